"""Ring attention: how much of its communication hides behind its compute.

Run it by hand (a measurement, not a test; nothing here asserts on timings)::

    meshkit-run -n 2 benchmarks/context_parallel.py                     # table on rank 0
    meshkit-run -n 2 benchmarks/context_parallel.py --seq 4096 --heads 8 --plot
    python benchmarks/context_parallel.py --plot-from benchmarks/results/context_parallel-n2.json

Every rank holds ``--seq / N`` tokens of q, k, v (``--batch`` x ``--heads`` x tokens x ``--head-dim``,
float64 by default). For the forward and for the backward, side by side in one run:

* ``compute``: the ring's blockwise attention (the same blocks, masks and log-sum-exp merges, or
  FlashAttention-2 backward blocks), on K/V blocks already at hand: no communication;
* ``comm``: the ring's transfers alone (the same ``isend``/``irecv`` of the same buffers, step by
  step: ``N - 1`` shifts of K and V; the backward adds ``N`` shifts of the dK/dV accumulators);
* ``ring``: ``ring_attention`` / ``ring_attention_backward`` themselves, transfers posted before each
  block's compute and waited after it (the forward includes its one small agreement all-gather);
* ``hidden``: the fraction of the communication that overlapped, ``(compute + comm - ring) / comm``
  (clamped to [0, 1]): 1 when the ring costs no more than its compute;
* ``exposed``: what the ring itself recorded waiting for transfers after computing on a block
  (``ctx.exposed_comm_s``, ``ctx.backward_exposed_comm_s``; slowest rank, median), and ``hidden by
  waits`` = ``1 - exposed / comm``. It needs no difference of two noisy times, so it holds on a shared
  machine where ``hidden`` does not (there compute alone varies by more than the whole of comm). The
  backward's last hop brings each block's dK/dV home after the last compute; its wait also holds any
  lag of the peer that sends it (a rank slowed by another job), which is not transfer time.

Each time is the median over ``--rounds`` of the slowest rank, after a barrier; the three are
timed in turn within each round, so that the noise of a shared machine falls on all three alike. BLAS runs one thread
per rank (``_common.limit_blas_threads``), so N ranks use N cores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from _common import (LOG, add_output_args, barrier, limit_blas_threads, matplotlib_missing, max_over_ranks, median,
                     parse_checked, print0, redraw, require_pyplot, run_metadata, save_figure, save_results,
                     setup_logging)
from mpi4py import MPI

import meshkit
from meshkit.parallel import SequenceSharding, ring_attention, ring_attention_backward, shard_sequence
from meshkit.parallel.context_parallelism.attention import block_backward, block_forward, merge
from meshkit.parallel.context_parallelism.ring import block_pairs

RESULTS = Path(__file__).resolve().parent / "results"


def _timed(fns: dict[str, Callable[[], Any]], comm: MPI.Comm, rounds: int, warmup: int) -> dict[str, float]:
    """Median seconds of each of ``fns`` (slowest rank), the functions interleaved round by round so
    that a burst of noise on a shared machine hits all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(warmup + rounds):
        for name, fn in fns.items():
            barrier(comm)
            start = time.perf_counter()
            fn()
            (elapsed,) = max_over_ranks(comm, [time.perf_counter() - start])
            if r >= warmup:
                times[name].append(elapsed)
    return {name: median(t) for name, t in times.items()}


def _shift(group: Any, bufs: list[Any]) -> list[Any]:
    """One ring step of ``bufs`` (as the ring posts it); returns the received buffers."""
    prev, nxt = (group.rank - 1) % group.size, (group.rank + 1) % group.size
    got = [np.empty_like(b) for b in bufs]
    works = meshkit.batch_isend_irecv([meshkit.P2POp(meshkit.irecv, g, group=group, group_peer=prev) for g in got]
                                      + [meshkit.P2POp(meshkit.isend, b, group=group, group_peer=nxt) for b in bufs])
    for w in works:
        w.wait()
    return got


