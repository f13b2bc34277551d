"""Checkpoint save and load time beside raw np.save / np.load of the same per-rank bytes.

Run it by hand (a measurement, not a test; nothing here asserts on timings)::

    meshkit-run -n 2 benchmarks/checkpoint.py                  # table on rank 0
    meshkit-run -n 2 benchmarks/checkpoint.py --mb 256 --plot  # ... and benchmarks/results/checkpoint-n2.png
    meshkit-run -n 4 benchmarks/checkpoint.py --dir /scratch/ck   # on the file system you train on
    python benchmarks/checkpoint.py --plot-from benchmarks/results/checkpoint-n2.json   # redraw only

Each rank holds ``--arrays`` float64 arrays of ``--mb`` MB in all (an FSDP-like state: each
array a DTensor sharded ``Shard(0)`` over the ranks, so every byte is written once) and, per
round, in an order rotating from round to round:

* ``np.save`` / ``np.load``: each rank saves its local blocks, one ``.npy`` file per array (no
  checksum, no fsync, no metadata: the floor), then loads them back;
* ``np.save+fsync``: the same with an ``fsync`` of each file, what a durable write costs;
* ``meshkit save`` / ``meshkit load``: :func:`meshkit.checkpoint.save` (plan, per-rank data
  file, XXH3 checksum of every chunk, fsync, metadata, atomic rename) and
  :func:`meshkit.checkpoint.load` (memory maps, checksum verification, agreement, copies);
* ``async_save (blocking)``: how long :func:`meshkit.checkpoint.async_save` holds training up
  (planning and the staging copy), then its future is waited for untimed;
* ``torch DCP save`` / ``torch DCP load``, where torch (2.2 or later) is importable on every
  rank: ``torch.distributed.checkpoint.save`` / ``load`` over a gloo group of the same ranks,
  of ``torch.from_numpy`` views of the same local blocks, each under a key of its own rank (so
  DCP, like meshkit, writes every byte once; its default writer fsyncs too). Without torch
  these rows are left out and rank 0 prints a note saying so.

A time is the MAX over ranks (a checkpoint is as slow as its slowest rank) after a barrier; the
table shows medians over ``--rounds`` and the ratios to the raw NumPy calls. Loads read what was
just written, so they come from the page cache for both. Results go to
``benchmarks/results/checkpoint-n{N}.json`` and, with ``--plot``, a PNG.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from _common import (LOG, add_output_args, barrier, init_gloo, matplotlib_missing, max_over_ranks, median,
                     parse_checked, print0, redraw, require_pyplot, run_metadata, save_figure, save_results,
                     setup_logging)
from mpi4py import MPI

import meshkit
from meshkit import checkpoint as dcp
from meshkit.tensor import DTensor, Shard

RESULTS = Path(__file__).resolve().parent / "results"
CANDIDATES = ("np.save", "np.save+fsync", "meshkit save", "async_save (blocking)", "np.load", "meshkit load",
              "torch DCP save", "torch DCP load")
#: each checkpointing candidate's raw baseline, for the ratio column
BASELINE = {"meshkit save": "np.save", "async_save (blocking)": "np.save", "meshkit load": "np.load",
            "torch DCP save": "np.save", "torch DCP load": "np.load"}
#: a load reads what its save wrote in the same round, so it comes right after it
LOADS = {"meshkit load": "meshkit save", "torch DCP load": "torch DCP save"}
#: each saving candidate's directories under the root: ``<prefix><n>``
PREFIXES = ("ck", "torch-ck")


def make_state(args: argparse.Namespace, mesh: meshkit.DeviceMesh) -> dict[str, DTensor]:
    """``--arrays`` DTensors sharded over the ranks, ``--mb`` MB of float64 per rank in all."""
    n, rng = mesh.size(), np.random.default_rng(mesh.get_rank())
    rows = max(1, int(args.mb * 2**20 / 8 / args.arrays / 256))
    return {f"p{i}": DTensor.from_local(rng.standard_normal((rows, 256)), mesh, [Shard(0)], shape=(rows * n, 256))
            for i in range(args.arrays)}


def candidates(state: dict[str, DTensor], root: Path, rank: int, counter: list[int]) -> dict[str, Callable[[], Any]]:
    """Every candidate as a callable; each save writes a fresh directory (removed between rounds)."""
    local = {k: v.to_local() for k, v in state.items()}
    raw = root / f"raw-{rank}"
    raw.mkdir(parents=True, exist_ok=True)

    def np_save(sync: bool) -> None:
        for k, a in local.items():
            with open(raw / f"{k}.npy", "wb") as f:
                np.save(f, a)
                if sync:
                    f.flush()
                    os.fsync(f.fileno())

    def np_load() -> None:
        for k in local:
            np.load(raw / f"{k}.npy")

    def fresh() -> Path:
        counter[0] += 1
        return root / f"ck{counter[0]}"

    def async_save() -> Any:
        return dcp.async_save({"model": state}, checkpoint_id=fresh())

    def load() -> None:
        dcp.load({"model": state}, checkpoint_id=root / f"ck{counter[0]}")

    out = {"np.save": lambda: np_save(False), "np.save+fsync": lambda: np_save(True),
           "meshkit save": lambda: dcp.save({"model": state}, checkpoint_id=fresh()),
           "async_save (blocking)": async_save, "np.load": np_load, "meshkit load": load}
    return out


def torch_dcp(comm: MPI.Comm, rank: int) -> Any | None:
    """``torch.distributed.checkpoint`` with a gloo group over ``comm``'s ranks, or None (rank 0
    prints why) where torch is not importable on every rank."""
    try:
        import torch.distributed.checkpoint as tdcp
        problem = None if hasattr(tdcp, "save") else "torch.distributed.checkpoint has no save (torch < 2.2)"
    except ImportError as exc:
        tdcp, problem = None, f"torch is not importable ({exc})"
    problems = comm.allgather(problem)
    if any(problems):
        print0(rank, f"note: torch DCP is not compared: {next(p for p in problems if p)}; pip install torch for its "
                     "rows")
        return None
    LOG.info("torch DCP: gloo rendezvous at %s", init_gloo(comm))
    return tdcp


def torch_candidates(tdcp: Any, state: dict[str, DTensor], root: Path, rank: int) -> dict[str, Callable[[], Any]]:
    """torch DCP's save and load of the same local blocks (views), one key per array and rank."""
    import torch

    tensors = {f"{k}.rank{rank}": torch.from_numpy(v.to_local()) for k, v in state.items()}
    counter = [0]

    def save() -> None:
        counter[0] += 1
        tdcp.save(tensors, checkpoint_id=root / f"torch-ck{counter[0]}")

    def load() -> None:  # in place, into the views: the values it reads are the ones they hold
        tdcp.load(tensors, checkpoint_id=root / f"torch-ck{counter[0]}")

    return {"torch DCP save": save, "torch DCP load": load}


