"""ZeRO-1/2, FSDP and HSDP trained on ddp_cases' model against single-process training.

Every step accumulates two micro-batches. Two configurations: "mixed" (float32 and float64
parameters, no clipping) and "clipped" (all float64, clipping by the global norm: clipping scales
every gradient by one coefficient, so with a float32 parameter its float32 rounding would reach
the float64 parameters and hide errors below 1e-8). Flat-parameter strategies
update a parameter without a gradient with a zero gradient (as torch's flat-parameter FSDP
does), so the reference gives the unused parameter zeros too.
"""

from __future__ import annotations

import contextlib

import numpy as np

import ddp_cases
import meshkit
from meshkit.parallel import (SGD, AdamW, FullyShardedDataParallel, ZeroRedundancyOptimizer,
                              array_namespace, clip_grad_norm_)

MICRO = 2
MAX_NORM = 1.0
CONFIGS = {"mixed": {"mixed": True, "clip": False}, "clipped": {"mixed": False, "clip": True}}
UNITS = [["w1", "b1", "scale"], ["w32"], ["big", "unused"]]


def make_opt(kind: str):
    return AdamW(lr=0.01, weight_decay=0.01) if kind == "adamw" else SGD(lr=0.1, momentum=0.9)


def micro_batch(step: int, m: int, rank: int = 0, n: int = 1, xp=np):
    return [xp.asarray(np.array_split(np.array_split(a, MICRO)[m], n)[rank]) for a in ddp_cases.data(step)]


def local_grads(params, step: int, m: int, rank: int = 0, n: int = 1) -> dict[str, np.ndarray]:
    """This rank's share of micro-batch m's gradients, scaled by 1/MICRO, unused ones zero."""
    xp = array_namespace(params["unused"])
    grads = {name: (g / MICRO).astype(g.dtype)
             for name, g in ddp_cases.grads_in_backward_order(params, *micro_batch(step, m, rank, n, xp))}
    grads["unused"] = xp.zeros_like(params["unused"])
    return grads


def reference(kind: str, config: str = "mixed", steps: int = ddp_cases.STEPS) -> dict[str, np.ndarray]:
    params, opt = ddp_cases.init_params(CONFIGS[config]["mixed"]), make_opt(kind)
    for step in range(steps):
        grads = {name: np.zeros_like(p) for name, p in params.items()}
        for m in range(MICRO):
            for name, g in local_grads(params, step, m).items():
                grads[name] += g
        if CONFIGS[config]["clip"]:
            clip_grad_norm_(grads, MAX_NORM)
        opt.step(params, grads)
    return params


def ddp_steps(ddp, opt, steps) -> None:
    """Train DDP (built over ddp_cases.init_params) for ``steps``, MICRO accumulated micro-batches each."""
    rank, n = meshkit.get_rank(), meshkit.get_world_size()
    for step in steps:
        ddp.zero_grad()
        for m in range(MICRO):
            with ddp.no_sync() if m < MICRO - 1 else contextlib.nullcontext():
                for name, g in local_grads(ddp.params, step, m, rank, n).items():
                    ddp.mark_grad_ready(name, g)
                ddp.finish_gradient_sync()
        opt.step(ddp.params, ddp.grads)


def train_zero(stage: int, kind: str, config: str = "mixed", steps=range(ddp_cases.STEPS), state=None, xp=np,
               setup=None):
    rank, n = meshkit.get_rank(), meshkit.get_world_size()
    zero = ZeroRedundancyOptimizer(ddp_cases.init_params(CONFIGS[config]["mixed"], xp), make_opt(kind), stage=stage, bucket_cap_mb=1 / 1024,
                                   first_bucket_cap_mb=0.25 / 1024, find_unused_parameters=True)
    if state is not None:
        zero.load_full_state_dict(state)
    if setup is not None:  # e.g. load a sharded checkpoint into it
        setup(zero)
    norms = []
    for step in steps:
        zero.zero_grad()
        for m in range(MICRO):
            with zero.no_sync() if m < MICRO - 1 else contextlib.nullcontext():
                for name, g in local_grads(zero.params, step, m, rank, n).items():
                    if name != "unused":
                        zero.mark_grad_ready(name, g)
                zero.finish_gradient_sync()
        if CONFIGS[config]["clip"]:
            norms.append(zero.clip_grad_norm_(MAX_NORM))
        zero.step()
    return zero.full_state_dict(), norms


def train_fsdp(kind: str, config: str = "mixed", mesh_shape=None, steps=range(ddp_cases.STEPS), state=None, xp=np,
               setup=None):
    rank, n = meshkit.get_rank(), meshkit.get_world_size()
    shape = mesh_shape or (n,)
    device = "cpu" if xp is np else "cuda"
    mesh = meshkit.init_device_mesh(device, shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
    fsdp = FullyShardedDataParallel(ddp_cases.init_params(CONFIGS[config]["mixed"], xp), mesh=mesh, optimizer=make_opt(kind), units=UNITS)
    if state is not None:
        fsdp.load_full_state_dict(state)
    if setup is not None:
        setup(fsdp)
    norms = []
    for step in steps:
        fsdp.zero_grad()
        for m in range(MICRO):
            full = {}
            for u in range(len(UNITS)):
                if u + 1 < len(UNITS):
                    fsdp.prefetch(u + 1)
                with fsdp.unshard(u) as p:
                    full.update({k: v.copy() for k, v in p.items()})
            grads = local_grads(full, step, m, rank, n)
            for u, names in enumerate(UNITS):
                fsdp.reduce_grads(u, {k: grads[k] for k in names})
        if CONFIGS[config]["clip"]:
            norms.append(fsdp.clip_grad_norm_(MAX_NORM))
        fsdp.step()
    return fsdp.full_state_dict(), norms


STRATEGIES = {
    "zero1": lambda kind, config="mixed", **kw: train_zero(1, kind, config, **kw),
    "zero2": lambda kind, config="mixed", **kw: train_zero(2, kind, config, **kw),
    "fsdp": lambda kind, config="mixed", **kw: train_fsdp(kind, config, **kw),
}


def assert_matches(params: dict[str, np.ndarray], ref: dict[str, np.ndarray], what: str) -> None:
    for name, expected in ref.items():
        rtol = 1e-5 if expected.dtype == np.float32 else 1e-10
        # relative to the parameter's scale: an element near zero is not held to 1e-10 of itself
        np.testing.assert_allclose(params[name], expected, rtol=rtol, atol=rtol * float(np.abs(expected).max()), err_msg=f"{what} {name}")
        assert params[name].dtype == expected.dtype, (what, name)
