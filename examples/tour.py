"""The tour of docs/collectives.md, runnable: ``meshkit-run -n 4 examples/tour.py`` (needs 4 ranks)."""

import sys

import numpy as np

import meshkit

meshkit.init_process_group()                 # "auto": MPI; plain `python` gives a world of one
rank, world = meshkit.get_rank(), meshkit.get_world_size()
problem = f"it takes no arguments, got {sys.argv[1:]}" if sys.argv[1:] else f"it needs 4 ranks, got {world}"
if world != 4 or sys.argv[1:]:               # a usage error: printed once, status 2 on every rank
    if rank == 0:
        print(f"tour.py: error: {problem}; run: meshkit-run -n 4 examples/tour.py", file=sys.stderr)
    meshkit.destroy_process_group()
    raise SystemExit(2)

x = np.full(4, float(rank))
meshkit.all_reduce(x)                        # in place; every rank: [6, 6, 6, 6]
assert (x == 6).all()

mesh = meshkit.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
assert mesh.mesh.tolist() == [[0, 1], [2, 3]]
assert mesh["dp"].mesh.tolist() == {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}[rank]
assert mesh["tp"].mesh.tolist() == {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}[rank]
y = np.array([float(rank)])
meshkit.all_reduce(y, group=mesh.get_group("tp"))   # rank 0, 1: [1.]   rank 2, 3: [5.]
assert y[0] == (1.0 if rank < 2 else 5.0)

out = np.empty(2 * world)                    # all ranks' [rank, rank] side by side
meshkit.all_gather_into_tensor(out, np.full(2, float(rank)))
assert out.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
work = meshkit.all_reduce(x, async_op=True)  # starts at once; MPI moves the data...
busy = sum(i * i for i in range(10_000))     # ...while you compute
work.wait()
assert (x == 24).all()
print(f"rank {rank}: tour OK, dp group {list(mesh.get_group('dp').ranks)}", flush=True)
meshkit.destroy_process_group()
