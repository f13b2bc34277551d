"""``np.concatenate``, ``np.split`` / ``np.array_split`` and ``np.take`` on DTensors.

Per mesh dimension, with ``axis`` the axis joined, cut or indexed:

* a Shard on another axis stays a Shard (renumbered past ``take``'s index dims): each rank
  joins, cuts or indexes its own block;
* a Shard on ``axis`` itself is first gathered to Replicate on that mesh dim (logged at DEBUG):
  the pieces of uneven chunks interleave across ranks, so no block of the result is one
  rank's; ``take`` along a sharded axis likewise (a masked Partial, torch's vocab-parallel
  embedding, is not done);
* a Partial stays (joining, cutting and selecting elements commute with reducing the terms),
  for ``concatenate`` only where every operand has that same Partial, else it is reduced first;
* ``concatenate`` with operands Shard on different axes: every operand takes the first
  operand's Shard (a Replicate is sliced locally), else Replicate.

``take``'s indices are a plain array (or list or int), the same on every rank, as a scalar
operand of a ufunc is; ``axis=None`` (the flattened array) gathers to Replicate first.
"""

from __future__ import annotations

import numbers
from typing import Any, Sequence

import numpy as np

from ..comm._seams import array_namespace
from . import errors
from .dispatch import implements
from .dtensor import DTensor
from .placements import Placement, Replicate, Shard
from .propagation import common_mesh, moved, no_out, unsupported, wrap

__all__ = ["concatenate", "split", "array_split", "take"]


def _axis(op: str, axis: Any, ndim: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral) or not -ndim <= axis < ndim:
        raise errors.value_error(op, f"axis must be an int in [{-ndim}, {ndim}) for {ndim} dims, got {axis!r}")
    return int(axis) % ndim


def _off_axis(a: DTensor, axis: int) -> list[Placement]:
    """``a``'s placements with a Shard on ``axis`` made Replicate."""
    return [Replicate() if isinstance(p, Shard) and p.dim == axis else p for p in a.placements]


@implements(np.concatenate)
def concatenate(arrays: Sequence[Any], axis: Any = 0, out: Any = None, *, dtype: Any = None,
                casting: str = "same_kind") -> DTensor:
    """``np.concatenate`` of DTensors (see the module's rules)."""
    op = "np.concatenate"
    no_out(op, {"out": out, "dtype": dtype})
    arrays = tuple(arrays)
    mesh = common_mesh(op, arrays)
    if not all(isinstance(x, DTensor) for x in arrays):
        raise unsupported(op, *(x.placements for x in arrays if isinstance(x, DTensor)))
    if axis is None:  # NumPy flattens each operand first: only whole arrays flatten locally
        blocks = [moved(op, f"array {k}", x, [Replicate()] * mesh.ndim).to_local() for k, x in enumerate(arrays)]
        local = np.concatenate(blocks, axis=None, casting=casting)
        return wrap(local, mesh, [Replicate()] * mesh.ndim, local.shape)
    first = arrays[0]
    ax = _axis(op, axis, first.ndim)
    for k, x in enumerate(arrays):  # checked on the global shapes: every rank raises alike
        if x.ndim != first.ndim or any(x.shape[d] != first.shape[d] for d in range(first.ndim) if d != ax):
            raise errors.value_error(op, f"array {k} has shape {x.shape} and array 0 {first.shape}: all but axis "
                                         f"{ax} must match")
    targets: list[Placement] = []
    for i in range(mesh.ndim):
        ps = [x.placements[i] for x in arrays]
        shard = next((p for p in ps if isinstance(p, Shard) and p.dim != ax), None)
        if shard is not None:
            targets.append(shard)
        elif ps[0].is_partial() and all(p == ps[0] for p in ps):
            targets.append(ps[0])
        else:
            targets.append(Replicate())
    blocks = [moved(op, f"array {k}", x, targets).to_local() for k, x in enumerate(arrays)]
    shape = list(first.shape)
    shape[ax] = sum(x.shape[ax] for x in arrays)
    return wrap(np.concatenate(blocks, axis=ax, casting=casting), mesh, targets, shape)


