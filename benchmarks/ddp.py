"""DistributedDataParallel: bucketed gradient sync, overlap with the backward pass, bucket-size sweep.

Run it by hand (it is a measurement, not a test; nothing here asserts on timings)::

    meshkit-run -n 4 benchmarks/ddp.py                 # all three sections, table on rank 0
    meshkit-run -n 4 benchmarks/ddp.py --plot          # ... and benchmarks/results/ddp-n4.png
    meshkit-run -n 2 benchmarks/ddp.py --plot
    meshkit-run -n 4 benchmarks/ddp.py --only sync --rounds 9
    meshkit-run -n 4 benchmarks/ddp.py --only overlap --caps 1,25 --hidden 2048,2048
    python benchmarks/ddp.py --plot-from benchmarks/results/ddp-n4.json   # redraw, measure nothing

With the pip-installed ``mpich`` wheel in a venv, use the venv's launcher, e.g.
``/tmp/venv/bin/meshkit-run -n 4 benchmarks/ddp.py --plot``. Results go to
``benchmarks/results/ddp-n{N}.json`` (``--json`` to change) and, with ``--plot``, the PNG
next to it. Each rank's BLAS runs ``--blas-threads`` threads (1), so N ranks use N cores.
``meshkit-run`` already divides the cores among the ranks through ``OPENBLAS_NUM_THREADS`` and
friends; the benchmark also caps the loaded library at run time (``_common.limit_blas_threads``)
so that the setting holds under any launcher: with one OpenBLAS thread per core in every rank,
4 ranks on 2 cores ran 8 spinning BLAS threads and section 2's compute was about 10x slower.

**1. Gradient synchronisation** (``--only sync``), for 1000 float32 gradients of 4 KB and
100 of 256 KB (``--cases``), the time of one synchronisation of all of them by:

* ``ddp``: ``DistributedDataParallel`` with the default caps (25 MB, first bucket 1 MB):
  ``mark_grad_ready(name, g)`` for every gradient in reverse order (the protocol's spelling:
  ``g``, preallocated zeros, is checked and added into its bucket), then ``sync_gradients()``,
  which finishes the sync as ``step()`` does, without the optimizer (the baselines run none).
  ``zero_grad()`` is not part of the synchronisation, as the baselines below zero nothing
  either (figures before 2026-11-22 included it: a 4 MB memset per call on one rank;
  figures before 2026-11-25 marked with the deprecated ``mark_grad_ready(name)``, which adds nothing);
* ``ddp bulk``: the same buckets through ``sync_gradients()`` alone, DDP's call for gradients
  computed all at once into ``ddp.grads``: it marks a bucket at a time instead of a gradient at a time;
* ``per-grad``: one blocking ``meshkit.all_reduce(g, AVG)`` per gradient;
* ``flat``: one ``meshkit.all_reduce`` (AVG) of a single buffer of the same total size: the floor;
* ``ddp no-fp`` (diagnostic): ``ddp`` with the call fingerprint switched off (each call's
  update of comm/groups/call_fingerprint.py's running hash made a no-op; the agreement still carries
  its 16 bytes): the column ``fp cost`` is what keeping the fingerprint costs a DDP step
  (the bar: within 1%; it adds no message, the step's agreement carries it);
* ``ddp local`` (diagnostic): the same DDP pass inside ``no_sync()``, i.e. DDP's own Python
  work (marking, bucket bookkeeping) without any communication;
* ``local+flat`` (diagnostic): ``ddp local`` then ``flat`` in one block: what DDP would cost
  if it did its bookkeeping and then one flat all_reduce, with nothing overlapped. With more
  ranks than cores it exceeds the sum of its parts, since ranks leave the Python work at
  different times and the collective waits for the last one.

Targets, printed with PASS/MISS (informative only; nothing fails): DDP within 1.3x of the
flat all_reduce, and at least 4x faster than the per-gradient all_reduce for the 4 KB case.

**2. Overlap** (``--only overlap``): the MLP of ``examples/mlp.py`` made bigger so that
communication matters (hidden layers ``--hidden``, default 1024,1024,1024: 2.1M parameters,
8.5 MB in float32), global batch ``--batch`` (256) split over the ranks. Per training step:

* (a) compute alone: ``zero`` the gradient buffers, forward, loss, backward; ``on_grad`` only
  adds each gradient into a preallocated buffer (the same local work as DDP's
  ``mark_grad_ready(name, g)``, which adds ``g`` into its bucket), no communication;
* (b) sync alone: ``ddp.sync_gradients()`` of preset gradients, no compute in between;
* (c) DDP step: ``zero_grad()``, forward, backward calling ``ddp.mark_grad_ready(name, g)``
  as each gradient is computed (buckets start averaging while earlier layers are still
  differentiating), ``sync_gradients()`` (the sync ``step()`` finishes, without the optimizer,
  which (a) does not run either).

The fraction of communication hidden behind compute is ``(a + b - c) / b``, clamped to
[0, 1]: 1 when the step costs no more than its compute, 0 when it costs compute plus the
whole sync. With more ranks than cores (4 ranks on a 2-core machine) the ranks contend for
the cores: a rank's communication runs on CPU time taken from some rank's compute, every
collective waits for ranks that are descheduled, and (a) itself is slowed by the other ranks,
so little or nothing can be hidden and the fraction there is mostly noise. The measure is
meaningful with one core per rank (``-n 2`` on 2 cores, 4 ranks on 4+ cores, nothing else
running), and more so with a spare core: meshkit's MPI engine progresses a bucket's reduction
on a communication thread that polls MPI (spin, then ``sched_yield``, then short naps), which
costs CPU beside the compute. Two diagnostics come with (c): ``wait``, the time spent in
``sync_gradients`` (communication not hidden, plus waiting for slower ranks), and
``comm cpu``, the CPU time per step of the process's other threads (the communication thread).
Note also that at the default caps this 8 MB model fills two buckets: a tiny first one (the
last layer, 20 KB) and one with everything else, which can start only once the first layer's
gradient is ready, i.e. after the backward pass; only smaller caps (section 3) leave
communication to overlap.

**3. Bucket-size sweep**: the same (b) and (c) for ``bucket_cap_mb`` in ``--caps`` (0.25,
0.5, 1, 2, 5, 10, 25, 50), ``first_bucket_cap_mb = min(1, cap)``, with the hidden fraction of
each against the same (a). Section 2 is the sweep's 25 MB point (the default caps), measured in
the same rounds.

Timing, as every benchmark here (see ``_common.py``): the methods are interleaved in rounds
(the order rotating from round to round), with a barrier (whose waiting ranks yield the core)
before each timed block of ``iters`` back-to-back calls after ``warmup`` untimed ones; a
call's time is the MAX over ranks of each rank's mean; the reported time is the median over
``--rounds`` rounds (7). Without ``--iters`` the calls per block adapt to about
``--block-seconds`` seconds. Every method's result is checked once against the expected
average before timing.

Rank 0 prints the tables, shows progress (tqdm when installed), writes the JSON (metadata and
one row per measurement) and, with ``--plot``, a PNG: step (c) and sync (b) time against the
bucket cap (log axis) with the compute-alone time for reference, and the hidden fraction.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from _common import (LOG, Progress, add_output_args, barrier, calibrate_iters, format_size, limit_blas_threads,
                     load_result, matplotlib_missing, max_over_ranks, median, parse_checked, parse_size,
                     placement, png_path, print0, require_pyplot, run_metadata, save_figure, setup_logging,
                     time_calls, write_json)
from mpi4py import MPI

import meshkit
from meshkit.comm.groups.call_fingerprint import CallSequence
from meshkit.parallel import SGD, DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from mlp import backward, forward, init_params, loss_and_grad_logits, make_data  # noqa: E402  (examples/mlp.py)

RESULTS = Path(__file__).resolve().parent / "results"

#: Informative targets of section 1 (printed as PASS/MISS, never asserted).
MAX_DDP_OVER_FLAT = 1.3
MIN_PERGRAD_OVER_DDP = 4.0
PERGRAD_TARGET_BYTES = 4 << 10  # the per-gradient target applies to the small-gradient case
DEFAULT_CAP_MB, DEFAULT_FIRST_CAP_MB = 25.0, 1.0
SYNC_METHODS = ("ddp", "ddp bulk", "per-grad", "flat", "ddp local", "local+flat", "ddp no-fp")

Call = Callable[[], object]


# --------------------------------------------------------------------------- rounds
@dataclasses.dataclass
class Block:
    """One timed thing: a collective callable and its calls per timed block."""

    name: str
    fn: Call
    iters: int = 0
    #: an accumulator ``fn`` adds seconds to (e.g. its wait in sync_gradients): zeroed
    #: before each timed block and read, per call, after it
    side: list[float] | None = None


def calibrate(blocks: list[Block], comm: MPI.Comm, args: argparse.Namespace) -> None:
    """Calls per timed block: ``--iters``, or about ``--block-seconds`` of calls (same on every rank)."""
    for block in blocks:
        block.iters = args.iters or calibrate_iters(block.fn, comm, budget_s=args.block_seconds,
                                                    min_iters=args.min_iters, probe_s=0.005)


def mib(nbytes: int) -> str:
    """``4000K`` -> ``3.9M``, 8,208 bytes -> ``8.0K``: exact (``4K``, ``25M``) where whole units."""
    if nbytes % 1024 == 0 and (nbytes < 1 << 20 or nbytes % (1 << 20) == 0):
        return format_size(nbytes)
    if nbytes < 1 << 20:
        return f"{nbytes / 1024:.1f}K"
    return f"{nbytes / (1 << 20):.1f}M"


def run_rounds(blocks: list[Block], comm: MPI.Comm, rounds: int, warmup: int,
               on_round: Callable[[int], None] = lambda r: None) -> dict[str, list[float]]:
    """Seconds per call of each block in each round: the MAX over ranks of each rank's mean.

    A block with ``side`` accumulators also gets ``"{name}:{j}"``: the per-call seconds of the j-th.
    """
    width = max((len(b.side) for b in blocks if b.side is not None), default=0)
    local = np.zeros((rounds, len(blocks), 1 + width))
    for r in range(rounds):
        for k in range(len(blocks)):
            i = (r + k) % len(blocks)  # rotate: no block always runs first
            block = blocks[i]
            for _ in range(warmup):
                block.fn()
            if block.side is not None:
                block.side[:] = [0.0] * len(block.side)
            barrier(comm)
            local[r, i, 0] = time_calls(block.fn, block.iters)
            if block.side is not None:
                local[r, i, 1:1 + len(block.side)] = [v / block.iters for v in block.side]
        on_round(r)
    worst = np.array(max_over_ranks(comm, local.ravel())).reshape(local.shape)
    out = {b.name: worst[:, i, 0].tolist() for i, b in enumerate(blocks)}
    for i, b in enumerate(blocks):
        for j in range(len(b.side or ())):
            out[f"{b.name}:{j}"] = worst[:, i, 1 + j].tolist()
    return out


def check_all(comm: MPI.Comm, what: str, ok: bool) -> None:
    """Raise on every rank if ``ok`` is False on any rank, naming the ranks."""
    bad = [r for r, good in enumerate(comm.allgather(bool(ok))) if not good]
    if bad:
        raise RuntimeError(f"meshkit.bench: {what} gave a wrong result on ranks {bad}")


# --------------------------------------------------------------------------- 1. gradient sync
@dataclasses.dataclass(frozen=True)
class Case:
    count: int
    nbytes: int  # of one gradient

    @property
    def label(self) -> str:
        return f"{self.count} x {format_size(self.nbytes)}"


def build_ddp(params: dict[str, np.ndarray], cap_mb: float, first_cap_mb: float) -> DistributedDataParallel:
    """DDP over the world as a 1-D mesh, as the protocol builds it (collective). Its optimizer is
    never stepped: the sections time the gradient sync, which ``sync_gradients()`` finishes
    without it (``step()`` is that plus the optimizer)."""
    mesh = meshkit.init_device_mesh("cpu", (meshkit.get_world_size(),), mesh_dim_names=("dp",))
    return DistributedDataParallel(params, mesh=mesh, optimizer=SGD(lr=0.0), bucket_cap_mb=cap_mb,
                                   first_bucket_cap_mb=first_cap_mb)


def parse_case(text: str) -> Case:
    """``1000x4K`` -> 1000 gradients of 4 KB."""
    count, sep, size = text.lower().partition("x")
    if not sep or not count.strip().isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"invalid case {text!r}; write COUNTxSIZE, e.g. 1000x4K")
    nbytes = parse_size(size)
    if nbytes < 4 or nbytes % 4:
        raise argparse.ArgumentTypeError(f"invalid case {text!r}: the gradient size must be a multiple of 4 "
                                         "bytes (float32)")
    return Case(int(count), nbytes)


def sync_blocks(case: Case, comm: MPI.Comm) -> tuple[list[Block], int]:
    """The section-1 callables of ``case`` (checked once), and DDP's number of buckets."""
    rank, n = comm.Get_rank(), comm.Get_size()
    elems = case.nbytes // 4
    width = len(str(case.count - 1))
    params = {f"p{i:0{width}d}": np.zeros(elems, np.float32) for i in range(case.count)}
    ddp = build_ddp(params, DEFAULT_CAP_MB, DEFAULT_FIRST_CAP_MB)
    names = list(reversed(params))
    grads = [np.zeros(elems, np.float32) for _ in range(case.count)]
    zeros = dict(zip(names, (np.zeros(elems, np.float32) for _ in names)))  # what a timed pass marks ready
    flat = np.zeros(case.count * elems, np.float32)
    avg = meshkit.ReduceOp.AVG

    def ddp_sync() -> None:
        for name, g in zeros.items():
            ddp.mark_grad_ready(name, g)
        ddp.sync_gradients()

    def ddp_local() -> None:
        with ddp.no_sync():
            for name, g in zeros.items():
                ddp.mark_grad_ready(name, g)
            ddp.sync_gradients()

    def per_grad() -> None:
        for g in grads:
            meshkit.all_reduce(g, avg)

    def flat_sync() -> None:
        meshkit.all_reduce(flat, avg)

    # correctness, once: rank r contributes r + 1 (+ i / count per gradient); the average is known
    expected = (n + 1) / 2
    offsets = np.arange(case.count, dtype=np.float32)[:, None] / case.count
    ddp.zero_grad()
    mine = {name: np.full(elems, rank + 1 + offsets[i, 0], np.float32) for i, name in enumerate(params)}
    for name in names:
        ddp.mark_grad_ready(name, mine[name])
    ddp.sync_gradients()
    ok = all(np.allclose(ddp.grads[name], expected + offsets[i]) for i, name in enumerate(params))
    for i, g in enumerate(grads):
        g[...] = rank + 1 + offsets[i]
    per_grad()
    ok &= all(np.allclose(g, expected + offsets[i]) for i, g in enumerate(grads))
    flat[...] = rank + 1
    flat_sync()
    ok &= bool(np.allclose(flat, expected))
    check_all(comm, f"gradient sync of {case.label}", ok)
    for g in grads:
        g.fill(0)  # zeros: values stay finite however many times they are averaged in place
    flat.fill(0)
    ddp.zero_grad()
    def local_then_flat() -> None:
        ddp_local()
        flat_sync()

    def ddp_without_fingerprint() -> None:
        keep = CallSequence.add
        CallSequence.add = _no_update  # type: ignore[method-assign]
        try:
            ddp_sync()
        finally:
            CallSequence.add = keep  # type: ignore[method-assign]

    blocks = [Block("ddp", ddp_sync), Block("ddp bulk", ddp.sync_gradients), Block("per-grad", per_grad),
              Block("flat", flat_sync),
              Block("ddp local", ddp_local), Block("local+flat", local_then_flat),
              Block("ddp no-fp", ddp_without_fingerprint)]
    return blocks, len(ddp.buckets)


