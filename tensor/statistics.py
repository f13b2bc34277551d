"""Statistics over axes of a DTensor: ``var``, ``std``, ``average``, ``count_nonzero``, ``any``,
``all``, ``prod``, ``argmax``, ``argmin``, ``median``.

Per mesh dimension, with ``axes`` the reduced axes (every axis for ``axis=None``):

* a Shard on a kept axis stays a Shard (renumbered past the removed axes): no communication;
* Replicate stays Replicate;
* a Shard on a reduced axis is combined by the op's collective, named in each rule's docstring
  (``var``: one all-gather of every rank's ``(count, mean, M2)``, merged by Chan et al.'s
  parallel formula; ``prod``: one all-reduce PRODUCT; ``argmax``: one all-gather of every
  rank's ``(value, global index)``); ``count_nonzero``, ``any``, ``all`` and ``average`` leave a
  Partial (sum, max, min, sum) that the next op that needs the value all-reduces, as ``np.sum``;
  ``median`` moves the sharded axis away first (see :func:`.propagation.off_axes`);
* a Partial is all-reduced first, except where the op is linear in the terms (``average``
  keeps a Partial(sum|avg)).

Dtypes and NaN are NumPy's: ints and bools give float64 statistics, float32 stays float32, a
NaN anywhere in a line gives NaN (``argmax``: the first NaN's index, as NumPy). Complex inputs of
``var``/``std``/``argmax``/``argmin`` are refused (NotImplementedError naming the dtype).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from ..comm import ReduceOp
from ..comm._seams import array_namespace
from . import errors
from .chunks import local_shape_and_offset
from .dispatch import implements
from .dtensor import DTensor
from .placements import Partial, Placement, Replicate, Shard
from .propagation import gather_over, moved, no_out, norm_axes, off_axes, reduce_over, reduction_placements, renumbered, \
    uniform_finite, unsupported, wrap

__all__ = ["var", "std", "average", "count_nonzero", "any_", "all_", "prod", "argmax", "argmin", "median"]


def _counts(a: DTensor, placements: list[Placement], axes: tuple[int, ...], merged: list[int]) -> np.ndarray:
    """Elements each rank along the ``merged`` mesh dims reduces, flat in mesh order: arithmetic."""
    mesh = a.device_mesh
    return _counts_of(a.shape, tuple(mesh.shape), tuple(mesh.get_coordinate()), tuple(placements), axes,
                      tuple(merged))


@functools.lru_cache(maxsize=256)
def _counts_of(shape: tuple[int, ...], mesh_shape: tuple[int, ...], me: tuple[int, ...],
               placements: tuple[Placement, ...], axes: tuple[int, ...], merged: tuple[int, ...]) -> np.ndarray:
    sizes = [mesh_shape[i] for i in merged]
    out = np.zeros(sizes, dtype=np.int64)
    for idx in np.ndindex(*sizes):
        coordinate = list(me)
        for i, c in zip(merged, idx):
            coordinate[i] = c
        block = local_shape_and_offset(shape, mesh_shape, coordinate, placements)[0]
        out[idx] = math.prod(block[ax] for ax in axes)
    out = out.reshape(-1)
    out.flags.writeable = False
    return out


def _stats_dtype(op: str, dtype: np.dtype) -> np.dtype:
    if dtype.kind == "c":
        raise NotImplementedError(errors.prefix(op) + f"complex dtype {dtype} has no DTensor rule; compute on "
                                  "full_tensor() (redistribute to Replicate first)")
    if dtype.kind not in "biuf":
        raise errors.type_error(op, f"dtype {dtype} has no variance")
    return dtype if dtype.kind == "f" else np.dtype(np.float64)


@implements(np.var)
def var(a: Any, axis: Any = None, dtype: Any = None, out: Any = None, ddof: Any = 0, keepdims: Any = False,
        *, where: Any = True, mean: Any = None, correction: Any = None) -> DTensor:
    """``np.var``: local ``(count, mean, M2)`` per block, merged over a sharded reduced axis by
    Chan, Golub and LeVeque's parallel formula for all blocks at once (the global mean ``m`` from
    the counts and means, then ``M2 = sum M2_k + sum n_k (m_k - m)^2``, non-negative terms),
    never a sum of squares, so it is as accurate as NumPy's two passes. Cost: one all-gather per
    mesh dim sharding a reduced axis of ``2 x`` the output block (the counts are arithmetic); the
    merge runs in mesh order on every rank, so the result is Replicate there, the same on all
    ranks. A Partial input is all-reduced first."""
    return _moments("np.var", a, axis, dtype, out, ddof, keepdims, where, mean, correction, root=False)


@implements(np.std)
def std(a: Any, axis: Any = None, dtype: Any = None, out: Any = None, ddof: Any = 0, keepdims: Any = False,
        *, where: Any = True, mean: Any = None, correction: Any = None) -> DTensor:
    """``np.std``: the square root of :func:`var` (the same placements and cost)."""
    return _moments("np.std", a, axis, dtype, out, ddof, keepdims, where, mean, correction, root=True)


def _moments(op: str, a: Any, axis: Any, dtype: Any, out: Any, ddof: Any, keepdims: Any, where: Any,
             mean: Any, correction: Any, *, root: bool) -> DTensor:
    if not isinstance(a, DTensor):
        raise unsupported(op)
    no_out(op, {"out": out, "where": where, "mean": mean})
    if correction is not None:
        ddof = correction
    axes = norm_axes(op, a.ndim, axis)
    work = np.dtype(dtype) if dtype is not None else _stats_dtype(op, np.dtype(a.dtype))
    need, placements, merged, shape = reduction_placements(a, axes, bool(keepdims))
    local = moved(op, "a", a, need).to_local()
    xp = array_namespace(local)
    block = local.astype(work, copy=False)
    n_local = math.prod(local.shape[ax] for ax in axes)
    if n_local:
        m = xp.mean(block, axis=axes, keepdims=True)
        dev = block - m
        xp.multiply(dev, dev, out=dev)  # in place, as NumPy's var: one temporary of the block, not two
        m2 = xp.sum(dev, axis=axes, keepdims=True)
    else:
        m = xp.zeros(tuple(1 if d in axes else s for d, s in enumerate(local.shape)), dtype=work)
        m2 = xp.zeros_like(m)
    merged = [i for i in merged if a.device_mesh.shape[i] > 1]  # a mesh dim of one rank has nothing to merge
    if merged:
        counts = _counts(a, need, axes, merged)
        both = gather_over(xp.stack([m, m2]), a.device_mesh, merged)
        both = both.reshape((-1, *both.shape[len(merged):]))[counts > 0]  # empty blocks hold no moments
        weights = xp.asarray((counts[counts > 0] / counts.sum()).astype(work)).reshape((-1,) + (1,) * m.ndim)
        # Chan et al.'s merge of all blocks at once: the global mean, then M2 = sum M2_k + n_k (m_k - m)^2,
        # a sum of non-negative terms (no cancellation, unlike sum(x^2) - n m^2); summed in mesh order
        m = xp.sum(weights * both[:, 0], axis=0)
        delta = both[:, 0] - m
        m2 = xp.sum(both[:, 1], axis=0) + xp.sum(weights * delta * delta, axis=0) * counts.sum()
        n_total = int(counts.sum())
    else:
        n_total = n_local
    with np.errstate(divide="ignore", invalid="ignore"):  # ddof >= count: inf or NaN, as NumPy's
        result = m2 / max(n_total - ddof, 0)
    if root:
        result = xp.sqrt(result)
    if not keepdims:
        result = result.reshape(tuple(s for d, s in enumerate(result.shape) if d not in axes))
    result = result.astype(work, copy=False)
    if dtype is None and np.dtype(a.dtype).kind == "f":
        result = result.astype(a.dtype, copy=False)
    return wrap(result, a.device_mesh, placements, shape)


@implements(np.average)
def average(a: Any, axis: Any = None, weights: Any = None, returned: bool = False, *, keepdims: Any = False
            ) -> Any:
    """``np.average``: ``sum(a * w) / sum(w)`` with ``w`` a plain array (the same on every rank) or an
    all-Replicate DTensor: each rank weighs its own block (the weights are sliced to it), so a
    sharded reduced axis leaves Partial(sum) as ``np.sum`` does, no communication here; a
    Partial(sum|avg) input stays (the average is linear in it) where the weights are finite.
    Without weights, :func:`np.mean`'s rule."""
    op = "np.average"
    if not isinstance(a, DTensor):
        raise unsupported(op)
    if weights is None:
        result = np.mean(a, axis=axis, keepdims=bool(keepdims))
        if returned:
            count = a.size if axis is None else math.prod(a.shape[d] for d in norm_axes(op, a.ndim, axis))
            return result, float(count)
        return result
    if isinstance(weights, DTensor):
        if not all(p.is_replicate() for p in weights.placements):
            raise unsupported(op, a.placements, weights.placements)
        weights = weights.to_local()
    w = np.asarray(weights.get() if hasattr(weights, "get") else weights)
    axes = norm_axes(op, a.ndim, axis)
    if w.shape != a.shape:
        if axis is None:
            raise TypeError(errors.prefix(op) + "axis must be specified when shapes of a and weights differ")
        if w.ndim != 1 or len(axes) != 1:
            raise TypeError(errors.prefix(op) + "1D weights expected when shapes of a and weights differ")
        if w.shape[0] != a.shape[axes[0]]:
            raise ValueError(errors.prefix(op) + "length of weights differs from that of the specified axis")
        w = w.reshape(tuple(-1 if d == axes[0] else 1 for d in range(a.ndim)))
    full_w = np.broadcast_to(w, a.shape)
    wsum = np.sum(full_w, axis=axes, keepdims=bool(keepdims))
    if np.any(wsum == 0.0):
        raise ZeroDivisionError(errors.prefix(op) + "weights sum to zero, can't be normalized")
    keep = ("sum", "avg") if uniform_finite(w) else ()
    need, placements, merged, shape = reduction_placements(a, axes, bool(keepdims), keep)
    for i in merged:
        placements[i] = Partial("sum")
    src = moved(op, "a", a, need)
    local = src.to_local()
    xp = array_namespace(local)
    from .chunks import local_slices
    coordinate = a.device_mesh.get_coordinate()
    wl = xp.asarray(np.ascontiguousarray(full_w[local_slices(a.shape, a.device_mesh.shape, coordinate, need)]))
    dt = np.result_type(a.dtype, w.dtype, np.float64 if np.dtype(a.dtype).kind in "biu" else a.dtype)
    num = xp.sum(local * wl, axis=axes, keepdims=bool(keepdims), dtype=dt)
    out_slices = local_slices(shape, a.device_mesh.shape, coordinate, placements)
    den = np.asarray(wsum, dtype=dt)
    den_local = xp.asarray(np.ascontiguousarray(den[out_slices]) if den.ndim else den)
    result = wrap((num / den_local).astype(dt, copy=False), a.device_mesh, placements, shape)
    if returned:
        return result, wrap(xp.asarray(np.broadcast_to(den, shape)[out_slices]).astype(dt), a.device_mesh,
                            [Replicate() if p.is_partial() else p for p in placements], shape)
    return result


