"""The experts: two-layer MLPs ``silu(x @ w1) @ w2`` run on the rows routed to them, forward and backward.

Bitwise reproducibility across ep degrees needs each matmul row to come out the same whatever
matrix it sits in, and BLAS does not promise that: its kernel (gemv for one row, small-matrix
kernels, blocking) is picked from the shape. :func:`blocked_matmul` therefore calls BLAS only
on blocks of exactly :data:`ROW_BLOCK` rows (the last one zero-padded), so every call has one
shape and a row's result depends on that row alone. The forward uses it (the router and both
expert matmuls); the backward is checked to 1e-12, not bitwise, and uses plain matmuls.

With a tensor-parallel group each expert's hidden dimension is split over it (w1 by columns, w2
by rows, Megatron's MLP): the outputs are partial sums, added by one all-reduce over tp after
w2 (forward) and after the input gradient (backward).
"""

from __future__ import annotations

from typing import Any, Sequence

from ...comm import ProcessGroup
from ..arrays import array_namespace

__all__ = ["ROW_BLOCK", "blocked_matmul", "experts_forward", "experts_backward"]

#: Rows per BLAS call in the forward: large enough that the loop costs little beside the matmul
#: (a 128 x d block), small enough that the zero padding of an expert's last block stays small.
ROW_BLOCK = 128


def blocked_matmul(a: Any, b: Any, block: int = ROW_BLOCK) -> Any:
    """``a @ b`` for 2-D ``a``, computed in BLAS calls of exactly ``block`` rows each."""
    xp = array_namespace(a)
    n = a.shape[0]
    out = xp.empty((n, b.shape[1]), dtype=xp.result_type(a, b))
    full = n - n % block
    for i in range(0, full, block):
        xp.matmul(a[i:i + block], b, out=out[i:i + block])
    if full < n:
        pad = xp.zeros((block, a.shape[1]), dtype=a.dtype)
        pad[:n - full] = a[full:]
        out[full:] = (pad @ b)[:n - full]
    return out


def _silu(z: Any, xp: Any) -> tuple[Any, Any]:
    s = 1.0 / (1.0 + xp.exp(-z))
    return z * s, s


def experts_forward(rows: Any, segments: Sequence[tuple[int, int, int]], w1: Any, w2: Any,
                    tp_group: ProcessGroup | None = None) -> tuple[Any, tuple[Any, ...]]:
    """Each segment ``(start, n, j)``'s output: expert j on rows ``start .. start + n`` of ``rows``,
    and what the backward needs. ``w1`` [E_local, d, h_local], ``w2`` [E_local, h_local, d]."""
    xp = array_namespace(rows)
    out = xp.empty((rows.shape[0], w2.shape[2]), dtype=xp.result_type(rows, w2))
    zs, hs = [], []
    for start, n, j in segments:
        z = blocked_matmul(rows[start:start + n], w1[j])
        h, _ = _silu(z, xp)
        out[start:start + n] = blocked_matmul(h, w2[j])
        zs.append(z)
        hs.append(h)
    if tp_group is not None and tp_group.size > 1:
        tp_group.all_reduce(out)  # each tp rank holds a slice of the hidden dimension: partial sums
    return out, (rows, segments, zs, hs)


def experts_backward(saved: tuple[Any, ...], dout: Any, w1: Any, w2: Any,
                     tp_group: ProcessGroup | None = None) -> tuple[Any, Any, Any]:
    """``(drows, dw1, dw2)`` from the outputs' gradient ``dout`` (laid out as the forward's rows);
    ``dw1``/``dw2`` are this rank's sums over the rows it ran, not yet reduced over data ranks."""
    rows, segments, zs, hs = saved
    xp = array_namespace(dout)
    drows = xp.empty_like(rows)
    dw1, dw2 = xp.zeros_like(w1), xp.zeros_like(w2)
    for (start, n, j), z, h in zip(segments, zs, hs):
        do = dout[start:start + n]
        _, s = _silu(z, xp)
        dz = (do @ w2[j].T) * (s * (1.0 + z * (1.0 - s)))
        dw2[j] += h.T @ do
        dw1[j] += rows[start:start + n].T @ dz
        drows[start:start + n] = dz @ w1[j].T
    if tp_group is not None and tp_group.size > 1:
        tp_group.all_reduce(drows)  # the input gradient is a partial sum over the hidden slices
    return drows, dw1, dw2
