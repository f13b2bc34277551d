"""What every op rule shares: unwrapping arguments, one mesh, logged redistribution, wrapping.

An op rule decides the placements its inputs must have and its output gets; when an input's
placements differ it is redistributed here, and the move is logged at DEBUG, naming the op, the
argument and both placements, so no communication happens unannounced. Where a rule has no
answer it raises :func:`unsupported`, a NotImplementedError naming the op and the placements.
"""

from __future__ import annotations

import logging
import math
import numbers
from typing import Any, Sequence

import numpy as np

from ..mesh import DeviceMesh
from . import errors
from .dtensor import DTensor
from .placements import Partial, Placement, Replicate, Shard
from .redistribute import redistribute_local
from ..comm._seams import array_namespace

__all__ = ["logger", "is_scalar", "common_mesh", "moved", "unsupported", "no_out", "wrap", "uniform_finite",
           "norm_axes", "off_axes", "renumbered", "refuse_kwargs"]

logger = logging.getLogger("meshkit.tensor")


def is_scalar(x: Any) -> bool:
    """Python numbers, NumPy scalars and 0-d arrays: combine with any DTensor locally."""
    return isinstance(x, (numbers.Number, np.generic)) or (getattr(x, "ndim", None) == 0 and not isinstance(x, DTensor))


def uniform_finite(x: Any, *, nonzero: bool = False) -> bool:
    """True if ``x`` is the same on every rank and finite (and nonzero with ``nonzero``).

    What a factor (divisor) must be for Partial(sum/avg) terms times it to be the terms of the
    product: ``inf`` times a term 0 (an idle rank's -0.0) is NaN where the sum is +-inf, and
    ``t / 0`` sums +-inf terms of both signs to NaN. Scalars are the same on every rank; a DTensor
    only when it is Replicate on every mesh dim (its block is then the global array), so every rank
    takes the same decision without communicating.
    """
    if isinstance(x, (int, float)):  # the common case (p * 0.5), without NumPy's dispatch
        return math.isfinite(x) and not (nonzero and x == 0)
    if isinstance(x, DTensor):
        if not all(p.is_replicate() for p in x.placements):
            return False
        x = x.to_local()
    xp = array_namespace(x)
    try:
        ok = xp.all(xp.isfinite(x))
        if nonzero:
            ok = ok & xp.all(x != 0)
    except TypeError:  # object or other non-numeric dtypes: no claim
        return False
    return bool(ok)


def common_mesh(op: str, args: Sequence[Any]) -> DeviceMesh:
    """The mesh of the DTensor arguments; an error naming the argument if they differ or mix arrays."""
    mesh = None
    for i, x in enumerate(args):
        if isinstance(x, DTensor):
            if mesh is None:
                mesh = x.device_mesh
            elif x.device_mesh is not mesh and x.device_mesh != mesh:
                raise errors.value_error(op, f"argument {i} is on mesh {x.device_mesh!r} but argument 0's mesh is "
                                             f"{mesh!r}; DTensors on different meshes do not mix")
        elif not is_scalar(x):
            raise NotImplementedError(errors.prefix(op) + f"argument {i} is a {type(x).__name__}, not a DTensor or "
                                      "a scalar; mixing DTensors with plain arrays is not supported (distribute "
                                      "it first)")
    assert mesh is not None
    return mesh


def moved(op: str, arg: str, x: DTensor, placements: Sequence[Placement]) -> DTensor:
    """``x`` redistributed to ``placements`` for ``op``, logged at DEBUG when it changes."""
    placements = tuple(placements)
    if x.placements == placements:
        return x
    logger.debug("%s: redistributing %s from %r to %r", op, arg, x.placements, placements)
    if x._claims is not None:  # built on a trusted shape=: checked before its data crosses ranks
        x._check_claims(op)
    # no copy: the rule only reads the block (a Replicate -> Shard move may stay a view of x's)
    local = redistribute_local(x.to_local(), x.device_mesh, x.shape, x.placements, placements, copy=False)
    return DTensor(local, x.device_mesh, placements, shape=x.shape)