def _cuts(op: str, n: int, indices_or_sections: Any, even: bool) -> list[tuple[int, int]]:
    """``(start, stop)`` of each piece of a length-``n`` axis, as ``np.split`` / ``np.array_split``."""
    if isinstance(indices_or_sections, numbers.Integral) and not isinstance(indices_or_sections, bool):
        sections = int(indices_or_sections)
        if sections <= 0:
            raise errors.value_error(op, f"number of sections must be larger than 0, got {sections}")
        if even and n % sections:
            raise errors.value_error(op, f"array split does not result in an equal division: axis of length {n} "
                                         f"into {sections} sections")
        size, extra = divmod(n, sections)
        bounds = np.cumsum([0] + extra * [size + 1] + (sections - extra) * [size]).tolist()
    else:
        bounds = [0, *(int(i) for i in indices_or_sections), n]
    # NumPy slices ary[a:b] (negative bounds count from the end, backward ones give empty pieces)
    pieces = [range(n)[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    return [(r.start, r.start + len(r)) for r in pieces]


def _split(op: str, ary: Any, indices_or_sections: Any, axis: Any, even: bool) -> list[DTensor]:
    if not isinstance(ary, DTensor):
        raise unsupported(op)
    ax = _axis(op, axis, ary.ndim)
    cuts = _cuts(op, ary.shape[ax], indices_or_sections, even)
    src = moved(op, "ary", ary, _off_axis(ary, ax))
    block = src.to_local()
    out = []
    for a, b in cuts:
        key = (slice(None),) * ax + (slice(a, b),)
        shape = list(ary.shape)
        shape[ax] = b - a
        out.append(wrap(block[key], ary.device_mesh, src.placements, shape))
    return out


@implements(np.split)
def split(ary: Any, indices_or_sections: Any, axis: int = 0) -> list[DTensor]:
    """``np.split``: pieces along ``axis``, each with ``ary``'s placements (a Shard on ``axis`` gathered first)."""
    return _split("np.split", ary, indices_or_sections, axis, even=True)


@implements(np.array_split)
def array_split(ary: Any, indices_or_sections: Any, axis: int = 0) -> list[DTensor]:
    """``np.array_split``: as :func:`split`, pieces of unequal length allowed."""
    return _split("np.array_split", ary, indices_or_sections, axis, even=False)


@implements(np.take)
def take(a: Any, indices: Any, axis: Any = None, out: Any = None, mode: str = "raise") -> DTensor:
    """``np.take`` of a DTensor with plain indices (see the module's rules).

    ``mode`` is applied here, on the host indices, and the block is indexed with in-range
    indices only: ``cupy.take`` has no ``mode`` (CuPy 14 raises TypeError for it) and wraps
    out-of-range indices silently where NumPy's default raises.
    """
    op = "np.take"
    no_out(op, {"out": out})
    if isinstance(indices, DTensor):
        if not all(p.is_replicate() for p in indices.placements):
            raise unsupported(op, indices.placements)
        indices = indices.to_local()
    if not isinstance(a, DTensor):
        raise unsupported(op)
    if mode not in _TAKE_MODES:
        raise errors.value_error(op, f"mode must be one of {list(_TAKE_MODES)}, got {mode!r}")
    idx = _host_indices(op, indices)
    if axis is None:
        src = moved(op, "a", a, [Replicate()] * a.device_mesh.ndim)
        block = src.to_local()
        local = np.take(block, _like(_in_range(op, idx, int(np.prod(a.shape)), None, mode), block))
        return wrap(local, a.device_mesh, src.placements, np.shape(local))
    ax = _axis(op, axis, a.ndim)
    idx = _in_range(op, idx, a.shape[ax], ax, mode)  # on the global size, every rank alike
    src = moved(op, "a", a, _off_axis(a, ax))
    shift = idx.ndim - 1
    placements = [Shard(p.dim + shift) if isinstance(p, Shard) and p.dim > ax else p for p in src.placements]
    shape = a.shape[:ax] + idx.shape + a.shape[ax + 1:]
    return wrap(np.take(src.to_local(), _like(idx, src.to_local()), axis=ax), a.device_mesh, placements, shape)


#: np.take's modes (numpy/_core/fromnumeric.py); the order is NumPy's message's.
_TAKE_MODES = ("raise", "wrap", "clip")


def _host_indices(op: str, indices: Any) -> np.ndarray:
    """The indices as a host integer array (a device array of indices is refused: the same on every
    rank, as a scalar operand, they are the caller's host values)."""
    if hasattr(indices, "__cuda_array_interface__"):
        raise errors.type_error(op, f"indices must be host integers (a list or NumPy array, the same on every "
                                    f"rank), got a device array {type(indices).__module__}."
                                    f"{type(indices).__name__}; pass indices.get()")
    idx = np.asarray(indices)
    if idx.dtype.kind not in "iu" and idx.size:
        raise errors.type_error(op, f"indices must be integers, got dtype {idx.dtype}")
    return idx.astype(np.intp, copy=False)


def _in_range(op: str, idx: np.ndarray, n: int, axis: int | None, mode: str) -> np.ndarray:
    """``idx`` made non-negative and below ``n`` as NumPy's ``mode`` does: 'raise' refuses an index
    outside ``[-n, n)`` with NumPy's IndexError, 'wrap' takes it modulo ``n``, 'clip' clamps it to
    ``[0, n - 1]`` (negative indices clip to 0: NumPy's clip disables counting from the end)."""
    if not idx.size:
        return idx
    where = f"axis {axis}" if axis is not None else "the flattened array"
    if n == 0:
        raise IndexError(f"{errors.prefix(op)}cannot do a non-empty take from an empty {where} (size 0)")
    if mode == "raise":
        high, low = int(idx.max()), int(idx.min())
        if high >= n or low < -n:
            bad = high if high >= n else low
            raise IndexError(f"{errors.prefix(op)}index {bad} is out of bounds for {where} with size {n}")
        return idx % n
    if mode == "wrap":
        return idx % n
    return np.clip(idx, 0, n - 1)


def _like(idx: np.ndarray, block: Any) -> Any:
    """The host indices where the block is (CuPy's take wants device indices for a device block)."""
    return array_namespace(block).asarray(idx)
