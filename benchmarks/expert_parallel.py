"""Expert parallelism: the MoE layer's token dispatch + combine against raw mpi4py ``Alltoallv``.

Run it by hand (a measurement, not a test; nothing here asserts on timings)::

    meshkit-run -n 4 benchmarks/expert_parallel.py                       # table on rank 0
    meshkit-run -n 4 benchmarks/expert_parallel.py --tokens 1024,8192 --dim 1024 --plot
    python benchmarks/expert_parallel.py --plot-from benchmarks/results/expert_parallel-n4.json

Each rank holds ``--tokens`` tokens of ``--dim`` float32 columns and routes each to ``--top-k``
of ``--experts`` experts (uniformly at random, seeded: uneven split sizes), the experts split
evenly over the N ranks (ep = N). Per token count, side by side in one run, each the time of
one dispatch followed by one combine (the same bytes both ways):

* ``meshkit``: what :class:`meshkit.parallel.MoE` does per forward: build the
  ``DispatchPlan`` (one all_gather of the per-expert counts, the capacity cut, the sending order),
  gather the token rows in sending order, ``dispatch`` (``all_to_all_single``, uneven splits; the
  experts run on the rows as received) and ``combine`` (the reverse);
* ``exchange``: the two ``all_to_all_single`` calls alone, on packed buffers, the plan prebuilt
  (meshkit's layer over the engine, no routing bookkeeping);
* ``mpi4py``: two raw ``comm.Alltoallv`` of the same buffers and counts.

A call's time is the MAX over ranks of the per-call mean; the reported time the median over
``--rounds`` rounds, the three interleaved with rotating order. The results are checked once
before timing (combine(dispatch(rows)) returns the rows; the raw exchange receives what
meshkit's does). Ratios: ``meshkit/mpi4py`` and ``exchange/mpi4py`` (the project's target: within 1.1x).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from _common import (LOG, add_output_args, barrier, calibrate_iters, format_size, limit_blas_threads,
                     matplotlib_missing, max_over_ranks, median, parse_checked, positive_int_list, print0, redraw,
                     require_pyplot, run_metadata, save_figure, save_results, setup_logging, time_calls)
from mpi4py import MPI

import meshkit
from meshkit.parallel.expert_parallelism.exchange import DispatchPlan

RESULTS = Path(__file__).resolve().parent / "results"
ENGINES = ("meshkit", "exchange", "mpi4py")


def measure(tokens: int, args: argparse.Namespace, comm: MPI.Comm, group: Any) -> dict[str, Any]:
    rank, n = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(1000 + rank)
    x = rng.standard_normal((tokens, args.dim)).astype(np.float32)
    scores = rng.random((tokens, args.experts))
    indices = np.argsort(scores, axis=1, kind="stable")[:, :args.top_k]  # k distinct random experts

    def plan() -> DispatchPlan:
        return DispatchPlan(indices, args.experts, group, width=args.dim, capacity_factor=args.capacity_factor,
                            who="bench")

    fixed = plan()
    send = np.ascontiguousarray(x[fixed.send_order // args.top_k])
    recv = np.empty((sum(fixed.output_splits), args.dim), np.float32)
    back = np.empty_like(send)
    # Check once: the round trip returns the rows, and raw MPI receives what meshkit does.
    assert np.array_equal(fixed.combine(fixed.dispatch(send)), send)
    mine = np.empty_like(recv)
    group.all_to_all_single(mine, send, fixed.output_splits, fixed.input_splits)
    d = args.dim
    sc, rc = np.array(fixed.input_splits) * d, np.array(fixed.output_splits) * d
    sd, rd = np.cumsum(sc) - sc, np.cumsum(rc) - rc

    def raw() -> None:
        comm.Alltoallv([send, (sc, sd), MPI.FLOAT], [recv, (rc, rd), MPI.FLOAT])
        comm.Alltoallv([recv, (rc, rd), MPI.FLOAT], [back, (sc, sd), MPI.FLOAT])

    raw()
    assert np.array_equal(recv, mine) and np.array_equal(back, send)

    def layer() -> None:
        p = plan()
        p.combine(p.dispatch(x[p.send_order // args.top_k]))

    def exchange() -> None:
        group.all_to_all_single(recv, send, fixed.output_splits, fixed.input_splits)
        group.all_to_all_single(back, recv, fixed.input_splits, fixed.output_splits)

    fns: dict[str, Callable[[], None]] = {"meshkit": layer, "exchange": exchange, "mpi4py": raw}
    iters = args.iters or calibrate_iters(raw, comm, budget_s=0.05, min_iters=3)
    times: dict[str, list[float]] = {e: [] for e in ENGINES}
    for r in range(args.rounds):
        for e in ENGINES[r % 3:] + ENGINES[:r % 3]:  # rotate: no engine always first
            for _ in range(args.warmup):
                fns[e]()
            barrier(comm)
            times[e].append(max_over_ranks(comm, [time_calls(fns[e], iters)])[0])
    sent = int(max_over_ranks(comm, [float(send.nbytes)])[0])
    row = {"tokens": tokens, "dim": args.dim, "experts": args.experts, "top_k": args.top_k, "ranks": n,
           "iters": iters, "max_bytes_sent": sent, **{f"{e}_s": median(times[e]) for e in ENGINES},
           "all_s": times, "dropped": int(fixed.dropped.sum())}
    row["meshkit/mpi4py"] = row["meshkit_s"] / row["mpi4py_s"]
    row["exchange/mpi4py"] = row["exchange_s"] / row["mpi4py_s"]
    return row


def table(rows: list[dict[str, Any]]) -> list[str]:
    out = [f"{'tokens':>7} {'bytes/rank':>10} | {'meshkit us':>10} {'exchange us':>11} {'mpi4py us':>9} | "
           f"{'meshkit/mpi4py':>14} {'exchange/mpi4py':>15}"]
    for r in rows:
        out.append(f"{r['tokens']:>7} {format_size(r['max_bytes_sent']):>10} | {1e6 * r['meshkit_s']:>10.1f} "
                   f"{1e6 * r['exchange_s']:>11.1f} {1e6 * r['mpi4py_s']:>9.1f} | {r['meshkit/mpi4py']:>14.3f} "
                   f"{r['exchange/mpi4py']:>15.3f}")
    return out


def plot(rows: list[dict[str, Any]], png: Path, title: str) -> None:
    plt = require_pyplot()
    fig, (t_ax, r_ax) = plt.subplots(1, 2, figsize=(11, 4))
    xs = [r["tokens"] for r in rows]
    for e in ENGINES:
        t_ax.plot(xs, [1e6 * r[f"{e}_s"] for r in rows], "o-", label=e)
    for key in ("meshkit/mpi4py", "exchange/mpi4py"):
        r_ax.plot(xs, [r[key] for r in rows], "o-", label=key)
    r_ax.axhline(1.1, color="k", ls=":", label="target 1.1")
    for ax in (t_ax, r_ax):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank")
        ax.legend(fontsize="small")
    t_ax.set_yscale("log")
    t_ax.set_ylabel("dispatch + combine (us)")
    r_ax.set_ylabel("time ratio")
    save_figure(fig, png, title)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokens", type=positive_int_list("256,4096"), default=[256, 1024, 4096, 16384],
                   help="comma-separated tokens per rank")
    p.add_argument("--dim", type=int, default=512, help="float32 columns of a token")
    p.add_argument("--experts", type=int, default=8, help="experts in all (divisible by the ranks)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--capacity-factor", type=float, default=None, help="capacity-limited (default: dropless)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (median)")
    p.add_argument("--iters", type=int, default=None, help="calls per round (default: about 50 ms of raw calls)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per round and engine")
    add_output_args(p, json_help="result file (default benchmarks/results/expert_parallel-n{N}.json)")
    return p


def _invalid(args: argparse.Namespace, ranks: int) -> str | None:
    if args.dim < 1 or args.rounds < 1 or args.warmup < 0 or (args.iters is not None and args.iters < 1):
        return "--dim, --rounds, --iters must be >= 1 and --warmup >= 0"
    if args.experts < 1 or args.experts % ranks:
        return f"--experts {args.experts} must be a positive multiple of the {ranks} ranks"
    if not 1 <= args.top_k <= args.experts:
        return f"--top-k {args.top_k} must be in [1, --experts {args.experts}]"
    if args.capacity_factor is not None and not args.capacity_factor > 0:
        return f"--capacity-factor {args.capacity_factor} must be > 0"
    return matplotlib_missing(args)


def main(argv: list[str] | None = None) -> int:
    comm = MPI.COMM_WORLD.Dup()
    rank, n = comm.Get_rank(), comm.Get_size()
    args = parse_checked(build_parser(), rank, argv, lambda a: _invalid(a, n))
    setup_logging(rank, args.verbose)
    if args.plot_from is not None:
        if rank == 0:
            redraw(args, "expert_parallel", plot,
                   lambda meta: f"MoE dispatch + combine, {meta.get('world_size')} ranks")
        comm.Free()
        return 0
    blas = limit_blas_threads(1)
    meshkit.init_process_group("mpi", timeout=300)
    started = time.perf_counter()
    try:
        group = meshkit.new_group(list(range(n)))
        rows = []
        for tokens in args.tokens:
            rows.append(measure(tokens, args, comm, group))
            LOG.info("tokens=%d done", tokens)
    finally:
        meshkit.destroy_process_group()
    meta = run_metadata(comm, benchmark="expert_parallel", blas=blas, capacity_factor=args.capacity_factor,
                        rounds=args.rounds, seconds=time.perf_counter() - started)
    if rank == 0:
        for line in table(rows):
            print0(rank, line)
        save_results(args, RESULTS / f"expert_parallel-n{n}.json", meta, rows,
                     lambda png: plot(rows, png, f"MoE dispatch + combine, {n} ranks, d = {args.dim}"))
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
