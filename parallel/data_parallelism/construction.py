"""What every data-parallel strategy does first: resolve its group, check its arguments on every
rank, and start every rank from the same parameters.

Shared by DDP, ZeRO and FSDP, so that they accept and reject the same inputs with the same words.
The checks are collective (one exchange, :func:`meshkit.comm._seams.agree`): a bad argument on one rank, or parameters
or settings that differ between ranks, raise on *every* rank, naming the ranks, instead of
leaving the others waiting in the first collective or training on mismatched buckets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator, Sequence

from ...comm import DistTypeError, DistValueError, ProcessGroup, get_backend
from ...comm._seams import agree, resolve_group
from ...mesh import DeviceMesh
from ...tensor import DTensor
from ..arrays import array_namespace, is_array, type_name
from ..checks import where
from .dtensors import describe_spec, layout_problem, layout_spec
from .flat import make_layouts

__all__ = ["world_mesh", "resolve_data_parallel_group", "check_setup", "caps_problem", "snapshot", "Params",
           "broadcast_params"]


def world_mesh() -> DeviceMesh:
    """The world as a 1-D mesh ``("dp",)``: what a strategy given no mesh is data-parallel over (a
    ``cuda`` mesh on the NCCL engine, else ``cpu``). Not collective: it wraps the world's group."""
    world = resolve_group(None)
    return DeviceMesh.from_group(world, "cuda" if get_backend(world) == "nccl" else "cpu", mesh_dim_names=("dp",))


def resolve_data_parallel_group(mesh: DeviceMesh | None, group: ProcessGroup | None, who: str) -> ProcessGroup:
    """The group a data-parallel strategy averages over: a 1-D mesh's, ``group``, or the world."""
    if mesh is not None and group is not None:
        raise DistValueError(f"{where(who)}: pass mesh or group, not both")
    if mesh is not None:
        if not isinstance(mesh, DeviceMesh):
            raise DistValueError(f"{where(who)}: mesh must be a DeviceMesh, got {type(mesh).__name__}")
        if mesh.ndim != 1:
            raise DistValueError(f"{where(who)}: mesh must be 1-D (a data-parallel dim, e.g. mesh['dp']), got a "
                                 f"{mesh.ndim}-D mesh with dims {mesh.mesh_dim_names}")
        return mesh.get_group()
    return resolve_group(group)


def caps_problem(bucket_cap_mb: Any, first_bucket_cap_mb: Any) -> str | None:
    """What is wrong with the bucket caps, or None."""
    try:
        if bucket_cap_mb > 0 and first_bucket_cap_mb > 0:
            return None
    except TypeError:
        pass
    return (f"bucket caps must be positive numbers, got bucket_cap_mb={bucket_cap_mb!r}, "
            f"first_bucket_cap_mb={first_bucket_cap_mb!r}")


def _params_problem(params: Any, group: ProcessGroup, ranks: Sequence[int] | None) -> str | None:
    if not isinstance(params, Mapping) or not params:
        return f"params must be a non-empty dict[str, array], got {type(params).__name__}"
    for name, p in params.items():
        if isinstance(p, DTensor):
            problem = layout_problem(name, p, group, ranks)
            if problem:
                return problem
    blocks = {name: p.to_local() if isinstance(p, DTensor) else p for name, p in params.items()}
    return _mixed_problem(blocks) or _array_problem(blocks)


#: Problems of this form are type errors (raised as DistTypeError on every rank).
_MIXED = "params mixes array libraries"


def _mixed_problem(params: Mapping[str, Any]) -> str | None:
    """Parameters of both NumPy and CuPy: name the first of each."""
    first: tuple[str, Any] | None = None
    for name, p in params.items():
        if not is_array(p):
            continue
        if first is None:
            first = (name, p)
        elif array_namespace(p) is not array_namespace(first[1]):
            return (f"{_MIXED}: params[{first[0]!r}] is a {type_name(first[1])} but params[{name!r}] is a "
                    f"{type_name(p)}; a model's parameters must all be NumPy (host) or all CuPy (device)")
    return None


def _array_problem(params: Mapping[str, Any]) -> str | None:
    for name, p in params.items():
        if not isinstance(name, str) or not is_array(p):
            return f"params[{name!r}] must be an array keyed by a str name, got {type(p).__name__}"
        if p.dtype.kind not in "fc":
            return f"params[{name!r}] has dtype {p.dtype}; parameters must be floating-point or complex"
        if not p.flags.c_contiguous:
            return f"params[{name!r}] is not C-contiguous"
    return None


