"""``distribute_tensor``: a DTensor from a global array every rank holds, with no communication."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..mesh import DeviceMesh
from . import errors
from .chunks import local_slices
from .dtensor import DTensor, coordinate_of, normalize_placements
from .placements import Partial, Placement
from .redistribute import partition_value

__all__ = ["distribute_tensor"]


def distribute_tensor(tensor: Any, device_mesh: DeviceMesh, placements: Sequence[Placement] | None = None, *,
                      src_data_rank: int | None = None) -> DTensor:
    """Lay out ``tensor`` (the same global array on every rank) over ``device_mesh``.

    Each rank keeps its block (a view, no copy) by the ``torch.chunk`` rule; Partial keeps the
    value on coordinate 0 of that mesh dim and the identity elsewhere (sum), or the value on
    every rank (avg, max, min).

    Args:
        tensor: the global NumPy or CuPy array; every rank passes the same.
        device_mesh: the mesh.
        placements: one per mesh dimension (None: all Replicate).
        src_data_rank: torch scatters from this rank; meshkit only supports None (every rank
            already holds the array, so no communication is needed).

    Example (4 ranks, mesh ``(2, 2)``, ``A = np.arange(8)``, ``[Shard(0), Shard(0)]``): rank 0
    holds ``A[0:2]``, rank 1 ``A[2:4]``, rank 2 ``A[4:6]``, rank 3 ``A[6:8]``.
    """
    op = "distribute_tensor"
    if isinstance(tensor, DTensor):
        raise errors.type_error(op, "tensor is already a DTensor; use its redistribute()")
    if src_data_rank is not None:
        raise errors.value_error(op, f"src_data_rank={src_data_rank!r} is not supported; every rank passes the "
                                     "same array (src_data_rank=None)")
    if not hasattr(tensor, "shape") or not hasattr(tensor, "dtype"):
        tensor = np.asarray(tensor)
    placements = normalize_placements(op, device_mesh, placements, tensor.ndim)
    coordinate = coordinate_of(op, device_mesh)
    local = tensor[local_slices(tensor.shape, device_mesh.shape, coordinate, placements)]
    for i, p in enumerate(placements):
        if isinstance(p, Partial):
            local = partition_value(local, p, coordinate[i])
    return DTensor(local, device_mesh, placements, shape=tensor.shape)
