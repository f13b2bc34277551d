"""Collective checks of DTensor construction (``run_check=True`` or ``MESHKIT_DEBUG=detail``).

Two small object all-gathers per mesh dimension: in the first sweep every rank checks what its
peers along each mesh dim passed; in the second what anyone found reaches every rank of the
mesh. So a rank whose block does not fit the global shape, or ranks that passed different
shapes or placements, make every rank raise the same error instead of computing on a wrong
layout (or waiting for a rank that already raised).
"""

from __future__ import annotations

from typing import Any, Sequence

from ..comm import all_gather_object
from ..mesh import DeviceMesh
from . import errors
from .chunks import local_shape_and_offset
from .placements import Placement

__all__ = ["check_from_local"]


def check_from_local(op: str, local: Any, mesh: DeviceMesh, placements: Sequence[Placement],
                     shape: Sequence[int]) -> None:
    """Raise on every rank of ``mesh`` unless every block fits ``shape`` and all agree on it.

    Collective over each mesh dimension's group.
    """
    coordinate = mesh.get_coordinate()
    rank = mesh.get_rank()
    mine = (rank, tuple(coordinate), tuple(shape), tuple(placements), tuple(local.shape), str(local.dtype))
    problems: list[str] = []
    for i in range(mesh.ndim):  # sweep 1: every rank checks what its peers along each mesh dim passed
        everyone: list[Any] = [None] * mesh.shape[i]
        all_gather_object(everyone, mine, group=mesh.get_group(i))
        problems.extend(_problems(mesh, rank, mine, everyone))
    for i in range(mesh.ndim):  # sweep 2: what anyone found reaches every rank of the mesh
        found: list[Any] = [None] * mesh.shape[i]
        all_gather_object(found, problems, group=mesh.get_group(i))
        problems = sorted({p for theirs in found for p in theirs})
    if problems:
        raise errors.value_error(op, "; ".join(problems))


def _problems(mesh: DeviceMesh, rank: int, mine: tuple, everyone: list[Any]) -> list[str]:
    """What is wrong with the peers' arguments (``everyone``), seen from this rank."""
    problems = []
    for other, coord, their_shape, their_placements, local_shape, dtype in everyone:
        if (their_shape, their_placements, dtype) != (mine[2], mine[3], mine[5]):
            problems.append(f"rank {other} passed shape {their_shape}, placements {their_placements!r}, "
                            f"dtype {dtype} but rank {rank} passed shape {mine[2]}, placements {mine[3]!r}, "
                            f"dtype {mine[5]}")
        elif len(their_shape) != len(local_shape):
            problems.append(f"rank {other}'s local has {len(local_shape)} dims, the shape {their_shape} "
                            f"has {len(their_shape)}")
        elif (want := local_shape_and_offset(their_shape, mesh.shape, coord, their_placements)[0]) != local_shape:
            problems.append(f"rank {other}'s local has shape {local_shape} but global shape {their_shape} "
                            f"with placements {their_placements!r} gives it {want}")
    return problems