def _no_update(self: CallSequence, seq: int, digest: int, what: Any) -> None:
    """CallSequence.add switched off: the same value on every rank, so every comparison passes."""


def sync_rows(case: Case, times: dict[str, list[float]], blocks: list[Block], buckets: int,
              n: int) -> list[dict[str, Any]]:
    rows = []
    for block in blocks:
        rounds = times[block.name]
        rows.append({"section": "sync", "case": case.label, "gradients": case.count, "grad_bytes": case.nbytes,
                     "total_bytes": case.count * case.nbytes, "method": block.name, "world_size": n,
                     "buckets": buckets if block.name.startswith("ddp") else None,
                     "time_ms": median(rounds) * 1e3, "iters": block.iters,
                     "rounds_ms": [t * 1e3 for t in rounds]})
    return rows


def sync_table(rows: list[dict[str, Any]], n: int, rounds: int) -> list[str]:
    by_case: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_case.setdefault(row["case"], {})[row["method"]] = row
    lines = [f"1. gradient sync: float32, AVG, {n} ranks; ms per sync (max over ranks, median of {rounds} rounds)",
             f"{'case':>11} {'total':>6} {'buckets':>7} {'ddp':>9} {'ddp bulk':>9} {'per-grad':>9} {'flat':>9} "
             f"{'ddp local':>9} {'local+flat':>10} {'ddp/flat':>9} {'bulk/flat':>9} {'per-grad/ddp':>12} {'fp cost':>8}"]
    verdicts = []
    for label, m in by_case.items():
        ddp, bulk, per, flat, local, floor, nofp = (m[k]["time_ms"] for k in SYNC_METHODS)
        total = m["ddp"]["total_bytes"]
        lines.append(f"{label:>11} {mib(total):>6} {m['ddp']['buckets']:>7} {ddp:9.3f} {bulk:9.3f} {per:9.3f} "
                     f"{flat:9.3f} {local:9.3f} {floor:10.3f} {ddp / flat:8.2f}x {bulk / flat:8.2f}x "
                     f"{per / ddp:11.2f}x {100 * (ddp / nofp - 1):+7.2f}%")
        for what, t in (("ddp/flat", ddp), ("ddp bulk/flat", bulk)):
            verdicts.append(f"  {label}: {what} {t / flat:.2f}x (target <= {MAX_DDP_OVER_FLAT}x): "
                            f"{'PASS' if t / flat <= MAX_DDP_OVER_FLAT else 'MISS'}")
        if m["ddp"]["grad_bytes"] == PERGRAD_TARGET_BYTES:
            target = f"target >= {MIN_PERGRAD_OVER_DDP:g}x" + ("" if n == 4 else ", set for 4 ranks")
            verdicts.append(f"  {label}: per-grad/ddp {per / ddp:.2f}x ({target}): "
                            f"{'PASS' if per / ddp >= MIN_PERGRAD_OVER_DDP else 'MISS'}")
    lines.append("targets (informative):")
    return lines + verdicts


