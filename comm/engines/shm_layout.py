"""The shared-memory engine's arithmetic: where each rank's flags, header and data slots lie in the
segment, how a buffer is cut into chunks, and which slice of a chunk each rank reduces.

Pure functions of integers (no MPI, no segment), so that tests check them in-process.

The segment (one per group, :mod:`~meshkit.comm.engines.shm_segment`)::

    [ control: n ranks x CONTROL_BYTES ][ data: n ranks x 2 buffers x chunk_bytes ]

Each rank's control block is :data:`CONTROL_WORDS` int64 words: its *post* flag (word 0), its
*reduced* flag (word :data:`RED`, on another cache line, so that a rank spinning on one flag does
not pull the line another rank writes the other flag into) and beside it its *done* flag
(:data:`DONE`), the address of the array a call lets its peers read and write directly (words :data:`ADDRESS` and ``ADDRESS + 1``, one per parity of the call's
step, written before the post flag; shm_cma.py), its pid and pid namespace (for the
liveness check), and two call headers (the call's kind, element count, reduce op, root and dtype
name), one per parity of the step that starts the call: a rank may post the next call's header
while another still compares the current one, never the one after (see shm_collectives.py).
"""

from __future__ import annotations

__all__ = ["CONTROL_WORDS", "CONTROL_BYTES", "POST", "ADDRESS", "RED", "DONE", "PID", "PIDNS", "HEADER", "HEADER_WORDS", "ALIGN_BYTES",
           "segment_bytes", "data_offset", "chunks", "slice_of", "check_chunk_bytes"]

#: int64 words of one rank's control block (256 bytes: four cache lines).
CONTROL_WORDS = 32
CONTROL_BYTES = CONTROL_WORDS * 8
#: Word indices in a control block: the post flag, the two address words (on the post flag's line:
#: written by its rank only, before the flag), the reduced flag (its own cache line), the pid and the
#: pid namespace's inode, and the first word of the two call headers.
POST, ADDRESS, RED, PID, PIDNS, HEADER = 0, 1, 8, 16, 17, 20
#: The *done* flag (on the reduced flag's line, written by its rank only): the last step of an
#: all_reduce through the segment whose peers' buffers this rank finished reading, so that the next
#: one may write the buffers the last one used, while they are still in the cache (shm_collectives.py).
DONE = 12
#: Words of one call header: kind, count, reduce op, root, dtype name (two words, 16 bytes).
HEADER_WORDS = 6
#: Slices and chunks start on a cache line (64 bytes): two ranks never write one line.
ALIGN_BYTES = 64


def check_chunk_bytes(chunk_bytes: int) -> int:
    """``chunk_bytes`` if it is a positive multiple of :data:`ALIGN_BYTES`, else ValueError."""
    if chunk_bytes <= 0 or chunk_bytes % ALIGN_BYTES:
        raise ValueError(f"chunk_bytes={chunk_bytes} is not a positive multiple of {ALIGN_BYTES}")
    return chunk_bytes


def segment_bytes(n: int, chunk_bytes: int) -> int:
    """The size of the segment of a group of ``n`` ranks: control blocks, then two buffers per rank."""
    return n * CONTROL_BYTES + 2 * n * check_chunk_bytes(chunk_bytes)


def data_offset(n: int, chunk_bytes: int, rank: int, buffer: int) -> int:
    """Where rank ``rank``'s buffer ``buffer`` (0 or 1: the step's parity) starts in the segment."""
    return n * CONTROL_BYTES + (2 * rank + buffer) * chunk_bytes


def chunks(count: int, per_chunk: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each chunk of ``count`` elements, ``per_chunk`` at most each; one
    empty chunk for ``count == 0`` (every rank still meets once, so a mismatch is still seen).

    Example: ``chunks(10, 4) == [(0, 4), (4, 4), (8, 2)]``.
    """
    if per_chunk <= 0:
        raise ValueError(f"per_chunk={per_chunk} must be positive")
    if count == 0:
        return [(0, 0)]
    return [(a, min(per_chunk, count - a)) for a in range(0, count, per_chunk)]


def slice_of(length: int, n: int, rank: int, itemsize: int) -> tuple[int, int]:
    """``[lo, hi)``: the elements of a chunk of ``length`` that rank ``rank`` of ``n`` reduces.

    Slices are equal and start on a cache line (:data:`ALIGN_BYTES`), the last ones shorter or
    empty; together they cover the chunk exactly once (tests/test_shm_layout.py).

    Example: ``[slice_of(100, 3, r, 8) for r in range(3)] == [(0, 40), (40, 80), (80, 100)]``.
    """
    align = max(1, ALIGN_BYTES // itemsize)
    per = -(-length // n)  # ceil
    per = -(-per // align) * align
    lo = min(length, rank * per)
    return lo, min(length, lo + per)
