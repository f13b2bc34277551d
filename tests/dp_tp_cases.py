"""Data parallelism over ``dp`` of tensor-parallel DTensor parameters on a ``dp x tp`` mesh.

A two-layer MLP laid out as Megatron-LM does (``w1``/``b1`` colwise, ``w2`` rowwise, ``b2``
replicated), its hidden width 5 cut unevenly over ``tp`` = 2 (3 + 2 columns, ``torch.chunk``'s
rule), trained with a data-parallel strategy that takes the DTensors themselves; and the same
training in one process on the global batch (the reference). The model code is plain NumPy:
the same functions run on arrays and on DTensors.
"""

from __future__ import annotations

import numpy as np

import meshkit
from meshkit.parallel import SGD, DistributedDataParallel, ZeroRedundancyOptimizer, clip_grad_norm_, to_host
from meshkit.tensor import ColwiseParallel, DTensor, Replicate, RowwiseParallel, Shard, distribute_tensor, parallelize

GLOBAL_BATCH = 12  # divisible by every dp degree used (1, 2, 3, 4)
STEPS = 4
MAX_NORM = 0.5  # small enough that every step clips: the norm over tp and dp matters
ROWWISE = RowwiseParallel(use_local_output=False)
PLAN = {"[wb]1": ColwiseParallel(use_local_output=False), "w2": ROWWISE}
#: what the plan gives each parameter, and so each gradient
PLACEMENTS = {"w1": (Shard(1),), "b1": (Shard(0),), "w2": (Shard(0),), "b2": (Replicate(),)}


def init_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {"w1": rng.standard_normal((4, 5)) / 2, "b1": rng.standard_normal(5) / 2,
            "w2": rng.standard_normal((5, 3)) / 2, "b2": rng.standard_normal(3) / 2}