def run_sync(args: argparse.Namespace, comm: MPI.Comm, progress: Progress,
             emit: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = []
    n = comm.Get_size()
    for case in args.cases:
        progress.start_group(f"sync {case.label}")
        blocks, buckets = sync_blocks(case, comm)
        calibrate(blocks, comm, args)
        times = run_rounds(blocks, comm, args.rounds, args.warmup, lambda r: progress.step(case.label))
        rows += sync_rows(case, times, blocks, buckets, n)
    emit("\n".join(sync_table(rows, n, args.rounds)))  # one write: one redraw of the bar
    return rows


# --------------------------------------------------------------------------- 2, 3. overlap and sweep
def caps_of(cap: float) -> tuple[float, float]:
    return cap, min(DEFAULT_FIRST_CAP_MB, cap)


def overlap_blocks(args: argparse.Namespace, comm: MPI.Comm) -> tuple[list[Block], dict[float, int], dict[str, Any]]:
    """Compute alone, then per cap sync alone and the DDP step (checked once); buckets per cap; model info."""
    rank, n = comm.Get_rank(), comm.Get_size()
    dtype = np.dtype(args.dtype)
    params = init_params(tuple(args.hidden), dtype=dtype)
    x, y = make_data(max(4096, args.batch))
    # one fixed global batch (the data does not change the cost); this rank's contiguous share
    idx = np.array_split(np.arange(args.batch), n)[rank]
    xb, yb = x[idx], y[idx]

    # (a) compute alone: the step's local work, gradients added into preallocated buffers
    flat = np.zeros(sum(p.size for p in params.values()), dtype)
    store, start = {}, 0
    for name in reversed(params):  # the same layout as DDP's buckets
        p = params[name]
        store[name] = flat[start:start + p.size].reshape(p.shape)
        start += p.size

    def add(name: str, g: np.ndarray) -> None:
        store[name] += g

    def compute() -> None:
        flat.fill(0)
        acts = forward(params, xb)
        _, dlogits = loss_and_grad_logits(acts[-1], yb)
        backward(params, acts, dlogits, add)

    blocks = [Block("compute", compute)]
    buckets: dict[float, int] = {}
    compute()
    meshkit.all_reduce(flat, meshkit.ReduceOp.AVG)
    expected = {name: g.copy() for name, g in store.items()}
    rtol = 1e-4 if dtype == np.float32 else 1e-10
    ok = True
    for cap in args.caps:
        ddp = build_ddp(params, *caps_of(cap))

        side = [0.0, 0.0]  # seconds waiting in sync_gradients; CPU seconds of other threads

        def step(ddp: DistributedDataParallel = ddp, side: list[float] = side) -> None:
            cpu, main_cpu = time.process_time(), time.thread_time()
            ddp.zero_grad()
            acts = forward(ddp.params, xb)
            _, dlogits = loss_and_grad_logits(acts[-1], yb)
            backward(ddp.params, acts, dlogits, ddp.mark_grad_ready)
            start = time.perf_counter()
            ddp.sync_gradients()
            side[0] += time.perf_counter() - start
            side[1] += (time.process_time() - cpu) - (time.thread_time() - main_cpu)

        step()  # the first pass also rebuilds buckets in gradient-ready order
        ok &= all(np.allclose(ddp.grads[k], v, rtol=rtol, atol=rtol * float(np.abs(v).max()))
                  for k, v in expected.items())
        blocks += [Block(f"sync {cap:g}", ddp.sync_gradients), Block(f"step {cap:g}", step, side=side)]
        buckets[cap] = len(ddp.buckets)
    check_all(comm, "the DDP training step (gradients against an all_reduce of the local ones)", ok)
    sizes = (params["w0"].shape[0], *args.hidden, params[f"w{len(args.hidden)}"].shape[1])
    model = {"layers": list(sizes), "parameters": int(flat.size), "grad_bytes": int(flat.nbytes),
             "dtype": str(dtype), "global_batch": args.batch, "batch_per_rank": len(idx)}
    return blocks, buckets, model


def hidden_fraction(a: float, b: float, c: float) -> float:
    return min(1.0, max(0.0, (a + b - c) / b)) if b > 0 else 0.0


def run_overlap(args: argparse.Namespace, comm: MPI.Comm, progress: Progress,
                emit: Callable[[str], None]) -> list[dict[str, Any]]:
    n = comm.Get_size()
    progress.start_group("overlap + sweep")
    blocks, buckets, model = overlap_blocks(args, comm)
    calibrate(blocks, comm, args)
    times = run_rounds(blocks, comm, args.rounds, args.warmup, lambda r: progress.step("overlap"))
    iters = {b.name: b.iters for b in blocks}
    a_rounds = times["compute"]
    a = median(a_rounds)
    rows: list[dict[str, Any]] = []
    for cap in args.caps:
        b_rounds, c_rounds = times[f"sync {cap:g}"], times[f"step {cap:g}"]
        b, c = median(b_rounds), median(c_rounds)
        wait = median(times[f"step {cap:g}:0"])
        comm_cpu = median(times[f"step {cap:g}:1"])
        # per round too: the spread of the hidden fraction shows how much to trust it
        per_round = [hidden_fraction(*t) for t in zip(a_rounds, b_rounds, c_rounds)]
        rows.append({"section": "sweep", "default_caps": cap == DEFAULT_CAP_MB, "world_size": n,
                     "bucket_cap_mb": caps_of(cap)[0], "first_bucket_cap_mb": caps_of(cap)[1],
                     "buckets": buckets[cap], **model,
                     "compute_ms": a * 1e3, "sync_ms": b * 1e3, "step_ms": c * 1e3,
                     "hidden_fraction": hidden_fraction(a, b, c),
                     "finish_wait_ms": wait * 1e3, "comm_thread_cpu_ms": comm_cpu * 1e3,
                     "wait_hidden_fraction": min(1.0, max(0.0, 1 - wait / b)) if b > 0 else 0.0,
                     "hidden_fraction_rounds": per_round,
                     "iters": {"compute": iters["compute"], "sync": iters[f"sync {cap:g}"],
                               "step": iters[f"step {cap:g}"]},
                     "compute_rounds_ms": [t * 1e3 for t in a_rounds],
                     "sync_rounds_ms": [t * 1e3 for t in b_rounds], "step_rounds_ms": [t * 1e3 for t in c_rounds]})
    layers = "-".join(map(str, model["layers"]))
    head = (f"MLP {layers}, {model['parameters'] / 1e6:.2f}M parameters ({mib(model['grad_bytes'])}B "
            f"{model['dtype']} gradients), global batch {model['global_batch']} ({model['batch_per_rank']} per rank), "
            f"{n} ranks; ms per step (max over ranks, median of {args.rounds} rounds)")
    emit("\n".join(overlap_report(rows, head, n, bool(placement(comm)["oversubscribed"]))))
    return rows


def overlap_report(rows: list[dict[str, Any]], head: str, n: int, oversubscribed: bool) -> list[str]:
    """The lines of sections 2 (the default caps' row) and 3 (every row)."""
    lines: list[str] = []
    default = next((r for r in rows if r["bucket_cap_mb"] == DEFAULT_CAP_MB), None)
    if default is not None:
        a, b, c = default["compute_ms"], default["sync_ms"], default["step_ms"]
        spread = default["hidden_fraction_rounds"]
        lines += [
            "",
            f"2. overlap, default caps ({DEFAULT_CAP_MB:g} MB, first {DEFAULT_FIRST_CAP_MB:g} MB: "
            f"{default['buckets']} buckets): {head}",
            f"  (a) compute alone     {a:9.2f} ms",
            f"  (b) sync alone        {b:9.2f} ms",
            f"  (c) DDP step          {c:9.2f} ms   (a + b = {a + b:.2f} ms; of c, "
            f"{default['finish_wait_ms']:.2f} ms waiting in sync_gradients)",
            f"  hidden = (a + b - c) / b = {default['hidden_fraction']:.2f} (per round: {min(spread):.2f} .. "
            f"{max(spread):.2f}); 1 - wait / b = {default['wait_hidden_fraction']:.2f}"]
        if oversubscribed:
            lines.append(f"  note: {n} ranks share fewer than {n} cores: compute and communication contend for "
                         "them, so little can be hidden (see the module docstring)")
    lines += ["", f"3. bucket-size sweep (first bucket = min(1, cap)): {head}",
              f"{'cap MB':>7} {'first':>6} {'buckets':>7} {'(b) sync':>9} {'(c) step':>9} {'(a) compute':>11} "
              f"{'hidden':>7} {'wait':>7} {'1-wait/b':>8} {'comm cpu':>8}"]
    for r in rows:
        lines.append(f"{r['bucket_cap_mb']:7g} {r['first_bucket_cap_mb']:6g} {r['buckets']:7d} {r['sync_ms']:9.2f} "
                     f"{r['step_ms']:9.2f} {r['compute_ms']:11.2f} {r['hidden_fraction']:7.2f} "
                     f"{r['finish_wait_ms']:7.2f} {r['wait_hidden_fraction']:8.2f} {r['comm_thread_cpu_ms']:8.2f}")
    best = min(rows, key=lambda r: r["step_ms"])
    lines.append(f"  fastest step: cap {best['bucket_cap_mb']:g} MB, {best['step_ms']:.2f} ms "
                 f"(hidden {best['hidden_fraction']:.2f})")
    lines.append("  wait: ms of (c) in sync_gradients (communication not hidden, plus waiting for slower ranks); "
                 "comm cpu: CPU ms per step of the threads other than the main one (the communication thread "
                 "polling MPI, during the backward pass and the wait): on a core the compute needs, if none "
                 "is spare")
    return lines


# --------------------------------------------------------------------------- plot
def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Step (c), sync (b) and compute (a) time vs bucket cap; the hidden fraction; section 1's bars."""
    plt = require_pyplot()
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
    sweep = sorted((r for r in rows if r["section"] == "sweep"), key=lambda r: r["bucket_cap_mb"])
    sync = [r for r in rows if r["section"] == "sync"]
    if not sweep and not sync:
        raise SystemExit("meshkit.bench: nothing to plot: the results have no rows")
    panels = 2 * bool(sweep) + bool(sync)
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.4), squeeze=False)
    axes = axes[0]
    if sweep:
        caps = [r["bucket_cap_mb"] for r in sweep]
        ax = axes[0]
        ax.plot(caps, [r["step_ms"] for r in sweep], marker="o", label="(c) DDP step")
        ax.plot(caps, [r["sync_ms"] for r in sweep], marker="s", label="(b) sync alone")
        ax.plot(caps, [r["compute_ms"] for r in sweep], linestyle="--", color="gray", label="(a) compute alone")
        ax.plot(caps, [r["compute_ms"] + r["sync_ms"] for r in sweep], linestyle=":", color="tab:red",
                label="(a) + (b): none hidden")
        for r in sweep:
            ax.annotate(str(r["buckets"]), (r["bucket_cap_mb"], r["step_ms"]), textcoords="offset points",
                        xytext=(0, 6), fontsize=8, ha="center", color="tab:blue")
        ax.set_ylabel("ms per step (max over ranks, median)")
        ax.set_title("time vs bucket cap (numbers: buckets)", fontsize="medium")
        top = max(max(r["step_ms"], r["compute_ms"] + r["sync_ms"]) for r in sweep)
        ax.set_ylim(0, top * 1.45)  # room above the data for the legend
        axes[1].plot(caps, [r["hidden_fraction"] for r in sweep], marker="o", color="tab:green",
                     label="(a + b - c) / b, of the medians")
        lo = [min(r["hidden_fraction_rounds"]) for r in sweep]
        hi = [max(r["hidden_fraction_rounds"]) for r in sweep]
        axes[1].fill_between(caps, lo, hi, color="tab:green", alpha=0.15, label="(a + b - c) / b, range over rounds")
        axes[1].plot(caps, [r["wait_hidden_fraction"] for r in sweep], marker="^", linestyle="--", color="tab:purple",
                     label="1 - (wait in sync_gradients) / b")
        axes[1].set_ylim(-0.03, 1.03)
        axes[1].set_ylabel("fraction of communication hidden")
        axes[1].set_title("fraction of the sync hidden behind backward", fontsize="medium")
        for ax in axes[:2]:
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(FixedLocator(caps))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
            ax.set_xlabel("bucket_cap_mb (first bucket: min(1, cap))")
            ax.grid(True, alpha=0.3)
        axes[0].legend(fontsize="small", loc="upper center", ncol=2)
        axes[1].legend(fontsize="small", loc="best")
    if sync:
        ax = axes[-1]
        cases = list(dict.fromkeys(r["case"] for r in sync))
        width = 0.8 / len(SYNC_METHODS)
        for k, method in enumerate(SYNC_METHODS):
            values = [next(r["time_ms"] for r in sync if r["case"] == c and r["method"] == method) for c in cases]
            ax.bar([i + (k - (len(SYNC_METHODS) - 1) / 2) * width for i in range(len(cases))], values, width,
                   label=method)
        ax.set_xticks(range(len(cases)), cases)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: ""))
        for i, case in enumerate(cases):  # the ratios the targets are about, above each group
            t = {r["method"]: r["time_ms"] for r in sync if r["case"] == case}
            ax.annotate(f"ddp/flat {t['ddp'] / t['flat']:.2f}x\nper-grad/ddp {t['per-grad'] / t['ddp']:.1f}x",
                        (i, max(t.values())), textcoords="offset points", xytext=(0, 4), ha="center",
                        fontsize=8)
        low = min(r["time_ms"] for r in sync)
        ax.set_ylim(low / 2, max(r["time_ms"] for r in sync) * 12)  # room for the notes and the legend
        ax.set_ylabel("ms per sync of all gradients")
        ax.set_title("gradient sync (float32, AVG), default caps", fontsize="medium")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize="small", loc="upper center", ncol=4)
    save_figure(fig, path, title)


