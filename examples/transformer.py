"""The transformer example's model in plain NumPy: one block (attention, then a mixture of experts).

``examples/train_transformer.py`` trains it on a mesh of any of dp, cp, tp, ep and pp; this
module is the single-device math every parallel run is checked against, and the pieces the
parallel run composes. Like ``mlp.py`` it is not part of the installed package.

The block, on ``x`` of shape ``(batch, seq, dim)``::

    h   = x + attention(x)         # heads x head_dim, softmax(q k^T / sqrt(head_dim)) v, causal or not
    out = h + moe(h)               # router softmax over experts, top-k, gates renormalized over the k,
                                   # each expert silu(h w1) w2 (meshkit.parallel.MoE's)
    loss = mean((out - y) ** 2) / 2

Parameters (float64): ``wq``, ``wk``, ``wv`` ``(dim, heads, head_dim)``, ``wo`` ``(heads, head_dim,
dim)``, ``router`` ``(dim, experts)``, ``w1`` ``(experts, dim, ffn)``, ``w2`` ``(experts, ffn, dim)``.
The backward pass is written by hand; :func:`loss_and_grads` is the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Config", "init_params", "make_data", "batch_indices", "attention_forward", "attention_backward",
           "route", "moe_forward", "moe_backward", "router_input_grad", "loss_and_grads", "PARAMS"]

PARAMS = ("wq", "wk", "wv", "wo", "router", "w1", "w2")


@dataclass(frozen=True)
class Config:
    """The model's sizes."""

    dim: int = 16
    heads: int = 4
    head_dim: int = 4
    experts: int = 4
    ffn: int = 8
    top_k: int = 2
    causal: bool = True


