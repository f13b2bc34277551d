"""The single-process reference for context parallelism: full softmax attention and its gradients in NumPy,
written independently of meshkit's blockwise code (one softmax over the whole score matrix)."""

from __future__ import annotations

import numpy as np

__all__ = ["inputs", "reference"]


def inputs(shape: tuple[int, ...], seed: int = 0, dv: int | None = None) -> tuple[np.ndarray, ...]:
    """``q, k, v, dout`` in float64, ``(*batch, heads, sequence, head_dim)``; v and dout may have head_dim ``dv``."""
    rng = np.random.default_rng(seed)
    vshape = shape[:-1] + (dv or shape[-1],)
    return (rng.standard_normal(shape), rng.standard_normal(shape), rng.standard_normal(vshape),
            rng.standard_normal(vshape))


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, dout: np.ndarray, causal: bool,
              scale: float | None = None) -> tuple[np.ndarray, ...]:
    """``out, dq, dk, dv`` of ``softmax(q k^T * scale + mask) v`` over the whole sequence."""
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = np.einsum("...qd,...kd->...qk", q, k) * scale
    if causal:
        n = q.shape[-2]
        s = np.where(np.tril(np.ones((n, n), dtype=bool)), s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out = p @ v
    dv = np.swapaxes(p, -1, -2) @ dout
    dp = dout @ np.swapaxes(v, -1, -2)
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))  # the softmax's Jacobian, row by row
    return out, ds @ k * scale, np.swapaxes(ds, -1, -2) @ q * scale, dv
