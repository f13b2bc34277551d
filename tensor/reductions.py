"""``np.sum``, ``np.mean``, ``np.max``, ``np.min`` on DTensors.

Per mesh dimension: a Shard on a reduced axis becomes Partial (sum for sum and mean, max for
max, min for min): each rank reduces its block, the ranks' results still to be combined; a
Shard on a kept axis stays a Shard (its index shifted past the removed axes); Replicate stays
Replicate; a Partial the reduction is linear in (sum/avg under sum or mean, max under max, min
under min) stays, any other Partial is all-reduced first (logged at DEBUG). ``mean`` divides each
block's sum by the global count, so the Partial terms add up to the mean, uneven shards included.
An empty block (a trailing rank of an uneven cut) contributes the identity of max or min (the
dtype's least or greatest value: False/True for bool, -inf/inf for floats). Complex arrays, which
no MAX/MIN collective orders, are gathered over the reduced sharded axes and reduced whole; other
dtypes no collective carries (datetime, objects) raise TypeError on every rank.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..comm._seams import array_namespace
from . import errors
from .dispatch import implements
from .dtensor import DTensor, _wrap
from .placements import Replicate, Shard
from .propagation import moved, no_out, unsupported, wrap
from .reduction_plan import reduction_plan

__all__ = ["total", "mean", "maximum", "minimum", "logsumexp"]

#: reduction -> (the Partial it leaves, the Partial ops it passes through)
_KINDS = {"sum": ("sum", ("avg", "sum")), "mean": ("sum", ("avg", "sum")),
          "max": ("max", ("max",)), "min": ("min", ("min",))}


def _identity(kind: str, dtype: Any) -> Any:
    """The value an empty block contributes to a max (min): the dtype's least (greatest)."""
    if dtype.kind == "b":
        return kind == "min"
    if dtype.kind == "f":
        return -np.inf if kind == "max" else np.inf
    info = np.iinfo(dtype)  # integers: _reduce let through only kinds "biuf" (complex is gathered)
    return info.min if kind == "max" else info.max


def _axes(op: str, a: DTensor, axis: Any) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(a.ndim))
    if axis.__class__ is int and -a.ndim <= axis < a.ndim:  # the common case
        return (axis % a.ndim,)
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    out = []
    for ax in axes:
        if not -a.ndim <= ax < a.ndim:
            raise np.exceptions.AxisError(int(ax), a.ndim, f"{op}: axis") if hasattr(np, "exceptions") \
                else IndexError(f"{op}: axis {ax} out of range for {a.ndim} dims")
        out.append(int(ax) % a.ndim)
    return tuple(sorted(set(out)))


def _reduce(kind: str, a: Any, axis: Any, keepdims: bool, kwargs: dict[str, Any]) -> DTensor:
    op = f"np.{kind}"
    if not isinstance(a, DTensor):
        raise unsupported(op)
    no_out(op, kwargs, "initial")
    axes = _axes(op, a, axis)
    leaves, passes = _KINDS[kind]
    if kind in ("max", "min"):
        if any(a.shape[ax] == 0 for ax in axes):  # NumPy's error, on every rank alike
            raise ValueError(f"{op}: zero-size array to reduction operation {kind} which has no identity "
                             f"(global shape {a.shape}, axis {axis})")
        sharded_away = any(isinstance(p, Shard) and p.dim in axes for p in a.placements)
        if sharded_away and a.dtype.kind not in "biufc":
            raise errors.type_error(op, f"dtype {a.dtype} over an axis sharded by {a.placements!r} needs a "
                                        f"collective {kind.upper()}, and {a.dtype} cannot be communicated; reduce "
                                        "the to_local() blocks yourself")
    # complex has no order a MAX/MIN collective could use (NumPy's is lexicographic): its blocks
    # are gathered first and reduced whole (decided by the dtype, so alike on every rank)
    gather = kind in ("max", "min") and a.dtype.kind == "c"
    plan = reduction_plan(a.device_mesh, a.shape, a.placements, axes, keepdims, passes)  # the layout facts, kept
    if not gather:
        local = moved(op, "argument 0", a, plan.need).to_local()
        count = math.prod(a.shape[ax] for ax in axes) if kind == "mean" else 0
        return _wrap(_local_reduce(kind, local, axes, keepdims, kwargs.get("dtype"), count),
                     a.device_mesh, plan.leaving(leaves), plan.shape)
    # the blocks of a reduced axis are gathered (Replicate) and reduced whole; the result is the plan's
    need = [Replicate() if i in plan.sharding else p for i, p in enumerate(plan.need)]
    local = moved(op, "argument 0", a, need).to_local()
    return wrap(_local_reduce(kind, local, axes, keepdims, kwargs.get("dtype"), 0), a.device_mesh, plan.out, plan.shape)


