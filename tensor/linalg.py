"""``np.linalg.norm``, ``np.outer``, ``np.trace``, ``np.tensordot`` (and ``np.dot`` beyond two matrices).

* ``norm`` (vector norms, and ``'fro'`` of matrices): the per-block partial sums (of ``|x|^2``,
  ``|x|``, ``|x|^p``) or extremes (``inf``: max of ``|x|``; ``-inf``: min) over a sharded reduced
  axis are all-reduced once (one all-reduce per mesh dim of the output block; ``sum`` and
  ``max`` leave Partial, reduced here because the root is not linear), then the root is taken:
  Replicate there, kept Shards stay. A Partial input is all-reduced first. ``ord`` 2, -2 and
  ``'nuc'`` of matrices (singular values) are refused: NotImplementedError naming them.
* ``outer``, ``tensordot`` and ``dot`` are written as :func:`np.einsum` calls, so they take its
  rules (:mod:`.einsum`): a Shard on a kept letter stays, a contracted sharded letter gives
  Partial(sum), one Partial beside Replicate operands stays. ``outer`` flattens its operands
  (``np.reshape``'s rule, which gathers where a block would move).
* ``trace`` of a 2-D array: each rank sums the diagonal elements its block holds (computed from
  the offsets, no communication), so a mesh dim sharding either axis leaves Partial(sum) and a
  Partial(sum|avg) input stays (the trace is linear).
"""

from __future__ import annotations

import string
from typing import Any

import numpy as np

from ..comm import ReduceOp
from ..comm._seams import array_namespace
from . import errors
from .chunks import local_shape_and_offset
from .dispatch import implements
from .dtensor import DTensor, _wrap
from .placements import Partial, Placement, Replicate, Shard
from .propagation import moved, norm_axes, unsupported, wrap
from .reduction_plan import reduction_plan

__all__ = ["norm", "outer", "trace", "tensordot"]  # np.dot is matmul.py's (its N-D form calls tensordot)


@implements(np.linalg.norm)
def norm(x: Any, ord: Any = None, axis: Any = None, keepdims: bool = False) -> DTensor:
    """``np.linalg.norm``: block partial sums (or extremes), one all-reduce over a sharded reduced
    axis, then the root (see the module's rules)."""
    op = "np.linalg.norm"
    if not isinstance(x, DTensor):
        raise unsupported(op)
    axes = norm_axes(op, x.ndim, axis)
    matrix = (axis is None and x.ndim == 2 and ord is not None) or len(axes) == 2
    if len(axes) > 2 or (axis is not None and not isinstance(axis, (int, np.integer)) and len(axes) != len(axis)):
        raise ValueError(errors.prefix(op) + "improper number of dimensions to norm")
    if matrix and ord not in (None, "fro"):
        raise NotImplementedError(errors.prefix(op) + f"the matrix norm ord={ord!r} has no DTensor rule "
                                  f"(placements {x.placements!r}); compute it on full_tensor() (redistribute to "
                                  "Replicate first)")
    if not matrix and isinstance(ord, str):
        raise ValueError(errors.prefix(op) + f"invalid norm order {ord!r} for vectors")
    if ord is None or ord == "fro":
        ord = 2
    plan = reduction_plan(x.device_mesh, x.shape, x.placements, axes, bool(keepdims))
    local = moved(op, "x", x, plan.need).to_local()
    xp = array_namespace(local)
    if local.dtype.kind not in "fc":
        local = local.astype(np.float64)
    mag = xp.abs(local) if local.dtype.kind == "c" or ord not in (None, 2) else local
    real = mag.dtype if mag.dtype.kind == "f" else np.dtype(np.float64)
    if ord == np.inf or ord == -np.inf:
        kind = "max" if ord == np.inf else "min"
        if any(s == 0 for s in local.shape):
            fill = 0.0 if kind == "max" else np.inf
            part = xp.full(tuple(1 if d in axes else s for d, s in enumerate(local.shape)), fill, dtype=real)
        else:
            part = (xp.max if kind == "max" else xp.min)(mag, axis=axes, keepdims=True)
        reduce_op = ReduceOp.MAX if kind == "max" else ReduceOp.MIN
    elif ord == 0:
        part = xp.sum(mag != 0, axis=axes, keepdims=True).astype(real)
        reduce_op = ReduceOp.SUM
    elif ord == 1:
        part = xp.sum(mag, axis=axes, keepdims=True)
        reduce_op = ReduceOp.SUM
    elif ord == 2:
        if len(axes) == local.ndim and local.dtype.kind == "f":  # the whole block: one BLAS dot, no temporaries
            flat = local.reshape(-1)
            part = xp.asarray(xp.dot(flat, flat)).reshape((1,) * local.ndim)
        else:
            part = xp.sum(mag * mag, axis=axes, keepdims=True)
        reduce_op = ReduceOp.SUM
    else:
        p = float(ord)
        part = xp.sum(mag ** p, axis=axes, keepdims=True)
        reduce_op = ReduceOp.SUM
    if plan.merged:
        plan.reduce(part, reduce_op)  # part is this call's own array
    if ord == 2:
        part = xp.sqrt(part, out=part)
    elif ord not in (np.inf, -np.inf, 0, 1):
        part = part ** (1.0 / float(ord))
    if not keepdims:
        part = part.reshape(plan.squeezed_block)
    return _wrap(part, x.device_mesh, plan.out, plan.shape)


