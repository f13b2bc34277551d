"""The shared-memory path's cases on real processes (tests/shm_cases.py); run with its tiny settings."""

import numpy as np
import shm_cases as cases
from collective_cases import DTYPES

import meshkit

meshkit.init_process_group("mpi", timeout=60)
rank = meshkit.get_rank()
total = sum(cases.check_dtype_ops(dtype) for dtype in DTYPES)
cases.check_repeats()
cases.check_shared_buffer()
timed_out = cases.check_timeout()
if timed_out:
    print(f"TIMEOUT {timed_out}", flush=True)
# last: the group's fingerprint keeps the mismatch, and later checks (a barrier, a split) report it again
mismatch = cases.check_mismatch()
if rank == 0:
    print(f"MISMATCH {mismatch}", flush=True)
print(f"OK {total} checks on rank {rank}", flush=True)
meshkit.destroy_process_group()
