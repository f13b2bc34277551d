"""DistributedDataParallel reproduces single-process training; buckets, no_sync, hooks, errors."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import ddp_cases
import meshkit
from meshkit.comm import local
from meshkit.parallel import DistributedDataParallel, PowerSGDState, fp16_compress_hook, powersgd_hook
from meshkit.parallel.data_parallelism.buckets import assign_buckets

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import train_mlp  # noqa: E402


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("view", [True, False], ids=["bucket-view", "copies"])
def test_ddp_reproduces_single_process_training_local(world_size, view):
    ref = ddp_cases.reference()
    for params, _ in local.run(ddp_cases.train, world_size, gradient_as_bucket_view=view, timeout=30):
        ddp_cases.assert_matches_reference(params, ref)
    assert np.array_equal(params["unused"], np.ones(3)), "an unused parameter's gradient is zero"


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_reproduces_single_process_training_mpi(mpirun, world_size):
    out = mpirun("mpi_ddp.py", world_size).stdout
    assert out.count("DDP OK") == world_size, out


def test_bucket_assignment_caps_dtypes_and_order():
    f32, f64 = np.dtype(np.float32), np.dtype(np.float64)
    specs = [("a", (2,), f32), ("b", (2,), f32), ("c", (2,), f32), ("d", (1,), f64), ("e", (100,), f32)]
    # first float32 bucket capped at 8 bytes, the rest at 16: "b" would overflow the first;
    # "e" (400 bytes) is larger than any cap and gets a bucket of its own
    assert assign_buckets(specs, bucket_cap_bytes=16, first_bucket_cap_bytes=8) == [["a"], ["b", "c"], ["d"], ["e"]]


def test_buckets_follow_reverse_registration_and_are_rebuilt_once_in_ready_order():
    order = ["w1", "b1", "scale", "w32", "big"]  # the reverse of the default order

    def body():
        return ddp_cases.train(order=order)
    ref = ddp_cases.reference()
    for params, layouts in local.run(body, 2, timeout=30):
        ddp_cases.assert_matches_reference(params, ref)
        first, rebuilt = layouts[0], layouts[1]
        assert first[0] == ["unused", "big"] or first[0][0] == "unused", first  # reverse registration
        flat = [n for bucket in rebuilt for n in bucket]
        assert flat[:5] == order, "rebuilt in the order gradients became ready"
        assert all(layout == rebuilt for layout in layouts[2:]), "rebuilt once"
        assert first != rebuilt


def test_no_sync_accumulation_equals_one_step_on_the_concatenated_batch():
    x, y, y32 = ddp_cases.data(0)
    ref = ddp_cases.init_params()
    expected = {n: 0.1 * g for n, g in ddp_cases.grads_in_backward_order(ref, x, y, y32)}

    def body():
        rank, n = meshkit.get_rank(), meshkit.get_world_size()
        ddp = DistributedDataParallel(ddp_cases.init_params(), find_unused_parameters=True)
        ddp.zero_grad()
        halves = [np.array_split(a, 2) for a in (x, y, y32)]
        for micro in range(2):  # two micro-batches, each the mean over half: scale by 1/2
            xs, ys, y32s = (np.array_split(h[micro], n)[rank] for h in halves)
            ctx = ddp.no_sync() if micro == 0 else _null()
            with ctx:
                for name, g in ddp_cases.grads_in_backward_order(ddp.params, xs, ys, y32s):
                    ddp.mark_grad_ready(name, (g / 2).astype(g.dtype))
                ddp.finish_gradient_sync()
        return {k: 0.1 * v for k, v in ddp.grads.items()}
    for grads in local.run(body, 3, timeout=10):
        for name, g in expected.items():
            np.testing.assert_allclose(grads[name], g, rtol=1e-5 if g.dtype == np.float32 else 1e-10, err_msg=name)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_fp16_hook_is_within_float16_tolerance():
    ref = ddp_cases.reference()
    for params, _ in local.run(ddp_cases.train, 2, hook=fp16_compress_hook, timeout=30):
        for name, expected in ref.items():
            np.testing.assert_allclose(params[name], expected, rtol=2e-3, atol=2e-3, err_msg=name)
        assert not all(np.array_equal(params[n], ref[n]) for n in ref), "float16 rounding should show"


def test_powersgd_trains_the_example_within_10_percent_of_allreduce():
    args = train_mlp.parse_args(["--steps", "150", "--bucket-cap-mb", "0.01"])

    def body(compress):
        # Each rank owns its PowerSGD state (error feedback, Q), as each process does under MPI.
        hook, state = (powersgd_hook, PowerSGDState(rank=2, start_iter=10)) if compress else (None, None)
        return float(np.mean(train_mlp.train(args, hook, state, progress=False)[1][-20:]))  # batches differ
    plain, again = local.run(body, 2, False, timeout=60)[0], local.run(body, 2, False, timeout=60)[0]
    compressed = local.run(body, 2, True, timeout=60)
    assert plain == again and compressed[0] == compressed[1], "deterministic, and the same on every rank"
    assert plain < 0.6, f"the example should learn: loss {plain}"
    assert abs(compressed[0] - plain) <= 0.1 * plain, (compressed[0], plain)


def test_powersgd_warm_up_is_plain_averaging():
    ref = ddp_cases.reference()

    def body():
        return ddp_cases.train(hook=powersgd_hook, state=PowerSGDState(rank=1, start_iter=100))
    for params, _ in local.run(body, 2, timeout=30):
        ddp_cases.assert_matches_reference(params, ref)


def test_ddp_bad_input():
    def body():
        rank = meshkit.get_rank()
        ddp = DistributedDataParallel(ddp_cases.init_params())
        with pytest.raises(ValueError, match=r"mark_grad_ready: unknown parameter 'w9'; valid names are \['w1'"):
            ddp.mark_grad_ready("w9")
        ddp.mark_grad_ready("b1")
        with pytest.raises(ValueError, match="gradient 'b1' was already marked ready in this backward pass"):
            ddp.mark_grad_ready("b1")
        ddp.grads["w1"] = np.zeros((5, 6))
        with pytest.raises(ValueError, match=r"gradient 'w1' has shape \(5, 6\) and dtype float64; expected the "
                                             r"parameter's shape \(6, 5\) and dtype float64"):
            ddp.mark_grad_ready("w1")
        with pytest.raises(ValueError, match=r"gradient 'w32' has shape \(6, 3\) and dtype float64"):
            ddp.mark_grad_ready("w32", np.zeros((6, 3)))
        ddp.grads["w1"] = np.zeros((6, 5))
        ddp.mark_grad_ready("w1")
        with pytest.raises(ValueError, match=r"gradients \['scale', 'w32', 'big', 'unused'\] were not marked ready "
                                             r"in this backward pass.*find_unused_parameters=True"):
            ddp.finish_gradient_sync()
        ddp.sync_gradients()  # the state was reset: a full pass works
        if rank == 1:
            params = {**ddp_cases.init_params(), "b1": np.zeros(7)}
        else:
            params = ddp_cases.init_params()
        with pytest.raises(ValueError, match=r"parameter 'b1' differs between rank \d \(shape \((5|7),\), dtype "
                                             r"float64\) and rank \d"):
            DistributedDataParallel(params)
        mesh = meshkit.init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        with pytest.raises(ValueError, match=r"mesh must be 1-D .*got a 2-D mesh with dims \('dp', 'tp'\)"):
            DistributedDataParallel(ddp_cases.init_params(), mesh=mesh)
        with pytest.raises(ValueError, match="params\\['i'\\] has dtype int64; parameters must be floating-point"):
            DistributedDataParallel({"i": np.zeros(2, np.int64)})
    local.run(body, 2, timeout=10)


def test_parameters_start_from_broadcast_from():
    def body():
        params = {"w": np.full(3, float(meshkit.get_rank()))}
        DistributedDataParallel(params, broadcast_from=1)
        return params["w"]
    assert all(np.array_equal(w, np.ones(3)) for w in local.run(body, 3))


def test_sync_gradients_marks_views_in_bulk_and_copies_replaced_arrays():
    def body():
        rank = meshkit.get_rank()
        ddp = DistributedDataParallel({"a": np.zeros(3), "b": np.zeros(2)})
        ddp.grads["a"][...] = rank + 1                # written into the bucket's view
        ddp.grads["b"] = np.full(2, 10.0 * (rank + 1))  # replaced by an array of the user's
        ddp.sync_gradients()
        return ddp.grads["a"].copy(), ddp.grads["b"].copy()
    for a, b in local.run(body, 3):
        np.testing.assert_array_equal(a, np.full(3, 2.0))
        np.testing.assert_array_equal(b, np.full(2, 20.0))
