"""Spawns 2 processes that wait in a barrier for good (join=False), prints their pids once both
wait there, and exits without joining them: the job must end with this process."""

import sys
import time
from pathlib import Path

import meshkit
import spawn_cases

context = meshkit.spawn(spawn_cases.fail_on, args=(sys.argv[1], 9, "none"), nprocs=2, join=False)
deadline = time.monotonic() + 60
while not all(Path(sys.argv[1], f"rank{r}.txt").exists() for r in (0, 1)) and time.monotonic() < deadline:
    time.sleep(0.1)
print("pids", *context.pids(), flush=True)
