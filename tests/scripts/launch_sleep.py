"""Every rank touches ready.<rank> in the working directory, then sleeps 60 s."""

import pathlib
import time

from mpi4py import MPI

pathlib.Path(f"ready.{MPI.COMM_WORLD.Get_rank()}").touch()
time.sleep(60)
