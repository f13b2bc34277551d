"""One training loop, written once against the strategy protocol, trains every strategy (issue 25.1).

:func:`train` uses only the protocol (``unshard``, ``prefetch``, ``mark_grad_ready``, ``no_sync``,
``zero_grad``, ``step``, ``units``, ``full_state_dict``) and must give the single-process result
(float64, 1e-10) for DDP, ZeRO-1/2 and FSDP at every world size and HSDP on a 2x2 mesh, with SGD
momentum and AdamW, gradient accumulation under ``no_sync()`` and several units. The old spellings
still work, warn, and give the same numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import re
import typing
import warnings
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np
import pytest

import meshkit
from meshkit.checkpoint import get_state_dict, load, save, set_state_dict
from meshkit.comm import local
from meshkit.parallel import (SGD, AdamW, Composite, DistributedDataParallel, ExpertStrategy, FullyShardedDataParallel,
                              LocalStrategy, Optimizer, Strategy, ZeroRedundancyOptimizer, data_parallel)
from meshkit.parallel import strategy as strategy_module
from meshkit.parallel.data_parallelism import ddp as ddp_module, fsdp as fsdp_module, zero as zero_module
from meshkit.parallel.strategy import PROTOCOL_METHODS
from meshkit.state import ShardedArray

FEATURES, HIDDEN, OUT = 5, 7, 3
LAYERS = 3
BATCH, MICRO, STEPS = 24, 2, 3  # the global batch splits into MICRO micro-batches over 1..4 ranks
UNITS = [[f"w{i}", f"b{i}"] for i in range(LAYERS)]  # one unit per layer


def init_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    sizes = (FEATURES, HIDDEN, HIDDEN, OUT)
    params = {}
    for i in range(LAYERS):
        params[f"w{i}"] = rng.standard_normal((sizes[i], sizes[i + 1])) / np.sqrt(sizes[i])
        params[f"b{i}"] = rng.standard_normal(sizes[i + 1]) * 0.1
    return params


def make_optimizer(name: str) -> Optimizer:
    return SGD(lr=0.1, momentum=0.9) if name == "sgd" else AdamW(lr=0.01, weight_decay=0.01)


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((BATCH, FEATURES)), rng.standard_normal((BATCH, OUT))


def local_batch(step: int, micro: int, rank: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's share of micro-batch ``micro`` of the global batch of ``step``."""
    x, y = batch(step)
    size = BATCH // (MICRO * world)
    lo = micro * (BATCH // MICRO) + rank * size
    return x[lo:lo + size], y[lo:lo + size]


def train(make: Callable[[dict[str, np.ndarray]], Any], steps: int = STEPS, clip: float | None = None,
          prefetch_across_step: bool = False) -> dict[str, Any]:
    """The loop, written once: only protocol methods. Loss 0.5 * mean squared error. With
    ``clip``, ``clip_grad_norm_(clip)`` between the backward pass and ``step()``, as torch's loops.
    With ``prefetch_across_step``, the next forward's first unit is prefetched before ``step()``."""
    rank, world = meshkit.get_rank(), meshkit.get_world_size()
    model = make(init_params())
    unit_of = {name: u for u, names in enumerate(model.units) for name in names}
    for step in range(steps):
        model.zero_grad()
        for micro in range(MICRO):
            with model.no_sync() if micro < MICRO - 1 else contextlib.nullcontext():
                x, y = local_batch(step, micro, rank, world)
                acts = [x]
                for i in range(LAYERS):
                    if i + 1 < LAYERS:
                        model.prefetch(unit_of[f"w{i + 1}"])
                    with model.unshard(unit_of[f"w{i}"]) as p:
                        z = acts[-1] @ p[f"w{i}"] + p[f"b{i}"]
                    acts.append(np.tanh(z) if i < LAYERS - 1 else z)
                delta = (acts[-1] - y) / (len(y) * MICRO)  # each micro-batch's mean, a 1/MICRO share
                for i in reversed(range(LAYERS)):
                    with model.unshard(unit_of[f"w{i}"]) as p:
                        dw, db = acts[i].T @ delta, delta.sum(axis=0)
                        if i:
                            delta = (delta @ p[f"w{i}"].T) * (1 - acts[i] ** 2)
                    model.mark_grad_ready(f"w{i}", dw)
                    model.mark_grad_ready(f"b{i}", db)
        if clip is not None:
            model.clip_grad_norm_(clip)
        if prefetch_across_step:
            model.prefetch(unit_of["w0"])
        model.step()
    return model.full_state_dict()


def reference(opt_name: str, clip: float | None = None) -> tuple[dict[str, np.ndarray], Optimizer]:
    """One process, the whole global batch per step, no strategy (clipped by the global norm)."""
    params, opt = init_params(), make_optimizer(opt_name)
    for step in range(STEPS):
        x, y = batch(step)
        acts = [x]
        for i in range(LAYERS):
            z = acts[-1] @ params[f"w{i}"] + params[f"b{i}"]
            acts.append(np.tanh(z) if i < LAYERS - 1 else z)
        delta, grads = (acts[-1] - y) / BATCH, {}
        for i in reversed(range(LAYERS)):
            grads[f"w{i}"], grads[f"b{i}"] = acts[i].T @ delta, delta.sum(axis=0)
            delta = (delta @ params[f"w{i}"].T) * (1 - acts[i] ** 2)
        if clip is not None:
            norm = np.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
            scale = min(clip / (norm + 1e-6), 1.0)
            grads = {name: g * scale for name, g in grads.items()}
        opt.step(params, grads)
    return params, opt


def assert_matches(sd: dict[str, Any], ref: tuple[dict[str, np.ndarray], Optimizer]) -> None:
    params, opt = ref
    assert sorted(sd["model"]) == sorted(params)
    for name, expected in params.items():
        np.testing.assert_allclose(sd["model"][name], expected, rtol=1e-10, atol=1e-10, err_msg=name)
    state = sd["optim"]["state"]
    for name, st in opt.state.items():
        assert sorted(state[name]) == sorted(st), name
        for key, expected in st.items():
            np.testing.assert_allclose(state[name][key], expected.reshape(state[name][key].shape), rtol=1e-10, atol=1e-10,
                                       err_msg=f"{name}.{key}")
        assert sd["optim"]["step"][name] == STEPS


def factory(strategy: str, opt_name: str, units: Any = UNITS, **options: Any) -> Callable[[dict], Any]:
    def make(params: dict[str, np.ndarray]) -> Any:
        world = meshkit.get_world_size()
        if strategy == "hsdp":
            mesh = meshkit.init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = meshkit.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        return data_parallel(params, mesh, strategy, optimizer=make_optimizer(opt_name), units=units, **options)
    return make


REFERENCES = {name: reference(name) for name in ("sgd", "adamw")}


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_one_loop_trains_every_strategy_to_the_single_process_result(strategy, world, opt_name):
    # tiny bucket caps: several buckets, so reductions start during the backward pass
    options = {} if strategy == "fsdp" else {"bucket_cap_mb": 1e-4, "first_bucket_cap_mb": 1e-4}
    for sd in local.run(train, world, factory(strategy, opt_name, **options)):
        assert_matches(sd, REFERENCES[opt_name])


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_one_loop_trains_hsdp_on_a_2x2_mesh(opt_name):
    for sd in local.run(train, 4, factory("hsdp", opt_name)):
        assert_matches(sd, REFERENCES[opt_name])


@pytest.mark.parametrize("strategy, world", [("fsdp", 2), ("fsdp", 3), ("hsdp", 4), ("zero2", 2)])
def test_a_unit_prefetched_before_step_is_gathered_again_from_the_updated_shards(strategy, world):
    # the gather started before step() read the old shards: using it would train on stale parameters
    for sd in local.run(train, world, factory(strategy, "adamw"), prefetch_across_step=True):
        assert_matches(sd, REFERENCES["adamw"])


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp"])
def test_default_units_are_one_unit_of_everything(strategy):
    def run() -> dict[str, Any]:
        make = factory(strategy, "adamw", units=None)
        assert make(init_params()).units == [list(init_params())]
        return train(make)

    for sd in local.run(run, 2):
        assert_matches(sd, REFERENCES["adamw"])


def test_one_loop_under_meshkit_run(mpirun):
    out = mpirun("mpi_strategy_protocol.py", 3).stdout
    assert out.count("protocol OK") == 3, out


def test_unshard_yields_the_parameters_themselves_where_nothing_is_gathered():
    def run() -> None:
        mesh = meshkit.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        for strategy in ("ddp", "zero1", "zero2"):
            model = data_parallel(init_params(), mesh, strategy, optimizer=SGD(lr=0.1), units=UNITS)
            model.prefetch(2)
            with model.unshard(1) as p:
                assert list(p) == ["w1", "b1"]
                assert all(p[n] is model.params[n] for n in p)
            with pytest.raises(ValueError, match=r"unshard: unknown unit 3; valid units are 0..2"):
                with model.unshard(3):
                    pass
            report = model.memory_report()
            assert report["optimizer_state"] == 0 and report["params"] > 0

    local.run(run, 2)


def test_fsdp_params_are_this_ranks_pieces_of_each_parameter():
    def run() -> dict[str, np.ndarray]:
        mesh = meshkit.init_device_mesh("cpu", (3,), mesh_dim_names=("dp",))
        fsdp = data_parallel(init_params(), mesh, "fsdp", optimizer=SGD(lr=0.1), units=UNITS)
        every: list[Any] = [None] * 3
        meshkit.all_gather_object(every, {n: p.copy() for n, p in fsdp.params.items()})
        return {n: np.concatenate([pieces[n] for pieces in every]) for n in init_params()}

    for joined in local.run(run, 3):
        for name, p in init_params().items():
            np.testing.assert_array_equal(joined[name], p.reshape(-1), err_msg=name)


def test_data_parallel_names_a_bad_strategy_or_option():
    def run() -> None:
        mesh = meshkit.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with pytest.raises(ValueError, match=r"data_parallel: unknown strategy 'zero3'; valid strategies are "
                                             r"ddp, zero1, zero2, fsdp, hsdp"):
            data_parallel(init_params(), mesh, "zero3", optimizer=SGD(lr=0.1))
        with pytest.raises(TypeError, match=r"data_parallel: strategy 'fsdp' takes no option\(s\) \['bucket_cap_mb'\]; "
                                            r"its options are reshard_after_forward, param_dtype, reduce_dtype"):
            data_parallel(init_params(), mesh, "fsdp", optimizer=SGD(lr=0.1), bucket_cap_mb=1)
        with pytest.raises(TypeError, match=r"strategy 'zero1' takes no option\(s\) \['comm_hook'\]; its options are "
                                            r"bucket_cap_mb, first_bucket_cap_mb, find_unused_parameters"):
            data_parallel(init_params(), mesh, "zero1", optimizer=SGD(lr=0.1), comm_hook=None)
        with pytest.raises(ValueError, match=r"strategy 'hsdp' needs a 2-D DeviceMesh \(replicate, shard\), got a 1-D "
                                             r"mesh with dims \('dp',\)"):
            data_parallel(init_params(), mesh, "hsdp", optimizer=SGD(lr=0.1))
        with pytest.raises(ValueError, match=r"units must put every parameter in exactly one non-empty unit; "
                                             r"unknown names \['nope'\]"):
            data_parallel(init_params(), mesh, "ddp", optimizer=SGD(lr=0.1), units=UNITS + [["nope"]])

    local.run(run, 2)


def test_protocol_misuse_raises_naming_what_to_do():
    def run() -> None:
        mesh = meshkit.init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        fsdp = data_parallel(init_params(), mesh, "fsdp", optimizer=SGD(lr=0.1), units=UNITS)
        g = {name: np.ones_like(p) for name, p in init_params().items()}
        fsdp.mark_grad_ready("w0", g["w0"])
        with pytest.raises(ValueError, match=r"mark_grad_ready: gradient 'w0' was already marked ready"):
            fsdp.mark_grad_ready("w0", g["w0"])
        with pytest.raises(ValueError, match=r"mark_grad_ready: unknown parameter 'x'; valid names are"):
            fsdp.mark_grad_ready("x", g["w0"])
        with pytest.raises(ValueError, match=r"gradient 'b0' has shape \(3,\) and dtype float64; expected the parameter's shape \(7,\)"):
            fsdp.mark_grad_ready("b0", np.ones(3))
        with pytest.raises(TypeError, match=r"gradient 'b0' is None; FullyShardedDataParallel keeps no gradient"):
            fsdp.mark_grad_ready("b0", None)
        with pytest.raises(ValueError, match=r"step: units \[0\] are partly marked: gradients \{0: \['b0'\]\}"):
            fsdp.step()
        fsdp.mark_grad_ready("b0", g["b0"])
        with fsdp.no_sync():
            fsdp.mark_grad_ready("w1", g["w1"])
        with pytest.raises(ValueError, match=r"step: gradients \['w1'\] were accumulated under no_sync\(\) but never "
                                             r"synchronized"):
            fsdp.step()
        fsdp.zero_grad()
        fsdp.step()

        with pytest.warns(DeprecationWarning, match="optimizer="):
            ddp = DistributedDataParallel(init_params(), mesh=mesh)
        ddp.mark_grad_ready("w0", g["w0"])
        with pytest.raises(ValueError, match=r"DistributedDataParallel.step: no optimizer; pass optimizer="):
            ddp.step()
        ddp = data_parallel(init_params(), mesh, "ddp", optimizer=SGD(lr=0.1))
        with pytest.raises(ValueError, match=r"step: no synchronized gradient pass since zero_grad\(\)"):
            ddp.step()
        with ddp.no_sync():
            ddp.mark_grad_ready("w0", g["w0"])
        with pytest.raises(ValueError, match=r"step: gradients \['w0'\] were accumulated under no_sync\(\) but never "
                                             r"synchronized"):
            ddp.step()

    local.run(run, 1)  # one thread: pytest.warns' filters are the process's


def test_checkpoint_takes_the_strategy_alone():
    """get_state_dict / set_state_dict of any strategy: the optimizer is the strategy's."""
    def run() -> None:
        for strategy in ("ddp", "zero2", "fsdp"):
            make = factory(strategy, "adamw")
            model = make(init_params())
            g = {name: np.full_like(p, 0.1) for name, p in init_params().items()}
            for name in reversed(list(g)):
                model.mark_grad_ready(name, g[name])
            model.step()
            msd, osd = get_state_dict(model)
            assert sorted(osd["state"]) == sorted(g) and all(int(s) == 1 for s in osd["step"].values())
            saved = model.full_state_dict()
            copies = ({k: _copy(v) for k, v in msd.items()},
                      {"state": {k: {kk: _copy(vv) for kk, vv in st.items()} for k, st in osd["state"].items()},
                       "step": {k: int(v) for k, v in osd["step"].items()}})
            for name in reversed(list(g)):
                model.mark_grad_ready(name, g[name])
            model.step()
            set_state_dict(model, model_state_dict=copies[0], optim_state_dict=copies[1])
            back = model.full_state_dict()
            for name in g:
                np.testing.assert_array_equal(back["model"][name], saved["model"][name])
                for key, arr in saved["optim"]["state"][name].items():
                    np.testing.assert_array_equal(back["optim"]["state"][name][key], arr)
                assert back["optim"]["step"][name] == 1

    local.run(run, 2)


def _copy(value: Any) -> Any:
    """A checkpoint's copy of a state-dict entry (an array, or a list of ShardedArray boxes)."""
    if isinstance(value, list):
        return [dataclasses.replace(box, local=box.local.copy()) for box in value]
    return value.copy()


# --------------------------------------------------------------------------- today's spellings
def train_old(strategy: str, opt_name: str) -> dict[str, np.ndarray]:
    """The same training written against the API as it was before the protocol."""
    rank, world = meshkit.get_rank(), meshkit.get_world_size()
    opt = make_optimizer(opt_name)
    if strategy == "ddp":
        model = DistributedDataParallel(init_params())                      # mesh=None: the world; no optimizer
    elif strategy == "fsdp":
        mesh = meshkit.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        model = FullyShardedDataParallel(init_params(), mesh=mesh, optimizer=opt, units=UNITS)
    else:
        model = ZeroRedundancyOptimizer(init_params(), opt, stage=int(strategy[-1]))  # positional optimizer
    for step in range(STEPS):
        model.zero_grad()
        for micro in range(MICRO):
            last = micro == MICRO - 1
            with contextlib.nullcontext() if last or strategy == "fsdp" else model.no_sync():
                x, y = local_batch(step, micro, rank, world)
                if strategy == "fsdp":
                    params = {}
                    for i in range(LAYERS):
                        with model.unshard(i) as p:
                            params.update({k: v.copy() for k, v in p.items()})
                else:
                    params = model.params
                acts = [x]
                for i in range(LAYERS):
                    z = acts[-1] @ params[f"w{i}"] + params[f"b{i}"]
                    acts.append(np.tanh(z) if i < LAYERS - 1 else z)
                delta = (acts[-1] - y) / (len(y) * MICRO)
                for i in reversed(range(LAYERS)):
                    dw, db = acts[i].T @ delta, delta.sum(axis=0)
                    delta = (delta @ params[f"w{i}"].T) * (1 - acts[i] ** 2)
                    if strategy == "fsdp":
                        model.reduce_grads(i, {f"w{i}": dw, f"b{i}": db})  # reduced per micro-batch, added up
                    else:
                        model.grads[f"w{i}"][...] += dw                        # write into the view, then mark
                        model.mark_grad_ready(f"w{i}")
                        model.mark_grad_ready(f"b{i}", db)
            if last and strategy != "fsdp":
                model.finish_gradient_sync()
        if strategy == "ddp":
            opt.step(model.params, model.grads)
        else:
            model.step()
    if strategy == "ddp":
        get_state_dict(model, opt)                                           # the optimizer passed alongside
        return {name: p.copy() for name, p in model.params.items()}
    return model.full_state_dict()["model"]


OLD_SPELLINGS = {
    "ddp": ["DistributedDataParallel without mesh=", "DistributedDataParallel without optimizer=",
            r"mark_grad_ready\(name\) after writing into grads\[name\]", r"finish_gradient_sync\(\)",
            r"meshkit.checkpoint.get_state_dict\(strategy, optimizers\)"],
    "zero1": [r"ZeroRedundancyOptimizer\(params, optimizer\) is deprecated; pass optimizer= by keyword",
              "ZeroRedundancyOptimizer without mesh=", r"mark_grad_ready\(name\) after writing",
              r"finish_gradient_sync\(\) is deprecated; step\(\) finishes the gradient sync"],
    "zero2": [r"ZeroRedundancyOptimizer\(params, optimizer\)", r"finish_gradient_sync\(\)"],
    "fsdp": [r"FullyShardedDataParallel.reduce_grads\(unit, grads\) is deprecated; call mark_grad_ready\(name, grad\)"],
}


@pytest.mark.parametrize("strategy", list(OLD_SPELLINGS))
def test_old_spellings_warn_and_give_the_same_numbers(strategy):
    with warnings.catch_warnings(record=True) as seen:  # the ranks' threads warn into the process's filters
        warnings.simplefilter("always")
        results = local.run(train_old, 2, strategy, "sgd")
    messages = [str(w.message) for w in seen if issubclass(w.category, DeprecationWarning)]
    for pattern in OLD_SPELLINGS[strategy]:
        assert any(re.search(pattern, m) for m in messages), (pattern, sorted(set(messages)))
    params, _ = REFERENCES["sgd"]
    for got in results:
        for name, expected in params.items():
            np.testing.assert_allclose(got[name], expected, rtol=1e-10, atol=1e-10, err_msg=name)


def test_get_state_dict_of_a_strategy_with_its_own_optimizer_passed_again_warns():
    def run() -> None:
        mesh = meshkit.init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        zero = data_parallel(init_params(), mesh, "zero1", optimizer=SGD(lr=0.1, momentum=0.9))
        with pytest.warns(DeprecationWarning, match=r"call get_state_dict\(strategy\): the optimizer is the strategy's"):
            _, osd = get_state_dict(zero, zero.optimizer)
        assert sorted(osd["state"]) == sorted(init_params())

    local.run(run, 1)


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_clipping_between_the_backward_pass_and_step_finishes_the_sync(strategy, world):
    """clip_grad_norm_() is, with step(), a collective call that ends the backward pass: it finishes
    the sync (reading the gradients does not, issue 23.4) and clips by the single-process norm. The
    bound is below the gradients' norm, so every step clips."""
    options = {} if strategy == "fsdp" else {"bucket_cap_mb": 1e-4, "first_bucket_cap_mb": 1e-4}
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the protocol alone: no old spelling
        for sd in local.run(train, world, factory(strategy, "adamw", **options), STEPS, 0.05):
            assert_matches(sd, reference("adamw", clip=0.05))


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp", "hsdp"])
def test_full_state_dict_is_model_and_optim_and_the_old_keys_still_read_and_load_for_a_release(strategy):
    """Issue 37.2: ``{"model": ..., "optim": ...}`` of NumPy arrays, state_dict()'s shape (the CuPy
    half is in tests/test_cupy_parallel.py); code reading the old keys ``["params"]`` and
    ``["optimizer"]`` keeps working one release, warning and naming the new key, and a dict saved
    in either old shape still loads into every strategy, DDP included (warning too)."""
    def run() -> tuple[Any, Any]:
        model = factory(strategy, "adamw")(init_params())
        for name in reversed(list(init_params())):
            model.mark_grad_ready(name, np.full_like(init_params()[name], 0.1))
        model.step()
        sd, again = model.full_state_dict(), model.full_state_dict()
        for arr in (sd["model"]["w0"], sd["optim"]["state"]["w0"]["exp_avg"]):
            arr += 1.0  # copies: the strategy's own arrays (DDP's parameters and state) do not change
        now = model.full_state_dict()
        np.testing.assert_array_equal(now["model"]["w0"], again["model"]["w0"])
        np.testing.assert_array_equal(now["optim"]["state"]["w0"]["exp_avg"], again["optim"]["state"]["w0"]["exp_avg"])
        model.load_full_state_dict({"params": sd["model"], "optimizer": sd["optim"]})  # as 0.1 wrote it
        flat = {**sd["optim"], "state": {n: {k: a.reshape(-1) for k, a in st.items()} for n, st in sd["optim"]["state"].items()}}
        model.load_full_state_dict({"params": sd["model"], "optim": flat})  # as 0.2 wrote it (1-D state)
        return sd, model.full_state_dict()

    with warnings.catch_warnings(record=True) as seen:  # the ranks' threads warn into the process's filters
        warnings.simplefilter("always")
        results = local.run(run, 4 if strategy == "hsdp" else 2)
    messages = [str(w.message) for w in seen if issubclass(w.category, DeprecationWarning)]
    loads = [m for m in messages if re.search(r'a full state dict with the key "(optimizer|params)" is deprecated; '
                                              r'name it "(optim|model)"', m)]
    assert len(loads) == 3 * len(results) and len(messages) == len(loads), messages
    for sd, after in results:
        assert type(sd).__name__ == "FullStateDict" and sorted(sd) == ["model", "optim"]
        assert sorted(sd["optim"]) == ["hyper", "state", "step"]
        assert all(type(a) is np.ndarray for a in sd["model"].values())
        assert all(type(a) is np.ndarray for st in sd["optim"]["state"].values() for a in st.values())
        assert all(a.shape == sd["model"][n].shape for n, st in sd["optim"]["state"].items() for a in st.values())
        assert sd["optim"]["step"]["w0"] == 1
        for old, new in (("optimizer", "optim"), ("params", "model")):
            with pytest.warns(DeprecationWarning, match=rf'full_state_dict\(\)\["{old}"\] is deprecated; read '
                                                        rf'full_state_dict\(\)\["{new}"\]'):
                assert sd[old] is sd[new]
            with pytest.warns(DeprecationWarning, match=rf'"{new}"'):
                assert sd.get(old) is sd[new]
        for name, p in sd["model"].items():  # the old forms loaded what was saved (the += 1 above included)
            np.testing.assert_array_equal(after["model"][name], p)
            for key, arr in sd["optim"]["state"][name].items():
                np.testing.assert_array_equal(after["optim"]["state"][name][key], arr)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fsdp_without_a_mesh_is_over_the_world_as_ddp_and_zero(world):
    """Issue 25.1: every strategy takes ``mesh=None`` meaning the world (1-D), FSDP too, with the
    same DeprecationWarning as DDP and ZeRO; the protocol's loop then trains it to the
    single-process result."""
    def make(params: dict[str, np.ndarray]) -> Any:
        model = FullyShardedDataParallel(params, optimizer=make_optimizer("adamw"), units=UNITS)
        assert model.mesh.mesh.tolist() == list(range(world)) and model.mesh.mesh_dim_names == ("dp",)
        return model

    with warnings.catch_warnings(record=True) as seen:  # the ranks' threads warn into the process's filters
        warnings.simplefilter("always")
        results = local.run(train, world, make)
    messages = {str(w.message) for w in seen if issubclass(w.category, DeprecationWarning)}
    assert messages == {"meshkit.parallel: FullyShardedDataParallel without mesh= (meaning the world) is deprecated; "
                        "pass mesh= (a 1-D DeviceMesh)"}, messages
    for sd in results:
        assert_matches(sd, REFERENCES["adamw"])


# ---------------------------------------------------------------------------- issue 37: one Strategy type
def _signature(fn: Any) -> list[tuple[str, Any, Any]]:
    """A method's parameters (name, kind, default), annotations aside (a subclass may narrow them)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _every_strategy() -> dict[str, Any]:
    """One of every strategy of the library, over this rank's world of 4 (collective)."""
    world = meshkit.get_world_size()
    dp = meshkit.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    hsdp = meshkit.init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    p = init_params()
    built = {kind: data_parallel(init_params(), dp, kind, optimizer=make_optimizer("adamw"), units=UNITS)
             for kind in ("ddp", "zero1", "zero2", "fsdp")}
    built["hsdp"] = data_parallel(init_params(), hsdp, "hsdp", optimizer=make_optimizer("adamw"), units=UNITS)
    built["local"] = LocalStrategy(init_params(), optimizer=make_optimizer("sgd"), units=UNITS)
    boxes = {"w0": ShardedArray(p["w0"][:, :4].copy(), p["w0"].shape, (0, 0))}  # one block of w0 on every rank
    built["expert"] = ExpertStrategy(boxes, optimizer=make_optimizer("sgd"), group=dp.get_group())
    dense = {n: v for n, v in init_params().items() if n != "w0"}
    built["composite"] = Composite([data_parallel(dense, dp, "fsdp", optimizer=make_optimizer("sgd")),
                                    built["expert"]])
    return built


def test_every_strategy_is_a_strategy_with_the_protocols_signatures():
    """Issue 37.1: ``Strategy`` is a runtime-checkable Protocol, and every strategy of the library
    (DDP, ZeRO-1/2, FSDP, HSDP, the single-process LocalStrategy, the ExpertStrategy, a Composite)
    implements every one of its methods with its signature; data_parallel is declared to return it."""
    declared = {n for n in vars(Strategy) if not n.startswith("_")} | set(Strategy.__annotations__)
    assert declared == set(PROTOCOL_METHODS) | {"units", "params"}, declared
    assert typing.get_type_hints(data_parallel)["return"] is Strategy

    def run() -> dict[str, Any]:
        found = {}
        for name, s in _every_strategy().items():
            wrong = [m for m in PROTOCOL_METHODS if _signature(getattr(type(s), m)) != _signature(getattr(Strategy, m))]
            found[name] = (isinstance(s, Strategy), wrong, isinstance(s.units, list), isinstance(s.params, Mapping))
        return found

    for found in local.run(run, 4):
        assert found == {name: (True, [], True, True) for name in found} and len(found) == 8, found

    class Partial:  # the check can fail: a strategy without load_full_state_dict (DDP's case before issue 37)
        units, params = [], {}
        zero_grad = prefetch = unshard = mark_grad_ready = no_sync = step = state_dict = lambda self, *a: None
        load_state_dict = full_state_dict = memory_report = lambda self, *a: None
    assert not isinstance(Partial(), Strategy)


def test_the_librarys_reference_and_a_composite_train_by_the_one_loop():
    """Issue 37.1: the single-process reference is the library's (LocalStrategy, a world of one), and
    a Composite of FSDP (layer 0) and DDP (layers 1, 2) trains by the same loop to the same result."""
    assert_matches(local.run(lambda: train(lambda p: LocalStrategy(p, optimizer=make_optimizer("adamw"),
                                                                   units=UNITS)), 1)[0], REFERENCES["adamw"])

    def composite(p: dict[str, np.ndarray]) -> Composite:
        mesh = meshkit.init_device_mesh("cpu", (meshkit.get_world_size(),), mesh_dim_names=("dp",))
        first = {n: p[n] for n in UNITS[0]}
        rest = {n: v for n, v in p.items() if n not in first}
        return Composite([data_parallel(first, mesh, "fsdp", optimizer=make_optimizer("adamw")),
                          data_parallel(rest, mesh, "ddp", optimizer=make_optimizer("adamw"), units=UNITS[1:])])
    for sd in local.run(lambda: train(composite), 3):
        assert_matches(sd, REFERENCES["adamw"])


def test_first_step_is_fired_by_the_strategies_one_step_counter(monkeypatch):
    """Issue 37.4: FIRST_STEP is fired in one place, the Steps counter every strategy's step() advances."""
    fired = []
    monkeypatch.setattr(strategy_module, "milestone", fired.append)

    for kind in ("ddp", "zero1", "zero2", "fsdp"):
        local.run(lambda: train(factory(kind, "sgd"), steps=2), 2)
    local.run(lambda: train(lambda p: LocalStrategy(p, optimizer=make_optimizer("sgd"), units=UNITS), steps=2), 1)
    assert fired == [strategy_module.FIRST_STEP] * (4 * 2 * 2 + 2)  # every step of every rank says it (the
    # milestone itself fires once per process)
    assert "FIRST_STEP" not in "".join(inspect.getsource(m) for m in (ddp_module, zero_module, fsdp_module))


@pytest.mark.parametrize("kind, world", [("fsdp", 3), ("zero2", 2), ("hsdp", 4), ("ddp", 2)])
def test_a_full_checkpoint_loads_into_any_strategy_and_a_sharded_one_into_a_full_state_dict(tmp_path, kind, world):
    """Issue 37.2: one shape. A checkpoint of a full state dict (one process) loads into the views of
    any strategy's ``state_dict()`` at any world size, nothing gathered to make a destination (it is
    ``state_dict()``, views); the strategy's sharded checkpoint then loads into a full state dict
    (a LocalStrategy's, one process) and equals the strategy's own ``full_state_dict()``."""
    full_dir, sharded_dir = tmp_path / "full", tmp_path / "sharded"

    def save_full() -> None:
        model = LocalStrategy(init_params(), optimizer=make_optimizer("adamw"), units=UNITS)
        model.load_full_state_dict(trained_full)
        save(model.full_state_dict(), checkpoint_id=full_dir)

    trained_full = local.run(lambda: train(factory("ddp", "adamw")), 1)[0]
    local.run(save_full, 1)

    def into_strategy() -> dict[str, Any]:
        model = factory(kind, "adamw")(init_params())
        sd = model.state_dict()
        load(sd, checkpoint_id=full_dir)
        model.load_state_dict(sd)
        save(model.state_dict(), checkpoint_id=sharded_dir)
        return model.full_state_dict()

    for got in local.run(into_strategy, world):
        assert_matches(got, REFERENCES["adamw"])

    def into_full() -> dict[str, Any]:
        model = LocalStrategy(init_params(), optimizer=make_optimizer("adamw"), units=UNITS)
        sd = model.state_dict()
        load(sd, checkpoint_id=sharded_dir)
        return model.full_state_dict()

    assert_matches(local.run(into_full, 1)[0], REFERENCES["adamw"])


def test_memory_reports_old_optimizer_argument_warns_and_still_counts():
    """Issue 37.1: DDP's ``memory_report(optimizer)`` (0.2) keeps working one release, warning;
    its signature is the protocol's."""
    def run() -> tuple[int, int]:
        mesh = meshkit.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        ddp = DistributedDataParallel(init_params(), mesh=mesh)
        opt = make_optimizer("adamw")
        opt.materialize("w0", init_params()["w0"].reshape(-1))
        old = ddp.memory_report(opt)["optimizer_state"]
        return old, ddp.memory_report()["optimizer_state"]
    # caught around the job: warnings.catch_warnings is process-wide, not per rank thread
    with pytest.warns(DeprecationWarning) as caught:
        assert local.run(run, 2) == [(2 * 35 * 8, 0)] * 2
    said = [str(w.message) for w in caught]
    assert any("without optimizer=" in m for m in said), said
    assert any(re.search(r"memory_report\(optimizer\) is deprecated", m) for m in said), said


def test_the_librarys_strategies_refuse_bad_input_naming_it():
    """LocalStrategy, Composite and ExpertStrategy check their arguments as the data-parallel ones do."""
    p = init_params()
    with pytest.raises(TypeError, match=r"LocalStrategy: optimizer must be a meshkit Optimizer \(SGD, AdamW\), got str"):
        LocalStrategy(p, optimizer="sgd")
    with pytest.raises(ValueError, match=r"LocalStrategy: units must put every parameter in exactly one"):
        LocalStrategy(p, optimizer=make_optimizer("sgd"), units=[["w0"]])
    model = LocalStrategy(p, optimizer=make_optimizer("sgd"))
    model.mark_grad_ready("w0", np.zeros_like(p["w0"]))
    with pytest.raises(ValueError, match=r"LocalStrategy.mark_grad_ready: gradient 'w0' was already marked ready"):
        model.mark_grad_ready("w0", np.zeros_like(p["w0"]))
    with pytest.raises(ValueError, match=r"gradient 'b0' has shape \(3,\) and dtype float64; expected the "
                                         r"parameter's shape \(7,\)"):
        model.mark_grad_ready("b0", np.zeros(3))
    with pytest.raises(ValueError, match=r"LocalStrategy.load_state_dict: state_dict must be \{'model'.*got \['params'\]"):
        model.load_state_dict({"params": {}})
    with pytest.raises(ValueError, match=r"LocalStrategy.load_full_state_dict: nothing was loaded; state_dict\['model'\]"
                                         r"\['w0'\] has shape \(2,\)"):
        model.load_full_state_dict({"model": {**p, "w0": np.zeros(2)}, "optim": {"state": {}, "step": {}}})
    with pytest.raises(TypeError, match=r"Composite: every part must be a meshkit.parallel.Strategy, got dict"):
        Composite([model, p])
    with pytest.raises(ValueError, match=r"Composite: parameter 'w0' is held by two parts \(LocalStrategy and "
                                         r"LocalStrategy\)"):
        Composite([model, LocalStrategy({"w0": p["w0"]}, optimizer=make_optimizer("sgd"))])
    with pytest.raises(ValueError, match=r"Composite.mark_grad_ready: unknown parameter 'w9'"):
        Composite([model]).mark_grad_ready("w9", p["w0"])

    def expert() -> None:
        group = meshkit.init_device_mesh("cpu", (1,), mesh_dim_names=("ep",)).get_group()
        with pytest.raises(TypeError, match=r"ExpertStrategy: boxes must map each name to a ShardedArray, got "
                                            r"\{'w0': 'ndarray'\}"):
            ExpertStrategy({"w0": p["w0"]}, optimizer=make_optimizer("sgd"), group=group)
    local.run(expert, 1)
