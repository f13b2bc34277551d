"""``np.linalg.norm``, ``np.outer``, ``np.trace``, ``np.tensordot`` (and ``np.dot`` beyond two matrices).

* ``norm`` (vector norms, and ``'fro'`` of matrices): the per-block partial sums (of ``|x|^2``,
  ``|x|``, ``|x|^p``) or extremes (``inf``: max of ``|x|``; ``-inf``: min) over a sharded reduced
  axis are all-reduced once (one all-reduce per mesh dim of the output block; ``sum`` and
  ``max`` leave Partial, reduced here because the root is not linear), then the root is taken:
  Replicate there, kept Shards stay. A Partial input is all-reduced first. The other matrix
  norms of 2-D arrays: ``1``/``-1``/``inf``/``-inf`` by the sum and max rules, ``2``/``-2``/``'nuc'``
  (singular values) by TSQR: one all-gather of each block's triangular factor
  (:func:`_matrix_norm`); of N-d arrays they are refused, naming the op and the placements.
* ``outer``, ``tensordot`` and ``dot`` are written as :func:`np.einsum` calls, so they take its
  rules (:mod:`.einsum`): a Shard on a kept letter stays, a contracted sharded letter gives
  Partial(sum), one Partial beside Replicate operands stays. ``outer`` flattens its operands
  (``np.reshape``'s rule, which gathers where a block would move).
* ``trace`` of a 2-D array: each rank sums the diagonal elements its block holds (computed from
  the offsets, no communication), so a mesh dim sharding either axis leaves Partial(sum) and a
  Partial(sum|avg) input stays (the trace is linear).
"""

from __future__ import annotations

import math
import string
from typing import Any

import numpy as np

from ..comm import ReduceOp
from ..comm._seams import all_reduce_owned, array_namespace
from . import errors
from .chunks import local_shape_and_offset
from .dispatch import implements
from .dtensor import DTensor, _wrap
from .placements import Partial, Placement, Replicate, Shard
from .propagation import moved, norm_axes, unsupported, wrap
from . import reduction_plan as _plans
from .reduction_plan import keep_compiled, reduction_plan

__all__ = ["norm", "outer", "trace", "tensordot"]  # np.dot is matmul.py's (its N-D form calls tensordot)


@implements(np.linalg.norm)
def norm(x: Any, ord: Any = None, axis: Any = None, keepdims: bool = False) -> DTensor:
    """``np.linalg.norm``: block partial sums (or extremes), one all-reduce over a sharded reduced
    axis, then the root (see the module's rules); matrix norms ``1``/``-1``/``inf``/``-inf`` of
    2-D arrays by the sum and max rules, ``2``/``-2``/``'nuc'`` by TSQR (one all-gather of each
    block's triangular factor, :func:`_matrix_norm`)."""
    op = "np.linalg.norm"
    if ord is None and axis is None and x.__class__ is DTensor and keepdims.__class__ is bool:  # an exact key
        local = x._local
        key = (op, id(x._mesh), x._shape, x._placements, local.dtype, local.__class__, keepdims)
        found = _plans._compiled.get(key)  # compiled(key, mesh), inlined: the hot path
        if found is not None and found[0]() is x._mesh:
            return found[1](x)
        return _flat_norm(op, x, keepdims, key)
    if not isinstance(x, DTensor):
        raise unsupported(op)
    if ord is None and axis is None:  # the 2-norm of the flattened array (a gradient's norm): the hot path
        return _flat_norm(op, x, bool(keepdims))
    axes = norm_axes(op, x.ndim, axis)
    matrix = (axis is None and x.ndim == 2 and ord is not None) or len(axes) == 2
    if len(axes) > 2 or (axis is not None and not isinstance(axis, (int, np.integer)) and len(axes) != len(axis)):
        raise ValueError(errors.prefix(op) + "improper number of dimensions to norm")
    if matrix and ord not in (None, "fro"):
        return _matrix_norm(op, x, ord, axis, bool(keepdims))
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


def _flat_norm(op: str, x: DTensor, keepdims: bool, key: tuple[Any, ...] | None = None) -> DTensor:
    """``np.linalg.norm(x)`` of any rank: each block's sum of squares (one BLAS dot for real
    floats), one all-reduce per mesh dim sharding the array, the root; Replicate there. With
    ``key``, the call is compiled for the next one where it can (real float NumPy blocks)."""
    plan = reduction_plan(x.device_mesh, x.shape, x.placements, tuple(range(x.ndim)), keepdims)
    local = moved(op, "x", x, plan.need).to_local()
    xp = array_namespace(local)
    kind = local.dtype.kind
    if kind not in "fc":
        local = local.astype(np.float64)
    if kind == "c":
        part = xp.asarray(xp.sum(local.real * local.real + local.imag * local.imag))
    else:
        flat = local.reshape(-1)
        part = xp.asarray(xp.dot(flat, flat))  # a new 0-d array: ours to reduce in place
    if plan.merged:
        plan.reduce(part, ReduceOp.SUM)
    part = xp.sqrt(part, out=part)
    if key is not None and kind == "f" and local.__class__ is np.ndarray and plan.need == x._placements and \
            len(plan.groups) <= 1:
        keep_compiled(key, x._mesh, _flat_norm_call(plan))
    return _wrap(part.reshape(plan.shape), x.device_mesh, plan.out, plan.shape)


