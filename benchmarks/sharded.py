"""Step time of every data-parallel strategy of the MLP example, and what FSDP prefetching hides.

Run it by hand (a measurement, not a test; nothing here asserts on timings)::

    meshkit-run -n 4 benchmarks/sharded.py              # table on rank 0
    meshkit-run -n 4 benchmarks/sharded.py --plot       # ... and benchmarks/results/sharded-n4.png
    meshkit-run -n 2 benchmarks/sharded.py --plot
    meshkit-run -n 4 benchmarks/sharded.py --hidden 1024,1024,1024 --rounds 5 --steps 10
    python benchmarks/sharded.py --plot-from benchmarks/results/sharded-n4.json   # redraw only

With the pip-installed ``mpich`` wheel in a venv, use the venv's launcher, e.g.
``/tmp/venv/bin/meshkit-run -n 4 benchmarks/sharded.py --plot``. Results go to
``benchmarks/results/sharded-n{N}.json`` (``--json`` to change) and, with ``--plot``, the PNG
next to it. Each rank's BLAS runs one thread
(set with ``_common.limit_blas_threads``, since ``meshkit-run`` imports NumPy before the script
runs and OpenBLAS reads the variables only at import), so N ranks use N cores.

The model is ``examples/mlp.py``'s tanh MLP made larger (hidden layers ``--hidden``,
default 512,512,512: 538K parameters, 2.1 MB in float32), float32, AdamW, bucket caps 25 MB
(first 1 MB), global batch ``--batch`` 256 split over the ranks. Every strategy is built by
the example's own ``mlp.build(strategy, hidden=...)`` (``examples/mlp.py``, imported by adding
the ``examples`` folder to ``sys.path``), and a step is the example's training step without the
loss all-reduce:
``zero_grad()``, ``forward_layers``, ``loss_and_grad_logits``, ``backward_layers`` (gradients
handed to the strategy layer by layer, last first), ``step()``. Strategies:

* ``compute``: the reference, not a strategy: the example's ``Plain`` model on this rank's share
  of the batch with the same optimizer, no communication at all (the floor of every step);
* ``ddp``, ``zero1``, ``zero2``: ``DistributedDataParallel`` / ``ZeroRedundancyOptimizer``;
* ``fsdp``: ``FullyShardedDataParallel``, one unit per layer, the next unit prefetched while
  the current one runs (the example's loop, ``mlp.forward_layers``/``backward_layers``);
* ``fsdp-noprefetch``: the same, but every unit is gathered only when it is needed (the
  example's loop with ``prefetch=False``);
* ``hsdp``: hybrid sharding on a ``--hsdp-mesh`` (replicate x shard) mesh, by default 2x2 when
  N = 4 (2 x N/2 for any even N >= 4; skipped otherwise).

Each strategy is first checked on a float64 copy of itself: one step from the example's initial
parameters on global batch 0 must give the single-process result on the whole batch to rtol
1e-10, the example's ``--check`` (float64 because AdamW's first step ``g / (|g| + eps)`` makes
float32 rounding of near-zero gradients show up as ~1e-4 relative differences, while hardly
depending on the gradients' scale). The timed instance is then built in ``--dtype`` and run
``--warmup`` (2) untimed steps. Timing:
``--rounds`` rounds (5), in each of which every strategy, in an order rotating from round to
round, runs ``--steps`` (8) steps, each after a barrier (whose waiting ranks yield the core);
a step's time is the MAX over ranks; a strategy's time is the median over its
``rounds x steps`` steps (40 by default; at least 10 are required).

Prefetch: ``hidden = fsdp-noprefetch - fsdp`` (medians), i.e. the gather time that prefetching
takes off the critical path; negative means prefetching cost more than it saved. With more
ranks than cores (4 ranks on a 2-core machine) compute and communication of all ranks share
the cores, so little can be hidden and every step is slowed by the others.

Rank 0 prints the table, shows progress (tqdm when installed), writes the JSON (metadata, one
row per strategy with every step's time, and a ``prefetch`` row) and, with ``--plot``, a PNG:
a bar chart of the median step times, with the 25th-75th percentile as error bars.
"""

from __future__ import annotations

import argparse
import os
import sys

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy: one BLAS thread per rank

import dataclasses  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from _common import (LOG, Progress, add_output_args, barrier, choice_list, limit_blas_threads,  # noqa: E402
                     load_result, matplotlib_missing, max_over_ranks, median, parse_checked, png_path,
                     positive_int_list, print0, require_pyplot, run_metadata, save_figure, setup_logging,
                     write_json)
