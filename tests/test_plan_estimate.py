"""meshkit.plan.estimate against the strategies themselves: memory byte for byte equal to
``memory_report()`` and the predicted collectives equal to the flight record of a real step, on
the local engine, for every strategy at 1-4 ranks, hsdp meshes and pipeline stages."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import meshkit
from meshkit.comm import local
from meshkit.parallel import data_parallel
from meshkit.parallel.optim.optimizers import SGD, AdamW
from meshkit.tensor import DTensor, Shard, distribute_tensor
from meshkit.plan import (Config, Layer, Machine, Model, estimate, predict_collectives, predict_memory,
                          step_collectives)

#: Shapes that divide evenly, that do not (7x5 + 5 over 2, 3, 4 ranks), and a model of buckets
#: (caps of a few kB in the configs below: several buckets, some parameters larger than a cap).
MODELS = {
    "odd": Model([Layer("l0", {"w": (7, 5), "b": (5,)}, 20, 70), Layer("l1", {"w": (5, 3)}, 12, 30),
                  Layer("l2", {"w": (3, 11), "b": (11,)}, 44, 66)], batch=12),
    "even": Model([Layer("a", {"w": (16, 16)}, 64, 512), Layer("b", {"w": (16, 8), "b": (8,)}, 32, 256)],
                  batch=12, dtype="float64"),
    "buckets": Model([Layer(f"l{i}", {"w": (40 + i, 9), "b": (9 + i,)}, 36, 720) for i in range(6)], batch=12),
}
CAPS = {"bucket_cap_mb": 3000 / (1 << 20), "first_bucket_cap_mb": 700 / (1 << 20)}


def _params(model: Model, layers) -> dict:
    rng = np.random.default_rng(1)
    return {f"{layer.name}.{p}": rng.standard_normal(shape).astype(model.dtype)
            for layer in layers for p, shape in layer.params.items()}


def _one_step(model: Model, config: Config, mesh, layers, params=None) -> tuple[dict, list]:
    """Build the strategy over this stage's parameters, run two training steps and return its
    memory_report and the flight record of the second step as (op, bytes, dim)."""
    params = _params(model, layers) if params is None else params
    opt = AdamW(lr=1e-3) if config.optimizer == "adamw" else SGD(lr=0.1, momentum=config.momentum)
    units = [[f"{layer.name}.{p}" for p in layer.params] for layer in layers if layer.params]
    fsdp = config.strategy in ("fsdp", "hsdp")
    options = {} if fsdp else {"bucket_cap_mb": config.bucket_cap_mb, "first_bucket_cap_mb": config.first_bucket_cap_mb}
    m = data_parallel(params, mesh, config.strategy, optimizer=opt, units=units if fsdp else None, **options)
    dims = {mesh.get_group(i).name: name for i, name in enumerate(
        ["dp"] if mesh.ndim == 1 else ["dp_replicate", "dp_shard"])}
    for _ in range(2):
        start = len(meshkit.comm.flight_record())
        if fsdp:
            for u in range(len(units)):
                with m.unshard(u):
                    pass
            for u in reversed(range(len(units))):
                with m.unshard(u):
                    for name in reversed(units[u]):
                        m.mark_grad_ready(name, np.ones_like(_local(params[name])))
        else:
            for name in reversed(list(params)):
                m.mark_grad_ready(name, np.ones_like(_local(params[name])))
        m.step()
    record = meshkit.comm.flight_record()[start:]
    ops = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}
    listed = []
    for e in record:
        shapes = e["shapes"]
        big = max(int(np.prod(s)) for s in shapes)  # an all-gather's output, a reduce-scatter's input
        listed.append((ops.get(e["op"], e["op"]), big * np.dtype(e["dtype"]).itemsize, dims[e["group"]]))
    return m.memory_report(), listed


def _local(p):
    return p.to_local() if isinstance(p, DTensor) else p


def _check(model_name: str, config: Config):
    model = MODELS[model_name]

    def body():
        dp_dims = (config.dp_replicate, config.dp_shard) if config.strategy == "hsdp" else (config.dp_shard,)
        names = ("pp",) * (config.pp > 1) + (("dp_replicate", "dp_shard") if len(dp_dims) == 2 else ("dp",))
        shape = ((config.pp,) if config.pp > 1 else ()) + dp_dims
        mesh = meshkit.init_device_mesh("cpu", shape, mesh_dim_names=names)
        stage = mesh.get_local_rank("pp") if config.pp > 1 else 0
        from meshkit.plan.estimate import stage_layers
        layers = stage_layers(model, config.pp)[stage]
        dp_mesh = mesh[names[1:]] if config.pp > 1 else mesh
        if config.pp > 1 and len(dp_dims) == 1:
            dp_mesh = mesh["dp"]
        report, listed = _one_step(model, config, dp_mesh, layers)
        return stage, report, listed

    for stage, report, listed in local.run(body, config.world_size, timeout=60):
        predicted = predict_memory(model, config, stage)
        actual = {k: report[k] for k in predicted}
        assert actual == predicted, (config, stage)
        assert [(c.op, c.nbytes, c.dim) for c in predict_collectives(model, config, stage)] == listed, (config, stage)


FLAT = [(s, n) for s in ("ddp", "zero1", "zero2", "fsdp") for n in (1, 2, 3, 4)]


@pytest.mark.parametrize("strategy,n", FLAT)
@pytest.mark.parametrize("model_name", ["odd", "buckets"])
def test_memory_and_collectives_match_a_real_step(strategy, n, model_name):
    _check(model_name, Config(strategy, dp_shard=n, **CAPS))


@pytest.mark.parametrize("replicate,shard", [(2, 1), (1, 2), (2, 2)])
def test_hsdp(replicate, shard):
    _check("odd", Config("hsdp", dp_replicate=replicate, dp_shard=shard))


@pytest.mark.parametrize("strategy,optimizer,momentum", [("ddp", "sgd", 0.9), ("zero2", "sgd", 0.0),
                                                         ("fsdp", "sgd", 0.5), ("zero1", "adamw", 0.0)])
def test_float64_and_sgd(strategy, optimizer, momentum):
    _check("even", Config(strategy, dp_shard=2, optimizer=optimizer, momentum=momentum, **CAPS))


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp"])
def test_pipeline_stages(strategy):
    """Two stages of (pp=2, dp=2): each stage's strategy holds what the prediction for that stage says."""
    _check("buckets", Config(strategy, dp_shard=2, pp=2, microbatches=2, **CAPS))


