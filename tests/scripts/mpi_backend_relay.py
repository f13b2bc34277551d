"""A third-party backend registered by name over MPI's engine, used through init_process_group."""

from collections import Counter

import ddp_cases
import numpy as np
from doubles.toy_backend import Relay

import meshkit
from meshkit.comm.setup import backends

calls, mpi = Counter(), backends.registered_backends()["mpi"]
meshkit.register_backend("relay", lambda options: Relay(mpi(options), "relay", calls))
meshkit.init_process_group("relay", timeout=60)
assert meshkit.get_backend() == "relay", meshkit.get_backend()
rank, n = meshkit.get_rank(), meshkit.get_world_size()
x = np.array([rank + 1.0])
meshkit.all_reduce(x)
assert x[0] == n * (n + 1) / 2, x
singles = [meshkit.new_group([r]) for r in range(n)]  # the engine's split, once per group
meshkit.all_reduce(x, group=singles[rank])
assert singles[rank].backend == "relay" and calls["split"] == n, (singles[rank].backend, calls)
params, _ = ddp_cases.train()
ddp_cases.assert_matches_reference(params, ddp_cases.reference())
print(f"relay DDP OK, all_reduce calls reached the relay: {calls['all_reduce'] >= 2 + ddp_cases.STEPS}", flush=True)
meshkit.destroy_process_group()
