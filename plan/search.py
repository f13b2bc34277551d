"""Enumerate the configurations of a world size and rank them by predicted step time."""

from __future__ import annotations

import math
from typing import Sequence

from .estimate import Breakdown, estimate
from .machine import Machine
from .model import SCHEDULES, STRATEGIES, Config, Model

__all__ = ["PlanError", "search", "configurations", "scaling"]


class PlanError(ValueError):
    """What a plan cannot meet (a world size no mesh fits, a memory cap nothing fits), naming the
    closest configuration that can."""


def _divisors(n: int) -> list[int]:
    """The divisors of ``n >= 1`` in increasing order, in ``O(sqrt(n))``."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _tp_degrees(model: Model) -> list[int] | None:
    """The tensor-parallel degrees that divide every ``tp_dim`` size (tensor parallelism shards
    evenly, as Megatron's column/row layers need): the divisors of their gcd; ``[1]`` without a
    ``tp_dim``; None (any degree) when every such size is 0."""
    sizes = [layer.params[p][d] for layer in model.layers for p, d in layer.tp_dim.items()]
    if not sizes:
        return [1]
    g = math.gcd(*sizes)
    return _divisors(g) if g else None


def _mesh_configs(model: Model, pp: int, tp: int, dp: int, *, strategies: Sequence[str], optimizer: str,
                  schedules: Sequence[str], max_microbatch_factor: int) -> list[Config]:
    """The configurations of one ``pp x dp x tp`` mesh (``dp`` divides the batch, ``pp`` at most
    the layers): each schedule and microbatch count that splits the local batch, each strategy."""
    local = model.batch // dp
    pipe = [(s, m) for s in schedules for m in range(pp, max_microbatch_factor * pp + 1, pp)
            if local % m == 0 and pp * (2 if s in ("interleaved", "zbv") else 1) <= len(model.layers)
            ] if pp > 1 else [("1f1b", 1)]  # interleaved and zbv: two stages a rank
    out = []
    for schedule, mb in pipe:
        common = {"tp": tp, "pp": pp, "optimizer": optimizer, "schedule": schedule, "microbatches": mb}
        for strategy in strategies:
            if strategy == "hsdp":
                out += [Config("hsdp", dp_replicate=r, dp_shard=dp // r, **common) for r in _divisors(dp) if 1 < r < dp]
            else:
                out.append(Config(strategy, dp_shard=dp, **common))
    return out


def configurations(model: Model, world_size: int, *, strategies: Sequence[str] = STRATEGIES,
                   optimizer: str = "adamw", schedules: Sequence[str] = ("1f1b",),
                   max_microbatch_factor: int = 4) -> list[Config]:
    """Every valid configuration: ``pp x dp x tp == world_size`` with ``pp`` at most the layers,
    ``tp > 1`` only when some layer has a ``tp_dim`` and ``tp`` divides every ``tp_dim`` size, the batch split evenly over the data-parallel
    ranks and (pipelined) into ``pp``, ``2 pp``... ``max_microbatch_factor * pp`` microbatches;
    every strategy, hsdp for each ``dp_replicate x dp_shard`` with both > 1.

    Cost: ``O(layers x tp degrees)`` whatever ``world_size`` (it enumerates the layers and the
    divisors of the ``tp_dim`` sizes' gcd, never the divisors of ``world_size``)."""
    options = {"strategies": strategies, "optimizer": optimizer, "schedules": schedules,
               "max_microbatch_factor": max_microbatch_factor}
    tps = _tp_degrees(model)
    out = []
    for pp in range(1, min(len(model.layers), world_size) + 1):
        if world_size % pp:
            continue
        rest = world_size // pp
        for tp in tps if tps is not None else _divisors(rest):
            if rest % tp == 0 and model.batch % (rest // tp) == 0:
                out += _mesh_configs(model, pp, tp, rest // tp, **options)
    return out


def _nearest_world_size(model: Model, world_size: int, options: dict) -> int | None:
    """The world size nearest ``world_size`` (the smaller of two as near) that has a configuration.

    Only products ``pp x tp x dp`` (``pp`` at most the layers, ``tp`` a degree of
    :func:`_tp_degrees`, ``dp`` a divisor of the batch) have one, so those are enumerated:
    ``O(layers x tp degrees x batch divisors)``, whatever ``world_size``. (Scanning the world sizes
    around it, each by its own divisors, took 37 s for 16384 ranks.)"""
    best: tuple[int, int] | None = None
    tps = _tp_degrees(model) or [1]  # (None, any degree: search never asks, every world size has one)
    for pp in range(1, len(model.layers) + 1):
        for tp in tps:
            for dp in _divisors(model.batch):
                w = pp * tp * dp
                key = (abs(w - world_size), w)
                if (best is None or key < best) and _mesh_configs(model, pp, tp, dp, max_microbatch_factor=4,
                                                                  **options):
                    best = key
    return best[1] if best else None


def search(model: Model, world_size: int, machine: Machine, memory_cap: int | None = None, *,
           strategies: Sequence[str] = STRATEGIES, optimizer: str = "adamw", schedules: Sequence[str] = ("1f1b",),
           ) -> list[Breakdown]:
    """The valid configurations of ``world_size`` ranks for ``model`` on ``machine``, fastest first,
    each with its :class:`~meshkit.plan.estimate.Breakdown`.

    ``memory_cap`` (bytes per rank; default the machine's ``memory_bytes`` when it has one)
    bounds the predicted params + grads + optimizer state + comm buffers + activations.

    Raises:
        PlanError: no configuration of ``world_size`` ranks (naming the nearest world size that has
            one), or none under ``memory_cap`` (naming the configuration that needs least memory).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PlanError(f"meshkit.plan: world_size must be an integer >= 1, got {world_size!r}")
    bad = [s for s in strategies if s not in STRATEGIES] + [s for s in schedules if s not in SCHEDULES]
    if bad:
        raise PlanError(f"meshkit.plan: unknown strategy or schedule {bad}; strategies are {', '.join(STRATEGIES)}, "
                        f"schedules {', '.join(SCHEDULES)}")
    options = {"strategies": strategies, "optimizer": optimizer, "schedules": schedules}
    configs = configurations(model, world_size, **options)
    if not configs:
        near = _nearest_world_size(model, world_size, options)
        hint = f"; the nearest world size with one is {near}: {configurations(model, near, **options)[0].name()}" \
            if near else ""
        raise PlanError(f"meshkit.plan: no mesh fits world_size={world_size}: the batch {model.batch} must split "
                        f"evenly over the data-parallel ranks, pipeline stages need a layer each "
                        f"({len(model.layers)} layers) and tensor parallelism a layer with tp_dim{hint}")
    ranked = sorted((estimate(c, model, machine) for c in configs), key=lambda b: (b.step_s, b.memory_total))
    cap = memory_cap if memory_cap is not None else (machine.memory_bytes or None)
    if cap is not None:
        fits = [b for b in ranked if b.memory_total <= cap]
        if not fits:
            least = min(ranked, key=lambda b: b.memory_total)
            raise PlanError(f"meshkit.plan: no configuration of {world_size} ranks fits memory_cap={cap} bytes per "
                            f"rank; the closest is {least.config.name()} at {least.memory_total} bytes "
                            f"({least.memory} + activations {least.activation_bytes})")
        ranked = fits
    return ranked


def scaling(model: Model, machine: Machine, world_sizes: Sequence[int], *,
            strategies: Sequence[str] = STRATEGIES, optimizer: str = "adamw") -> list[dict]:
    """Per world size, the fastest configuration of each strategy (and over all of them), with its
    step time, exposed communication and data-parallel efficiency (compute / step): where a
    strategy stops scaling shows as its efficiency falling (docs/planner.md)."""
    rows = []
    for n in world_sizes:
        row: dict = {"ranks": n, "best": None}
        for strategy in strategies:
            try:
                b = search(model, n, machine, strategies=[strategy], optimizer=optimizer)[0]
            except PlanError:
                row[strategy] = None
                continue
            row[strategy] = {"config": b.config.name(), "step_s": b.step_s, "exposed_comm_s": b.exposed_comm_s,
                             "efficiency": b.compute_s / b.step_s, "memory": b.memory_total,
                             "per_device_batch": model.batch // b.config.dp}
            if row["best"] is None or b.step_s < row[row["best"]]["step_s"]:
                row["best"] = strategy
        rows.append(row)
    return rows
