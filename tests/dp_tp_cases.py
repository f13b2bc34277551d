"""Data parallelism over ``dp`` of tensor-parallel DTensor parameters on a ``dp x tp`` mesh.

A two-layer MLP laid out as Megatron-LM does (``w1``/``b1`` colwise, ``w2`` rowwise, ``b2``
replicated), its hidden width 5 cut unevenly over ``tp`` = 2 (3 + 2 columns, ``torch.chunk``'s
rule), trained with a data-parallel strategy that takes the DTensors themselves; and the same
training in one process on the global batch (the reference). The model code is plain NumPy:
the same functions run on arrays and on DTensors.

Strategies: ``ddp``, ``zero1``, ``zero2`` on a ``(dp, tp)`` mesh; ``fsdp`` (two units, one per
layer) on a ``(dp, tp)`` mesh and ``hsdp`` on a ``(replicate, shard, tp)`` one, each data-parallel
rank taking its share of the global batch in mesh order.
"""

from __future__ import annotations

import numpy as np

import meshkit
from meshkit.parallel import (SGD, DistributedDataParallel, FullyShardedDataParallel, ZeroRedundancyOptimizer,
                              clip_grad_norm_, to_host)
from meshkit.tensor import ColwiseParallel, DTensor, Replicate, RowwiseParallel, Shard, distribute_tensor, parallelize

GLOBAL_BATCH = 12  # divisible by every dp degree used (1, 2, 3, 4)
STEPS = 4
MAX_NORM = 0.5  # small enough that every step clips: the norm over tp and dp matters
ROWWISE = RowwiseParallel(use_local_output=False)
PLAN = {"[wb]1": ColwiseParallel(use_local_output=False), "w2": ROWWISE}
#: what the plan gives each parameter, and so each gradient
PLACEMENTS = {"w1": (Shard(1),), "b1": (Shard(0),), "w2": (Shard(0),), "b2": (Replicate(),)}
#: FSDP's units: one per layer
UNITS = [["w1", "b1"], ["w2", "b2"]]


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
    """NumPy for a ``cpu`` mesh, CuPy (tests/doubles/fake_cupy.py's, where installed) for a ``cuda`` one."""
    if device == "cpu":
        return np
    import cupy

    return cupy


def build_mesh(mesh_shape: tuple[int, ...], strategy: str = "ddp", device: str = "cpu") -> meshkit.DeviceMesh:
    """``(dp, tp)``, or ``(replicate, shard, tp)`` for hsdp."""
    names = ("replicate", "shard", "tp") if strategy == "hsdp" else ("dp", "tp")
    return meshkit.init_device_mesh(device, mesh_shape, mesh_dim_names=names)


def dp_mesh(mesh: meshkit.DeviceMesh) -> meshkit.DeviceMesh:
    """The data-parallel part of the mesh: 1-D ``dp``, or HSDP's 2-D ``(replicate, shard)``."""
    return mesh["replicate", "shard"] if mesh.ndim == 3 else mesh["dp"]


def build(mesh_shape: tuple[int, ...], strategy: str = "ddp", device: str = "cpu", **kw):
    """The mesh, the DTensor parameters over its ``tp`` dim and the strategy over the rest."""
    mesh = build_mesh(mesh_shape, strategy, device)
    xp = _xp(device)
    params = parallelize({n: xp.asarray(p) for n, p in init_params().items()}, mesh["tp"], PLAN)
    if strategy == "ddp":
        return mesh, DistributedDataParallel(params, mesh=mesh["dp"], bucket_cap_mb=1e-4, first_bucket_cap_mb=5e-5,
                                             **kw)
    if strategy in ("fsdp", "hsdp"):
        return mesh, FullyShardedDataParallel(params, mesh=dp_mesh(mesh), optimizer=SGD(lr=0.2, momentum=0.9),
                                              units=UNITS, **kw)
    return mesh, ZeroRedundancyOptimizer(params, SGD(lr=0.2, momentum=0.9), mesh=mesh["dp"],
                                         stage=int(strategy[-1]), bucket_cap_mb=1e-4, first_bucket_cap_mb=5e-5)


def _layouts(tensors: dict, tp) -> dict:
    return {n: (type(g).__name__, g.placements, g.device_mesh == tp) for n, g in tensors.items()}


