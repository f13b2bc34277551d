"""The planner checked against runs: every data-parallel configuration of the example MLP that fits
this machine, measured step time and memory beside ``meshkit.plan``'s prediction.

Run it by hand with plain ``python`` (it starts one ``meshkit-run -n N`` job per world size itself)::

    python benchmarks/scaling.py --quick                 # 1 and 2 ranks, the shortest run
    python benchmarks/scaling.py                         # 1, 2 and 4 ranks
    python benchmarks/scaling.py --worlds 1,2 --strategies ddp,fsdp --steps 4 --json out.json --plot
    python benchmarks/scaling.py --parts 3d --worlds 2,4 --rounds 3   # tensor and pipeline parallel only

The run is ``--rounds`` rounds; a round is one job per world size, in turn. Each job first
calibrates its world (``meshkit.plan.calibrate`` over a 1-D mesh of every rank), then builds each
strategy with ``examples/mlp.py``'s ``build`` (ddp, zero1, zero2, fsdp; hsdp on every
``replicate x shard`` split), twice: **strong** scaling (the global batch ``--batch`` split over
the ranks) and **weak** scaling (``--batch`` samples per rank). It trains every configuration for
``--warmup`` steps, then ``--steps`` timed steps interleaved: one step of each configuration in
turn, from a configuration that rotates by one a round. A step's time is the slowest rank's (MAX
over ranks of each step), a round's the median over its timed steps, the result the median over
the rounds. The prediction
uses the median of the rounds' calibrations (``Machine.median``, saved as
``scaling_calib_N.json`` beside the result). Rounds interleave the world sizes because this
shared host's speed drifts by 10-30% over minutes: with one job per world size, measured and
calibrated minutes apart, the 1-rank job once ran 1.2x and the 2-rank job 1.5x slower than
predicted, and another run the other way round, which reorders the world sizes' steps
(Spearman's correlation moved from one run to the next). A burst of load then hits every
configuration and world size a little rather than one a lot. Beside it, the
prediction of ``meshkit.plan.estimate(config, model, machine)`` for the MLP described as
``plan.Model`` layers (its exact parameter shapes; forward flops ``2 x fan_in x fan_out`` per sample;
activations ``fan_out`` values per sample, each a ``tanh`` but the last layer's). ``measured_bytes`` is the rank's params + grads +
optimizer state from ``memory_report()`` (the largest over ranks), ``predicted_bytes`` the same
sum of the prediction.

The summary prints the planner's acceptance figures from this one run: Spearman's rank
correlation of predicted vs measured step times (over every record and over those that do not
oversubscribe the cores), whether the configuration the planner ranks first is within 10% of the
fastest measured (per world size and scaling mode), and the count of memory mismatches.

Tensor and pipeline parallelism (``--parts 3d``, run by default beside ``dp``) run
``examples/train_3d.py``'s model and step (its ``setup``: the same MLP as Megatron blocks over
``tp``, stages over ``pp`` under a schedule with ``--microbatches``, a strategy over ``dp``) on every
``pp x dp x tp`` mesh of 2 and 4 ranks with ``pp`` or ``tp`` above 1: ``gpipe`` and ``1f1b`` where
``dp`` is 1, ``1f1b`` with every data-parallel strategy of train_3d (ddp, zero1, zero2, fsdp) where
it is 2; predicted by ``estimate`` for ``train_3d.plan_model`` (the same layers, with tp's pairing)
and ``Config(loop="whole")`` (train_3d hands every gradient over after the pipelined pass);
``measured_bytes`` is the largest rank's, ``predicted_bytes`` the largest of ``predict_memory``
over the (stage, tp rank) pairs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (_cores, add_output_args, host_metadata, limit_blas_threads, matplotlib_missing,  # noqa: E402
                     png_path, redraw, require_pyplot, save_figure, write_json)

DEFAULT_JSON = ROOT / "benchmarks" / "results" / "scaling.json"
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "hsdp")
MODES = ("strong", "weak")
#: Collective kinds the strategies issue (zero2 reduces; pipelines send and receive).
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "reduce", "send_recv")
PARTS = ("dp", "3d")
#: train_3d.py's data-parallel strategies (no hsdp)
STRATEGIES_3D = ("ddp", "zero1", "zero2", "fsdp")


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _strategies(text: str) -> list[str]:
    values = text.split(",")
    bad = [v for v in values if v not in STRATEGIES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown strategies {bad}; valid: {', '.join(STRATEGIES)}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scaling.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=_ints, default=None, help="world sizes (default: 1,2,4; --quick: 1,2)")
    parser.add_argument("--strategies", type=_strategies, default=list(STRATEGIES), help="default: all")
    parser.add_argument("--modes", type=lambda t: t.split(","), default=list(MODES), help="strong,weak (default)")
    parser.add_argument("--hidden", type=_ints, default=[512, 512, 512], help="MLP hidden sizes (default: 512,512,512)")
    parser.add_argument("--batch", type=int, default=256,
                        help="strong: the global batch; weak: samples per rank (default: %(default)s)")
    parser.add_argument("--parts", type=lambda t: t.split(","), default=list(PARTS),
                        help="dp (examples/mlp.py, data parallel) and/or 3d (examples/train_3d.py, tp and pp with "
                             "dp) (default: dp,3d)")
    parser.add_argument("--microbatches", type=int, default=4, help="3d: pipeline microbatches (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds, each one job per world size (calibrate, then every configuration once), "
                             "interleaved over the world sizes; the median is reported (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps a round (default: 4; --quick: 3)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="steps before timing, each round (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="1 and 2 ranks, 3 steps a round (the shortest run)")
    parser.add_argument("--calib-repeats", type=int, default=5, help="calibrate's repeats (default: %(default)s)")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)  # a job's own records
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)  # the worker's round
    add_output_args(parser, json_help=f"result file (default: {DEFAULT_JSON.relative_to(ROOT)})",
                    json_default=None)
    args = parser.parse_args(argv)
    if args.worlds is None:
        args.worlds = [1, 2] if args.quick else [1, 2, 4]
    if args.steps is None:
        args.steps = 3 if args.quick else 4
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        parser.error(f"argument --modes: unknown {bad}; valid: strong, weak")
    bad = [p for p in args.parts if p not in PARTS]
    if bad:
        parser.error(f"argument --parts: unknown {bad}; valid: dp, 3d")
    for name in ("rounds", "steps", "microbatches"):
        if getattr(args, name) < 1:
            parser.error(f"argument --{name}: must be >= 1, got {getattr(args, name)}")
    error = matplotlib_missing(args)
    if error:
        parser.error(error)
    return args


# --------------------------------------------------------------------------- the model as the planner sees it
def plan_model(hidden: list[int], batch: int) -> Any:
    """examples/mlp.py's MLP (float64, ``w_i: (fan_in, fan_out)``, ``b_i: (fan_out,)``) as plan layers."""
    import mlp
    from meshkit.plan import Layer, Model
    sizes = (mlp.FEATURES, *hidden, mlp.CLASSES)
    last = len(sizes) - 2  # every layer but the last applies tanh to its output
    layers = [Layer(f"l{i}", {"w": (a, b), "b": (b,)}, activation_bytes=8 * b, flops=2 * a * b,
                    pointwise=b if i < last else 0)
              for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))]
    return Model(layers, batch=batch, dtype="float64")


