"""Ring attention: K/V blocks travel around the context-parallel ring while the current block computes.

Forward (Liu et al., *Ring Attention with Blockwise Transformers*, 2023): at step t rank r holds the K/V
block of rank ``r - t``; it posts ``isend`` of that block to ``r + 1`` and ``irecv`` of the next from
``r - 1`` (one ``batch_isend_irecv``), computes its queries against the block it holds, merges the partial result by log-sum-exp
(:func:`.attention.merge`) and only then waits: the transfer hides behind the compute. ``cp - 1`` steps
move K and V, so each rank sends ``(cp - 1) / cp`` of the global K and V per pass (even lengths).

Backward (FlashAttention-2's, ring-flash-attention's order): K/V travel the same ring again, and with
each block travels its dK/dV accumulator: a rank adds its queries' share to the block's accumulator and
sends it on before it computes its dQ share (so dQ's matmul hides the hop, the last one included); after
``cp`` hops every accumulator is back with its block's owner. dQ stays home.

Causal attention skips the blocks no query sees and masks only the diagonal ones, working chunk by chunk
(:mod:`.sequence`'s chunks): with ``balanced=True`` (head-tail) every rank computes the same number of
scores, recorded on the context (``score_entries``) so it can be checked.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Iterator

from ...comm import DistValueError, P2POp, ProcessGroup, Work, batch_isend_irecv, irecv, isend
from ...mesh import DeviceMesh
from ..arrays import array_namespace
from ..checks import where
from .arguments import SavedAttention, agree
from .attention import block_backward_kv, block_forward, mask_kind, merge, score_entries
from .sequence import SequenceSharding, cp_group

__all__ = ["RingAttentionContext", "ring_attention", "ring_attention_backward", "block_pairs"]



@dataclasses.dataclass
class RingAttentionContext(SavedAttention):
    """What :func:`ring_attention_backward` needs of a forward, and the work each pass counted.

    ``score_entries``: (query, key) scores this rank computed in the forward (batch x heads x queries x keys
    of every block not skipped); ``backward_score_entries`` the same in the backward, once it ran.
    ``exposed_comm_s`` (``backward_exposed_comm_s``): seconds the pass waited for transfers after
    computing on a block, the communication its compute did not hide.
    """

    score_entries: int = 0
    backward_score_entries: int = 0
    exposed_comm_s: float = 0.0
    backward_exposed_comm_s: float = 0.0


def block_pairs(sharding: SequenceSharding, causal: bool, rank: int, src: int) -> list[tuple[slice, slice, str]]:
    """``(query rows, key rows, mask)`` to compute between rank's queries and rank ``src``'s keys."""
    if not causal:
        return [(slice(None), slice(None), "none")]
    out = []
    qo = 0
    for qa, qb in sharding.pieces(rank):
        ko = 0
        for ka, kb in sharding.pieces(src):
            kind = mask_kind((qa, qb), (ka, kb))
            if kind != "skip":
                out.append((slice(qo, qo + qb - qa), slice(ko, ko + kb - ka), kind))
            ko += kb - ka
        qo += qb - qa
    return out


def _rows(x: Any, rows: slice) -> Any:
    return x[..., rows, :]


def _shift(group: ProcessGroup, send: list[Any], recv: list[Any]) -> list[Work]:
    """One ring step: receive ``recv`` from the previous rank, send ``send`` to the next, posted as one
    batch (NCCL groups it, so the ring cannot deadlock). Tag 0 throughout, as NCCL has no tags: every
    rank posts K, V (and dK, dV) in the same order, and messages between two ranks match in order."""
    prev, nxt = (group.rank - 1) % group.size, (group.rank + 1) % group.size
    return batch_isend_irecv([P2POp(irecv, buf, group=group, group_peer=prev) for buf in recv]
                             + [P2POp(isend, buf, group=group, group_peer=nxt) for buf in send])


def _like_block(x: Any, length: int) -> Any:
    xp = array_namespace(x)
    return xp.empty(x.shape[:-2] + (length, x.shape[-1]), dtype=x.dtype)


def _ring_steps(g: ProcessGroup, sharding: SequenceSharding, k: Any, v: Any,
                waited: list[float]) -> Iterator[tuple[int, Any, Any]]:
    """``(owner, k block, v block)`` of each ring step. The next blocks' shift is posted before a step is
    handed out and waited only when the caller comes back for the next: the caller's compute on this
    block is what the transfer hides behind. ``waited[0]`` grows by the seconds spent in those waits."""
    rank, cp = g.rank, g.size
    cur_k, cur_v = k, v
    for step in range(cp):
        src = (rank - step) % cp
        works: list[Work] = []
        if step < cp - 1:
            length = sharding.local_length((src - 1) % cp)
            nk, nv = _like_block(k, length), _like_block(v, length)
            works = _shift(g, [cur_k, cur_v], [nk, nv])
        yield src, cur_k, cur_v
        _wait(works, waited)
        if works:
            cur_k, cur_v = nk, nv


def _wait(works: list[Work], waited: list[float]) -> None:
    start = time.perf_counter()
    for w in works:
        w.wait()
    waited[0] += time.perf_counter() - start


def _block_pairs(sharding: SequenceSharding, causal: bool, rank: int, src: int,
                 q_pos: Any) -> Iterator[tuple[slice, slice, Any, Any]]:
    """:func:`block_pairs` with the positions a partial (diagonal) pair masks by, else None."""
    k_pos = None
    for rows, cols, kind in block_pairs(sharding, causal, rank, src):
        if kind != "partial":
            yield rows, cols, None, None
            continue
        if k_pos is None:
            k_pos = array_namespace(q_pos).asarray(sharding.positions(src))
        yield rows, cols, q_pos[rows], k_pos[cols]


def ring_attention(q: Any, k: Any, v: Any, group: ProcessGroup | DeviceMesh | None = None, *, causal: bool = False,
                   balanced: bool = False, scale: float | None = None) -> tuple[Any, RingAttentionContext]:
    """Softmax attention over the whole sequence, each rank holding its shard of q, k and v (collective).

    Args:
        q, k, v: this rank's tokens, ``(*batch, heads, local_sequence, head_dim)`` (``v`` may have
            another head_dim), sharded as :func:`shard_sequence` shards them with the same ``balanced``.
        group: the context-parallel group: a ProcessGroup, a 1-D mesh (``mesh["cp"]``) or None (world).
        causal: query at global position i sees keys at positions <= i.
        balanced: the inputs are head-tail sharded (each rank one early and one late chunk).
        scale: scores are ``q @ k.T * scale``; default ``1 / sqrt(head_dim)``.

    Returns:
        ``(out, ctx)``: this rank's rows of the attention output, shaped like ``q`` (with v's
        head_dim), equal to full attention's rows at this rank's positions; ``ctx`` for
        :func:`ring_attention_backward`.

    Raises:
        DistValueError: on every rank, for a sequence that cannot be split as asked or shapes that disagree.

    Example (cp = 2, a 6-token sequence, not balanced)::

        q_local = shard_sequence(q, mesh["cp"])          # rank 0: tokens 0-2, rank 1: tokens 3-5
        out, ctx = ring_attention(q_local, k_local, v_local, mesh["cp"], causal=True)
        dq, dk, dv = ring_attention_backward(ctx, dout_local)
    """
    g = cp_group("ring_attention", group)
    sharding = agree("ring_attention", g, q, k, v, causal=causal, balanced=balanced, scale=scale)
    xp = array_namespace(q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q, k, v = (xp.ascontiguousarray(x) for x in (q, k, v))
    rank = g.rank
    q_pos = xp.asarray(sharding.positions(rank))
    out = xp.zeros(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype)
    lse = xp.full(q.shape[:-1], -xp.inf, dtype=q.dtype)
    ctx = RingAttentionContext(g, sharding, causal, scale, q, k, v, out, lse)
    waited = [0.0]
    for src, cur_k, cur_v in _ring_steps(g, sharding, k, v, waited):
        for rows, cols, qp, kp in _block_pairs(sharding, causal, rank, src, q_pos):
            qb, kb, vb = _rows(q, rows), _rows(cur_k, cols), _rows(cur_v, cols)
            bo, bl = block_forward(qb, kb, vb, scale, qp, kp)
            o, l = merge(_rows(out, rows), lse[..., rows], bo, bl)
            out[..., rows, :], lse[..., rows] = o, l
            ctx.score_entries += score_entries(qb, kb)
    ctx.exposed_comm_s = waited[0]
    return out, ctx


def ring_attention_backward(ctx: RingAttentionContext, dout: Any) -> tuple[Any, Any, Any]:
    """``(dq, dk, dv)`` of this rank's shards, given ``dout`` (this rank's rows of the output's gradient).

    Collective over ``ctx.group``: a second ring pass, dK/dV travelling with their K/V blocks.
    """
    g, sharding, scale = ctx.group, ctx.sharding, ctx.scale
    q, k, v, out, lse = ctx.q, ctx.k, ctx.v, ctx.out, ctx.lse
    xp = array_namespace(q)
    if tuple(dout.shape) != tuple(out.shape):
        raise DistValueError(f"{where('ring_attention_backward', g)}: dout has shape {tuple(dout.shape)} but the "
                             f"forward's output has {tuple(out.shape)}")
    dout = xp.ascontiguousarray(dout, dtype=out.dtype)
    rank, cp = g.rank, g.size
    delta = xp.sum(dout * out, axis=-1)
    q_pos = xp.asarray(sharding.positions(rank))
    dq = xp.zeros_like(q)
    acc_works: list[Work] = []
    acc_in: tuple[Any, Any] | None = None
    ctx.backward_score_entries, ctx.backward_exposed_comm_s = 0, 0.0
    waited = [0.0]
    for src, cur_k, cur_v in _ring_steps(g, sharding, k, v, waited):
        dk_acc, dv_acc = xp.zeros_like(cur_k), xp.zeros_like(cur_v)
        dq_later = []
        for rows, cols, qp, kp in _block_pairs(sharding, ctx.causal, rank, src, q_pos):
            qb, kb, vb = _rows(q, rows), _rows(cur_k, cols), _rows(cur_v, cols)
            ds, bk, bv = block_backward_kv(qb, kb, vb, _rows(dout, rows), lse[..., rows], delta[..., rows], scale,
                                           qp, kp)
            dk_acc[..., cols, :] += bk
            dv_acc[..., cols, :] += bv
            dq_later.append((rows, ds, kb))
            ctx.backward_score_entries += score_entries(qb, kb)
        if cp > 1:
            _wait(acc_works, waited)  # the accumulators of this block, received while it computed
            if acc_in is not None:
                dk_acc += acc_in[0]
                dv_acc += acc_in[1]
            # this block's accumulators go on to the next rank, which holds the block at step + 1 (or owns it);
            # dq's matmuls below run while they travel
            incoming = sharding.local_length((src - 1) % cp)
            acc_in = (_like_block(k, incoming), _like_block(v, incoming))
            acc_works = _shift(g, [dk_acc, dv_acc], list(acc_in))
        for rows, ds, kb in dq_later:
            dq[..., rows, :] += (ds @ kb) * scale
    if cp == 1:
        return dq, dk_acc, dv_acc
    _wait(acc_works, waited)  # the last hop home: no block is left to hide it behind
    ctx.backward_exposed_comm_s = waited[0]
    return dq, acc_in[0], acc_in[1]
