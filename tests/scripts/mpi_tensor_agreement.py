"""Issue 23.2 and 23.9 on real processes (any world size >= 2): uneven blocks through from_local
without shape= give the right global array (under MPI the old inferred shapes differed per rank and
full_tensor returned uninitialised memory with exit status 0); distribute_tensor with a shape that
differs on the last rank raises on every rank, naming it, and the job goes on; separately seeded
arrays are scattered from rank 0 by default."""

import numpy as np

import meshkit
from meshkit.tensor import DTensor, Shard, distribute_tensor

meshkit.init_process_group("mpi", timeout=60)
rank, size = meshkit.get_rank(), meshkit.get_world_size()
mesh = meshkit.init_device_mesh("cpu", (size,))
rows = 2 * size - 1  # uneven: torch.chunk gives the last rank one row fewer
a = np.arange(rows * 3.0).reshape(rows, 3)
c = -(-rows // size)
block = a[min(rank * c, rows):min((rank + 1) * c, rows)]
d = DTensor.from_local(block, mesh, [Shard(0)])
assert d.shape == (rows, 3), d.shape
assert np.array_equal(d.full_tensor(), a), d.full_tensor()

try:
    distribute_tensor(np.zeros(4 + (rank == size - 1)), mesh, [Shard(0)])
except ValueError as exc:
    assert f"rank {size - 1} passed shape (5,)" in str(exc), exc
else:
    raise AssertionError("ranks that passed different shapes were not refused")

try:  # not torch.chunk's cutting: the first rank one row short
    DTensor.from_local(np.zeros((c - (rank == 0), 3)), mesh, [Shard(0)])
except ValueError as exc:
    assert "which is not how" in str(exc) and "blocks follow torch.chunk" in str(exc), exc
else:
    raise AssertionError("blocks that are not a torch.chunk cutting were not refused")

seeded = distribute_tensor(np.random.default_rng(rank).standard_normal((rows, 3)), mesh, [Shard(0)])
assert np.array_equal(seeded.full_tensor(), np.random.default_rng(0).standard_normal((rows, 3)))
print("AGREEMENT OK", flush=True)
meshkit.destroy_process_group()