def measure(args: argparse.Namespace, comm: MPI.Comm) -> list[dict[str, Any]]:
    group = meshkit.new_group(list(range(comm.Get_size())))  # the world's ranks: cp = N
    rank, cp = group.rank, group.size
    dtype = np.dtype(args.dtype)
    rng = np.random.default_rng(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q, k, v, dout = (rng.standard_normal(shape).astype(dtype) for _ in range(4))
    sharding = SequenceSharding(args.seq, cp, args.balanced)
    lq, lk, lv, ldo = (shard_sequence(x, balanced=args.balanced) for x in (q, k, v, dout))
    blocks = {src: (sharding.shard(k, src), sharding.shard(v, src)) for src in range(cp)}
    scale = 1 / np.sqrt(args.head_dim)
    q_pos = sharding.positions(rank)
    sources = [(rank - step) % cp for step in range(cp)]

    def compute_forward() -> None:
        out = np.zeros_like(lq)
        lse = np.full(lq.shape[:-1], -np.inf, dtype)
        for src in sources:
            kb, vb = blocks[src]
            k_pos = sharding.positions(src)
            for rows, cols, kind in block_pairs(sharding, args.causal, rank, src):
                qp, kp = (q_pos[rows], k_pos[cols]) if kind == "partial" else (None, None)
                bo, bl = block_forward(lq[..., rows, :], kb[..., cols, :], vb[..., cols, :], scale, qp, kp)
                out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], bo, bl)

    _, ctx = ring_attention(lq, lk, lv, causal=args.causal, balanced=args.balanced)
    delta = np.sum(ldo * ctx.out, axis=-1)

    def compute_backward() -> None:
        dq = np.zeros_like(lq)
        for src in sources:
            kb, vb = blocks[src]
            k_pos = sharding.positions(src)
            dk, dv = np.zeros_like(kb), np.zeros_like(vb)
            for rows, cols, kind in block_pairs(sharding, args.causal, rank, src):
                qp, kp = (q_pos[rows], k_pos[cols]) if kind == "partial" else (None, None)
                bq, bk, bv = block_backward(lq[..., rows, :], kb[..., cols, :], vb[..., cols, :], ldo[..., rows, :],
                                            ctx.lse[..., rows], delta[..., rows], scale, qp, kp)
                dq[..., rows, :] += bq
                dk[..., cols, :] += bk
                dv[..., cols, :] += bv

    def comm_forward() -> None:
        kv = [lk, lv]
        for _ in range(cp - 1):
            kv = _shift(group, kv)

    def comm_backward() -> None:
        kv, acc = [lk, lv], [np.zeros_like(lk), np.zeros_like(lv)]
        for step in range(cp):
            if step < cp - 1:
                kv = _shift(group, kv)
            acc = _shift(group, acc)

    exposed: dict[str, list[float]] = {"forward": [], "backward": []}

    def ring_forward() -> None:
        _, c = ring_attention(lq, lk, lv, causal=args.causal, balanced=args.balanced)
        exposed["forward"].append(c.exposed_comm_s)

    def ring_backward() -> None:
        ring_attention_backward(ctx, ldo)
        exposed["backward"].append(ctx.backward_exposed_comm_s)

    rows = []
    for phase, compute, transfer, ring in (("forward", compute_forward, comm_forward, ring_forward),
                                           ("backward", compute_backward, comm_backward, ring_backward)):
        t = _timed({"compute": compute, "comm": transfer, "ring": ring}, comm, args.rounds, args.warmup)
        waited = median(max_over_ranks(comm, exposed[phase][args.warmup:]))
        hidden = min(1.0, max(0.0, (t["compute"] + t["comm"] - t["ring"]) / t["comm"])) if t["comm"] > 0 else None
        rows.append({"phase": phase, "ranks": cp, "compute_s": t["compute"], "comm_s": t["comm"], "ring_s": t["ring"],
                     "serial_s": t["compute"] + t["comm"], "hidden": hidden, "exposed_s": waited,
                     "exposed_all_s": max_over_ranks(comm, exposed[phase][args.warmup:]),
                     "hidden_by_waits": max(0.0, 1 - waited / t["comm"]) if t["comm"] > 0 else None,
                     "kv_bytes_per_rank": lk.nbytes + lv.nbytes})
        LOG.info("%s done", phase)
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    out = [f"{'phase':<9} {'ranks':>5} {'compute ms':>11} {'comm ms':>9} {'compute+comm':>13} {'ring ms':>9} "
           f"{'hidden comm':>12} {'exposed ms':>11} {'hidden by waits':>16}"]

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.0f}%"

    for r in rows:
        out.append(f"{r['phase']:<9} {r['ranks']:>5} {1e3 * r['compute_s']:>11.2f} {1e3 * r['comm_s']:>9.2f} "
                   f"{1e3 * r['serial_s']:>13.2f} {1e3 * r['ring_s']:>9.2f} {pct(r['hidden']):>12} "
                   f"{1e3 * r['exposed_s']:>11.3f} {pct(r['hidden_by_waits']):>16}")
    return out


