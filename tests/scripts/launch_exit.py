"""Every rank exits with the code given as the first argument."""

import sys

from mpi4py import MPI

MPI.COMM_WORLD.Barrier()
sys.exit(int(sys.argv[1]))
