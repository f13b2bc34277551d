"""The global save plan: who writes which box, each replicated box once (DCP's dedup planner).

Every rank describes what it holds; rank 0 alone checks the descriptions against each other and
decides, so planning is one gather and one scatter whatever the world size. A box held by
several ranks (DDP's parameters, a DTensor's Replicate copies, HSDP's replica shards) is written
by the holder that has been given the fewest bytes so far, spreading the writes.

Copies written once must be equal, as a value saved once must be: every holder of a replicated
leaf (a plain array, a DTensor's box over a ``Replicate`` mesh dim) sends the XXH3-64 of its
copy with its description, and copies that differ fail the save on every rank, naming the key
and which ranks hold which copy. The cost is one hash pass over the replicated bytes on each
holder (XXH3, a fast non-cryptographic hash; docs/checkpoints.md measures it). A
:class:`~meshkit.parallel.ShardedArray` marked ``replica`` (HSDP, a flat shard replicated over
tp) is its strategy's promise and is not described, hence not compared.

Every element in one box (:func:`tiling_problem`): the planner checks the ranks' pieces with it
before a save, the reader a checkpoint's chunks before a load; the chunks come from a file, so
the check must stay fast whatever the file says. A sweep that compared each box with the boxes still open along one axis
took 84 s for a crafted staircase of 8,000 chunks (1 MB of metadata: a 4000x4000 array's columns
cut in two at the diagonal, every lower half open to the far end of the sweep axis).

The exact check used here counts signed corners. On the array's elements ``x``, the indicator of
a box ``[a, b)`` is ``prod_k ([x_k >= a_k] - [x_k >= b_k])``; expanded, it is a sum of "upper
orthants" ``[x >= p]``, one per corner ``p`` (``a_k`` or ``b_k`` on each axis), signed by the
parity of the ``b`` coordinates taken; a corner with ``b_k`` equal to the array's length on an
axis is empty on the array and drops out. Orthants of distinct corners are linearly independent
(order the corners; each orthant is the first to hold its own corner), so the boxes' indicators
add up to the whole array's, which is the orthant at the origin, exactly when the corners' signs
add up to +1 at the origin and 0 everywhere else. That is "every element in exactly one box",
decided with ``2**c`` dictionary updates per box, where ``c`` is the number of axes on which the
box ends before the array does: 4 for a chunk of a 2-D array, whatever the boxes' arrangement.

A box cut on many axes has many corners (2**30 for a chunk of a 30-D array cut on every axis),
so where the corners would cost more than :data:`STEPS_PER_BOX` per box on average, the check
paints the grid the boxes' boundaries make instead (each cell must be covered once: 4096 unit
chunks of a 12-D array are 4096 cells), where that grid is as small; else it is the exact sweep,
along the axis where it compares the fewest pairs (counted first, by a sort per axis), up to
:data:`PAIRS` pairs; beyond all three, the boxes are refused as too costly to check. No
checkpoint meshkit writes comes near: its chunks are cut on the axes a DTensor is sharded on, a
flat shard's boxes and axis 0, and their grid is their number. The sweep also names two
overlapping boxes when the corners or the grid find that boxes do not tile.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
from collections import defaultdict
from typing import Any

import numpy as np
import xxhash

from ..comm._seams import to_host
from .errors import CheckpointError
from .leaves import ArrayLeaf

__all__ = ["Description", "describe", "make_plan", "Plan", "tiling_problem", "STEPS_PER_BOX", "PAIRS"]

Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclasses.dataclass
class Description:
    """What one rank holds: per array key ``(shape, dtype str, [box])`` (shape None: no piece
    here), the JSON values, and per replicated key the digest of each box's copy (in the order
    of its boxes)."""

    arrays: dict[str, tuple[tuple[int, ...] | None, str | None, list[Box]]]
    values: dict[str, Any]
    digests: dict[str, list[str]] = dataclasses.field(default_factory=dict)


def describe(arrays: dict[str, ArrayLeaf], values: dict[str, Any], *, digest_replicas: bool = True) -> Description:
    """This rank's description for the plan: the boxes it could write (replica boxes are another
    rank's to write), its values and (``digest_replicas``: where other ranks may hold copies)
    the digests of its replicated leaves' boxes."""
    boxes = {k: [p for p in a.pieces if not p.replica] for k, a in arrays.items()}
    return Description({k: (a.shape, None if a.dtype is None else np.dtype(a.dtype).str,
                            [p.box for p in boxes[k]]) for k, a in arrays.items()}, dict(values),
                       {k: [digest(p.data) for p in boxes[k]] for k, a in arrays.items()
                        if a.replicated and digest_replicas})


