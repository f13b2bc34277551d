"""DTensor construction agreement on real processes (any world size >= 2): uneven blocks through from_local
without shape= give the right global array (under MPI the old inferred shapes differed per rank and
full_tensor returned uninitialised memory with exit status 0); distribute_tensor with a shape that
differs on the last rank raises on every rank, naming it, and the job goes on; separately seeded
arrays are scattered from rank 0 by default. from_local's trusted shape= that differs per rank
(the porting mistake shape=(local rows * size, ...) on uneven blocks: each fits its own block)
raises on every rank where the data first crosses ranks, directly or through a result computed from
it (before: Allgather read past what the shorter ranks sent, 5e-324 and 8e-08 in the result with
exit status 0); a consistent shape= is checked once."""

import numpy as np

import meshkit
from meshkit.tensor import DTensor, Replicate, Shard, distribute_tensor

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
w = distribute_tensor(np.ones((3, 2)), mesh, [Replicate()])
for use in ("full_tensor", "redistribute", "x * 2", "x @ w"):
    x = DTensor.from_local(block, mesh, [Shard(0)], shape=(block.shape[0] * size, 3))  # the porting mistake
    try:
        if use == "full_tensor":
            got = x.full_tensor()
        elif use == "redistribute":
            got = x.redistribute(placements=[Replicate()]).to_local()
        elif use == "x * 2":
            y = x * 2
            got = y.full_tensor()
        else:
            y = x @ w
            got = y.full_tensor()
    except ValueError as exc:
        assert "on global layouts that differ" in str(exc) and f"passed DTensor.from_local(shape=({c * size}, 3)" \
            in str(exc) and f"passed DTensor.from_local(shape=({(rows - (size - 1) * c) * size}, 3)" in str(exc), exc
    else:
        raise AssertionError(f"{use}: shapes that differ per rank were not refused; got {got.tolist()}")

eye = distribute_tensor(np.eye(3), mesh, [Replicate()])
last = meshkit.flight_record()[-1]["seq"]
x = DTensor.from_local(block, mesh, [Shard(0)], shape=(rows, 3))  # consistent: checked once, at the first move
y = x * 2
assert np.array_equal(y.full_tensor(), 2 * a) and np.array_equal(x.full_tensor(), a)
assert np.array_equal((x @ eye).full_tensor(), a)
issued = [(r["op"], r["dtype"]) for r in meshkit.flight_record() if r["seq"] > last]
assert issued == [("all_gather_into_tensor", "int64")] + [("all_gather_into_tensor", "float64")] * 3, issued
print("AGREEMENT OK", flush=True)
meshkit.destroy_process_group()
