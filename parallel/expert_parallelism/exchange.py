"""Token dispatch and combine over the ep group: who sends which rows where, and the two exchanges.

A :class:`DispatchPlan` is built collectively from each rank's expert choices ``indices`` [T, k]:
one ``all_gather_into_tensor`` of every rank's per-expert counts (with its token count and what
it found wrong in its input, if anything) tells every rank the whole traffic, so the capacity
cut, both split-size lists and the received rows' segments are computed locally, identically, with
no second count exchange (a per-destination ``all_to_all`` of counts would give the receiver
neither the per-expert split it needs nor the earlier ranks' counts the capacity cut needs).

Order, which makes the layer bitwise reproducible for any ep degree: the ranks of the ep group
hold consecutive token shards (rank 0 the first), so "global token order" is (rank, local token).
A rank sends its kept (token, slot) assignments sorted by expert, then token, then slot; a
destination receives them source by source (``all_to_all_single``, uneven split sizes), in
segments of one (source, expert) each, and runs each expert on its segments where they lie:
every row's result depends on that row alone (``experts.blocked_matmul``), so that is what a
single process computes for it, with no reorder copy (on one host as costly as the exchange
itself). :meth:`combine` returns the outputs the same way back.

Capacity (``capacity_factor`` not None): expert e keeps its first
``ceil(capacity_factor * T * k / E)`` assignments in global token order (T: the ep group's tokens,
exact rational arithmetic on the float's value), the rest are dropped: they contribute zero to
their token's output (the layer has no residual; add yours outside). ``dropped`` counts them per
expert, ``keep`` [T, k] says which of this rank's were kept. ``capacity_factor=None``: dropless.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np

from ...comm import DistValueError, ProcessGroup
from ..arrays import array_namespace, to_host
from ..checks import on_ranks

__all__ = ["DispatchPlan", "expert_capacity"]


#: What a rank can find wrong in its own input before the exchange; the exchange sends the index.
PROBLEMS = ("indices out of range [0, num_experts={num_experts})", "x is not a [tokens, {width}] array",
            "indices are not an integer array of shape [tokens, top_k]")


def expert_capacity(capacity_factor: float, tokens: int, top_k: int, num_experts: int) -> int:
    """``ceil(capacity_factor * tokens * top_k / num_experts)``, in exact arithmetic."""
    return math.ceil(Fraction(capacity_factor) * tokens * top_k / num_experts)


class DispatchPlan:
    """The exchange of one forward (and its backward): built collectively over ``group``.

    Attributes: ``capacity`` (None when dropless), ``dropped`` (np.ndarray [E], every rank the same),
    ``keep`` ([T, k] bool, this rank's), ``expert_counts`` (rows per local expert), ``segments``
    (``(start, rows, local expert)`` runs of the received rows, source-major), ``tokens`` (the
    group's token count).
    """

    def __init__(self, indices: Any, num_experts: int, group: ProcessGroup | None, *, width: int,
                 capacity_factor: float | None, who: str, problem: int | None = None) -> None:
        """``problem``: what this rank found wrong in its own input, an index of :data:`PROBLEMS`
        (``indices`` is then ignored): the exchange carries it, and every rank raises, naming this one."""
        xp = array_namespace(indices)
        self.xp, self.group = xp, group
        ep = group.size if group is not None else 1
        rank = group.rank if group is not None else 0
        t, k = indices.shape
        flat = indices.reshape(-1)
        if problem is None and flat.size and bool(to_host((flat < 0).any() | (flat >= num_experts).any())):
            problem = 0
        mine = np.zeros(num_experts + 2, np.int64)
        mine[num_experts:] = (t, -1 if problem is None else problem)
        if problem is None:
            mine[:num_experts] = to_host(xp.bincount(flat, minlength=num_experts))
        if group is not None and ep > 1:
            out = xp.empty(ep * mine.size, np.int64)
            group.all_gather_into_tensor(out, xp.asarray(mine))
            table = to_host(out).reshape(ep, -1)
        else:
            table = mine[None]
        # Every rank raises the same error from the same table: none is left waiting in an exchange.
        problems = [(r, None if row[-1] < 0 else PROBLEMS[row[-1]].format(num_experts=num_experts, width=width))
                    for r, row in enumerate(table)]
        if any(p for _, p in problems):
            raise DistValueError(f"{who}: {on_ranks(problems)} (ep group rank numbering)")
        counts = table[:, :num_experts]  # [ep, E]: assignments of each rank to each expert
        self.tokens = int(table[:, num_experts].sum())
        total = counts.sum(axis=0)
        if capacity_factor is None:
            self.capacity = None
            kept = counts
        else:
            self.capacity = expert_capacity(capacity_factor, self.tokens, k, num_experts)
            before = np.cumsum(counts, axis=0) - counts  # earlier ranks' assignments: they come first
            kept = np.clip(self.capacity - before, 0, counts)
        self.dropped = total - kept.sum(axis=0)
        per = num_experts // ep
        by_dest = kept.reshape(ep, ep, per)  # [source, destination rank, local expert]
        self.input_splits = [int(n) for n in by_dest[rank].sum(axis=1)]
        self.output_splits = [int(n) for n in by_dest[:, rank].sum(axis=1)]
        self.expert_counts = [int(n) for n in by_dest[:, rank].sum(axis=0)]
        # Received: source-major, then expert. The experts run on those rows where they lie, one
        # segment (source, expert) at a time: no reorder, a copy as costly as the exchange itself on
        # one host, in either direction. Each row's result depends on that row alone
        # (experts.blocked_matmul), so the segments give what one expert-major matrix would.
        mine_rows = by_dest[:, rank]  # [source, local expert]
        starts = np.cumsum(mine_rows.reshape(-1)) - mine_rows.reshape(-1)
        self.segments = [(int(start), int(n), j) for start, n, (_, j) in
                         zip(starts, mine_rows.reshape(-1), np.ndindex(ep, per)) if n]
        # This rank's assignments (token-major flat index t * k + slot), sorted by expert then token.
        n = t * k
        order = xp.argsort(flat * max(n, 1) + xp.arange(n), kind="stable") if n else xp.zeros(0, xp.int64)
        experts = flat[order]
        first = np.cumsum(counts[rank]) - counts[rank]
        position = xp.arange(n) - xp.asarray(first)[experts]  # among this rank's for that expert
        keep_sorted = position < xp.asarray(kept[rank])[experts]
        self.send_order = order[keep_sorted]  # flat assignment of each row sent, in sending order
        self.keep = xp.zeros(n, dtype=bool)
        self.keep[self.send_order] = True
        self.keep = self.keep.reshape(t, k)
        self.num_sent = int(self.send_order.shape[0])

    def _exchange(self, out: Any, rows: Any, out_splits: list[int], in_splits: list[int]) -> None:
        if self.group is not None and self.group.size > 1:
            self.group.all_to_all_single(out, rows, out_splits, in_splits)
        else:
            out[...] = rows

    def dispatch(self, rows: Any) -> Any:
        """Rows in sending order (one per kept assignment) -> this rank's experts' rows, source-major
        (:attr:`segments` says which expert runs which)."""
        recv = self.xp.empty((sum(self.output_splits),) + rows.shape[1:], dtype=rows.dtype)
        self._exchange(recv, self.xp.ascontiguousarray(rows), self.output_splits, self.input_splits)
        return recv

    def combine(self, expert_rows: Any) -> Any:
        """The experts' output rows (as received: source-major, :attr:`segments`) -> back to their
        sources, in sending order."""
        back = self.xp.ascontiguousarray(expert_rows)
        out = self.xp.empty((self.num_sent,) + expert_rows.shape[1:], dtype=expert_rows.dtype)
        self._exchange(out, back, self.input_splits, self.output_splits)
        return out
