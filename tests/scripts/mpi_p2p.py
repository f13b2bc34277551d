"""Point-to-point cases on real processes."""

import test_p2p

import meshkit

meshkit.init_process_group("mpi", timeout=30)
test_p2p.p2p_cases()
print("P2P OK", flush=True)
meshkit.destroy_process_group()
