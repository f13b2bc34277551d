"""Rank 1 leaves with os._exit(0) (no MPI_Finalize, no meshkit notices) while the others wait for it."""
import os

import numpy as np
from mpi4py import MPI

if MPI.COMM_WORLD.Get_rank() == 1:
    os._exit(0)
buf = np.ones(1)
MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, buf)  # never completes: rank 1 is gone
