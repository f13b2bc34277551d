"""``np.cumsum`` and ``np.cumprod`` on DTensors: a local scan plus an exclusive scan of shard totals.

Along an axis no mesh dim shards, each rank scans its block: no communication, every placement
kept (a Partial(sum|avg) stays through ``cumsum``, which is linear in the terms). Along a sharded
axis each rank scans its block, then learns the totals of the blocks before it along that axis
(one all-gather per mesh dim sharding the axis, of one line: the last of each rank's scan, of
the output block's size without the axis) and adds (multiplies by) their sum (product) in chunk
order: an exclusive scan of the shard totals, on every rank alike. An empty block contributes
0 (1). ``cumprod`` all-reduces a Partial first; ``axis=None`` (the flattened array) gathers to
Replicate unless the array is 1-D. NaN and inf propagate as in NumPy's sequential scan.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..comm._seams import array_namespace
from .dispatch import implements
from .dtensor import DTensor, _wrap
from .placements import Replicate
from .propagation import moved, no_out, norm_axes, unsupported, wrap
from . import reduction_plan as _plans
from .reduction_plan import gatherer, keep_compiled, reduction_plan

__all__ = ["cumsum", "cumprod"]


def _scan(op: str, kind: str, a: Any, axis: Any, dtype: Any, out: Any) -> DTensor:
    key = None
    if a.__class__ is DTensor and axis.__class__ is int and dtype is None and out is None:  # an exact key: compiled
        local = a._local
        key = (op, id(a._mesh), a._shape, a._placements, local.dtype, local.__class__, axis)
        found = _plans._compiled.get(key)  # compiled(key, mesh), inlined: the hot path
        if found is not None and found[0]() is a._mesh:
            return found[1](a)
    if not isinstance(a, DTensor):
        raise unsupported(op)
    no_out(op, {"out": out})
    keep = ("sum", "avg") if kind == "sum" else ()
    mesh = a.device_mesh
    if axis is None and a.ndim != 1:  # C order of the flattened array interleaves the blocks
        src = moved(op, "a", a, [Replicate()] * mesh.ndim)
        fn = np.cumsum if kind == "sum" else np.cumprod
        return wrap(fn(src.to_local(), dtype=dtype), mesh, src.placements, (a.size,))
    (ax,) = norm_axes(op, a.ndim, 0 if axis is None else axis)
    plan = reduction_plan(mesh, a.shape, a.placements, (ax,), True, keep)  # its merged dims shard the axis
    src = moved(op, "a", a, plan.need)
    local = src.to_local()
    xp = array_namespace(local)
    result = local.cumsum(axis=ax, dtype=dtype) if kind == "sum" else local.cumprod(axis=ax, dtype=dtype)
    if plan.merged:
        if result.shape[ax]:
            total = result[(slice(None),) * ax + (slice(-1, None),)]  # the last line: a view
        else:
            total = (xp.zeros if kind == "sum" else xp.ones)(plan.reduced_block, dtype=result.dtype)
        if plan.position:  # the totals of the blocks before this one: an exclusive scan
            totals = plan.gather(total, empty=True)[:plan.position]  # empty blocks' totals: 0 (1)
            carry = totals.sum(axis=0) if kind == "sum" else totals.prod(axis=0)
            if carry.dtype != result.dtype:
                carry = carry.astype(result.dtype)
            if kind == "sum":
                result += carry  # result is the scan's own array
            else:
                result *= carry
        else:  # the first block adds nothing, but takes part in the collective
            plan.gather(total, empty=True)
    if key is not None and local.__class__ is np.ndarray and src is a and len(plan.groups) <= 1 and \
            plan.valid is None and result.shape[ax]:
        keep_compiled(key, mesh, _scan_call(plan, kind, ax, result.dtype, a._placements, a._shape))
    return _wrap(result, mesh, src.placements, a.shape if axis is not None else (a.size,))


def _scan_call(plan: Any, kind: str, ax: int, dtype: Any, placements: Any, shape: tuple[int, ...]) -> Any:
    """:func:`_scan` along a given axis compiled for one request (every block holding lines): the
    block's scan, one prepared all-gather of its last line, the carry of the blocks before."""
    gather = gatherer(plan, plan.reduced_block, dtype) if plan.groups else None
    last = (slice(None),) * ax + (slice(-1, None),)
    position = plan.position

    def call(a: DTensor) -> DTensor:
        local = a._local
        result = local.cumsum(axis=ax) if kind == "sum" else local.cumprod(axis=ax)
        if gather is not None:
            totals = gather(result[last][None])
            if position:
                totals = totals[:position]
                carry = totals.sum(axis=0) if kind == "sum" else totals.prod(axis=0)
                if carry.dtype != dtype:
                    carry = carry.astype(dtype)
                if kind == "sum":
                    result += carry
                else:
                    result *= carry
        return _wrap(result, a._mesh, placements, shape)
    return call


@implements(np.cumsum)
def cumsum(a: Any, axis: Any = None, dtype: Any = None, out: Any = None) -> DTensor:
    """``np.cumsum``: local scan plus an exclusive scan of the shard totals (one all-gather of one
    line per mesh dim sharding the axis); placements kept, a Partial(sum|avg) included."""
    return _scan("np.cumsum", "sum", a, axis, dtype, out)


@implements(np.cumprod)
def cumprod(a: Any, axis: Any = None, dtype: Any = None, out: Any = None) -> DTensor:
    """``np.cumprod``: as :func:`cumsum` with products; a Partial is all-reduced first."""
    return _scan("np.cumprod", "prod", a, axis, dtype, out)
