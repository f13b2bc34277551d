"""Placements: how a DTensor's global array is laid out over one mesh dimension.

A DTensor has one placement per *mesh* dimension (as torch's DTensor; JAX's PartitionSpec is
one per *array* dimension instead). Worked example, a global array ``A`` of shape ``(6, 4)`` on a
2x2 mesh ``[[0, 1], [2, 3]]`` (mesh dim 0 = rows of the mesh, mesh dim 1 = columns):

* ``[Shard(0), Replicate()]``: mesh dim 0 cuts rows; ranks 0 and 1 hold ``A[0:3]``, ranks 2 and
  3 hold ``A[3:6]`` (ranks in one mesh row hold the same block).
* ``[Shard(0), Shard(1)]``: rank 0 ``A[0:3, 0:2]``, rank 1 ``A[0:3, 2:4]``, rank 2
  ``A[3:6, 0:2]``, rank 3 ``A[3:6, 2:4]``.
* ``[Shard(0), Shard(0)]``: two Shard on one array dim nest left to right: mesh dim 0 cuts rows
  into ``0:3`` and ``3:6``, mesh dim 1 cuts each of those again: rank 0 ``A[0:2]``, rank 1
  ``A[2:3]``, rank 2 ``A[3:5]``, rank 3 ``A[5:6]`` (uneven cuts follow ``torch.chunk``).
* ``[Partial(), Replicate()]``: every rank holds an array of the full shape; ``A`` is the sum
  of rank 0's and rank 2's arrays (the ones along mesh dim 0); ranks 1 and 3 hold the same
  arrays as 0 and 2.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..comm import ReduceOp

__all__ = ["Placement", "Shard", "Replicate", "Partial", "PARTIAL_OPS"]

#: Reductions a Partial placement may stand for, and the collective op that completes each.
PARTIAL_OPS: dict[str, ReduceOp] = {"sum": ReduceOp.SUM, "avg": ReduceOp.AVG,
                                    "max": ReduceOp.MAX, "min": ReduceOp.MIN}


class Placement:
    """Base of the placements; ``is_shard``/``is_replicate``/``is_partial`` as in torch."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        """True for a Shard (on ``dim`` when given)."""
        return False

    def is_replicate(self) -> bool:
        """True for Replicate."""
        return False

    def is_partial(self) -> bool:
        """True for Partial."""
        return False


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """The array is cut along array dimension ``dim`` over the ranks of this mesh dimension.

    A dimension of size ``s`` over ``n`` ranks is cut as ``torch.chunk`` cuts it: chunks of
    ``ceil(s / n)``, so trailing ranks may hold fewer rows or none (6 over 4: 2, 2, 2, 0).
    ``dim`` may be negative until it is normalised against the array's ndim.
    """

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"Shard(dim): dim must be an int, got {self.dim!r}")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every rank of this mesh dimension holds the same full (along this dim) array."""

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """Each rank of this mesh dimension holds a full-shape term; the array is their reduction.

    ``reduce_op`` is one of ``"sum"`` (default), ``"avg"``, ``"max"``, ``"min"``.
    """

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in PARTIAL_OPS:
            raise ValueError(f"Partial(reduce_op): must be one of {sorted(PARTIAL_OPS)}, got {self.reduce_op!r}")

    def is_partial(self) -> bool:
        return True

    @property
    def op(self) -> ReduceOp:
        """The collective reduction that turns the terms into the array."""
        return PARTIAL_OPS[self.reduce_op]

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op})"

    def __str__(self) -> str:
        return f"P({self.reduce_op})"
