"""meshkit-run -n 3 mpi_trace_dir.py CASE, with MESHKIT_TRACE_DIR and a short MESHKIT_TIMEOUT set.

``missing``: rank 2 skips the second all_reduce (and sleeps past the others' timeout);
``mismatch``: after set_debug_level("detail") on every rank, rank 1 passes a shorter array;
``alone``: rank 0 calls set_debug_level("detail") alone, the others go on to an all_reduce.
Each rank catches its error and prints it, so that the job ends normally and every rank that
failed has written its flight record."""

import sys
import time

import numpy as np

import meshkit

case = sys.argv[1]
meshkit.init_process_group("mpi")
rank = meshkit.get_rank()
x = np.ones(4, np.float32)
meshkit.all_reduce(x)
try:
    if case == "missing":
        if rank == 2:
            time.sleep(3.0)
        else:
            meshkit.all_reduce(x)
    elif case == "alone":
        if rank == 0:
            meshkit.set_debug_level("detail")
        meshkit.all_reduce(x)
    else:
        meshkit.set_debug_level("detail")
        meshkit.all_reduce(np.ones(3 if rank == 1 else 4, np.float32))
    sys.stdout.write(f"rank {rank}: no error\n")
except meshkit.DistError as exc:
    sys.stdout.write(f"rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0]}\n")
