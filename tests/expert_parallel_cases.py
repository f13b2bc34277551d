"""Cases of the expert-parallel MoE layer, shared by tests/test_expert_parallel.py (local engine)
and tests/scripts/mpi_expert_parallel.py (real processes): an independent single-process NumPy
reference of the forward, and per-rank bodies that compare the layer with it."""

from __future__ import annotations

import math

import numpy as np

import meshkit
from meshkit.parallel import MoE, shard_experts
from meshkit.parallel.expert_parallelism.experts import ROW_BLOCK

D, H = 5, 8
#: Widths at which OpenBLAS 0.3.31 (numpy 2's wheel) gives a row a different result in matrices of
#: different row counts (271 of the counts 1..299 at 64 x 256): the bitwise cases must see that.
BITWISE_D, BITWISE_H = 64, 96


def blocked(a, b):
    """``a @ b`` with every BLAS call on exactly ROW_BLOCK rows (the layer's documented rule)."""
    n = a.shape[0]
    padded = np.zeros((-(-n // ROW_BLOCK) * ROW_BLOCK, a.shape[1]))
    padded[:n] = a
    return np.concatenate([padded[i:i + ROW_BLOCK] @ b for i in range(0, len(padded), ROW_BLOCK)]
                          or [np.zeros((0, b.shape[1]))])[:n]


def reference(x, router, w1, w2, k, *, normalize=True, capacity_factor=None, indices=None):
    """The layer in one process, written plainly: ``(y, indices, keep, dropped)``."""
    s = blocked(x, router)
    e = np.exp(s - s.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    idx = np.argsort(-p, axis=1, kind="stable")[:, :k] if indices is None else indices
    raw = np.take_along_axis(p, idx, axis=1)
    g = raw / raw.sum(axis=1, keepdims=True) if normalize else raw
    n_exp = router.shape[1]
    cap = None if capacity_factor is None else math.ceil(capacity_factor * len(x) * k / n_exp)
    contrib = np.zeros((len(x), k, x.shape[1]))
    keep = np.zeros(idx.shape, bool)
    dropped = np.zeros(n_exp, np.int64)
    for ex in range(n_exp):
        slots = [(t, j) for t in range(len(x)) for j in range(k) if idx[t, j] == ex]  # global token order
        if cap is not None:
            dropped[ex] = max(0, len(slots) - cap)
            slots = slots[:cap]
        if not slots:
            continue
        z = blocked(x[[t for t, _ in slots]], w1[ex])
        o = blocked(z * (1.0 / (1.0 + np.exp(-z))), w2[ex])
        for (t, j), row in zip(slots, o):
            contrib[t, j] = row
            keep[t, j] = True
    y = g[:, 0, None] * contrib[:, 0]
    for j in range(1, k):
        y = y + g[:, j, None] * contrib[:, j]
    return y, idx, keep, dropped


def weights(num_experts, seed=0, d=D, h=H):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(d, num_experts)), rng.normal(size=(num_experts, d, h)) / 2, \
        rng.normal(size=(num_experts, h, d)) / 2


def tokens(n, seed=1, d=D):
    return np.random.default_rng(seed).normal(size=(n, d))


def shards(n, parts):
    """Consecutive, uneven shards of n tokens (the last ones shorter)."""
    return np.array_split(np.arange(n), parts)


def ep_forward_backward(ep_group, num_experts, k, n, *, normalize=True, capacity_factor=None, dp_group=None,
                        tp_group=None, data_index=None, data_parts=None, d=D, h=H):
    """One forward and backward of the layer on this rank's shard: ``(rows, y, dx, grads, ctx)``."""
    ep, er = ep_group.size(), ep_group.get_local_rank()
    tp, tr = (tp_group.size(), tp_group.get_local_rank()) if tp_group is not None else (1, 0)
    router, w1, w2 = weights(num_experts, d=d, h=h)
    w1l, w2l = shard_experts(w1, w2, er, ep, tr, tp)
    layer = MoE(router, w1l, w2l, top_k=k, ep_group=ep_group, dp_group=dp_group, tp_group=tp_group,
                capacity_factor=capacity_factor, normalize=normalize)
    rows = shards(n, data_parts or ep)[er if data_index is None else data_index]
    x = tokens(n, d=d)[rows]
    y, ctx = layer.forward(x)
    dy = np.random.default_rng(2).normal(size=(n, d))[rows]
    dx, grads = layer.backward(ctx, dy)
    return rows, y, dx, grads, ctx


def single_process(num_experts, k, n, d=D, h=H, **kw):
    """The layer with no groups on all n tokens: forward and the backward of ``dy`` (all rows)."""
    router, w1, w2 = weights(num_experts, d=d, h=h)
    layer = MoE(router, w1, w2, top_k=k, **kw)
    y, ctx = layer.forward(tokens(n, d=d))
    dx, grads = layer.backward(ctx, np.random.default_rng(2).normal(size=(n, d)))
    return y, dx, grads, ctx


def check_bitwise(ep, num_experts, k, n, capacity_factor, d=BITWISE_D, h=BITWISE_H):
    """ep ranks: y bit-identical to the plain reference, the same dropped/keep; grads to 1e-12."""
    mesh = meshkit.init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
    rows, y, dx, grads, ctx = ep_forward_backward(mesh["ep"], num_experts, k, n, capacity_factor=capacity_factor,
                                                  d=d, h=h)
    router, w1, w2 = weights(num_experts, d=d, h=h)
    y_ref, idx, keep, dropped = reference(tokens(n, d=d), router, w1, w2, k, capacity_factor=capacity_factor)
    assert np.array_equal(y, y_ref[rows]), np.abs(y - y_ref[rows]).max()
    assert np.array_equal(ctx.indices, idx[rows]) and np.array_equal(ctx.keep, keep[rows])
    assert np.array_equal(ctx.dropped, dropped), (ctx.dropped, dropped)
    _, dx_ref, g_ref, _ = single_process(num_experts, k, n, d=d, h=h, capacity_factor=capacity_factor)
    np.testing.assert_allclose(dx, dx_ref[rows], rtol=0, atol=1e-12)
    er = mesh.get_local_rank()
    per = num_experts // ep
    want = {"router": g_ref["router"], "w1": g_ref["w1"][er * per:(er + 1) * per],
            "w2": g_ref["w2"][er * per:(er + 1) * per]}
    for name in want:  # the mean over the ep data ranks' losses: the full batch's gradient / ep
        np.testing.assert_allclose(grads[name] * ep, want[name], rtol=1e-12, atol=1e-12, err_msg=name)
    return int(dropped.sum())


def check_ep_dp(dp, ep, num_experts, k, n, tp=1):
    """dp x ep (x tp): tokens split over all dp*ep ranks; y bitwise as one process on its ep group's
    tokens (without tp; with tp to 1e-12), dx and the reduced grads to 1e-12 of the full batch's (dropless)."""
    shape, names = ((dp, ep, tp), ("dp", "ep", "tp")) if tp > 1 else ((dp, ep), ("dp", "ep"))
    mesh = meshkit.init_device_mesh("cpu", shape, mesh_dim_names=names)
    di, er = mesh.get_local_rank("dp"), mesh.get_local_rank("ep")
    tr = mesh.get_local_rank("tp") if tp > 1 else 0
    rows, y, dx, grads, ctx = ep_forward_backward(mesh["ep"], num_experts, k, n, dp_group=mesh["dp"],
                                                  tp_group=mesh["tp"] if tp > 1 else None,
                                                  data_index=di * ep + er, data_parts=dp * ep)
    router, w1, w2 = weights(num_experts)
    group_rows = np.concatenate(shards(n, dp * ep)[di * ep:(di + 1) * ep])
    y_ref, *_ = reference(tokens(n)[group_rows], router, w1, w2, k)
    if tp == 1:
        assert np.array_equal(y, y_ref[np.searchsorted(group_rows, rows)])
    np.testing.assert_allclose(y, y_ref[np.searchsorted(group_rows, rows)], rtol=0, atol=1e-12)
    _, dx_ref, g_ref, _ = single_process(num_experts, k, n)
    np.testing.assert_allclose(dx, dx_ref[rows], rtol=0, atol=1e-12)
    w1_ref, w2_ref = shard_experts(g_ref["w1"], g_ref["w2"], er, ep, tr, tp)
    for name, full in (("router", g_ref["router"]), ("w1", w1_ref), ("w2", w2_ref)):
        np.testing.assert_allclose(grads[name] * dp * ep, full, rtol=1e-12, atol=1e-12, err_msg=name)


def check_ep_tp(ep, tp, num_experts, k, n, capacity_factor=None):
    """ep x tp: each expert's hidden dimension split over tp; everything to 1e-12 of one process."""
    mesh = meshkit.init_device_mesh("cpu", (ep, tp), mesh_dim_names=("ep", "tp"))
    er, tr = mesh.get_local_rank("ep"), mesh.get_local_rank("tp")
    rows, y, dx, grads, ctx = ep_forward_backward(mesh["ep"], num_experts, k, n, tp_group=mesh["tp"],
                                                  capacity_factor=capacity_factor)
    y_ref, dx_ref, g_ref, ctx_ref = single_process(num_experts, k, n, capacity_factor=capacity_factor)
    np.testing.assert_allclose(y, y_ref[rows], rtol=0, atol=1e-12)
    np.testing.assert_allclose(dx, dx_ref[rows], rtol=0, atol=1e-12)
    assert np.array_equal(ctx.dropped, ctx_ref.dropped)
    w1_ref, w2_ref = shard_experts(g_ref["w1"], g_ref["w2"], er, ep, tr, tp)
    for name, full in (("router", g_ref["router"]), ("w1", w1_ref), ("w2", w2_ref)):
        np.testing.assert_allclose(grads[name] * ep, full, rtol=1e-12, atol=1e-12, err_msg=name)
