"""``distribute_tensor``: a DTensor from a global array: cut locally, or sent from one rank."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..comm import DistTypeError, DistValueError
from ..comm._seams import array_namespace
from ..mesh import DeviceMesh
from . import errors
from .verify import check_same_arguments
from .chunks import chunk_range, chunk_size, local_slices
from .dtensor import DTensor, coordinate_of, normalize_placements
from .placements import Partial, Placement, Replicate, Shard
from .redistribute import partition_value

__all__ = ["distribute_tensor"]


def distribute_tensor(tensor: Any, device_mesh: DeviceMesh, placements: Sequence[Placement] | None = None, *,
                      src_data_rank: int | None = 0) -> DTensor:
    """Lay out ``tensor`` (a global array) over ``device_mesh``.

    Each rank keeps a copy of its block (its own memory, never a view of ``tensor``: an in-place
    step on the DTensor leaves the caller's array alone) by the ``torch.chunk`` rule; Partial
    keeps the value on coordinate 0 of that mesh dim and the identity elsewhere (sum), or the
    value on every rank (avg, max, min).

    Every rank first checks that all passed the same shape, dtype, placements and
    ``src_data_rank`` (one all-gather of two int64 per mesh dim; docs/benchmarks.md
    gives its cost), so ranks that disagree raise, all of them, naming who passed what, instead
    of cutting or scattering blocks of different sizes.

    Args:
        tensor: the global NumPy or CuPy array, of the same shape and dtype on every rank.
        device_mesh: the mesh; every rank of it calls ``distribute_tensor``.
        placements: one per mesh dimension (None: all Replicate).
        src_data_rank: 0 (the default, torch's): only the values of the rank at coordinate 0 on
            every mesh dimension count (the others' arrays give the shape and dtype): each mesh
            dim in turn scatters the chunks (Shard) or broadcasts the array (Replicate, Partial)
            from its group rank 0, as torch does, so that separately seeded inits still give one
            array. Another int ``s``: the same from group rank ``s``. None: every rank passes the
            same values and cuts its block locally, with no data sent (meshkit's default before;
            pass it where every rank builds the same array and the scatter's cost matters).

    Returns:
        The DTensor.

    Raises:
        DistValueError: bad placements, this rank outside the mesh, ``src_data_rank`` not a rank
            of every mesh dim, or ranks that passed different shapes, dtypes, placements or
            ``src_data_rank`` (on every rank; a rank whose own arguments are bad raises its own
            error, the others one that names it).

    Example (4 ranks, mesh ``(2, 2)``, ``A = np.arange(8)``, ``[Shard(0), Shard(0)]``): rank 0
    holds ``A[0:2]``, rank 1 ``A[2:4]``, rank 2 ``A[4:6]``, rank 3 ``A[6:8]``, cut from rank 0's
    ``A`` whatever the others passed (with ``src_data_rank=None``, from each rank's own ``A``).
    """
    op = "distribute_tensor"
    if not isinstance(device_mesh, DeviceMesh):
        raise errors.type_error(op, f"device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}")
    coordinate = coordinate_of(op, device_mesh)  # outside the mesh: no group to take part in the check
    own: Exception | None = None
    arguments: dict[str, Any] | None = None
    try:
        if isinstance(tensor, DTensor):
            raise errors.type_error(op, "tensor is already a DTensor; use its redistribute()")
        if src_data_rank is not None and (isinstance(src_data_rank, bool) or not isinstance(src_data_rank, int)):
            raise errors.type_error(op, f"src_data_rank must be an int or None, got {src_data_rank!r}")
        if not hasattr(tensor, "shape") or not hasattr(tensor, "dtype"):
            tensor = np.asarray(tensor)
        placements = normalize_placements(op, device_mesh, placements, tensor.ndim)
        if src_data_rank is not None and not all(0 <= src_data_rank < n for n in device_mesh.shape):
            raise errors.value_error(op, f"src_data_rank={src_data_rank} is not a rank of every mesh dimension: "
                                         f"the mesh has shape {device_mesh.shape}; valid are 0 to "
                                         f"{min(device_mesh.shape) - 1}, or None")
        arguments = {"shape": tuple(tensor.shape), "dtype": str(tensor.dtype), "placements": placements,
                     "src_data_rank": src_data_rank}
    except (DistValueError, DistTypeError) as exc:  # told to every rank, then raised here
        own = exc
    check_same_arguments(op, device_mesh, arguments, own)
    if src_data_rank is None:
        local = tensor[local_slices(tensor.shape, device_mesh.shape, coordinate, placements)].copy()
        for i, p in enumerate(placements):
            if isinstance(p, Partial):
                local = partition_value(local, p, coordinate[i])
    else:
        local = _from_source(tensor, device_mesh, coordinate, placements, src_data_rank)
    return DTensor(local, device_mesh, placements, shape=tensor.shape)


def _from_source(tensor: Any, mesh: DeviceMesh, coordinate: Sequence[int], placements: Sequence[Placement],
                 src: int) -> Any:
    """This rank's block, scattered or broadcast from group rank ``src`` of each mesh dim in turn.

    After mesh dim ``i`` every rank holds what the rank at coordinate ``src`` along dims ``0..i``
    (and its own coordinates on the others) held, so after the last only the values of the rank
    at ``(src, ..., src)`` count. Mesh dims go left to right, so nested Shards cut the outer
    chunk first; uneven chunks travel zero-padded and are stripped.
    """
    xp = array_namespace(tensor)
    local = tensor
    for i, p in enumerate(placements):
        group, n, r = mesh.get_group(i), mesh.shape[i], coordinate[i]
        if isinstance(p, Shard):
            d, parent = p.dim, local.shape[p.dim]
            c = chunk_size(parent, n)
            chunks = None
            if r == src:
                chunks = []
                for k in range(n):
                    start, stop = chunk_range(parent, n, k)
                    index = [slice(None)] * local.ndim
                    index[d] = slice(start, stop)
                    chunks.append(_padded_along(xp, local[tuple(index)], d, c))
            shape = list(local.shape)
            shape[d] = c
            # every byte is written: the chunks are c long on the source too (distribute_tensor checked that
            # every rank passed the same shape before any data moved)
            out = xp.empty(tuple(shape), dtype=local.dtype)
            group.scatter(out, chunks, src)
            start, stop = chunk_range(parent, n, r)
            index = [slice(None)] * local.ndim
            index[d] = slice(0, stop - start)
            # a short chunk: the padding stripped, into memory of its own (a C-contiguous block, as the
            # local cut gives: strategies that flatten parameters refuse strided ones)
            local = xp.ascontiguousarray(out[tuple(index)]) if stop - start < c else out
        else:
            buf = xp.array(local, copy=True, order="C")  # received into: never the caller's array
            group.broadcast(buf, src)
            local = buf if isinstance(p, Replicate) else partition_value(buf, p, r)
    return local


def _padded_along(xp: Any, piece: Any, d: int, c: int) -> Any:
    """``piece`` as a C-contiguous array of length ``c`` along ``d`` (zeros after it)."""
    if piece.shape[d] == c:
        return xp.ascontiguousarray(piece)
    shape = list(piece.shape)
    shape[d] = c
    out = xp.zeros(tuple(shape), dtype=piece.dtype)
    out[tuple(slice(0, k) for k in piece.shape)] = piece
    return out
