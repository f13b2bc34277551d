"""A rank that holds its place: MPI_Init, a barrier, then ``ready.<rank>`` in the working directory
(``PID [CHILD_PID]``, written whole), then it waits until ``go`` appears there (at most 120 s) and
ends cleanly. With argv[1] == "child", each rank first starts a child process (``sleep``) in its
own process group, as a rank's helper would be.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

from mpi4py import MPI

rank = MPI.COMM_WORLD.Get_rank()
MPI.COMM_WORLD.Barrier()  # every rank is past MPI_Init: MPICH's shared memory exists
child = subprocess.Popen(["sleep", "120"]) if sys.argv[1:] == ["child"] else None
Path(f"ready.{rank}.part").write_text(f"{os.getpid()} {child.pid if child else ''}".strip())
os.replace(f"ready.{rank}.part", f"ready.{rank}")
deadline = time.monotonic() + 120
while not Path("go").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
if child is not None:
    child.kill()
    child.wait()
MPI.COMM_WORLD.Barrier()
