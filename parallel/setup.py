"""What every data-parallel strategy does first: resolve its group, check the parameters, bucket
caps and arguments on every rank, and start every rank from the same parameters.

Shared by DDP, ZeRO and FSDP, so that they accept and reject the same inputs with the same words.
"""

from __future__ import annotations

from typing import Any

from ..comm import DistValueError, ProcessGroup, all_gather_object, resolve_group
from ..mesh import DeviceMesh
from .flat import make_layouts

__all__ = ["resolve_data_parallel_group", "check_params", "check_caps", "broadcast_params"]


def resolve_data_parallel_group(mesh: DeviceMesh | None, group: ProcessGroup | None, who: str) -> ProcessGroup:
    """The group a data-parallel strategy averages over: a 1-D mesh's, ``group``, or the world."""
    if mesh is not None and group is not None:
        raise DistValueError(f"meshkit.parallel: {who}: pass mesh or group, not both")
    if mesh is not None:
        if not isinstance(mesh, DeviceMesh):
            raise DistValueError(f"meshkit.parallel: {who}: mesh must be a DeviceMesh, got {type(mesh).__name__}")
        if mesh.ndim != 1:
            raise DistValueError(f"meshkit.parallel: {who}: mesh must be 1-D (a data-parallel dim, e.g. "
                                 f"mesh['dp']), got a {mesh.ndim}-D mesh with dims {mesh.mesh_dim_names}")
        return mesh.get_group()
    return resolve_group(group)


def check_params(params: Any, group: ProcessGroup, who: str) -> dict[str, Any]:
    """Parameters are a dict of float arrays whose names, shapes and dtypes agree on every rank."""
    if not isinstance(params, dict) or not params:
        raise DistValueError(f"meshkit.parallel: {who}: params must be a non-empty dict[str, array], "
                             f"got {type(params).__name__}")
    for name, p in params.items():
        if not isinstance(name, str) or not hasattr(p, "dtype") or not hasattr(p, "shape"):
            raise DistValueError(f"meshkit.parallel: {who}: params[{name!r}] must be an array keyed by a str name")
        if p.dtype.kind not in "fc":
            raise DistValueError(f"meshkit.parallel: {who}: params[{name!r}] has dtype {p.dtype}; parameters "
                                 "must be floating-point or complex")
        if not p.flags.c_contiguous:
            raise DistValueError(f"meshkit.parallel: {who}: params[{name!r}] is not C-contiguous")
    mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in params.items()]
    everyone: list[Any] = [None] * group.size
    all_gather_object(everyone, mine, group=group)
    for i, theirs in enumerate(everyone):
        if theirs != mine:
            ours, other = dict((n, s) for n, *s in mine), dict((n, s) for n, *s in theirs)
            diff = sorted(set(ours) ^ set(other)) or [n for n in ours if ours[n] != other.get(n)]
            name = diff[0]
            raise DistValueError(
                f"meshkit.parallel: rank {group.global_rank}: {who}: parameter {name!r} differs between rank "
                f"{group.global_rank} ({_describe(ours.get(name))}) and rank {group.ranks[i]} "
                f"({_describe(other.get(name))}); every rank must pass the same names, shapes and dtypes")
    return params


def _describe(spec: Any) -> str:
    return "missing" if spec is None else f"shape {spec[0]}, dtype {spec[1]}"


def check_caps(bucket_cap_mb: float, first_bucket_cap_mb: float, who: str) -> None:
    if not bucket_cap_mb > 0 or not first_bucket_cap_mb > 0:
        raise DistValueError(f"meshkit.parallel: {who}: bucket caps must be positive, got "
                             f"bucket_cap_mb={bucket_cap_mb}, first_bucket_cap_mb={first_bucket_cap_mb}")


def broadcast_params(params: dict[str, Any], group: ProcessGroup, src: int) -> None:
    """Copy group rank ``src``'s parameters to every rank: one broadcast per dtype, not per array."""
    for layout in make_layouts(params, list(params), 1):
        flat = layout.pack(params, params[layout.names[0]])
        group.broadcast(flat, src)
        layout.unpack(flat, params)
