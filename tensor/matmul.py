"""``@`` / ``np.matmul`` / ``np.dot`` on DTensors: the rules that need no communication.

Per mesh dimension, for ``A (..., m, k) @ B (..., k, n)``:

========================  ============  =========================================
A                         B             output
========================  ============  =========================================
Replicate                 Replicate     Replicate
Shard(m)                  Replicate     Shard(m)          (rows of A)
Replicate                 Shard(n)      Shard(n)          (columns of B)
Shard(k)                  Shard(k)      Partial(sum)      (the contraction is split)
Partial(sum|avg)          Replicate     the same Partial  (and the mirror image; the
                                        Replicate operand finite and Replicate on
                                        every mesh dim, else the Partial is reduced)
Shard(batch)              Shard(batch)  Shard(batch)      (or Replicate where broadcast)
========================  ============  =========================================

Any other pair is first made one of these by redistributing one operand (the one whose move
is cheaper: a local slice of a Replicate before a collective), else both to Replicate; every
move is logged at DEBUG.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import errors
from .dispatch import implements, implements_ufunc
from .dtensor import DTensor
from .placements import Partial, Placement, Replicate, Shard
from .propagation import common_mesh, moved, no_out, uniform_finite, unsupported, wrap

__all__ = ["matmul", "dot"]


class _Shapes:
    """Dims of A, B and the output for one matmul (batch dims broadcast from the right)."""

    def __init__(self, a: DTensor, b: DTensor) -> None:
        self.a, self.b = a.shape, b.shape
        # Checked on the global shapes, the same on every rank, so every rank raises: each rank's
        # blocks may still fit (a (5, 4) @ (3, 4) with Shard(1) gave rank 0 a product of the wrong
        # rows and rank 1 NumPy's own error, alone)
        try:
            if self.a[-1] != self.b[-2]:
                raise ValueError(f"the contraction dims differ: {self.a[-1]} and {self.b[-2]}")
            batch = tuple(np.broadcast_shapes(self.a[:-2], self.b[:-2]))
        except ValueError as exc:
            raise errors.value_error("np.matmul", f"shapes {self.a} and {self.b} do not multiply ({exc}); a @ b "
                                     "needs a.shape[-1] == b.shape[-2] and batch dims that broadcast") from None
        self.out = batch + (self.a[-2], self.b[-1])
        self.nd = len(self.out)

    def out_dim(self, side: str, d: int) -> int | None:
        """Output dim of a batch/row/col dim of A or B (None for the contraction dim k)."""
        shape = self.a if side == "a" else self.b
        nd = len(shape)
        if d < nd - 2:
            return d + self.nd - nd
        if side == "a":
            return self.nd - 2 if d == nd - 2 else None
        return self.nd - 1 if d == nd - 1 else None

    def full(self, side: str, d: int) -> bool:
        """True if ``side``'s dim ``d`` is not broadcast in the output."""
        shape = self.a if side == "a" else self.b
        o = self.out_dim(side, d)
        return o is None or shape[d] == self.out[o]

    def in_dim(self, side: str, o: int) -> int | None:
        """``side``'s dim that becomes output batch dim ``o`` (None if it has none or broadcasts it)."""
        shape = self.a if side == "a" else self.b
        d = o - (self.nd - len(shape))
        return d if 0 <= d < len(shape) - 2 and shape[d] == self.out[o] else None


def _result(s: _Shapes, pa: Placement, pb: Placement, factor_ok: dict[str, bool]) -> Placement | None:
    """The output placement for ``(pa, pb)`` on one mesh dim, or None if no local rule exists.

    ``factor_ok[side]``: that operand may multiply the other's Partial terms (see :func:`matmul`).
    """
    ka, kb = len(s.a) - 1, len(s.b) - 2
    if pa.is_replicate() and pb.is_replicate():
        return Replicate()
    if isinstance(pa, Shard) and isinstance(pb, Shard) and pa.dim == ka and pb.dim == kb:
        return Partial("sum")
    for p, q, side, other in ((pa, pb, "a", "b"), (pb, pa, "b", "a")):
        if isinstance(p, Partial) and p.reduce_op in ("sum", "avg") and q.is_replicate() and factor_ok[other]:
            return p
        if isinstance(p, Shard) and s.full(side, p.dim) and (o := s.out_dim(side, p.dim)) is not None:
            if o >= s.nd - 2:  # rows of A or columns of B: the other operand whole
                if q.is_replicate():
                    return Shard(o)
            elif isinstance(q, Shard) and s.out_dim(other, q.dim) == o and s.full(other, q.dim):
                return Shard(o)
            elif q.is_replicate() and s.in_dim(other, o) is None:
                return Shard(o)
    return None


