"""Data movement along axes: ``np.diff``, ``np.roll``, ``np.flip``, ``np.pad``.

Along axes no mesh dim shards, each rank works on its block: no communication, every placement
kept. Along a sharded axis the lines cross blocks (a difference needs the next block's first
row, a roll or flip sends rows to other ranks, padding shifts every chunk boundary), so that
axis is first moved off the mesh (:func:`.propagation.off_axes`: one all-to-all to another axis,
each rank sending and receiving about its block once, or an all-gather where no other axis is
free), and the result keeps the moved placements. All four are linear selections or
differences, so a Partial(sum|avg) stays (and a Partial(max|min) through ``roll``, ``flip`` and
``pad``'s copying modes); ``pad`` with a nonzero constant all-reduces a Partial first.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..comm._seams import array_namespace
from . import errors
from .chunks import local_slices
from .dispatch import implements
from .dtensor import DTensor
from .placements import Replicate
from .propagation import moved, norm_axes, off_axes, unsupported, wrap

__all__ = ["diff", "roll", "flip", "pad"]

_SELECTING = ("sum", "avg", "max", "min")


@implements(np.diff)
def diff(a: Any, n: int = 1, axis: int = -1, prepend: Any = np._NoValue, append: Any = np._NoValue) -> DTensor:
    """``np.diff``: local along an unsharded axis; a sharded one moved off first; a Partial(sum|avg)
    stays (differences are linear), max/min are all-reduced. ``prepend``/``append`` (a scalar, a
    plain array the same on every rank, or an all-Replicate DTensor) are cut to each rank's block
    on the other axes and joined locally (no more communication); with them a Partial is
    all-reduced first (the joined values are not terms of a sum)."""
    op = "np.diff"
    if not isinstance(a, DTensor):
        raise unsupported(op)
    if n < 0:
        raise ValueError(errors.prefix(op) + f"order must be non-negative but got {n!r}")
    (ax,) = norm_axes(op, a.ndim, axis)
    extra = {name: v for name, v in (("prepend", prepend), ("append", append)) if v is not np._NoValue}
    src = off_axes(op, "a", a, (ax,), keep_partial=() if extra else ("sum", "avg"))
    shape = list(a.shape)
    if n == 0:  # NumPy returns the input as it is, prepend and append ignored
        return wrap(src.to_local(), a.device_mesh, src.placements, shape)
    mesh = a.device_mesh
    for name, v in extra.items():
        if isinstance(v, DTensor):
            if not all(p.is_replicate() for p in v.placements):
                raise NotImplementedError(errors.prefix(op) + f"{name} is a DTensor with placements {v.placements!r}; "
                                          "pass it all-Replicate (redistribute it first) or as a plain array")
            v = v.to_local()
        v = np.asarray(v.get() if hasattr(v, "get") else v)
        if v.ndim == 0:
            v = np.broadcast_to(v, tuple(1 if d == ax else s for d, s in enumerate(a.shape)))
        elif v.ndim != a.ndim or any(v.shape[d] != s for d, s in enumerate(a.shape) if d != ax):
            raise ValueError(errors.prefix(op) + f"{name} has shape {v.shape}; it must be a scalar or have the "
                             f"shape of a {a.shape} except along axis {ax}")
        shape[ax] += v.shape[ax]
        cut = local_slices(v.shape, mesh.shape, mesh.get_coordinate(), src.placements)  # axis ax is whole
        local = src.to_local()
        extra[name] = array_namespace(local).asarray(np.ascontiguousarray(v[cut]))
    local = np.diff(src.to_local(), n=n, axis=ax, **extra)
    shape[ax] = max(shape[ax] - n, 0)
    return wrap(local, mesh, src.placements, shape)


@implements(np.roll)
def roll(a: Any, shift: Any, axis: Any = None) -> DTensor:
    """``np.roll``: local along unsharded axes; sharded rolled axes moved off first; ``axis=None``
    (the flattened array) gathers to Replicate. Every Partial stays (a permutation)."""
    op = "np.roll"
    if not isinstance(a, DTensor):
        raise unsupported(op)
    if axis is None:
        src = moved(op, "a", a, [p if p.is_partial() else Replicate() for p in a.placements])
        return wrap(np.roll(src.to_local(), shift), a.device_mesh, src.placements, a.shape)
    axes = norm_axes(op, a.ndim, axis)
    src = off_axes(op, "a", a, axes, keep_partial=_SELECTING)
    return wrap(np.roll(src.to_local(), shift, axis=axis), a.device_mesh, src.placements, a.shape)


@implements(np.flip)
def flip(m: Any, axis: Any = None) -> DTensor:
    """``np.flip``: local along unsharded axes; sharded flipped axes moved off first (uneven chunks
    do not mirror onto each other). Every Partial stays."""
    op = "np.flip"
    if not isinstance(m, DTensor):
        raise unsupported(op)
    axes = norm_axes(op, m.ndim, axis)
    src = off_axes(op, "m", m, axes, keep_partial=_SELECTING)
    return wrap(np.flip(src.to_local(), axis=axes), m.device_mesh, src.placements, m.shape)


_PAD_MODES = ("constant", "edge", "reflect", "symmetric", "wrap", "linear_ramp", "maximum", "minimum", "mean",
              "median", "empty")


@implements(np.pad)
def pad(array: Any, pad_width: Any, mode: Any = "constant", **kwargs: Any) -> DTensor:
    """``np.pad``: local along unsharded axes; sharded padded axes moved off first, so each rank's
    block holds whole lines along every padded axis, which is all any mode reads (the statistic
    modes ``maximum``, ``minimum``, ``mean``, ``median`` with their ``stat_length``, and
    ``linear_ramp``); lines along the other axes are independent. Partials: the copying modes
    (edge, reflect, symmetric, wrap) keep every one; zeros (``constant`` 0, ``linear_ramp`` to 0)
    and ``mean`` keep sum|avg (linear, for floats); ``maximum`` keeps max and ``minimum`` min (the extreme of
    the terms' extremes); the rest are all-reduced first. ``empty`` leaves the pad undefined, as
    NumPy does. A callable ``mode`` may read and write anything along every axis (NumPy calls
    it on every line, padded or not), so the array is gathered whole first (all-Replicate)."""
    op = "np.pad"
    if not isinstance(array, DTensor):
        raise unsupported(op)
    if callable(mode):
        src = moved(op, "array", array, [Replicate()] * array.device_mesh.ndim)
        local = np.pad(src.to_local(), pad_width, mode=mode, **kwargs)
        return wrap(local, array.device_mesh, src.placements, local.shape)
    if not isinstance(mode, str) or mode not in _PAD_MODES:
        raise ValueError(errors.prefix(op) + f"mode {mode!r} is not supported; NumPy's modes are {_PAD_MODES} "
                         "or a callable")
    widths = np.broadcast_to(np.asarray(pad_width, dtype=np.intp), (array.ndim, 2))
    padded = tuple(d for d in range(array.ndim) if widths[d].any())
    if mode == "constant":
        keep: tuple[str, ...] = ("sum", "avg") if not np.asarray(kwargs.get("constant_values", 0)).any() else ()
    elif mode in ("linear_ramp", "mean"):  # linear in the line, but NumPy rounds them for integers
        linear = np.dtype(array.dtype).kind in "fc" and (
            mode == "mean" or not np.asarray(kwargs.get("end_values", 0)).any())
        keep = ("sum", "avg") if linear else ()
    elif mode in ("maximum", "minimum"):
        keep = ("max",) if mode == "maximum" else ("min",)
    elif mode in ("median", "empty"):
        keep = () if mode == "median" else _SELECTING
    else:
        keep = _SELECTING
    src = off_axes(op, "array", array, padded, keep_partial=keep)
    local = np.pad(src.to_local(), widths, mode=mode, **kwargs)
    shape = tuple(s + int(widths[d].sum()) for d, s in enumerate(array.shape))
    return wrap(local, array.device_mesh, src.placements, shape)
