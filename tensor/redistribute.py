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
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Sequence

from ..comm import array_namespace
from ..mesh import DeviceMesh
from .chunks import chunk_range, chunk_size, local_shape_and_offset
from .placements import Partial, Placement, Replicate, Shard

__all__ = ["redistribute_local", "plan", "partition_value"]

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


def redistribute_local(local: Any, mesh: DeviceMesh, shape: Sequence[int], src: Sequence[Placement],
                       dst: Sequence[Placement], *, copy: bool = True) -> Any:
    """This rank's block of the global array of ``shape`` under ``dst``, given its block under ``src``.

    Collective over the groups of the mesh dims that change. Never writes into ``local``. The
    result has its own memory (``copy``, what ``DTensor.redistribute`` returns: writing into it
    leaves the source DTensor's block alone) or, without ``copy`` (the op rules, which only read
    it), may be a view of ``local`` where no collective ran (Replicate -> Shard slices it).
    """
    coordinate = mesh.get_coordinate()
    cur = list(src)
    fresh = False  # True once a collective has put the block into a buffer of its own
    for i, p, q in _plan(tuple(src), tuple(dst)):
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("redistribute on mesh dim %d: %r -> %r (global shape %s)", i, p, q, tuple(shape))
        group = mesh.get_group(i)
        n, r = mesh.shape[i], coordinate[i]
        if isinstance(p, Shard) and isinstance(q, Shard):
            parent_p = _parent_size(shape, mesh, coordinate, cur, i, p.dim)
            parent_q = _parent_size(shape, mesh, coordinate, cur, i, q.dim)
            local = _all_to_all(group, local, p.dim, q.dim, parent_p, parent_q, n, r)
            fresh = True
        elif isinstance(p, Shard):
            local = _all_gather(group, local, p.dim, _parent_size(shape, mesh, coordinate, cur, i, p.dim), n)
            fresh = True
            if isinstance(q, Partial):
                local = partition_value(local, q, r)
        elif isinstance(p, Replicate):
            if isinstance(q, Shard):
                start, stop = chunk_range(local.shape[q.dim], n, r)
                index = [slice(None)] * local.ndim
                index[q.dim] = slice(start, stop)
                local = local[tuple(index)]
            else:
                local = partition_value(local, q, r)
        else:  # Partial -> Replicate, Shard or another Partial
            fresh = True
            if isinstance(q, Shard):
                local = _reduce_scatter(group, local, q.dim, p, n, r)
            else:
                xp = array_namespace(local)
                local = xp.array(local, copy=True, order="C")
                group.all_reduce(local, p.op)
                if isinstance(q, Partial):
                    local = partition_value(local, q, r)
        cur[i] = q
    return local if fresh or not copy else local.copy()


def partition_value(local: Any, q: Partial, r: int) -> Any:
    """Replicate -> Partial on one mesh dim: the terms whose reduction is ``local``."""
    if q.reduce_op != "sum" or r == 0:
        return local
    xp = array_namespace(local)
    if local.dtype.kind in "fc":
        return xp.full_like(local, -0.0)  # x + (-0.0) == x for every x, +0.0 included
    return xp.zeros_like(local)


def _padded(xp: Any, block: Any, sizes: Sequence[int]) -> Any:
    """``block`` (axes already in order) zero-padded at the end to ``sizes``, C-contiguous."""
    if tuple(block.shape[:len(sizes)]) == tuple(sizes):
        return xp.ascontiguousarray(block)
    out = xp.zeros(tuple(sizes) + tuple(block.shape[len(sizes):]), dtype=block.dtype)
    out[tuple(slice(0, s) for s in block.shape[:len(sizes)])] = block
    return out


def _front(xp: Any, a: Any, dim: int) -> Any:
    """``a`` with axis ``dim`` first (itself when it is already: moveaxis costs microseconds)."""
    return a if dim == 0 else xp.moveaxis(a, dim, 0)


def _back(xp: Any, a: Any, dim: int) -> Any:
    """Undo :func:`_front`."""
    return a if dim == 0 else xp.moveaxis(a, 0, dim)


def _all_gather(group: Any, local: Any, dim: int, parent: int, n: int) -> Any:
    """Shard(dim) -> Replicate: gather the padded chunks, keep the first ``parent`` rows."""
    xp = array_namespace(local)
    c = chunk_size(parent, n)
    send = _padded(xp, _front(xp, local, dim), (c,))
    out = xp.empty((n * c,) + send.shape[1:], dtype=local.dtype)
    group.all_gather_into_tensor(out, send)
    return _back(xp, out if n * c == parent else out[:parent], dim)


def _reduce_scatter(group: Any, local: Any, dim: int, p: Partial, n: int, r: int) -> Any:
    """Partial -> Shard(dim): reduce the padded array, keep this rank's chunk."""
    xp = array_namespace(local)
    parent = local.shape[dim]
    c = chunk_size(parent, n)
    send = _padded(xp, _front(xp, local, dim), (n * c,))
    out = xp.empty((c,) + send.shape[1:], dtype=local.dtype)
    group.reduce_scatter_tensor(out, send, p.op)
    start, stop = chunk_range(parent, n, r)
    return _back(xp, out if stop - start == c else out[:stop - start], dim)


def _all_to_all(group: Any, local: Any, d: int, e: int, parent_d: int, parent_e: int, n: int, r: int) -> Any:
    """Shard(d) -> Shard(e): send each rank its e-chunk of my d-chunk; join the d-chunks received.

    One copy at most on each side: the send buffer is ``local`` with axis ``e`` split into
    ``(n, ce)`` and the ``n`` axis brought first (no copy when ``e`` is the first axis and no
    padding is needed); the received pieces join along ``d`` by a reshape (a view when ``d`` is
    the first axis). Pieces are zero-padded to the chunk sizes and the result stripped.
    """
    xp = array_namespace(local)
    cd, ce = chunk_size(parent_d, n), chunk_size(parent_e, n)
    padded = list(local.shape)
    padded[d], padded[e] = cd, n * ce
    src = local
    if tuple(local.shape) != tuple(padded):
        src = xp.zeros(tuple(padded), dtype=local.dtype)
        src[tuple(slice(0, k) for k in local.shape)] = local
    send = _front(xp, src.reshape(src.shape[:e] + (n, ce) + src.shape[e + 1:]), e)
    send = xp.ascontiguousarray(send)  # the pack (free when e == 0)
    recv = xp.empty_like(send)
    group.all_to_all_single(recv, send)
    piece = list(send.shape[1:])  # recv[i]: rank i's d-chunk of my e-chunk
    joined = _back(xp, recv, d).reshape(tuple(piece[:d]) + (n * cd,) + tuple(piece[d + 1:]))
    start, stop = chunk_range(parent_e, n, r)
    index = [slice(None)] * len(piece)
    index[d], index[e] = slice(0, parent_d), slice(0, stop - start)
    return joined[tuple(index)]