def _flat_norm_call(plan: Any) -> Any:
    """:func:`_flat_norm` compiled for one request (real float NumPy blocks): one BLAS dot, one
    all-reduce, the root, the wrap."""
    group = plan.groups[0] if plan.groups else None
    placements, shape, total = plan.out, plan.shape, ReduceOp.SUM

    def call(x: DTensor) -> DTensor:
        flat = x._local.ravel()
        part = np.asarray(np.dot(flat, flat))
        if group is not None:
            all_reduce_owned(group, part, total)  # a new array of ours: the public checks hold
        part = np.sqrt(part)  # a new 0-d array: half the time of np.sqrt(part, out=part) (its keyword)
        return _wrap(part.reshape(shape) if shape else part, x._mesh, placements, shape)
    return call


def _matrix_norm(op: str, x: DTensor, ord: Any, axis: Any, keepdims: bool) -> DTensor:
    """The matrix norms of a 2-D DTensor beyond ``'fro'``; the result is Replicate.

    * ``1``, ``-1``, ``inf``, ``-inf``: the column (row) sums of ``|x|`` by ``np.sum``'s rule (a
      sharded summed axis leaves Partial(sum)), their max (min) by ``np.max``'s (the Partial
      all-reduced first), then the Partial(max|min) it leaves all-reduced: two all-reduces of a
      line at most.
    * ``2``, ``-2``, ``'nuc'`` (singular values): TSQR. Each rank's block along the one sharded axis
      (the other gathered first, a Partial all-reduced) is reduced to its ``n x n`` triangular
      factor R (``np.linalg.qr``; a block of fewer rows is sent as it is, padded with zero rows),
      one all-gather of those, and every rank takes the singular values of the stacked factors,
      which are ``x``'s (the stack's Gram matrix is ``x``'s, up to rounding, with no squaring of
      the condition number). Cost: one all-gather of ``n x n`` per rank, ``n`` the unsharded
      side; where that is more than the whole matrix (``k * n`` rows for ``k`` blocks against
      ``m``), the matrix is gathered whole instead and NumPy's norm runs on it.
    """
    if x.ndim != 2:
        raise NotImplementedError(errors.prefix(op) + f"the matrix norm ord={ord!r} of a {x.ndim}-d array "
                                  f"(placements {x.placements!r}) has no DTensor rule; compute it on full_tensor() "
                                  "(redistribute to Replicate first)")
    pair = (0, 1) if axis is None else tuple(int(a) % 2 for a in axis)
    if pair[0] == pair[1]:
        raise ValueError(errors.prefix(op) + "duplicate axes given")
    if np.dtype(x.dtype).kind not in "fc":
        x = x.astype(np.float64)
    mesh = x.device_mesh
    shape = (1, 1) if keepdims else ()
    replicate = (Replicate(),) * mesh.ndim
    if ord in (1, -1, np.inf, -np.inf):
        rows, cols = pair
        summed, kept = (rows, cols) if ord in (1, -1) else (cols, rows)
        t = np.sum(np.abs(x), axis=summed, keepdims=True)
        t = (np.max if ord > 0 else np.min)(t, axis=kept, keepdims=True)
        local = t.redistribute(placements=replicate).to_local()
        return wrap(local.reshape(shape), mesh, replicate, shape)
    if ord not in (2, -2, "nuc"):
        raise ValueError(errors.prefix(op) + f"invalid norm order {ord!r} for matrices")
    sharded = [p.dim for p in x.placements if isinstance(p, Shard)]
    along = sharded[0] if sharded else 0  # the axis whose blocks are merged by TSQR
    need = [p if isinstance(p, Shard) and p.dim == along else Replicate() for p in x.placements]
    m, n = x.shape[along], x.shape[1 - along]
    blocks = math.prod(mesh.shape[i] for i, p in enumerate(need) if isinstance(p, Shard))
    if blocks > 1 and blocks * n > m:  # the factors would outweigh the matrix: gather it whole
        need = list(replicate)
    local = moved(op, "x", x, need).to_local()
    xp = array_namespace(local)
    plan = reduction_plan(mesh, x.shape, tuple(need), (along,), True)
    if plan.merged:
        block = local if along == 0 else local.T
        if block.shape[0] >= n:
            factor = xp.linalg.qr(block, mode="r")
        else:
            factor = xp.zeros((n, n), dtype=block.dtype)
            factor[:block.shape[0]] = block
        stack = plan.gather(xp.ascontiguousarray(factor)).reshape((-1, n))
        values = xp.linalg.svd(stack, compute_uv=False)[:min(m, n)]  # descending
    else:
        values = xp.linalg.svd(local, compute_uv=False)
    result = values[0] if ord == 2 else values[-1] if ord == -2 else values.sum()
    return wrap(xp.asarray(result).reshape(shape), mesh, replicate, shape)


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
