"""The last rank raises ValueError; the others wait in a barrier or sleep (argv[1])."""

import sys
import time

from mpi4py import MPI

comm = MPI.COMM_WORLD
if comm.Get_rank() == comm.Get_size() - 1:
    time.sleep(0.3)
    print(f"raising at {time.time():.3f}", flush=True)
    raise ValueError(f"launch test failure on rank {comm.Get_rank()}")
if sys.argv[1] == "barrier":
    comm.Barrier()
else:
    time.sleep(60)
