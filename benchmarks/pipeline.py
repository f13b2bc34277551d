"""Pipeline schedules: step time against the ideal, the bubble against its formula, peak activations.

Run it by hand (a measurement, not a test; nothing here asserts on timings)::

    meshkit-run -n 4 benchmarks/pipeline.py                     # table on rank 0
    meshkit-run -n 4 benchmarks/pipeline.py --plot              # ... and benchmarks/results/pipeline-n4.png
    meshkit-run -n 2 benchmarks/pipeline.py --microbatches 1,2,4,8,16 --forward-ms 4
    python benchmarks/pipeline.py --plot-from benchmarks/results/pipeline-n4.json   # redraw only

Each of the N ranks is one pipeline stage (``v`` = ``--virtual`` stages with the interleaved
schedule). A stage's forward of one microbatch *sleeps* ``--forward-ms`` and its backward twice
that (sleeping, the stages do not compete for the cores, so the bubble is the schedule's, not
the machine's); the interleaved schedule's stages sleep ``1/v`` of that each, the same work per
rank. The zero-bubble schedules split each backward into two halves, the input gradient B and
the weight gradient W (so F = B = W, the paper's assumption), ZB-V's two stages per rank half
of that each. Activations are 1 KB, so transfers cost little beside the compute.

For each schedule and microbatch count m: the step time (median over ``--rounds`` steps, max
over ranks, after a barrier), the ideal ``m (f + b)`` (no idle time), the time a rank really
spent in its stages' passes (``busy``: a sleep lasts a little longer than asked), the measured bubble
``1 - busy / step`` (the idle fraction of the step, transfers included) and the formula's: ``(p - 1) / (m + p - 1)`` for GPipe and 1F1B,
``(p - 1) / (v m + p - 1)`` interleaved, ``i / (3 m + i)`` with ``i = max(p - 1, 2 p - 1 - m)``
for ZB-H1 and ``i / (6 m + i)`` with ``i = max(p - 1, 4 p - 2 - 2 m)`` for ZB-V (those of the
schedules' simulation with equal pass times, :func:`meshkit.parallel.pipelining.schedules.simulate`);
and the peak number of microbatches whose activations
a stage held (1F1B: ``min(p - s, m)`` on stage s; GPipe: ``m``; ZB-H1: up to ``min(p, m)`` on
every stage, from F to W: 1F1B's peak, on more stages). With as many microbatches as
ranks (``m == p``), the interleaved schedule runs every forward first (Megatron-LM's rule): its
ideal bubble is still ``(p - 1) / (v m + p - 1)`` (each rank's forwards follow each other without
a gap, as do its backwards), but every stage holds all ``m`` microbatches, as in GPipe; such
rows say so in their ``note``. The plot has three panels: the bubble against its formula, the
step time against the ideal (and against the ideal over ``1 - formula``), and the peak
activations per stage at the largest m.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import (LOG, add_output_args, barrier, matplotlib_missing, max_over_ranks, median, parse_checked,
                     positive_int_list, print0, redraw, require_pyplot, run_metadata, save_figure, save_results,
                     setup_logging)
from mpi4py import MPI

import meshkit
from meshkit.parallel import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleZBH1,
                              ScheduleZBVZeroBubble, bubble_fraction)

RESULTS = Path(__file__).resolve().parent / "results"
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbh1", "zbv")
WIDTH = 128  # float64 columns of an activation: 1 KB per sample row


def make_stage(index: int, stages: int, f: float, b: float, busy: list[float], *, split: bool = False,
               placement: str = "loop") -> PipelineStage:
    """A stage that sleeps ``f`` per forward and ``b`` per backward, adding the time it really
    slept (a sleep overshoots) to ``busy[0]``; ``split``: the backward in two
    halves of ``b / 2``, the input gradient (B) and the weight gradient (W), for ZB-H1 and ZB-V."""
    def work(seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        busy[0] += time.perf_counter() - start

    # A layer makes new arrays: y is not the received x, nor dx the received dy (the pipeline
    # copes with a stage that returns them, but that is not what this measures). 1 KB a sample.
    def forward(x: Any) -> tuple[Any, Any]:
        work(f)
        return x.copy(), None

    def backward(ctx: Any, dy: Any) -> Any:
        work(b)
        return dy.copy()

    def backward_input(ctx: Any, dy: Any) -> tuple[Any, Any]:
        work(b / 2)
        return dy.copy(), None

    def backward_weight(wctx: Any) -> None:
        work(b / 2)

    if split:
        return PipelineStage(forward, None, index, stages, backward_input=backward_input,
                             backward_weight=backward_weight, placement=placement)
    return PipelineStage(forward, backward, index, stages)


def loss_fn(y: Any, t: Any) -> tuple[float, Any]:
    return 0.0, np.zeros_like(y)


def measure(kind: str, m: int, args: argparse.Namespace, comm: MPI.Comm) -> dict[str, Any]:
    rank, p = comm.Get_rank(), comm.Get_size()
    v = args.virtual if kind == "interleaved" else 2 if kind == "zbv" else 1
    f, b = args.forward_ms / 1000 / v, 2 * args.forward_ms / 1000 / v
    busy = [0.0]
    if kind == "zbv":  # rank r holds stages r and 2p - 1 - r
        stages = [make_stage(s, 2 * p, f, b, busy, split=True, placement="v") for s in (rank, 2 * p - 1 - rank)]
    else:
        stages = [make_stage(rank + k * p, p * v, f, b, busy, split=kind == "zbh1") for k in range(v)]
    if kind == "interleaved":
        schedule: Any = ScheduleInterleaved1F1B(stages, m, loss_fn)
    elif kind == "zbh1":
        schedule = ScheduleZBH1(stages[0], m, loss_fn)
    elif kind == "zbv":
        schedule = ScheduleZBVZeroBubble(stages, m, loss_fn)
    else:
        schedule = (ScheduleGPipe if kind == "gpipe" else Schedule1F1B)(stages[0], m, loss_fn)
    x = np.ones((m, WIDTH)) if rank == 0 else None
    t = np.ones((m, WIDTH)) if any(s.is_last for s in stages) else None
    times, busies = [], []
    for r in range(args.rounds + 1):
        barrier(comm)
        busy[0] = 0.0
        start = time.perf_counter()
        schedule.step(x, target=t)
        elapsed, worked = max_over_ranks(comm, [time.perf_counter() - start, busy[0]])
        if r:  # the first step learns the boundary shapes
            times.append(elapsed)
            busies.append(worked)
    step, worked = median(times), median(busies)
    ideal = m * 3 * args.forward_ms / 1000
    peaks = comm.allgather({s.stage_index: s.peak_live_activations for s in stages})
    note = ("m == p: every forward first (Megatron-LM); bubble formula unchanged, each stage holds all m"
            if kind == "interleaved" and m == p else "")
    return {"schedule": kind, "ranks": p, "virtual": v, "microbatches": m, "step_s": step, "ideal_s": ideal,
            "busy_s": worked, "bubble": 1 - worked / step, "bubble_formula": bubble_fraction(kind, p, m, v),
            "peak_activations": {str(k): n for d in peaks for k, n in sorted(d.items())}, "all_s": times,
            "note": note}


def run(args: argparse.Namespace, comm: MPI.Comm) -> list[dict[str, Any]]:
    rows = []
    p = comm.Get_size()
    for kind in args.schedules:
        for m in args.microbatches:
            if kind == "interleaved" and m % p:
                LOG.info("interleaved skips m=%d (not a multiple of %d ranks)", m, p)
                continue
            rows.append(measure(kind, m, args, comm))
            LOG.info("%s m=%d done", kind, m)
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    out = [f"{'schedule':<12} {'m':>3} {'step ms':>9} {'ideal ms':>9} {'busy ms':>8} {'bubble':>7} {'formula':>8}  "
           "peak activations per stage"]
    for r in rows:
        peaks = " ".join(f"{n}" for _, n in sorted(r["peak_activations"].items(), key=lambda kv: int(kv[0])))
        out.append(f"{r['schedule']:<12} {r['microbatches']:>3} {1e3 * r['step_s']:>9.1f} {1e3 * r['ideal_s']:>9.1f} "
                   f"{1e3 * r['busy_s']:>8.1f} {r['bubble']:>7.3f} {r['bubble_formula']:>8.3f}  {peaks}"
                   + (f"  ({r['note']})" if r.get("note") else ""))
    return out


def plot(rows: list[dict[str, Any]], png: Path, title: str) -> None:
    plt = require_pyplot()
    fig, (bubble, step, peak) = plt.subplots(1, 3, figsize=(15, 4))
    for i, kind in enumerate(SCHEDULES):
        mine = [r for r in rows if r["schedule"] == kind]
        if not mine:
            continue
        ms = [r["microbatches"] for r in mine]
        color = f"C{i}"
        bubble.plot(ms, [r["bubble"] for r in mine], "o-", color=color, label=f"{kind} measured")
        bubble.plot(ms, [r["bubble_formula"] for r in mine], "--", color=color, label=f"{kind} formula")
        step.plot(ms, [1e3 * r["step_s"] for r in mine], "o-", color=color, label=f"{kind} measured")
        step.plot(ms, [1e3 * r["ideal_s"] / (1 - r["bubble_formula"]) for r in mine], "--", color=color,
                  label=f"{kind} ideal / (1 - formula)")
        last = mine[-1]
        stages = sorted(last["peak_activations"].items(), key=lambda kv: int(kv[0]))
        peak.plot([int(k) for k, _ in stages], [n for _, n in stages], "o-", color=color,
                  label=f"{kind}, m = {last['microbatches']}")
    ideal = sorted({(r["microbatches"], r["ideal_s"]) for r in rows})
    step.plot([m for m, _ in ideal], [1e3 * t for _, t in ideal], "k:", label="ideal m (f + b)")
    for ax in (bubble, step):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("microbatches m")
        ax.legend(fontsize="small")
    bubble.set_ylabel("bubble fraction (idle time of a step)")
    step.set_ylabel("step time (ms)")
    peak.xaxis.get_major_locator().set_params(integer=True)
    peak.yaxis.get_major_locator().set_params(integer=True)
    peak.set_xlabel("stage")
    peak.set_ylabel("peak microbatches with live activations")
    peak.legend(fontsize="small")
    save_figure(fig, png, title)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--schedules", type=lambda s: s.split(","), default=list(SCHEDULES),
                   help=f"comma-separated, of {', '.join(SCHEDULES)}")
    p.add_argument("--microbatches", type=positive_int_list("1,2,4,8"), default=[1, 2, 4, 8, 16],
                   help="comma-separated microbatch counts")
    p.add_argument("--forward-ms", type=float, default=2.0, help="a stage's forward per microbatch (backward: 2x)")
    p.add_argument("--virtual", type=int, default=2, help="stages per rank of the interleaved schedule")
    p.add_argument("--rounds", type=int, default=5, help="timed steps per (schedule, m)")
    add_output_args(p, json_help="result file (default benchmarks/results/pipeline-n{N}.json)")
    return p


def _invalid(args: argparse.Namespace) -> str | None:
    bad = [s for s in args.schedules if s not in SCHEDULES]
    if bad:
        return f"--schedules: unknown {bad}; valid: {', '.join(SCHEDULES)}"
    if not args.forward_ms > 0 or args.virtual < 1 or args.rounds < 1:
        return (f"--forward-ms must be > 0 and --virtual, --rounds >= 1, got {args.forward_ms}, {args.virtual}, "
                f"{args.rounds}")
    return matplotlib_missing(args)


def main(argv: list[str] | None = None) -> int:
    comm = MPI.COMM_WORLD.Dup()
    rank, n = comm.Get_rank(), comm.Get_size()
    args = parse_checked(build_parser(), rank, argv, _invalid)
    setup_logging(rank, args.verbose)
    if args.plot_from is not None:
        if rank == 0:
            redraw(args, "pipeline", plot, lambda meta: f"pipeline bubbles, {meta.get('world_size', '?')} ranks")
        comm.Free()
        return 0
    meshkit.init_process_group("mpi", timeout=120)
    started = time.perf_counter()
    try:
        rows = run(args, comm)
    finally:
        meshkit.destroy_process_group()
    meta = run_metadata(comm, benchmark="pipeline", forward_ms=args.forward_ms, virtual=args.virtual,
                        rounds=args.rounds, seconds=time.perf_counter() - started)
    if rank == 0:
        for line in table(rows):
            print0(rank, line)
        save_results(args, RESULTS / f"pipeline-n{n}.json", meta, rows,
                     lambda png: plot(rows, png, f"pipeline bubbles, {n} ranks, f = {args.forward_ms:g} ms, b = 2f"))
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