def configurations(n: int, strategies: list[str]) -> list[Any]:
    """Every data-parallel Config of ``n`` ranks (hsdp: every replicate x shard split) for AdamW."""
    from meshkit.plan import Config
    out = []
    for s in strategies:
        if s == "hsdp":
            out += [Config("hsdp", dp_replicate=r, dp_shard=n // r) for r in range(1, n + 1) if n % r == 0]
        else:
            out.append(Config(s, dp_shard=n))
    return out


def configurations_3d(n: int, strategies: list[str], microbatches: int = 4) -> list[Any]:
    """Every ``pp x dp x tp`` Config of ``n`` ranks with ``pp`` or ``tp`` above 1, as train_3d.py
    runs them (AdamW, ``loop="whole"``): gpipe and 1f1b where dp is 1 (the strategy ddp: nothing
    to shard over one rank), 1f1b with each of ``strategies`` train_3d has where dp is above 1."""
    from meshkit.plan import Config
    out = []
    for pp in (d for d in range(1, n + 1) if n % d == 0):
        for tp in (d for d in range(1, n // pp + 1) if (n // pp) % d == 0):
            dp = n // (pp * tp)
            if pp == tp == 1:
                continue
            schedules = ("gpipe", "1f1b") if pp > 1 and dp == 1 else ("1f1b",)
            kinds = ["ddp"] if dp == 1 else [s for s in strategies if s in STRATEGIES_3D]
            out += [Config(s, dp_shard=dp, tp=tp, pp=pp, schedule=sched, microbatches=microbatches if pp > 1 else 1,
                           loop="whole") for sched in schedules for s in kinds]
    return out


def _mesh_name(config: Any) -> str:
    """The line a configuration belongs to in the plot: its strategy (data parallel), or which of
    pp, dp, tp it spans (``tp``, ``pp+tp``, ``pp+dp``...)."""
    if config.tp == 1 and config.pp == 1:
        return config.strategy
    return "+".join(d for d, k in (("pp", config.pp), ("dp", config.dp), ("tp", config.tp)) if k > 1)


# --------------------------------------------------------------------------- one job (under meshkit-run)
def _build(config: Any, hidden: list[int], global_batch: int) -> tuple[Any, Any]:
    """``config`` built with mlp.build, and its pass (forward, loss, backward over this rank's
    share of step ``step``'s global batch)."""
    import meshkit
    import mlp
    rank, n = meshkit.get_rank(), meshkit.get_world_size()
    model = mlp.build(config.strategy, hidden=tuple(hidden), optimizer="adamw", lr=1e-3,
                      hsdp_mesh=(config.dp_replicate, config.dp_shard) if config.strategy == "hsdp" else None)
    x, y = mlp.make_data(global_batch * 4)
    per = global_batch // n

    def run_pass(model: Any, step: int) -> None:
        idx = mlp.batch_indices(step, len(x), global_batch)[rank * per:(rank + 1) * per]
        acts = mlp.forward_layers(model, x[idx])
        _, dlogits = mlp.loss_and_grad_logits(acts[-1], y[idx])
        dlogits = dlogits * (per / global_batch)  # the global mean's gradient
        mlp.backward_layers(model, acts, dlogits)

    return model, run_pass


def _build_3d(config: Any, hidden: list[int], global_batch: int) -> tuple[Any, Any]:
    """``config`` as examples/train_3d.py builds it (``setup``), and its pipelined pass."""
    import meshkit
    import train_3d
    argv = ["--mesh", f"{config.pp}x{config.dp}x{config.tp}", "--dp", config.strategy, "--schedule", config.schedule,
            "--microbatches", str(config.microbatches), "--hidden", ",".join(map(str, hidden)), "--batch",
            str(global_batch), "--samples", str(global_batch * 4), "--optimizer", "adamw", "--lr", "1e-3"]
    args = train_3d.parse_args(argv, rank=meshkit.get_rank(), world_size=meshkit.get_world_size())
    _, model, run_pass = train_3d.setup(args)
    return model, run_pass


def _timed(built: list[tuple[Any, Any]], steps: int, warmup: int, first: int = 0) -> list[tuple[float, int]]:
    """Each ``(model, run_pass)`` of ``built`` trained with the examples' loop step (zero_grad,
    ``run_pass``, step): ``warmup`` steps each, then ``steps`` timed steps interleaved (one step of
    each model in turn, from model ``first`` on), each after a barrier. A burst of load on this
    shared host then lands on one step of many models, not on all the steps of one: the same
    computation measured up to 28% apart when each model ran its steps in a row. Returns, per model, the median
    over its steps of the slowest rank's time and the largest rank's params + grads + optimizer
    state from memory_report()."""
    import numpy as np

    import meshkit
    from meshkit.comm import ReduceOp

    def step(i: int, k: int) -> float:
        model, run_pass = built[i]
        meshkit.barrier()
        t0 = time.perf_counter()
        model.zero_grad()
        run_pass(model, k)
        model.step()
        return time.perf_counter() - t0

    for i in range(len(built)):
        for k in range(warmup):
            step(i, k)
    order = [*range(first, len(built)), *range(first)]
    times = np.zeros((len(built), steps))
    for k in range(steps):
        for i in order:
            times[i, k] = step(i, warmup + k)
    held = np.asarray([sum(m.memory_report()[f] for f in ("params", "grads", "optimizer_state")) for m, _ in built],
                      np.float64)
    meshkit.all_reduce(times, ReduceOp.MAX)
    meshkit.all_reduce(held, ReduceOp.MAX)
    return [(float(np.median(t)), int(h)) for t, h in zip(times, held)]


def _predicted_bytes(model: Any, config: Any) -> int:
    """The largest rank's params + grads + optimizer state: over every (stage, tp rank)."""
    from meshkit.plan import predict_memory
    return max(sum(m[k] for k in ("params", "grads", "optimizer_state"))
               for m in (predict_memory(model, config, s, t) for s in range(config.pp) for t in range(config.tp)))


def jobs_for(n: int, args: argparse.Namespace) -> list[tuple[str, int, Any, Any, Any]]:
    """What a job of ``n`` ranks runs, in order: ``(mode, global batch, Config, plan Model, build
    function)`` for every configuration of ``args`` (the worker measures them, main predicts them)."""
    import train_3d
    jobs = []
    for mode in args.modes:
        global_batch = args.batch if mode == "strong" else args.batch * n
        if "dp" in args.parts:
            model = plan_model(args.hidden, global_batch)
            jobs += [(mode, global_batch, c, model, _build) for c in configurations(n, args.strategies)]
        if "3d" in args.parts:
            jobs += [(mode, global_batch, c, train_3d.plan_model(args.hidden, global_batch, pp=c.pp, tp=c.tp,
                                                                 schedule=c.schedule), _build_3d)
                     for c in configurations_3d(n, args.strategies, args.microbatches)
                     if c.pp <= len(args.hidden) + 1 and global_batch % (c.dp * c.microbatches) == 0]
    return jobs


def worker(args: argparse.Namespace) -> int:
    """One round of one world size (under meshkit-run): calibrate, save the machine as
    ``calib.json`` beside ``--worker``, then build every configuration and train them, their
    steps interleaved (:func:`_timed`); writes
    ``[[step seconds, bytes held], ...]`` in :func:`jobs_for`'s order."""
    limit_blas_threads(1)  # one BLAS thread per rank: the ranks share the cores (benchmarks/_common.py)
    import meshkit
    from meshkit.plan import calibrate
    meshkit.init_process_group("mpi", timeout=120)
    rank, n = meshkit.get_rank(), meshkit.get_world_size()
    mesh = meshkit.init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
    machine = calibrate(mesh, repeats=args.calib_repeats, kinds=KINDS if n > 1 else ("all_reduce",))
    if rank == 0:
        machine.save(args.worker.parent / "calib.json")
    jobs = jobs_for(n, args)
    built = [build(config, args.hidden, global_batch) for _, global_batch, config, _, build in jobs]
    # Where the interleaved steps start rotates by one a round: the configuration trained first
    # after the calibration measured slow in every round (1 rank: ddp strong slower than ddp weak,
    # the same computation), which the median over rounds then drops.
    out = _timed(built, args.steps, args.warmup, first=args.round % len(jobs) if jobs else 0)
    if rank == 0:
        args.worker.write_text(json.dumps(out))
    meshkit.destroy_process_group()
    return 0


def records(n: int, args: argparse.Namespace, rounds: list[list[tuple[float, int]]],
            machine: Any) -> list[dict[str, Any]]:
    """The result rows of world size ``n``: each configuration's rounds (``rounds[r][i]``: round
    ``r``'s step seconds and bytes held of configuration ``i``), their median, and ``estimate``'s
    prediction on ``machine`` (the median of the rounds' calibrations)."""
    from meshkit.plan import estimate
    rows = []
    for i, (mode, global_batch, config, model, _) in enumerate(jobs_for(n, args)):
        measured = [r[i][0] for r in rounds]
        held = max(r[i][1] for r in rounds)
        step_s = statistics.median(measured)
        b = estimate(config, model, machine)
        before = estimate(config, model, dataclasses.replace(machine, overlap=1.0, update_rate={}))
        predicted = _predicted_bytes(model, config)
        rows.append({"config": config.name(), "strategy": config.strategy, "line": _mesh_name(config),
                     "mode": mode, "ranks": n, "pp": config.pp, "dp": config.dp, "tp": config.tp,
                     "schedule": config.schedule if config.pp > 1 else None,
                     "microbatches": config.microbatches, "global_batch": global_batch,
                     "measured_step_s": step_s, "measured_rounds_s": measured, "predicted_step_s": b.step_s,
                     "predicted_compute_s": b.compute_s, "predicted_exposed_comm_s": b.exposed_comm_s,
                     "predicted_optimizer_s": b.optimizer_s, "predicted_comm_s": b.comm_s,
                     "predicted_bubble_s": b.bubble_s, "predicted_before_s": before.step_s,
                     "measured_bytes": held, "predicted_bytes": predicted,
                     "oversubscribed": n > _cores()})
        print(f"{n} ranks {mode:6} {config.name():34} measured {step_s * 1e3:8.2f} ms  predicted "
              f"{b.step_s * 1e3:8.2f} ms  bytes {held} / {predicted}", flush=True)
    return rows


# --------------------------------------------------------------------------- the figures
def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties), numpy only."""
    import numpy as np

    def ranks(v: list[float]) -> Any:
        v = np.asarray(v, float)
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        for value in np.unique(v):  # ties share their mean rank
            r[v == value] = r[v == value].mean()
        return r

    if len(a) < 2:
        return float("nan")
    ra, rb = ranks(a), ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The planner's acceptance figures from ``rows``."""
    fits = [r for r in rows if not r["oversubscribed"]]
    picks = []
    for key in sorted({(r["ranks"], r["mode"]) for r in rows}):
        group = [r for r in rows if (r["ranks"], r["mode"]) == key]
        if len(group) < 2:
            continue
        pick = min(group, key=lambda r: r["predicted_step_s"])
        old = min(group, key=lambda r: r["predicted_before_s"])
        fastest = min(group, key=lambda r: r["measured_step_s"])
        picks.append({"ranks": key[0], "mode": key[1], "pick": pick["config"], "fastest": fastest["config"],
                      "ratio": pick["measured_step_s"] / fastest["measured_step_s"],
                      "ratio_before": old["measured_step_s"] / fastest["measured_step_s"],
                      "oversubscribed": group[0]["oversubscribed"]})
    return {
        "spearman_all": spearman([r["predicted_step_s"] for r in rows], [r["measured_step_s"] for r in rows]),
        "spearman_not_oversubscribed": spearman([r["predicted_step_s"] for r in fits],
                                                [r["measured_step_s"] for r in fits]),
        # the same measurements against the planner's earlier model (full overlap, no optimizer step)
        "spearman_all_before": spearman([r["predicted_before_s"] for r in rows], [r["measured_step_s"] for r in rows]),
        "records": len(rows), "records_not_oversubscribed": len(fits),
        "picks": picks, "picks_within_10pct": sum(p["ratio"] <= 1.10 for p in picks),
        "picks_within_10pct_before": sum(p["ratio_before"] <= 1.10 for p in picks),
        "memory_mismatches": sum(r["measured_bytes"] != r["predicted_bytes"] for r in rows),
    }


def print_summary(s: dict[str, Any], cores: int) -> None:
    print(f"\nSpearman(predicted, measured step time): {s['spearman_all']:.3f} over {s['records']} configurations; "
          f"{s['spearman_not_oversubscribed']:.3f} over the {s['records_not_oversubscribed']} with at most "
          f"{cores} ranks (more ranks than cores oversubscribe: compute and communication contend, which "
          f"the model does not know); {s['spearman_all_before']:.3f} over all for the earlier model "
          f"(full overlap, no optimizer step)")
    for p in s["picks"]:
        note = "  (oversubscribed: this machine cannot say)" if p["oversubscribed"] else ""
        print(f"  {p['ranks']} ranks {p['mode']:6}: planner picks {p['pick']!r}, fastest measured {p['fastest']!r}: "
              f"{p['ratio']:.2f}x{note}")
    print(f"planner's pick within 10% of the fastest measured: {s['picks_within_10pct']} of {len(s['picks'])} "
          f"(the earlier model: {s['picks_within_10pct_before']})")
    print(f"memory mismatches (params + grads + optimizer state, bytes): {s['memory_mismatches']}")


def draw(rows: list[dict[str, Any]], png: Path, title: str) -> None:
    """Time per step and efficiency versus ranks, one line per strategy (the data-parallel ones) or
    per mesh family (tp, pp, dp+tp...: the fastest of its strategies and schedules per world
    size), predictions dashed. Efficiency is against the fastest one-rank step of the mode (all
    one-rank configurations run the same computation): strong ``t1 / (n t)``, weak ``t1 / t``."""
    plt = require_pyplot()
    modes = sorted({r["mode"] for r in rows})
    fig, axes = plt.subplots(2, len(modes), figsize=(7 * len(modes), 9), squeeze=False)
    for col, mode in enumerate(modes):
        ones = [r for r in rows if r["mode"] == mode and r["ranks"] == 1]
        for key in dict.fromkeys(r.get("line", r["strategy"]) for r in rows):  # one line each
            best: dict[int, tuple[float, float]] = {}
            for r in rows:  # the fastest configuration of the line per world size
                n, m, p = r["ranks"], r["measured_step_s"], r["predicted_step_s"]
                if r["mode"] == mode and r.get("line", r["strategy"]) == key and (n not in best or m < best[n][0]):
                    best[n] = (m, p)
            if not best:
                continue
            ns = sorted(best)
            meas, pred = [best[n][0] for n in ns], [best[n][1] for n in ns]
            line, = axes[0][col].plot(ns, [m * 1e3 for m in meas], "o-", label=key)
            axes[0][col].plot(ns, [p * 1e3 for p in pred], "x--", color=line.get_color())
            # the one-rank baseline (the line's own first point scaled by its ranks where there is none)
            base_m = min((r["measured_step_s"] for r in ones), default=meas[0] * ns[0])
            base_p = min((r["predicted_step_s"] for r in ones), default=pred[0] * ns[0])
            scale = ns if mode == "strong" else [1] * len(ns)
            axes[1][col].plot(ns, [base_m / (m * k) for m, k in zip(meas, scale)], "o-", color=line.get_color())
            axes[1][col].plot(ns, [base_p / (p * k) for p, k in zip(pred, scale)], "x--", color=line.get_color())
        worlds = sorted({r["ranks"] for r in rows})
        for ax in (axes[0][col], axes[1][col]):  # rank counts on a log2 axis, ticked where measured
            ax.set_xscale("log", base=2)
            ax.set_xticks(worlds, [str(n) for n in worlds])
            ax.minorticks_off()
        axes[0][col].set(title=f"{mode} scaling (dashed: predicted)", xlabel="ranks", ylabel="ms per step")
        axes[1][col].set(xlabel="ranks", ylabel="efficiency (vs the fastest one-rank step)")
        axes[0][col].legend(fontsize="small", ncol=2)
    save_figure(fig, png, title)


def run_worker(script: str, n: int, forwarded: list[str], tmp: Path, launch: Sequence[str] = ()) -> Any:
    """Run ``script --worker FILE`` as one ``meshkit-run -n n`` job (``launch``: more launcher flags),
    echo its output and return what it wrote to FILE (JSON); a failed job ends the benchmark with
    its exit code and the tail of its errors."""
    part = tmp / "records.json"
    cmd = [sys.executable, "-m", "meshkit.launch", "-n", str(n), *launch, script, "--worker", str(part), *forwarded]
    proc = subprocess.run(cmd, text=True, capture_output=True, timeout=1800)
    print(proc.stdout, end="", flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"{Path(script).name}: the {n}-rank job failed (exit {proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    return json.loads(part.read_text())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args)
    out = args.json or DEFAULT_JSON
    if args.plot_from is not None:
        redraw(args, "scaling", draw, lambda meta: f"scaling, {meta.get('hostname')}")
        return 0
    from meshkit.plan import Machine
    rows: list[dict[str, Any]] = []
    out.parent.mkdir(parents=True, exist_ok=True)
    forwarded = ["--strategies", ",".join(args.strategies), "--modes", ",".join(args.modes), "--hidden",
                 ",".join(map(str, args.hidden)), "--batch", str(args.batch), "--steps", str(args.steps),
                 "--warmup", str(args.warmup), "--calib-repeats", str(args.calib_repeats), "--parts",
                 ",".join(args.parts), "--microbatches", str(args.microbatches)]
    start = time.monotonic()
    measured: dict[int, list[Any]] = {n: [] for n in args.worlds}
    machines: dict[int, list[Any]] = {n: [] for n in args.worlds}
    for r in range(args.rounds):  # round-robin over the world sizes: the host's drift hits each alike
        for n in args.worlds:
            with tempfile.TemporaryDirectory(prefix="meshkit-scaling-") as tmp:
                measured[n].append(run_worker(__file__, n, [*forwarded, "--round", str(r)], Path(tmp)))
                machines[n].append(Machine.load(Path(tmp) / "calib.json"))
            print(f"round {r + 1}/{args.rounds}: {n} ranks calibrated and measured ({time.monotonic() - start:.0f} s)",
                  flush=True)
    for n in args.worlds:
        machine = Machine.median(machines[n], name=f"calibrated ({args.rounds} rounds)")
        machine.save(out.parent / f"scaling_calib_{n}.json")
        rows += records(n, args, measured[n], machine)
    s = summary(rows)
    print_summary(s, _cores())
    print(f"({time.monotonic() - start:.0f} s)")
    write_json(out, host_metadata(benchmark="scaling", summary=s, args={k: str(v) for k, v in vars(args).items()}),
               rows)
    if args.plot is not None:
        draw(rows, png_path(args.plot, out), f"scaling: MLP {args.hidden}, batch {args.batch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