from mpi4py import MPI  # noqa: E402

import meshkit  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import mlp  # noqa: E402  (the example's model: examples/mlp.py)

RESULTS = Path(__file__).resolve().parent / "results"
#: The check of one float64 step against single-process training (the example's ``--check``).
RTOL = 1e-10
MIN_TIMED_STEPS = 10


# --------------------------------------------------------------------------- strategies
def hsdp_shape(text: str) -> tuple[int, int]:
    replicate, shard = (int(v) for v in text.lower().split("x"))
    return replicate, shard


def build(args: argparse.Namespace, name: str) -> Any:
    """One strategy over all ranks (collective), or the communication-free ``compute`` reference."""
    hidden = tuple(args.hidden)
    if name == "compute":
        params = mlp.init_params(hidden, dtype=np.dtype(args.dtype))
        return mlp.Plain(params, optimizer=mlp.make_optimizer(args.optimizer, args.lr))
    strategy = "fsdp" if name == "fsdp-noprefetch" else name
    model = mlp.build(strategy, hidden=hidden, dtype=args.dtype, optimizer=args.optimizer, lr=args.lr,
                      bucket_cap_mb=args.bucket_cap_mb,
                      hsdp_mesh=hsdp_shape(args.hsdp_mesh) if strategy == "hsdp" else None)
    return model


def train_step(model: Any, x: np.ndarray, y: np.ndarray, prefetch: bool = True) -> float:
    """The example's training step (without the loss all-reduce); ``fsdp-noprefetch`` runs it with
    ``prefetch=False`` (each unit gathered when it is used)."""
    model.zero_grad()
    acts = mlp.forward_layers(model, x, prefetch=prefetch)
    loss, dlogits = mlp.loss_and_grad_logits(acts[-1], y)
    mlp.backward_layers(model, acts, dlogits, prefetch=prefetch)
    model.step()
    return loss


@dataclasses.dataclass
class Batches:
    """This rank's share of every global batch (precomputed: no indexing inside timed steps)."""

    x: list[np.ndarray]
    y: list[np.ndarray]
    global_x: np.ndarray  # batch 0 whole, for the check
    global_y: np.ndarray

    def __len__(self) -> int:
        return len(self.x)


def make_batches(args: argparse.Namespace, rank: int, n: int, count: int) -> Batches:
    x, y = mlp.make_data(args.samples)
    xs, ys = [], []
    for step in range(count):
        idx = np.array_split(mlp.batch_indices(step, args.samples, args.batch), n)[rank]
        xs.append(np.ascontiguousarray(x[idx]))
        ys.append(y[idx])
    first = mlp.batch_indices(0, args.samples, args.batch)
    return Batches(xs, ys, x[first], y[first])


def float64(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "dtype": "float64"})


def reference_step(args: argparse.Namespace, batches: Batches) -> dict[str, np.ndarray]:
    """Single-process training (float64) of one step on the whole of global batch 0."""
    model = build(float64(args), "compute")
    train_step(model, batches.global_x, batches.global_y)
    return model.full_state_dict()["model"]


def check_one_step(args: argparse.Namespace, name: str, batches: Batches, reference: dict[str, np.ndarray],
                   comm: MPI.Comm) -> float | None:
    """Build ``name`` in float64, train one step on batch 0, compare with single-process training.

    In float64, as the example's ``--check``: in float32 AdamW's first step, ``g / (|g| + eps)``,
    turns the rounding of near-zero gradients (summed in another order) into differences of
    up to about 1e-4 relative, and it hardly depends on the gradients' scale, so a float32 check
    would be both noisy and weak. Raises on every rank if any rank is off; returns the worst
    relative difference (the example's measure) over ranks, None for ``compute``.
    """
    if name == "compute":
        return None
    model = build(float64(args), name)
    train_step(model, batches.x[0], batches.y[0], prefetch=name != "fsdp-noprefetch")
    params = model.full_state_dict()["model"]
    atol = RTOL * 1e-2
    worst = max(float(np.max(np.abs(params[k] - reference[k]) / (np.abs(reference[k]) + atol / RTOL)))
                for k in reference)
    ok = all(np.allclose(params[k], reference[k], rtol=RTOL, atol=atol) for k in reference)
    bad = [r for r, good in enumerate(comm.allgather(ok)) if not good]
    worst = max_over_ranks(comm, [worst])[0]
    if bad:
        raise RuntimeError(f"meshkit.bench: {name}: one float64 step differs from single-process training on "
                           f"ranks {bad} (worst relative difference {worst:.2e}, rtol {RTOL:g})")
    return worst


