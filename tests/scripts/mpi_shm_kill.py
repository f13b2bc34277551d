"""A rank SIGKILLed mid-job (tests/test_shm.py): its peer, waiting for it in an all_reduce over shared
memory, fails at once naming it; nothing of the job is left in /dev/shm.

Rank 1 also holds a segment it created and never unlinked (as a rank killed while creating a group
would), so the launcher's cleanup is what removes that one."""

import os
import signal
import time

import numpy as np

import meshkit
from meshkit.comm.engines import shm_segment

meshkit.init_process_group("mpi", timeout=30)
rank = meshkit.get_rank()
meshkit.all_reduce(np.ones(1 << 16))  # the path works
if rank == 1:
    held = shm_segment.create(4096)
    print(f"HELD {held.path}", flush=True)
    time.sleep(2.5)  # the launcher looks at what its ranks hold open once a second
    print(f"KILLED at {time.time():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
try:
    meshkit.all_reduce(np.ones(1 << 16))
except meshkit.DistError as exc:
    print(f"FAILED at {time.time():.3f}: {type(exc).__name__}: {exc}", flush=True)
    os._exit(3)
