"""A rank dies at a chosen moment of a save (os._exit: no cleanup, like a kill -9).

argv: DIRECTORY PHASE, PHASE one of before-write, after-write, before-commit, after-commit
(rank 1 dies, or rank 0 for the commit phases); or "resume" DIRECTORY...: in each directory, load
the latest complete checkpoint and check it (one job resumes the saves of every phase)."""

import os
import sys

import numpy as np

import meshkit
from meshkit.checkpoint import CheckpointManager
from meshkit.checkpoint import writer as save_module

meshkit.init_process_group("mpi")
rank = meshkit.get_rank()
mesh = meshkit.init_device_mesh("cpu", (meshkit.get_world_size(),))


def state(step):
    from meshkit.tensor import Shard, distribute_tensor
    full = np.arange(4096.0) * step
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": step}


if sys.argv[1] == "resume":
    for directory in sys.argv[2:]:
        sd = state(0)
        step = CheckpointManager(directory).load(None, sd)
        assert sd["step"] == step and np.array_equal(sd["w"].full_tensor(), np.arange(4096.0) * step), directory
        print(f"{directory} resumed from step {step}")
    sys.exit(0)

directory, phase = sys.argv[1], sys.argv[2]
manager = CheckpointManager(directory)
manager.save(1, state(1))


def die_if(where, victim):
    if phase == where and rank == victim:
        print(f"rank {rank} dies at {where}", flush=True)
        os._exit(9)


real_write, real_commit, real_rename = save_module.write_chunks, save_module._commit, save_module.os.rename


def write_chunks(directory, r, chunks):
    die_if("before-write", 1)
    out = real_write(directory, r, chunks)
    die_if("after-write", 1)
    return out


def rename(src, dst):
    die_if("before-commit", 0)
    real_rename(src, dst)
    die_if("after-commit", 0)


save_module.write_chunks = write_chunks
save_module.os.rename = rename
manager.save(2, state(2))
meshkit.barrier()
