"""The last rank ends without a traceback (argv[1]: "exit" is os._exit(3), "kill" is SIGKILL
sent to itself); the others wait for it in a barrier forever."""

import os
import signal
import sys

from mpi4py import MPI

comm = MPI.COMM_WORLD
comm.Barrier()
if comm.Get_rank() == comm.Get_size() - 1:
    if sys.argv[1] == "exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGKILL)
comm.Barrier()
