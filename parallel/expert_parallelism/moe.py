"""The mixture-of-experts layer over an ``ep`` group: forward, hand-written backward, reduced gradients.

``MoE(router, w1, w2, top_k=..., ep_group=mesh["ep"])`` holds the replicated router [d, E] and this
rank's experts (w1 [E/ep, d, h/tp], w2 [E/ep, h/tp, d]: ep rank r holds experts
``r*E/ep .. (r+1)*E/ep - 1``, :func:`shard_experts` cuts them from full arrays).
``forward(x)`` -> ``(y, ctx)``; ``backward(ctx, dy)`` -> ``(dx, grads)``. Each rank's ``x`` is its
own tokens, the ep group's ranks holding consecutive shards of one batch.

Gradients are those of the mean of the data ranks' losses (the dp x ep ranks, each one data
shard, as DDP averages; tp ranks share their data): ``dy`` is the gradient of this rank's own
loss, ``dx`` that of its own tokens, and ``grads`` (``"router"``, ``"w1"``, ``"w2"``) are already
reduced, ready for an optimizer (do not reduce them again in DDP): the experts' summed over the
dp ranks that hold the same experts and divided by dp x ep (torchtitan's gradient divide factor
for experts), the router's averaged over every dp x ep rank.

Bitwise promise: without tp, ``y`` is bit-identical for every ep degree (and dp degree) to the
same layer run in one process on the ep group's tokens, concatenated in rank order
(:mod:`.exchange` for the order, :mod:`.experts` for BLAS). With tp, and for every gradient, the
agreement is to rounding (1e-12 in float64: the sums over tp, dp and ep ranks change the order).

With ``top_k=1`` and ``normalize=True`` every gate is 1 and the router learns nothing: use
``normalize=False`` there (the Switch Transformer's gate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...comm import DistTypeError, DistValueError, ProcessGroup, ReduceOp
from ..arrays import array_namespace
from ..checks import where
from .exchange import DispatchPlan
from .experts import experts_backward, experts_forward
from .routing import Routing, check_top_k, route, route_backward

__all__ = ["MoE", "MoEContext", "shard_experts"]


def _group(value: Any, name: str, who: str) -> ProcessGroup | None:
    """A ProcessGroup from a group, a 1-D DeviceMesh (``mesh["ep"]``) or None."""
    if value is None or isinstance(value, ProcessGroup):
        return value
    if hasattr(value, "get_group") and getattr(value, "ndim", 1) == 1:
        return value.get_group()
    raise DistTypeError(f"{who}: {name} must be a ProcessGroup, a 1-D DeviceMesh or None, got "
                        f"{type(value).__name__}")


def shard_experts(w1: Any, w2: Any, ep_rank: int, ep: int, tp_rank: int = 0, tp: int = 1) -> tuple[Any, Any]:
    """This rank's experts (contiguous copies) from full ``w1`` [E, d, h] and ``w2`` [E, h, d]:
    experts ``ep_rank*E/ep ..`` and, of each, hidden units ``tp_rank*h/tp ..`` (h divisible by tp)."""
    e, h = w1.shape[0], w1.shape[2]
    if e % ep or h % tp:
        raise DistValueError(f"{where('shard_experts')}: {e} experts over ep={ep} and hidden {h} over tp={tp} "
                             "must divide evenly")
    per, hs = e // ep, h // tp
    xp = array_namespace(w1)
    return (xp.ascontiguousarray(w1[ep_rank * per:(ep_rank + 1) * per, :, tp_rank * hs:(tp_rank + 1) * hs]),
            xp.ascontiguousarray(w2[ep_rank * per:(ep_rank + 1) * per, tp_rank * hs:(tp_rank + 1) * hs]))


@dataclass
class MoEContext:
    """What ``forward`` keeps for ``backward``; ``dropped`` [E] and ``keep`` [T, k] report the capacity cut."""

    x: Any
    routing: Routing
    plan: DispatchPlan
    saved: tuple[Any, ...]
    contrib: Any  # [T, k, d]: each slot's expert output (zero where dropped)

    @property
    def dropped(self) -> np.ndarray:
        return self.plan.dropped

    @property
    def keep(self) -> Any:
        return self.plan.keep

    @property
    def indices(self) -> Any:
        return self.routing.indices

    @property
    def gates(self) -> Any:
        return self.routing.gates


class MoE:
    """A mixture-of-experts layer, experts split over ``ep_group`` (see the module docstring).

    Args:
        router: [d, E], the same on every rank.
        w1, w2: this rank's experts, [E/ep, d, h/tp] and [E/ep, h/tp, d].
        top_k: experts per token, in [1, E].
        ep_group: the ranks the experts are split over (a ProcessGroup or ``mesh["ep"]``); None: one process.
        dp_group: ranks holding the same experts on other data (gradients reduced over it), or None.
        tp_group: ranks splitting each expert's hidden dimension, or None.
        capacity_factor: None (dropless) or > 0 (:mod:`.exchange` defines the cut).
        normalize: gates renormalized over the top k (Mixtral; True) or raw softmax probabilities.
    """

    def __init__(self, router: Any, w1: Any, w2: Any, *, top_k: int, ep_group: Any = None, dp_group: Any = None,
                 tp_group: Any = None, capacity_factor: float | None = None, normalize: bool = True) -> None:
        who = where("MoE")
        self.ep_group = _group(ep_group, "ep_group", who)
        self.dp_group = _group(dp_group, "dp_group", who)
        self.tp_group = _group(tp_group, "tp_group", who)
        who = where("MoE", self.ep_group)
        self.ep = self.ep_group.size if self.ep_group is not None else 1
        self.dp = self.dp_group.size if self.dp_group is not None else 1
        if getattr(router, "ndim", None) != 2:
            raise DistValueError(f"{who}: router must be a 2-D array [d, num_experts], got "
                                 f"{getattr(router, 'shape', type(router).__name__)}")
        self.num_experts = int(router.shape[1])
        if self.num_experts % self.ep:
            raise DistValueError(f"{who}: num_experts={self.num_experts} (router.shape[1]) must be divisible by "
                                 f"the ep group's size {self.ep}")
        self.top_k = check_top_k(top_k, self.num_experts, who)
        per, d = self.num_experts // self.ep, router.shape[0]
        if w1.ndim != 3 or w2.ndim != 3 or w1.shape[:2] != (per, d) or w2.shape != (per, w1.shape[2], d):
            raise DistValueError(f"{who}: w1 {w1.shape} and w2 {w2.shape} must be [{per}, {d}, h] and [{per}, h, {d}] "
                                 f"(num_experts/ep = {self.num_experts}/{self.ep} experts on this rank)")
        if capacity_factor is not None and not (isinstance(capacity_factor, (int, float))
                                                and not isinstance(capacity_factor, bool) and capacity_factor > 0):
            raise DistValueError(f"{who}: capacity_factor={capacity_factor!r} must be None (dropless) or a number > 0")
        self.router, self.w1, self.w2 = router, w1, w2
        self.capacity_factor, self.normalize = capacity_factor, bool(normalize)

    def forward(self, x: Any, indices: Any = None) -> tuple[Any, MoEContext]:
        """``y`` [T, d] for this rank's tokens ``x`` [T, d]; ``indices`` [T, k]: the caller's own experts
        per token instead of the router's top k (the gates are still the router's probabilities).
        Collective over the ep group (and tp)."""
        who = where("MoE.forward", self.ep_group)
        xp = array_namespace(x)
        # A rank's own bad input travels in the plan's exchange: every rank raises, none waits.
        problem = None  # an index of exchange.PROBLEMS
        if getattr(x, "ndim", None) != 2 or x.shape[1] != self.router.shape[0]:
            problem = 1
        elif indices is not None and (getattr(getattr(indices, "dtype", None), "kind", "") not in "iu"
                                      or indices.shape != (x.shape[0], self.top_k)):
            problem = 2
        r = None
        if problem is not None:
            plan_indices = xp.zeros((0, self.top_k), xp.int64)
        elif indices is None:
            x = xp.ascontiguousarray(x)  # bitwise is tested on C-order rows; a strided view may take another BLAS path
            r = route(x, self.router, self.top_k, normalize=self.normalize)
            plan_indices = r.indices
        else:
            x = xp.ascontiguousarray(x)
            plan_indices = indices = indices.astype(xp.int64)
        plan = DispatchPlan(plan_indices, self.num_experts, self.ep_group, width=self.router.shape[0],
                            capacity_factor=self.capacity_factor, who=who, problem=problem)
        if r is None:  # the caller's indices passed the plan's range check on every rank
            r = route(x, self.router, self.top_k, normalize=self.normalize, indices=indices)
        t, k = r.indices.shape
        tokens = plan.send_order // k
        rows = plan.dispatch(x[tokens])
        out, saved = experts_forward(rows, plan.segments, self.w1, self.w2, self.tp_group)
        back = plan.combine(out)
        contrib = xp.zeros((t * k, x.shape[1]), dtype=out.dtype)
        contrib[plan.send_order] = back
        contrib = contrib.reshape(t, k, x.shape[1])
        y = r.gates[:, 0, None] * contrib[:, 0]
        for j in range(1, k):  # k order, the same additions in every layout
            y = y + r.gates[:, j, None] * contrib[:, j]
        return y, MoEContext(x, r, plan, saved, contrib)

    __call__ = forward

    def backward(self, ctx: MoEContext, dy: Any) -> tuple[Any, dict[str, Any]]:
        """``(dx, grads)`` from ``dy`` [T, d], the gradient of this rank's loss w.r.t. its ``y``.
        Collective over ep, tp and dp; ``grads`` are reduced (module docstring)."""
        who = where("MoE.backward", self.ep_group)
        xp = array_namespace(dy)
        if dy.shape != ctx.x.shape:
            raise DistValueError(f"{who}: dy must have y's shape {ctx.x.shape}, got {dy.shape}")
        r, plan = ctx.routing, ctx.plan
        t, k = r.indices.shape
        dgates = (dy[:, None, :] * ctx.contrib).sum(axis=2)
        dslots = (r.gates[:, :, None] * dy[:, None, :]).reshape(t * k, dy.shape[1])
        dout = plan.dispatch(dslots[plan.send_order])
        drows, dw1, dw2 = experts_backward(ctx.saved, dout, self.w1, self.w2, self.tp_group)
        dx_slots = xp.zeros((t * k, dy.shape[1]), dtype=drows.dtype)
        dx_slots[plan.send_order] = plan.combine(drows)
        dx, drouter = route_backward(r, ctx.x, self.router, dgates)
        dx = dx + dx_slots.reshape(t, k, dy.shape[1]).sum(axis=1)
        data_ranks = self.dp * self.ep
        for g in (dw1, dw2):
            if self.dp > 1:
                self.dp_group.all_reduce(g)
            g /= data_ranks
        for group in (self.ep_group, self.dp_group):
            if group is not None and group.size > 1:
                group.all_reduce(drouter, ReduceOp.SUM)
        drouter /= data_ranks
        return dx, {"router": drouter, "w1": dw1, "w2": dw2}