# --------------------------------------------------------------------------- command line
def _float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid list {text!r}; write comma-separated numbers, e.g. 1,25")
    if not values or min(values) <= 0 or not all(map(math.isfinite, values)):
        raise argparse.ArgumentTypeError(f"invalid list {text!r}: give one or more positive numbers")
    return sorted(set(values))


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid list {text!r}; write comma-separated integers, e.g. 1024,1024")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"invalid list {text!r}: give one or more positive integers")
    return values


def _case_list(text: str) -> list[Case]:
    return [parse_case(t) for t in text.split(",") if t.strip()] or [parse_case(text)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--only", choices=("sync", "overlap"), default=None,
                   help="run one section: sync (1) or overlap (2 and 3); without it, all")
    p.add_argument("--cases", type=_case_list, default="1000x4K,100x256K",
                   metavar="NxSIZE,...", help="section 1: gradient counts and sizes (float32), e.g. 1000x4K,100x256K")
    p.add_argument("--hidden", type=_int_list, default="1024,1024,1024", help="sections 2-3: hidden layer widths")
    p.add_argument("--batch", type=int, default=256, help="sections 2-3: global batch (divisible by the ranks)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="sections 2-3: model dtype")
    p.add_argument("--caps", type=_float_list, default="0.25,0.5,1,2,5,10,25,50",
                   help="section 3: bucket_cap_mb values (25 is section 2)")
    p.add_argument("--blas-threads", type=int, default=1,
                   help="BLAS threads per rank (1: N ranks use N cores; more oversubscribes a shared host)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds; the median is reported")
    p.add_argument("--iters", type=int, default=None,
                   help="calls per timed block; without it, about --block-seconds of calls")
    p.add_argument("--block-seconds", type=float, default=0.1, help="about this long per timed block without --iters")
    p.add_argument("--min-iters", type=int, default=2, help="fewest calls per timed block without --iters")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before each timed block")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any blocking meshkit call waits at most")
    add_output_args(p, json_help="result file (default: benchmarks/results/ddp-n{N}.json)")
    return p


