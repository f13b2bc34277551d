"""The cross-rank cases of the protocol on real processes: each ends in the right result or an error on every rank."""

import protocol_cases

import meshkit

meshkit.init_process_group("mpi", timeout=30)
count = protocol_cases.run_cross_rank_cases()
print(f"PROTOCOL OK ({count} cases)", flush=True)
meshkit.destroy_process_group()