def _fsdp_pass(model: FullyShardedDataParallel, x, t, blocks: bool) -> dict:
    """FSDP's forward and backward: both units gathered, each unit's gradients reduced as soon as
    the backward pass has them all; returns the gathered parameters' layouts."""
    pending = {}
    with model.unshard(0) as first, model.unshard(1) as second:
        params = {**first, **second}
        for name, g in grads_in_backward_order(params, x, t):
            assert g.placements == PLACEMENTS[name], (name, g.placements)
            pending[name] = g.to_local() if blocks else g
            for u, names in enumerate(UNITS):
                if name in names and all(n in pending for n in names):
                    model.reduce_grads(u, {n: pending.pop(n) for n in names})
    return params


def steps(mesh, model, opt, first: int, last: int, *, blocks: bool = False) -> list[dict]:
    """Train steps ``first..last-1``; return each step's gradients' (type, placements) (FSDP's:
    its gathered parameters', FSDP handing out no gradients).

    ``blocks``: hand the strategy each gradient's block (``to_local()``) instead of the DTensor.
    """
    dp, tp = dp_mesh(mesh), mesh["tp"]
    share = int(np.ravel_multi_index(dp.get_coordinate(), dp.shape))  # this rank's part of the global batch
    xp = _xp(mesh.device_type)
    seen = []
    for step in range(first, last):
        x, t = (xp.asarray(np.array_split(a, dp.size())[share]) for a in data(step))
        x, t = distribute_tensor(x, tp, [Replicate()]), distribute_tensor(t, tp, [Replicate()])
        model.zero_grad()
        if isinstance(model, FullyShardedDataParallel):
            seen.append(_layouts(_fsdp_pass(model, x, t, blocks), tp))
            model.clip_grad_norm_(MAX_NORM)
            model.step()
            continue
        for name, g in grads_in_backward_order(model.params, x, t):
            assert g.placements == PLACEMENTS[name], (name, g.placements)
            model.mark_grad_ready(name, g.to_local() if blocks else g)
        model.finish_gradient_sync()
        seen.append(_layouts(model.grads, tp))
        if opt is None:  # ZeRO: its own optimizer and clipping
            model.clip_grad_norm_(MAX_NORM)
            model.step()
        else:
            clip_grad_norm_(model.grads, MAX_NORM)
            opt.step(model.params, model.grads)
    return seen


def full_params(model) -> dict:
    """Every parameter gathered whole (collective over the mesh), in the model's order."""
    if not isinstance(model, FullyShardedDataParallel):
        return {n: p.full_tensor() for n, p in model.params.items()}
    out = {}
    for unit in range(len(model.units)):
        with model.unshard(unit) as params:
            out.update({n: p.full_tensor() for n, p in params.items()})
    return {n: out[n] for n in PLACEMENTS}


def train(mesh_shape: tuple[int, ...], strategy: str = "ddp", *, blocks: bool = False, device: str = "cpu", **kw):
    """Train ``STEPS`` steps; returns the full final parameters (NumPy) and the gradients' layouts."""
    mesh, model = build(mesh_shape, strategy, device, **kw)
    opt = SGD(lr=0.2, momentum=0.9) if strategy == "ddp" else None
    if not isinstance(model, FullyShardedDataParallel):
        assert _layouts(model.params, mesh["tp"]) == {n: ("DTensor", pl, True) for n, pl in PLACEMENTS.items()}
    seen = steps(mesh, model, opt, 0, STEPS, blocks=blocks)
    return {n: to_host(p) for n, p in full_params(model).items()}, seen


def resume(mesh_shape: tuple[int, ...], strategy: str, ckpt_in, ckpt_out, first: int, last: int) -> dict:
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
    return full_params(model)


def assert_matches_reference(params: dict, ref: dict) -> None:
    assert list(params) == list(ref)
    for name, want in ref.items():
        np.testing.assert_allclose(params[name], want, rtol=0, atol=1e-10, err_msg=name)


def check(mesh_shape: tuple[int, ...], strategy: str = "ddp") -> None:
    """``train`` equals the reference; every gradient a DTensor laid out as its parameter."""
    ref = reference()
    params, seen = train(mesh_shape, strategy)
    assert_matches_reference(params, ref)
    assert all(s == {n: ("DTensor", pl, True) for n, pl in PLACEMENTS.items()} for s in seen), seen
