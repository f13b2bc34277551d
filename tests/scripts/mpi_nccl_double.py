"""The nccl backend over MPI as the host engine, with the NCCL double as the runtime.

The double's communicators live in one process, so this runs as a world of one: it checks the
MPI side of the engine (unique id and host names over MPI exchanges, host arrays and objects
over MPI, the split, notices and teardown), not NCCL traffic between processes.
"""

import collective_cases as cases
from doubles import nccl_double as double
import numpy as np
from test_nccl import nccl_ops

import meshkit
from meshkit.comm.engines import cuda_runtime

cuda_runtime.set_runtime(double.FakeRuntime())
meshkit.init_process_group("nccl", timeout=60)
assert meshkit.get_backend() == "nccl", meshkit.get_backend()
total = 0
for dtype in (np.float32, np.int64, np.bool_, np.complex128):
    total += cases.check_all(dtype, dev=double.to_device, host=double.to_host, ops=nccl_ops)
    total += cases.check_all(dtype)  # host arrays: over MPI
    total += cases.check_subgroup(dtype, dev=double.to_device, host=double.to_host, ops=nccl_ops)
total += cases.check_objects()
meshkit.monitored_barrier(timeout=10)
print(f"OK {total} checks on rank {meshkit.get_rank()} of {meshkit.get_world_size()}")
meshkit.destroy_process_group()
