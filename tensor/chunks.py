"""Shard arithmetic: which block of the global array a rank holds (``torch.chunk`` rule).

Pure integer arithmetic, no communication, so the redistribution, the NumPy op rules and the
checkpoints all share it. A dimension of size ``s`` cut over ``n`` ranks gives chunks of
``c = ceil(s / n)``; rank ``r`` holds ``[min(r*c, s), min((r+1)*c, s))``, so trailing ranks may
hold fewer rows or none::

    chunk_range(6, 4, r) -> (0, 2), (2, 4), (4, 6), (6, 6)     # sizes 2, 2, 2, 0
    chunk_range(5, 4, r) -> (0, 2), (2, 4), (4, 5), (5, 5)     # sizes 2, 2, 1, 0

Several ``Shard`` on one array dimension nest left to right over the mesh dimensions: the first
cuts the dimension, the next cuts each of those chunks again, and so on.
"""

from __future__ import annotations

from typing import Sequence

from .placements import Placement, Shard

__all__ = ["chunk_size", "chunk_range", "local_shape_and_offset", "local_slices", "normalize_dim"]


def chunk_size(size: int, n: int) -> int:
    """The full chunk length ``ceil(size / n)`` (the padded length collectives use)."""
    return -(-size // n)


def chunk_range(size: int, n: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of chunk ``index`` when ``size`` elements are cut into ``n`` chunks."""
    c = chunk_size(size, n)
    return min(index * c, size), min((index + 1) * c, size)


def normalize_dim(dim: int, ndim: int, *, what: str = "Shard(dim)") -> int:
    """``dim`` made non-negative for an array of ``ndim`` dimensions; IndexError if out of range."""
    if not -ndim <= dim < ndim:
        raise IndexError(f"{what}: dim {dim} is out of range for an array of {ndim} dimensions")
    return dim % ndim


def local_shape_and_offset(global_shape: Sequence[int], mesh_shape: Sequence[int],
                           coordinate: Sequence[int], placements: Sequence[Placement]
                           ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and global offset of the block held at mesh ``coordinate`` (torch's rule).

    Args:
        global_shape: the global array's shape.
        mesh_shape: the mesh's shape (one size per mesh dimension).
        coordinate: this rank's coordinate in the mesh.
        placements: one per mesh dimension; Shard dims must already be non-negative.

    Returns:
        ``(local_shape, offset)``: the block is ``A[offset[d] : offset[d] + local_shape[d]]``
        along each array dim ``d``. Example: shape ``(6,)``, mesh ``(2, 2)``,
        ``[Shard(0), Shard(0)]``: coordinate ``(1, 0)`` -> ``((2,), (3,))``.
    """
    shape = list(global_shape)
    offset = [0] * len(shape)
    for n, index, p in zip(mesh_shape, coordinate, placements):
        if isinstance(p, Shard):
            start, stop = chunk_range(shape[p.dim], n, index)
            shape[p.dim] = stop - start
            offset[p.dim] += start
    return tuple(shape), tuple(offset)


def local_slices(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                 placements: Sequence[Placement]) -> tuple[slice, ...]:
    """The block at ``coordinate`` as a tuple of slices into the global array."""
    shape, offset = local_shape_and_offset(global_shape, mesh_shape, coordinate, placements)
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))