def _local_reduce(kind: str, local: Any, axes: tuple[int, ...], keepdims: bool, dtype: Any, count: int) -> Any:
    """This rank's block reduced (``count``: the global number of elements reduced, for ``mean``)."""
    if kind in ("sum", "mean"):
        result = local.sum(axis=axes, dtype=dtype, keepdims=keepdims)  # the method: NumPy's wrapper skipped
        if kind == "mean":
            result = result / count if dtype is None else (result / count).astype(dtype)
        return result
    if any(local.shape[ax] == 0 for ax in axes):  # an empty block (trailing rank): the identity
        xp = array_namespace(local)
        local_shape = tuple(1 if d in axes else s for d, s in enumerate(local.shape) if keepdims or d not in axes)
        return xp.full(local_shape, _identity(kind, local.dtype), dtype=local.dtype)
    return (np.max if kind == "max" else np.min)(local, axis=axes, keepdims=keepdims)


@implements(np.sum)
def total(a: Any, axis: Any = None, dtype: Any = None, out: Any = None, keepdims: bool = False,
          **kwargs: Any) -> DTensor:
    """``np.sum``: a sharded axis summed away leaves Partial(sum)."""
    return _reduce("sum", a, axis, keepdims, {"dtype": dtype, "out": out, **kwargs})


@implements(np.mean)
def mean(a: Any, axis: Any = None, dtype: Any = None, out: Any = None, keepdims: bool = False,
         **kwargs: Any) -> DTensor:
    """``np.mean``: each block's sum over the global count, so the Partial(sum) terms add up to the mean."""
    return _reduce("mean", a, axis, keepdims, {"dtype": dtype, "out": out, **kwargs})


@implements(np.max, np.amax)
def maximum(a: Any, axis: Any = None, out: Any = None, keepdims: bool = False, **kwargs: Any) -> DTensor:
    """``np.max``: a sharded axis reduced away leaves Partial(max)."""
    return _reduce("max", a, axis, keepdims, {"out": out, **kwargs})


@implements(np.min, np.amin)
def minimum(a: Any, axis: Any = None, out: Any = None, keepdims: bool = False, **kwargs: Any) -> DTensor:
    """``np.min``: a sharded axis reduced away leaves Partial(min)."""
    return _reduce("min", a, axis, keepdims, {"out": out, **kwargs})


def logsumexp(x: Any, axis: Any = None, keepdims: bool = False) -> Any:
    """``log(sum(exp(x), axis))``, numerically stable, for DTensors and plain arrays alike.

    NumPy has none (SciPy's ``scipy.special.logsumexp``, same meaning). The row maximum ``m`` is
    subtracted before ``exp`` (no overflow), a non-finite ``m`` (a row all ``-inf``, or holding
    ``inf``) replaced by 0, as SciPy does, so such rows give ``-inf`` / ``inf``, not NaN. Over an
    axis a mesh dim shards, ``m`` is a Partial(max) all-reduced before the subtraction and the
    sum of ``exp`` a Partial(sum) all-reduced before the ``log``: two all-reduces of the reduced
    shape, exact (no approximation of the terms' sum in log space).
    """
    x = _reduced(x)  # a Partial x: reduced once here, not by max and again by the subtraction
    m = _reduced(np.max(x, axis=axis, keepdims=True))  # once, not by isfinite and again by where
    m = np.where(np.isfinite(m), m, 0)
    with np.errstate(divide="ignore"):  # log(0) = -inf is the answer for a row all -inf
        out = np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)) + m
    if keepdims:
        return out
    ndim = np.ndim(x)
    axes = range(ndim) if axis is None else [a % ndim for a in ((axis,) if np.ndim(axis) == 0 else axis)]
    return out[tuple(0 if d in axes else slice(None) for d in range(ndim))]


def _reduced(x: Any) -> Any:
    """``x`` with its Partial placements all-reduced (plain arrays as they are)."""
    if isinstance(x, DTensor) and any(p.is_partial() for p in x.placements):
        return moved("logsumexp", "x", x, [Replicate() if p.is_partial() else p for p in x.placements])
    return x
