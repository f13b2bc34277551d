"""meshkit-run -n N mpi_debug_server.py GO_FILE: every rank starts its debug server, rank 0 prints
``URL <its url>``; the last rank then waits (in "compute": a sleep loop) until GO_FILE exists while
the others wait in an all_reduce; then all finish it, print the sum and stop their servers."""

import os
import sys
import time

import numpy as np

import meshkit

go = sys.argv[1]
meshkit.init_process_group("mpi")
rank, size = meshkit.get_rank(), meshkit.get_world_size()
url = meshkit.debug.start_debug_server()
if rank == 0:
    print(f"URL {url}", flush=True)
x = np.ones(4)
if rank == size - 1:
    while not os.path.exists(go):
        time.sleep(0.01)
meshkit.all_reduce(x)
print(f"rank {rank}: sum {x[0]:g}", flush=True)
meshkit.debug.stop_debug_server()
meshkit.destroy_process_group()
