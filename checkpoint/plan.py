"""The global save plan: who writes which box, each replicated box once (DCP's dedup planner).

Every rank describes what it holds; rank 0 alone checks the descriptions against each other and
decides, so planning is one gather and one scatter whatever the world size. A box held by
several ranks (DDP's parameters, a DTensor's Replicate copies, HSDP's replica shards) is written
by the holder that has been given the fewest bytes so far, spreading the writes.

Copies written once must be equal, as a value saved once must be: every holder of a replicated
leaf (a plain array, a DTensor's box over a ``Replicate`` mesh dim) sends the XXH3-64 of its
copy with its description, and copies that differ fail the save on every rank, naming the key
and which ranks hold which copy. The cost is one hash pass over the replicated bytes on each
holder (XXH3: 38 ms for 64 MB a rank on this loaded 2-core VM; docs/checkpoints.md). A
:class:`~meshkit.parallel.ShardedArray` marked ``replica`` (HSDP, a flat shard replicated over
tp) is its strategy's promise and is not described, hence not compared.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import xxhash

from ..comm._seams import to_host
from .errors import CheckpointError
from .leaves import ArrayLeaf

__all__ = ["Description", "describe", "make_plan", "Plan", "tiling_problem"]

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


def tiling_problem(shape: tuple[int, ...], boxes: list[Box], noun: str) -> str | None:
    """What keeps the distinct ``boxes`` from tiling an array of ``shape`` exactly, or None.

    Every box must lie inside the array, their volumes must add up to the array's, and no two
    may overlap: together, every element is in exactly one box. The planner checks the ranks'
    pieces with it before a save, the reader a checkpoint's chunks before a load (a chunk that
    claims another's place would otherwise load wrong values with every element "covered").

    Returns:
        the problem as text starting with ``noun`` (``"pieces at offsets ... overlap"``).
    """
    for offsets, lengths in boxes:
        if len(offsets) != len(shape) or len(lengths) != len(shape) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, shape)):
            return f"{noun} at offsets {tuple(offsets)} (lengths {tuple(lengths)}) is not inside the shape {shape}"
    total, size = sum(math.prod(lengths) for _, lengths in boxes), math.prod(shape)
    if total != size:
        return (f"{noun}s hold {total} elements of an array of shape {shape} ({size} elements): they "
                f"{'overlap' if total > size else 'leave gaps'}")
    pair = _overlapping_pair(boxes)
    if pair:
        (oa, la), (ob, lb) = pair
        return (f"{noun}s at offsets {tuple(oa)} (lengths {tuple(la)}) and {tuple(ob)} (lengths {tuple(lb)}) "
                "overlap")
    return None


def _overlapping_pair(boxes: list[Box]) -> tuple[Box, Box] | None:
    """Two overlapping boxes, or None: a sweep along the axis where the boxes start at the most
    distinct places (row blocks sweep along rows, column blocks along columns), comparing each
    box only with those still open there; exact, and near linear for the grids ranks hold."""
    if len(boxes) < 2 or not boxes[0][0]:
        return None
    axis = max(range(len(boxes[0][0])), key=lambda d: len({o[d] for o, _ in boxes}))
    active: list[Box] = []
    for box in sorted(boxes, key=lambda b: b[0][axis]):
        start = box[0][axis]
        active = [a for a in active if a[0][axis] + a[1][axis] > start]
        for a in active:
            if all(max(x, y) < min(x + m, y + k) for x, m, y, k in zip(a[0], a[1], box[0], box[1])):
                return a, box
        active.append(box)
    return None
