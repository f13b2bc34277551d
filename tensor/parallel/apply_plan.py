"""``parallelize``: a dict of parameters laid out over a 1-D ``tp`` mesh by a ``{name or glob: style}`` plan."""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any

from ...mesh import DeviceMesh
from .. import errors
from ..distribute import distribute_tensor
from ..dtensor import DTensor
from ..placements import Placement, Replicate
from .style import ParallelStyle

__all__ = ["parallelize", "plan_placements"]

_OP = "parallelize"


def _check(params: Any, mesh: Any, plan: Any) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise errors.type_error(_OP, f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise errors.value_error(_OP, f"mesh must be the 1-D tp mesh (e.g. mesh['tp']), got a {mesh.ndim}-D mesh "
                                      f"with dims {mesh.mesh_dim_names}")
    styles = "a ParallelStyle (ColwiseParallel(), RowwiseParallel() or SequenceParallel())"
    for what, given, key_kind, valid, wanted in (
            ("params", params, "str names", _is_plain_array, "a plain NumPy or CuPy array (the full parameter)"),
            ("plan", plan, "parameter names or fnmatch globs", _is_style, styles)):
        if not isinstance(given, Mapping):
            raise errors.type_error(_OP, f"{what} must be a dict, got {type(given).__name__}")
        for key, value in given.items():
            if not isinstance(key, str):
                raise errors.type_error(_OP, f"{what} keys must be {key_kind}, got {key!r}")
            if not valid(value):
                raise errors.type_error(_OP, f"{what}[{key!r}] must be {wanted}, got {type(value).__name__} {value!r}")


def _is_plain_array(p: Any) -> bool:
    return not isinstance(p, DTensor) and hasattr(p, "shape") and hasattr(p, "dtype")


def _is_style(s: Any) -> bool:
    return isinstance(s, ParallelStyle)


def _style_of(name: str, plan: Mapping[str, ParallelStyle]) -> ParallelStyle | None:
    """The style the plan gives ``name``: its exact key, else the one style of the globs matching it."""
    if name in plan:
        return plan[name]
    matches = [key for key in plan if fnmatchcase(name, key)]
    styles = {plan[key] for key in matches}
    if len(styles) > 1:
        raise errors.value_error(_OP, f"parameter {name!r} matches plan rules {matches} with different styles "
                                      f"{[plan[k] for k in matches]}; make the rules disjoint or name it exactly")
    return plan[matches[0]] if matches else None


def plan_placements(params: Mapping[str, Any], plan: Mapping[str, ParallelStyle]) -> dict[str, Placement]:
    """``{name: placement on the tp mesh}`` that :func:`parallelize` gives each parameter.

    Pure (no communication); checks the plan as :func:`parallelize` does. ``params`` maps names to
    anything with a ``shape`` (arrays, DTensors).
    """
    unused = [key for key in plan if key not in params and not any(fnmatchcase(n, key) for n in params)]
    if unused:
        raise errors.value_error(_OP, f"plan rule{'s' if len(unused) > 1 else ''} "
                                      f"{', '.join(repr(k) for k in unused)} match{'' if len(unused) > 1 else 'es'} "
                                      f"no parameter; parameters are {list(params)}")
    out = {}
    for name, p in params.items():
        style = _style_of(name, plan)
        out[name] = Replicate() if style is None else style.param_placement(name, tuple(p.shape))
    return out


def parallelize(params: Mapping[str, Any], mesh: DeviceMesh, plan: Mapping[str, ParallelStyle], *,
                src_data_rank: int | None = 0) -> dict[str, DTensor]:
    """Lay out a model's parameters over a 1-D tensor-parallel mesh (torch's ``parallelize_module``).

    Every rank passes full parameters of the same shapes and dtypes; as torch's styles do
    (``src_data_rank=0``), the values of tp rank 0 are scattered (Shard) or broadcast (Replicate),
    so that parameters initialised with a different seed on each rank still make one model
    (:func:`~meshkit.tensor.distribute_tensor`). Each rank keeps a copy of its block
    (C-contiguous, its own memory: the optimizers update it in place, DDP can bucket it).

    Args:
        params: ``{name: full array}`` (NumPy or CuPy).
        mesh: the 1-D tp mesh: a 1-D mesh, or ``mesh["tp"]`` of a 2-D ``dp x tp`` mesh.
        plan: ``{name or fnmatch glob: style}``; a style lays out a 2-D weight ``(in, out)`` and a
            1-D bias as in :mod:`.style` (``{"[wb]0": ColwiseParallel(), "[wb]1":
            RowwiseParallel()}``). An exact name wins over globs; globs matching one name must
            agree. A parameter no rule matches becomes ``Replicate()`` (a DTensor too, so that the
            model computes on DTensors only: the NumPy rules do not mix DTensors with plain arrays).
        src_data_rank: the tp rank whose values count (torch's default 0), or None: every rank
            passes the same values and cuts its block locally, sending no data.

    Returns:
        ``{name: DTensor}`` in the order of ``params``.

    Raises:
        DistTypeError: a value is not a plain array, a style is not a ParallelStyle.
        DistValueError: the mesh is not 1-D, a rule matches no parameter (naming it), globs with
            different styles match one name, or a style cannot lay out a parameter's shape.

    Example (2 ranks, mesh ``[0, 1]``, ``{"w0": (20, 64), "b0": (64,), "w1": (64, 4), "b1": (4,)}``,
    plan ``{"*0": ColwiseParallel(), "*1": RowwiseParallel()}``): rank 0 holds ``w0[:, 0:32]``,
    ``b0[0:32]``, ``w1[0:32]`` and all of ``b1``; rank 1 ``w0[:, 32:64]``, ``b0[32:64]``,
    ``w1[32:64]`` and all of ``b1``.
    """
    _check(params, mesh, plan)
    out = {}
    for name, placement in plan_placements(params, plan).items():
        out[name] = distribute_tensor(params[name], mesh, [placement], src_data_rank=src_data_rank)  # its own copy
    return out