def data(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(50 + step)
    return rng.standard_normal((GLOBAL_BATCH, 4)), rng.standard_normal((GLOBAL_BATCH, 3))


def grads_in_backward_order(p, x, t) -> list[tuple[str, object]]:
    """``(name, gradient)`` of ``0.5 * mean_i |y_i - t_i|^2``, last layer first; on DTensors each
    gradient comes out with its parameter's placements."""
    h = np.tanh(x @ p["w1"] + p["b1"])
    z = h @ p["w2"]
    if isinstance(z, DTensor):
        z = ROWWISE.prepare_output(z)  # Partial -> Replicate: Megatron's one forward all-reduce
    dy = (z + p["b2"] - t) / x.shape[0]
    dz = (dy @ p["w2"].T) * (1 - h ** 2)
    return [("w2", h.T @ dy), ("b2", dy.sum(axis=0)), ("w1", x.T @ dz), ("b1", dz.sum(axis=0))]


def reference(steps: int = STEPS) -> dict[str, np.ndarray]:
    params, opt = init_params(), SGD(lr=0.2, momentum=0.9)
    for step in range(steps):
        grads = dict(grads_in_backward_order(params, *data(step)))
        clip_grad_norm_(grads, MAX_NORM)
        opt.step(params, grads)
    return params


def _xp(device: str):
    """NumPy for a ``cpu`` mesh, CuPy (tests/fake_cupy.py's, where installed) for a ``cuda`` one."""
    if device == "cpu":
        return np
    import cupy

    return cupy


def build(mesh_shape: tuple[int, int], strategy: str = "ddp", device: str = "cpu", **kw):
    """The mesh, the DTensor parameters over its ``tp`` dim and the strategy over ``dp``."""
    mesh = meshkit.init_device_mesh(device, mesh_shape, mesh_dim_names=("dp", "tp"))
    xp = _xp(device)
    params = parallelize({n: xp.asarray(p) for n, p in init_params().items()}, mesh["tp"], PLAN)
    if strategy == "ddp":
        return mesh, DistributedDataParallel(params, mesh=mesh["dp"], bucket_cap_mb=1e-4, first_bucket_cap_mb=5e-5,
                                             **kw)
    return mesh, ZeroRedundancyOptimizer(params, SGD(lr=0.2, momentum=0.9), mesh=mesh["dp"],
                                         stage=int(strategy[-1]), bucket_cap_mb=1e-4, first_bucket_cap_mb=5e-5)


def steps(mesh, model, opt, first: int, last: int, *, blocks: bool = False) -> list[dict]:
    """Train steps ``first..last-1``; return each step's gradients' (type, placements).

    ``blocks``: hand DDP each gradient's block (``to_local()``) instead of the DTensor.
    """
    dp, tp = mesh["dp"], mesh["tp"]
    xp = _xp(mesh.device_type)
    seen = []
    for step in range(first, last):
        x, t = (xp.asarray(np.array_split(a, dp.size())[dp.get_local_rank()]) for a in data(step))
        x, t = distribute_tensor(x, tp, [Replicate()]), distribute_tensor(t, tp, [Replicate()])
        model.zero_grad()
        for name, g in grads_in_backward_order(model.params, x, t):
            assert g.placements == PLACEMENTS[name], (name, g.placements)
            model.mark_grad_ready(name, g.to_local() if blocks else g)
        model.finish_gradient_sync()
        seen.append({n: (type(g).__name__, g.placements, g.device_mesh == tp) for n, g in model.grads.items()})
        if opt is None:  # ZeRO: its own optimizer and clipping
            model.clip_grad_norm_(MAX_NORM)
            model.step()
        else:
            clip_grad_norm_(model.grads, MAX_NORM)
            opt.step(model.params, model.grads)
    return seen


def train(mesh_shape: tuple[int, int], strategy: str = "ddp", *, blocks: bool = False, device: str = "cpu", **kw):
    """Train ``STEPS`` steps; returns the full final parameters (NumPy) and the gradients' layouts."""
    mesh, model = build(mesh_shape, strategy, device, **kw)
    opt = SGD(lr=0.2, momentum=0.9) if strategy == "ddp" else None
    params, tp = model.params, mesh["tp"]
    assert {n: (type(p).__name__, p.placements, p.device_mesh == tp) for n, p in params.items()} == \
        {n: ("DTensor", pl, True) for n, pl in PLACEMENTS.items()}
    seen = steps(mesh, model, opt, 0, STEPS, blocks=blocks)
    return {n: to_host(p.full_tensor()) for n, p in model.params.items()}, seen


def resume(mesh_shape: tuple[int, int], strategy: str, ckpt_in, ckpt_out, first: int, last: int) -> dict:
    """Load ``ckpt_in`` (if any) in place through ``get_state_dict``, train steps ``first..last-1``,
    save to ``ckpt_out``; returns the full parameters."""
    from meshkit import checkpoint as dcp

    mesh, model = build(mesh_shape, strategy)
    opt = SGD(lr=0.2, momentum=0.9) if strategy == "ddp" else None
    if ckpt_in is not None:
        sd = dict(zip(("model", "optim"), dcp.get_state_dict(model, opt)))
        assert all(isinstance(v, DTensor) for v in sd["model"].values()) or strategy != "ddp", sd["model"]
        dcp.load(sd, checkpoint_id=ckpt_in)
        dcp.set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    steps(mesh, model, opt, first, last)
    model_sd, optim_sd = dcp.get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt_out)
    return {n: p.full_tensor() for n, p in model.params.items()}


def assert_matches_reference(params: dict, ref: dict) -> None:
    assert list(params) == list(ref)
    for name, want in ref.items():
        np.testing.assert_allclose(params[name], want, rtol=0, atol=1e-10, err_msg=name)


def check(mesh_shape: tuple[int, int], strategy: str = "ddp") -> None:
    """``train`` equals the reference; every gradient a DTensor laid out as its parameter."""
    ref = reference()
    params, seen = train(mesh_shape, strategy)
    assert_matches_reference(params, ref)
    assert all(s == {n: ("DTensor", pl, True) for n, pl in PLACEMENTS.items()} for s in seen), seen