TP_MODEL = Model([Layer("l0", {"w": (6, 7), "b": (7,)}, 28, 84, {"w": 1, "b": 0}), Layer("l1", {"w": (8, 5)}, 20, 80, {"w": 0}),
                  Layer("l2", {"w": (5, 3), "b": (3,)}, 12, 30)], batch=8)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_tensor_parallel_blocks(strategy):
    """(dp=2, tp=2): DTensor parameters sharded over tp (7 columns: blocks of 4 and 3) are held as their blocks; memory and
    collectives are those of the tp-rank's local shapes."""
    config = Config(strategy, dp_shard=2, tp=2, **CAPS)

    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        full = _params(TP_MODEL, TP_MODEL.layers)
        params = {}
        for layer in TP_MODEL.layers:
            for p in layer.params:
                name = f"{layer.name}.{p}"
                dim = layer.tp_dim.get(p)
                params[name] = full[name] if dim is None else distribute_tensor(full[name], mesh["tp"], [Shard(dim)])
        return mesh.get_local_rank("tp"), *_one_step(TP_MODEL, config, mesh["dp"], TP_MODEL.layers, params)

    for tp_rank, report, listed in local.run(body, 4, timeout=60):
        predicted = predict_memory(TP_MODEL, config, 0, tp_rank)
        assert {k: report[k] for k in predicted} == predicted
        assert [(c.op, c.nbytes, c.dim) for c in predict_collectives(TP_MODEL, config, 0, tp_rank)] == listed


