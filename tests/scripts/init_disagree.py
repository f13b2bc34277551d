"""Under meshkit-run: init methods that disagree with the MPI world fail on every rank, naming both;
one that agrees makes the world. Prints ``ENV ...``, ``ARGS ...``, ``ONE ...`` (the errors) and
``AGREED r of n``."""

import os

import meshkit

rank = int(os.environ["RANK"])

os.environ["RANK"] = str(1 - rank)  # every rank: env:// says the other rank
try:
    meshkit.init_process_group("mpi", init_method="env://", timeout=30)
except meshkit.DistValueError as exc:
    print(f"ENV {exc}")
os.environ["RANK"] = str(rank)

try:  # explicit arguments, with a tcp:// URL that is never connected to
    meshkit.init_process_group("mpi", init_method="tcp://127.0.0.1:1", world_size=4, rank=3, timeout=30)
except meshkit.DistValueError as exc:
    print(f"ARGS {exc}")

try:  # rank=0 on every rank: rank 0 agrees, the others do not; all raise
    meshkit.init_process_group("mpi", world_size=2, rank=0, timeout=30)
except meshkit.DistValueError as exc:
    print(f"ONE {exc}")

meshkit.init_process_group("mpi", init_method="env://", timeout=30)
meshkit.barrier()
print(f"AGREED {meshkit.get_rank()} of {meshkit.get_world_size()}")
meshkit.destroy_process_group()
