"""Collective checks of DTensor construction (``run_check=True`` or ``MESHKIT_DEBUG=detail``).

One small object all-gather per mesh dimension: every rank learns what its neighbours along
each mesh dim passed, so a rank whose block does not fit the global shape, or ranks that passed
different shapes or placements, make every rank raise the same error instead of computing on a
wrong layout (or waiting for a rank that already raised).
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
    for i in range(mesh.ndim):
        everyone: list[Any] = [None] * mesh.shape[i]
        all_gather_object(everyone, mine, group=mesh.get_group(i))
        for other, coord, their_shape, their_placements, local_shape, dtype in everyone:
            if (their_shape, their_placements, dtype) != (mine[2], mine[3], mine[5]):
                problems.append(f"rank {other} passed shape {their_shape}, placements {their_placements!r}, "
                                f"dtype {dtype} but rank {rank} passed shape {mine[2]}, placements {mine[3]!r}, "
                                f"dtype {mine[5]}")
                continue
            if len(their_shape) != len(local_shape):
                problems.append(f"rank {other}'s local has {len(local_shape)} dims, the shape {their_shape} "
                                f"has {len(their_shape)}")
                continue
            want = local_shape_and_offset(their_shape, mesh.shape, coord, their_placements)[0]
            if want != local_shape:
                problems.append(f"rank {other}'s local has shape {local_shape} but global shape {their_shape} "
                                f"with placements {their_placements!r} gives it {want}")
    if problems:
        unique = list(dict.fromkeys(problems))
        raise errors.value_error(op, "; ".join(unique))