def _letters(n: int, skip: str = "") -> str:
    return "".join(c for c in string.ascii_letters if c not in skip)[:n]


@implements(np.outer)
def outer(a: Any, b: Any, out: Any = None) -> DTensor:
    """``np.outer``: both operands flattened, then ``einsum('i,j->ij')`` (its rules)."""
    op = "np.outer"
    if out is not None or not (isinstance(a, DTensor) and isinstance(b, DTensor)):
        raise unsupported(op, *(x.placements for x in (a, b) if isinstance(x, DTensor)))
    return np.einsum("i,j->ij", np.reshape(a, (-1,)), np.reshape(b, (-1,)))


@implements(np.tensordot)
def tensordot(a: Any, b: Any, axes: Any = 2) -> DTensor:
    """``np.tensordot``: the contraction as an einsum (its rules: a sharded contracted axis gives Partial(sum))."""
    op = "np.tensordot"
    if not (isinstance(a, DTensor) and isinstance(b, DTensor)):
        raise unsupported(op, *(x.placements for x in (a, b) if isinstance(x, DTensor)))
    if isinstance(axes, (int, np.integer)):
        n = int(axes)
        ax_a, ax_b = list(range(a.ndim - n, a.ndim)), list(range(n))
    else:
        ax_a, ax_b = axes
        ax_a = [ax_a] if isinstance(ax_a, (int, np.integer)) else list(ax_a)
        ax_b = [ax_b] if isinstance(ax_b, (int, np.integer)) else list(ax_b)
    if len(ax_a) != len(ax_b):
        raise ValueError(errors.prefix(op) + "shape-mismatch for sum")
    ax_a = [d % a.ndim for d in ax_a]
    ax_b = [d % b.ndim for d in ax_b]
    for da, db in zip(ax_a, ax_b):
        if a.shape[da] != b.shape[db]:
            raise ValueError(errors.prefix(op) + f"shape-mismatch for sum: {a.shape} axis {da} and {b.shape} axis {db}")
    letters = _letters(a.ndim + b.ndim)
    ta = list(letters[:a.ndim])
    tb = list(letters[a.ndim:a.ndim + b.ndim])
    for da, db in zip(ax_a, ax_b):
        tb[db] = ta[da]
    out = [c for d, c in enumerate(ta) if d not in ax_a] + [c for d, c in enumerate(tb) if d not in ax_b]
    return np.einsum(f"{''.join(ta)},{''.join(tb)}->{''.join(out)}", a, b)


@implements(np.trace)
def trace(a: Any, offset: int = 0, axis1: int = 0, axis2: int = 1, dtype: Any = None, out: Any = None) -> DTensor:
    """``np.trace`` of a 2-D DTensor: each rank sums the diagonal elements of its block (no
    communication); a sharded axis leaves Partial(sum), a Partial(sum|avg) stays."""
    op = "np.trace"
    if not isinstance(a, DTensor) or out is not None or a.ndim != 2 or (axis1 % 2, axis2 % 2) != (0, 1):
        raise unsupported(op, *((a.placements,) if isinstance(a, DTensor) else ()))
    mesh = a.device_mesh
    need: list[Placement] = []
    res: list[Placement] = []
    for p in a.placements:
        if isinstance(p, Shard):
            need.append(p)
            res.append(Partial("sum"))
        elif isinstance(p, Partial) and p.reduce_op in ("sum", "avg"):
            need.append(p)
            res.append(p)
        else:
            need.append(Replicate())
            res.append(Replicate())
    # a Shard on both axes along one mesh dim cannot happen; two mesh dims sharding give Partial on each
    local = moved(op, "a", a, need).to_local()
    xp = array_namespace(local)
    (s0, s1), (o0, o1) = local_shape_and_offset(a.shape, mesh.shape, mesh.get_coordinate(), need)
    rows = np.arange(o0, o0 + s0)
    cols = rows + offset
    inside = (cols >= o1) & (cols < o1 + s1)
    dt = dtype if dtype is not None else np.trace(np.zeros((1, 1), dtype=a.dtype)).dtype
    picked = local[xp.asarray(rows[inside] - o0), xp.asarray(cols[inside] - o1)]
    return wrap(xp.sum(picked, dtype=dt), mesh, res, ())