def _logical(op: str, fn: Any, partial: str, a: Any, axis: Any, keepdims: Any, dtype: Any = None) -> DTensor:
    """A reduction whose per-block results combine by ``partial`` (sum, max, min): that Partial left."""
    if not isinstance(a, DTensor):
        raise unsupported(op)
    axes = norm_axes(op, a.ndim, axis)
    need, placements, merged, shape = reduction_placements(a, axes, bool(keepdims))
    for i in merged:
        placements[i] = Partial(partial)
    local = moved(op, "a", a, need).to_local()
    result = fn(local, axis=axes, keepdims=bool(keepdims))
    if dtype is not None:
        result = result.astype(dtype, copy=False)
    return wrap(result, a.device_mesh, placements, shape)


@implements(np.count_nonzero)
def count_nonzero(a: Any, axis: Any = None, *, keepdims: bool = False) -> DTensor:
    """``np.count_nonzero``: each rank counts its block; a sharded reduced axis leaves Partial(sum)
    (int64), no communication here. A Partial input is all-reduced first."""
    def fn(x: Any, axis: Any, keepdims: bool) -> Any:
        xp = array_namespace(x)
        return xp.asarray(xp.count_nonzero(x, axis=axis, keepdims=keepdims)).astype(np.intp, copy=False)
    return _logical("np.count_nonzero", fn, "sum", a, axis, keepdims)