def _invalid(args: argparse.Namespace, n: int) -> str | None:
    """The first problem with ``args`` on ``n`` ranks that argparse cannot see, or None."""
    if args.blas_threads < 1:
        return f"invalid --blas-threads {args.blas_threads}; it must be >= 1"
    if args.rounds < 1:
        return f"invalid --rounds {args.rounds}; it must be >= 1"
    if args.iters is not None and args.iters < 1:
        return f"invalid --iters {args.iters}; it must be >= 1"
    if args.min_iters < 1 or args.warmup < 0 or not args.block_seconds > 0 or not args.timeout > 0:
        return "--min-iters must be >= 1, --warmup >= 0, --block-seconds and --timeout > 0"
    if args.only != "sync" and (args.batch < n or args.batch % n):
        return f"invalid --batch {args.batch}: it must be a positive multiple of the {n} ranks"
    return matplotlib_missing(args)


def parse_args(rank: int, n: int, argv: list[str] | None = None) -> argparse.Namespace:
    args = parse_checked(build_parser(), rank, argv, lambda a: _invalid(a, n))
    if args.only != "sync" and DEFAULT_CAP_MB not in args.caps:
        args.caps = sorted({*args.caps, DEFAULT_CAP_MB})  # section 2 is the default caps' point
    return args


