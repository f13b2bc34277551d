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

from . import errors
from .dispatch import implements
from .dtensor import DTensor
from .placements import Replicate
from .propagation import moved, norm_axes, off_axes, refuse_kwargs, unsupported, wrap

__all__ = ["diff", "roll", "flip", "pad"]

_SELECTING = ("sum", "avg", "max", "min")


@implements(np.diff)
def diff(a: Any, n: int = 1, axis: int = -1, prepend: Any = np._NoValue, append: Any = np._NoValue) -> DTensor:
    """``np.diff``: local along an unsharded axis; a sharded one moved off first; a Partial(sum|avg)
    stays (differences are linear), max/min are all-reduced."""
    op = "np.diff"
    if not isinstance(a, DTensor):
        raise unsupported(op)
    refuse_kwargs(op, {"prepend": prepend, "append": append}, a.placements)
    if n < 0:
        raise ValueError(errors.prefix(op) + f"order must be non-negative but got {n!r}")
    (ax,) = norm_axes(op, a.ndim, axis)
    src = off_axes(op, "a", a, (ax,), keep_partial=("sum", "avg"))
    local = np.diff(src.to_local(), n=n, axis=ax)
    shape = list(a.shape)
    shape[ax] = max(a.shape[ax] - n, 0)
    return wrap(local, a.device_mesh, src.placements, shape)


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


@implements(np.pad)
def pad(array: Any, pad_width: Any, mode: Any = "constant", **kwargs: Any) -> DTensor:
    """``np.pad``: local along unsharded axes; sharded padded axes moved off first. A Partial stays
    for the copying modes (edge, reflect, symmetric, wrap) and for zeros (sum|avg)."""
    op = "np.pad"
    if not isinstance(array, DTensor):
        raise unsupported(op)
    if not isinstance(mode, str) or mode not in ("constant", "edge", "reflect", "symmetric", "wrap"):
        raise NotImplementedError(errors.prefix(op) + f"mode={mode!r} has no DTensor rule (placements "
                                  f"{array.placements!r}); pad full_tensor() (redistribute to Replicate first)")
    widths = np.broadcast_to(np.asarray(pad_width, dtype=np.intp), (array.ndim, 2))
    padded = tuple(d for d in range(array.ndim) if widths[d].any())
    if mode == "constant":
        values = np.asarray(kwargs.get("constant_values", 0))
        keep: tuple[str, ...] = ("sum", "avg") if not values.any() else ()
    else:
        keep = _SELECTING
    src = off_axes(op, "array", array, padded, keep_partial=keep)
    local = np.pad(src.to_local(), widths, mode=mode, **kwargs)
    shape = tuple(s + int(widths[d].sum()) for d, s in enumerate(array.shape))
    return wrap(local, array.device_mesh, src.placements, shape)