@implements(np.any)
def any_(a: Any, axis: Any = None, out: Any = None, keepdims: Any = False, *, where: Any = True) -> DTensor:
    """``np.any``: each rank tests its block; a sharded reduced axis leaves Partial(max) of bools
    (an empty block gives False, max's identity), no communication here."""
    no_out("np.any", {"out": out, "where": where})
    return _logical("np.any", np.any, "max", a, axis, keepdims)


@implements(np.all)
def all_(a: Any, axis: Any = None, out: Any = None, keepdims: Any = False, *, where: Any = True) -> DTensor:
    """``np.all``: each rank tests its block; a sharded reduced axis leaves Partial(min) of bools
    (an empty block gives True, min's identity), no communication here."""
    no_out("np.all", {"out": out, "where": where})
    return _logical("np.all", np.all, "min", a, axis, keepdims)


@implements(np.prod)
def prod(a: Any, axis: Any = None, dtype: Any = None, out: Any = None, keepdims: Any = False,
         initial: Any = None, where: Any = True) -> DTensor:
    """``np.prod``: each rank multiplies its block (an empty one gives 1); a sharded reduced axis is
    combined by one all-reduce PRODUCT per mesh dim of the output block: Replicate there. A
    Partial input is all-reduced first. Integers wrap as NumPy's."""
    op = "np.prod"
    if not isinstance(a, DTensor):
        raise unsupported(op)
    no_out(op, {"out": out, "where": where, "initial": initial})
    axes = norm_axes(op, a.ndim, axis)
    need, placements, merged, shape = reduction_placements(a, axes, bool(keepdims))
    local = moved(op, "a", a, need).to_local()
    result = np.prod(local, axis=axes, dtype=dtype, keepdims=bool(keepdims))
    if merged:
        result = reduce_over(result, a.device_mesh, merged, ReduceOp.PRODUCT)
    return wrap(result, a.device_mesh, placements, shape)