# --------------------------------------------------------------------------- timing
def time_strategies(args: argparse.Namespace, models: dict[str, Any], batches: Batches,
                    comm: MPI.Comm, progress: Progress) -> dict[str, list[float]]:
    """Seconds of every timed step of every strategy: the MAX over ranks, in run order."""
    names = list(models)
    local: dict[str, list[float]] = {name: [] for name in names}
    counter = 0
    for r in range(args.rounds):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]  # rotate: no strategy always runs first
            progress.start_group(f"round {r + 1}/{args.rounds}")
            model = models[name]
            for _ in range(args.steps):
                b = counter % len(batches)
                counter += 1
                barrier(comm)
                start = time.perf_counter()
                train_step(model, batches.x[b], batches.y[b], prefetch=name != "fsdp-noprefetch")
                local[name].append(time.perf_counter() - start)
            progress.step(name)
    flat = max_over_ranks(comm, [t for name in names for t in local[name]])
    steps = args.rounds * args.steps
    return {name: flat[i * steps:(i + 1) * steps] for i, name in enumerate(names)}


def summarize(name: str, times: list[float], check: float | None, n: int) -> dict[str, Any]:
    ms = sorted(t * 1e3 for t in times)
    q = np.percentile(ms, [25, 75])
    return {"section": "step", "strategy": name, "world_size": n, "step_ms": median(ms), "p25_ms": float(q[0]),
            "p75_ms": float(q[1]), "min_ms": ms[0], "max_ms": ms[-1], "steps": len(ms),
            "check_worst_rel_diff": check, "step_ms_all": [t * 1e3 for t in times]}


def prefetch_row(rows: list[dict[str, Any]], times: dict[str, list[float]], args: argparse.Namespace,
                 n: int) -> dict[str, Any] | None:
    if "fsdp" not in times or "fsdp-noprefetch" not in times:
        return None
    t = {r["strategy"]: r["step_ms"] for r in rows}
    per_round = []
    for r in range(args.rounds):
        part = slice(r * args.steps, (r + 1) * args.steps)
        per_round.append((median(times["fsdp-noprefetch"][part]) - median(times["fsdp"][part])) * 1e3)
    hidden = t["fsdp-noprefetch"] - t["fsdp"]
    return {"section": "prefetch", "world_size": n, "fsdp_ms": t["fsdp"], "fsdp_noprefetch_ms": t["fsdp-noprefetch"],
            "hidden_ms": hidden, "hidden_fraction_of_step": hidden / t["fsdp-noprefetch"],
            "hidden_ms_per_round": per_round}


def table(rows: list[dict[str, Any]], pre: dict[str, Any] | None, n: int, meta: dict[str, Any]) -> list[str]:
    base = next((r["step_ms"] for r in rows if r["strategy"] == "compute"), None)
    head = (f"{'strategy':<17}{'median ms':>10}{'p25':>8}{'p75':>8}{'min':>8}{'max':>8}{'steps':>6}"
            f"{'x compute':>10}{'check':>10}")
    lines = [f"step time, {n} ranks ({meta['cores_per_host']} cores/host"
             f"{', oversubscribed' if meta['oversubscribed'] else ''}), MLP {meta['model']}, "
             f"{meta['psi']:,} {meta['dtype']} parameters, {meta['optimizer']}, global batch {meta['batch']}; "
             "MAX over ranks per step, median over steps",
             head, "-" * len(head)]
    for r in rows:
        check = "-" if r["check_worst_rel_diff"] is None else f"{r['check_worst_rel_diff']:.1e}"
        ratio = f"{r['step_ms'] / base:.2f}" if base else "-"
        lines.append(f"{r['strategy']:<17}{r['step_ms']:10.2f}{r['p25_ms']:8.2f}{r['p75_ms']:8.2f}"
                     f"{r['min_ms']:8.2f}{r['max_ms']:8.2f}{r['steps']:6d}{ratio:>10}{check:>10}")
    if pre is not None:
        rounds = ", ".join(f"{v:+.2f}" for v in pre["hidden_ms_per_round"])
        lines.append(f"FSDP prefetch hides {pre['hidden_ms']:+.2f} ms per step "
                     f"({100 * pre['hidden_fraction_of_step']:+.1f}% of the step without prefetch; "
                     f"per round: {rounds} ms)")
    lines.append("check: worst relative difference of one float64 step vs single-process training "
                 f"(must be within rtol {RTOL:g})")
    return lines


