"""Device arrays over the MPI engine (the double as the runtime), at any world size.

argv[1]: "staged" (MESHKIT_CUDA_AWARE_MPI=0: pinned host buffers) or "aware" (=1: MPI gets the
device arrays). Runs every collective and point-to-point on device arrays, checks the staging
counts, the mix of host and device arrays, and prints one OK line per rank.
"""

import sys

import collective_cases as cases
from doubles import nccl_double as double
import numpy as np
import pytest

import meshkit
from meshkit.comm.engines import cuda_runtime

mode = sys.argv[1]
rt = double.FakeRuntime()
cuda_runtime.set_runtime(rt)
meshkit.init_process_group("mpi", timeout=60)
assert meshkit.get_backend() == "mpi", meshkit.get_backend()
rank, n = meshkit.get_rank(), meshkit.get_world_size()
total = 0
for dtype in (np.float32, np.int64, np.bool_, np.complex128, np.float16):
    total += cases.check_all(dtype, dev=double.to_device, host=double.to_host)
    total += cases.check_subgroup(dtype, dev=double.to_device, host=double.to_host)

# Async: the Work completes only after the copy back (a settle after it: AVG divides on the device).
x = double.to_device(np.full(5, rank + 1.0, np.float32))
work = meshkit.all_reduce(x, meshkit.ReduceOp.AVG, async_op=True)
work.wait()
assert np.array_equal(x.get(), np.full(5, (n + 1) / 2, np.float32)), x.get()

# Several in flight at once, same size: each has its own staging buffers until it completes.
xs = [double.to_device(np.full(64, 10.0 * i + rank, np.float64)) for i in range(4)]
works = [meshkit.all_reduce(v, async_op=True) for v in xs]
sends = [meshkit.isend(double.to_device(np.full(64, 100.0 * i + rank)), (rank + 1) % n) for i in range(3)]
recvs = [double.to_device(np.zeros(64)) for _ in range(3)]
rworks = [meshkit.irecv(r, (rank - 1) % n) for r in recvs]
for w in works + sends + rworks:
    w.wait()
for i, v in enumerate(xs):
    assert np.array_equal(v.get(), np.full(64, n * 10.0 * i + n * (n - 1) / 2)), (i, v.get()[:2])
for i, r in enumerate(recvs):
    assert np.array_equal(r.get(), np.full(64, 100.0 * i + (rank - 1) % n)), (i, r.get()[:2])

# Reuse: the same sizes again allocate nothing new (staged), or nothing at all (aware).
y = double.to_device(np.ones(1000, np.float64))
meshkit.all_reduce(y)
allocated = rt.pinned_allocations
for _ in range(5):
    meshkit.all_reduce(y)
assert np.array_equal(y.get(), np.full(1000, float(n) ** 6)), y.get()[:3]
if mode == "staged":
    assert rt.pinned_allocations == allocated > 0, (rt.pinned_allocations, allocated)
    assert rt.copies_to_host > 0 and rt.copies_to_device > 0
else:  # MPI read and wrote the device arrays at their own addresses: no staging at all
    assert (rt.pinned_allocations, rt.copies_to_host, rt.copies_to_device) == (0, 0, 0), \
        (rt.pinned_allocations, rt.copies_to_host, rt.copies_to_device)

# Host and device arrays in one call: a TypeError naming both, on every rank (nothing started).
with pytest.raises(TypeError, match=r"output is .*DeviceArray \(device\) but input is numpy.ndarray \(host\)"):
    meshkit.all_gather_into_tensor(double.to_device(np.zeros(2 * n, np.float32)), np.zeros(2, np.float32))
with pytest.raises(TypeError, match=r"\(host\) but .* \(device\)"):
    meshkit.all_gather([np.zeros(2, np.float32) for _ in range(n)], double.to_device(np.zeros(2, np.float32)))
# A "cuda" mesh needs the nccl backend, as in torch: over mpi it is an error naming both.
with pytest.raises(meshkit.DistValueError, match=r"device_type 'cuda' needs meshkit's NCCL engine \(backend 'nccl'\), "
                   r"but the backend here is 'mpi'"):
    meshkit.init_device_mesh("cuda", (n,))
meshkit.barrier()
meshkit.monitored_barrier(timeout=10)
print(f"OK {mode} {total} checks pinned={rt.pinned_allocations} on rank {rank} of {n}")
meshkit.destroy_process_group()
