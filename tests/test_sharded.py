"""ZeRO-1/2, FSDP and HSDP reproduce single-process training; state dicts; memory; errors."""

from __future__ import annotations

import numpy as np
import pytest

import ddp_cases
import meshkit
import sharded_cases as cases
from meshkit.comm import local
from meshkit.parallel import (AdamW, DistributedDataParallel, FullyShardedDataParallel, SGD,
                              ZeroRedundancyOptimizer)

REFERENCE = {(kind, config): cases.reference(kind, config) for kind in ("adamw", "sgd") for config in cases.CONFIGS}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("config", list(cases.CONFIGS))
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("strategy", list(cases.STRATEGIES))
def test_strategy_reproduces_single_process_training_local(strategy, kind, config, world_size):
    results = local.run(cases.STRATEGIES[strategy], world_size, kind, config, timeout=60)
    for sd, norms in results:
        cases.assert_matches(sd["model"], REFERENCE[kind, config], f"{strategy}/{kind}/{config}/{world_size}")
        assert norms == results[0][1], "every rank computes the same global norm"
    if config == "clipped":
        assert max(results[0][1]) > cases.MAX_NORM, "clipping was exercised"


@pytest.mark.parametrize("config", list(cases.CONFIGS))
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_hybrid_sharding_on_a_2x2_mesh(kind, config):
    for sd, _ in local.run(cases.train_fsdp, 4, kind, config, (2, 2), timeout=60):
        cases.assert_matches(sd["model"], REFERENCE[kind, config], f"hsdp/{kind}/{config}")


def test_every_strategy_on_real_processes(mpirun):
    out = mpirun("mpi_sharded.py", 4, timeout=300).stdout
    assert out.count("SHARDED OK") == 4, out


@pytest.mark.parametrize("strategy", list(cases.STRATEGIES))
def test_state_dict_round_trip_from_4_to_2_ranks(strategy):
    steps = ddp_cases.STEPS
    first = local.run(cases.STRATEGIES[strategy], 4, "adamw", "mixed", steps=range(2), timeout=60)
    saved = first[0][0]
    assert set(saved["optim"]["state"]["w1"]) == {"exp_avg", "exp_avg_sq"}
    assert saved["optim"]["step"]["w1"] == 2
    resumed = local.run(cases.STRATEGIES[strategy], 2, "adamw", "mixed", steps=range(2, steps), state=saved,
                        timeout=60)
    for sd, _ in resumed:
        cases.assert_matches(sd["model"], REFERENCE["adamw", "mixed"], f"{strategy} resumed")


PSI = 2000  # float32 parameters: 4 * PSI bytes


def known_model():
    rng = np.random.default_rng(0)
    return {"a": rng.standard_normal((40, 25)).astype(np.float32), "b": rng.standard_normal(1000).astype(np.float32)}


