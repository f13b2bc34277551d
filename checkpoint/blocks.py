"""Checksum blocks: a chunk's checksums cover blocks of its bytes, so a reader verifies what it reads.

A chunk of ``nbytes`` bytes is checksummed in consecutive blocks of ``block_bytes`` (the last
one shorter): block ``i`` covers the chunk's bytes ``[i * block_bytes, min((i + 1) *
block_bytes, nbytes))``, and its XXH3-64 is the chunk record's ``xxh3_64[i]``. A rank that
needs some rows of a chunk (a checkpoint saved in column blocks, loaded in row blocks) hashes
only the blocks those rows lie in, not the whole chunk: its share of the checksum work, like its
share of the reads, stays near its own shard.

Example: a chunk of 512 rows of 1 KB (512 KB) has blocks of 64 KB (64 rows); a rank loading
rows 128..255 of it verifies blocks 2 and 3 (128 KB), where one checksum for the chunk made it
hash all 512 KB.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

__all__ = ["block_bytes", "block_checksums", "touched_blocks"]

#: the largest block: a rank reading a few rows hashes at most about this much more than it
#: needs at each end of its rows
MAX_BLOCK = 1 << 20
#: the smallest block: per block the metadata holds 19 bytes (its checksum as a JSON string) and
#: a reader makes one hash call, both negligible against 64 KB (0.03% of its bytes; one call's
#: fixed cost beside hashing 64 KB)
MIN_BLOCK = 64 << 10
#: blocks a chunk is cut into, where that keeps them within [MIN_BLOCK, MAX_BLOCK]: enough that
#: a reader taking 1/n of a chunk's rows (n ranks resharding) hashes about 1/n + 1/16 of it
PER_CHUNK = 16
#: beyond this many contiguous runs of a chunk (a thin column strip of a tall chunk), a reader
#: marks the blocks spanned by groups of runs instead of each run (more blocks, fewer steps)
MAX_RUNS = 4096


def block_bytes(nbytes: int) -> int:
    """The block size for a chunk of ``nbytes``: a power of two near ``nbytes / 16``, within
    [64 KiB, 1 MiB] (so a chunk of at most 64 KiB is one block)."""
    want = max(1, -(-nbytes // PER_CHUNK))
    return min(MAX_BLOCK, max(MIN_BLOCK, 1 << (want - 1).bit_length()))


def block_checksums(data: Any, block: int, checksum: Any) -> list[str]:
    """``checksum`` of each ``block``-byte block of the contiguous array ``data``."""
    raw = memoryview(data).cast("B") if data.nbytes else memoryview(b"")
    return [checksum(raw[i:i + block]) for i in range(0, len(raw), block)]


def touched_blocks(lengths: Sequence[int], lo: Sequence[int], hi: Sequence[int], itemsize: int, block: int,
                   nblocks: int) -> np.ndarray:
    """Which blocks of a C-order chunk of shape ``lengths`` hold elements of its sub-box
    ``[lo, hi)`` (chunk coordinates), as a bool array of ``nblocks``; a superset where the
    sub-box is more than :data:`MAX_RUNS` separate runs."""
    ndim = len(lengths)
    if ndim == 0:
        return np.ones(nblocks, bool)
    strides = [math.prod(lengths[k + 1:]) for k in range(ndim)]
    j = ndim - 1  # the axes after j are whole: the sub-box is one contiguous run per index of the axes before j
    while j > 0 and lo[j] == 0 and hi[j] == lengths[j]:
        j -= 1
    while j > 0 and math.prod(hi[k] - lo[k] for k in range(j)) > MAX_RUNS:
        j -= 1  # each run now spans from its first element to its last (holes included)
    base = np.zeros(1, np.int64)
    for k in range(j):
        base = (base[:, None] + np.arange(lo[k], hi[k], dtype=np.int64) * strides[k]).ravel()
    first = sum(lo[k] * strides[k] for k in range(j, ndim))
    last = sum((hi[k] - 1) * strides[k] for k in range(j, ndim))
    diff = np.zeros(nblocks + 1, np.int64)
    np.add.at(diff, (base + first) * itemsize // block, 1)
    np.add.at(diff, ((base + last + 1) * itemsize - 1) // block + 1, -1)
    return np.cumsum(diff[:-1]) > 0
