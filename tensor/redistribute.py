"""Redistribution: one collective per changing mesh dimension, never a full copy on one rank.

On mesh dimension ``i`` (its group ``mesh.get_group(i)``), with ``n`` ranks:

=====================  =============================================================
Shard(d) -> Replicate  ``all_gather_into_tensor`` (blocks padded to the chunk size, stripped)
Partial  -> Replicate  ``all_reduce`` with the Partial's op
Partial  -> Shard(d)   ``reduce_scatter_tensor`` (padded to ``n`` chunks, stripped)
Shard(d) -> Shard(e)   ``all_to_all_single`` (padded pieces, stripped)
Replicate -> Shard(d)  local slice, no communication
Replicate -> Partial   local: for sum, coordinate 0 keeps the value and the others hold -0.0
                       (the additive identity, so the sum is bit-exact); avg/max/min keep it
                       (avg, as torch: completing it computes (x + ... + x) / n, which may
                       round, one ulp off at n = 3; every other pair is bit-exact)
Shard -> Partial       all-gather, then as Replicate -> Partial
=====================  =============================================================

Nested shards (several mesh dims sharding one array dim) are undone innermost (rightmost mesh
dim) first and built outermost first, so every collective works on whole chunks of its parent
block, as torch does. Works on NumPy and CuPy blocks alike (``xp`` is the block's library).

The steps of a redistribution depend only on the mesh, the global shape and the two placements,
so they are worked out once (the plan, every chunk size and padding, axis orders, index tuples,
the groups) into a :func:`program` kept in a small table; a call looks it up and runs it. Copies
are the fewest the layout allows: the collectives write straight into the result's memory, an
all-to-all packs its send buffer with one copy (none when the target dim is the first axis) and
unpacks with none when the source dim is the first axis (else one, into the result).
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from typing import Any, Callable, Sequence

from ..comm import array_namespace
from ..mesh import DeviceMesh
from .chunks import chunk_range, chunk_size, local_shape_and_offset
from .placements import Partial, Placement, Replicate, Shard

__all__ = ["redistribute_local", "plan", "program", "run", "partition_value", "PROGRAMS_MAX"]

logger = logging.getLogger("meshkit.tensor")


def _parent_size(shape: Sequence[int], mesh: DeviceMesh, coordinate: Sequence[int],
                 placements: Sequence[Placement], i: int, dim: int) -> int:
    """Size along ``dim`` of the block mesh dims ``< i`` leave this rank (what dim ``i`` cuts)."""
    outer = list(placements[:i]) + [Replicate()] * (len(placements) - i)
    return local_shape_and_offset(shape, mesh.shape, coordinate, outer)[0][dim]


def plan(src: Sequence[Placement], dst: Sequence[Placement]) -> list[tuple[int, Placement, Placement]]:
    """The steps ``(mesh dim, from, to)`` that take ``src`` to ``dst``, in order (see :func:`_plan`)."""
    return list(_plan(tuple(src), tuple(dst)))


@functools.lru_cache(maxsize=1024)
def _plan(src: tuple[Placement, ...], dst: tuple[Placement, ...]) -> tuple[tuple[int, Placement, Placement], ...]:
    """The steps ``(mesh dim, from, to)`` that take ``src`` to ``dst``, in order.

    Pure (cached; the tests read it). First (right to left) every Shard that changes, or that
    sits inside (to the right of) such a Shard or a new Shard of the same array dim, is undone:
    all-to-all straight to its target Shard where no other mesh dim shards either array dim
    (before or after), else all-gather to Replicate. Then (left to right) every remaining
    difference is applied.
    """
    cur = list(src)
    n = len(cur)
    undo = {i for i in range(n) if cur[i].is_shard() and cur[i] != dst[i]}
    for i in range(n):
        if cur[i] != dst[i]:
            dims = {p.dim for p in (cur[i], dst[i]) if isinstance(p, Shard)}
            undo |= {j for j in range(i + 1, n) if isinstance(cur[j], Shard) and cur[j].dim in dims}
    steps = []
    for i in sorted(undo, reverse=True):
        p, q = cur[i], dst[i]
        others = {x.dim for k in range(n) if k != i for x in (cur[k], dst[k]) if isinstance(x, Shard)}
        if isinstance(q, Shard) and q.dim != p.dim and p.dim not in others and q.dim not in others:
            steps.append((i, p, q))
            cur[i] = q
        else:
            steps.append((i, p, Replicate()))
            cur[i] = Replicate()
    for i in range(n):
        if cur[i] != dst[i]:
            steps.append((i, cur[i], dst[i]))
            cur[i] = dst[i]
    return tuple(steps)


# ---- compiled programs: the plan with every size, group and index worked out once ---------------
#
# Planning on every call cost 4-11 us beside a 3-12 us collective (world of one, 8x64 float64;
# S0->S1 23 us: moveaxis alone is microseconds); from the table the whole DTensor layer is 2-3 us
# (/tmp timings, benchmarks/dtensor.py shows the current ones).

#: Programs kept; the oldest is dropped beyond this (a model has a few dozen distinct layouts).
PROGRAMS_MAX = 1024

_programs: dict[tuple[Any, ...], _Program] = {}
_programs_lock = threading.Lock()


class _Program:
    """The steps of one redistribution on one mesh: ``(function, args)`` run in order on the block."""

    __slots__ = ("mesh", "steps", "fresh", "moves")

    def __init__(self, mesh: DeviceMesh, steps: list[tuple[Callable[..., Any], tuple[Any, ...]]], fresh: bool,
                 moves: tuple[tuple[int, Placement, Placement], ...]) -> None:
        self.mesh = weakref.ref(mesh)  # keyed by id(mesh): the entry is this mesh's only while it lives
        self.steps = tuple(steps)
        self.fresh = fresh  # the last step leaves the block in memory of its own (a collective's output)
        self.moves = moves


def program(mesh: DeviceMesh, shape: tuple[int, ...], src: tuple[Placement, ...],
            dst: tuple[Placement, ...]) -> _Program:
    """The compiled redistribution of a ``shape`` array on ``mesh`` from ``src`` to ``dst`` (cached)."""
    key = (id(mesh), shape, src, dst)
    found = _programs.get(key)
    if found is not None and found.mesh() is mesh:
        return found
    made = _compile(mesh, shape, src, dst)
    with _programs_lock:  # ranks of the local engine are threads: one writer at a time
        if len(_programs) >= PROGRAMS_MAX:
            _programs.pop(next(iter(_programs)), None)
        _programs[key] = made
    return made


def redistribute_local(local: Any, mesh: DeviceMesh, shape: Sequence[int], src: Sequence[Placement],
                       dst: Sequence[Placement], *, copy: bool = True) -> Any:
    """This rank's block of the global array of ``shape`` under ``dst``, given its block under ``src``.

    Collective over the groups of the mesh dims that change. Never writes into ``local``. The
    result has its own memory (``copy``, what ``DTensor.redistribute`` returns: writing into it
    leaves the source DTensor's block alone) or, without ``copy`` (the op rules, which only read
    it), may be a view of ``local`` where no collective ran (Replicate -> Shard slices it).
    """
    return run(program(mesh, tuple(shape), tuple(src), tuple(dst)), local, copy=copy)


def run(prog: _Program, local: Any, *, copy: bool = True) -> Any:
    """Run a compiled redistribution on this rank's block (see :func:`redistribute_local`)."""
    if logger.isEnabledFor(logging.DEBUG):
        for i, p, q in prog.moves:
            logger.debug("redistribute on mesh dim %d: %r -> %r (block %s)", i, p, q, tuple(local.shape))
    xp = array_namespace(local)
    for fn, args in prog.steps:
        local = fn(xp, local, *args)
    return local if prog.fresh or not copy else local.copy()