def _arg(op: str, kind: str, a: Any, axis: Any, out: Any, keepdims: Any) -> DTensor:
    if not isinstance(a, DTensor):
        raise unsupported(op)
    no_out(op, {"out": out})
    if np.dtype(a.dtype).kind == "c":
        _stats_dtype(op, np.dtype(a.dtype))
    if a.size == 0:
        raise ValueError(errors.prefix(op) + f"attempt to get {op[3:]} of an empty sequence")
    flat = axis is None
    if not flat and (isinstance(axis, bool) or not isinstance(axis, (int, np.integer))):
        raise TypeError(errors.prefix(op) + f"axis must be an int or None, got {axis!r}")  # NumPy's: one axis
    axes = tuple(range(a.ndim)) if flat else norm_axes(op, a.ndim, axis)
    keep = bool(keepdims)
    need, placements, merged, _ = reduction_placements(a, axes, keep)
    shape = (tuple(1 for _ in a.shape) if keep else ()) if flat else \
        tuple(1 if d in axes else s for d, s in enumerate(a.shape) if keep or d not in axes)
    if flat and keep:
        placements = [Replicate() if isinstance(p, Shard) else p for p in placements]
    local = moved(op, "a", a, need).to_local()
    xp = array_namespace(local)
    mesh = a.device_mesh
    pick = xp.argmax if kind == "max" else xp.argmin
    _, offset = local_shape_and_offset(a.shape, mesh.shape, mesh.get_coordinate(), need)
    empty = local.size == 0 or (not flat and local.shape[axes[0]] == 0)
    if flat:
        if empty:
            idx, val = xp.zeros((), dtype=np.intp), xp.zeros((), dtype=local.dtype)
        else:
            k = int(pick(local))
            idx = xp.asarray(_global_flat(k, local.shape, offset, a.shape), dtype=np.intp)
            val = local.reshape(-1)[k]
    else:
        ax = axes[0]
        if empty:
            rest = tuple(s for d, s in enumerate(local.shape) if d != ax)
            idx, val = xp.zeros(rest, dtype=np.intp), xp.zeros(rest, dtype=local.dtype)
        else:
            i = pick(local, axis=ax)
            val = xp.take_along_axis(local, xp.expand_dims(i, ax), axis=ax).squeeze(ax)
            idx = i + offset[ax]
    merged = [i for i in merged if mesh.shape[i] > 1]  # a mesh dim of one rank has nothing to merge
    if merged:
        counts = _counts(a, need, axes, merged)
        if np.dtype(local.dtype).itemsize <= 4 or local.dtype == np.float64:  # both exact in float64: one all-gather
            both = gather_over(xp.stack([val.astype(np.float64), idx.astype(np.float64)]), mesh, merged)
            both = both.reshape((-1, 2, *val.shape))
            vals, idxs = both[:, 0].astype(local.dtype, copy=False), both[:, 1].astype(np.int64)
        else:  # 64-bit integers: values and indices gathered apart
            vals = gather_over(val, mesh, merged).reshape((-1, *val.shape))
            idxs = gather_over(idx.astype(np.int64), mesh, merged).reshape((-1, *idx.shape))
        valid = counts > 0
        vals, idxs = vals[valid], idxs[valid]
        best = (xp.max if kind == "max" else xp.min)(vals, axis=0)  # NaN where any candidate is NaN
        hit = vals == best
        if np.dtype(local.dtype).kind == "f":
            hit |= xp.isnan(vals) & xp.isnan(best)
        idx = xp.min(xp.where(hit, idxs, np.iinfo(np.int64).max), axis=0)  # the first in global order
    idx = idx.astype(np.intp, copy=False)
    if keep:
        idx = idx.reshape(shape) if flat else xp.expand_dims(idx, axes[0])
    return wrap(idx, mesh, placements, shape)


