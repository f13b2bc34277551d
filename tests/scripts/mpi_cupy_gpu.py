"""Real CuPy arrays over the MPI engine on real GPUs (several ranks may share one GPU): every
collective and point-to-point, staged through pinned host buffers or CUDA-aware, as
MESHKIT_CUDA_AWARE_MPI says. Run by tests/test_mpi_device.py only where CuPy sees a GPU."""

import collective_cases as cases
import cupy
import numpy as np

import meshkit

meshkit.init_process_group("mpi", timeout=120)
rank, n = meshkit.get_rank(), meshkit.get_world_size()
total = 0
for dtype in (np.float32, np.float64, np.int64, np.bool_, np.complex128, np.float16):
    total += cases.check_all(dtype, dev=cupy.asarray, host=cupy.asnumpy)
    total += cases.check_subgroup(dtype, dev=cupy.asarray, host=cupy.asnumpy)

# Several async all-reduces in flight on one group, then their results on the device.
xs = [cupy.full(1 << 16, 10.0 * i + rank, cupy.float64) for i in range(4)]
works = [meshkit.all_reduce(v, async_op=True) for v in xs]
for w in works:
    w.wait()
for i, v in enumerate(xs):
    assert bool((v == n * 10.0 * i + n * (n - 1) / 2).all()), (i, v[:2])
meshkit.barrier()
print(f"OK {total} checks on rank {rank} of {n} (GPU {cupy.cuda.Device().id})")
meshkit.destroy_process_group()