def _compile(mesh: DeviceMesh, shape: tuple[int, ...], src: tuple[Placement, ...],
             dst: tuple[Placement, ...]) -> _Program:
    coordinate = mesh.get_coordinate()
    moves = _plan(src, dst)
    cur = list(src)
    steps: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
    fresh = False  # True once a step has put the block into memory of its own
    for i, p, q in moves:
        group = mesh.get_group(i)
        n, r = mesh.shape[i], coordinate[i]
        block = local_shape_and_offset(shape, mesh.shape, coordinate, cur)[0]
        if isinstance(p, Shard) and isinstance(q, Shard):
            parent_p = _parent_size(shape, mesh, coordinate, cur, i, p.dim)
            parent_q = _parent_size(shape, mesh, coordinate, cur, i, q.dim)
            steps.append((_all_to_all, _all_to_all_args(group, block, p.dim, q.dim, parent_p, parent_q, n, r)))
            fresh = True
        elif isinstance(p, Shard):
            steps.append((_all_gather, _all_gather_args(group, block, p.dim,
                                                        _parent_size(shape, mesh, coordinate, cur, i, p.dim), n)))
            fresh = True
            if isinstance(q, Partial) and _partitions(q, r):
                steps.append((_partition, (q, r)))
        elif isinstance(p, Replicate):
            if isinstance(q, Shard):
                start, stop = chunk_range(block[q.dim], n, r)
                index = [slice(None)] * len(block)
                index[q.dim] = slice(start, stop)
                steps.append((_take, (tuple(index),)))
            elif _partitions(q, r):
                steps.append((_partition, (q, r)))
                fresh = True
        else:  # Partial -> Replicate, Shard or another Partial
            fresh = True
            if isinstance(q, Shard):
                steps.append((_reduce_scatter, _reduce_scatter_args(group, block, q.dim, p.op, n, r)))
            else:
                steps.append((_all_reduce, (group, p.op)))
                if isinstance(q, Partial) and _partitions(q, r):
                    steps.append((_partition, (q, r)))
        cur[i] = q
    return _Program(mesh, steps, fresh, moves)


