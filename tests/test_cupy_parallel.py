"""Every parallel strategy on device arrays: the NCCL engine over the double, with tests/doubles/fake_cupy.py's
strict CuPy arrays (not np.ndarray; np.asarray on them raises as on CuPy), against single-process
NumPy on the global batch (float64 to 1e-10, float32 to 1e-5). The collective suite runs on the
strict arrays over every engine: NCCL, local, and MPI (staged, chunked, CUDA-aware)."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

import collective_cases
import ddp_cases
from doubles import fake_cupy
import meshkit
from doubles import nccl_double as double
import sharded_cases as cases
from meshkit import ReduceOp
from meshkit.comm import local
from meshkit.parallel import (SGD, AdamW, DistributedDataParallel, FullyShardedDataParallel, PowerSGDState,
                              ZeroRedundancyOptimizer, clip_grad_norm_, fp16_compress_hook, powersgd_hook)
from meshkit.parallel.data_parallelism import full_state
import support.nccl


# The ``cupy`` fixture (tests/conftest.py) installs the fake module and the double for a test; a
# strategy's step on 4 thread-ranks of a loaded 2-core machine takes the group's timeout of 60 s.
on_nccl = functools.partial(support.nccl.on_nccl, timeout=60)


def host(tree):
    """Device arrays of a (nested) dict as NumPy arrays, through the explicit ``.get()``."""
    if isinstance(tree, dict):
        return {k: host(v) for k, v in tree.items()}
    return tree.get() if isinstance(tree, fake_cupy.ndarray) else tree


def on_host(tree):
    """Every array of a nested dict is a NumPy array."""
    if isinstance(tree, dict):
        return all(on_host(v) for v in tree.values())
    return not hasattr(tree, "dtype") or type(tree) is np.ndarray


def on_device(tree):
    """Every array of a nested dict is a (fake) CuPy array."""
    if isinstance(tree, dict):
        return all(on_device(v) for v in tree.values())
    return not hasattr(tree, "dtype") or isinstance(tree, fake_cupy.ndarray)


# --------------------------------------------------------------------------- the collectives
FLOAT_OPS = [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
INT_OPS = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("engine", ["nccl", "local"])
def test_every_collective_on_fake_cupy_arrays(cupy, engine, dtype, world_size):
    """comm's NCCL engine takes the strict arrays as device arrays (pointers, stream order); the
    local engine computes on them with their own library (a hidden np.asarray raises)."""
    if engine == "nccl":
        ops = FLOAT_OPS if np.dtype(dtype).kind == "f" else INT_OPS
    else:
        ops = collective_cases.ops_for(dtype)

    def body():
        return collective_cases.check_all(dtype, dev=cupy.asarray, host=double.to_host, ops=lambda _: ops)
    per_rank = 8 * len(ops) + 9 + world_size  # + 1 on rank 0, the gather root
    run = on_nccl if engine == "nccl" else local.run
    assert run(body, world_size) == [per_rank + 1] + [per_rank] * (world_size - 1)


@pytest.mark.parametrize("mode", ["staged", "chunked", "aware"])
def test_every_collective_on_fake_cupy_arrays_over_mpi(mpirun, mode):
    """The MPI engine on the strict arrays: staged through pinned buffers (whole, or in 16-byte
    chunks), and handed to MPI as they are (CUDA-aware)."""
    env = {"MESHKIT_CUDA_AWARE_MPI": "1" if mode == "aware" else "0"}
    out = mpirun("mpi_fake_cupy.py", 2, mode, env=env, timeout=240).stdout
    assert dict(re.findall(rf"\[rank(\d)\]: OK {mode} (\d+) checks", out)) == {"0": "626", "1": "298"}, out


DDP_REFERENCE = ddp_cases.reference()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("view", [True, False], ids=["bucket_view", "own_grads"])
def test_ddp_on_device_arrays_matches_single_process_numpy(cupy, world_size, view):
    for params, _ in on_nccl(ddp_cases.train, world_size, gradient_as_bucket_view=view, xp=cupy):
        assert on_device(dict(params))
        ddp_cases.assert_matches_reference(host(dict(params)), DDP_REFERENCE)


SHARDED_REFERENCE = {(kind, config): cases.reference(kind, config) for kind in ("adamw", "sgd") for config in cases.CONFIGS}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("config", list(cases.CONFIGS))
@pytest.mark.parametrize("strategy", list(cases.STRATEGIES))
def test_sharded_strategies_on_device_arrays_match_single_process_numpy(cupy, strategy, config, world_size):
    kind = "adamw" if world_size % 2 else "sgd"  # both optimizers, without doubling the run time
    results = on_nccl(cases.STRATEGIES[strategy], world_size, kind, config, steps=range(2), xp=cupy)
    ref = cases.reference(kind, config, steps=2)
    for sd, norms in results:
        assert on_host(sd), "the full state dict of a device model is NumPy arrays on the host"
        cases.assert_matches(host(sd["model"]), ref, f"{strategy}/{kind}/{config}/{world_size}")
        assert norms == results[0][1] and all(isinstance(v, float) for v in norms)


@pytest.mark.parametrize("config", list(cases.CONFIGS))
def test_hybrid_sharding_on_device_arrays_on_a_2x2_mesh(cupy, config):
    ref = cases.reference("adamw", config, steps=2)
    for sd, _ in on_nccl(cases.train_fsdp, 4, "adamw", config, (2, 2), steps=range(2), xp=cupy):
        cases.assert_matches(host(sd["model"]), ref, f"hsdp/{config}")


# --------------------------------------------------------------------------- communication hooks
@pytest.mark.parametrize("hook", ["fp16", "powersgd"])
def test_comm_hooks_on_device_arrays_match_the_host_run(cupy, hook):
    """The same hook on host and device arrays gives the same parameters (the fake computes with
    NumPy, and its random generator is NumPy's: a real GPU draws PowerSGD's Q differently)."""
    def run(xp):
        hook_fn = fp16_compress_hook if hook == "fp16" else powersgd_hook
        state = None if hook == "fp16" else PowerSGDState(rank=1, start_iter=1, min_compression_rate=1.0)
        params, _ = ddp_cases.train(hook=hook_fn, state=state, xp=xp)
        held = [] if state is None else list(state.errors.values()) + [q for qs in state.qs.values() for q in qs]
        return dict(params), held
    host_params = local.run(run, 2, np)[0][0]
    for params, held in on_nccl(run, 2, cupy):
        assert on_device(dict(params))
        if hook == "powersgd":
            assert held and all(isinstance(h, fake_cupy.ndarray) for h in held), "PowerSGD's state is on the device"
        for name, expected in host_params.items():
            np.testing.assert_allclose(params[name].get(), expected, rtol=1e-10, atol=1e-12, err_msg=name)


# --------------------------------------------------------------------------- optimizers and clipping
@pytest.mark.parametrize("make", [lambda: SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
                                  lambda: AdamW(lr=0.01, amsgrad=True)], ids=["sgd", "adamw"])
def test_optimizers_on_device_arrays_match_numpy(cupy, make):
    rng = np.random.default_rng(3)
    params = {"w": rng.standard_normal((4, 3)), "b": rng.standard_normal(3).astype(np.float32)}
    grads = [{k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in params.items()} for _ in range(3)]
    host_params, host_opt = {k: v.copy() for k, v in params.items()}, make()
    dev_params, dev_opt = {k: cupy.asarray(v) for k, v in params.items()}, make()
    for g in grads:
        host_opt.step(host_params, g)
        dev_opt.step(dev_params, {k: cupy.asarray(v) for k, v in g.items()})
    for name, expected in host_params.items():
        np.testing.assert_array_equal(dev_params[name].get(), expected)
    assert all(isinstance(a, fake_cupy.ndarray) for st in dev_opt.state.values() for a in st.values())
    assert dev_opt.state_nbytes() == host_opt.state_nbytes()


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, "inf"])
def test_clip_grad_norm_on_device_arrays(cupy, norm_type):
    rng = np.random.default_rng(5)
    grads = [rng.standard_normal(7) * 3, rng.standard_normal((2, 5)).astype(np.float32) * 3]
    expected = clip_grad_norm_([g.copy() for g in grads], 1.0, norm_type=norm_type)
    host = [g.copy() for g in grads]
    clip_grad_norm_(host, 1.0, norm_type=norm_type)
    dev = [cupy.asarray(g) for g in grads]
    norm = clip_grad_norm_(dev, 1.0, norm_type=norm_type)
    assert isinstance(norm, float) and norm == pytest.approx(expected, rel=1e-12)
    for d, h in zip(dev, host):
        np.testing.assert_allclose(d.get(), h, rtol=1e-6)

    def sharded():  # each rank holds a disjoint piece: the norm is all-reduced on the device (NCCL)
        rank, n = meshkit.get_rank(), meshkit.get_world_size()
        mine = [cupy.asarray(np.array_split(g.reshape(-1), n)[rank]) for g in grads]
        return clip_grad_norm_(mine, 1.0, norm_type=norm_type, group=meshkit.new_group())
    assert on_nccl(sharded, 3) == [pytest.approx(expected, rel=1e-12)] * 3


def test_clip_grad_norm_nan_on_device(cupy):
    g = cupy.asarray(np.array([1.0, np.nan]))
    assert np.isnan(clip_grad_norm_([g, cupy.asarray(np.ones(2))], 1.0))
    assert np.isnan(g.get()).all(), "a nan norm makes the gradients nan, as torch"


# --------------------------------------------------------------------------- state dicts and memory
def test_state_dicts_on_device_and_the_documented_host_conversion(cupy):
    """A device ZeRO-2 run saved at 4 ranks resumes at 2 from its full state dict, NumPy arrays on
    the host (full_state_dict() is NumPy whatever the model's library), and from a
    device copy of it (the one documented conversion: a load takes either library)."""
    steps = ddp_cases.STEPS
    ref = cases.reference("adamw", "mixed")
    saved = on_nccl(cases.train_zero, 4, 2, "adamw", steps=range(2), xp=cupy)[0][0]
    assert on_host(saved) and saved["optim"]["state"]["w1"]["exp_avg"].shape == (6, 5)  # w1's shape (issue 37.2)

    def resume(where):
        state = mine(saved) if where == "device" else saved  # each rank's device copy on its own GPU
        return cases.train_zero(2, "adamw", steps=range(2, steps), state=state, xp=cupy)

    def mine(tree):
        return {k: mine(v) for k, v in tree.items()} if isinstance(tree, dict) else (
            cupy.asarray(tree) if isinstance(tree, np.ndarray) else tree)

    for where in ("device", "host"):
        for sd, _ in on_nccl(resume, 2, where):
            assert on_host(sd)
            cases.assert_matches(sd["model"], ref, "resumed")


def _memory(xp):
    rng = np.random.default_rng(0)
    params = {"a": xp.asarray(rng.standard_normal(300)), "b": xp.asarray(rng.standard_normal(101))}
    zero = ZeroRedundancyOptimizer(params, AdamW(), stage=2, bucket_cap_mb=1e-3, first_bucket_cap_mb=1e-3)
    zero.sync_gradients()
    zero.step()
    return zero.memory_report()


def test_memory_report_of_a_device_model_equals_the_host_one(cupy):
    assert on_nccl(_memory, 3, cupy) == local.run(_memory, 3, np)


# --------------------------------------------------------------------------- mixing libraries
def test_mixing_numpy_and_cupy_arrays_is_a_type_error_naming_both(cupy):
    host_p, dev_p = np.ones(3), cupy.asarray(np.ones(3))
    both = r"numpy\.ndarray.*cupy\.ndarray|cupy\.ndarray.*numpy\.ndarray"
    with pytest.raises(TypeError, match=r"SGD\.step: grad of parameter 'w' is a numpy\.ndarray but the parameter "
                                        r"is a cupy\.ndarray"):
        SGD(lr=0.1).step({"w": dev_p}, {"w": host_p})
    with pytest.raises(TypeError, match=r"clip_grad_norm_: grads\[1\] is a numpy\.ndarray but grads\[0\] is a "
                                        r"cupy\.ndarray"):
        clip_grad_norm_([dev_p, host_p], 1.0)

    def body():
        with pytest.raises(TypeError, match=r"params\['a'\] is a cupy\.ndarray but params\['b'\] is a "
                                            r"numpy\.ndarray"):
            DistributedDataParallel({"a": cupy.ones(3), "b": np.ones(3)})
        ddp = DistributedDataParallel({"a": cupy.ones(3)})
        with pytest.raises(TypeError, match=r"mark_grad_ready: gradient 'a' is a numpy\.ndarray but the "
                                            r"parameters are cupy\.ndarray;"):
            ddp.mark_grad_ready("a", np.ones(3))
        zero = ZeroRedundancyOptimizer({"a": cupy.ones(3)}, SGD(lr=0.1), stage=2)
        with pytest.raises(TypeError, match=both):
            zero.grads["a"] = np.ones(3)
        mesh = meshkit.init_device_mesh("cuda", (meshkit.get_world_size(),))
        fsdp = FullyShardedDataParallel({"a": cupy.ones(3)}, mesh=mesh, optimizer=SGD(lr=0.1))
        with pytest.raises(TypeError, match=r"reduce_grads: gradient 'a' is a numpy\.ndarray but the parameter "
                                            r"shards are cupy\.ndarray;"):
            fsdp.reduce_grads(0, {"a": np.ones(3)})
        return True
    assert on_nccl(body, 2) == [True, True]


# --------------------------------------------------------------------------- the fake is strict
def _implicit_to_host(value):
    """full_state_dict's host copy as a careless port would write it: np.asarray of a device array
    (CuPy refuses it; a forgiving fake would copy silently)."""
    return np.asarray(value)


def test_a_silent_device_to_host_copy_fails_under_the_fake(cupy, monkeypatch):
    # the path full_state_dict() takes to the host (it went through FlatLayout.split until that
    # copy was folded into full_array; the patch must sit on the path, or this test proves nothing)
    monkeypatch.setattr(full_state, "to_host", _implicit_to_host)
    with pytest.raises(TypeError, match=r"Implicit conversion to a NumPy array is not allowed"):
        on_nccl(cases.train_zero, 2, 1, "sgd", steps=range(1), xp=cupy)


class _CpuTensor:
    """Like torch's CPU tensors: the class has ``__cuda_array_interface__``, reading it raises."""

    @property
    def __cuda_array_interface__(self):
        raise AttributeError("Can't get __cuda_array_interface__ on non-CUDA tensor")


def test_one_rule_decides_device_and_library_in_every_layer(cupy):
    """comm's engines and checks, the CUDA runtime, parallel and tensor ask one rule
    (``__cuda_array_interface__`` on the array): the double's DeviceArray, an np.ndarray subclass,
    is a device array, hence CuPy's, to all of them; torch-like CPU tensors are host arrays."""
    from meshkit.comm import checks
    from meshkit.comm.engines import cuda_runtime
    from meshkit.comm._seams import array_namespace, is_device_array
    from meshkit.parallel import array_namespace as parallel_namespace
    from meshkit.tensor import reductions

    assert parallel_namespace is array_namespace and reductions.array_namespace is array_namespace
    assert cuda_runtime.is_device_array is is_device_array
    cases = {"numpy": (np.ones(2), False), "fake cupy": (cupy.ones(2), True),
             "double": (double.to_device(np.ones(2)), True), "cpu tensor": (_CpuTensor(), False), "None": (None, False)}
    for name, (x, device) in cases.items():
        assert is_device_array(x) is device, name
        assert array_namespace(x) is (cupy if device else np), name
        assert cuda_runtime.runtime().is_device_array(x) is device, name
    assert checks._where_is(double.to_device(np.ones(2))) == "doubles.nccl_double.DeviceArray (device)"


def test_the_fake_refuses_host_arrays_as_cupy_does(cupy):
    x = cupy.asarray(np.arange(4.0))
    assert not isinstance(x, np.ndarray) and type(x).__module__ == "cupy" and x.data.ptr
    assert x.__cuda_array_interface__["data"][0] == x.data.ptr
    with pytest.raises(TypeError, match=re.escape(fake_cupy.IMPLICIT)):
        np.asarray(x)
    for bad in (lambda: x + np.ones(4), lambda: cupy.add(x, np.ones(4)), lambda: cupy.concatenate([x, np.ones(4)]),
                lambda: x.__setitem__(slice(None), np.ones(4)), lambda: np.add(x, np.ones(4))):
        with pytest.raises(TypeError, match=r"Unsupported type <class 'numpy\.ndarray'>"):
            bad()
    y = cupy.empty(4)
    assert cupy.sqrt(x, out=y) is y and isinstance(x.sum(), fake_cupy.ndarray) and float(x.sum()) == 6.0
    np.testing.assert_array_equal(y.get(), np.sqrt(np.arange(4.0)))