# --------------------------------------------------------------------------- examples/train_3d.py's whole step
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train_3d  # noqa: E402
import train_mlp  # noqa: E402

_OPS = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}


def _train_3d_step(monkeypatch, shape, schedule, dp, microbatches, hidden="8,8,8", optimizer="sgd"):
    """Train examples/train_3d.py for 3 steps on the local engine; per rank: (pp rank, tp rank,
    the third step's flight record as (op, bytes, mesh dim), memory_report() after it). The loop's
    loss reporting (two 1-element all-reduces, over pp and dp, after each step) is not the step's."""
    snapshots: dict[int, list] = {}
    models: dict[int, object] = {}

    def saver(manager, model, args):  # the loop's after_step: where one step ends
        models[meshkit.get_rank()] = model
        return lambda done: snapshots.setdefault(meshkit.get_rank(), []).append(meshkit.flight_record())

    monkeypatch.setattr(train_mlp, "saver", saver)

    def body():
        rank, world = meshkit.get_rank(), meshkit.get_world_size()
        args = train_3d.parse_args(["--mesh", "x".join(map(str, shape)), "--schedule", schedule, "--dp", dp,
                                    "--microbatches", str(microbatches), "--hidden", hidden, "--steps", "3",
                                    "--batch", "8", "--samples", "64", "--optimizer", optimizer],
                                   rank=rank, world_size=world)
        train_3d.train(args, progress=False)
        mesh = train_3d.build_mesh(args.mesh)
        # dimensions of size 1 share one group: name it dp (tp and pp issue nothing over one rank)
        dims = {mesh.get_group(name).name: name for name in ("pp", "tp", "dp")}
        before, after = snapshots[rank][-2:]
        # the step begins after the previous step's last entry (a collective: sends and receives have no seq)
        last = (before[-1]["group"], before[-1]["seq"])
        step = after[[(e["group"], e["seq"]) for e in after].index(last) + 1:]
        listed = [(_OPS.get(e["op"], e["op"]),
                   max(int(np.prod(s)) for s in e["shapes"]) * np.dtype(e["dtype"]).itemsize, dims[e["group"]])
                  for e in step]
        assert [e[:2] for e in listed[-2:]] == [("all_reduce", 8)] * 2, listed  # the loss, reported
        assert len(step) < 60, "the flight recorder keeps 64 entries: this step may not fit"
        return mesh.get_local_rank("pp"), mesh.get_local_rank("tp"), listed[:-2], models[rank].memory_report()

    return local.run(body, int(np.prod(shape)), timeout=120)


TRAIN_3D = [((2, 1, 1), "gpipe", "ddp", 2), ((2, 1, 1), "1f1b", "zero1", 4), ((1, 1, 2), "1f1b", "ddp", 2),
            ((1, 1, 2), "gpipe", "fsdp", 2), ((2, 1, 2), "1f1b", "ddp", 2), ((2, 1, 2), "gpipe", "zero2", 2),
            ((1, 2, 2), "1f1b", "zero2", 2), ((1, 2, 2), "gpipe", "fsdp", 2), ((2, 2, 1), "1f1b", "fsdp", 2),
            ((2, 2, 1), "gpipe", "zero1", 2), ((2, 1, 2), "zbh1", "ddp", 2), ((2, 1, 1), "interleaved", "ddp", 2),
            ((2, 1, 2), "interleaved", "zero2", 4), ((2, 1, 2), "zbv", "fsdp", 2), ((2, 2, 1), "zbv", "ddp", 2)]


