"""Several ranks fail at about the same time; rank 0 waits for them in a barrier forever.

argv[1] says who fails how, after a barrier that every rank passes first:
  raise-all:   every rank but 0 raises ValueError with a 41-line message (a long traceback);
  exit-first:  the last rank calls sys.exit(7) at once, the others but 0 raise 0.3 s later;
  raise-first: rank 1 raises at once, the others but 0 call sys.exit(7) 0.3 s later.
"""

import sys
import time

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
case = sys.argv[1]


def nested(depth: int) -> None:
    if depth == 0:
        raise ValueError(f"rank {rank} fails, last line of its traceback")
    nested(depth - 1)


comm.Barrier()
if rank != 0 and case == "raise-all":
    raise ValueError(f"rank {rank} fails:\n" + "\n".join(f"detail {i} of rank {rank}" for i in range(40)))
if rank != 0 and case == "exit-first":
    if rank != size - 1:
        time.sleep(0.3)
        nested(3)
    sys.exit(7)
if rank != 0 and case == "raise-first":
    if rank != 1:
        time.sleep(0.3)
        sys.exit(7)
    nested(3)
comm.Barrier()