def plot_from(args: argparse.Namespace) -> None:
    data = load_result(args.plot_from, "ddp")
    meta = data["metadata"]
    png = png_path(args.plot, args.plot_from)
    plot(data["rows"], png, plot_title(meta))
    LOG.info("wrote %s", png)


def plot_title(meta: dict[str, Any]) -> str:
    return (f"meshkit DDP: {meta.get('world_size')} ranks, {meta.get('cores_per_host')} cores/host, "
            f"{meta.get('hostname')}, median of {meta.get('rounds')} rounds")


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
    args.load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    args.blas_limit = limit_blas_threads(args.blas_threads)  # NumPy is loaded: the variables alone are late
    meshkit.init_process_group("mpi", timeout=args.timeout)
    show = rank == 0 and not args.no_progress
    steps = (len(args.cases) * args.rounds if args.only != "overlap" else 0) + (
        args.rounds if args.only != "sync" else 0)
    rows: list[dict[str, Any]] = []
    try:
        with Progress(steps, enabled=show, unit="round") as progress:
            def emit(text: str) -> None:
                if show:
                    progress.write(text)
                else:
                    print0(rank, text)
            if args.only != "overlap":
                rows += run_sync(args, comm, progress, emit)
            if args.only != "sync":
                rows += run_overlap(args, comm, progress, emit)
    finally:
        meshkit.destroy_process_group()
    meta = metadata(args, comm)  # collective (placement): every rank
    if rank == 0:
        save(args, meta, rows, n)
    comm.Free()
    return 0


