"""``meshkit.parallel.parallelize_model``, the library's recipe (tensor, then context, then data
parallelism; the experts beside): one Strategy that trains to single-process training on the global
batch, and clear errors naming the argument. In-process (the local engine)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import meshkit
from meshkit.comm import DistTypeError, DistValueError, local
from meshkit.parallel import SGD, AdamW, Composite, ExpertStrategy, Strategy, parallelize_model
from meshkit.state import ShardedArray
from meshkit.tensor import ColwiseParallel, DTensor, Shard

FEATURES, HIDDEN, OUT, BATCH, STEPS = 4, 8, 3, 16, 3


def init_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"w0": rng.standard_normal((FEATURES, HIDDEN)) / 2, "w1": rng.standard_normal((HIDDEN, OUT)) / 3,
            "b1": rng.standard_normal(OUT) * 0.1, "e": rng.standard_normal((FEATURES, OUT)) / 2}


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((BATCH, FEATURES)), rng.standard_normal((BATCH, OUT))


def make_optimizer(name: str) -> Any:
    return SGD(lr=0.1, momentum=0.9) if name == "sgd" else AdamW(lr=0.01, weight_decay=0.01)


def reference(opt_name: str) -> dict[str, np.ndarray]:
    """One process, the global batch: ``out = tanh(x w0) w1 + b1 + x e``, loss 0.5 * mean squared error."""
    params = init_params()
    dense, experts = make_optimizer(opt_name), make_optimizer(opt_name)
    for step in range(STEPS):
        x, y = batch(step)
        h = np.tanh(x @ params["w0"])
        delta = (h @ params["w1"] + params["b1"] + x @ params["e"] - y) / y.size
        dh = (delta @ params["w1"].T) * (1 - h ** 2)
        dense.step({n: params[n] for n in ("w0", "w1", "b1")},
                   {"w0": x.T @ dh, "w1": h.T @ delta, "b1": delta.sum(axis=0)})
        experts.step({"e": params["e"]}, {"e": x.T @ delta})
    return params


def train(shape: tuple[int, int, int], strategy: str, opt_name: str, context_parallel: bool) -> dict[str, Any]:
    """``shape`` over ``("dp", "cp", "tp")``: w0 colwise and w1 rowwise over tp (their partial outputs
    summed once), the other ranks each a contiguous share of the batch; ``e`` is the experts' part,
    its gradient reduced by the "layer" (here) over the data ranks, as an MoE does."""
    mesh = meshkit.init_device_mesh("cpu", shape, mesh_dim_names=("dp", "cp", "tp"))
    full = init_params()
    data_ranks = ("dp", "cp") if context_parallel or strategy == "hsdp" else ("dp",)
    first = meshkit.get_rank() == 0
    model = parallelize_model({n: full[n] for n in ("w0", "w1", "b1")}, mesh, optimizer=make_optimizer(opt_name),
                              tp_plan={"w0": ColwiseParallel(), "w1": Shard(0)}, context_parallel=context_parallel,
                              strategy=strategy, dp_dims=data_ranks if strategy == "hsdp" else ("dp",), experts={"e": ShardedArray(full["e"].copy(), full["e"].shape, (0, 0),
                                                                           replica=not first)})
    data = mesh[data_ranks].flatten("data") if len(data_ranks) > 1 else mesh["dp"]
    tp = mesh["tp"].get_group()
    for step in range(STEPS):
        x, y = batch(step)
        share = np.array_split(np.arange(BATCH), data.size())[data.get_local_rank()]
        x, y = x[share], y[share]
        model.zero_grad()
        with model.unshard(0) as p:
            w0, w1, b1 = (p[n].to_local() for n in ("w0", "w1", "b1"))
            h = np.tanh(x @ w0)
            out = h @ w1
            meshkit.all_reduce(out, group=tp)
            with model.unshard(1) as q:
                delta = (out + b1 + x @ q["e"] - y) / y.size
            dh = (delta @ w1.T) * (1 - h ** 2)
            for name, g in (("w0", x.T @ dh), ("w1", h.T @ delta), ("b1", delta.sum(axis=0))):
                model.mark_grad_ready(name, DTensor.from_local(g, p[name].device_mesh, p[name].placements,
                                                               shape=p[name].shape))
        de = x.T @ delta
        meshkit.all_reduce(de, meshkit.ReduceOp.AVG, group=data.get_group())  # the layer reduces its own
        model.mark_grad_ready("e", de)
        model.step()
    return {"type": type(model), "parts": [type(s) for s in model.strategies],
            "model": model.full_state_dict()["model"]}


REFERENCES = {name: reference(name) for name in ("sgd", "adamw")}


@pytest.mark.parametrize(("shape", "strategy", "opt_name", "context_parallel"), [
    ((2, 2, 2), "ddp", "adamw", True),   # tp, cp joining dp, ddp: the whole recipe at once
    ((2, 2, 2), "fsdp", "sgd", True),
    ((2, 1, 2), "zero2", "adamw", False),
    ((2, 2, 1), "hsdp", "adamw", False),  # dp_dims=(replicate, shard)
    ((1, 1, 1), "ddp", "sgd", False),    # a world of one
])
def test_the_recipe_trains_to_the_single_process_result(shape, strategy, opt_name, context_parallel):
    reference_params = REFERENCES[opt_name]
    for result in local.run(train, int(np.prod(shape)), shape, strategy, opt_name, context_parallel, timeout=60):
        assert result["type"] is Composite and result["parts"][1] is ExpertStrategy
        assert sorted(result["model"]) == sorted(reference_params)
        for name, expected in reference_params.items():
            np.testing.assert_allclose(result["model"][name], expected, rtol=1e-10, atol=1e-12, err_msg=name)


def test_one_kind_of_parameter_gives_that_strategy_alone_and_an_optimizer_instance_is_not_shared():
    def run() -> tuple[Any, Any, Any]:
        mesh = meshkit.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        opt = SGD(lr=0.5, momentum=0.9)
        stage = mesh["pp"].get_local_rank()
        dense = {"w": np.ones((2, 2))} if stage == 0 else {}
        experts = None if stage == 0 else {"e": ShardedArray(np.ones(3), (3,), (0,), replica=mesh["dp"].get_local_rank() > 0)}
        model = parallelize_model(dense, mesh, optimizer=opt, experts=experts, pp_dim="pp")
        both = parallelize_model({"w": np.ones(2)}, mesh, optimizer=opt, experts={"e": ShardedArray(
            np.ones(3), (3,), (0,), replica=meshkit.get_rank() > 0)}, dp_dims=("pp", "dp"))
        return type(model), isinstance(model, Strategy), (both.strategies[0].optimizer is opt,
                                                         both.strategies[1].optimizer is not opt,
                                                         both.strategies[1].optimizer.hyper == opt.hyper)
    results = local.run(run, 4, timeout=30)
    assert [r[0].__name__ for r in results] == ["DistributedDataParallel"] * 2 + ["ExpertStrategy"] * 2
    assert all(r[1] and r[2] == (True, True, True) for r in results)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"tp_plan": {"w": Shard(0)}, "tp_dim": "xp"}, DistValueError,
     r"tp_dim 'xp' is not a dimension of the mesh; its dimensions are \['dp', 'tp'\]"),
    ({"dp_dims": ("dp", "ep")}, DistValueError, r"dp_dims 'ep' is not a dimension of the mesh"),
    ({"dp_dims": "dp"}, DistTypeError, r"dp_dims must be a non-empty sequence of dimension names, got 'dp'"),
    ({"context_parallel": True}, DistValueError, r"cp_dim 'cp' is not a dimension of the mesh"),
    ({"pp_dim": "pp"}, DistValueError, r"pp_dim 'pp' is not a dimension of the mesh"),
    ({"strategy": "zero3"}, DistValueError,
     r"strategy 'zero3' is unknown; valid strategies are ddp, zero1, zero2, fsdp, hsdp"),
    ({"strategy": "hsdp"}, DistValueError, r"strategy 'hsdp' takes dp_dims=\(replicate, shard\), two names"),
    ({"tp_plan": {"w": Shard(0)}, "dp_dims": ("tp",)}, DistValueError, r"dimension\(s\) \['tp'\] named twice"),
    ({"optimizer": "sgd"}, DistTypeError, r"optimizer must be a meshkit.parallel.Optimizer or a function making one"),
    ({"optimizer": lambda: None}, DistTypeError, r"optimizer\(\) must return a meshkit.parallel.Optimizer, got NoneType"),
    ({"tp_plan": [Shard(0)]}, DistTypeError, r"tp_plan must be a dict of name or glob -> ParallelStyle or Placement"),
    ({"params": [np.ones(2)]}, DistTypeError, r"params must be a dict of name -> array \(or None\), got list"),
    ({"params": {}}, DistValueError, r"nothing to parallelize: params is empty and experts is None"),
    ({"mesh": None}, DistTypeError, r"mesh must be a DeviceMesh with mesh_dim_names, got NoneType"),
])
def test_bad_input_names_the_argument(kwargs, error, message):
    def run() -> None:
        mesh = meshkit.init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        args = {"params": {"w": np.ones((2, 2))}, "mesh": mesh, "optimizer": SGD(lr=0.1), **kwargs}
        parallelize_model(args.pop("params"), args.pop("mesh"), **args)
    with pytest.raises(error, match=r"rank 0: parallelize_model: " + message):
        local.run(run, 1, timeout=30)


def test_a_plan_of_bare_placements_takes_globs_as_a_plan_of_styles_does():
    def run(plan: dict) -> dict:
        mesh = meshkit.init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        model = parallelize_model({"wa": np.ones((4, 2)), "wb": np.ones((4, 2))}, mesh, optimizer=SGD(lr=0.1),
                                  tp_plan=plan)
        return {n: (p.placements, p.to_local().shape) for n, p in model.params.items()}
    same = local.run(run, 2, {"w?": Shard(0), "*a": Shard(0)}, timeout=30)  # two globs, one placement: they agree
    assert same[0] == {"wa": ((Shard(0),), (2, 2)), "wb": ((Shard(0),), (2, 2))}
    with pytest.raises(DistValueError, match=r"parameter 'wa' matches plan rules \['w\?', '\*a'\] with different "
                                             r"styles"):
        local.run(run, 2, {"w?": Shard(0), "*a": Shard(1)}, timeout=30)
