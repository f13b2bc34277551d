"""The local math of context parallelism: softmax attention on one block of keys, its merge, its backward.

Arrays are laid out as torch's ``scaled_dot_product_attention``: ``(*batch, heads, sequence, head_dim)``.
A block's forward returns its output and its log-sum-exp (``lse``, one per query); two blocks' results
merge exactly (:func:`merge`): ``lse = logaddexp(lse_a, lse_b)`` and each output weighted by
``exp(lse_x - lse)`` (the online softmax of FlashAttention; Liu et al., *Ring Attention*, 2023). The
backward of a block is FlashAttention-2's (Dao, 2023, Algorithm 2): the probabilities are recomputed from
the final ``lse``, and ``delta = rowsum(dout * out)`` stands for the softmax's Jacobian.

Causal masks use global token positions (``q_pos``, ``k_pos``: query i may see key j iff
``k_pos[j] <= q_pos[i]``), so shards in any order (head-tail balancing) mask right. A query that sees no
key of a block gets ``lse = -inf`` and output 0 from it, which the merge weighs as nothing.

The array library is taken from the arrays (:func:`array_namespace`): NumPy or CuPy.
"""

from __future__ import annotations

from typing import Any

from ..arrays import array_namespace

__all__ = ["mask_kind", "block_forward", "merge", "block_backward", "block_backward_kv", "score_entries"]


def mask_kind(q_range: tuple[int, int], k_range: tuple[int, int]) -> str:
    """For causal attention between query positions ``[q0, q1)`` and key positions ``[k0, k1)``:
    ``"none"`` (every key visible to every query), ``"skip"`` (no key visible) or ``"partial"``."""
    (q0, q1), (k0, k1) = q_range, k_range
    if k0 >= q1:  # the first key comes after the last query
        return "skip"
    if k1 - 1 <= q0:  # the last key is at or before the first query
        return "none"
    return "partial"


def score_entries(q: Any, k: Any) -> int:
    """The (query, key) scores one block computes: batch x heads x queries x keys."""
    n = 1
    for s in q.shape[:-1]:
        n *= s
    return n * k.shape[-2]


def _scores(q: Any, k: Any, scale: float, visible: Any | None) -> Any:
    xp = array_namespace(q)
    s = (q @ xp.swapaxes(k, -1, -2)) * scale
    if visible is not None:
        s = xp.where(visible, s, -xp.inf)
    return s


def _visible(q_pos: Any | None, k_pos: Any | None) -> Any | None:
    return None if q_pos is None else q_pos[:, None] >= k_pos[None, :]


def block_forward(q: Any, k: Any, v: Any, scale: float, q_pos: Any | None = None,
                  k_pos: Any | None = None) -> tuple[Any, Any]:
    """``(out, lse)`` of softmax attention of ``q`` over this block of keys only.

    ``q_pos``/``k_pos`` (global positions, 1-D) give a causal mask; None: no mask.
    """
    xp = array_namespace(q)
    s = _scores(q, k, scale, _visible(q_pos, k_pos))
    m = xp.max(s, axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0.0)  # a query that sees nothing: exp(-inf - 0) = 0, not nan
    p = xp.exp(s - m)
    total = xp.sum(p, axis=-1, keepdims=True)
    seen = total > 0
    out = (p @ v) / xp.where(seen, total, 1.0)
    with _quiet(xp):  # log(0) = -inf for a query that sees nothing, on purpose
        lse = (m + xp.log(total))[..., 0]
    return out, lse


def merge(out: Any, lse: Any, block_out: Any, block_lse: Any) -> tuple[Any, Any]:
    """The exact combination of two partial attentions over disjoint key sets (new arrays)."""
    xp = array_namespace(out)
    new = xp.logaddexp(lse, block_lse)
    finite = xp.isfinite(new)
    safe = xp.where(finite, new, 0.0)
    a = xp.where(finite, xp.exp(lse - safe), 0.0)[..., None]
    b = xp.where(finite, xp.exp(block_lse - safe), 0.0)[..., None]
    return out * a + block_out * b, new


def block_backward(q: Any, k: Any, v: Any, dout: Any, lse: Any, delta: Any, scale: float,
                   q_pos: Any | None = None, k_pos: Any | None = None) -> tuple[Any, Any, Any]:
    """``(dq, dk, dv)``: this block's share of the gradients of attention over all blocks.

    ``lse`` is the final log-sum-exp of each query (over every block) and ``delta`` is
    ``sum(dout * out, axis=-1)`` with the final output: with them a block's probabilities and the
    softmax's backward need nothing of the other blocks (FlashAttention-2).
    """
    ds, dk, dv = block_backward_kv(q, k, v, dout, lse, delta, scale, q_pos, k_pos)
    return (ds @ k) * scale, dk, dv


def block_backward_kv(q: Any, k: Any, v: Any, dout: Any, lse: Any, delta: Any, scale: float,
                      q_pos: Any | None = None, k_pos: Any | None = None) -> tuple[Any, Any, Any]:
    """:func:`block_backward` without dq: ``(ds, dk, dv)``, dq being ``(ds @ k) * scale``. The ring sends a
    block's dK/dV on before it computes dq, so that dq's matmul hides the transfer."""
    xp = array_namespace(q)
    s = _scores(q, k, scale, _visible(q_pos, k_pos))
    safe = xp.where(xp.isfinite(lse), lse, 0.0)[..., None]
    p = xp.exp(s - safe)  # masked scores are -inf: p = 0 there
    dv = xp.swapaxes(p, -1, -2) @ dout
    dp = dout @ xp.swapaxes(v, -1, -2)
    ds = p * (dp - delta[..., None])
    dk = (xp.swapaxes(ds, -1, -2) @ q) * scale
    return ds, dk, dv


class _quiet:
    """NumPy's errstate for divide-by-zero (CuPy does not warn, and has no errstate to need)."""

    def __init__(self, xp: Any) -> None:
        self._state = xp.errstate(divide="ignore") if hasattr(xp, "errstate") else None

    def __enter__(self) -> None:
        if self._state is not None:
            self._state.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._state is not None:
            self._state.__exit__(*exc)
