"""No blocking call waits past its timeout, and meshkit-run names the rank that hung.

3 ranks under ``meshkit-run --max-restarts 1``, the world's timeout 2 s:

* attempt 0: ranks 0 and 1 call ``new_group([0, 1])`` while rank 2 runs a world ``all_reduce``.
  On main, the others' barrier before MPI's ``Comm.Split`` matched rank 2's collective: rank 2
  got 1.0 instead of 3.0, and ranks 0 and 1 blocked in ``Comm.Split`` forever. Now group creation
  first checks that every rank makes the same call: every rank fails within its timeout.
* attempt 1: rank 1 sleeps in its own code while ranks 0 and 2 run a world ``all_reduce``: their
  timeouts fire, and the launcher names rank 1 (on main: "rank 2 raised an exception").
"""

import os
import time

import numpy as np

import meshkit

meshkit.init_process_group("mpi", timeout=2.0)
rank = meshkit.get_rank()
attempt = int(os.environ["MESHKIT_RESTART_COUNT"])
if attempt == 0:
    if rank < 2:
        meshkit.new_group([0, 1])
        print("new_group returned", flush=True)
    else:
        x = np.ones(1)
        meshkit.all_reduce(x)
        print(f"all_reduce gave {x.tolist()}", flush=True)
else:
    if rank == 1:
        time.sleep(60)
    meshkit.all_reduce(np.ones(1))
meshkit.destroy_process_group()
