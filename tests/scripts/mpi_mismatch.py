"""Collective mismatches under MPI at the default debug level, one case per group.

4 ranks; each case on a 2-rank group of its own (a mismatch breaks its group), two at a time:
``size`` (4 float64 against 8) on [0, 1] and ``dtype`` (float32 against float64) on [2, 3], both
found by the next barrier; ``shift`` (a caught one-rank error skips a call) on [0, 2], found by
the next object collective; ``ddp`` (a mismatch inside a DDP step) on [1, 3], found by the step's
agreement, which must apply nothing. Prints ``CASE: ErrorName: message`` per rank and case.
"""

import numpy as np

import meshkit
from meshkit.parallel import SGD, data_parallel

meshkit.init_process_group("mpi")
rank = meshkit.get_rank()
groups = {pair: meshkit.new_group(list(pair)) for pair in [(0, 1), (2, 3), (0, 2), (1, 3)]}


def report(case, fn):
    try:
        fn()
        print(f"{case}: no error", flush=True)
    except meshkit.DistError as exc:
        print(f"{case}: {type(exc).__name__}: {exc}".replace("\n", " | "), flush=True)


def size(g):
    meshkit.all_reduce(np.ones(4 if rank == 0 else 8), group=g)  # garbage, silently, on main
    g.barrier()


def dtype(g):
    meshkit.all_reduce(np.ones(4, np.float32 if rank == 2 else np.float64), group=g)
    g.barrier()


def shift(g):
    try:
        if rank == 2:
            raise RuntimeError("a one-rank error, caught")
        meshkit.all_reduce(np.ones(3), group=g)
    except RuntimeError:
        pass
    got = [None, None]
    meshkit.all_gather_object(got, {"rank": rank}, group=g)


def ddp(g):
    model = data_parallel({"w": np.ones(4)}, meshkit.DeviceMesh.from_group(g, "cpu"), "ddp", optimizer=SGD(lr=0.5))
    before = np.array(model.params["w"])
    model.zero_grad()
    meshkit.all_reduce(np.ones(2 if rank == 1 else 4), group=g)  # a loss's all-reduce, of another size on rank 3
    model.mark_grad_ready("w", np.full(4, float(rank)))
    try:
        model.step()
    finally:
        print(f"ddp params unchanged: {bool((np.array(model.params['w']) == before).all())}", flush=True)


if rank in (0, 1):
    report("size", lambda: size(groups[0, 1]))
else:
    report("dtype", lambda: dtype(groups[2, 3]))
if rank in (0, 2):
    report("shift", lambda: shift(groups[0, 2]))
else:
    report("ddp", lambda: ddp(groups[1, 3]))
x = np.ones(2)
meshkit.all_reduce(x)
print(f"world still works: {(x / 2).tolist()}", flush=True)
meshkit.destroy_process_group()