def run(args: argparse.Namespace, comm: MPI.Comm, rank: int, n: int, root: Path) -> list[dict[str, Any]]:
    mesh = meshkit.init_device_mesh("cpu", (n,))
    state = make_state(args, mesh)
    counter = [0]
    calls = candidates(state, root, rank, counter)
    tdcp = torch_dcp(comm, rank)
    if tdcp is not None:
        calls.update(torch_candidates(tdcp, state, root, rank))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(args.rounds):
        order = list(calls)
        order = order[r % len(order):] + order[:r % len(order)]
        for load, save in LOADS.items():
            if load in order and order.index(load) < order.index(save):
                order.remove(load)
                order.insert(order.index(save) + 1, load)  # load what this round saved
        for name in order:
            barrier(comm)
            t0 = time.perf_counter()
            result = calls[name]()
            elapsed = time.perf_counter() - t0
            if name.startswith("async_save"):
                result.result()  # committed before the next candidate
            times[name].append(max_over_ranks(comm, [elapsed])[0])
        barrier(comm)
        if rank == 0:  # keep the disk use bounded: each candidate's newest checkpoint stays for the next load
            for prefix in PREFIXES:
                made = [p for p in root.glob(f"{prefix}*") if p.is_dir() and p.name[len(prefix):].isdigit()]
                for p in sorted(made, key=lambda p: int(p.name[len(prefix):]))[:-1]:
                    shutil.rmtree(p, ignore_errors=True)
        barrier(comm)
        LOG.info("round %d/%d done", r + 1, args.rounds)
    if tdcp is not None:
        import torch.distributed as tdist
        tdist.destroy_process_group()
    nbytes = sum(v.to_local().nbytes for v in state.values())
    rows = []
    for name, ts in times.items():
        t = median(ts)
        base = BASELINE.get(name)
        rows.append({"candidate": name, "seconds": t, "per_rank_bytes": nbytes, "GBps_per_rank": nbytes / t / 1e9,
                     "ratio": t / median(times[base]) if base else None, "baseline": base, "all": ts})
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    out = [f"{'candidate':<24} {'median s':>10} {'GB/s/rank':>10} {'ratio':>7}  vs"]
    for r in rows:
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else ""
        out.append(f"{r['candidate']:<24} {r['seconds']:>10.4f} {r['GBps_per_rank']:>10.3f} {ratio:>7}  "
                   f"{r['baseline'] or ''}")
    return out


