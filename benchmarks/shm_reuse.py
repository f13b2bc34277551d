"""A collective through the shared-memory segment taking the same buffers call after call, or the
two in turn, beside MPICH's (and for all_reduce a NumPy floor), interleaved in one job.

Run it by hand (a measurement, not a test; nothing here asserts on timings)::

    meshkit-run -n 2 benchmarks/shm_reuse.py                       # 4 MiB float32, 60 rounds
    meshkit-run -n 2 benchmarks/shm_reuse.py --bytes 16M --rounds 30 --split-us 650
    meshkit-run -n 2 benchmarks/shm_reuse.py --op all_gather   # through the segment from 1 MiB here

Each round runs, in a shuffled order, 10 calls (after 2 untimed) of: MPI's collective (mpi4py:
``Allreduce`` in place, ``Reduce_scatter_block``, ``Allgather``, ``Bcast``), meshkit's on the
world group (all_gather and broadcast through the segment from ``MESHKIT_SHM_MOVE_MIN_BYTES``,
which this sets to 1 MiB unless given) with ``MESHKIT_SHM_REUSE``'s two behaviours
(the group's channel's ``reuse`` flag, set alike on every rank before its calls), and at 2 ranks
the floor: the same algorithm written out in NumPy over a shared mapping of its own (copy the
peer's half in, meet, add one's half, copy it back, meet, copy the peer's half out, meet). A
round's time is the slowest rank's mean per call. It prints each one's median and its median
ratio to MPI's time of the same round; with ``--split-us`` the rounds where MPI took less than that
and the others apart (this shared machine has spells whose costs differ 3x: docs/collectives.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np


OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(text[:-1]) * units[text[-1]] if text and text[-1] in units else int(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shm_reuse.py", description=__doc__.splitlines()[0])
    p.add_argument("--op", choices=OPS, default="all_reduce", help="the collective (default all_reduce)")
    p.add_argument("--bytes", type=parse_bytes, default=4 << 20,
                   help="its largest buffer's size (default 4M: all_reduce's and broadcast's buffer, "
                        "reduce_scatter's input, all_gather's output)")
    p.add_argument("--rounds", type=int, default=60, help="rounds (default 60)")
    p.add_argument("--calls", type=int, default=10, help="timed calls of each per round (default 10)")
    p.add_argument("--split-us", type=float, default=0.0, help="report rounds with MPI under/over this apart")
    args = p.parse_args(argv)

    import meshkit
    from mpi4py import MPI

    if args.op in ("all_gather", "broadcast"):  # through the segment from 1 MiB (by default: MPI)
        os.environ.setdefault("MESHKIT_SHM_MOVE_MIN_BYTES", str(1 << 20))
    meshkit.init_process_group("mpi")
    comm = MPI.COMM_WORLD.Dup()
    rank, n = comm.rank, comm.size
    group = meshkit.new_group(ranks=list(range(n)))
    channel = getattr(group.engine, "channel", None)
    if channel is None:
        if rank == 0:
            print(f"shm_reuse.py: the group's engine is {type(group.engine).__name__}, not the shared-memory "
                  "path (MESHKIT_SHM=0, or the ranks span hosts)", file=sys.stderr)
        return 2
    x0 = np.random.default_rng(rank).standard_normal(args.bytes // 4).astype(np.float32)
    x = x0.copy()
    part = np.empty(x.size // n, np.float32)
    floor = _floor(comm, x) if n == 2 and args.op == "all_reduce" else None
    mpi = {"all_reduce": lambda: comm.Allreduce(MPI.IN_PLACE, x),
           "reduce_scatter": lambda: comm.Reduce_scatter_block(x, part),
           "all_gather": lambda: comm.Allgather(part, x),
           "broadcast": lambda: comm.Bcast(x, 0)}[args.op]
    ours = {"all_reduce": lambda: meshkit.all_reduce(x, group=group),
            "reduce_scatter": lambda: meshkit.reduce_scatter_tensor(part, x, group=group),
            "all_gather": lambda: meshkit.all_gather_into_tensor(x, part, group=group),
            "broadcast": lambda: meshkit.broadcast(x, 0, group=group)}[args.op]

    def reuse(flag: bool):
        def call() -> None:
            channel.reuse = flag
            ours()
        return call

    calls = {"mpi": mpi, "same buffers": reuse(True), "alternating": reuse(False)}
    if floor is not None:
        calls["numpy floor"] = floor
    times: dict[str, list[float]] = {k: [] for k in calls}
    order = list(calls)
    rng = np.random.default_rng(0)
    for _ in range(args.rounds):
        rng.shuffle(order)
        for name in order:
            comm.Barrier()
            for _ in range(2):
                calls[name]()
            comm.Barrier()
            began = time.perf_counter()
            for _ in range(args.calls):
                calls[name]()
            took = np.array([(time.perf_counter() - began) / args.calls])
            comm.Allreduce(MPI.IN_PLACE, took, op=MPI.MAX)
            times[name].append(float(took[0]) * 1e6)
            np.copyto(x, x0)
    channel.reuse = True
    if rank == 0:
        mpi_us = np.array(times["mpi"])
        parts = [("all", mpi_us > 0)]
        if args.split_us:
            parts += [(f"MPI under {args.split_us:g} us", mpi_us < args.split_us),
                      (f"MPI from {args.split_us:g} us", mpi_us >= args.split_us)]
        for label, sel in parts:
            if not sel.any():
                continue
            print(f"# {args.op} {args.bytes} B at {n} ranks, {label}: {int(sel.sum())} rounds; "
                  f"MPI median {np.median(mpi_us[sel]):.0f} us")
            for name in calls:
                mine = np.array(times[name])[sel]
                ratio = mine / mpi_us[sel]
                print(f"{name:>14s}  median {np.median(mine):8.1f} us  over MPI: median {np.median(ratio):.3f} "
                      f"(quartiles {np.percentile(ratio, 25):.3f}-{np.percentile(ratio, 75):.3f})")
    meshkit.destroy_process_group()
    return 0


def _floor(comm, x: np.ndarray):
    """The algorithm in NumPy at 2 ranks over a mapping of its own (flags spun on, no checks)."""
    nbytes = x.nbytes
    if comm.rank == 0:
        shm = shared_memory.SharedMemory(create=True, size=4096 + 4 * nbytes)
        comm.bcast(shm.name)
    else:
        shm = shared_memory.SharedMemory(name=comm.bcast(None))
        resource_tracker.unregister(shm._name, "shared_memory")  # rank 0 made it and unlinks it
    comm.Barrier()
    if comm.rank == 0:
        shm.unlink()  # mapped by both: nothing left in /dev/shm
    flags = np.ndarray((64,), np.int64, shm.buf, 0)
    flags[comm.rank * 8::16] = 0
    comm.Barrier()
    count, me = x.size, comm.rank
    peer, half = 1 - me, x.size // 2
    ins = [np.ndarray((count,), x.dtype, shm.buf, 4096 + r * nbytes) for r in range(2)]
    outs = [np.ndarray((count,), x.dtype, shm.buf, 4096 + (2 + r) * nbytes) for r in range(2)]
    lo, hi = (0, half) if me == 0 else (half, count)
    olo, ohi = (half, count) if me == 0 else (0, half)
    step = [0]

    def meet(word: int, value: int) -> None:
        flags[word + 8 * me] = value
        while flags[word + 8 * peer] < value:
            pass

    def call() -> None:
        step[0] += 1
        s = step[0]
        np.copyto(ins[me][olo:ohi], x[olo:ohi])
        meet(0, s)
        np.add(x[lo:hi], ins[peer][lo:hi], out=outs[me][lo:hi])
        flags[16 + 8 * me] = s
        np.copyto(x[lo:hi], outs[me][lo:hi])
        while flags[16 + 8 * peer] < s:
            pass
        np.copyto(x[olo:ohi], outs[peer][olo:ohi])
        meet(32, s)
    call.keep = shm  # type: ignore[attr-defined]  (the mapping lives as long as the call)
    return call


if __name__ == "__main__":
    sys.exit(main())