def digest(data: Any) -> str:
    """The XXH3-64 of an array's bytes in C order (a device array is copied to the host)."""
    host = to_host(data)
    if not host.flags.c_contiguous:
        host = np.ascontiguousarray(host)
    return xxhash.xxh3_64_hexdigest(memoryview(host).cast("B") if host.nbytes else b"")


@dataclasses.dataclass
class Plan:
    """The outcome: each rank's boxes to write, and what metadata.json says besides chunks."""

    writes: list[list[tuple[str, Box]]]
    arrays: dict[str, dict[str, Any]]  # key -> {"shape", "dtype"}
    values: dict[str, Any]


def make_plan(descriptions: list[Description]) -> Plan:
    """Check the ranks' descriptions against each other and assign every distinct box a writer.

    Raises:
        CheckpointError: the ranks that hold a key disagree on its shape, dtype or value, or
            their boxes of an array overlap without being equal, or leave elements unheld.
    """
    n = len(descriptions)
    # The union of the ranks' keys: a rank may hold keys others lack (a pipeline stage's layers,
    # as in DCP); an array's holders must still cover it whole (the tiling check below), so a
    # shard nobody saved is an error, never a hole in the checkpoint.
    keys: dict[str, None] = {}
    for d in descriptions:
        keys.update(dict.fromkeys(d.arrays))
        keys.update(dict.fromkeys(d.values))
    writes: list[list[tuple[str, Box]]] = [[] for _ in range(n)]
    load = [0] * n
    arrays: dict[str, dict[str, Any]] = {}
    values: dict[str, Any] = {}
    for key in keys:
        held = [(r, d.arrays[key]) for r, d in enumerate(descriptions) if key in d.arrays and d.arrays[key][0] is not None]
        as_value = [(r, d.values[key]) for r, d in enumerate(descriptions) if key in d.values]
        if not held:  # a value on every rank (an empty list reads as an empty piece list: a value here)
            vals = [v for _, v in as_value] or [[]]
            if any(v != vals[0] for v in vals):
                r0, v0 = as_value[0]
                r1, v1 = next((r, v) for r, v in as_value if v != v0)
                raise CheckpointError(f"{key!r} differs between ranks: {v0!r} on rank {r0}, {v1!r} on rank {r1}; a "
                                      "value is saved once and must be the same everywhere")
            values[key] = vals[0]
            continue
        if as_value:
            raise CheckpointError(f"{key!r} is an array on rank {held[0][0]} but a value ({as_value[0][1]!r}) on rank "
                                  f"{as_value[0][0]}")
        shape, dtype = held[0][1][0], held[0][1][1]
        for r, (s, t, _) in held:
            if tuple(s) != tuple(shape) or t != dtype:
                raise CheckpointError(f"{key!r} has global shape {tuple(shape)} and dtype {dtype} on rank {held[0][0]} "
                                      f"but {tuple(s)} and {t} on rank {r}")
        arrays[key] = {"shape": list(shape), "dtype": dtype}
        holders: dict[Box, list[int]] = {}
        copies: dict[Box, dict[str, list[int]]] = {}
        for r, (_, _, boxes) in held:
            digests = descriptions[r].digests.get(key)
            for i, box in enumerate(boxes):
                box = (tuple(box[0]), tuple(box[1]))
                holders.setdefault(box, []).append(r)
                if digests is not None:
                    copies.setdefault(box, {}).setdefault(digests[i], []).append(r)
        _check_tiling(key, tuple(shape), list(holders))
        _check_copies(key, copies)
        itemsize = np.dtype(dtype).itemsize
        for box, ranks in holders.items():
            writer = min(ranks, key=lambda r: (load[r], r))
            load[writer] += math.prod(box[1]) * itemsize
            writes[writer].append((key, box))
    return Plan(writes, arrays, values)


def _check_copies(key: str, copies: dict[Box, dict[str, list[int]]]) -> None:
    """Refuse a replicated box whose holders' copies differ (by digest)."""
    for (offsets, lengths), by_digest in copies.items():
        if len(by_digest) > 1:
            groups = " vs ".join(str(ranks) for ranks in by_digest.values())
            where = f" (the box at offsets {offsets}, lengths {lengths})" if offsets else ""
            raise CheckpointError(f"{key!r} is replicated, but ranks {groups} hold different copies{where}; a "
                                  "replicated array is saved once, from one rank, so its copies must be equal "
                                  "(broadcast it from one rank), or save each rank's own data under a key of its own")


