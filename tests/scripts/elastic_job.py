"""A small job for the restart tests of ``meshkit-run``: what it does depends on argv[1].

Every rank first prints ``attempt A rank R of N`` (with meshkit.elastic's view) and records its pid
in ``$ELASTIC_LOG/attempt-{A}.rank-{R}`` when that is set.

* ``kill-once R``: on the first attempt rank R SIGKILLs itself after a barrier; later attempts succeed.
* ``vanish-once R``: on the first attempt rank R SIGKILLs its watcher, then itself, writing the time
  to ``$ELASTIC_LOG/killed`` first; later attempts succeed.
* ``raise-always``: rank 1 raises ValueError on every attempt.
* ``shrink-then-kill PATH N``: rank 0 of the first attempt rewrites host file PATH to N slots, then
  rank 1 SIGKILLs itself.
* ``sleep``: every rank sleeps 60 s.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import meshkit
from meshkit import elastic

mode, args = sys.argv[1], sys.argv[2:]
meshkit.init_process_group()
rank, world = meshkit.get_rank(), meshkit.get_world_size()
info = elastic.attempt()
print(f"attempt {info.restart_count} rank {rank} of {world} max_restarts {info.max_restarts} "
      f"range {info.world_size_range} restart {elastic.is_restart()}", flush=True)
log = os.environ.get("ELASTIC_LOG")
if log:
    record = Path(log, f"attempt-{info.restart_count}.rank-{rank}")
    Path(f"{record}.part").write_text(f"{os.getpid()} {world}")
    os.replace(f"{record}.part", record)  # whole: the test reads it while the job runs
meshkit.barrier()
first = info.restart_count == 0
if mode == "kill-once" and first and rank == int(args[0]):
    os.kill(os.getpid(), signal.SIGKILL)
elif mode == "vanish-once" and first and rank == int(args[0]):
    Path(log, "killed").write_text(str(time.time_ns()))
    os.kill(os.getppid(), signal.SIGKILL)  # the watcher: nobody is left to report how this rank ended
    os.kill(os.getpid(), signal.SIGKILL)
elif mode == "raise-always" and rank == 1:
    raise ValueError(f"elastic_job: rank 1 fails on attempt {info.restart_count} too")
elif mode == "shrink-then-kill" and first:
    if rank == 0:
        Path(args[0]).write_text(f"localhost:{args[1]}\n")
    meshkit.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
elif mode == "sleep":
    time.sleep(60)
meshkit.barrier()  # the others wait here for a rank that died: the launcher, not a timeout, ends them
meshkit.destroy_process_group()
