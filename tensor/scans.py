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
from .dtensor import DTensor
from .placements import Partial, Replicate, Shard
from .propagation import gather_over, moved, no_out, norm_axes, unsupported, wrap

__all__ = ["cumsum", "cumprod"]


def _scan(op: str, kind: str, a: Any, axis: Any, dtype: Any, out: Any) -> DTensor:
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
    need = [Replicate() if isinstance(p, Partial) and p.reduce_op not in keep else p for p in a.placements]
    src = moved(op, "a", a, need)
    local = src.to_local()
    xp = array_namespace(local)
    fn = xp.cumsum if kind == "sum" else xp.cumprod
    result = fn(local, axis=ax, dtype=dtype)
    merged = [i for i, p in enumerate(need) if isinstance(p, Shard) and p.dim == ax]
    if merged:
        rest = tuple(s for d, s in enumerate(result.shape) if d != ax)
        if result.shape[ax]:
            total = xp.take(result, -1, axis=ax)
        else:
            total = (xp.zeros if kind == "sum" else xp.ones)(rest, dtype=result.dtype)
        totals = gather_over(total, mesh, merged).reshape((-1, *rest))
        me = mesh.get_coordinate()
        position = int(np.ravel_multi_index(tuple(me[i] for i in merged), tuple(mesh.shape[i] for i in merged)))
        if position:
            before = totals[:position]
            carry = xp.sum(before, axis=0) if kind == "sum" else xp.prod(before, axis=0)
            carry = xp.expand_dims(carry.astype(result.dtype, copy=False), ax)
            result = result + carry if kind == "sum" else result * carry
    return wrap(result, mesh, src.placements, a.shape if axis is not None else (a.size,))


@implements(np.cumsum)
def cumsum(a: Any, axis: Any = None, dtype: Any = None, out: Any = None) -> DTensor:
    """``np.cumsum``: local scan plus an exclusive scan of the shard totals (one all-gather of one
    line per mesh dim sharding the axis); placements kept, a Partial(sum|avg) included."""
    return _scan("np.cumsum", "sum", a, axis, dtype, out)


@implements(np.cumprod)
def cumprod(a: Any, axis: Any = None, dtype: Any = None, out: Any = None) -> DTensor:
    """``np.cumprod``: as :func:`cumsum` with products; a Partial is all-reduced first."""
    return _scan("np.cumprod", "prod", a, axis, dtype, out)