def plot(rows: list[dict[str, Any]], png: Path, title: str) -> None:
    plt = require_pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["candidate"] for r in rows]
    ax.barh(names, [r["seconds"] for r in rows], color=["#888" if r["baseline"] is None else "#36c" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (median, max over ranks)")
    for i, r in enumerate(rows):
        if r["ratio"] is not None:
            ax.text(r["seconds"], i, f" {r['ratio']:.2f}x {r['baseline']}", va="center", fontsize="small")
    save_figure(fig, png, title)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mb", type=float, default=64.0, help="MB of float64 state per rank")
    p.add_argument("--arrays", type=int, default=8, help="arrays the state is split into")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--dir", type=Path, default=None, help="where to write: a fresh directory is made inside it and removed at the end (default: the "
                   "system's temporary directory)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any blocking meshkit call waits at most")
    add_output_args(p, json_help="result file (default benchmarks/results/checkpoint-n{N}.json)")
    return p


def _invalid(args: argparse.Namespace) -> str | None:
    if not args.mb > 0:
        return f"--mb must be > 0, got {args.mb}"
    if args.arrays < 1 or args.rounds < 1:
        return f"--arrays and --rounds must be >= 1, got {args.arrays} and {args.rounds}"
    return matplotlib_missing(args)


def main(argv: list[str] | None = None) -> int:
    comm = MPI.COMM_WORLD.Dup()
    rank, n = comm.Get_rank(), comm.Get_size()
    args = parse_checked(build_parser(), rank, argv, _invalid)
    setup_logging(rank, args.verbose)
    if args.plot_from is not None:
        if rank == 0:
            redraw(args, "checkpoint", plot, lambda meta: f"checkpoint, {meta.get('ranks', '?')} ranks")
        comm.Free()
        return 0
    meshkit.init_process_group("mpi", timeout=args.timeout)
    if rank == 0 and args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    # a directory of this run's own, inside --dir when given: a second run never meets the first's checkpoints
    root = Path(comm.bcast(tempfile.mkdtemp(prefix="meshkit-ckpt-bench-", dir=args.dir) if rank == 0 else None))
    started = time.perf_counter()
    try:
        rows = run(args, comm, rank, n, root)
    finally:
        barrier(comm)
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        meshkit.destroy_process_group()
    meta = run_metadata(comm, benchmark="checkpoint", mb_per_rank=args.mb, arrays=args.arrays, rounds=args.rounds,
                        directory=str(root), seconds=time.perf_counter() - started)
    if rank == 0:
        for line in table(rows):
            print0(rank, line)
        save_results(args, RESULTS / f"checkpoint-n{n}.json", meta, rows,
                     lambda png: plot(rows, png, f"checkpoint, {n} ranks, {args.mb:g} MB per rank"))
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
