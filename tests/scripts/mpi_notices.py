"""A rank that fails, or leaves, alone: the others must fail within seconds (the cases in argv[1:], run
in order in one job: only the last may end it or leave its world unusable).

Every rank prints 'REPORT <rank> <error name> <elapsed s>: <message>' for what it saw.
"""

import os
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

import meshkit

meshkit.init_process_group("mpi", timeout=60)  # far longer than the tests allow: a wait must not run out
rank, n = meshkit.get_rank(), meshkit.get_world_size()


def report(fn):
    start = time.monotonic()
    try:
        fn()
        print(f"REPORT {rank} ok {time.monotonic() - start:.2f}", flush=True)
    except Exception as exc:  # noqa: BLE001
        print(f"REPORT {rank} {type(exc).__name__} {time.monotonic() - start:.2f}: {exc}", flush=True)


for case in sys.argv[1:]:
    if case == "bad-scatter":
        # Only the root can see its scatter_list is wrong; the others have started the scatter.
        out = np.empty(2)
        chunks = [np.ones(2)] * (n + 1) if rank == 0 else None
        report(lambda: meshkit.scatter(out, chunks, src=0))
    elif case == "pickle":
        report(lambda: meshkit.broadcast_object_list([threading.Lock()] if rank == 0 else [None], src=0))
        x = np.ones(3)
        report(lambda: meshkit.all_reduce(x))  # the group is still usable, and in step
        print(f"SUM {rank} {x[0]}", flush=True)
    elif case == "early-exit":
        if rank == 1:
            sys.exit(0)  # a clean exit, while the others wait for it
        report(lambda: meshkit.all_reduce(np.ones(4)))
        meshkit.all_reduce(np.ones(4))  # as a script that does not catch it: the job ends with the error
    elif case == "recv-size":
        if rank == 0:
            meshkit.send(np.arange(3.0), dst=1)
            meshkit.send(np.arange(3.0), dst=1)
            meshkit.send(np.arange(3, dtype=np.float32), dst=1)
        elif rank == 1:
            report(lambda: meshkit.recv(np.zeros(2), src=0))   # too small
            big = np.zeros(5)
            report(lambda: meshkit.recv(big, src=0))           # too large: no partial fill passes
            print(f"UNTOUCHED {rank} {big.tolist()}", flush=True)
            report(lambda: meshkit.recv(np.zeros(3), src=0))   # float32 into float64: 12 bytes, not 24
        report(lambda: meshkit.send(np.ones(1), dst=rank))      # to itself
    elif case == "recv-dtype":  # run with MESHKIT_DEBUG=detail: the same bytes, another dtype
        if rank == 0:
            meshkit.send(np.arange(3, dtype=np.int64), dst=1)
            meshkit.send(np.arange(3, dtype=np.float64), dst=1)
        elif rank == 1:
            report(lambda: meshkit.recv(np.zeros(3), src=0))
            y = np.zeros(3)
            report(lambda: meshkit.recv(y, src=0))
            print(f"RECEIVED {rank} {y.tolist()}", flush=True)
    elif case in ("ddp-exit", "ddp-exit-late"):
        # Rank 1 leaves with DDP buckets in flight; the others finish the sync.
        from meshkit.parallel import DistributedDataParallel
        params = {f"p{i}": np.zeros(1000) for i in range(4)}
        ddp = DistributedDataParallel(params, bucket_cap_mb=0.004, first_bucket_cap_mb=0.004)  # a bucket each
        names = list(reversed(list(params)))
        ddp.zero_grad()
        if rank == 1:
            for name in names[:2]:
                ddp.mark_grad_ready(name, np.ones(1000))  # two buckets launched
            sys.exit(0)
        if case == "ddp-exit-late":
            time.sleep(2)  # a longer forward pass: rank 1 gave up waiting for its buckets and left

        def backward():
            for name in names:
                ddp.mark_grad_ready(name, np.ones(1000))
            ddp.finish_gradient_sync()
        report(backward)
        ddp.finish_gradient_sync()  # uncaught, as in a script: the job ends with the error
    elif case == "split-skip":
        if rank == 1:
            sys.exit(0)  # skips new_group
        report(lambda: meshkit.new_group([0, 2]))
        meshkit.new_group([0, 2])
    elif case == "uncaught":
        if rank == 1:
            time.sleep(0.3)
            raise RuntimeError("rank 1 fails, uncaught")
        meshkit.barrier()  # would wait 60 s without the abort
sys.stdout.flush()
MPI.COMM_WORLD.Barrier()
os._exit(0)  # a call that failed may still be pending inside MPI: leave without finalizing
