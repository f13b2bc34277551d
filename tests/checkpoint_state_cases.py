"""Resuming from a checkpoint equals training on (issue 23.1), per strategy, on any engine.

A run trains ``ddp_cases``' model (all float64) with two accumulated micro-batches a step;
``Run`` keeps the strategy and its optimizer across steps as a user's loop does. The state dict
is built once before training (the pattern of docs/checkpoints.md) or again at each save, and saved with
``save``, ``async_save`` or ``CheckpointManager.save``; a fresh run loads it and trains on. The
result must equal uninterrupted training to 1e-10, and the resumed run's own next checkpoint
must record the step counts of the steps it took (the dict it loaded into stays live).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import numpy as np

import ddp_cases
import meshkit
import sharded_cases
from meshkit import checkpoint as dcp
from meshkit.parallel import (DistributedDataParallel, FullyShardedDataParallel, ZeroRedundancyOptimizer)

KINDS = ["dict", "ddp", "zero1", "zero2", "fsdp", "hsdp"]
SAVES = ["save", "async_save", "manager"]
PATTERNS = ["once", "each"]


def local_grads(params: dict[str, Any], step: int, m: int) -> dict[str, np.ndarray]:
    return sharded_cases.local_grads(params, step, m, meshkit.get_rank(), meshkit.get_world_size())


def reference(opt: str, steps: int) -> dict[str, np.ndarray]:
    """Single-process training of the all-float64 model for ``steps`` steps."""
    params, optimizer = ddp_cases.init_params(False), sharded_cases.make_opt(opt)
    for step in range(steps):
        grads = {name: np.zeros_like(p) for name, p in params.items()}
        for m in range(sharded_cases.MICRO):
            for name, g in sharded_cases.local_grads(params, step, m).items():
                grads[name] += g
        optimizer.step(params, grads)
    return params


class Run:
    """One strategy and its optimizer, kept across steps."""

    def __init__(self, kind: str, opt: str) -> None:
        self.kind = kind
        params = ddp_cases.init_params(False)
        self.optimizer = sharded_cases.make_opt(opt) if kind in ("dict", "ddp") else None
        if kind == "dict":
            self.strategy: Any = params
        elif kind == "ddp":
            self.strategy = DistributedDataParallel(params, find_unused_parameters=True)
        elif kind.startswith("zero"):
            self.strategy = ZeroRedundancyOptimizer(params, sharded_cases.make_opt(opt), stage=int(kind[-1]),
                                                    bucket_cap_mb=1 / 1024, first_bucket_cap_mb=0.25 / 1024,
                                                    find_unused_parameters=True)
        else:
            n = meshkit.get_world_size()
            shape = (2, n // 2) if kind == "hsdp" else (n,)
            mesh = meshkit.init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
            self.strategy = FullyShardedDataParallel(params, mesh=mesh, optimizer=sharded_cases.make_opt(opt),
                                                     units=sharded_cases.UNITS)

    def state(self) -> dict[str, Any]:
        model, optim = dcp.get_state_dict(self.strategy, self.optimizer)
        return {"model": model, "optim": optim}

    def take(self, state: dict[str, Any]) -> None:
        dcp.set_state_dict(self.strategy, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])

    def step(self, step: int) -> None:
        s, micro = self.strategy, sharded_cases.MICRO
        if self.kind == "dict":
            grads = {name: np.zeros_like(p) for name, p in s.items()}
            for m in range(micro):  # every rank the whole batch: a replicated model, as one process
                for name, g in sharded_cases.local_grads(s, step, m).items():
                    grads[name] += g
            self.optimizer.step(s, grads)
        elif self.kind == "ddp":
            sharded_cases.ddp_steps(s, self.optimizer, [step])
        elif self.kind.startswith("zero"):
            s.zero_grad()
            for m in range(micro):
                with s.no_sync() if m < micro - 1 else contextlib.nullcontext():
                    for name, g in local_grads(s.params, step, m).items():
                        if name != "unused":
                            s.mark_grad_ready(name, g)
                    s.finish_gradient_sync()
            s.step()
        else:
            s.zero_grad()
            for m in range(micro):
                full = {}
                for u in range(len(sharded_cases.UNITS)):
                    with s.unshard(u) as p:
                        full.update({k: v.copy() for k, v in p.items()})
                grads = local_grads(full, step, m)
                for u, names in enumerate(sharded_cases.UNITS):
                    s.reduce_grads(u, {k: grads[k] for k in names})
            s.step()

    def params(self) -> dict[str, np.ndarray]:
        if self.kind in ("dict", "ddp"):
            return {k: np.array(v) for k, v in dict(self.strategy if self.kind == "dict" else
                                                    self.strategy.params).items()}
        return self.strategy.full_state_dict()["model"]


def save(state: dict[str, Any], how: str, directory: Path, step: int) -> None:
    """Save ``state`` as step ``step`` under ``directory`` the way ``how`` says."""
    if how == "save":
        dcp.save(state, checkpoint_id=directory / f"step_{step}")
    elif how == "async_save":
        dcp.async_save(state, checkpoint_id=directory / f"step_{step}").result()
    else:
        dcp.CheckpointManager(directory).save(step, state)


def load(state: dict[str, Any], how: str, directory: Path, step: int) -> None:
    if how == "manager":
        assert dcp.CheckpointManager(directory).restore(state) == step
    else:
        dcp.load(state, checkpoint_id=directory / f"step_{step}")


def train_and_save(kind: str, opt: str, pattern: str, how: str, directory: Path, steps: int = 3) -> None:
    """``steps`` steps of a new run, then a save as step ``steps``."""
    run = Run(kind, opt)
    state = run.state() if pattern == "once" else None
    for step in range(steps):
        run.step(step)
    save(state if pattern == "once" else run.state(), how, directory, steps)


def resume_and_train(kind: str, opt: str, pattern: str, how: str, directory: Path, steps: int = 3
                     ) -> dict[str, np.ndarray]:
    """A fresh run loads step ``steps``, takes ``steps`` more and saves again; returns its
    parameters (the caller checks them against ``2 * steps`` uninterrupted steps)."""
    run = Run(kind, opt)
    state = run.state()  # fresh: zeros and step 0 until the checkpoint is loaded into it
    load(state, how, directory, steps)
    run.take(state)
    for step in range(steps, 2 * steps):
        run.step(step)
    save(state if pattern == "once" else run.state(), how, directory, 2 * steps)
    return run.params()


def resume(kind: str, opt: str, pattern: str, how: str, directory: Path, steps: int = 3) -> dict[str, np.ndarray]:
    """:func:`train_and_save`, then :func:`resume_and_train` in new objects."""
    train_and_save(kind, opt, pattern, how, directory, steps)
    return resume_and_train(kind, opt, pattern, how, directory, steps)


def check(got: dict[str, np.ndarray], opt: str, directory: Path, what: str, steps: int = 3) -> None:
    """``got`` equals ``2 * steps`` uninterrupted steps to 1e-10, and the checkpoints of steps
    ``steps`` and ``2 * steps`` under ``directory`` record those step counts."""
    for name, expected in reference(opt, 2 * steps).items():
        np.testing.assert_allclose(got[name], expected, rtol=1e-10, atol=1e-10 * float(np.abs(expected).max()),
                                   err_msg=f"{what} {name}")
    for step in (steps, 2 * steps):
        values = json.loads((directory / f"step_{step}" / "metadata.json").read_text())["values"]
        counts = {k: v for k, v in values.items() if k.startswith("optim.step.")}
        assert counts and set(counts.values()) == {step}, (what, step, counts)