def check_setup(params: Any, group: ProcessGroup, who: str, *, problem: str | None = None,
                config: dict[str, Any] | None = None, then: ProcessGroup | None = None,
                data_parallel_ranks: Sequence[int] | None = None) -> None:
    """Check ``params`` and the other arguments of a strategy on every rank of ``group`` (collective).

    Args:
        params: must be a non-empty dict of C-contiguous float arrays whose names, shapes,
            dtypes and order are the same on every rank. Values may be DTensors (see
            :mod:`.dtensors`): none ``Partial``, each on a mesh that holds no other
            data-parallel rank, and with the same placements, global shape and mesh coordinate
            on every rank (their blocks are then checked as the arrays are).
        problem: what is wrong with this rank's other arguments, or None.
        config: settings that must be equal on every rank (bucket caps, stage, units...).
        then: the other dim of a 2-D data-parallel mesh (HSDP's replicate group, ``group`` being
            its shard group): the ranks compare over ``group``, then over ``then``, each carrying
            its first verdict, so every rank of the mesh learns of any problem from two
            all-gathers and all raise together (checking each group in turn, raising after the
            first, would leave the ranks whose first group agreed waiting in the second).
        data_parallel_ranks: every rank the parameters are data-parallel over, with ``then``
            (default: ``group``'s ranks); a DTensor's mesh may hold none of them but this rank.

    Raises:
        DistValueError: on every rank, naming the ranks and what differs, when any rank has a
            problem or ranks differ (DistTypeError when parameters mix NumPy and CuPy).
    """
    problem = problem or _params_problem(params, group, data_parallel_ranks)
    specs = None if problem else [(n, *_spec(p)) for n, p in params.items()]

    def fail(message: str) -> Exception:  # a problem of mixed array libraries is a type error
        return (DistTypeError if _MIXED in message else DistValueError)(f"{where(who, group)}: {message}")

    agree([group] if then is None else [group, then], (specs, config), problem=problem, compare=_verdict, error=fail)


def _verdict(group: ProcessGroup, everyone: list[Any]) -> str | None:
    """What differs between the ranks' ``(specs, config)`` (``group``'s, in its order), or None: the
    same on every rank that has them."""
    ref_specs, ref_config = everyone[0]
    for i, (theirs, their_config) in enumerate(everyone[1:], start=1):
        if theirs != ref_specs:
            what = "shapes, dtypes and DTensor layouts" if any(s[3] for s in ref_specs + theirs) else \
                "shapes and dtypes"
            return (f"{_spec_difference(ref_specs, theirs, group.ranks[0], group.ranks[i])}; every rank must "
                    f"pass the same names, {what} in the same order")
        if their_config != ref_config:
            keys = [k for k in ref_config if ref_config[k] != their_config.get(k)]
            return (f"settings differ between rank {group.ranks[0]} ({ {k: ref_config[k] for k in keys} }) "
                    f"and rank {group.ranks[i]} ({ {k: their_config.get(k) for k in keys} }); every rank must "
                    "pass the same")
    return None


def _spec(p: Any) -> tuple[Any, ...]:
    """``(shape, dtype, layout)`` of a parameter: its block's shape and, for a DTensor, its layout."""
    block = p.to_local() if isinstance(p, DTensor) else p
    return tuple(block.shape), str(block.dtype), layout_spec(p)


def _spec_difference(ours: list, theirs: list, me: int, other: int) -> str:
    mine, their = {n: s for n, *s in ours}, {n: s for n, *s in theirs}
    for name in list(mine) + [n for n in their if n not in mine]:
        if mine.get(name) != their.get(name):
            return (f"parameter {name!r} differs between rank {me} ({_describe(mine.get(name))}) and rank {other} "
                    f"({_describe(their.get(name))})")
    at = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a[0] != b[0])
    return (f"parameters are in a different order on rank {me} and rank {other}: position {at} holds "
            f"{ours[at][0]!r} on rank {me} and {theirs[at][0]!r} on rank {other} (rank {me}: "
            f"{[s[0] for s in ours]}, rank {other}: {[s[0] for s in theirs]})")


def _describe(spec: Any) -> str:
    if spec is None:
        return "missing"
    if spec[2] is None:
        return f"shape {spec[0]}, dtype {spec[1]}"
    return f"{describe_spec(spec[2])}, block shape {spec[0]}, dtype {spec[1]}"


def snapshot(params: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], Any]]:
    """``name -> (shape, dtype)``, taken at construction: what a strategy owns and checks against."""
    return {name: (tuple(p.shape), p.dtype) for name, p in params.items()}


class Params(Mapping):
    """A strategy's parameters, ``name -> array``: a read-only mapping over arrays it owns.

    The arrays are updated in place (by an optimizer, ``p[...] = value``); adding, removing or
    replacing entries raises, since the strategy's buckets and flat buffers were built for these.
    """

    __slots__ = ("_arrays", "_who")

    def __init__(self, arrays: dict[str, Any], who: str) -> None:
        self._arrays, self._who = arrays, who

    def __getitem__(self, name: str) -> Any:
        return self._arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def __reversed__(self) -> Iterator[str]:
        return reversed(self._arrays)

    def _refuse(self, name: Any) -> None:
        raise DistTypeError(f"{where(self._who)}: params is read-only, so params[{name!r}] cannot be replaced or "
                            "removed: update the arrays in place (params[name][...] = value), or wrap the changed "
                            "model in a new strategy")

    def __setitem__(self, name: str, value: Any) -> None:
        self._refuse(name)

    def __delitem__(self, name: str) -> None:
        self._refuse(name)

    def __repr__(self) -> str:
        return f"<{self._who} params {list(self._arrays)}>"


def broadcast_params(params: dict[str, Any], group: ProcessGroup, src: int) -> None:
    """Copy group rank ``src``'s parameters to every rank: one broadcast per dtype, not per array."""
    for layout in make_layouts(params, list(params), 1):
        flat = layout.pack(params, params[layout.names[0]])
        group.broadcast(flat, src)
        layout.unpack(flat, params)
