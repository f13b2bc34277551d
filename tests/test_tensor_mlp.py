"""The test that matters for DTensor ops: a plain-NumPy two-layer MLP (forward, loss, hand-written
backward) runs unchanged on DTensors with W1 = Shard(1), W2 = Shard(0), matches single-process
NumPy, and issues exactly Megatron's collectives: one all-reduce forward, one backward."""

from __future__ import annotations

import numpy as np
import pytest
from tensor_cases import backward, check_megatron, data, forward, new_records, ops_of, reference

import meshkit
from meshkit.comm import local
from meshkit.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor


@pytest.mark.parametrize("world", [1, 2, 3, 4])  # hidden 6 over 4 ranks: 2, 2, 2, 0 (uneven, one empty)
def test_megatron_mlp_matches_numpy_with_one_all_reduce_each_way(world):
    local.run(check_megatron, world, world, timeout=60)


def dp_tp():
    """2-D: x and t split over dp, the weights over tp: the dp gradient reduction shows up as Partial."""
    mesh = meshkit.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x, t, w1, w2 = data()
    X, T = distribute_tensor(x, mesh, [Shard(0), Replicate()]), distribute_tensor(t, mesh, [Shard(0), Replicate()])
    W1 = distribute_tensor(w1, mesh, [Replicate(), Shard(1)])
    W2 = distribute_tensor(w2, mesh, [Replicate(), Shard(0)])
    start = meshkit.flight_record()
    pre, h, y, err, loss = forward(X, T, W1, W2)
    fwd = ops_of(new_records(start))
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
