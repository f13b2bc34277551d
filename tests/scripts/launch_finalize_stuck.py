"""Rank 1 ends normally (its MPI_Finalize waits for every rank); the others leave with os._exit(0)."""
import os
import sys

from mpi4py import MPI

MPI.COMM_WORLD.Barrier()
print("done", flush=True)
if MPI.COMM_WORLD.Get_rank() == 1:
    sys.exit(0)
os._exit(0)
