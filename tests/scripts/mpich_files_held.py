"""Which MPICH shared-memory files (/dev/shm/mpich_*) this rank holds under a name, before and after
``init_process_group``: MPICH makes them at MPI_Init; meshkit unlinks them once every rank of the
node is past it, so that a job killed or aborted leaves none in /dev/shm."""

import os

from mpi4py import MPI  # MPI_Init: MPICH's files exist from here

import meshkit


def named() -> list[str]:
    folder = f"/proc/{os.getpid()}/fd"
    found = []
    for fd in os.listdir(folder):
        try:
            target = os.readlink(f"{folder}/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/shm/mpich_") and not target.endswith(" (deleted)"):
            found.append(target)
    return sorted(found)


MPI.COMM_WORLD.Barrier()  # every rank past MPI_Init
before = named()
meshkit.init_process_group("mpi")
print(f"rank {meshkit.get_rank()}: before {len(before)} after {len(named())}", flush=True)
meshkit.destroy_process_group()
