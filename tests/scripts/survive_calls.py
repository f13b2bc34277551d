"""Under ``meshkit-run -n 4 --survive 1``: rank 1 dies while every survivor is in a different kind of call.

Rank 0 waits in a receive from rank 2, which never sends (it is sending 1 MiB to the dead rank 1,
past any eager limit); rank 3 waits in an all_reduce the others never join (over meshkit's shared
memory path, which --survive takes: its wait finds rank 1's process gone). Each must raise one
RankFailedError naming rank 1 (the receive woken by a survivor's revoke, not by a timeout), then
the survivors shrink to 3 ranks, whose world has the shared-memory path again, and an all_reduce
over them is right.
"""

import os
import time

import numpy as np

import meshkit
from meshkit.comm import RankFailedError

meshkit.init_process_group("mpi", timeout=60)
rank = meshkit.get_rank()
print(f"old rank {rank}: world of 4: {meshkit.new_group(list(range(4))).paths()}", flush=True)
meshkit.barrier()
if rank == 1:  # once the others surely left the barrier (a barrier's last message may still be on its
    time.sleep(0.2)  # way when the first rank leaves it: their barrier would meet the death, not their call)
    os._exit(9)
started = time.perf_counter()
buf = np.zeros(1 << 17)
calls = {0: lambda: meshkit.recv(buf, src=2), 2: lambda: meshkit.send(buf, dst=1), 3: lambda: meshkit.all_reduce(buf)}
try:
    calls[rank]()
    raise SystemExit(f"rank {rank}: no error")
except RankFailedError as exc:
    waited = time.perf_counter() - started
    assert exc.failed_ranks == (1,) and waited < 10, (exc.failed_ranks, waited)
    print(f"old rank {rank}: RankFailedError naming {list(exc.failed_ranks)} after {waited:.3f} s", flush=True)
shrunk = meshkit.comm.shrink_world()
total = np.array([float(rank)])
meshkit.all_reduce(total)
assert (shrunk.size, shrunk.failed, total[0]) == (3, (1,), 5.0), (shrunk, total)
print(f"old rank {rank}: world of 3: {meshkit.new_group(list(range(3))).paths()}", flush=True)
print(f"old rank {rank}: now rank {meshkit.get_rank()} of {meshkit.get_world_size()}, sum {total[0]}", flush=True)
meshkit.destroy_process_group()
