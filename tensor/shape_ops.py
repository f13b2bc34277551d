"""``np.transpose`` / ``.T`` and ``np.reshape`` on DTensors: local, placements follow the axes.

Transpose moves each Shard to where its axis goes. Reshape is local where every sharded axis
survives: it starts at the same flat position in the new shape (equal products of the dims
before it) and every rank's chunk boundaries land on whole rows of the new axis, so each rank's
block is exactly the block the new shape gives it (merging ``(B, S, H)`` Shard(0) into
``(B*S, H)`` qualifies when B divides evenly). Anything else moves data, logged at DEBUG: the
sharded mesh dims are gathered (one all-gather each), the array reshaped and cut again along
the new shape's largest axis (a local slice), so the result is as sharded as the input.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any, Sequence

import numpy as np

from .chunks import local_shape_and_offset
from .dispatch import implements
from .dtensor import DTensor
from .placements import Placement, Replicate, Shard
from .propagation import moved, unsupported, wrap

__all__ = ["transpose", "reshape", "reshape_placements"]


@implements(np.transpose)
def transpose(a: Any, axes: Sequence[int] | None = None) -> DTensor:
    """Permute the axes; ``Shard(d)`` becomes ``Shard(axes.index(d))``."""
    if not isinstance(a, DTensor):
        raise unsupported("np.transpose")
    axes = tuple(reversed(range(a.ndim))) if axes is None else tuple(int(x) % a.ndim for x in axes)
    if sorted(axes) != list(range(a.ndim)):
        raise ValueError(f"np.transpose: axes {axes} are not a permutation of {a.ndim} dims")
    placements = [Shard(axes.index(p.dim)) if isinstance(p, Shard) else p for p in a.placements]
    return wrap(np.transpose(a.to_local(), axes), a.device_mesh, placements, tuple(a.shape[x] for x in axes))


def _resolve(old: tuple[int, ...], new: Any) -> tuple[int, ...]:
    new = (int(new),) if isinstance(new, (int, np.integer)) else tuple(int(s) for s in new)
    if new.count(-1) == 1:
        known = math.prod(s for s in new if s != -1)
        new = tuple(math.prod(old) // known if known and s == -1 else s for s in new)
    if math.prod(new) != math.prod(old) or any(s < 0 for s in new):
        raise ValueError(f"np.reshape: cannot reshape an array of shape {old} into shape {new}")
    return new


@functools.lru_cache(maxsize=256)
def reshape_placements(old: tuple[int, ...], new: tuple[int, ...], mesh_shape: tuple[int, ...],
                       placements: tuple[Placement, ...]) -> tuple[Placement, ...] | None:
    """The placements ``new`` gets when every rank's block reshapes locally, or None if some block would not."""
    sharded = sorted({p.dim for p in placements if isinstance(p, Shard)})
    mapping: dict[int, int] = {}
    for d in sharded:
        before = math.prod(old[:d])
        found = [e for e in range(len(new)) if math.prod(new[:e]) == before and (new[e] > 1 or old[d] <= 1)]
        if not found:
            return None
        mapping[d] = found[0]
    targets = [mapping[d] for d in sharded]
    if targets != sorted(set(targets)):
        return None
    result = tuple(Shard(mapping[p.dim]) if isinstance(p, Shard) else p for p in placements)
    bounds_old, bounds_new = sharded[1:] + [len(old)], targets[1:] + [len(new)]
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        so, oo = local_shape_and_offset(old, mesh_shape, coordinate, placements)
        sn, on = local_shape_and_offset(new, mesh_shape, coordinate, result)
        for d, e, bo, bn in zip(sharded, targets, bounds_old, bounds_new):
            ro, rn = math.prod(old[d + 1:bo]), math.prod(new[e + 1:bn])
            if (so[d] * ro, oo[d] * ro) != (sn[e] * rn, on[e] * rn):
                return None
    return result


@implements(np.reshape)
def reshape(a: Any, shape: Any = None, order: str = "C", *, newshape: Any = None, copy: Any = None) -> DTensor:
    """Reshape where the sharded axes survive (see the module docstring)."""
    if not isinstance(a, DTensor):
        raise unsupported("np.reshape")
    if order != "C" or copy is not None:
        raise NotImplementedError("np.reshape: only order='C' (and copy=None) is supported on DTensors")
    new = _resolve(a.shape, shape if shape is not None else newshape)
    placements = reshape_placements(a.shape, new, a.device_mesh.shape, a.placements)
    if placements is None:  # blocks would move between ranks: gather, reshape, cut again
        return _reshape_moving(a, new)
    local_shape = local_shape_and_offset(new, a.device_mesh.shape, a.device_mesh.get_coordinate(), placements)[0]
    return wrap(a.to_local().reshape(local_shape), a.device_mesh, placements, new)


def _reshape_moving(a: DTensor, new: tuple[int, ...]) -> DTensor:
    """Reshape where some rank's block would take elements of another's: each mesh dim that shards
    is gathered (one all-gather per such mesh dim: every rank then holds the whole array for a
    moment), the array reshaped, and cut again along the new shape's largest axis (a local
    slice, so the result is sharded as the input was, by as many mesh dims). A Partial stays
    (reshaping selects elements). Logged at DEBUG, as every move."""
    whole = moved("np.reshape", "a", a, [Replicate() if isinstance(p, Shard) else p for p in a.placements])
    local = whole.to_local().reshape(new)
    if not new:
        return wrap(local, a.device_mesh, whole.placements, new)
    axis = max(range(len(new)), key=lambda d: (new[d], -d))
    target = [Shard(axis) if isinstance(p, Shard) else p for p in a.placements]
    out = wrap(local, a.device_mesh, whole.placements, new)
    return moved("np.reshape", "result", out, target)
