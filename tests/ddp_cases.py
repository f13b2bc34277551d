"""A small model with every awkward parameter DDP must handle, its gradients and a reference.

Parameters: float64 weights and bias, a float64 scalar, a float32 weight in a separate float32
branch (so float64 gradients never pass through float32 arithmetic and can match to 1e-10), a
parameter larger than a bucket, and one the model never uses.
"""

from __future__ import annotations

import numpy as np

import meshkit
from meshkit.parallel import SGD, DistributedDataParallel, array_namespace

GLOBAL_BATCH = 24  # divisible by 1, 2, 3, 4
STEPS = 4


def init_params(mixed: bool = True, xp=np) -> dict[str, np.ndarray]:
    """With ``mixed=False`` the "w32" branch is float64 too (for tests whose coupling of all
    gradients, e.g. clipping by the global norm, would carry float32 rounding into float64).
    ``xp``: the array library the parameters are made in (``cupy`` copies them to the device)."""
    rng = np.random.default_rng(7)
    return {name: xp.asarray(p) for name, p in {
        "w1": rng.standard_normal((6, 5)),
        "b1": rng.standard_normal(5),
        "scale": np.array(0.7),                                   # a 0-d parameter
        "w32": rng.standard_normal((6, 3)).astype(np.float32 if mixed else np.float64),  # float32 branch
        "big": rng.standard_normal(400),                          # 3.2 KB: larger than a 1 KB bucket
        "unused": np.ones(3),                                     # never gets a gradient
    }.items()}


def data(step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    x = rng.standard_normal((GLOBAL_BATCH, 6))
    return x, rng.standard_normal((GLOBAL_BATCH, 5)), rng.standard_normal((GLOBAL_BATCH, 3)).astype(np.float32)


def grads_in_backward_order(p: dict[str, np.ndarray], x, y, y32):
    """(name, gradient) of the mean loss over the batch, in the order a backward pass finds them
    (in the parameters' array library: the same code on NumPy and CuPy)."""
    xp = array_namespace(p["w1"])
    n = len(x)
    h = xp.tanh(x @ p["w1"] + p["b1"])
    r = p["scale"] * h - y                                  # loss64 = mean_i sum_j r_ij^2
    f32 = p["w32"].dtype
    o32 = x.astype(f32) @ p["w32"] - y32.astype(f32)        # loss32 = mean_i sum_j o_ij^2 (float32)
    dpred = 2 * r / n
    dz = dpred * p["scale"] * (1 - h ** 2)
    return [
        ("big", 0.02 * p["big"] * x[:, 0].mean()),          # loss_big = mean_i(x_i0) * 0.01 * sum(big^2)
        ("w32", (x.astype(f32).T @ (2 * o32 / f32.type(n))).astype(f32)),
        ("scale", xp.asarray((dpred * h).sum())),
        ("b1", dz.sum(axis=0)),
        ("w1", x.T @ dz),
    ]


def reference() -> dict[str, np.ndarray]:
    """Single-process SGD-with-momentum on the global batch."""
    params, opt = init_params(), SGD(lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.step(params, {**dict(grads_in_backward_order(params, *data(step))), "unused": None})
    return params


def train(*, gradient_as_bucket_view: bool = True, order=None, hook=None, state=None, xp=np) -> tuple[dict, list]:
    """DDP on this rank's share of each global batch; returns the params and the bucket layouts seen."""
    rank, n = meshkit.get_rank(), meshkit.get_world_size()
    ddp = DistributedDataParallel(init_params(xp=xp), bucket_cap_mb=1 / 1024, first_bucket_cap_mb=0.25 / 1024,
                                  gradient_as_bucket_view=gradient_as_bucket_view, find_unused_parameters=True,
                                  comm_hook=hook, comm_state=state)
    opt = SGD(lr=0.1, momentum=0.9)
    layouts = [ddp.buckets]
    for step in range(STEPS):
        x, y, y32 = (xp.asarray(np.array_split(a, n)[rank]) for a in data(step))
        ddp.zero_grad()
        grads = grads_in_backward_order(ddp.params, x, y, y32)
        for name, g in (grads if order is None else sorted(grads, key=lambda item: order.index(item[0]))):
            ddp.grads[name][...] = g
            ddp.mark_grad_ready(name)
        ddp.finish_gradient_sync()
        opt.step(ddp.params, {**ddp.grads, "unused": None})  # no gradient: the optimizer skips it
        layouts.append(ddp.buckets)
    return ddp.params, layouts


def assert_matches_reference(params: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> None:
    for name, expected in ref.items():
        rtol = 1e-5 if expected.dtype == np.float32 else 1e-10
        # relative to the parameter's scale: an element near zero is not held to 1e-10 of itself
        np.testing.assert_allclose(params[name], expected, rtol=rtol, atol=rtol * float(np.abs(expected).max()), err_msg=name)
        assert params[name].dtype == expected.dtype
