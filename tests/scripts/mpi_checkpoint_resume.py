"""Resuming from a checkpoint on real processes: a state dict built once before training, saved by a
CheckpointManager; a new job (new processes) restores into a dict built once and trains on.

argv: DIRECTORY PHASE, PHASE "first" (3 steps, save step 3) or "resume" (load step 3, 3 more
steps, save step 6, compare with 6 uninterrupted steps), for every strategy that fits 2 ranks
and both optimizers."""

import sys
from pathlib import Path

import checkpoint_state_cases as cases

import meshkit

directory, phase = Path(sys.argv[1]), sys.argv[2]
meshkit.init_process_group("mpi", timeout=60)
for kind in [k for k in cases.KINDS if k != "hsdp"]:
    for opt in ("adamw", "sgd"):
        where = directory / f"{kind}-{opt}"
        if phase == "first":
            cases.train_and_save(kind, opt, "once", "manager", where)
        else:
            cases.check(cases.resume_and_train(kind, opt, "once", "manager", where), opt, where, f"{kind} {opt}")
if phase == "resume":
    print("RESUMED OK", flush=True)
meshkit.destroy_process_group()
