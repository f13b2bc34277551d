"""All-to-all (Ulysses) context parallelism: trade the sequence sharding for a head sharding and back.

DeepSpeed-Ulysses (Jacobs et al., 2023): an ``all_to_all_single`` sends head group j of this rank's
tokens to rank j, so each rank then holds ``heads / cp`` heads over the whole sequence, computes plain
attention on them (causal by global position, so any sharding, balanced or not, masks right), and a
second all-to-all brings its output back to sequence shards. The backward moves ``dout`` the same way,
differentiates the local attention (FlashAttention-2's formulas with the saved log-sum-exp) and sends
dq, dk, dv back. Heads must divide by cp (checked on every rank, :mod:`.arguments`). Each rank computes
``heads / cp`` heads x sequence x sequence scores, balanced or not.

Uneven sequence shards travel as one flat buffer each way, with per-rank split sizes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ...comm import DistValueError, ProcessGroup
from ...mesh import DeviceMesh
from ..arrays import array_namespace
from ..checks import where
from .arguments import SavedAttention, agree
from .attention import block_backward, block_forward, score_entries
from .sequence import SequenceSharding, cp_group

__all__ = ["UlyssesContext", "ulysses_attention", "ulysses_attention_backward"]


@dataclasses.dataclass
class UlyssesContext(SavedAttention):
    """What :func:`ulysses_attention_backward` needs: q, k, v, output and log-sum-exp are head-sharded
    (``heads / cp`` heads over the whole sequence, its shards in rank order at ``positions``).

    ``score_entries``: (query, key) scores this rank computed (its heads x batch x sequence x sequence).
    """

    positions: Any
    local_shape: tuple[int, ...]
    score_entries: int = 0


def _to_heads(g: ProcessGroup, sharding: SequenceSharding, x: Any) -> Any:
    """``(*batch, H, S_local, d)`` sequence shards -> ``(*batch, H / cp, S, d)`` in rank order of the shards."""
    xp = array_namespace(x)
    cp = g.size
    moved = xp.ascontiguousarray(xp.moveaxis(x, -3, 0))  # (H, *batch, S_local, d): head group j is contiguous
    per = moved.shape[0] // cp
    inner = moved.shape[1:-2]
    lengths = [sharding.local_length(r) for r in range(cp)]
    row = per * math.prod(inner) * moved.shape[-1]
    out = xp.empty(sum(lengths) * row, dtype=x.dtype)
    g.all_to_all_single(out, moved.reshape(-1), [n * row for n in lengths], [moved.size // cp] * cp)
    pieces, offset = [], 0
    for n in lengths:
        pieces.append(out[offset:offset + n * row].reshape((per,) + inner + (n, moved.shape[-1])))
        offset += n * row
    return xp.moveaxis(xp.concatenate(pieces, axis=-2), 0, -3)


def _to_sequence(g: ProcessGroup, sharding: SequenceSharding, y: Any, heads: int) -> Any:
    """The inverse of :func:`_to_heads`: ``(*batch, H / cp, S, d)`` -> this rank's ``(*batch, H, S_local, d)``."""
    xp = array_namespace(y)
    cp = g.size
    moved = xp.moveaxis(y, -3, 0)  # (H / cp, *batch, S, d)
    lengths = [sharding.local_length(r) for r in range(cp)]
    starts = [sum(lengths[:r]) for r in range(cp)]
    send = xp.concatenate([xp.ascontiguousarray(moved[..., s:s + n, :]).reshape(-1) for s, n in zip(starts, lengths)])
    mine = lengths[g.rank]
    part = moved.shape[0] * math.prod(moved.shape[1:-2]) * mine * moved.shape[-1]
    out = xp.empty(cp * part, dtype=y.dtype)
    row = send.size // sum(lengths)
    g.all_to_all_single(out, send, [part] * cp, [n * row for n in lengths])
    full = out.reshape((heads,) + moved.shape[1:-2] + (mine, moved.shape[-1]))
    return xp.moveaxis(full, 0, -3)


def ulysses_attention(q: Any, k: Any, v: Any, group: ProcessGroup | DeviceMesh | None = None, *,
                      causal: bool = False, balanced: bool = False,
                      scale: float | None = None) -> tuple[Any, UlyssesContext]:
    """Softmax attention over the whole sequence by head sharding (collective: two all-to-alls per call).

    Same arguments, layout and result as :func:`ring_attention`; q's heads (axis -3) must divide by cp.

    Raises:
        DistValueError: on every rank, for heads or a sequence that cannot be split, or shapes that disagree.

    Example (cp = 2, 4 heads, 6 tokens): each rank sends 2 heads of its 3 tokens to the other and
    attends with heads ``[2r, 2r + 1]`` over all 6 tokens; its output returns as 4 heads of its 3 tokens.
    """
    g = cp_group("ulysses_attention", group)
    sharding = agree("ulysses_attention", g, q, k, v, causal=causal, balanced=balanced, scale=scale,
                     heads_split=True)
    xp = array_namespace(q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    hq, hk, hv = (_to_heads(g, sharding, x) for x in (q, k, v))
    # the gathered sequence is the shards in rank order: with balancing, not sequence order
    positions = xp.asarray(np.concatenate([sharding.positions(r) for r in range(g.size)]))
    pos = positions if causal else None
    out, lse = block_forward(hq, hk, hv, scale, pos, pos)
    ctx = UlyssesContext(g, sharding, causal, scale, hq, hk, hv, out, lse, positions, tuple(q.shape),
                         score_entries(hq, hk))
    return _to_sequence(g, sharding, out, q.shape[-3]), ctx


def ulysses_attention_backward(ctx: UlyssesContext, dout: Any) -> tuple[Any, Any, Any]:
    """``(dq, dk, dv)`` of this rank's sequence shards, given ``dout`` (collective: four all-to-alls)."""
    g, sharding = ctx.group, ctx.sharding
    want = ctx.local_shape[:-1] + (ctx.v.shape[-1],)
    if tuple(dout.shape) != want:
        raise DistValueError(f"{where('ulysses_attention_backward', g)}: dout has shape {tuple(dout.shape)} but the "
                             f"forward's output has {want}")
    xp = array_namespace(dout)
    hdo = _to_heads(g, sharding, dout.astype(ctx.out.dtype, copy=False))
    delta = xp.sum(hdo * ctx.out, axis=-1)
    pos = ctx.positions if ctx.causal else None
    dq, dk, dv = block_backward(ctx.q, ctx.k, ctx.v, hdo, ctx.lse, delta, ctx.scale, pos, pos)
    heads = ctx.local_shape[-3]
    return tuple(_to_sequence(g, sharding, x, heads) for x in (dq, dk, dv))
