"""Prints torchrun's variables as a ported script reads them, then meshkit's world rank and size.

Each rank writes one line: ``RANK=.. WORLD_SIZE=.. LOCAL_RANK=.. LOCAL_WORLD_SIZE=.. MASTER_ADDR=..
MASTER_PORT=.. | meshkit rank .. of .. on BACKEND`` (read before meshkit is imported, as torch
code does). argv[1]: the backend asked of init_process_group (default "mpi"; "gloo" as ported code).
"""

import os
import sys

names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
seen = " ".join(f"{name}={os.environ.get(name)}" for name in names)

import meshkit  # noqa: E402 (after reading the environment, as a ported script does)

meshkit.init_process_group(sys.argv[1] if len(sys.argv) > 1 else "mpi", timeout=30)
print(f"{seen} | meshkit rank {meshkit.get_rank()} of {meshkit.get_world_size()} on {meshkit.get_backend()}",
      flush=True)
meshkit.barrier()
meshkit.destroy_process_group()
