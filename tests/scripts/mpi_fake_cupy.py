"""The collective suite on tests/doubles/fake_cupy.py's strict arrays over the MPI engine, at any world size.

argv[1]: "staged" (MESHKIT_CUDA_AWARE_MPI=0), "chunked" (staged, in 16-byte chunks) or "aware"
(=1). The arrays are not np.ndarray and
refuse implicit host conversion, as CuPy's: an engine path that reads a device array as a NumPy
array fails here. Prints one OK line per rank with the number of checks.
"""

import sys

import collective_cases as cases
from doubles import fake_cupy
from doubles import nccl_double as double
import numpy as np

import meshkit

mode = sys.argv[1]
if mode == "chunked":
    from meshkit.comm.engines import mpi_staging

    mpi_staging.CHUNK_BYTES = 16
with fake_cupy.installed() as cupy:
    meshkit.init_process_group("mpi", timeout=60)
    rank, n = meshkit.get_rank(), meshkit.get_world_size()
    total = 0
    for dtype in (np.float32, np.float64, np.int32, np.bool_, np.complex128, np.float16):
        total += cases.check_all(dtype, dev=cupy.asarray, host=double.to_host)
        total += cases.check_subgroup(dtype, dev=cupy.asarray, host=double.to_host)
    x = cupy.asarray(np.full(5, rank + 1.0, np.float32))
    meshkit.all_reduce(x, meshkit.ReduceOp.AVG, async_op=True).wait()
    assert isinstance(x, fake_cupy.ndarray) and x.get().tolist() == [(n + 1) / 2] * 5, x
    print(f"OK {mode} {total} checks on rank {rank} of {n}", flush=True)
    meshkit.destroy_process_group()