def _global_flat(k: int, local_shape: tuple[int, ...], offset: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """The global flat (C order) index of the block's flat index ``k``."""
    flat, stride = 0, 1
    for size, block, off in zip(reversed(shape), reversed(local_shape), reversed(offset)):
        k, within = divmod(k, block)
        flat += (within + off) * stride
        stride *= size
    return flat


@implements(np.argmax)
def argmax(a: Any, axis: Any = None, out: Any = None, *, keepdims: Any = False) -> DTensor:
    """``np.argmax``: each rank's ``(max, its global index)`` per line; over a sharded reduced axis
    one all-gather per mesh dim of both packed as float64 (2 x the output block; two all-gathers
    for 64-bit integers, which float64 does not hold exactly) picks the first maximum in global
    order (the first NaN, as NumPy): Replicate there. ``axis=None``: global flat indices."""
    return _arg("np.argmax", "max", a, axis, out, keepdims)


@implements(np.argmin)
def argmin(a: Any, axis: Any = None, out: Any = None, *, keepdims: Any = False) -> DTensor:
    """``np.argmin``: as :func:`argmax`, the first minimum."""
    return _arg("np.argmin", "min", a, axis, out, keepdims)


@implements(np.median)
def median(a: Any, axis: Any = None, out: Any = None, overwrite_input: bool = False, keepdims: bool = False
           ) -> DTensor:
    """``np.median``: the reduced axes moved off the mesh first (:func:`.propagation.off_axes`: a
    Shard there goes by one all-to-all to a kept axis, else one all-gather; a Partial is
    all-reduced), then each rank's lines are whole and NumPy's median runs on them; kept Shards
    stay. ``axis=None`` gathers the whole array (every rank sorts it: for large arrays,
    redistribute to a layout with a kept axis and give ``axis``)."""
    op = "np.median"
    if not isinstance(a, DTensor):
        raise unsupported(op)
    no_out(op, {"out": out})
    axes = norm_axes(op, a.ndim, axis)
    src = off_axes(op, "a", a, axes)
    result = np.median(src.to_local(), axis=axes if axis is not None else None, keepdims=keepdims)
    keep = bool(keepdims)
    shape = tuple(1 if d in axes else s for d, s in enumerate(a.shape) if keep or d not in axes)
    placements = list(src.placements) if keep else renumbered(src.placements, axes)
    return wrap(array_namespace(src.to_local()).asarray(result), a.device_mesh, placements, shape)