def partition_value(local: Any, q: Partial, r: int) -> Any:
    """Replicate -> Partial on one mesh dim: the terms whose reduction is ``local``."""
    if not _partitions(q, r):
        return local
    return _partition(array_namespace(local), local, q, r)


def _partitions(q: Partial, r: int) -> bool:
    """Whether coordinate ``r``'s term differs from the value (a sum keeps it at coordinate 0 only)."""
    return q.reduce_op == "sum" and r != 0


def _partition(xp: Any, local: Any, q: Partial, r: int) -> Any:
    if local.dtype.kind in "fc":
        return xp.full_like(local, -0.0)  # x + (-0.0) == x for every x, +0.0 included
    return xp.zeros_like(local)


def _take(xp: Any, local: Any, index: tuple[slice, ...]) -> Any:
    return local[index]


def _front(ndim: int, dim: int) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """Axis orders that bring ``dim`` first and put it back (None: it is first already)."""
    if dim == 0:
        return None, None
    front = (dim, *range(dim), *range(dim + 1, ndim))
    back = (*range(1, dim + 1), 0, *range(dim + 1, ndim))
    return front, back


def _pad0(xp: Any, block: Any, size: int) -> Any:
    """``block`` zero-padded along its first axis to ``size`` rows, C-contiguous."""
    out = xp.zeros((size,) + tuple(block.shape[1:]), dtype=block.dtype)
    out[:block.shape[0]] = block
    return out


def _all_gather_args(group: Any, block: tuple[int, ...], dim: int, parent: int, n: int) -> tuple[Any, ...]:
    c = chunk_size(parent, n)
    return (group, *_front(len(block), dim), n, c, block[dim] != c, parent)


def _all_gather(xp: Any, local: Any, group: Any, front: tuple[int, ...] | None, back: tuple[int, ...] | None,
                n: int, c: int, pad: bool, keep: int) -> Any:
    """Shard(dim) -> Replicate: gather the padded chunks straight into the result, keep ``keep`` rows."""
    send = local if front is None else local.transpose(front)
    send = _pad0(xp, send, c) if pad else xp.ascontiguousarray(send)
    out = xp.empty((n * c,) + send.shape[1:], dtype=local.dtype)
    group.all_gather_into_tensor(out, send)
    if keep != n * c:
        out = out[:keep]
    return out if back is None else out.transpose(back)


def _reduce_scatter_args(group: Any, block: tuple[int, ...], dim: int, op: Any, n: int, r: int) -> tuple[Any, ...]:
    parent = block[dim]
    c = chunk_size(parent, n)
    start, stop = chunk_range(parent, n, r)
    return (group, op, *_front(len(block), dim), n, c, parent != n * c, stop - start)


def _reduce_scatter(xp: Any, local: Any, group: Any, op: Any, front: tuple[int, ...] | None,
                    back: tuple[int, ...] | None, n: int, c: int, pad: bool, keep: int) -> Any:
    """Partial -> Shard(dim): reduce the padded array, keep this rank's chunk."""
    send = local if front is None else local.transpose(front)
    send = _pad0(xp, send, n * c) if pad else xp.ascontiguousarray(send)
    out = xp.empty((c,) + send.shape[1:], dtype=local.dtype)
    group.reduce_scatter_tensor(out, send, op)
    if keep != c:
        out = out[:keep]
    return out if back is None else out.transpose(back)


def _all_reduce(xp: Any, local: Any, group: Any, op: Any) -> Any:
    """Partial -> Replicate: all-reduce a copy (the source block stays this rank's term)."""
    out = xp.array(local, copy=True, order="C")  # an ndarray even from a 0-d NumPy scalar
    group.all_reduce(out, op)
    return out


