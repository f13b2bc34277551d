"""The last rank exits with sys.exit(argv[1]); the others wait for it in a barrier forever."""

import sys

from mpi4py import MPI

comm = MPI.COMM_WORLD
if comm.Get_rank() == comm.Get_size() - 1:
    sys.exit(int(sys.argv[1]))
comm.Barrier()
