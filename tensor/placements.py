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

import threading
from typing import Any

from ..comm import ReduceOp
from . import errors

__all__ = ["Placement", "Shard", "Replicate", "Partial", "PARTIAL_OPS"]

#: Reductions a Partial placement may stand for, and the collective op that completes each.
PARTIAL_OPS: dict[str, ReduceOp] = {"sum": ReduceOp.SUM, "avg": ReduceOp.AVG,
                                    "max": ReduceOp.MAX, "min": ReduceOp.MIN}


class Placement:
    """Base of the placements; ``is_shard``/``is_replicate``/``is_partial`` as in torch.

    Placements are immutable values, interned: ``Shard(0) is Shard(0)``. Equality and hashing
    are therefore identity's, done in C: the redistribution table and the op rules look
    placements up on every call, and a Python-level ``__eq__``/``__hash__`` per placement was a
    measurable part of a small redistribution. Pickling and copying keep the interning.
    """

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

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable: cannot delete {name!r}")

    def __copy__(self) -> Placement:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Placement:
        return self


_interning = threading.Lock()  # ranks of the local engine are threads: one instance per value


class Shard(Placement):
    """The array is cut along array dimension ``dim`` over the ranks of this mesh dimension.

    A dimension of size ``s`` over ``n`` ranks is cut as ``torch.chunk`` cuts it: chunks of
    ``ceil(s / n)``, so trailing ranks may hold fewer rows or none (6 over 4: 2, 2, 2, 0).
    ``dim`` may be negative until it is normalised against the array's ndim.
    """

    __slots__ = ("dim",)
    __match_args__ = ("dim",)
    _known: dict[int, Shard] = {}
    dim: int

    def __new__(cls, dim: int) -> Shard:
        found = cls._known.get(dim) if dim.__class__ is int else None
        if found is not None:
            return found
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise errors.type_error("Shard(dim)", f"dim must be an int, got {dim!r}")
        dim = int(dim)
        with _interning:
            found = cls._known.get(dim)
            if found is None:
                found = object.__new__(cls)
                object.__setattr__(found, "dim", dim)
                cls._known[dim] = found
        return found

    def __reduce__(self) -> tuple[Any, ...]:
        return (Shard, (self.dim,))

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"

    def __str__(self) -> str:
        return f"S({self.dim})"


class Replicate(Placement):
    """Every rank of this mesh dimension holds the same full (along this dim) array."""

    __slots__ = ()
    _the: Replicate | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Replicate:
        if args or kwargs:
            raise errors.type_error("Replicate()", f"takes no arguments, got {args or ''}{kwargs or ''}")
        the = Replicate._the
        if the is None:
            with _interning:
                if Replicate._the is None:
                    type.__setattr__(Replicate, "_the", object.__new__(cls))
                the = Replicate._the
        return the

    def __reduce__(self) -> tuple[Any, ...]:
        return (Replicate, ())

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"

    def __str__(self) -> str:
        return "R"


class Partial(Placement):
    """Each rank of this mesh dimension holds a full-shape term; the array is their reduction.

    ``reduce_op`` is one of ``"sum"`` (default), ``"avg"``, ``"max"``, ``"min"``.
    """

    __slots__ = ("reduce_op",)
    __match_args__ = ("reduce_op",)
    _known: dict[str, Partial] = {}
    reduce_op: str

    def __new__(cls, reduce_op: str = "sum") -> Partial:
        found = cls._known.get(reduce_op) if reduce_op.__class__ is str else None
        if found is not None:
            return found
        if not isinstance(reduce_op, str):
            raise errors.type_error("Partial(reduce_op)", f"reduce_op must be a str, one of {sorted(PARTIAL_OPS)}, "
                                                          f"got {reduce_op!r}")
        if reduce_op not in PARTIAL_OPS:
            raise errors.value_error("Partial(reduce_op)", f"must be one of {sorted(PARTIAL_OPS)}, got {reduce_op!r}")
        with _interning:
            found = cls._known.get(reduce_op)
            if found is None:
                found = object.__new__(cls)
                object.__setattr__(found, "reduce_op", reduce_op)
                cls._known[reduce_op] = found
        return found

    def __reduce__(self) -> tuple[Any, ...]:
        return (Partial, (self.reduce_op,))

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
