"""Every collective on real GPUs over NCCL (CuPy arrays), one GPU per rank; run by
tests/test_nccl.py only where CuPy sees a GPU."""

import collective_cases as cases
import cupy
import numpy as np
from test_nccl import nccl_ops

import meshkit

meshkit.init_process_group("nccl", timeout=120)
assert meshkit.get_backend() == "nccl", meshkit.get_backend()
total = 0
for dtype in (np.float16, np.float32, np.float64, np.int32, np.int64, np.uint8, np.bool_, np.complex64, np.int16):
    total += cases.check_all(dtype, dev=cupy.asarray, host=cupy.asnumpy, ops=nccl_ops)
    total += cases.check_subgroup(dtype, dev=cupy.asarray, host=cupy.asnumpy, ops=nccl_ops)
total += cases.check_all(np.float64)  # host arrays over MPI beside NCCL
total += cases.check_objects()
print(f"OK {total} checks on rank {meshkit.get_rank()} of {meshkit.get_world_size()}")
meshkit.destroy_process_group()