def _partner(s: _Shapes, p: Placement, side: str) -> Placement:
    """What the other operand should hold on this mesh dim to pair with ``p`` on ``side``."""
    other = "b" if side == "a" else "a"
    if isinstance(p, Shard):
        o = s.out_dim(side, p.dim)
        if o is None:
            return Shard(len(s.b) - 2 if side == "a" else len(s.a) - 1)
        if o < s.nd - 2 and (d := s.in_dim(other, o)) is not None:
            return Shard(d)
    return Replicate()


def _cost(src: Placement, dst: Placement) -> int:
    return 0 if src == dst else 1 if src.is_replicate() else 2


def _plan(s: _Shapes, pa: Placement, pb: Placement, factor_ok: dict[str, bool]
          ) -> tuple[Placement, Placement, Placement]:
    """``(A's, B's, output)`` placement on one mesh dim: as given if a rule exists, else the cheapest fix."""
    out = _result(s, pa, pb, factor_ok)
    if out is not None:
        return pa, pb, out
    options = []
    for qa, qb in ((pa, _partner(s, pa, "a")), (_partner(s, pb, "b"), pb), (Replicate(), Replicate())):
        r = _result(s, qa, qb, factor_ok)
        if r is not None:
            options.append((_cost(pa, qa) + _cost(pb, qb), qa, qb, r))
    cost, qa, qb, r = min(options, key=lambda t: t[0])
    return qa, qb, r


@implements_ufunc("__call__", np.matmul)
def matmul(a: Any, b: Any, **kwargs: Any) -> DTensor:
    """``a @ b`` for DTensors of 2 or more dims (see the module's table)."""
    op = "np.matmul"
    no_out(op, kwargs, "axes", "axis")
    mesh = common_mesh(op, (a, b))
    if not (isinstance(a, DTensor) and isinstance(b, DTensor)) or a.ndim < 2 or b.ndim < 2:
        raise unsupported(op, *(x.placements for x in (a, b) if isinstance(x, DTensor)))
    s = _Shapes(a, b)
    # Partial terms @ a Replicate operand are the product's terms only where that operand is
    # finite (inf times a term 0 is NaN where the sum is +-inf) and every rank sees that alike: a
    # scan of the operand, only when some mesh dim pairs a Partial with it.
    linear = [isinstance(p, Partial) and p.reduce_op in ("sum", "avg") for p in (*a.placements, *b.placements)]
    factor_ok = {"a": any(linear[a.device_mesh.ndim:]) and uniform_finite(a),
                 "b": any(linear[:a.device_mesh.ndim]) and uniform_finite(b)}
    plans = [_plan(s, pa, pb, factor_ok) for pa, pb in zip(a.placements, b.placements)]
    la = moved(op, "argument 0", a, [p[0] for p in plans]).to_local()
    lb = moved(op, "argument 1", b, [p[1] for p in plans]).to_local()
    return wrap(np.matmul(la, lb, **kwargs), mesh, [p[2] for p in plans], s.out)


@implements(np.dot)
def dot(a: Any, b: Any, out: Any = None) -> DTensor:
    """``np.dot``: two matrices by :func:`matmul`'s rules; vectors and N-D operands as
    ``np.tensordot`` over a's last axis and b's second to last (einsum's rules); a 0-d operand
    as ``np.multiply``."""
    if out is not None or not (isinstance(a, DTensor) and isinstance(b, DTensor)):
        raise unsupported("np.dot", *(x.placements for x in (a, b) if isinstance(x, DTensor)))
    if a.ndim == 2 and b.ndim == 2:
        return matmul(a, b)
    if a.ndim == 0 or b.ndim == 0:
        return np.multiply(a, b)
    # 1-D operands, or N-D: the sum over a's last axis and b's second to last (b's only, if 1-D)
    return np.tensordot(a, b, axes=([a.ndim - 1], [max(b.ndim - 2, 0)]))