# --------------------------------------------------------------------------- plot
def plot(rows: list[dict[str, Any]], pre: dict[str, Any] | None, path: Path, title: str) -> None:
    """Bars: median step time per strategy, 25th-75th percentile as error bars."""
    plt = require_pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(rows) + 2), 4.6))
    names = [r["strategy"] for r in rows]
    medians = [r["step_ms"] for r in rows]
    err = [[r["step_ms"] - r["p25_ms"] for r in rows], [r["p75_ms"] - r["step_ms"] for r in rows]]
    colors = ["tab:gray" if s == "compute" else "tab:red" if s.startswith("fsdp") else
              "tab:purple" if s == "hsdp" else "tab:blue" for s in names]
    bars = ax.bar(range(len(rows)), medians, yerr=err, capsize=4, color=colors, alpha=0.85)
    for bar, value in zip(bars, medians):
        ax.annotate(f"{value:.2f}", (bar.get_x() + bar.get_width() / 2, value), textcoords="offset points",
                    xytext=(10, 2), ha="left", fontsize=8)
    for i, r in enumerate(rows):
        if r["strategy"] == "fsdp-noprefetch":
            bars[i].set_hatch("//")
    ax.set_xticks(range(len(rows)), ["compute\n(no comm)" if s == "compute" else s for s in names])
    ax.set_ylabel("ms per step (MAX over ranks; median, bars p25-p75)")
    if pre is not None:
        ax.set_title(f"FSDP prefetch hides {pre['hidden_ms']:+.2f} ms per step "
                     f"({100 * pre['hidden_fraction_of_step']:+.1f}%)", fontsize="medium")
    ax.set_ylim(bottom=0)
    ax.margins(y=0.15)
    ax.grid(True, axis="y", alpha=0.3)
    save_figure(fig, path, title)


def plot_title(meta: dict[str, Any]) -> str:
    return (f"meshkit data-parallel step time: {meta.get('world_size')} ranks, {meta.get('cores_per_host')} "
            f"cores/host, MLP {meta.get('model')}, {meta.get('dtype')}, {meta.get('optimizer')}, "
            f"batch {meta.get('batch')}")


# --------------------------------------------------------------------------- command line
STRATEGIES = ("compute", "ddp", "zero1", "zero2", "fsdp", "fsdp-noprefetch", "hsdp")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hidden", type=positive_int_list("512,512,512"), default=[512, 512, 512], help="hidden layer widths")
    p.add_argument("--batch", type=int, default=256, help="global batch (divisible by the ranks)")
    p.add_argument("--samples", type=int, default=4096, help="size of the synthetic data set")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP/ZeRO bucket cap (first: min(1, cap))")
    p.add_argument("--strategies", type=choice_list(STRATEGIES, "strategies"), default=None,
                   help=f"subset of {','.join(STRATEGIES)} (default all; hsdp only where a mesh fits)")
    p.add_argument("--hsdp-mesh", default=None, metavar="RxS",
                   help="hsdp's replicate x shard mesh (default 2x(N/2) for even N >= 4, else no hsdp)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=8, help="timed steps per strategy per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per strategy before timing")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any blocking meshkit call waits at most")
    add_output_args(p, json_help="result file (default benchmarks/results/sharded-n{N}.json)")
    return p


def _invalid(args: argparse.Namespace, n: int) -> str | None:
    """The first problem with ``args`` on ``n`` ranks that argparse cannot see, or None.

    Without one, it fills in ``args.hsdp_mesh`` and ``args.strategies`` (:func:`_resolve_strategies`).
    """
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0 or not args.timeout > 0:
        return "--rounds and --steps must be >= 1, --warmup >= 0 and --timeout > 0"
    if args.plot_from is None and args.rounds * args.steps < MIN_TIMED_STEPS:
        return (f"--rounds {args.rounds} x --steps {args.steps} gives {args.rounds * args.steps} timed steps; "
                f"at least {MIN_TIMED_STEPS} are needed")
    if args.batch < n or args.batch % n:
        return f"invalid --batch {args.batch}: it must be a positive multiple of the {n} ranks"
    if not args.bucket_cap_mb > 0:
        return f"invalid --bucket-cap-mb {args.bucket_cap_mb}; it must be > 0"
    return matplotlib_missing(args) or _resolve_strategies(args, n)


