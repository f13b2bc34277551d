"""Per-rank memory of DDP and ZeRO stages 1, 2 and 3 (FSDP) against the ZeRO paper's formulas.

Run it by hand (a measurement of bytes, not of time; nothing here asserts)::

    python benchmarks/memory.py                      # Ψ ≈ 10M, N = 1, 2, 4, 8; table on stdout
    python benchmarks/memory.py --plot               # ... and benchmarks/results/memory.png
    python benchmarks/memory.py --params 2M --worlds 1,2,4 --plot
    python benchmarks/memory.py --plot-from benchmarks/results/memory.json   # redraw, measure nothing

With the repository's venv: ``/tmp/venv/bin/python benchmarks/memory.py --plot``. It needs no
launcher: every world size runs on meshkit's in-process engine (``meshkit.comm.local.run``, one
thread per rank), since bytes held do not depend on the engine.

The model is a float32 tanh MLP of ``examples/mlp.py`` (20 features, 4 classes) with
``--layers`` hidden layers of one width, chosen so that the parameter count Ψ is as close as it
gets to ``--params`` (default 10M; the exact Ψ is printed and stored), trained with AdamW.
For every strategy and world size N each rank builds the strategy from the same parameters and
runs ONE training step with zero gradients (memory does not depend on values, so no forward or
backward arithmetic is done; AdamW creates its state on its first step). Every strategy is built
by ``meshkit.parallel.data_parallel`` with one unit per layer (as the example) and runs the same
step, the training-loop protocol's: ``zero_grad()``; each unit unsharded in forward order and
again in backward order (no prefetch: at most one unit is full at a time), the backward pass
marking its zero gradients ready (``mark_grad_ready(name, grad)``, one layer's gradients alive at
a time); ``step()``; then ``memory_report()``. What differs is what the strategy holds:

* ``ddp``: ``DistributedDataParallel`` (gradients are views into the buckets), AdamW on every rank;
* ``zero1`` / ``zero2``: ``ZeroRedundancyOptimizer(stage=1|2)``: AdamW's state (and, at stage 2,
  the gradients) sharded; ``unshard`` yields the parameters themselves;
* ``zero3``: ``FullyShardedDataParallel``: each unit gathered while unsharded, its gradients
  reduce-scattered once all are marked.

Rank 0's report (every rank holds the same up to one padding element) gives the columns
``params``, ``grads``, ``optimizer_state`` (the model states: their sum is ``total``) and the
extras, kept apart: ``comm_buffers`` (bytes held for communication after the step: stage 2's
bucket pool, which is allocated once and kept) and ``peak_transient`` (the most held at once
during the step: stage 2's live pool buffers, FSDP's unsharded unit). ``formula`` is the ZeRO
paper's model-state memory for float32 parameters and gradients and Adam's two float32 moments
(K = 8 bytes per parameter), i.e. Rajbhandari et al. 2020 with 4-byte instead of 2-byte
copies and no fp32 master copy:

* DDP 4Ψ + 4Ψ + 8Ψ = 16Ψ;  stage 1 8Ψ + 8Ψ/N;  stage 2 4Ψ + 12Ψ/N;  stage 3 16Ψ/N bytes,

and ``ratio`` is ``total / formula`` (above 1 only by the padding of flat buffers to a multiple
of N). As an independent check of the reports, ``traced`` is what ``tracemalloc`` (which sees
NumPy's allocations) finds still allocated after the step over all N ranks, divided by N, and
``traced peak`` the process's peak during the step divided by N (ranks are threads of one
process that do not peak at the same moment, and the local engine's message copies count, so
it is an upper-bound style figure). ``--no-trace`` turns both off.

Output: the table, ``benchmarks/results/memory.json`` (``--json``: metadata and one row per
strategy and N) and, with ``--plot``, a PNG: bytes per rank against N (log-log), one line per
strategy, the formula dashed; left the model states, right with the extras added.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import re
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy: the ranks are threads; keep BLAS out of the way

import numpy as np  # noqa: E402
from _common import (LOG, Progress, add_output_args, choice_list, host_metadata, load_result,  # noqa: E402
                     matplotlib_missing, png_path, positive_int_list, require_pyplot, save_figure,
                     setup_logging, write_json)

import meshkit  # noqa: E402
from meshkit.comm import local  # noqa: E402
from meshkit.parallel import AdamW, data_parallel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from mlp import CLASSES, FEATURES, init_params  # noqa: E402  (the example's model: examples/mlp.py)

RESULTS = Path(__file__).resolve().parent / "results"
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
LABELS = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3 (FSDP)"}
KEYS = ("params", "grads", "optimizer_state", "comm_buffers", "peak_transient")
MB = 1 << 20


# --------------------------------------------------------------------------- model
def formula_bytes(strategy: str, psi: int, n: int) -> float:
    """The ZeRO paper's model-state bytes per rank (float32 params and grads, Adam's 8 bytes)."""
    return {"ddp": 16 * psi, "zero1": 8 * psi + 8 * psi / n, "zero2": 4 * psi + 12 * psi / n,
            "zero3": 16 * psi / n}[strategy]


def mlp_param_count(width: int, layers: int) -> int:
    """Ψ of the example's MLP with ``layers`` hidden layers of ``width``."""
    sizes = (FEATURES, *([width] * layers), CLASSES)
    return sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))