def init_params(cfg: Config, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d, h, e, f = cfg.dim, cfg.heads, cfg.experts, cfg.ffn
    scale = 1 / np.sqrt(d)
    return {
        "wq": rng.standard_normal((d, h, cfg.head_dim)) * scale,
        "wk": rng.standard_normal((d, h, cfg.head_dim)) * scale,
        "wv": rng.standard_normal((d, h, cfg.head_dim)) * scale,
        "wo": rng.standard_normal((h, cfg.head_dim, d)) / np.sqrt(h * cfg.head_dim),
        "router": rng.standard_normal((d, e)) * scale,
        "w1": rng.standard_normal((e, d, f)) * scale,
        "w2": rng.standard_normal((e, f, d)) / np.sqrt(f),
    }


def make_data(samples: int, seq: int, cfg: Config, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets: the targets are a fixed random block's output (a learnable task)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, seq, cfg.dim))
    teacher = init_params(cfg, seed=seed + 100)
    out, _ = block_forward(teacher, x, cfg)
    return x, out + 0.01 * rng.standard_normal(out.shape)


def batch_indices(step: int, samples: int, batch: int) -> np.ndarray:
    """The global batch of a step: the same on every rank and at every world size (docs/elastic.md)."""
    return np.random.default_rng(1000 + step).choice(samples, size=batch, replace=False)


# --------------------------------------------------------------------------- attention
def attention_forward(x: np.ndarray, p: dict[str, np.ndarray], causal: bool) -> tuple[np.ndarray, Any]:
    """Multi-head attention over the heads ``p`` holds (a tp rank's share): the output projection
    summed over those heads only (a partial sum when heads are split)."""
    q = np.einsum("bsd,dhe->bhse", x, p["wq"])
    k = np.einsum("bsd,dhe->bhse", x, p["wk"])
    v = np.einsum("bsd,dhe->bhse", x, p["wv"])
    scores = np.einsum("bhqe,bhke->bhqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        s = x.shape[1]
        scores = np.where(np.tril(np.ones((s, s), dtype=bool)), scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    ctx = np.einsum("bhqk,bhke->bhqe", probs, v)
    out = np.einsum("bhse,hed->bsd", ctx, p["wo"])
    return out, (x, q, k, v, probs, ctx)


def attention_backward(dout: np.ndarray, cache: Any, p: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    x, q, k, v, probs, ctx = cache
    grads = {"wo": np.einsum("bhse,bsd->hed", ctx, dout)}
    dctx = np.einsum("bsd,hed->bhse", dout, p["wo"])
    dprobs = np.einsum("bhqe,bhke->bhqk", dctx, v)
    dv = np.einsum("bhqk,bhqe->bhke", probs, dctx)
    dscores = probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True)) / np.sqrt(q.shape[-1])
    dq = np.einsum("bhqk,bhke->bhqe", dscores, k)
    dk = np.einsum("bhqk,bhqe->bhke", dscores, q)
    grads["wq"] = np.einsum("bsd,bhse->dhe", x, dq)
    grads["wk"] = np.einsum("bsd,bhse->dhe", x, dk)
    grads["wv"] = np.einsum("bsd,bhse->dhe", x, dv)
    dx = (np.einsum("bhse,dhe->bsd", dq, p["wq"]) + np.einsum("bhse,dhe->bsd", dk, p["wk"])
          + np.einsum("bhse,dhe->bsd", dv, p["wv"]))
    return dx, grads


# --------------------------------------------------------------------------- mixture of experts
def route(h: np.ndarray, router: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray, Any]:
    """``(experts (tokens, k), gates (tokens, k), cache)`` for tokens ``h`` of shape ``(tokens, dim)``:
    the k highest router probabilities (ties to the lower expert), renormalized over the k."""
    logits = h @ router
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    picked = np.take_along_axis(probs, experts, axis=-1)
    gates = picked / picked.sum(axis=-1, keepdims=True)
    return experts, gates, (h, probs, experts, picked)


def moe_forward(h: np.ndarray, p: dict[str, np.ndarray], top_k: int) -> tuple[np.ndarray, Any]:
    """The layer on tokens ``h`` (tokens, dim), every expert here: each token's k experts' outputs,
    weighted by their gates, summed in k order."""
    experts, gates, rcache = route(h, p["router"], top_k)
    out = np.zeros_like(h)
    per_expert = []
    for e in range(p["w1"].shape[0]):
        rows, slots = np.nonzero(experts == e)  # tokens in order: what an expert sees is fixed
        pre = h[rows] @ p["w1"][e]
        act = pre / (1 + np.exp(-pre))  # silu
        y = act @ p["w2"][e]
        per_expert.append((rows, slots, pre, act, y))
    contributions = np.zeros((h.shape[0], top_k, h.shape[1]))
    for rows, slots, _, _, y in per_expert:
        contributions[rows, slots] = y
    for slot in range(top_k):  # a fixed order of summation
        out += gates[:, slot, None] * contributions[:, slot]
    return out, (h, experts, gates, rcache, per_expert, contributions)


def moe_backward(dout: np.ndarray, cache: Any, p: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    h, experts, gates, (_, probs, _, picked), per_expert, contributions = cache
    dgates = np.einsum("td,tkd->tk", dout, contributions)
    grads = {"w1": np.zeros_like(p["w1"]), "w2": np.zeros_like(p["w2"])}
    dh = np.zeros_like(h)
    for e, (rows, slots, pre, act, _) in enumerate(per_expert):
        dy = gates[rows, slots, None] * dout[rows]
        grads["w2"][e] = act.T @ dy
        sig = 1 / (1 + np.exp(-pre))
        dpre = (dy @ p["w2"][e].T) * (sig * (1 + pre * (1 - sig)))
        grads["w1"][e] = h[rows].T @ dpre
        np.add.at(dh, rows, dpre @ p["w1"][e].T)
    dlogits = _router_logits_grad(dgates, probs, experts, picked)
    grads["router"] = h.T @ dlogits
    dh += dlogits @ p["router"].T
    return dh, grads


def _router_logits_grad(dgates: np.ndarray, probs: np.ndarray, experts: np.ndarray, picked: np.ndarray) -> np.ndarray:
    """Through ``gates = picked / sum(picked)`` (the renormalization), then the softmax."""
    total = picked.sum(axis=-1, keepdims=True)
    dpicked = dgates / total - (dgates * picked).sum(axis=-1, keepdims=True) / total ** 2
    dprobs = np.zeros_like(probs)
    np.put_along_axis(dprobs, experts, dpicked, axis=-1)
    return probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True))


def router_input_grad(dout: np.ndarray, cache: Any, p: dict[str, np.ndarray]) -> np.ndarray:
    """The part of :func:`moe_backward`'s input gradient that flows through the router (the gates)."""
    h, experts, gates, (_, probs, _, picked), _, contributions = cache
    dgates = np.einsum("td,tkd->tk", dout, contributions)
    return _router_logits_grad(dgates, probs, experts, picked) @ p["router"].T


# --------------------------------------------------------------------------- the block
def block_forward(p: dict[str, np.ndarray], x: np.ndarray, cfg: Config) -> tuple[np.ndarray, Any]:
    attn, acache = attention_forward(x, p, cfg.causal)
    h = x + attn
    b, s, d = h.shape
    moe, mcache = moe_forward(h.reshape(b * s, d), p, cfg.top_k)
    return h + moe.reshape(b, s, d), (acache, mcache)


def loss_and_grads(p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, cfg: Config
                   ) -> tuple[float, dict[str, np.ndarray]]:
    """The mean squared error over every element of the batch, and every parameter's gradient."""
    out, (acache, mcache) = block_forward(p, x, cfg)
    diff = out - y
    loss = 0.5 * float(np.mean(diff ** 2))
    dout = diff / diff.size
    b, s, d = x.shape
    dh_moe, grads = moe_backward(dout.reshape(b * s, d), mcache, p)
    dh = dout + dh_moe.reshape(b, s, d)
    _, agrads = attention_backward(dh, acache, p)
    return loss, {**agrads, **grads}
