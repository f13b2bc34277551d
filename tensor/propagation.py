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
from .placements import Placement
from .redistribute import redistribute_local
from ..comm._seams import array_namespace

__all__ = ["logger", "is_scalar", "common_mesh", "moved", "unsupported", "no_out", "wrap", "uniform_finite"]

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
