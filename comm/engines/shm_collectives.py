"""The collectives over a group's shared-memory segment: flags instead of barriers, a fixed
reduction order, double buffering.

The algorithm is DeepSpeed's CPU all-reduce (csrc/cpu/comm/shm.cpp), which gloo adopted: every
rank has two data buffers of ``chunk_bytes`` in the segment (:mod:`~meshkit.comm.engines.shm_layout`)
and two flags, *post* and *reduced*, each a step number. A buffer is cut into chunks; each chunk
is one *step* of a counter every rank keeps in lockstep (the same calls in the same order), and
uses the rank's buffer ``step % 2``:

all_reduce (and reduce), chunks of more than ``small_bytes`` (two meetings per chunk)
    rank ``r`` copies into its buffer every slice (:func:`~meshkit.comm.engines.shm_layout.slice_of`)
    of its chunk but slice ``r``, and posts ``step``; once every rank posted, it reduces slice ``r``
    of every rank **in rank order** (``((b0 + b1) + b2) + ...``; its own part read from its array)
    into slice ``r`` of its own buffer, which it left free, sets its reduced flag and copies the
    result into its array; once every rank has, it copies each other slice out of its owner's buffer.
all_reduce (and reduce), chunks of at most ``small_bytes`` (one meeting)
    each rank copies in and posts; once every rank posted, each reduces the whole chunk itself,
    in the same rank order, from the buffers into its own array.
all_reduce (and reduce) by cross-memory attach (where :meth:`Channel.attach_directly` was called)
    no chunks and no segment data: each rank posts its array's address and meets; rank ``r`` reads
    slice ``r`` of the others' arrays (``process_vm_readv``) in pieces of ``direct_bytes`` into its
    scratch, reduces each piece in rank order while it is in the core's L2, and writes it into
    their arrays (``process_vm_writev``) while it is still there, then posts its reduced flag; once
    every rank has, every array holds the result (:meth:`Channel._all_reduce_direct`).
reduce_scatter
    each rank copies in its chunk of every other rank's block; rank ``r`` reduces block ``r`` of
    every buffer (its own read from its input), in rank order, straight into its output; by
    cross-memory attach, rank ``r`` reads block ``r`` of the others' inputs piece by piece into its
    scratch and reduces each piece there (:meth:`Channel._reduce_scatter_direct`).
all_gather, broadcast
    each rank (the root) copies in; once every rank posted, each copies every rank's (the root's)
    buffer out; by cross-memory attach, each reads the others' (the root's) arrays directly (taken
    only from ``MESHKIT_SHM_MOVE_MIN_BYTES``, by default never: MPICH already moves a large message
    with one copy; docs/collectives.md).

Every rank computes each element from the same inputs in the same order, so every rank holds
bitwise the same result and a run repeats bit for bit, whatever the timing.

Why no barrier is needed: a rank writes its buffer ``step % 2`` only at step ``s + 2``, after it
saw every rank post ``s + 1``; a rank posts ``s + 1`` only after it finished reading everything
of step ``s``. Slice ``r`` of rank ``r``'s buffer, written at the reduce of step ``s``, is written
after every rank posted ``s`` (so finished step ``s - 1``, and step ``s - 2`` in the same buffer),
and read by the others only after rank ``r``'s reduced flag. One exception keeps the cache warm: an
all_reduce, reduce_scatter or all_gather through the segment right after one of those (the same
on every rank: the same calls in the same order) skips a step, so that its first chunk takes the
buffers the last chunk of the one before used, which are the ones still in the cache (taking the
other parity, one call in two, cost 50-80 us of a 4 MiB all_reduce at 2 ranks); each rank posts a
*done* flag with the step at the end of such a call, once it read everything of it, and the next
call writes only once every rank's done flag is there (:meth:`Channel._warm`). A broadcast keeps
the parity: one rank writes what the others only read, and writing the lines they had just read
made a 4 MiB broadcast 1.6x slower. By cross-memory attach, a rank reads
and writes another's array only between the call's two meetings, while that rank is inside the
call: the array is alive at the posted address, and changes only by the slices the others write,
each of which only its writer reads.
The call header (kind, count, dtype, reduce op, root) is written before the first step's post
flag, in the header slot of that step's parity, and compared by every rank once every rank
posted: all of them see the same headers, so a mismatched call raises
:class:`~meshkit.comm.engines.engine.CallsDiffer` on every rank at once, before any data is read.

**Memory ordering.** The flags are aligned 8-byte words written and read through a
``memoryview`` cast to ``q`` (one 8-byte ``memcpy``, which compilers emit as one ``mov``: atomic
on x86 when aligned). The path relies on x86-TSO: a rank's stores become visible to the others
in program order (the data, then the flag), and loads are not reordered with older loads (the
flag, then the data). NumPy's copies and ufuncs issue their stores in program order before the
flag's (CPython does not reorder statements), and glibc's ``memcpy`` ends its non-temporal
stores (used only for copies larger than a fraction of the last-level cache) with ``sfence``.
Weaker memory models (ARM, POWER) would need fences: the engine uses the path only on x86-64
(:func:`~meshkit.comm.engines.shm.supported`).

**Waiting.** A collective is a generator that yields whenever a flag it needs has not come:
``Test()`` runs it until it yields or ends, so a caller's wait, and the progress agent for an
``async_op`` call, drive it exactly as they drive MPI's requests (the wait spins, then yields the
core with ``os.sched_yield``, bounded by the group's timeout). While it waits it knows which
ranks' flags are missing (:attr:`ShmRequest.missing`: a timeout names them) and, every
:data:`LIVENESS_INTERVAL`, whether those ranks' processes still exist: a dead rank makes every
waiting peer raise :class:`~meshkit.comm.errors.RankFailedError` naming it, not spin. At the same
moments it calls the channel's :attr:`Channel.abandoned` hook where the engine set one (under
``meshkit-run --survive``: whether a survivor revoked the group's MPI communicator, so a rank
waiting for a live peer that left for the recovery wakes too; comm/engines/shm.py).
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any, Callable, Generator, Iterator, cast

import numpy as np

from ..debug import Call
from ..errors import DistBackendError, RankFailedError
from ..reduce_op import ReduceOp, combine, combine_into
from .engine import CallsDiffer
from .shm_cma import Transfer
from .shm_layout import (ADDRESS, CONTROL_WORDS, DONE, HEADER, HEADER_WORDS, PID, PIDNS, POST, RED, chunks,
                         data_offset, slice_of)

__all__ = ["Channel", "Stepped", "ShmRequest", "KINDS", "LIVENESS_INTERVAL"]

#: The collectives this path runs, as the header's kind (index + 1; 0: no header yet).
KINDS = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_reduce of a shared buffer",
         "all_gather into a shared buffer", "reduce_scatter of a shared buffer")
_REDUCE_OPS = tuple(ReduceOp)
#: Seconds between looks at whether the ranks a wait is missing still live (``os.kill(pid, 0)``):
#: a dead rank is found within this, and a look costs a system call per missing rank.
LIVENESS_INTERVAL = 0.05
#: Polls between reads of the clock while waiting for a flag (a read of ``time.monotonic`` costs
#: as much as a poll).
_POLLS_PER_CLOCK = 64

Steps = Generator[None, None, None]
#: Dtypes whose items hold padding (x87's 80-bit long double in 16 bytes): a ufunc writes the value's
#: bytes only, so a result reduced straight into a rank's array would keep that rank's padding.
_PADDED = frozenset(np.dtype(t) for t in (np.longdouble, np.clongdouble)
                    if np.finfo(np.longdouble).nmant + np.finfo(np.longdouble).nexp + 1
                    < 8 * np.dtype(np.longdouble).itemsize)


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where unknown): pids compare only within one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


@functools.lru_cache(maxsize=256)
def _name_words(dtype: np.dtype) -> tuple[int, int]:
    """``dtype``'s name as two header words (kept: NumPy computes a dtype's name in Python, some
    microseconds a call)."""
    raw = dtype.name.encode("ascii", "replace")[:16].ljust(16, b"\0")
    return int.from_bytes(raw[:8], "little", signed=True), int.from_bytes(raw[8:], "little", signed=True)


def _name_of(words: tuple[int, int]) -> str:
    raw = b"".join(w.to_bytes(8, "little", signed=True) for w in words)
    return raw.rstrip(b"\0").decode("ascii", "replace")


class Channel:
    """One rank's view of a group's segment: its flags, headers and buffers, and the step counter.

    Args:
        memory: the mapped segment (:class:`~meshkit.comm.engines.shm_segment.Segment`'s ``memory``).
        n, rank: the group's size and this rank's group rank.
        chunk_bytes: bytes of each data buffer.
        small_bytes: a reduction of at most this many bytes per chunk meets once (each rank reduces
            the whole chunk) instead of twice (each reduces its slice).
        world_ranks: each group rank's global rank (errors name global ranks).
    """

    def __init__(self, memory: Any, n: int, rank: int, chunk_bytes: int, small_bytes: int,
                 world_ranks: list[int]) -> None:
        self.memory, self.n, self.rank = memory, n, rank
        self.chunk_bytes, self.small_bytes, self.world_ranks = chunk_bytes, small_bytes, world_ranks
        self.words = memoryview(memory).cast("B").cast("q")  # the control blocks' int64 words
        self.step = 0  # the last step this rank started (the same on every rank, call after call)
        self.pid = os.getpid()
        self.pidns = pid_namespace()
        self._bases = [[data_offset(n, chunk_bytes, r, b) for b in (0, 1)] for r in range(n)]
        self._posts = [r * CONTROL_WORDS + POST for r in range(n)]
        self._reds = [r * CONTROL_WORDS + RED for r in range(n)]
        self._dones = [r * CONTROL_WORDS + DONE for r in range(n)]
        #: the last step of a call through the segment's buffers that posted its done flag: where
        #: the next step is the next call's, that call takes the same buffers (see _warm)
        self.done_step = -1
        #: whether that call takes the same buffers (MESHKIT_SHM_REUSE; the same on every rank)
        self.reuse = True
        me = rank * CONTROL_WORDS
        self.words[me + PID], self.words[me + PIDNS] = self.pid, self.pidns
        #: cross-memory attach (shm_cma.py), once :meth:`attach_directly` was called: each rank's pid,
        #: and one scratch slot of ``direct_bytes`` per rank (peers' parts read in, the accumulator)
        self.direct: Transfer | None = None
        self.pids: list[int] = []
        self.direct_bytes = 0
        #: ordinary buffers of at most this many bytes copy through the segment although attach is
        #: on (shm.py sets it where attach measured dearer on this host); 0: attach above small_bytes
        self.attach_above = 0
        #: the kernel's copy over a user-space copy as measured at creation (None: not measured)
        self.attach_ratio: float | None = None
        self._scratch = np.empty(0, np.uint8)
        #: Called every LIVENESS_INTERVAL while a wait misses a flag (never when nothing waits); it
        #: raises to end the wait (a RankFailedError), or returns. None: no hook.
        self.abandoned: Callable[[], None] | None = None

    def attach_directly(self, pids: list[int], scratch_bytes: int) -> None:
        """Let ordinary buffers of more than ``small_bytes`` move between the ranks' own arrays with
        ``process_vm_readv``/``writev`` (every rank of the group calls it, once :func:`shm_cma.probe`
        succeeded on all): ``pids[r]`` rank r's process; ``scratch_bytes`` (a multiple of 64) the
        piece reduced at a time, in this rank's cache."""
        self.direct, self.pids, self.direct_bytes = Transfer(), list(pids), scratch_bytes
        self._scratch = np.empty(self.n * scratch_bytes, np.uint8)

    def goes_direct(self, nbytes: int) -> bool:
        """Whether an ordinary buffer of ``nbytes`` moves by cross-memory attach (the same on every rank)."""
        return self.direct is not None and nbytes > self.small_bytes and nbytes > self.attach_above

    def reduces_direct(self, nbytes: int) -> bool:
        """Whether an ordinary all_reduce or reduce of ``nbytes`` goes by cross-memory attach: above half of
        ``small_bytes``, where the one-meeting path (shm_small.py) stops taking all_reduces; between the
        two the chunk's meeting through the segment took 1.3-1.6x the direct path's time (2026-11-29,
        quiet, 2 ranks, 1 MiB: 401 us against 167-250; docs/collectives.md)."""
        return self.direct is not None and nbytes > self.small_bytes // 2 and nbytes > self.attach_above

    def close(self) -> None:
        self.words.release()

    # ----------------------------------------------------------------- the segment's parts
    def buffer(self, rank: int, parity: int, dtype: np.dtype, count: int) -> np.ndarray:
        """Rank ``rank``'s buffer ``parity`` as ``count`` elements of ``dtype``."""
        return np.frombuffer(self.memory, dtype, count, self._bases[rank][parity])

    def _header(self, kind: int, count: int, op: ReduceOp | None, root: int, dtype: np.dtype) -> tuple[int, ...]:
        return (kind, count, 0 if op is None else _REDUCE_OPS.index(op) + 1, root, *_name_words(dtype))

    def _write_header(self, step: int, header: tuple[int, ...]) -> None:
        at = self.rank * CONTROL_WORDS + HEADER + (step & 1) * HEADER_WORDS
        words = self.words
        for i, value in enumerate(header):
            words[at + i] = value

    def _read_header(self, rank: int, step: int) -> tuple[int, ...]:
        at = rank * CONTROL_WORDS + HEADER + (step & 1) * HEADER_WORDS
        return tuple(self.words[at:at + HEADER_WORDS])

    def _call(self, header: tuple[int, ...]) -> Call:
        kind, count, op, root, *name = header
        what = KINDS[kind - 1] if 0 < kind <= len(KINDS) else f"unknown call {kind}"
        return Call(what, _name_of((name[0], name[1])), (count,), None if op == 0 else _REDUCE_OPS[op - 1].name,
                    None if root < 0 or kind >= 6 else root)  # (kinds 6-8's root word: the place in the buffer)

    def _compare(self, step: int, mine: tuple[int, ...]) -> None:
        headers = [self._read_header(r, step) for r in range(self.n)]
        if any(h != mine for h in headers):  # every rank reads the same headers: all raise or none does
            raise CallsDiffer([(None, self._call(h)) for h in headers])

    # ----------------------------------------------------------------- flags and waiting
    def _post(self, step: int) -> None:
        self.words[self._posts[self.rank]] = step

    def _post_address(self, step: int, address: int) -> None:
        """Before the post flag of ``step``: the address of the array peers may read and write."""
        self.words[self._posts[self.rank] + ADDRESS + (step & 1)] = address

    def _addresses(self, step: int) -> list[int]:
        """Every rank's posted address for ``step`` (read once every rank posted it)."""
        words, at = self.words, ADDRESS + (step & 1)
        return [words[post + at] for post in self._posts]

    def _moved(self, rank: int, what: str, exc: OSError) -> BaseException:
        """The error for a failed cross-memory copy with ``rank``: its death, else the copy's own."""
        who = self.world_ranks[rank]
        pid = self.pids[rank]
        me = self.world_ranks[self.rank]
        if not _alive(pid):
            return RankFailedError(f"meshkit.comm: rank {me}: {what} over shared memory cannot complete: rank {who} "
                                   f"(pid {pid}) died during it")
        return DistBackendError(f"meshkit.comm: rank {me}: {what} over shared memory: a direct copy with rank {who} "
                                f"failed: {exc}; MESHKIT_SHM_CMA=0 copies through the segment instead")

    def _read(self, rank: int, address: int, into: np.ndarray, what: str) -> None:
        try:
            self.direct.read(self.pids[rank], address, into)  # type: ignore[union-attr]
        except OSError as exc:
            raise self._moved(rank, what, exc) from exc

    def _scratches(self, dtype: np.dtype) -> tuple[list[np.ndarray], int]:
        """One scratch array per rank of ``dtype`` (``direct_bytes`` each) and its element count."""
        per = self.direct_bytes // dtype.itemsize
        return [np.frombuffer(self._scratch, dtype, per, r * self.direct_bytes) for r in range(self.n)], per

    def _scratch_addresses(self) -> list[int]:
        """The address of each rank's scratch slot (:meth:`_scratches`)."""
        base = self._scratch.ctypes.data
        return [base + r * self.direct_bytes for r in range(self.n)]

    def _transfer_parts(self) -> tuple[Any, Any, Any, list[int]]:
        """``(move, reader, writer, pids)`` of the cross-memory transfer, for a loop over pieces."""
        transfer = cast(Transfer, self.direct)  # (called only where attach_directly was)
        return transfer.move, transfer.reader, transfer.writer, self.pids

    def _reduced(self, step: int) -> None:
        self.words[self._reds[self.rank]] = step

    def _warm(self, request: ShmRequest) -> Steps:
        """At the start of a call through the segment's buffers: where the call before was one too
        (it posted its done flag: the same on every rank), skip one step, so that this call's first
        chunk takes the buffers the last chunk of that one used, the ones in the cache, and yield
        until every rank has posted that it finished reading them (not only the step after them)."""
        last = self.step
        if self.done_step == last and self.reuse:
            self.step = last + 1
            yield from self._wait(request, self._dones, last)

    def _read_out(self) -> None:
        """At the end of a call through the segment's buffers: this rank read everything of its last
        step (the done flag), so the next such call may write those buffers again (:meth:`_warm`)."""
        self.words[self._dones[self.rank]] = self.done_step = self.step

    def _meet(self, request: ShmRequest, step: int, header: tuple[int, ...] | None) -> Steps:
        """Post this rank's flag for ``step`` and yield until every rank's came; at a call's first
        meeting (``header`` given) the call's header is written before and compared after, so ranks
        whose calls differ all raise there."""
        if header is not None:
            self._write_header(step, header)
        self._post(step)
        yield from self._wait(request, self._posts, step)
        if header is not None:
            self._compare(step, header)

    def _wait(self, request: ShmRequest, flags: list[int], step: int) -> Steps:
        """Yield until every rank's flag (word index in ``flags``) reached ``step``."""
        words = self.words
        polls = 0
        while True:
            missing = [r for r, at in enumerate(flags) if words[at] < step]
            if not missing:
                request.missing_ranks = ()
                return
            request.missing_ranks = missing
            polls += 1
            if polls % _POLLS_PER_CLOCK == 0:
                self._check_alive(request, missing)
            yield

    def _check_alive(self, request: ShmRequest, missing: list[int]) -> None:
        now = time.monotonic()
        if now - request.looked < LIVENESS_INTERVAL:
            return
        request.looked = now
        words = self.words
        for r in missing:
            pid, ns = words[r * CONTROL_WORDS + PID], words[r * CONTROL_WORDS + PIDNS]
            if pid <= 0 or ns != self.pidns or not ns:
                continue  # not attached yet, or another pid namespace: its pid means nothing here
            if not _alive(pid):
                raise RankFailedError(
                    f"meshkit.comm: rank {self.world_ranks[self.rank]}: {request.kind} over shared memory cannot "
                    f"complete: rank {self.world_ranks[r]} (pid {pid}) died before it arrived",
                    failed_ranks=(self.world_ranks[r],))
        if self.abandoned is not None:
            self.abandoned()

    # ----------------------------------------------------------------- the collectives (each a generator)
    def all_reduce(self, request: ShmRequest, buf: np.ndarray, op: ReduceOp, root: int = -1) -> Steps:
        """In place over ``buf`` (flat); ``root >= 0``: a reduce, only the root's ``buf`` written.

        A chunk of more than ``small_bytes``: rank r copies in every slice of its chunk but its own
        (slice r, which only it reduces, is read straight from its array), reduces slice r of every
        rank in rank order into the free slot of its buffer, posts its reduced flag, copies its result
        into its array, and copies the other slices' results out of their owners' buffers: per rank
        about two passes over the chunk instead of three (docs/collectives.md has the figures)."""
        flat, n, me = buf.reshape(-1), self.n, self.rank
        dtype = flat.dtype
        header = self._header(2 if root >= 0 else 1, flat.size, op, root, dtype)
        if self.reduces_direct(flat.nbytes):
            yield from self._all_reduce_direct(request, flat, op, root, header)
            return
        itemsize = dtype.itemsize
        per = max(1, self.chunk_bytes // itemsize)
        out = root < 0 or root == me
        first = True
        yield from self._warm(request)
        for start, length in chunks(flat.size, per):
            step = self.step = self.step + 1
            parity = step & 1
            part = flat[start:start + length]
            mine = self.buffer(me, parity, dtype, length)
            if length * itemsize <= self.small_bytes:  # one meeting: every rank reduces the whole chunk
                np.copyto(mine, part)
                yield from self._meet(request, step, header if first else None)
                first = False
                if out:
                    _reduce_into(op, part, [self.buffer(r, parity, dtype, length) for r in range(n)])
                continue
            lo, hi = slice_of(length, n, me, itemsize)
            if lo:
                np.copyto(mine[:lo], part[:lo])
            if hi < length:
                np.copyto(mine[hi:], part[hi:])
            yield from self._meet(request, step, header if first else None)
            first = False
            bufs = [self.buffer(r, parity, dtype, length) for r in range(n)]
            _reduce_into(op, mine[lo:hi], [part[lo:hi] if r == me else bufs[r][lo:hi] for r in range(n)])
            self._reduced(step)
            if out:
                np.copyto(part[lo:hi], mine[lo:hi])  # (while the others still reduce)
                yield from self._wait(request, self._reds, step)
                for r in range(n):
                    if r != me:
                        a, b = slice_of(length, n, r, itemsize)
                        np.copyto(part[a:b], bufs[r][a:b])
        self._read_out()

    def _all_reduce_direct(self, request: ShmRequest, flat: np.ndarray, op: ReduceOp, root: int,
                           header: tuple[int, ...]) -> Steps:
        """All-reduce (reduce: ``root >= 0``) between the ranks' own arrays, with no copy through the
        segment: every rank posts its array's address and meets; rank r then, piece by piece
        (``direct_bytes``), reads slice r of every other rank's array into its scratch, reduces the
        slice in rank order (into its own array, or its scratch where its array is an input the
        order reads later), and writes the result into every other rank's array (the root's only)
        while it is still in this core's cache; it posts its reduced flag and returns once every rank
        has, so nobody's array changes while another reads it. Per rank: one read of the others'
        slice, the reduce, one write: 1.2-1.4 copies' time at 2 ranks, where the segment's path is
        2.2 (docs/collectives.md has the phases)."""
        n, me, what = self.n, self.rank, KINDS[header[0] - 1]
        dtype, itemsize = flat.dtype, flat.dtype.itemsize
        step = self.step = self.step + 1
        base = flat.ctypes.data
        self._post_address(step, base)
        yield from self._meet(request, step, header)
        addresses = self._addresses(step)
        out = root < 0 or root == me
        peers = [r for r in range(n) if r != me]
        targets = [r for r in peers if root < 0 or r == root]
        # the accumulator may be this rank's own piece where the order reads it first (rank 0) or
        # second (rank 1: the first step reads both before it writes), unless padding bytes would
        # come from this rank (x87 long double: the result's padding is rank 0's)
        in_place = out and (me == 0 or (me == 1 and dtype not in _PADDED))
        scratch, per = self._scratches(dtype)
        at = self._scratch_addresses()
        lo, hi = slice_of(flat.size, n, me, itemsize)
        move, read, write, pids = self._transfer_parts()
        r = me
        try:
            for start in range(lo, hi, per):
                length = min(hi, start + per) - start
                offset, nbytes = start * itemsize, length * itemsize
                for r in peers:  # (addresses, not arrays: a piece costs two kernel calls, little else)
                    move(read, pids[r], addresses[r] + offset, at[r], nbytes)
                own = flat[start:start + length]
                acc = own if in_place else scratch[me][:length]
                _reduce_into(op, acc, [own if q == me else scratch[q][:length] for q in range(n)])
                if out and not in_place:
                    np.copyto(own, acc)
                source = base + offset if in_place else at[me]
                for r in targets:
                    move(write, pids[r], addresses[r] + offset, source, nbytes)
        except OSError as exc:
            raise self._moved(r, what, exc) from exc
        self._reduced(step)
        yield from self._wait(request, self._reds, step)

    def _reduce_scatter_direct(self, request: ShmRequest, dst: np.ndarray, src: np.ndarray, op: ReduceOp,
                               header: tuple[int, ...]) -> Steps:
        """Reduce-scatter between the ranks' own arrays (``src`` n x m, ``dst`` m): every rank posts its
        input's address and meets; rank r then, piece by piece (``direct_bytes``), reads block r of
        every other rank's input into its scratch and reduces it with its own block, in rank order,
        into ``dst`` while the pieces are in this core's cache; a second meeting keeps every input
        unchanged until all have read. Per rank: one read of the others' block and the reduce, with
        no copy in (the segment's path copies every other block in, and its reduce reads them from
        memory another core wrote: docs/collectives.md).

        ``dst`` may be this rank's own block of ``src`` (torch's in-place form): peers never read it. Any
        other overlap with ``src`` is reduced aside and copied into ``dst`` after the second meeting,
        once no peer reads ``src`` any more."""
        n, me, what = self.n, self.rank, KINDS[header[0] - 1]
        m, dtype, itemsize = dst.size, dst.dtype, dst.dtype.itemsize
        step = self.step = self.step + 1
        self._post_address(step, src.ctypes.data)
        yield from self._meet(request, step, header)
        addresses = self._addresses(step)
        own_block = src[me]
        aside = None
        if np.may_share_memory(dst, src) and dst.ctypes.data != own_block.ctypes.data:
            aside = np.empty_like(dst)  # (a rare overlap: the result waits until no peer reads src)
        result = dst if aside is None else aside
        # the accumulator may be the output where it is not this rank's input, or is its own block and
        # the order reads that block first (rank 0) or second (rank 1), as in _all_reduce_direct
        overlapping = aside is None and dst.ctypes.data == own_block.ctypes.data
        straight = not overlapping or me == 0 or (me == 1 and dtype not in _PADDED)
        scratch, per = self._scratches(dtype)
        at = self._scratch_addresses()
        move, read, _, pids = self._transfer_parts()
        block = me * m * itemsize
        r = me
        try:
            for start in range(0, m, per):
                length = min(m, start + per) - start
                offset, nbytes = block + start * itemsize, length * itemsize
                for r in range(n):
                    if r != me:
                        move(read, pids[r], addresses[r] + offset, at[r], nbytes)
                target = result[start:start + length]
                acc = target if straight else scratch[me][:length]
                _reduce_into(op, acc, [own_block[start:start + length] if q == me else scratch[q][:length]
                                       for q in range(n)])
                if acc is not target:
                    np.copyto(target, acc)
        except OSError as exc:
            raise self._moved(r, what, exc) from exc
        self._reduced(step)
        yield from self._wait(request, self._reds, step)
        if aside is not None:
            np.copyto(dst, aside)

    def all_reduce_in_place(self, request: ShmRequest, views: list[np.ndarray], op: ReduceOp, offset: int) -> Steps:
        """All-reduce of arrays that already lie in the segment of a shared buffer, ``views[r]``
        rank r's (at the same place in every rank's region, which the header's root word carries):
        no copy in or out. Rank ``r`` reduces its slice of every rank's array in rank order into rank
        0's, copies it into every other rank's, and posts its reduced flag; once every rank has,
        every array holds the result (two meetings, one step)."""
        n, me = self.n, self.rank
        mine = views[me]
        header = self._header(6, mine.size, op, offset, mine.dtype)
        step = self.step = self.step + 1
        yield from self._meet(request, step, header)
        lo, hi = slice_of(mine.size, n, me, mine.dtype.itemsize)
        acc = views[0][lo:hi]
        for other in views[1:]:
            combine_into(op, acc, other[lo:hi])
        for other in views[1:]:
            np.copyto(other[lo:hi], acc)
        self._reduced(step)
        yield from self._wait(request, self._reds, step)

    def all_gather_in_place(self, request: ShmRequest, outs: list[np.ndarray], inp: np.ndarray, offset: int) -> Steps:
        """All-gather into arrays that lie in a shared buffer, ``outs[r]`` rank r's (n x m elements, at
        the same place on every rank): this rank's block is written once (unless ``inp`` is it), then
        each rank copies every other block straight from its owner's array; a second meeting keeps
        each owner's block unchanged until every rank has read it."""
        n, me = self.n, self.rank
        src, mine = inp.reshape(-1), outs[me].reshape(n, -1)
        m = src.size
        header = self._header(7, m, None, offset, src.dtype)
        step = self.step = self.step + 1
        if src.ctypes.data != mine[me].ctypes.data:
            np.copyto(mine[me], src)
        yield from self._meet(request, step, header)
        for r in range(n):
            if r != me:
                np.copyto(mine[r], outs[r].reshape(n, -1)[r])
        self._reduced(step)
        yield from self._wait(request, self._reds, step)

    def reduce_scatter_in_place(self, request: ShmRequest, out: np.ndarray, ins: list[np.ndarray], op: ReduceOp,
                                offset: int) -> Steps:
        """Reduce-scatter of arrays that lie in a shared buffer, ``ins[r]`` rank r's (n x m elements, at
        the same place on every rank): rank r reduces block r of every rank's array in rank order
        straight into ``out``, with no copy in; a second meeting keeps the inputs unchanged until
        every rank has read them."""
        n, me = self.n, self.rank
        dst = out.reshape(-1)
        header = self._header(8, dst.size, op, offset, dst.dtype)
        step = self.step = self.step + 1
        yield from self._meet(request, step, header)
        parts = [a.reshape(n, -1)[me] for a in ins]
        if np.may_share_memory(dst, ins[me]):  # out is (in) this rank's own input: reduce aside first
            result = np.empty_like(dst)
            _reduce_into(op, result, parts)
            np.copyto(dst, result)
        else:
            _reduce_into(op, dst, parts)
        self._reduced(step)
        yield from self._wait(request, self._reds, step)

    def reduce_scatter(self, request: ShmRequest, out: np.ndarray, inp: np.ndarray, op: ReduceOp) -> Steps:
        """Rank r's ``out`` (m elements) = the reduction of every rank's block r of ``inp`` (n x m)."""
        n, me = self.n, self.rank
        dst, src = out.reshape(-1), inp.reshape(n, -1)
        m, dtype = dst.size, dst.dtype
        header = self._header(5, m, op, -1, dtype)
        if self.goes_direct(src.nbytes):
            yield from self._reduce_scatter_direct(request, dst, src, op, header)
            return
        per = max(1, self.chunk_bytes // dtype.itemsize // n)
        # this rank's own block is read straight from its input, unless the output overlaps the input
        # (then a reduction in rank order could overwrite it before reading it: copied in as the others)
        direct = not np.may_share_memory(dst, src)
        first = True
        yield from self._warm(request)
        for start, length in chunks(m, per):
            step = self.step = self.step + 1
            parity = step & 1
            mine = self.buffer(me, parity, dtype, n * length).reshape(n, length)
            for r in range(n):
                if r != me or not direct:
                    np.copyto(mine[r], src[r, start:start + length])
            yield from self._meet(request, step, header if first else None)
            first = False
            blocks = [src[me, start:start + length] if r == me and direct else
                      self.buffer(r, parity, dtype, n * length)[me * length:(me + 1) * length] for r in range(n)]
            _reduce_into(op, dst[start:start + length], blocks)
        self._read_out()

    def _move_direct(self, request: ShmRequest, header: tuple[int, ...], address: int,
                     reads: list[tuple[int, int, np.ndarray]]) -> Steps:
        """all_gather and broadcast between the ranks' own arrays: post ``address`` (what the peers
        read here), meet, read each ``(rank, offset, into)`` from that rank's posted address plus
        ``offset`` bytes, and meet again (the sources stay unchanged until all have read)."""
        what = KINDS[header[0] - 1]
        step = self.step = self.step + 1
        self._post_address(step, address)
        yield from self._meet(request, step, header)
        addresses = self._addresses(step)
        for r, offset, into in reads:
            self._read(r, addresses[r] + offset, into, what)
        self._reduced(step)
        yield from self._wait(request, self._reds, step)

    def all_gather(self, request: ShmRequest, out: np.ndarray, inp: np.ndarray, own_chunk: bool) -> Steps:
        """``out`` (n x m) = every rank's ``inp`` (m), in rank order; ``own_chunk``: ``inp`` is
        this rank's block of ``out`` (gathered in place)."""
        n, me = self.n, self.rank
        src, dst = inp.reshape(-1), out.reshape(n, -1)
        m, dtype = src.size, src.dtype
        header = self._header(4, m, None, -1, dtype)
        if self.goes_direct(dst.nbytes):
            if not own_chunk:
                np.copyto(dst[me], src)
            yield from self._move_direct(request, header, src.ctypes.data, [(r, 0, dst[r]) for r in range(n) if r != me])
            return
        per = max(1, self.chunk_bytes // dtype.itemsize)
        first = True
        yield from self._warm(request)
        for start, length in chunks(m, per):
            step = self.step = self.step + 1
            parity = step & 1
            np.copyto(self.buffer(me, parity, dtype, length), src[start:start + length])
            if first:  # _meet's steps, with this rank's own copy done while the others post
                self._write_header(step, header)
            self._post(step)
            if not own_chunk:
                np.copyto(dst[me, start:start + length], src[start:start + length])
            yield from self._wait(request, self._posts, step)
            if first:
                self._compare(step, header)
                first = False
            for r in range(n):
                if r != me:
                    np.copyto(dst[r, start:start + length], self.buffer(r, parity, dtype, length))
        self._read_out()

    def broadcast(self, request: ShmRequest, buf: np.ndarray, root: int) -> Steps:
        """Root's ``buf`` into every rank's."""
        flat, me = buf.reshape(-1), self.rank
        dtype = flat.dtype
        header = self._header(3, flat.size, None, root, dtype)
        if self.goes_direct(flat.nbytes):
            yield from self._move_direct(request, header, flat.ctypes.data, [] if me == root else [(root, 0, flat)])
            return
        per = max(1, self.chunk_bytes // dtype.itemsize)
        first = True
        for start, length in chunks(flat.size, per):  # (the step's parity: taking the same buffers
            step = self.step = self.step + 1          # again made a 4 MiB broadcast 1.6x slower here)
            parity = step & 1
            if me == root:
                np.copyto(self.buffer(me, parity, dtype, length), flat[start:start + length])
            yield from self._meet(request, step, header if first else None)
            first = False
            if me != root:
                np.copyto(flat[start:start + length], self.buffer(root, parity, dtype, length))


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists (``kill(pid, 0)``) and is not a zombie (a rank killed
    but not yet reaped by its parent, the launcher's watcher, still answers ``kill``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: the pid was reused, so not our rank, but we cannot tell
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read(512).rpartition(b")")[2].split()[:1]
    except OSError:
        return True
    return state != [b"Z"]


def _reduce_into(op: ReduceOp, dst: np.ndarray, parts: list[np.ndarray]) -> None:
    """``dst = ((parts[0] op parts[1]) op parts[2]) ...``: the fixed rank order (the first step reads
    two parts and writes ``dst`` in one pass)."""
    if len(parts) == 1 or dst.dtype in _PADDED:  # (a copy first: the padding bytes are rank 0's too)
        np.copyto(dst, parts[0])
        for other in parts[1:]:
            combine_into(op, dst, other)
        return
    combine(op, parts[0], parts[1], dst)
    for other in parts[2:]:
        combine_into(op, dst, other)


class Stepped:
    """A request driven by a generator: ``Test()`` runs it to its next wait (False) or its end
    (True); an error it raised is raised again by every later ``Test``."""

    __slots__ = ("_steps", "_done", "_error")
    _steps: Iterator[None]
    _done: bool
    _error: BaseException | None

    def Test(self) -> bool:  # noqa: N802 (the Request protocol's name)
        if self._done:
            return True
        if self._error is not None:
            raise self._error
        try:
            next(self._steps)
        except StopIteration:
            self._done = True
            return True
        except BaseException as exc:
            self._error = exc
            raise
        return False


class ShmRequest(Stepped):
    """A collective over shared memory in progress: ``Test()`` runs it until it must wait for a
    flag (False) or it is done (True); an error it raised is raised again by every later ``Test``.

    Attributes:
        kind: the collective (``all_reduce``, ...), for messages.
        missing_ranks: the group ranks whose flag the collective waits for (empty when not waiting).
        path: ``"shm"``: the path the call took (the flight recorder's field).
    """

    __slots__ = ("kind", "missing_ranks", "looked")
    path = "shm"

    def __init__(self, kind: str, start: Callable[[ShmRequest], Iterator[None]]) -> None:
        self.kind = kind
        self.missing_ranks: list[int] | tuple[()] = ()
        self.looked = time.monotonic()
        self._done = False
        self._error: BaseException | None = None
        self._steps = start(self)
        self.Test()  # copy in and post at once: the others can go on while the caller computes