def _check_tiling(key: str, shape: tuple[int, ...], boxes: list[Box]) -> None:
    problem = tiling_problem(shape, boxes, "piece")
    if problem:
        raise CheckpointError(f"{key!r}: the ranks' {problem}")


#: The corners (or grid cells) counted per box on average, at most, with a floor of 65536 in all:
#: a box cut on up to 6 axes; 64 dictionary updates a box keep the check's Python cost small.
STEPS_PER_BOX = 64
#: Up to this many boxes, a plain sweep (at most 496 pairs): as fast as before the corners for the
#: usual few chunks an array (for 600 arrays of 8 chunks, counting corners first was slower)
_FEW = 32
#: Pairs of boxes the sweep may compare (with a floor for few boxes): a bound on the check's
#: Python time, whatever the metadata holds; beyond, the boxes are refused as too costly to check.
PAIRS = 1 << 21


def tiling_problem(shape: tuple[int, ...], boxes: list[Box], noun: str) -> str | None:
    """What keeps ``boxes`` from tiling an array of ``shape`` exactly (every element in one box),
    or None.

    Every box must lie inside the array, their volumes must add up to the array's, and no two
    may overlap. Time: linear in the boxes (see the module docstring): at most
    :data:`STEPS_PER_BOX` steps a box, or :data:`PAIRS` comparisons.

    Returns:
        the problem as text starting with ``noun`` (``"chunks at offsets ... overlap"``).
    """
    ndim = len(shape)
    for offsets, lengths in boxes:
        if len(offsets) != ndim or len(lengths) != ndim or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, shape)):
            return f"{noun} at offsets {tuple(offsets)} (lengths {tuple(lengths)}) is not inside the shape {shape}"
    total, size = sum(math.prod(lengths) for _, lengths in boxes), math.prod(shape)
    if total != size:
        return (f"{noun}s hold {total} elements of an array of shape {shape} ({size} elements): they "
                f"{'overlap' if total > size else 'leave gaps'}")
    full = [b for b in boxes if all(b[1])]  # an empty box holds no element
    if not full:  # (total == size == 0)
        return None
    if len(full) <= _FEW:  # few boxes: a plain sweep, exact (the volumes add up) and cheapest
        pair = _overlapping_pair(full, max(range(ndim), key=lambda k: len({o[k] for o, _ in full})) if ndim else 0)
        return None if pair is None else _overlap_text(noun, pair)
    budget = STEPS_PER_BOX * len(full) + (1 << 16)
    corners = sum(1 << sum(o + n < s for o, n, s in zip(offsets, lengths, shape)) for offsets, lengths in full)
    if corners <= budget:
        tiles = _corners_add_up(shape, full)
    else:
        grid = [sorted({0, s, *{o[k] for o, _ in full}, *{o[k] + n[k] for o, n in full}}) for k, s in enumerate(shape)]
        if math.prod(len(g) - 1 for g in grid) <= budget:
            tiles = _painted_once(full, grid)
        elif _sweep_cost(full)[1] <= max(PAIRS, 4 * len(full)):
            pair = _overlapping_pair(full)  # exact: the volumes add up, so no overlap means a tiling
            return None if pair is None else _overlap_text(noun, pair)
        else:
            return (f"{noun}s of the array of shape {shape}: {len(full)} {noun}s cut on up to {ndim} axes, too "
                    f"costly to check that they tile it ({corners} corners, a grid of "
                    f"{math.prod(len(g) - 1 for g in grid)} cells, more than {budget} each, and more than "
                    f"{max(PAIRS, 4 * len(full))} pairs to compare); no checkpoint meshkit writes has such {noun}s")
    if tiles:
        return None
    # the volumes add up and the boxes do not tile: some overlap (and leave as many elements unheld)
    pair = _overlapping_pair(full)
    if pair is None:  # the sweep would cost too much to name two: say what is known
        return (f"{noun}s hold {total} elements of an array of shape {shape} ({size} elements) but not each once: "
                "some overlap and leave as many elements unheld")
    return _overlap_text(noun, pair)


def _overlap_text(noun: str, pair: tuple[Box, Box]) -> str:
    (oa, la), (ob, lb) = pair
    return f"{noun}s at offsets {tuple(oa)} (lengths {tuple(la)}) and {tuple(ob)} (lengths {tuple(lb)}) overlap"


