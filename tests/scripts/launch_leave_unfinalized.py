"""Every rank leaves with os._exit(0), without MPI_Finalize, as a script must after a collective
timed out (the timed-out call is still pending, and MPI_Finalize would wait for it); rank 1
leaves 0.5 s after the others, and prints a line just before."""

import os
import time

from mpi4py import MPI

comm = MPI.COMM_WORLD
comm.Barrier()
if comm.Get_rank() == 1:
    time.sleep(0.5)
    print("rank 1 leaves last", flush=True)
os._exit(0)