def unsupported(op: str, *placements: Sequence[Placement]) -> NotImplementedError:
    """The error for an op with no rule for these placements."""
    shown = ", ".join(repr(tuple(p)) for p in placements)
    return NotImplementedError(errors.prefix(op) + f"no sharding rule for placements {shown}; "
                               "redistribute the arguments first")


def no_out(op: str, kwargs: dict[str, Any], *names: str) -> None:
    """Reject keyword arguments the DTensor rules do not support (``out=``, ``where=``...)."""
    for name in ("out", "where", *names):
        if kwargs.get(name) is not None and not (name == "where" and kwargs[name] is True):
            hint = (" (an in-place operator such as x @= y passes it): write x = x @ y, or compute on "
                    "to_local()") if name == "out" and op == "np.matmul" else ""
            raise NotImplementedError(errors.prefix(op) + f"{name}= is not supported on DTensors{hint}")


def wrap(local: Any, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int]) -> DTensor:
    """The result DTensor (no check: the rule computed placements and shape)."""
    return DTensor(local, mesh, placements, shape=shape)


_ALL_AXES = tuple(tuple(range(n)) for n in range(33))  # axis=None of an n-d array (NumPy allows 64 dims)


def norm_axes(op: str, ndim: int, axis: Any) -> tuple[int, ...]:
    """``axis`` (None, an int or a tuple of ints) as sorted non-negative axes; NumPy's AxisError out of range."""
    if axis is None:
        return _ALL_AXES[ndim] if ndim < len(_ALL_AXES) else tuple(range(ndim))
    if axis.__class__ is int and -ndim <= axis < ndim:  # the common case, without the loop below
        return (axis % ndim,)
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    out = set()
    for ax in axes:
        if isinstance(ax, bool) or not isinstance(ax, (int, np.integer)):
            raise errors.type_error(op, f"axis must be an int or a tuple of ints, got {axis!r}")
        if not -ndim <= ax < ndim:
            raise np.exceptions.AxisError(int(ax), ndim, errors.prefix(op) + "axis")
        out.add(int(ax) % ndim)
    return tuple(sorted(out))


def refuse_kwargs(op: str, kwargs: dict[str, Any], placements: Sequence[Placement]) -> None:
    """NotImplementedError naming ``op``, the placements and the first keyword given a non-default value."""
    for name, value in kwargs.items():
        if value is not None and value is not np._NoValue:
            raise NotImplementedError(errors.prefix(op) + f"{name}={value!r} has no DTensor rule (placements "
                                      f"{tuple(placements)!r}); compute on full_tensor() (redistribute to "
                                      "Replicate first)")


def off_axes(op: str, arg: str, a: DTensor, axes: Sequence[int], *, keep_partial: Sequence[str] = ()) -> DTensor:
    """``a`` laid out so that no mesh dim shards one of ``axes`` and no Partial is left but those of
    ``keep_partial``: what an op that reads whole lines along ``axes`` (sort, median, diff...) needs.

    A mesh dim sharding one of ``axes`` moves its Shard to another axis, the largest that no mesh
    dim shards yet (one all-to-all: each rank sends and receives about its block once), and where
    there is none (1-D arrays, every other axis taken) gathers it (an all-gather: each rank
    receives the whole line). A Partial not kept is all-reduced.
    """
    taken = {p.dim for p in a.placements if isinstance(p, Shard) and p.dim not in axes}
    need: list[Placement] = []
    for p in a.placements:
        if isinstance(p, Shard) and p.dim in axes:
            free = [d for d in range(a.ndim) if d not in axes and d not in taken]
            if free:
                d = max(free, key=lambda d: (a.shape[d], -d))
                taken.add(d)
                need.append(Shard(d))
            else:
                need.append(Replicate())
        elif isinstance(p, Partial) and p.reduce_op not in keep_partial:
            need.append(Replicate())
        else:
            need.append(p)
    return moved(op, arg, a, need)


def renumbered(placements: Sequence[Placement], removed: Sequence[int]) -> list[Placement]:
    """``placements`` with each Shard's dim shifted past the ``removed`` axes (none of them sharded)."""
    return [Shard(p.dim - sum(r < p.dim for r in removed)) if isinstance(p, Shard) else p for p in placements]
