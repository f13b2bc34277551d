"""Checkpoints under contention on real processes; each rank prints ``OUTCOME <rank> <outcome>``.

argv: DIRECTORY race VALUE (two such jobs at once on one DIRECTORY: rank 0 waits for the other
job's rank 0 at its commit rename, then both rename; a save), or DIRECTORY enospc RANKS (the disk
is full for RANKS, e.g. "0,1": a save to DIRECTORY/save, an async_save to DIRECTORY/async_save)."""

import sys
import time
from pathlib import Path

import test_checkpoint_commit as cases

import meshkit

directory, mode, arg = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
meshkit.init_process_group("mpi", timeout=30)
rank = meshkit.get_rank()
if mode == "race":
    flags = directory.parent / f"{directory.name}-flags"
    flags.mkdir(exist_ok=True)

    def arrive():  # both jobs at their rename (each has planned and written), then both go
        (flags / arg).touch()
        deadline = time.monotonic() + 30
        while len(list(flags.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)

    cases.meet_at_commit(arrive, setattr)
    print(f"OUTCOME {rank} save {cases.outcome(directory, 'save', float(arg))}", flush=True)
else:
    cases.full_disk({int(r) for r in arg.split(",")}, setattr)
    for op in cases.OPS:
        print(f"OUTCOME {rank} {op} {cases.outcome(directory / op, op, 1.0)}", flush=True)
meshkit.destroy_process_group()
