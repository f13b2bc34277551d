"""Every collective × ReduceOp × dtype against NumPy on real MPI processes (any world size)."""

import collective_cases as cases

import meshkit

meshkit.init_process_group("mpi", timeout=60)
total = 0
for dtype in cases.DTYPES:
    total += cases.check_all(dtype)
    total += cases.check_subgroup(dtype)
total += cases.check_objects()
print(f"OK {total} checks on rank {meshkit.get_rank()} of {meshkit.get_world_size()}")
meshkit.destroy_process_group()
