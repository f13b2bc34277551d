"""The MoE layer on 4 real processes: bitwise forward over ep=4 (dropless and capacity-limited),
then ep=2 x dp=2 and ep=2 x tp=2 against one process."""

import expert_parallel_cases as cases

import meshkit

meshkit.init_process_group("mpi", timeout=60)
assert meshkit.get_world_size() == 4, meshkit.get_world_size()
for capacity_factor in (None, 1.0):
    cases.check_bitwise(4, 8, 2, 300, capacity_factor)
cases.check_ep_dp(2, 2, 4, 2, 90)
cases.check_ep_tp(2, 2, 4, 2, 60, 1.0)
print("EP OK", flush=True)
meshkit.destroy_process_group()
