"""meshkit.plan: machine descriptions, calibration, search and the command line."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import meshkit
from meshkit.comm import local
from meshkit.plan import (Config, Layer, Level, LinkCost, Machine, Model, PlanError, bus_bytes, calibrate, estimate,
                          scaling, search)
from meshkit.plan.calibrate import fit_alpha_beta
from meshkit.plan.__main__ import main as plan_command


def two_level() -> Machine:
    return Machine.describe_cluster(gpus_per_node=8, nodes=4, intra_bw=400e9, intra_latency=2e-6, inter_bw=40e9,
                                    inter_latency=8e-6, memory_bytes=80 << 30, flops=1e14)


MODEL = Model([Layer("embed", {"w": (1000, 64)}, 256, 0),
               Layer("mlp", {"w1": (64, 256), "w2": (256, 64)}, 1024, 2 * 64 * 256 * 2, {"w1": 1, "w2": 0}),
               Layer("head", {"w": (64, 1000)}, 4000, 2 * 64 * 1000)], batch=32)


# ------------------------------------------------------------------ machine
def test_bus_bytes_follow_nccl_conventions():
    assert bus_bytes("all_reduce", 1000, 4) == 1500          # 2 (n-1)/n S
    assert bus_bytes("all_gather", 1000, 4) == 750           # (n-1)/n S
    assert bus_bytes("reduce_scatter", 1000, 2) == 500
    assert bus_bytes("broadcast", 1000, 8) == 1000
    assert bus_bytes("all_reduce", 1000, 1) == 0
    with pytest.raises(ValueError, match=r"unknown collective kind 'gossip'; valid kinds are all_reduce"):
        bus_bytes("gossip", 1, 2)


def test_machine_json_round_trip_and_levels(tmp_path):
    m = two_level()
    m.save(tmp_path / "m.json")
    back = Machine.load(tmp_path / "m.json")
    assert back == m
    assert m.level_for(8).name == "node" and m.level_for(16).name == "cluster"
    # 1 MB all-reduce over 8 ranks in a node: 2e-6 + 2*7/8*1e6 / 400e9
    assert m.collective_time("all_reduce", 1e6, 8) == pytest.approx(2e-6 + 1.75e6 / 400e9)
    assert m.collective_time("all_reduce", 1e6, 4, span=32) == pytest.approx(8e-6 + 1.5e6 / 40e9)


def test_machine_median_takes_each_cost_and_rate_of_the_middle_calibration():
    """Machine.median (scaling.py's rounds: calibrations taken minutes apart on a drifting host):
    every alpha, beta, sized cost and rate is the median of the machines', field by field."""
    def calibrated(scale: float) -> Machine:
        m = Machine([Level("dp", 2, {"all_reduce": LinkCost(1e-5 * scale, 1e-9 / scale)},
                           {2: {"all_reduce": LinkCost(2e-5 * scale, 3e-9)}})],
                    0, {"float64": 3e10 * scale}, "c", {"dp.all_reduce": 0.1 * scale}, {"adamw": 7e7 / scale},
                    0.5 * scale, {"float64": 4e7 * scale}, 1e-4 * scale, 2e10 * scale)
        return m
    runs = [calibrated(1.0), calibrated(1.4), calibrated(0.8)]
    mid = Machine.median(runs, name="median")
    one = calibrated(1.0)  # the middle of every field (those divided by the scale too)
    assert mid.name == "median" and mid.levels[0].name == "dp" and mid.levels[0].size == 2
    assert mid.levels[0].costs["all_reduce"] == LinkCost(one.levels[0].costs["all_reduce"].alpha, 1e-9)
    assert mid.levels[0].sized[2]["all_reduce"] == LinkCost(2e-5, 3e-9)
    assert (mid.flops, mid.pointwise_rate, mid.update_rate) == (one.flops, one.pointwise_rate, one.update_rate)
    assert (mid.overlap, mid.sync_cost, mid.copy_rate) == (one.overlap, one.sync_cost, one.copy_rate)
    assert mid.fit_error == pytest.approx(one.fit_error)
    assert Machine.median([one]) == one  # one machine is its own median
    assert Machine.median(runs[::-1]) == Machine.median(runs)  # order does not matter
    # machines of different shapes (another mesh, a rate missing) are refused, naming which
    other = dataclasses.replace(one, flops={"float32": 1e10})
    with pytest.raises(ValueError, match=r"Machine.median: machines\[1\] \('c'\) does not have the levels, kinds "
                                         r"and rates of machines\[0\]"):
        Machine.median([one, other])
    with pytest.raises(ValueError, match=r"Machine.median: needs one or more Machine, got \[\]"):
        Machine.median([])
    with pytest.raises(ValueError, match=r"needs one or more Machine, got \['Machine', 'dict'\]"):
        Machine.median([one, one.to_dict()])


@pytest.mark.parametrize("change,match", [
    (lambda d: d["levels"][0].update(size=-8), r"Machine.levels\[0\]: size must be an integer >= 1, got -8"),
    (lambda d: d["levels"][1]["costs"]["all_reduce"].update(beta=-1.0),
     r"Machine.levels\[1\].costs\['all_reduce'\]: beta must be >= 0, got -1.0"),
    (lambda d: d.update(memory_bytes=-1), r"Machine: memory_bytes must be an integer >= 0, got -1"),
    (lambda d: d["levels"][0]["costs"].update(gossip={"alpha": 0, "beta": 0}), r"unknown collective kind 'gossip'"),
    (lambda d: d["flops"].update(float32=0), r"Machine: flops\['float32'\] must be > 0, got 0"),
    (lambda d: d.update(update_rate={"adamw": -1.0}), r"Machine: update_rate\['adamw'\] must be > 0, got -1.0"),
    (lambda d: d.update(overlap=1.5), r"Machine: overlap must be a number in \[0, 1\], got 1.5"),
    (lambda d: d.update(pointwise_rate={"float64": 0}), r"Machine: pointwise_rate\['float64'\] must be > 0, got 0"),
    (lambda d: d.update(sync_cost=-1e-3), r"Machine: sync_cost must be >= 0, got -0.001"),
    (lambda d: d.update(copy_rate=float("nan")), r"Machine: copy_rate must be a finite number, got nan"),
    (lambda d: d["levels"].reverse(), r"Machine.levels\[1\]: size 8 is below the level inside it \(32\)"),
    (lambda d: d["levels"][0].update(sized={"16": {"all_reduce": {"alpha": 0, "beta": 0}}}),
     r"Machine.levels\[0\].sized: a group size must be an integer in \[2, 8\] \(the level's size\), got 16"),
    (lambda d: d["levels"][1].update(sized={"4": {"all_reduce": {"alpha": -1, "beta": 0}}}),
     r"Machine.levels\[1\].sized\[4\]\['all_reduce'\]: alpha must be >= 0, got -1"),
    (lambda d: d["levels"][1].update(sized={"four": {}}), r"Machine.levels\[1\].sized: keys must be group sizes"),
])
def test_machine_bad_fields_are_named(change, match):
    data = two_level().to_dict()
    change(data)
    with pytest.raises(ValueError, match=match):
        Machine.from_dict(data)


def test_model_and_config_bad_fields_are_named():
    with pytest.raises(ValueError, match=r"Model.layers\[0\].params\['w'\]\[1\] must be an integer >= 0, got -3"):
        Model([Layer("a", {"w": (2, -3)})], batch=4)
    with pytest.raises(ValueError, match=r"Model.batch must be an integer >= 1, got 0"):
        Model([Layer("a", {"w": (2,)})], batch=0)
    with pytest.raises(ValueError, match=r"Config.strategy must be one of ddp, zero1, zero2, fsdp, hsdp, got 'zero3'"):
        Config("zero3")
    with pytest.raises(ValueError, match=r"Config.dp_replicate must be 1 for strategy 'fsdp'"):
        Config("fsdp", dp_replicate=2, dp_shard=2)


def test_numpy_counts_are_counts_and_a_repeated_layer_name_is_named():
    """``flops=np.int64(...)`` (an ``np.prod`` of a shape) was refused as not an
    integer, and two layers with one name were reported as a parameter not unique "within its
    layer". NumPy integers are ints now; a repeated name is refused naming both layers (the
    planner keys parameters and activations by the layer's name)."""
    with_numpy = Model([Layer("embed", {"w": (np.int64(1000), 64)}, np.int64(256), np.int64(0)),
                        Layer("mlp", {"w1": (64, 256), "w2": (256, 64)}, np.int64(1024), np.prod([2, 64, 256, 2]),
                              {"w1": np.int64(1), "w2": 0}),
                        Layer("head", {"w": (64, 1000)}, 4000, np.int64(2 * 64 * 1000), pointwise=np.int32(3))],
                       batch=32)
    assert type(with_numpy.layers[1].flops) is int and type(with_numpy.layers[0].params["w"][0]) is int
    plain = dataclasses.replace(MODEL, layers=[dataclasses.replace(MODEL.layers[2], pointwise=3) if i == 2 else layer
                                               for i, layer in enumerate(MODEL.layers)])
    for config in (Config("fsdp", dp_shard=4, tp=2), Config("zero2", dp_shard=8)):
        assert estimate(config, with_numpy, two_level()).to_dict() == estimate(config, plain, two_level()).to_dict()
    json.dumps(estimate(Config("ddp", dp_shard=2), with_numpy, two_level()).to_dict())  # plain ints, JSON-able
    with pytest.raises(ValueError, match=r"Model.layers\[2\].name must be unique among the layers "
                                         r"\(Model.layers\[0\] is named so too\), got 'fc'"):
        Model([Layer("fc", {"w": (2, 2)}), Layer("act", {}), Layer("fc", {"w": (2, 2)})], batch=4)
    with pytest.raises(ValueError, match=r"Model.layers\[0\].flops must be an integer >= 0, got 2.5"):
        Model([Layer("fc", {"w": (2, 2)}, flops=2.5)], batch=4)


# ------------------------------------------------------------------ calibration
def test_fit_recovers_alpha_beta():
    bus = np.array([1e3, 1e4, 1e5, 1e6])
    cost, err = fit_alpha_beta(bus, 5e-6 + bus * 2e-10)
    assert cost.alpha == pytest.approx(5e-6) and cost.beta == pytest.approx(2e-10) and err < 1e-9


def test_calibrate_on_the_local_engine(tmp_path):
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
        # a small eviction pass: this test is about the machine's structure, not its timings
        return calibrate(mesh, sizes=(256, 4096, 65536), repeats=2, matmul_n=64, evict_bytes=1 << 20).to_dict()

    results = local.run(body, 4, timeout=60)
    assert all(r == results[0] for r in results)  # the same machine on every rank
    machine = Machine.from_dict(results[0])
    assert [(lv.name, lv.size) for lv in machine.levels] == [("shard", 2), ("rep", 4)]
    kinds = machine.levels[0].costs
    assert set(machine.fit_error) == {f"{d}.{k}" for d in ("rep", "shard", "rep@4") for k in kinds}
    # the whole mesh timed as one group of 4: the outer level's cost for 4 ranks (flat dp), its own
    # groups' (2 ranks: rep) for 2
    outer = machine.levels[1]
    assert set(outer.sized) == {4} and set(outer.sized[4]) == set(kinds)
    assert outer.cost("all_gather", 4) == outer.sized[4]["all_gather"] != outer.cost("all_gather", 2)
    assert outer.cost("all_gather", 2) == outer.costs["all_gather"]
    cost = outer.sized[4]["all_reduce"]
    assert machine.collective_time("all_reduce", 1 << 16, 4) == pytest.approx(
        cost.alpha + bus_bytes("all_reduce", 1 << 16, 4) * cost.beta)
    assert all(np.isfinite(e) and e >= 0 for e in machine.fit_error.values())
    assert machine.flops["float32"] > 0 and machine.flops["float64"] > 0
    assert machine.update_rate["adamw"] > 0 and machine.update_rate["sgd"] > 0
    assert machine.pointwise_rate["float32"] > 0 and machine.pointwise_rate["float64"] > 0
    assert machine.sync_cost >= 0 and machine.copy_rate > 0
    assert 0 <= machine.overlap <= 1
    # not ">": 4 threads on a loaded 2-core host can time 64 KiB like 256 B (a fit with beta = 0)
    assert machine.collective_time("all_reduce", 1 << 20, 2) >= machine.collective_time("all_reduce", 1 << 10, 2)
    machine.save(tmp_path / "calib.json")
    assert Machine.load(tmp_path / "calib.json") == machine


def test_calibrate_times_collectives_after_a_pass_over_memory(monkeypatch):
    """A step's collectives run on buffers its computation evicted from the caches (a
    3.3 MB all-reduce at 2 ranks: 0.77 ms hot, 2.3 ms after a pass of matmuls), and timed hot the
    calibration under-predicted every multi-rank step. Each timed collective of the fit (and the
    sync cost's idle call) now follows a pass over ``evict_bytes`` of the rank's memory, the
    collective's own buffer untouched; ``evict_bytes=0`` times them hot, without the passes."""
    import importlib
    import threading

    module = importlib.import_module("meshkit.plan.calibrate")
    made, log, lock = [], [], threading.Lock()
    real_evictor, real_all_reduce = module._evictor, module._c.all_reduce

    def evictor(nbytes):
        made.append(nbytes)
        inner = real_evictor(nbytes)

        def evict():
            inner()
            with lock:
                log.append(("evict", threading.get_ident()))
        return evict

    def all_reduce(tensor, *args, **kwargs):
        with lock:
            log.append((("all_reduce", tensor.size), threading.get_ident()))
        return real_all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(module, "_evictor", evictor)
    monkeypatch.setattr(module._c, "all_reduce", all_reduce)

    def body(evict_bytes):
        mesh = meshkit.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        calibrate(mesh, sizes=(1024, 8192), repeats=3, kinds=("all_reduce",), matmul_n=32, compute_window=0.002,
                  evict_bytes=evict_bytes)
        return threading.get_ident()

    me = local.run(body, 2, 1 << 20, timeout=60)[0]
    assert made == [1 << 20, 1 << 20]  # one buffer a rank
    mine = [what for what, thread in log if thread == me]
    for size in (1024 // 4, 8192 // 4):  # the fit's float32 buffers: a warm-up call, then 3 timed after a pass
        calls = [i for i, what in enumerate(mine) if what == ("all_reduce", size)]
        assert len(calls) == 4 and all(mine[i - 1] == "evict" for i in calls[1:]), mine
        assert mine[calls[0] - 1] != "evict", mine  # the warm-up is not timed: no pass before it
    assert mine.count("evict") == 2 * 3 + 3, mine  # and the sync cost's 3 idle 8-byte calls
    made.clear(), log.clear()
    local.run(body, 2, 0, timeout=60)
    assert made == [] and not any(what == "evict" for what, _ in log)


def test_calibrate_times_compute_with_every_rank_busy_at_once(monkeypatch):
    """Measured alone, a short matmul sees a whole core, and 4 ranks on 2 cores were
    predicted at half their compute time. Each round of a compute rate now starts on every rank
    together and lasts the window: the rounds of the ranks overlap in time."""
    import importlib
    import threading
    import time

    module = importlib.import_module("meshkit.plan.calibrate")  # the package's name is the function
    spans: dict[int, list[tuple[float, float]]] = {}
    lock = threading.Lock()
    real = module._busy_rate

    def recording(work, units, mesh, repeats, window):
        def timed():
            t0 = time.perf_counter()
            work()
            with lock:
                spans.setdefault(mesh.get_rank(), []).append((t0, time.perf_counter()))
        return real(timed, units, mesh, repeats, window)

    monkeypatch.setattr(module, "_busy_rate", recording)

    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        return calibrate(mesh, sizes=(256,), repeats=2, kinds=("all_reduce",), matmul_n=32, update_n=1024,
                         compute_window=0.05).pointwise_rate

    rates = local.run(body, 2, timeout=60)
    assert rates[0] == rates[1] and rates[0]["float64"] > 0
    # 6 rates x 2 rounds, each at least 0.05 s of back-to-back calls on each rank, the ranks'
    # rounds overlapping in time (they start together)
    def blocks(calls):  # back-to-back calls merged into busy blocks (gaps under 2 ms)
        out = []
        for a, b in sorted(calls):
            if out and a - out[-1][1] < 2e-3:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return out

    first, second = blocks(spans[0]), blocks(spans[1])
    assert sum(b - a for a, b in first) >= 6 * 2 * 0.05
    busy1 = sum(b - a for a, b in second)
    overlap = sum(max(0.0, min(b, d) - max(a, c)) for a, b in first for c, d in second)
    assert overlap > 0.5 * busy1, (overlap, busy1)


def test_every_collective_of_a_step_adds_the_sync_cost():
    """At 4 ranks on 2 cores a collective reached from computation cost 1.7 ms against
    0.2 ms idle (a peer waits for a core), and strategies with more calls per step (FSDP's per-layer
    gathers, a pipeline's per-microbatch sends) measured 2-3x the model, ddp 1.3-1.7x."""
    synced = dataclasses.replace(two_level(), sync_cost=1e-3)
    for config in (Config("ddp", dp_shard=4), Config("fsdp", dp_shard=4), Config("ddp", pp=2, microbatches=4),
                   Config("ddp", tp=2)):
        base, with_sync = estimate(config, MODEL, two_level()), estimate(config, MODEL, synced)
        assert len(with_sync.collectives) > 1
        assert with_sync.exposed_comm_s == pytest.approx(base.exposed_comm_s + 1e-3 * len(base.collectives))
        assert with_sync.step_s == pytest.approx(base.step_s + 1e-3 * len(base.collectives))
    fsdp = estimate(Config("fsdp", dp_shard=4), MODEL, synced)
    ddp = estimate(Config("ddp", dp_shard=4), MODEL, synced)
    assert len(fsdp.collectives) > len(ddp.collectives)  # more calls, more sync cost
    assert Machine.from_dict(synced.to_dict()) == synced


def test_every_collective_buffer_costs_a_pass_through_memory():
    """At one rank, where the links cost nothing, FSDP (a gather of each unit forward and
    backward, a reduce-scatter of its gradients) measured 10-25% over DDP (one bucket pass), and
    the model timed every one-rank configuration alike."""
    copying = dataclasses.replace(two_level(), copy_rate=1e9)
    for config in (Config("ddp"), Config("fsdp"), Config("zero1", dp_shard=2), Config("ddp", pp=2, microbatches=2)):
        base, with_copy = estimate(config, MODEL, two_level()), estimate(config, MODEL, copying)
        moved = sum(c.nbytes for c in base.collectives)
        assert moved > 0 and base.copy_s == 0
        assert with_copy.copy_s == pytest.approx(moved / 1e9)
        assert with_copy.step_s == pytest.approx(base.step_s + moved / 1e9)
        assert with_copy.to_dict()["copy_s"] == with_copy.copy_s
    one_rank = {s: estimate(Config(s), MODEL, copying).step_s for s in ("ddp", "zero1", "fsdp")}
    assert one_rank["ddp"] < one_rank["zero1"] < one_rank["fsdp"]  # 1, 2 and 3 passes over the parameters
    assert Machine.from_dict(copying.to_dict()) == copying


def test_activations_cost_time_at_the_pointwise_rate():
    """On a host NumPy's tanh costs as much as a 512-wide layer's matmul; the model
    counted matmul flops only and predicted about half the measured step."""
    layers = [Layer("a", {"w": (8, 16)}, 128, 256, pointwise=16), Layer("b", {"w": (16, 4)}, 32, 128)]
    model = Model(layers, batch=8)
    m = dataclasses.replace(two_level(), pointwise_rate={"float32": 1e6})
    without = estimate(Config("ddp", dp_shard=2), model, two_level())
    with_ = estimate(Config("ddp", dp_shard=2), model, m)
    assert with_.compute_s == pytest.approx(without.compute_s + 16 * 4 / 1e6)  # 4 samples a rank
    assert with_.step_s - without.step_s == pytest.approx(16 * 4 / 1e6)
    split = Model([Layer("a", {"w": (8, 16)}, 128, 256, {"w": 1}, pointwise=16), layers[1]], batch=8)
    tp = estimate(Config("ddp", tp=2), split, m)  # a layer split over tp computes half its activations
    assert tp.compute_s == pytest.approx(m.compute_time(3 * 384 * 8 / 2, "float32") + 16 * 8 / 2 / 1e6)
    data = {"batch": 8, "layers": [{"name": "a", "params": {"w": [8, 16]}, "pointwise": 16}]}
    assert Model.from_dict(data).layers[0].pointwise == 16
    with pytest.raises(ValueError, match=r"Model.layers\[0\].pointwise must be an integer >= 0, got -1"):
        Model([Layer("a", {"w": (2,)}, pointwise=-1)], batch=1)


def test_calibrate_a_mesh_with_a_dimension_of_one_rank():
    """A (1, 2) mesh has one dimension of more than one rank: one level, no sized costs (the whole
    mesh is that dimension's group; a level holding only sized costs would not be a valid machine)."""
    def body():
        mesh = meshkit.init_device_mesh("cpu", (1, 2), mesh_dim_names=("rep", "shard"))
        return calibrate(mesh, sizes=(256, 4096), repeats=1, kinds=("all_reduce",), matmul_n=32,
                         compute_window=0.005).to_dict()

    machine = Machine.from_dict(local.run(body, 2, timeout=60)[0])
    assert [(lv.name, lv.size, lv.sized) for lv in machine.levels] == [("shard", 2, {})]


def test_calibrate_bad_arguments():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        with pytest.raises(ValueError, match=r"rank \d: calibrate: kinds must be among all_reduce, .*; got "
                                             r"kinds=\['gossip'\], sizes=\[1024\], repeats=1"):
            calibrate(mesh, kinds=["gossip"], sizes=[1024], repeats=1)
        with pytest.raises(ValueError, match=r"sizes=\[2\], repeats=1"):
            calibrate(mesh, sizes=[2], repeats=1)
        with pytest.raises(ValueError, match=r"compute_window=0 \(> 0 seconds\)"):
            calibrate(mesh, sizes=[1024], repeats=1, compute_window=0)
        with pytest.raises(ValueError, match=r"calibrate: mesh must be a DeviceMesh, got list"):
            calibrate([0, 1])

    local.run(body, 2)


def test_calibrate_through_meshkit_run(mpirun, tmp_path):
    out = mpirun("mpi_plan_calibrate.py", 2, str(tmp_path / "calib.json"), "3").stdout
    machine = Machine.load(tmp_path / "calib.json")
    # a group on one node with the shared-memory path (comm/engines/shm.py) also prices its shared
    # buffers' path: all_reduce, all_gather and reduce_scatter in place (where /dev/shm and x86-64 allow)
    shares = "SHARES True" in out
    assert machine.levels[0].size == 2 and len(machine.fit_error) == (10 if shares else 7), out
    assert out.count("FIT dp.") == (10 if shares else 7), out
    paths = machine.levels[0].paths
    assert sorted(paths.get("shm", {})) == (["all_gather", "all_reduce", "reduce_scatter"] if shares else []), paths
    for kind, cost in paths.get("shm", {}).items():
        assert cost.alpha > 0 or cost.beta > 0, (kind, cost)
        assert machine.levels[0].cost(kind, path="shm") is cost and machine.levels[0].cost(kind) is not cost


def test_the_docs_snippet_as_written(tmp_path):
    """docs/planner.md's example, pasted into a file and run the way it says (2 ranks under
    meshkit-run): it calibrates, saves calib.json and ranks zero2's configurations."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "planner.md").read_text()
    snippet = page.split("```python\n", 1)[1].split("```", 1)[0]
    assert "meshkit-run -n 2 plan_example.py" in snippet
    (tmp_path / "plan_example.py").write_text(snippet + "if meshkit.get_rank() == 0:\n"
                                              "    print('BEST', ranked[0].config.name(), b.step_s > 0)\n")
    proc = subprocess.run([sys.executable, "-m", "meshkit.launch", "-n", "2", "plan_example.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert Machine.load(tmp_path / "calib.json").levels[0].size == 2
    assert "BEST " in proc.stdout and proc.stdout.rstrip().endswith("True"), proc.stdout


# ------------------------------------------------------------------ estimate and search
def test_estimate_breakdown_adds_up():
    m = two_level()
    b = estimate(Config("ddp", dp_shard=4), MODEL, m)
    assert b.step_s == pytest.approx(b.compute_s + b.bubble_s + b.exposed_comm_s)
    assert b.compute_s == pytest.approx(3 * sum(layer.flops for layer in MODEL.layers) * 8 / 1e14)
    assert b.exposed_comm_s <= b.comm_s + 1e-15
    p = estimate(Config("ddp", dp_shard=2, pp=2, microbatches=4), MODEL, m)
    assert p.bubble_s == pytest.approx(p.compute_s * (1 / 5) / (4 / 5))  # 1f1b: (p-1)/(m+p-1) = 1/5
    assert len(p.stage_memory) == 2
    with pytest.raises(ValueError, match=r"batch 32 does not divide over 3 data-parallel ranks"):
        estimate(Config("ddp", dp_shard=3), MODEL, m)
    with pytest.raises(ValueError, match=r"16 samples per data-parallel rank do not split into 3 microbatches"):
        estimate(Config("ddp", dp_shard=2, pp=2, microbatches=3), MODEL, m)
    with pytest.raises(ValueError, match=r"pp=4 stages need at least 4 layers, the model has 3"):
        estimate(Config("ddp", pp=4), MODEL, m)
    with pytest.raises(TypeError, match=r"takes a Config, a Model and a Machine, got dict"):
        estimate({}, MODEL, m)


def test_the_optimizer_step_counts_the_parameters_each_rank_updates():
    """benchmarks/scaling.py measured zero1 faster than ddp at 2 ranks (AdamW updates half
    the parameters); without the optimizer's step the model ranked ddp first."""
    m = dataclasses.replace(two_level(), update_rate={"adamw": 1e8})
    numel = MODEL.numel
    ddp = estimate(Config("ddp", dp_shard=2), MODEL, m)
    zero1 = estimate(Config("zero1", dp_shard=2), MODEL, m)
    fsdp = estimate(Config("fsdp", dp_shard=2), MODEL, m)
    assert ddp.optimizer_s == pytest.approx(numel * 4 / 8 / 1e8)  # float32: twice float64's rate
    assert zero1.optimizer_s == pytest.approx(ddp.optimizer_s / 2)
    assert fsdp.optimizer_s == pytest.approx((64000 + 32768 + 64000) // 2 * 4 / 8 / 1e8)  # its units' shards
    assert ddp.step_s == pytest.approx(ddp.compute_s + ddp.exposed_comm_s + ddp.optimizer_s)
    assert zero1.step_s < ddp.step_s
    assert estimate(Config("ddp", dp_shard=2), MODEL, two_level()).optimizer_s == 0  # a rate not given: left out


def test_a_machine_that_overlaps_nothing_exposes_every_collective():
    """On the 2-core host calibrate measured overlap 0 (a rank's one core computes or
    communicates); the model hid FSDP's gathers under compute and picked FSDP, measured slower."""
    full = dataclasses.replace(two_level(), flops={"float32": 1e9})  # compute long enough to hide buckets under
    none = dataclasses.replace(full, overlap=0.0)
    for strategy in ("ddp", "zero2", "fsdp"):
        config = Config(strategy, dp_shard=4, bucket_cap_mb=0.1, first_bucket_cap_mb=0.1)  # several buckets
        hidden, exposed = estimate(config, MODEL, full), estimate(config, MODEL, none)
        assert exposed.exposed_comm_s == pytest.approx(exposed.comm_s)
        assert exposed.step_s == pytest.approx(exposed.compute_s + exposed.comm_s)
        assert hidden.exposed_comm_s < exposed.exposed_comm_s
    assert Machine.from_dict(none.to_dict()) == none


def test_search_ranks_and_fits_the_cap():
    m = two_level()
    ranked = search(MODEL, 8, m)
    assert [b.step_s for b in ranked] == sorted(b.step_s for b in ranked)
    names = {b.config.name() for b in ranked}
    assert {"ddp dp8 tp1 pp1", "hsdp dp2x4 tp1 pp1", "fsdp dp4 tp2 pp1", "zero2 dp4 tp1 pp2 1f1b mb8"} <= names
    assert not any("pp4" in n for n in names)  # 3 layers: at most 3 stages
    cap = sorted(b.memory_total for b in ranked)[len(ranked) // 2]
    capped = search(MODEL, 8, m, memory_cap=cap)
    assert capped and all(b.memory_total <= cap for b in capped) and len(capped) < len(ranked)


def test_search_says_what_cannot_be_met():
    m = two_level()
    with pytest.raises(PlanError, match=r"no configuration of 8 ranks fits memory_cap=1000 bytes per rank; the "
                                         r"closest is fsdp dp8 tp1 pp1 at 598656 bytes"):  # 4 x 160768 / 8 x 4 B + the embedding unsharded (256000 B) + 4 samples x 5280 B
        search(MODEL, 8, m, memory_cap=1000)
    with pytest.raises(PlanError, match=r"no mesh fits world_size=5: .* the nearest world size with one is 4: "):
        search(MODEL, 5, m)
    with pytest.raises(PlanError, match=r"world_size must be an integer >= 1, got 0"):
        search(MODEL, 0, m)


def _lines_executed(fn, limit):
    """Python lines ``fn()`` executes (sys.settrace's line events), stopping it past ``limit``: an
    operation count, the same on any machine and under any load."""
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
            if count > limit:
                raise RuntimeError(f"over {limit} lines executed")
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(previous)
    return count


@pytest.mark.parametrize("world_size", [10**5, 10**12])
def test_the_nearest_world_size_costs_the_same_at_any_world_size(world_size):
    """``--world-size 100000`` ran for minutes when each world size around it was tried by its
    own divisors. The products pp x tp x dp that can fit are enumerated instead:
    6,603 lines for this model, whatever the world size (9,800 would be a regression's margin)."""
    m, refusal = two_level(), []

    def plan():
        try:
            search(MODEL, world_size, m)
        except PlanError as exc:
            refusal.append(str(exc))

    assert _lines_executed(plan, 10_000) < 10_000
    assert re.search(rf"no mesh fits world_size={world_size}: .* the nearest world size with one is 8192: ddp dp32 "
                     r"tp256 pp1", refusal[0]), refusal
    assert _lines_executed(lambda: search(MODEL, 8, m), 200_000) < 200_000  # 34 configurations estimated


def _plan(argv: list[str]) -> subprocess.CompletedProcess:
    """``python -m meshkit.plan ARGV`` through its ``main`` in this process: exit status, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = plan_command(argv)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def test_cli(tmp_path):
    layers = [{"name": layer.name, "params": {k: list(v) for k, v in layer.params.items()},
               "activation_bytes": layer.activation_bytes, "flops": layer.flops, "tp_dim": layer.tp_dim}
              for layer in MODEL.layers]
    (tmp_path / "model.json").write_text(json.dumps({"batch": 32, "layers": layers}))
    two_level().save(tmp_path / "m.json")
    args = [str(tmp_path / "model.json"), "--world-size", "8"]
    # the command itself once; the other runs call its main in this process (a process each costs seconds)
    out = subprocess.run([sys.executable, "-m", "meshkit.plan", *args, "--machine", str(tmp_path / "m.json"), "--top",
                          "3"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"{len(search(MODEL, 8, two_level()))} configurations of 8 ranks")
    assert len(lines) == 5 and lines[2].split()[0] == search(MODEL, 8, two_level())[0].config.strategy
    # each row adds up: step = compute + bubble + exposed + optim + copy, in the columns shown
    assert lines[1].split()[1:] == ["step", "ms", "compute", "bubble", "exposed", "optim", "copy", "comm", "MiB/rank"]
    machine = dataclasses.replace(two_level(), update_rate={"adamw": 1e8}, copy_rate=1e9)
    machine.save(tmp_path / "full.json")
    full = _plan(args + ["--machine", str(tmp_path / "full.json"), "--top", "3"])
    for row in full.stdout.splitlines()[2:]:
        step, compute, bubble, exposed, optim, copy = map(float, row.split()[-8:-2])
        assert optim > 0 and copy > 0 and step == pytest.approx(compute + bubble + exposed + optim + copy, abs=2e-3)
    layers[1]["params"]["w1"] = [64, -256]
    (tmp_path / "bad.json").write_text(json.dumps({"batch": 32, "layers": layers}))
    bad = _plan([str(tmp_path / "bad.json"), "--world-size", "8"])
    assert bad.returncode == 2 and "usage:" in bad.stderr
    assert "Model.layers[1].params['w1'][1] must be an integer >= 0, got -256" in bad.stderr
    strat = _plan(args + ["--strategies", "ddp,zero3"])
    assert strat.returncode == 2 and "--strategies: unknown strategy 'zero3'; valid strategies are ddp, zero1" in strat.stderr
    only = _plan(args + ["--strategies", "fsdp", "--json", "--top", "2"])
    assert [r["config"].split()[0] for r in json.loads(only.stdout)] == ["fsdp", "fsdp"]
    (tmp_path / "typo.json").write_text(json.dumps({"batch": 32, "layers": [{"params": {"w": [2]}, "flop": 3}]}))
    typo = _plan([str(tmp_path / "typo.json"), "--world-size", "2"])
    assert typo.returncode == 2 and "Model.layers[0] must be keys among name, params" in typo.stderr, typo.stderr
    cap = _plan(args + ["--memory-cap", "1000"])
    assert cap.returncode == 2 and "fits memory_cap=1000 bytes per rank; the closest is" in cap.stderr


def test_data_parallel_turns_communication_bound_below_c_over_w():
    """The scaling-book rule (docs/planner.md): DDP's gradient all-reduce (about 2 x 2P bytes of
    bfloat16 over bandwidth W) hides under the backward (4 P B / C for B tokens per device) while
    B > C / W, and is exposed beyond it."""
    d, seq, layers = 1024, 1024, 16
    block = Layer("b", {"w1": (d, 4 * d), "w2": (4 * d, d)}, seq * d * 2, 2 * 8 * d * d * seq)
    machine = Machine.describe_cluster(gpus_per_node=1, nodes=4096, intra_bw=1e12, intra_latency=0, inter_bw=50e9,
                                       inter_latency=0, memory_bytes=0, flops=400e12)
    c_over_w_tokens = 400e12 / 50e9 / 2  # bfloat16 rate = 2 x the described float32 rate
    for factor, bound in ((4, False), (1 / 4, True)):
        per_device = int(factor * c_over_w_tokens // seq) or 1
        n = 64
        model = Model([dataclasses.replace(block, name=f"b{i}") for i in range(layers)], batch=per_device * n,
                      dtype="bfloat16")
        b = estimate(Config("ddp", dp_shard=n), model, machine)
        backward = 2 * b.compute_s / 3
        if bound:
            assert b.exposed_comm_s == pytest.approx(b.comm_s - backward, rel=0.05) and b.comm_s > backward
        else:
            assert b.exposed_comm_s < 0.15 * b.comm_s < backward


def test_scaling_rows():
    rows = scaling(MODEL, two_level(), [2, 8, 32], strategies=["ddp", "hsdp"])
    assert [r["ranks"] for r in rows] == [2, 8, 32]
    assert rows[0]["hsdp"] is None and rows[0]["best"] == "ddp"  # hsdp needs both dimensions > 1
    for r in rows[1:]:
        best = r[r["best"]]
        assert best["step_s"] == min(r[s]["step_s"] for s in ("ddp", "hsdp"))
        assert 0 < best["efficiency"] <= 1


def test_search_leaves_out_two_stage_schedules_without_the_layers_for_them():
    """interleaved and zbv hold two stages a rank: pp=2 needs 4 layers; MODEL has 3, so search
    offers 1f1b at pp=2 but no zbv there (estimate would refuse it), instead of failing."""
    ranked = search(MODEL, 2, two_level(), schedules=("zbv", "1f1b"))
    assert any(b.config.pp == 2 and b.config.schedule == "1f1b" for b in ranked)
    assert not any(b.config.pp == 2 and b.config.schedule == "zbv" for b in ranked)
    with pytest.raises(ValueError, match=r"schedule 'zbv' holds 2 stages a rank: pp=2 needs at least 4 layers, the "
                       r"model has 3"):
        estimate(Config("ddp", pp=2, schedule="zbv", microbatches=2), MODEL, two_level())


def test_layer_tp_style_and_input_bytes():
    """How tp cuts a layer is read off its 2-D weights' tp_dim (Megatron's (fan_in, fan_out) linear
    layers); input_bytes, the size a colwise layer's backward all-reduces, loads from a model file."""
    assert Layer("a", {"w": (4, 8), "b": (8,)}, tp_dim={"w": 1, "b": 0}).tp_style == "colwise"
    assert Layer("a", {"w": (8, 4), "b": (4,)}, tp_dim={"w": 0}).tp_style == "rowwise"
    assert MODEL.layers[1].tp_style == "block"  # w1 colwise and w2 rowwise inside one layer
    assert Layer("a", {"w": (4, 8), "b": (8,)}, tp_dim={"b": 0}).tp_style == "replicated"
    loaded = Model.from_dict({"layers": [{"params": {"w": [2, 3]}, "activation_bytes": 12, "input_bytes": 8}]})
    assert loaded.layers[0].input_bytes == 8
    with pytest.raises(ValueError, match=r"Model.layers\[0\].input_bytes must be an integer >= 0, got -1"):
        Model([Layer("a", {"w": (2,)}, input_bytes=-1)], batch=1)