def _corners_add_up(shape: tuple[int, ...], boxes: list[Box]) -> bool:
    """Whether the boxes' signed corners add up to the whole array's (see the module docstring):
    the boxes, all non-empty, inside the array and of the array's total volume, tile it.
    (Linear in the corners: 1M chunks of a 2-D array make 4M corners.)"""
    counts: defaultdict[tuple[int, ...], int] = defaultdict(int)
    product = itertools.product
    for offsets, lengths in boxes:
        choices = [(o, o + n) if o + n < s else (o,) for o, n, s in zip(offsets, lengths, shape)]
        cut = sum(len(c) == 2 for c in choices)
        # product() enumerates the corners as binary counting over the cut axes (an end taken for
        # a 1): a corner's sign is the parity of its index's bits
        signs = _signs(cut) if cut <= _SIGNS_CACHED else (1 - 2 * (bin(i).count("1") & 1) for i in range(1 << cut))
        for corner, sign in zip(product(*choices), signs):
            counts[corner] += sign
    origin = (0,) * len(shape)
    return counts.get(origin, 0) == 1 and all(v == 0 for p, v in counts.items() if p != origin)


#: boxes cut on at most this many axes take their corners' signs from a cached list
_SIGNS_CACHED = 10


@functools.lru_cache(maxsize=None)
def _signs(cut: int) -> tuple[int, ...]:
    return tuple(1 - 2 * (bin(i).count("1") & 1) for i in range(1 << cut))


def _overlap(a: Box, b: Box) -> bool:
    return all(max(x, y) < min(x + m, y + k) for x, m, y, k in zip(a[0], a[1], b[0], b[1]))


def _painted_once(boxes: list[Box], grid: list[list[int]]) -> bool:
    """Whether the boxes cover each cell of ``grid`` once (``grid[k]``: every box boundary on axis
    ``k``, the array's ends included, sorted): each box adds one to the cells it spans, after a
    check that they span as many cells in all as the grid has (so the painting costs that many)."""
    index = [{x: i for i, x in enumerate(g)} for g in grid]
    spans = [[(index[k][o], index[k][o + n]) for k, (o, n) in enumerate(zip(offsets, lengths))]
             for offsets, lengths in boxes]
    cells = math.prod(len(g) - 1 for g in grid)
    if sum(math.prod(b - a for a, b in span) for span in spans) != cells:
        return False
    counts = np.zeros([len(g) - 1 for g in grid], np.int32)
    for span in spans:
        counts[tuple(slice(a, b) for a, b in span)] += 1
    return bool((counts == 1).all())


def _sweep_cost(boxes: list[Box]) -> tuple[int, int]:
    """The axis along which a sweep compares the fewest pairs (each box with those still open at
    its start), and that number; by one sort per axis."""
    best = (0, 0)
    for axis in range(len(boxes[0][0]) if boxes else 0):
        starts = sorted(o[axis] for o, _ in boxes)
        ends = sorted(o[axis] + n[axis] for o, n in boxes)
        pairs, closed = 0, 0
        for i, start in enumerate(starts):
            while closed < len(ends) and ends[closed] <= start:
                closed += 1
            pairs += i - closed
        if axis == 0 or pairs < best[1]:
            best = (axis, pairs)
    return best


def _overlapping_pair(boxes: list[Box], axis: int | None = None) -> tuple[Box, Box] | None:
    """Two overlapping boxes, or None where no two overlap, or where finding out would compare
    more than :data:`PAIRS` pairs (None then means "not found"; the caller knows which): a sweep
    along ``axis`` (default: the cheapest, :func:`_sweep_cost`), comparing each box with those
    still open there."""
    if len(boxes) < 2 or not boxes[0][0]:
        return None
    if axis is None:
        axis, cost = _sweep_cost(boxes)
        if cost > max(PAIRS, 4 * len(boxes)):
            return None
    open_: dict[int, Box] = {}
    ending: list[tuple[int, int]] = []  # (end along the axis, index in open_)
    for i, box in enumerate(sorted(boxes, key=lambda b: b[0][axis])):
        start = box[0][axis]
        while ending and ending[0][0] <= start:
            del open_[heapq.heappop(ending)[1]]
        for a in open_.values():
            if _overlap(a, box):
                return a, box
        open_[i] = box
        heapq.heappush(ending, (start + box[1][axis], i))
    return None
