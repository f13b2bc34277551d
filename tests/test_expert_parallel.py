"""Expert parallelism: the MoE layer over an ep group reproduces one process bit for
bit (forward) and to 1e-12 (backward, and composed with dp and tp), drops exactly what its
capacity rule says, and rejects bad input on every rank."""

from __future__ import annotations

import numpy as np
import pytest
from expert_parallel_cases import (D, check_bitwise, check_ep_dp, check_ep_tp, reference, single_process, tokens,
                                   weights)

import meshkit
from meshkit.comm import DistValueError, local
from meshkit.parallel import MoE, expert_capacity, shard_experts


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "capacity"])
@pytest.mark.parametrize("ep,experts", [(1, 4), (2, 4), (4, 8), (3, 6), (4, 4)])  # (4, 4): no reorder
def test_forward_is_bitwise_one_process_for_any_ep_degree(ep, experts, capacity_factor):
    # 301 tokens: more than two ROW_BLOCKs for some experts, uneven shards
    dropped = local.run(check_bitwise, ep, ep, experts, 2, 301, capacity_factor, timeout=120)
    assert (dropped[0] > 0) == (capacity_factor is not None), dropped  # the capacity case really drops


def test_bitwise_holds_for_three_experts_per_token_and_a_tiny_batch():
    local.run(check_bitwise, 2, 2, 4, 3, 7, 0.5)  # 2 tokens of one rank may all be dropped


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_a_rank_without_tokens_takes_part(capacity_factor):
    local.run(check_bitwise, 4, 4, 8, 2, 3, capacity_factor)  # 3 tokens over 4 ranks: the last has none


@pytest.mark.parametrize("dp,ep", [(2, 2), (3, 2)])
def test_ep_by_dp_matches_one_process(dp, ep):
    local.run(check_ep_dp, dp * ep, dp, ep, 4, 2, 90, timeout=120)


def test_dp_by_ep_by_tp_matches_one_process():
    local.run(check_ep_dp, 8, 2, 2, 4, 2, 90, 2, timeout=120)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_ep_by_tp_matches_one_process(capacity_factor):
    local.run(check_ep_tp, 4, 2, 2, 4, 2, 60, capacity_factor, timeout=120)


def test_ep_by_tp_when_a_rank_receives_no_rows():
    local.run(check_ep_tp, 4, 2, 2, 4, 1, 1)  # one token, one expert: one ep rank runs nothing (empty all-reduce)


def test_capacity_keeps_the_first_tokens_in_global_order_and_counts_the_rest():
    """E=2, k=1, 8 tokens on 2 ranks, all sent to expert 0: capacity ceil(1.0 * 8 * 1 / 2) = 4
    keeps rank 0's four tokens and drops rank 1's (their output is zero); expert 1 drops none."""
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        r = mesh.get_local_rank()
        router, w1, w2 = weights(2)
        layer = MoE(router, *shard_experts(w1, w2, r, 2), top_k=1, ep_group=mesh["ep"], capacity_factor=1.0)
        y, ctx = layer.forward(tokens(8)[4 * r:4 * r + 4], indices=np.zeros((4, 1), np.int64))
        return y, ctx.keep, ctx.dropped, ctx.plan.capacity

    (y0, keep0, dropped, cap), (y1, keep1, _, _) = local.run(body, 2)
    assert cap == 4 == expert_capacity(1.0, 8, 1, 2)
    assert keep0.all() and not keep1.any() and dropped.tolist() == [4, 0]
    assert np.abs(y0).min() > 0 and np.array_equal(y1, np.zeros_like(y1))
    router, w1, w2 = weights(2)
    y_ref, _, keep, ref_dropped = reference(tokens(8), router, w1, w2, 1, capacity_factor=1.0,
                                            indices=np.zeros((8, 1), np.int64))
    assert np.array_equal(np.concatenate([y0, y1]), y_ref) and ref_dropped.tolist() == [4, 0]


def test_ties_go_to_the_lowest_expert_index_and_gates_follow_mixtral():
    router = np.zeros((D, 4))  # every probability 1/4: a four-way tie on every token
    w1, w2 = np.ones((4, D, 3)), np.ones((4, 3, D))
    for normalize, gate in ((True, 0.5), (False, 0.25)):
        _, ctx = MoE(router, w1, w2, top_k=2, normalize=normalize).forward(tokens(5))
        assert ctx.indices.tolist() == [[0, 1]] * 5
        assert np.allclose(ctx.gates, gate)


def test_backward_matches_finite_differences():
    rng = np.random.default_rng(5)
    router, w1, w2 = weights(4)
    x, c = tokens(6), rng.normal(size=(6, D))
    for normalize in (True, False):
        params = {"router": router.copy(), "w1": w1.copy(), "w2": w2.copy(), "x": x.copy()}

        def loss():
            layer = MoE(params["router"], params["w1"], params["w2"], top_k=2, normalize=normalize)
            return float((layer.forward(params["x"])[0] * c).sum())

        layer = MoE(params["router"], params["w1"], params["w2"], top_k=2, normalize=normalize)
        y, ctx = layer.forward(params["x"])
        dx, grads = layer.backward(ctx, c)
        grads["x"] = dx
        for name, arr in params.items():
            num = np.zeros_like(arr)
            for i in np.ndindex(arr.shape):
                old = arr[i]
                arr[i] = old + 1e-6
                up = loss()
                arr[i] = old - 1e-6
                num[i] = (up - loss()) / 2e-6
                arr[i] = old
            np.testing.assert_allclose(grads[name], num, rtol=1e-6, atol=1e-7, err_msg=f"{name} normalize={normalize}")