def memory(strategy: str):
    params, opt = known_model(), AdamW(lr=1e-3)
    caps = {"bucket_cap_mb": 4000 / (1 << 20), "first_bucket_cap_mb": 4000 / (1 << 20)}
    if strategy == "ddp":
        model = DistributedDataParallel(params, **caps)
        model.sync_gradients()
        opt.step(model.params, model.grads)
        return model.memory_report(opt)
    if strategy.startswith("zero"):
        model = ZeroRedundancyOptimizer(params, opt, stage=int(strategy[-1]), **caps)
        model.sync_gradients()
        model.step()
        return model.memory_report()
    mesh = meshkit.init_device_mesh("cpu", (meshkit.get_world_size(),))
    model = FullyShardedDataParallel(params, mesh=mesh, optimizer=opt, units=[["a"], ["b"]])
    for u, name in enumerate(["a", "b"]):
        with model.unshard(u):
            during = model.memory_report()["comm_buffers"]
        model.reduce_grads(u, {name: np.zeros_like(params[name])})
    model.step()
    return {**model.memory_report(), "during_unshard": during}


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_memory_report_matches_the_zero_paper(n):
    padded = -(-PSI // n) * n  # every flat buffer is padded to a multiple of n
    shard = padded // n
    ddp, z1, z2, fsdp = (local.run(memory, n, s)[0] for s in ("ddp", "zero1", "zero2", "fsdp"))
    assert ddp == {"params": 4 * PSI, "grads": 4 * PSI, "optimizer_state": 8 * PSI, "comm_buffers": 0,
                   "peak_transient": 0}                                        # 16 Ψ
    assert z1 == {"params": 4 * padded, "grads": 4 * padded, "optimizer_state": 8 * shard, "comm_buffers": 0,
                  "peak_transient": 0}                                         # 8 Ψ + 8 Ψ / N
    assert (z2["params"], z2["grads"], z2["optimizer_state"]) == (4 * padded, 4 * shard, 8 * shard)  # 4Ψ + 12Ψ/N
    bucket = 4000  # bytes: each parameter has a bucket of its own
    assert bucket <= z2["comm_buffers"] <= 2 * bucket and z2["peak_transient"] <= 2 * bucket
    unit_a, unit_b = -(-1000 // n) * n, -(-1000 // n) * n                       # each unit padded alone
    assert (fsdp["params"], fsdp["grads"], fsdp["optimizer_state"]) == (
        4 * (unit_a + unit_b) // n, 4 * (unit_a + unit_b) // n, 8 * (unit_a + unit_b) // n)  # 16 Ψ / N
    assert fsdp["comm_buffers"] == 0 and fsdp["during_unshard"] == 4 * unit_a   # + one unit while unsharded
    assert fsdp["peak_transient"] == 4 * unit_a


def test_sharded_bad_input():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        params = ddp_cases.init_params()
        with pytest.raises(ValueError, match=r"stage=3 is not valid; valid stages are 1 and 2"):
            ZeroRedundancyOptimizer(params, SGD(lr=0.1), stage=3)
        with pytest.raises(ValueError, match=r"units must put every parameter in exactly one non-empty unit; "
                                             r"unknown names \['nope'\], in several units \[\], in none \['big', "
                                             r"'unused'\]"):
            FullyShardedDataParallel(params, mesh=mesh, optimizer=SGD(lr=0.1),
                                     units=[["w1", "b1", "scale", "nope"], ["w32"]])
        fsdp = FullyShardedDataParallel(params, mesh=mesh, optimizer=SGD(lr=0.1), units=cases.UNITS)
        with pytest.raises(ValueError, match=r"unshard: unknown unit 5; valid units are 0..2"):
            with fsdp.unshard(5):
                pass
        with fsdp.unshard(0):
            with pytest.raises(ValueError, match=r"unit 0 is already unsharded \(unshard\(0\) was entered again "
                                                 r"before its exit\)"):
                with fsdp.unshard(0):
                    pass
        with pytest.raises(ValueError, match=r"reduce_grads: unit 1 needs gradients for \['w32'\], got \['w1'\]"):
            fsdp.reduce_grads(1, {"w1": np.zeros((6, 5))})
        with pytest.raises(ValueError, match=r"gradient 'w32' has shape \(3, 6\) and dtype float32; expected the "
                                             r"parameter's shape \(6, 3\) and dtype float32"):
            fsdp.reduce_grads(1, {"w32": np.zeros((3, 6), np.float32)})
        with fsdp.unshard(1):
            pass
        with pytest.raises(ValueError, match=r"step: the gradient sync failed on rank\(s\) \[0, 1\]: ranks \[0, 1\]: "
                                             r"units \[0, 1\] were unsharded since the last step but none of their "
                                             r"gradients were marked ready \(nor reduce_grads called for them\)"):
            fsdp.step()  # on every rank: the others would step on gradients without these
        sd = fsdp.full_state_dict()
        del sd["model"]["big"]
        with pytest.raises(ValueError, match=r"parameters differ from the model's: missing \['big'\]"):
            fsdp.load_full_state_dict(sd)
        zero = ZeroRedundancyOptimizer(ddp_cases.init_params(), SGD(lr=0.1), stage=2, find_unused_parameters=True)
        zero.sync_gradients()
        with pytest.raises(ValueError, match="mesh must be a 1-D DeviceMesh"):  # None is the world (issue 25.1)
            FullyShardedDataParallel(params, mesh="dp", optimizer=SGD(lr=0.1))
    local.run(body, 2, timeout=20)


def test_fsdp_param_and_reduce_dtypes():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        params = {"w": np.linspace(0, 1, 7)}
        fsdp = FullyShardedDataParallel(params, mesh=mesh, optimizer=SGD(lr=1.0), param_dtype=np.float32,
                                        reduce_dtype=np.float32)
        with fsdp.unshard(0) as full:
            assert full["w"].dtype == np.float32
            np.testing.assert_allclose(full["w"], params["w"], rtol=1e-7)
        fsdp.reduce_grads(0, {"w": np.full(7, 0.5 + meshkit.get_rank(), np.float32)})  # param_dtype's, as unshard's
        fsdp.step()
        return fsdp.full_state_dict()["model"]["w"]
    for w in local.run(body, 2):
        assert w.dtype == np.float64
        np.testing.assert_allclose(w, np.linspace(0, 1, 7) - 1.0, rtol=1e-7)
