"""meshkit-run -n N: rank 0 stops in pdb (commands from the launcher's stdin); the others wait at a
barrier without deadline (MESHKIT_TIMEOUT is short: they must wait past it)."""

import os
import sys
import time

import numpy as np

import meshkit

meshkit.init_process_group("mpi")
rank = meshkit.get_rank()
x = 40 + rank + 2
started = time.monotonic()
meshkit.breakpoint(rank=int(os.environ.get("BREAK_RANK", "0")))
waited = time.monotonic() - started
y = np.full(1, float(rank))
meshkit.all_reduce(y)  # every rank goes on together after the session
sys.stdout.write(f"rank {rank} waited {waited:.1f} s; sum {y[0]:g}\n")
meshkit.destroy_process_group()