def _all_to_all_args(group: Any, block: tuple[int, ...], d: int, e: int, parent_d: int, parent_e: int, n: int,
                     r: int) -> tuple[Any, ...]:
    """Everything :func:`_all_to_all` needs for a block of shape ``block`` (``block[e] == parent_e``)."""
    ndim = len(block)
    cd, ce = chunk_size(parent_d, n), chunk_size(parent_e, n)
    piece = list(block)  # what goes to (and comes from) each rank, padded: d-chunk of mine x e-chunk of its
    piece[d], piece[e] = cd, ce
    piece_shape = (n, *piece)
    # the pack: None (e first, no padding: the block is the send buffer), a split shape and axis
    # order (one copy from a view), or the per-rank (destination, source) indexes of a padded copy
    if block[d] == cd and block[e] == n * ce:
        split = block[:e] + (n, ce) + block[e + 1:]
        order = None if e == 0 else (e, *range(e), *range(e + 1, ndim + 1))
        pack = (split, order, None)
    else:
        pieces = []
        for j in range(n):
            start, stop = chunk_range(parent_e, n, j)
            if stop > start:
                to = [slice(None)] * ndim
                to[d], to[e] = slice(0, block[d]), slice(0, stop - start)
                frm = [slice(None)] * ndim
                frm[e] = slice(start, stop)
                pieces.append((j, tuple(to), tuple(frm)))
        pack = (None, None, tuple(pieces))
    # the unpack: recv[i] is rank i's d-chunk of my e-chunk; joined along d they are my block
    start, stop = chunk_range(parent_e, n, r)
    mine_e = stop - start
    order = (*range(1, d + 1), 0, *range(d + 1, ndim + 1))  # n next to d: (..., n, cd, ...)
    at_e = e if e < d else e + 1  # axis e after that move
    final = list(piece)
    final[d], final[e] = parent_d, mine_e
    if d == 0:  # the received buffer is the result (a view of it when padding is stripped)
        index = [slice(None)] * ndim
        index[0], index[e] = slice(0, parent_d), slice(0, mine_e)
        unpack = ("view", (n * cd, *piece[1:]), None if (parent_d == n * cd and mine_e == ce) else tuple(index))
    elif parent_d == n * cd:  # one copy, straight into the result
        index = [slice(None)] * (ndim + 1)
        index[at_e] = slice(0, mine_e)
        split_final = (*final[:d], n, cd, *final[d + 1:])
        unpack = ("copy", (tuple(final), split_final, order), None if mine_e == ce else tuple(index))
    else:  # padded along d: join (a copy) then strip
        index = [slice(None)] * ndim
        index[d], index[e] = slice(0, parent_d), slice(0, mine_e)
        unpack = ("join", ((*piece[:d], n * cd, *piece[d + 1:]), order), tuple(index))
    return group, piece_shape, pack, unpack


def _all_to_all(xp: Any, local: Any, group: Any, piece_shape: tuple[int, ...], pack: tuple[Any, ...],
                unpack: tuple[Any, ...]) -> Any:
    """Shard(d) -> Shard(e): send each rank its e-chunk of my d-chunk; join the d-chunks received.

    One copy at most on each side. The pack: none when ``e`` is the first axis and nothing is
    padded (the block is the send buffer); else one ``copyto`` from the block viewed with axis
    ``e`` split into ``(n, ce)`` and ``n`` brought first (per rank, into a zeroed buffer, when
    padded). The unpack: none when ``d`` is the first axis (the received buffer is the result, or
    a view of it without the padding); else one ``copyto`` into the result viewed as
    ``(..., n, cd, ...)``.
    """
    split, order, pieces = pack
    if pieces is not None:
        send = xp.zeros(piece_shape, dtype=local.dtype)
        for j, to, frm in pieces:
            send[j][to] = local[frm]
    elif order is None:
        send = xp.ascontiguousarray(local.reshape(split))
    else:
        send = xp.empty(piece_shape, dtype=local.dtype)
        xp.copyto(send, local.reshape(split).transpose(order))
    recv = xp.empty(piece_shape, dtype=local.dtype)
    group.all_to_all_single(recv, send)
    how, shapes, index = unpack
    if how == "view":
        out = recv.reshape(shapes)
        return out if index is None else out[index]
    if how == "copy":
        final, split_final, order = shapes
        out = xp.empty(final, dtype=local.dtype)
        xp.copyto(out.reshape(split_final), recv.transpose(order) if index is None else recv.transpose(order)[index])
        return out
    joined_shape, order = shapes
    return recv.transpose(order).reshape(joined_shape)[index]