def metadata(args: argparse.Namespace, comm: MPI.Comm) -> dict[str, Any]:
    return run_metadata(
        comm, benchmark="ddp", sections=[args.only] if args.only else ["sync", "overlap", "sweep"],
        rounds=args.rounds, iters=args.iters, block_seconds=args.block_seconds, warmup=args.warmup,
        cases=[c.label for c in args.cases], hidden=args.hidden, batch=args.batch, dtype=args.dtype,
        caps_mb=args.caps, default_caps_mb=[DEFAULT_CAP_MB, DEFAULT_FIRST_CAP_MB],
        blas_threads=args.blas_threads, blas_limit=args.blas_limit,
        load_average_1m_start=args.load_start,  # run_metadata's load_average is the end's
        targets={"ddp_over_flat_max": MAX_DDP_OVER_FLAT, "pergrad_over_ddp_min": MIN_PERGRAD_OVER_DDP})


def save(args: argparse.Namespace, meta: dict[str, Any], rows: list[dict[str, Any]], n: int) -> None:
    path = args.json or RESULTS / f"ddp-n{n}.json"
    write_json(path, meta, rows)
    LOG.info("wrote %s", path)
    if args.plot is not None:
        png = png_path(args.plot, path)
        plot(rows, png, plot_title(meta))
        LOG.info("wrote %s", png)


if __name__ == "__main__":
    sys.exit(main())
