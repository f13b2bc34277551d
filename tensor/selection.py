"""Indexing that moves data, fancy and boolean keys, and writes: what :mod:`.indexing`'s plan
refuses on a sharded dim (``d[1:4]`` and ``d[2]`` of a row-sharded ``d``, ``d[[0, 3]]``,
``d[d > 0]``) and ``d[key] = value``. Each function states its placements and cost; every move
is logged at DEBUG. Reached through :data:`.dispatch.INDEXING` (``DTensor.__getitem__`` and
``__setitem__``), so that :mod:`.dtensor` does not import this module.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from ..comm._seams import array_namespace
from . import errors
from .chunks import local_shape_and_offset, local_slices
from .dispatch import INDEXING
from .dtensor import DTensor
from .indexing import expand, index_plan
from .placements import Partial, Placement, Replicate, Shard
from .propagation import logger, moved, off_axes

__all__ = ["getitem", "setitem"]

def _is_index_array(k: Any) -> bool:
    return isinstance(k, list) or (hasattr(k, "dtype") and hasattr(k, "shape") and
                                   type(k).__name__ != "DTensor" and getattr(k, "ndim", 0) > 0)


def _is_mask(k: Any) -> bool:
    return getattr(k, "dtype", None) is not None and getattr(k.dtype, "kind", None) == "b" and getattr(k, "ndim", 0) > 0


def getitem(x: Any, key: Any) -> Any:
    """``x[key]`` for every key :func:`index_plan` refuses on a sharded dim, and for fancy and
    boolean keys: a slice of a sharded dim keeps it sharded (local where every rank's chunk of the
    result lies in its block, else gathered and cut again), an integer on one is broadcast from
    the rank holding it, one integer array is ``np.take``'s rule, several (``x[i, j]``, integers
    and full slices beside them) move the indexed dims off the mesh and index locally, a boolean
    mask gathers the dims it covers (:func:`_sliced`, :func:`_fancy`, :func:`_masked`)."""
    op = "DTensor.__getitem__"
    if _is_mask(key):
        return _masked(op, x, key)
    parts = list(key) if isinstance(key, tuple) else [key]
    arrays = [d for d, k in enumerate(parts) if _is_index_array(k)]
    if arrays:
        full = all(isinstance(k, slice) and k == slice(None) for d, k in enumerate(parts) if d not in arrays)
        if (len(arrays) > 1 or not full) and _advanced_only(parts):
            return _fancy(op, x, parts)
        if len(arrays) != 1 or not full or Ellipsis in parts or None in parts:
            raise NotImplementedError(errors.prefix(op) + f"index {key!r} (placements {x.placements!r}): integer "
                                      "arrays are supported beside integers and full slices ':' only; index "
                                      "full_tensor() for the others (redistribute to Replicate first)")
        idx = np.asarray(parts[arrays[0]])
        if idx.dtype.kind == "b":
            raise NotImplementedError(errors.prefix(op) + "a boolean list among other indices has no DTensor rule; "
                                      "give the mask alone, of the array's leading shape")
        return np.take(x, idx, axis=arrays[0])
    return _sliced(op, x, key)


def _advanced_only(parts: list[Any]) -> bool:
    """Every index an integer array, an integer or a full slice ``:`` (NumPy's advanced indexing
    of several dims at once, ``x[i, j]``), no boolean among them."""
    for k in parts:
        if _is_index_array(k):
            if np.asarray(k).dtype.kind not in "iu":
                return False
        elif not (isinstance(k, (int, np.integer)) and not isinstance(k, bool)) and \
                not (isinstance(k, slice) and k == slice(None)):
            return False
    return True


def _fancy(op: str, x: Any, parts: list[Any]) -> Any:
    """``x[i, j]``: integer arrays (and integers) on several dims, full slices elsewhere. The indexed
    dims are moved off the mesh first (:func:`.propagation.off_axes`: a Shard there goes by one
    all-to-all to a sliced dim, else one all-gather), so every rank holds them whole and indexes
    its block with the same key; the sliced dims keep their Shards, placed where NumPy puts
    those dims (after the broadcast index shape where the indexed dims are adjacent, else after
    it at the front). Every Partial stays (a selection). Out-of-range indices raise IndexError on
    every rank before any communication."""
    indexed = [d for d, k in enumerate(parts) if not isinstance(k, slice)]
    arrays = []
    for d in indexed:
        k = np.asarray(parts[d])
        n = x.shape[d]
        if k.size and (int(k.max()) >= n or int(k.min()) < -n):
            bad = int(k.max()) if int(k.max()) >= n else int(k.min())
            raise IndexError(errors.prefix(op) + f"index {bad} is out of bounds for axis {d} with size {n}")
        arrays.append(k)
    try:
        bshape = tuple(np.broadcast_shapes(*(k.shape for k in arrays)))
    except ValueError:
        raise IndexError(errors.prefix(op) + "shape mismatch: indexing arrays could not be broadcast together "
                         f"with shapes {' '.join(str(k.shape) for k in arrays)}") from None
    src = off_axes(op, "x", x, indexed, keep_partial=("sum", "avg", "max", "min"))
    rest = [d for d in range(x.ndim) if d not in indexed]
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1))
    order = ([*rest[:indexed[0]], *([None] * len(bshape)), *rest[indexed[0]:]] if adjacent
             else [*([None] * len(bshape)), *rest])  # the source dim of each output dim (None: the index's)
    shape = tuple(bshape[sum(o is None for o in order[:i])] if d is None else x.shape[d] for i, d in enumerate(order))
    placements = [Shard(order.index(p.dim)) if isinstance(p, Shard) else p for p in src.placements]
    local = src.to_local()[tuple(parts)]
    return DTensor(local, x.device_mesh, placements, shape=shape)


def _sliced(op: str, x: Any, key: Any) -> Any:
    """Basic indexing touching a sharded dim. A slice of a sharded dim keeps it sharded: where every
    rank's chunk of the result lies in its own block (``x[1:4]`` of 5 rows over 2 ranks: rows 1-2
    on rank 0, row 3 on rank 1) each rank slices its block, no communication; otherwise the
    touched dims are gathered (one all-gather per mesh dim sharding them), indexed, and cut again
    (a local slice) to the same mesh dims. Integers alone on sharded dims (``x[2]``) are
    :func:`_from_owner`'s: one broadcast of the result's block from the rank holding it, those
    mesh dims Replicate. A Partial stays."""
    expanded = expand(op, key, x.ndim)
    touched: dict[int, Any] = {}
    d = 0
    for k in expanded:
        if k is None:
            continue
        if not (isinstance(k, slice) and range(*k.indices(x.shape[d])) == range(x.shape[d])):
            touched[d] = k
        d += 1
    gathered = [Replicate() if isinstance(p, Shard) and p.dim in touched else p for p in x.placements]
    local_key, shape, out = index_plan(key, x.shape, gathered)
    # where each sharded touched dim keeps (a slice), its mesh dims cut the result again
    new_dim: dict[int, int] = {}
    d, e = 0, 0
    for k in expanded:
        if k is None:
            e += 1
            continue
        if isinstance(k, slice):
            new_dim[d] = e
            e += 1
        d += 1
    target = tuple(Shard(new_dim[p.dim]) if isinstance(p, Shard) and p.dim in touched and p.dim in new_dim
                   else q for p, q in zip(x.placements, out))
    mesh = x.device_mesh
    sharded_touched = [p.dim for p in x.placements if isinstance(p, Shard) and p.dim in touched]
    if all(not isinstance(touched[d], slice) for d in sharded_touched):
        return _from_owner(op, x, expanded, touched, local_key, shape, out)
    if all(isinstance(touched.get(p.dim), slice) for p in x.placements if isinstance(p, Shard) and p.dim in touched):
        plan = _local_slices(x, expanded, touched, shape, target)
        if plan is not None:
            block = x.to_local()[plan]
            return DTensor(block, mesh, target, shape=shape)
    whole = moved(op, "self", x, gathered)
    result = DTensor(whole.to_local()[local_key], mesh, out, shape=shape)
    return moved(op, "result", result, target)


def _from_owner(op: str, x: Any, expanded: list[Any], touched: dict[int, Any], local_key: tuple[Any, ...],
                shape: tuple[int, ...], out: tuple[Placement, ...]) -> Any:
    """``x[key]`` where integers are the only indices on sharded dims (``x[2]`` of rows over ranks):
    the rank whose block holds those indices indexes it, and one broadcast per mesh dim sharding
    them (innermost first, from the owner's coordinate) gives it to the others, so each rank
    receives the result's block, not the whole dim. Those mesh dims become Replicate."""
    mesh = x.device_mesh
    mesh_shape = tuple(mesh.shape)
    me = tuple(mesh.get_coordinate())
    dims = [i for i, p in enumerate(x.placements) if isinstance(p, Shard) and p.dim in touched]
    owner = None
    for combo in itertools.product(*(range(mesh_shape[i]) for i in dims)):
        coordinate = list(me)
        for i, c in zip(dims, combo):
            coordinate[i] = c
        bshape, boff = local_shape_and_offset(x.shape, mesh_shape, coordinate, x.placements)
        if all(boff[d] <= int(touched[d]) % x.shape[d] < boff[d] + bshape[d]
               for d in {x.placements[i].dim for i in dims}):
            owner = tuple(coordinate)
            break
    assert owner is not None  # the integers were checked in range by index_plan
    block = x.to_local()
    xp = array_namespace(block)
    _, offset = local_shape_and_offset(x.shape, mesh_shape, me, x.placements)
    result_shape = local_shape_and_offset(shape, mesh_shape, me, out)[0]
    if all(me[i] == owner[i] for i in dims):
        key = []
        d = 0
        for k in expanded:
            if k is None:
                key.append(None)
                continue
            if d in touched and any(x.placements[i].dim == d for i in dims):
                key.append(int(k) % x.shape[d] - offset[d])
            else:
                key.append(local_key[len(key)] if len(key) < len(local_key) else k)
            d += 1
        result = xp.ascontiguousarray(block[tuple(key)])
    else:
        result = xp.empty(result_shape, dtype=block.dtype)
    logger.debug("%s: broadcasting the block of %r from mesh coordinate %s (placements %r -> %r)", op, expanded,
                 owner, x.placements, out)
    for i in reversed(dims):  # innermost first: the owner's row of each outer group then holds it
        if mesh_shape[i] > 1:
            group = mesh.get_group(i)
            root_coordinate = list(me)
            root_coordinate[i] = owner[i]
            root = list(group.ranks).index(int(mesh.mesh[tuple(root_coordinate)]))
            group.broadcast(result, root)
    return DTensor(result, mesh, out, shape=shape)


def _local_slices(x: Any, expanded: list[Any], touched: dict[int, Any], shape: tuple[int, ...],
                  target: tuple[Placement, ...]) -> tuple[Any, ...] | None:
    """This rank's key when every rank's result chunk lies in its own block (arithmetic on every
    coordinate, so all ranks decide alike), else None."""
    mesh_shape = tuple(x.device_mesh.shape)
    me = tuple(x.device_mesh.get_coordinate())
    mine: tuple[Any, ...] | None = None
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        src_shape, src_off = local_shape_and_offset(x.shape, mesh_shape, coordinate, x.placements)
        out_shape, out_off = local_shape_and_offset(shape, mesh_shape, coordinate, target)
        key: list[Any] = []
        d, e = 0, 0
        for k in expanded:
            if k is None:
                key.append(None)
                e += 1
                continue
            if isinstance(k, slice):
                start, _, step = k.indices(x.shape[d])
                if d in touched:
                    first = start + step * out_off[e]
                    count = out_shape[e]
                    lo = first - src_off[d]
                    last = lo + step * (count - 1)
                    if count and not (0 <= lo < src_shape[d] and 0 <= last < src_shape[d]):
                        return None
                    stop = lo + step * count
                    key.append(slice(lo, stop if stop >= 0 else None, step) if count else slice(0, 0))
                elif any(isinstance(p, Shard) and p.dim == d for p in x.placements):
                    key.append(slice(None))
                else:
                    key.append(k)
                e += 1
            else:
                key.append(int(k))
            d += 1
        if coordinate == me:
            mine = tuple(key)
    return mine


def _masked(op: str, x: Any, mask: Any) -> Any:
    """``x[mask]``: a data-dependent length. The mask (a DTensor of ``x``'s leading shape, or a
    plain bool array the same on every rank) and ``x``'s dims it covers are gathered (one
    all-gather per mesh dim sharding them; a Partial mask all-reduced), so every rank selects
    the same elements and learns the result's length from the mask; the dims after the mask keep
    their Shards (renumbered), and a Partial ``x`` stays (selection is linear)."""
    m = mask.ndim
    if m > x.ndim or tuple(mask.shape) != tuple(x.shape[:m]):
        raise IndexError(f"{errors.prefix(op)}boolean index of shape {tuple(mask.shape)} does not match the "
                         f"DTensor of shape {x.shape}")
    if isinstance(mask, DTensor):
        if mask.device_mesh != x.device_mesh:
            raise errors.value_error(op, "the mask is on another mesh than the array")
        mask = moved(op, "mask", mask, [Replicate()] * mask.device_mesh.ndim).to_local()
    src = moved(op, "self", x, [Replicate() if isinstance(p, Shard) and p.dim < m else p for p in x.placements])
    local = src.to_local()
    xp = array_namespace(local)
    block = local[xp.asarray(mask)]
    count = int(np.count_nonzero(np.asarray(mask.get() if hasattr(mask, "get") else mask)))
    placements = tuple(Shard(p.dim - m + 1) if isinstance(p, Shard) else p for p in src.placements)
    return DTensor(block, x.device_mesh, placements, shape=(count, *x.shape[m:]))


def setitem(x: Any, key: Any, value: Any) -> None:
    """``x[key] = value`` with basic keys (integers, slices, ``...``, None) or a boolean mask of
    ``x``'s shape (a DTensor, brought to ``x``'s layout: no communication for ``x > 0``, or a plain
    array sliced locally): each rank writes the part of the selection its block holds (no communication;
    ``value`` a scalar, a plain array the same on every rank broadcast to the selection, or an
    all-Replicate DTensor). On a Partial ``x`` the written elements must reduce to ``value``:
    Partial(sum) writes ``value`` on the ranks of mesh coordinate 0 along that dim and 0 on the
    others; avg, max and min write it on every rank (torch refuses in-place writes to a Partial;
    this rule is exact)."""
    op = "DTensor.__setitem__"
    if isinstance(value, DTensor):
        if not all(p.is_replicate() for p in value.placements):
            raise NotImplementedError(errors.prefix(op) + f"value has placements {value.placements!r}; writing a "
                                      "sharded or Partial value has no DTensor rule: redistribute it to Replicate "
                                      "first")
        value = value.to_local()
    local = x.to_local()
    xp = array_namespace(local)
    mesh = x.device_mesh
    coordinate = tuple(mesh.get_coordinate())
    zero = any(isinstance(p, Partial) and p.reduce_op == "sum" and c != 0 for p, c in zip(x.placements, coordinate))
    if _is_mask(key):
        if tuple(key.shape) != tuple(x.shape):
            raise IndexError(f"{errors.prefix(op)}boolean index of shape {tuple(key.shape)} does not match the "
                             f"DTensor of shape {x.shape}")
        if np.ndim(value) != 0:
            raise NotImplementedError(errors.prefix(op) + "x[mask] = value takes a scalar value on DTensors "
                                      f"(placements {x.placements!r}); for an array value, write on full_tensor()")
        if isinstance(key, DTensor):
            if any(p.is_partial() for p in key.placements):
                raise NotImplementedError(errors.prefix(op) + f"a Partial mask (placements {key.placements!r}) has "
                                          "no rule; redistribute the mask to Replicate first")
            # the mask laid out as x's blocks (a Partial dim of x holds the whole extent): x > 0 already is,
            # a Replicate mask is sliced locally, another Shard moves (a collective every rank reaches)
            target = [p if isinstance(p, Shard) else Replicate() for p in x.placements]
            mine = moved(op, "mask", key, target).to_local()
        else:  # the whole mask on every rank: each takes its block's part
            mine = key[local_slices(x.shape, mesh.shape, coordinate, x.placements)]
        local[xp.asarray(mine)] = 0 if zero else value
        return
    expanded = expand(op, key, x.ndim)
    shape, offset = local_shape_and_offset(x.shape, mesh.shape, coordinate, x.placements)
    local_idx: list[Any] = []
    value_idx: list[Any] = []
    sel_shape: list[int] = []
    d = 0
    for k in expanded:
        if k is None:
            continue
        n = x.shape[d]
        if isinstance(k, slice):
            picked = np.arange(n)[k]
            sel_shape.append(len(picked))
        else:
            if not -n <= k < n:
                raise IndexError(f"{errors.prefix(op)}index {k} is out of bounds for dim {d} with size {n}")
            picked = np.array([int(k) % n])
        inside = (picked >= offset[d]) & (picked < offset[d] + shape[d])
        local_idx.append(picked[inside] - offset[d])
        value_idx.append(np.flatnonzero(inside) if isinstance(k, slice) else np.zeros(int(inside.sum()), np.intp))
        d += 1
    v = np.asarray(value.get() if hasattr(value, "get") else value)
    try:
        full = np.broadcast_to(v, tuple(sel_shape))
    except ValueError:
        raise ValueError(f"{errors.prefix(op)}could not broadcast input array from shape {v.shape} into shape "
                         f"{tuple(sel_shape)}") from None
    ints = [k for k in expanded if k is not None]
    full = full.reshape(tuple(s if isinstance(k, slice) else 1 for k, s in zip(ints, _with_ints(ints, sel_shape))))
    if not all(len(ix) for ix in local_idx):
        return
    part = full[np.ix_(*value_idx)]
    local[np.ix_(*(xp.asarray(ix) for ix in local_idx))] = xp.asarray(np.zeros_like(part) if zero else part)


def _with_ints(keys: list[Any], sel_shape: list[int]) -> list[int]:
    """The selection's shape with a 1 where an integer removed a dim (aligned with ``keys``)."""
    it = iter(sel_shape)
    return [next(it) if isinstance(k, slice) else 1 for k in keys]


INDEXING["getitem"] = getitem
INDEXING["setitem"] = setitem