@pytest.mark.parametrize("shape,schedule,dp,microbatches", TRAIN_3D)
def test_train_3d_step_matches_the_flight_record(monkeypatch, shape, schedule, dp, microbatches):
    """examples/train_3d.py's real step (Megatron blocks over tp, its stages over pp under the
    schedule, the strategy over dp): step_collectives lists every collective of it (tp all-reduces,
    pp sends and receives, dp collectives) entry by entry on every rank, and memory is exact."""
    pp, dps, tp = shape
    hidden = (8,) * (7 if schedule in ("interleaved", "zbv") else 3)  # two layers a stage: Megatron blocks
    model = train_3d.plan_model(hidden, 8, pp=pp, tp=tp, schedule=schedule)
    config = Config(dp, dp_shard=dps, tp=tp, pp=pp, optimizer="sgd", momentum=0.9, schedule=schedule,
                    microbatches=microbatches, loop="whole")
    ranks = _train_3d_step(monkeypatch, shape, schedule, dp, microbatches, hidden=",".join(map(str, hidden)))
    for stage, tp_rank, listed, report in ranks:
        predicted = step_collectives(model, config, stage, tp_rank)
        assert [(c.op, c.nbytes, c.dim) for c in predicted] == listed, (stage, tp_rank)
        memory = predict_memory(model, config, stage, tp_rank)
        assert {k: report[k] for k in memory} == memory, (stage, tp_rank)
    ops = {(op, dim) for *_, listed, _ in ranks for op, _, dim in listed}
    assert (("send", "pp") in ops) == (pp > 1) and (("all_reduce", "tp") in ops) == (tp > 1)


def test_train_3d_buckets_and_adamw(monkeypatch):
    """Widths of 512 (several DDP buckets: 25 MB and a first of 1 MB), AdamW, 2 stages x 2 tp ranks."""
    model = train_3d.plan_model((512, 512, 512), 8, pp=2, tp=2)
    config = Config("ddp", dp_shard=1, tp=2, pp=2, optimizer="adamw", microbatches=2, loop="whole")
    ranks = _train_3d_step(monkeypatch, (2, 1, 2), "1f1b", "ddp", 2, hidden="512,512,512", optimizer="adamw")
    for stage, tp_rank, listed, report in ranks:
        assert [(c.op, c.nbytes, c.dim) for c in step_collectives(model, config, stage, tp_rank)] == listed
        assert sum(op == "all_reduce" and dim == "dp" for op, _, dim in listed) == 3  # two buckets, the flags
        memory = predict_memory(model, config, stage, tp_rank)
        assert {k: report[k] for k in memory} == memory


def test_estimate_times_the_step_it_lists():
    """estimate's collectives are step_collectives' list for the stage it times (the slowest),
    each timed over its dimension: tensor parallelism's all-reduces and pipeline transfers are
    the real ones (four a microbatch at pp=2, tp=2 on a 4-layer MLP), not a rough count."""
    model = train_3d.plan_model((64, 64, 64), 32, pp=2, tp=2)
    config = Config("zero1", dp_shard=2, tp=2, pp=2, schedule="1f1b", microbatches=4, loop="whole")
    machine = Machine.describe_cluster(gpus_per_node=8, nodes=1, intra_bw=1e11, intra_latency=1e-5, inter_bw=1e10,
                                       inter_latency=1e-5, memory_bytes=1 << 34, flops=1e12)
    b = estimate(config, model, machine)
    listed = step_collectives(model, config, 0)
    assert [(c.op, c.nbytes, c.dim) for c in b.collectives] == [(c.op, c.nbytes, c.dim) for c in listed]
    assert sum(c.dim == "tp" for c in listed) == 2 * 4 and sum(c.dim == "pp" for c in listed) == 2 * 4
    assert all(c.seconds > 0 for c in b.collectives)
    assert b.comm_s == pytest.approx(sum(c.seconds for c in b.collectives))
    with pytest.raises(ValueError, match=r"Config.loop must be one of per_layer, whole, got 'once'"):
        Config("fsdp", loop="once")
