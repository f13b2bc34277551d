"""Every rank touches ready.<rank> in the working directory, then sleeps 60 s.

With argv[1] == "barrier", every rank but 0 waits in MPI_Barrier instead (in C code, where a
SIGINT cannot raise KeyboardInterrupt), so that only rank 0 reacts to a Ctrl-C.
"""

import pathlib
import sys
import time

from mpi4py import MPI

rank = MPI.COMM_WORLD.Get_rank()
pathlib.Path(f"ready.{rank}").touch()
if sys.argv[1:] == ["barrier"] and rank != 0:
    MPI.COMM_WORLD.Barrier()
time.sleep(60)