def test_the_single_process_layer_is_the_reference_forward_bitwise():
    router, w1, w2 = weights(4)
    for cf in (None, 0.75):
        y, *_ = single_process(4, 2, 200, capacity_factor=cf)
        assert np.array_equal(y, reference(tokens(200), router, w1, w2, 2, capacity_factor=cf)[0])


# --------------------------------------------------------------------------- bad input
def _errors_on_every_rank(fn, world):
    def body():
        try:
            fn()
        except (DistValueError, TypeError) as exc:
            return str(exc)
        return None
    return local.run(body, world)


def test_num_experts_not_divisible_by_ep_fails_on_every_rank():
    def fn():
        mesh = meshkit.init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        router, w1, w2 = weights(3)
        MoE(router, w1[:1], w2[:1], top_k=1, ep_group=mesh["ep"])
    msgs = _errors_on_every_rank(fn, 2)
    for rank, msg in enumerate(msgs):
        assert msg is not None and f"rank {rank}: MoE: num_experts=3 (router.shape[1]) must be divisible by" in msg


def test_top_k_larger_than_the_experts_is_an_error_naming_it():
    router, w1, w2 = weights(4)
    with pytest.raises(DistValueError, match=r"rank 0: MoE: top_k=5 must be in \[1, num_experts=4\]"):
        MoE(router, w1, w2, top_k=5)
    with pytest.raises(DistValueError, match=r"capacity_factor=0 must be None \(dropless\) or a number > 0"):
        MoE(router, w1, w2, top_k=1, capacity_factor=0)


def test_indices_out_of_range_on_one_rank_fail_on_every_rank_naming_it():
    def fn():
        mesh = meshkit.init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        r = mesh.get_local_rank()
        router, w1, w2 = weights(4)
        layer = MoE(router, *shard_experts(w1, w2, r, 2), top_k=1, ep_group=mesh["ep"])
        layer.forward(tokens(4), indices=np.full((4, 1), 4 if r == 1 else 0))
    msgs = _errors_on_every_rank(fn, 2)
    for rank, msg in enumerate(msgs):
        assert msg is not None and f"rank {rank}: MoE.forward: rank 1: indices out of range [0, num_experts=4)" in msg


@pytest.mark.parametrize("bad,message", [
    ("x", r"rank 1: x is not a \[tokens, 5\] array"),
    ("float indices", r"rank 1: indices are not an integer array of shape \[tokens, top_k\]"),
    ("indices shape", r"rank 1: indices are not an integer array of shape \[tokens, top_k\]")])
def test_a_bad_input_on_one_rank_fails_on_every_rank_naming_it(bad, message):
    def fn():
        mesh = meshkit.init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        r = mesh.get_local_rank()
        router, w1, w2 = weights(4)
        layer = MoE(router, *shard_experts(w1, w2, r, 2), top_k=2, ep_group=mesh["ep"])
        x, idx = tokens(4), np.zeros((4, 2), np.int64)
        if r == 1:
            x = tokens(4, d=6) if bad == "x" else x
            idx = idx.astype(float) if bad == "float indices" else idx[:, :1] if bad == "indices shape" else idx
        layer.forward(x, indices=idx)
    import re
    msgs = _errors_on_every_rank(fn, 2)
    for rank, msg in enumerate(msgs):
        assert msg is not None and re.search(f"rank {rank}: MoE.forward: " + message, msg), msg


# --------------------------------------------------------------------------- real processes
def test_expert_parallel_on_real_processes(mpirun):
    out = mpirun("mpi_expert_parallel.py", 4).stdout
    assert out.count("EP OK") == 4, out


# --------------------------------------------------------------------------- device arrays
def test_device_arrays_over_nccl_match_numpy(cupy):
    """tests/doubles/fake_cupy.py's strict arrays over the NCCL double: the layer stays on the device (every
    result a CuPy array) and matches the NumPy layer bit for bit forward, to 1e-12 backward."""
    from test_cupy_parallel import on_nccl

    def body():
        mesh = meshkit.init_device_mesh("cuda", (2,), mesh_dim_names=("ep",))
        r = mesh.get_local_rank()
        router, w1, w2 = weights(4)
        w1l, w2l = shard_experts(cupy.asarray(w1), cupy.asarray(w2), r, 2)
        layer = MoE(cupy.asarray(router), w1l, w2l, top_k=2, ep_group=mesh["ep"], capacity_factor=1.0)
        rows = slice(20 * r, 20 * r + 20)
        y, ctx = layer.forward(cupy.asarray(tokens(40)[rows]))
        dx, grads = layer.backward(ctx, cupy.asarray(np.random.default_rng(2).normal(size=(40, D))[rows]))
        assert all(isinstance(a, cupy.ndarray) for a in (y, dx, ctx.keep, *grads.values()))
        return rows, r, y.get(), dx.get(), {k: v.get() for k, v in grads.items()}

    y_ref, dx_ref, g_ref, _ = single_process(4, 2, 40, capacity_factor=1.0)
    for rows, r, y, dx, grads in on_nccl(body, 2):
        assert np.array_equal(y, y_ref[rows])
        np.testing.assert_allclose(dx, dx_ref[rows], rtol=0, atol=1e-12)
        np.testing.assert_allclose(grads["w1"] * 2, g_ref["w1"][2 * r:2 * r + 2], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(grads["router"] * 2, g_ref["router"], rtol=1e-12, atol=1e-12)