def width_for(target: int, layers: int) -> int:
    """The hidden width whose Ψ is closest to ``target``."""
    a, b = layers - 1, FEATURES + CLASSES + layers
    guess = (target / b) if a == 0 else (-b + math.sqrt(b * b + 4 * a * target)) / (2 * a)
    candidates = {max(1, math.floor(guess)), max(1, math.ceil(guess))}
    return min(candidates, key=lambda w: abs(mlp_param_count(w, layers) - target))


# --------------------------------------------------------------------------- one rank
#: The protocol's name (``data_parallel``'s) of each strategy measured here.
PROTOCOL_NAMES = {"ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "zero3": "fsdp"}


def rank_step(strategy: str, template: dict[str, np.ndarray], layers: int,
              bucket_cap_mb: float = 25.0) -> tuple[dict[str, int], Any]:
    """Build ``strategy`` on this rank, run one zero-gradient step, return (report, the strategy).

    The strategy is returned so that its memory is still allocated when the caller reads
    ``tracemalloc``; the per-rank copy of the parameters is dropped unless the strategy keeps it
    (DDP trains the dict it is given in place).
    """
    n = meshkit.get_world_size()
    mesh = meshkit.init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
    params = {name: p.copy() for name, p in template.items()}
    shapes = {name: (p.shape, p.dtype) for name, p in params.items()}
    units = [[f"w{i}", f"b{i}"] for i in range(layers + 1)]
    options = {} if strategy == "zero3" else \
        {"bucket_cap_mb": bucket_cap_mb, "first_bucket_cap_mb": min(1.0, bucket_cap_mb)}  # as the example
    model = data_parallel(params, mesh, PROTOCOL_NAMES[strategy], optimizer=AdamW(lr=1e-3, weight_decay=0.01),
                          units=units, **options)
    del params
    model.zero_grad()
    for u in range(len(units)):                    # forward
        with model.unshard(u):
            pass
    for u in reversed(range(len(units))):          # backward: FSDP gathers again; zero gradients, last layer first
        with model.unshard(u):
            grads = {name: np.zeros(*shapes[name]) for name in reversed(units[u])}
        for name, g in grads.items():
            model.mark_grad_ready(name, g)
        del grads
    model.step()
    return model.memory_report(), model


def measure(strategy: str, n: int, template: dict[str, np.ndarray], layers: int, trace: bool,
            bucket_cap_mb: float) -> dict[str, Any]:
    """One strategy at world size ``n`` on the local engine: rank 0's report and the traced bytes."""
    gc.collect()
    if trace:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    results = local.run(rank_step, n, strategy, template, layers, bucket_cap_mb)
    seconds = time.perf_counter() - start
    row: dict[str, Any] = {"strategy": strategy, "world_size": n, "seconds": seconds}
    if trace:
        gc.collect()
        live, peak = tracemalloc.get_traced_memory()
        row["traced_bytes"] = (live - base) / n
        row["traced_peak_bytes"] = (peak - base) / n
    reports = [r for r, _ in results]
    del results
    report = reports[0]
    row.update({key: int(report[key]) for key in KEYS})
    row["total_bytes"] = report["params"] + report["grads"] + report["optimizer_state"]
    row["extra_bytes"] = max(report["comm_buffers"], report["peak_transient"])
    row["max_total_over_ranks"] = max(r["params"] + r["grads"] + r["optimizer_state"] for r in reports)
    return row


# --------------------------------------------------------------------------- table
def table(rows: list[dict[str, Any]], psi: int) -> list[str]:
    trace = "traced_bytes" in rows[0]
    head = (f"{'strategy':<14}{'N':>3}{'params':>9}{'grads':>9}{'optim':>9}{'total':>9}{'formula':>9}"
            f"{'ratio':>8}{'comm_buf':>10}{'peak_tr':>9}" + (f"{'traced':>9}{'tr.peak':>9}" if trace else ""))
    lines = [f"per-rank MB (MiB, 2^20 bytes); Ψ = {psi:,} float32 parameters ({4 * psi / MB:.1f} MB), AdamW",
             head, "-" * len(head)]
    for r in rows:
        mb = lambda v: f"{v / MB:9.2f}"  # noqa: E731
        line = (f"{LABELS[r['strategy']]:<14}{r['world_size']:>3}{mb(r['params'])}{mb(r['grads'])}"
                f"{mb(r['optimizer_state'])}{mb(r['total_bytes'])}{mb(r['formula_bytes'])}{r['ratio']:8.4f}"
                f"{r['comm_buffers'] / MB:10.2f}{mb(r['peak_transient'])}")
        if trace:
            line += f"{mb(r['traced_bytes'])}{mb(r['traced_peak_bytes'])}"
        lines.append(line)
    lines.append("total = params + grads + optim; formula: DDP 16Ψ, ZeRO-1 8Ψ+8Ψ/N, ZeRO-2 4Ψ+12Ψ/N, "
                 "ZeRO-3 16Ψ/N; comm_buf and peak_tr are extras, not in total")
    if trace:
        lines.append("traced: tracemalloc's live bytes after the step / N; tr.peak: the process peak during "
                     "the step / N (includes the local engine's message copies)")
    return lines


# --------------------------------------------------------------------------- plot
def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Bytes per rank vs N, one line per strategy, the formula dashed; right: with the extras."""
    plt = require_pyplot()
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), sharey=True)
    worlds = sorted({r["world_size"] for r in rows})
    colors = dict(zip(STRATEGIES, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    values: list[float] = []
    for ax, extras in zip(axes, (False, True)):
        for s in STRATEGIES:
            mine = sorted((r for r in rows if r["strategy"] == s), key=lambda r: r["world_size"])
            if not mine:
                continue
            ns = [r["world_size"] for r in mine]
            measured = [(r["total_bytes"] + (r["extra_bytes"] if extras else 0)) / MB for r in mine]
            ax.plot(ns, measured, marker="o", markersize=7, linewidth=4, alpha=0.45, color=colors[s],
                    label=LABELS[s] + (" + extras" if extras else " measured"))
            ax.plot(ns, [r["formula_bytes"] / MB for r in mine], linestyle="--", linewidth=1.5, color=colors[s],
                    marker="x", zorder=3, label=f"{LABELS[s]} formula")
            values += measured + [r["formula_bytes"] / MB for r in mine]
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(FixedLocator(worlds))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.set_xlabel("ranks N")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="x-small", ncol=2, loc="lower left")
    lo, hi = min(values), max(values)
    ticks = [t for t in (2.0 ** e for e in range(-10, 40)) if lo / 2 <= t <= hi * 2]
    for ax in axes:
        ax.yaxis.set_major_locator(FixedLocator(ticks))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.set_ylim(lo / 1.25, hi * 1.25)
    axes[0].set_ylabel("MB per rank (MiB; log scale)")
    axes[0].set_title("model states: params + grads + AdamW state", fontsize="medium")
    axes[1].set_title("plus extras: ZeRO-2 bucket pool, FSDP unsharded unit", fontsize="medium")
    save_figure(fig, path, title)


def plot_title(meta: dict[str, Any]) -> str:
    return (f"meshkit per-rank memory, Ψ = {meta['psi']:,} float32 parameters "
            f"(MLP {meta['layers']} x {meta['width']}), AdamW")


# --------------------------------------------------------------------------- command line
def parse_count(text: str) -> int:
    """``10M``, ``2.5M``, ``500K``, ``1G`` or a plain integer: a count in decimal multiples."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([KMG]?)\s*", text, re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}; write e.g. 10M, 2.5M, 500K or 1000000")
    value = float(match.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}[match.group(2).upper()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}; it must be at least 1")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--params", type=parse_count, default=10_000_000,
                   help="target parameter count Ψ (decimal: 10M = 10,000,000); the hidden width is chosen to reach it")
    p.add_argument("--layers", type=int, default=3, help="hidden layers of the MLP")
    p.add_argument("--worlds", type=positive_int_list("1,2,4,8"), default=[1, 2, 4, 8], help="world sizes N")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0,
                   help="DDP/ZeRO bucket cap (first bucket: min(1, cap)); sets the size of ZeRO-2's bucket pool")
    p.add_argument("--strategies", type=choice_list(STRATEGIES, "strategies"), default=list(STRATEGIES),
                   help="strategies to measure")
    p.add_argument("--no-trace", action="store_true", help="skip the tracemalloc cross-check (faster)")
    add_output_args(p, json_help="result file", json_default=RESULTS / "memory.json")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.layers < 1:
        p.error(f"invalid --layers {args.layers}; it must be >= 1")
    if not args.bucket_cap_mb > 0:
        p.error(f"invalid --bucket-cap-mb {args.bucket_cap_mb}; it must be > 0")
    error = matplotlib_missing(args)
    if error:
        p.error(error)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(0, args.verbose)
    if args.plot_from is not None:
        data = load_result(args.plot_from, "memory")
        png = png_path(args.plot, args.plot_from)
        plot(data["rows"], png, plot_title(data["metadata"]))
        LOG.info("wrote %s", png)
        return 0

    width = width_for(args.params, args.layers)
    psi = mlp_param_count(width, args.layers)
    LOG.info("model: MLP %d -> %d x %d -> %d, Ψ = %s float32 parameters (target %s)", FEATURES, args.layers,
             width, CLASSES, f"{psi:,}", f"{args.params:,}")
    template = init_params(hidden=(width,) * args.layers, dtype=np.float32)
    trace = not args.no_trace
    warm = init_params(hidden=(8,) * args.layers, dtype=np.float32)
    for strategy in args.strategies:  # untraced: imports, thread-locals and other one-time allocations
        local.run(rank_step, 2, strategy, warm, args.layers)
    if trace:
        tracemalloc.start()
    rows: list[dict[str, Any]] = []
    jobs: list[tuple[str, int]] = [(s, n) for s in args.strategies for n in args.worlds]
    started = time.perf_counter()
    with Progress(len(jobs), enabled=not args.no_progress, unit="run") as progress:
        for strategy, n in jobs:
            progress.start_group(LABELS[strategy])
            row = measure(strategy, n, template, args.layers, trace, args.bucket_cap_mb)
            row["psi"] = psi
            row["formula_bytes"] = formula_bytes(strategy, psi, n)
            row["ratio"] = row["total_bytes"] / row["formula_bytes"]
            rows.append(row)
            LOG.debug("%s N=%d: %s (%.1f s)", strategy, n, row, row["seconds"])
            progress.step(f"N={n}")
    if trace:
        tracemalloc.stop()
    for line in table(rows, psi):
        print(line, flush=True)
    meta = host_metadata(benchmark="memory", engine="local (threads)", psi=psi, target_params=args.params,
                         layers=args.layers, width=width, dtype="float32", optimizer="AdamW",
                         worlds=args.worlds, strategies=args.strategies, traced=trace,
                         fsdp_units="one per layer, no prefetch",
                         bucket_caps_mb=[args.bucket_cap_mb, min(1.0, args.bucket_cap_mb)],
                         seconds=time.perf_counter() - started)
    write_json(args.json, meta, rows)
    LOG.info("wrote %s", args.json)
    if args.plot is not None:
        png = png_path(args.plot, args.json)
        plot(rows, png, plot_title(meta))
        LOG.info("wrote %s", png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
