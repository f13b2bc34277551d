"""A tanh MLP cut into pipeline stages (one layer each), and its single-process reference.

Layer s: ``y = tanh(x @ W_s + b_s)``; loss: half the mean over samples of the squared error
of the last layer's output. ``forward``/``backward`` are the stage functions a user writes:
the backward accumulates into ``grads`` and returns ``dx``."""

from __future__ import annotations

import numpy as np

WIDTH = 5


def params(num_stages: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"w": rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH), "b": rng.standard_normal(WIDTH) * 0.1}
            for _ in range(num_stages)]


def data(batch: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, WIDTH)), rng.standard_normal((batch, WIDTH))


def stage_fns(p: dict[str, np.ndarray], grads: dict[str, np.ndarray]):
    def forward(x):
        y = np.tanh(x @ p["w"] + p["b"])
        return y, (x, y)

    def backward(ctx, dy):
        x, y = ctx
        dz = dy * (1 - y * y)
        grads["w"] += x.T @ dz
        grads["b"] += dz.sum(axis=0)
        return dz @ p["w"].T

    return forward, backward


def loss_fn(y, t):
    """Mean over the microbatch of half the squared error, and its gradient."""
    d = y - t
    return 0.5 * float(np.mean(np.sum(d * d, axis=1))), d / y.shape[0]


def reference(ps: list[dict[str, np.ndarray]], x: np.ndarray, t: np.ndarray):
    """The loss on the whole batch and every stage's gradients, in one process."""
    grads = [{k: np.zeros_like(v) for k, v in p.items()} for p in ps]
    fns = [stage_fns(p, g) for p, g in zip(ps, grads)]
    ctxs = []
    for fwd, _ in fns:
        x, ctx = fwd(x)
        ctxs.append(ctx)
    loss, dy = loss_fn(x, t)
    for (_, bwd), ctx in zip(reversed(fns), reversed(ctxs)):
        dy = bwd(ctx, dy)
    return loss, grads


# --------------------------------------------------------------------------- stages that alias their buffers
def scale_stage(kind: str, w: float, grad: np.ndarray):
    """A stage ``y = w x`` whose arrays alias the buffers the pipeline gave it, as in-place code does.

    ``kind``: "scale" (new arrays); "pass" (an identity layer: ``y`` is its input ``x``, ``dx`` is
    ``dy``); "inplace" (``dx`` written into its saved input ``x`` and returned). ``grad[0]``
    accumulates ``d loss / d w``."""
    def forward(x):
        return (x, None) if kind == "pass" else (w * x, x)

    def backward(x, dy):
        if kind == "pass":
            return dy
        grad[0] += float((x * dy).sum())
        if kind == "inplace":
            np.multiply(dy, w, out=x)
            return x
        return w * dy

    return forward, backward


def scale_reference(ws: list[float], x: np.ndarray, t: np.ndarray) -> list[float]:
    """``d loss / d w_s`` of ``loss_fn(prod(ws) x, t)`` on the whole batch (a "pass" stage: w = 1)."""
    d = (np.prod(ws) * x - t) / x.shape[0]
    total = float((x * d).sum())  # d loss / d w_s = (prod of the others) sum(x d) = prod / w_s * sum(x d)
    return [np.prod(ws) / w * total for w in ws]


def split_stage_fns(p: dict[str, np.ndarray], grads: dict[str, np.ndarray]):
    """``stage_fns``'s layer with its backward split (zero-bubble schedules): ``backward_input``
    returns ``dx`` and what ``backward_weight`` needs, ``backward_weight`` accumulates."""
    def forward(x):
        y = np.tanh(x @ p["w"] + p["b"])
        return y, (x, y)

    def backward_input(ctx, dy):
        x, y = ctx
        dz = dy * (1 - y * y)
        return dz @ p["w"].T, (x, dz)

    def backward_weight(wctx):
        x, dz = wctx
        grads["w"] += x.T @ dz
        grads["b"] += dz.sum(axis=0)

    return forward, backward_input, backward_weight


def split_stage(p, grads, stage: int, num_stages: int, **kw):
    """A PipelineStage of ``split_stage_fns`` (keywords go to PipelineStage)."""
    from meshkit.parallel import PipelineStage

    fwd, bi, bw = split_stage_fns(p, grads)
    return PipelineStage(fwd, None, stage, num_stages, backward_input=bi, backward_weight=bw, **kw)
