"""Ranks whose shared-memory settings differ: every rank's init_process_group raises, naming them.

Each size's protocol (MPI, one meeting, chunks, cross-memory attach) depends on the settings, and a
call's header names the call, not the protocol: ranks that picked differently would read one
another's buffers wrongly (tests/test_shm.py)."""

import os
import sys

rank = int(os.environ["RANK"])
if sys.argv[1:] == ["reuse"]:  # an all_reduce after another would skip a step on rank 1 only
    os.environ["MESHKIT_SHM_REUSE"] = str(rank)
else:
    os.environ["MESHKIT_SHM_SMALL_BYTES"] = str(65536 << rank)  # 64 KiB on rank 0, 128 KiB on rank 1

import meshkit  # noqa: E402
from meshkit.comm import DistValueError  # noqa: E402

try:
    meshkit.init_process_group("mpi")
except DistValueError as exc:
    print(f"rank {rank} refused: {exc}", flush=True)
else:
    print(f"rank {rank} started", flush=True)
    meshkit.destroy_process_group()