def plot(rows: list[dict[str, Any]], png: Path, title: str) -> None:
    plt = require_pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(rows))
    for i, (key, label) in enumerate((("compute_s", "compute"), ("comm_s", "comm"), ("serial_s", "compute + comm"),
                                      ("ring_s", "ring (overlapped)"))):
        ax.bar(x + 0.2 * i - 0.3, [1e3 * r[key] for r in rows], 0.2, label=label)
    ax.set_xticks(x, [r["phase"] if r["hidden"] is None else f"{r['phase']} ({100 * r['hidden']:.0f}% comm hidden)"
                      for r in rows])
    ax.set_ylabel("ms per call (slowest rank, median)")
    ax.legend(fontsize="small")
    save_figure(fig, png, title)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batch", type=int, default=1, help="batch size")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--seq", type=int, default=2048, help="global sequence length (tokens over all ranks)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension")
    p.add_argument("--dtype", choices=("float64", "float32"), default="float64", help="array dtype")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal attention")
    p.add_argument("--balanced", action=argparse.BooleanOptionalAction, default=True,
                   help="head-tail sharding (each rank one early and one late chunk)")
    p.add_argument("--rounds", type=int, default=5, help="timed calls per measurement")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls first")
    add_output_args(p, json_help="result file (default benchmarks/results/context_parallel-n{N}.json)")
    return p


def _invalid(args: argparse.Namespace, ranks: int) -> str | None:
    if min(args.batch, args.heads, args.seq, args.head_dim, args.rounds) < 1 or args.warmup < 0:
        return "--batch, --heads, --seq, --head-dim and --rounds must be >= 1 and --warmup >= 0"
    if args.seq < (2 * ranks if args.balanced else ranks):
        return f"--seq {args.seq} cannot be split over {ranks} ranks (balanced: 2 chunks a rank)"
    return matplotlib_missing(args)


def main(argv: list[str] | None = None) -> int:
    comm = MPI.COMM_WORLD.Dup()
    rank, n = comm.Get_rank(), comm.Get_size()
    args = parse_checked(build_parser(), rank, argv, lambda a: _invalid(a, n))
    setup_logging(rank, args.verbose)
    title = lambda meta: f"ring attention, {meta.get('world_size', '?')} ranks"  # noqa: E731
    if args.plot_from is not None:
        if rank == 0:
            redraw(args, "context_parallel", plot, title)
        comm.Free()
        return 0
    blas = limit_blas_threads(1)
    meshkit.init_process_group("mpi", timeout=300)
    started = time.perf_counter()
    try:
        rows = measure(args, comm)
    finally:
        meshkit.destroy_process_group()
    meta = run_metadata(comm, benchmark="context_parallel", batch=args.batch, heads=args.heads, seq=args.seq,
                        head_dim=args.head_dim, dtype=args.dtype, causal=args.causal, balanced=args.balanced,
                        rounds=args.rounds, blas=blas, seconds=time.perf_counter() - started)
    if rank == 0:
        print0(rank, f"# ring attention, {n} ranks, {args.batch}x{args.heads} heads x {args.seq} tokens x "
                     f"{args.head_dim}, {args.dtype}, causal={args.causal}, balanced={args.balanced}; time = median "
                     "over rounds of the slowest rank")
        for line in table(rows):
            print0(rank, line)
        save_results(args, RESULTS / f"context_parallel-n{n}.json", meta, rows,
                     lambda png: plot(rows, png, title(meta)))
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
