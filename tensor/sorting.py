"""``np.sort`` and ``np.argsort`` on DTensors: the sorted axis made whole on every rank first.

Choice and cost: a Shard on the sorted axis moves to another axis by one all-to-all
(:func:`.propagation.off_axes`: each rank sends and receives about its block once, and the
result stays sharded, on that other axis), and only where no other axis is free (1-D arrays,
``axis=None``) is it all-gathered, every rank then sorting the whole line. A sample-sort (sample,
choose splitters, all-to-all by splitter, local sort, rebalance to ``torch.chunk`` sizes) would
keep a 1-D array sharded but costs two all-to-alls, an all-gather of the samples and the
rebalancing for the same result; the move costs one all-to-all (docs/dtensor.md has the
figures). A Shard on another axis stays; a Partial is all-reduced first (sorting is not linear).
NaN sorts last, as NumPy's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..comm._seams import array_namespace
from .dispatch import implements
from .dtensor import DTensor
from .placements import Replicate
from .propagation import moved, norm_axes, off_axes, refuse_kwargs, unsupported, wrap

__all__ = ["sort", "argsort"]


def _sorted(op: str, fn: Any, a: Any, axis: Any, kind: Any, order: Any, stable: Any) -> DTensor:
    if not isinstance(a, DTensor):
        raise unsupported(op)
    refuse_kwargs(op, {"order": order}, a.placements)
    if axis is None:  # the flattened array: gathered whole (a 1-D result has no other axis to shard)
        src = moved(op, "a", a, [Replicate()] * a.device_mesh.ndim)
        local = src.to_local().reshape(-1)
        return wrap(fn(local, axis=0, kind=kind, stable=stable), a.device_mesh, src.placements, (a.size,))
    (ax,) = norm_axes(op, a.ndim, axis)
    src = off_axes(op, "a", a, (ax,))
    local = src.to_local()
    xp = array_namespace(local)
    result = fn(local, axis=ax, kind=kind) if xp is not np else fn(local, axis=ax, kind=kind, stable=stable)
    return wrap(result, a.device_mesh, src.placements, a.shape)


@implements(np.sort)
def sort(a: Any, axis: Any = -1, kind: Any = None, order: Any = None, *, stable: Any = None) -> DTensor:
    """``np.sort``: the axis moved off the mesh (one all-to-all, or an all-gather where no other axis
    is free), then sorted locally; the result keeps the moved placements."""
    return _sorted("np.sort", np.sort, a, axis, kind, order, stable)


@implements(np.argsort)
def argsort(a: Any, axis: Any = -1, kind: Any = None, order: Any = None, *, stable: Any = None) -> DTensor:
    """``np.argsort``: as :func:`sort`; the lines are whole, so the local indices are the global ones."""
    return _sorted("np.argsort", np.argsort, a, axis, kind, order, stable)
