"""Top-k routing of a mixture-of-experts layer: router scores, softmax, top-k experts, gates, backward.

Every step is row-wise, so a token's routing does not depend on which other tokens share its
rank: the router's matmul runs in fixed row blocks (:func:`.experts.blocked_matmul`), the softmax
and the gate sums reduce along a row only. Ties between equal probabilities go to the lowest
expert index (``argmax`` returns the first maximum; k passes, each masking the last winner).

Gates follow Mixtral (``normalize=True``): the top-k probabilities renormalized to sum to 1 per
token; ``normalize=False`` keeps the raw softmax probabilities (Switch/GShard style).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...comm import DistTypeError, DistValueError
from ..arrays import array_namespace
from .experts import blocked_matmul

__all__ = ["Routing", "route", "route_backward", "check_top_k"]


@dataclass
class Routing:
    """One forward's routing of a rank's tokens: ``probs`` [T, E], ``indices`` [T, k] (int64),
    ``raw`` [T, k] (the chosen probabilities) and ``gates`` [T, k] (what weighs each expert's output)."""

    probs: Any
    indices: Any
    raw: Any
    gates: Any
    normalize: bool


def check_top_k(top_k: Any, num_experts: int, who: str) -> int:
    """``top_k`` as an int in [1, num_experts], else an error naming it and the rank (``who``)."""
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise DistTypeError(f"{who}: top_k must be an int, got {type(top_k).__name__} {top_k!r}")
    if not 1 <= top_k <= num_experts:
        raise DistValueError(f"{who}: top_k={top_k} must be in [1, num_experts={num_experts}]")
    return top_k


def route(x: Any, router: Any, top_k: int, *, normalize: bool = True, indices: Any = None) -> Routing:
    """Route ``x`` [T, d] with ``router`` [d, E]: softmax of ``x @ router``, top-k, gates.

    ``indices`` [T, k] (the caller's own choice of experts) replaces the top-k; it must already be
    checked (:func:`.exchange.DispatchPlan` checks its range on every rank).
    """
    xp = array_namespace(x)
    scores = blocked_matmul(x, router)
    shifted = scores - scores.max(axis=1, keepdims=True)
    e = xp.exp(shifted)
    probs = e / e.sum(axis=1, keepdims=True)
    if indices is None:
        masked = probs.copy()
        rows = xp.arange(x.shape[0])
        picks = []
        for _ in range(top_k):  # argmax: the first maximum, so ties go to the lowest expert index
            j = masked.argmax(axis=1)
            picks.append(j)
            masked[rows, j] = -1.0  # probabilities are >= 0: a picked expert is never picked again
        indices = xp.stack(picks, axis=1).astype(xp.int64) if picks else xp.zeros((x.shape[0], 0), xp.int64)
    raw = xp.take_along_axis(probs, indices, axis=1)
    gates = raw / raw.sum(axis=1, keepdims=True) if normalize else raw
    return Routing(probs, indices, raw, gates, normalize)


def route_backward(r: Routing, x: Any, router: Any, dgates: Any) -> tuple[Any, Any]:
    """``(dx, drouter)`` of this rank's tokens from ``dgates`` [T, k] (the loss's gradient of the gates)."""
    xp = array_namespace(x)
    if r.normalize:  # g = raw / S: d raw_i = (dg_i - sum_j dg_j g_j) / S
        draw = (dgates - (dgates * r.gates).sum(axis=1, keepdims=True)) / r.raw.sum(axis=1, keepdims=True)
    else:
        draw = dgates
    dprobs = xp.zeros_like(r.probs)
    rows = xp.arange(x.shape[0])
    for k in range(r.indices.shape[1]):  # one slot at a time: a caller's indices may repeat an expert
        dprobs[rows, r.indices[:, k]] += draw[:, k]
    dscores = r.probs * (dprobs - (dprobs * r.probs).sum(axis=1, keepdims=True))
    return dscores @ router.T, x.T @ dscores
