"""The test that matters for DTensor ops: a plain-NumPy two-layer MLP (forward, loss, hand-written
backward) runs unchanged on DTensors with W1 = Shard(1), W2 = Shard(0), matches single-process
NumPy, and issues exactly Megatron's collectives: one all-reduce forward, one backward."""

from __future__ import annotations

import numpy as np
import pytest
from tensor_cases import new_records

import meshkit
from meshkit.comm import local
from meshkit.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor


def forward(x, t, w1, w2):
    """Plain NumPy: no DTensor in sight."""
    pre = x @ w1
    h = np.tanh(pre)
    y = h @ w2
    err = y - t
    loss = 0.5 * np.sum(err ** 2) / x.shape[0]
    return pre, h, y, err, loss


def backward(x, h, err, w1, w2):
    """Plain NumPy, hand-written: gradients of the loss above."""
    dy = err / x.shape[0]
    dw2 = h.T @ dy
    dh = dy @ w2.T
    dpre = dh * (1 - h ** 2)
    dw1 = x.T @ dpre
    dx = dpre @ w1.T
    return dw1, dw2, dx


def data(batch=5, d_in=3, hidden=6, d_out=2):
    rng = np.random.default_rng(7)
    return (rng.standard_normal((batch, d_in)), rng.standard_normal((batch, d_out)),
            rng.standard_normal((d_in, hidden)) / 2, rng.standard_normal((hidden, d_out)) / 2)


def reference():
    x, t, w1, w2 = data()
    pre, h, y, err, loss = forward(x, t, w1, w2)
    return (loss, *backward(x, h, err, w1, w2))


def _ops(records):
    return [(r["group"], r["op"]) for r in records]


def megatron(world: int):
    mesh = meshkit.init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    x, t, w1, w2 = data()
    X, T = distribute_tensor(x, mesh, [Replicate()]), distribute_tensor(t, mesh, [Replicate()])
    W1, W2 = distribute_tensor(w1, mesh, [Shard(1)]), distribute_tensor(w2, mesh, [Shard(0)])
    start = meshkit.flight_record()
    pre, h, y, err, loss = forward(X, T, W1, W2)
    fwd = new_records(start)
    mark = meshkit.flight_record()
    dw1, dw2, dx = backward(X, h, err, W1, W2)
    bwd_local = new_records(mark)
    mark = meshkit.flight_record()
    dx_full = dx.full_tensor()
    bwd = new_records(mark)
    placements = {name: v.placements for name, v in
                  dict(pre=pre, h=h, y=y, err=err, loss=loss, dw1=dw1, dw2=dw2, dx=dx).items()}
    tp = mesh.get_group("tp").name  # a 1-D mesh over the whole world uses the world's group
    return (tp, _ops(fwd), _ops(bwd_local), _ops(bwd), placements,
            [float(loss.full_tensor()), dw1.full_tensor(), dw2.full_tensor(), dx_full])


@pytest.mark.parametrize("world", [1, 2, 3, 4])  # hidden 6 over 4 ranks: 2, 2, 2, 0 (uneven, one empty)
def test_megatron_mlp_matches_numpy_with_one_all_reduce_each_way(world):
    results = local.run(megatron, world, world, timeout=60)
    want = reference()
    for tp, fwd, bwd_local, bwd, placements, got in results:
        assert fwd == [(tp, "all_reduce")], fwd
        assert bwd_local == [], "the backward is local until the input gradient is needed"
        assert bwd == [(tp, "all_reduce")], bwd
        assert placements == dict(pre=(Shard(1),), h=(Shard(1),), y=(Partial(),), err=(Replicate(),),
                                  loss=(Replicate(),), dw1=(Shard(1),), dw2=(Shard(0),), dx=(Partial(),))
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-10)


def dp_tp():
    """2-D: x and t split over dp, the weights over tp: the dp gradient reduction shows up as Partial."""
    mesh = meshkit.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x, t, w1, w2 = data()
    X, T = distribute_tensor(x, mesh, [Shard(0), Replicate()]), distribute_tensor(t, mesh, [Shard(0), Replicate()])
    W1 = distribute_tensor(w1, mesh, [Replicate(), Shard(1)])
    W2 = distribute_tensor(w2, mesh, [Replicate(), Shard(0)])
    start = meshkit.flight_record()
    pre, h, y, err, loss = forward(X, T, W1, W2)
    fwd = _ops(new_records(start))
    dw1, dw2, dx = backward(X, h, err, W1, W2)
    return fwd, (loss.placements, dw1.placements, dw2.placements, dx.placements), \
        [float(loss.full_tensor()), dw1.full_tensor(), dw2.full_tensor(), dx.full_tensor()]


def test_dp_by_tp_mlp_matches_numpy():
    want = reference()
    for fwd, placements, got in local.run(dp_tp, 4, timeout=60):
        assert fwd == [("tp", "all_reduce")], fwd
        assert placements == ((Partial(), Replicate()), (Partial(), Shard(1)), (Partial(), Shard(0)),
                              (Shard(0), Partial()))
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-10)


def test_from_local_blocks_run_the_same_model():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        x, t, w1, w2 = data()
        r = meshkit.get_rank()
        W1 = DTensor.from_local(w1[:, 3 * r:3 * r + 3], mesh, [Shard(1)])
        W2 = DTensor.from_local(w2[3 * r:3 * r + 3], mesh, [Shard(0)])
        X, T = distribute_tensor(x, mesh), distribute_tensor(t, mesh)
        return float(forward(X, T, W1, W2)[-1].full_tensor())

    assert local.run(body, 2) == pytest.approx([reference()[0]] * 2, abs=1e-12)