def parse_args(rank: int, n: int, argv: list[str] | None = None) -> argparse.Namespace:
    return parse_checked(build_parser(), rank, argv, lambda a: _invalid(a, n))


def _resolve_strategies(args: argparse.Namespace, n: int) -> str | None:
    """Fill in ``args.hsdp_mesh`` and ``args.strategies``; an error message or None."""
    if args.hsdp_mesh is not None:
        try:
            replicate, shard = (int(v) for v in args.hsdp_mesh.lower().split("x"))
        except ValueError:
            return f"invalid --hsdp-mesh {args.hsdp_mesh!r}; write REPLICATExSHARD, e.g. 2x2"
        if replicate < 1 or shard < 1 or replicate * shard != n:
            return f"invalid --hsdp-mesh {args.hsdp_mesh!r}: its {replicate}x{shard} ranks must be the {n} ranks"
    elif n >= 4 and n % 2 == 0:
        args.hsdp_mesh = f"2x{n // 2}"
    if args.strategies is None:
        args.strategies = [s for s in STRATEGIES if s != "hsdp" or args.hsdp_mesh is not None]
    elif "hsdp" in args.strategies and args.hsdp_mesh is None:
        return f"hsdp needs a 2-D mesh: pass --hsdp-mesh RxS with R x S = {n} (none fits by default)"
    return None


def plot_from(args: argparse.Namespace) -> None:
    data = load_result(args.plot_from, "sharded")
    meta = data["metadata"]
    rows = [r for r in data["rows"] if r["section"] == "step"]
    pre = next((r for r in data["rows"] if r["section"] == "prefetch"), None)
    png = png_path(args.plot, args.plot_from)
    plot(rows, pre, png, plot_title(meta))
    LOG.info("wrote %s", png)


def main(argv: list[str] | None = None) -> int:
    comm = MPI.COMM_WORLD.Dup()  # barriers and time reductions: never in meshkit's way
    rank, n = comm.Get_rank(), comm.Get_size()
    args = parse_args(rank, n, argv)
    setup_logging(rank, args.verbose)
    if args.plot_from is not None:
        if rank == 0:
            plot_from(args)
        comm.Free()
        return 0
    blas = limit_blas_threads(1)  # meshkit-run's bootstrap imported NumPy before this script set the variables
    meshkit.init_process_group("mpi", timeout=args.timeout)
    started = time.perf_counter()
    try:
        batches = make_batches(args, rank, n, count=16)
        reference = reference_step(args, batches)
        psi = sum(int(p.size) for p in reference.values())
        models: dict[str, Any] = {}
        checks: dict[str, float | None] = {}
        for name in args.strategies:
            checks[name] = check_one_step(args, name, batches, reference, comm)
            models[name] = build(args, name)
            for step in range(args.warmup):
                train_step(models[name], batches.x[step % len(batches)], batches.y[step % len(batches)],
                           prefetch=name != "fsdp-noprefetch")
            LOG.debug("%s built, checked (worst relative difference %s) and warmed up", name, checks[name])
        show = rank == 0 and not args.no_progress
        with Progress(args.rounds * len(models), enabled=show, unit="block") as progress:
            times = time_strategies(args, models, batches, comm, progress)
    finally:
        meshkit.destroy_process_group()
    rows = [summarize(name, times[name], checks[name], n) for name in args.strategies]
    pre = prefetch_row(rows, times, args, n)
    meta = run_metadata(comm, benchmark="sharded", model="x".join(map(str, args.hidden)), hidden=args.hidden,
                        psi=psi, dtype=args.dtype, optimizer=args.optimizer, lr=args.lr, batch=args.batch,
                        bucket_caps_mb=[args.bucket_cap_mb, min(1.0, args.bucket_cap_mb)],
                        hsdp_mesh=args.hsdp_mesh, strategies=args.strategies, rounds=args.rounds,
                        steps=args.steps, warmup=args.warmup, seconds=time.perf_counter() - started,
                        blas_threads=blas,
                        load_average_1m=os.getloadavg()[0] if hasattr(os, "getloadavg") else None)
    if rank == 0:
        for line in table(rows, pre, n, meta):
            print0(rank, line)
        path = args.json or RESULTS / f"sharded-n{n}.json"
        write_json(path, meta, rows + ([pre] if pre else []))
        LOG.info("wrote %s", path)
        if args.plot is not None:
            png = png_path(args.plot, path)
            plot(rows, pre, png, plot_title(meta))
            LOG.info("wrote %s", png)
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
