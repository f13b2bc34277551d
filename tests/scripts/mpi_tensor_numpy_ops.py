"""On real processes (world 3, uneven 5x7 blocks): a few of issue 40's rules (var, cumsum, sort,
argmax, prod, norm, median, slicing and integers on a sharded axis, a boolean mask, a write and
``+=``, tensordot) match NumPy under
meshkit-run, their collectives crossing processes over MPI; every rank prints its verdict."""

import numpy as np

import meshkit
from meshkit.tensor import Partial, Shard, distribute_tensor

meshkit.init_process_group("mpi", timeout=60)
mesh = meshkit.init_device_mesh("cpu", (meshkit.get_world_size(),))
x = np.random.default_rng(40).standard_normal((5, 7))
for placement in (Shard(0), Shard(1), Partial("sum")):
    d = distribute_tensor(x, mesh, [Shard(0)]).redistribute(placements=[placement])
    checks = {
        "var": (np.var(d, axis=0), np.var(x, axis=0)), "std": (np.std(d), np.std(x)),
        "cumsum": (np.cumsum(d, axis=0), np.cumsum(x, axis=0)), "sort": (np.sort(d, axis=0), np.sort(x, axis=0)),
        "argmax": (np.argmax(d), np.argmax(x)), "slice": (d[1:4, ::-1], x[1:4, ::-1]),
        "mask": (d[d > 0], x[x > 0]), "tensordot": (np.tensordot(d, d, ([1], [1])), np.tensordot(x, x, ([1], [1]))),
        "median": (np.median(d, axis=1), np.median(x, axis=1)), "row": (d[3], x[3]), "column": (d[:, 5], x[:, 5]),
        "prod": (np.prod(d, axis=0), np.prod(x, axis=0)),
        "norm": (np.linalg.norm(d, axis=0), np.linalg.norm(x, axis=0)),
    }
    y, want = d.copy(), x.copy()
    y[1, 2], want[1, 2] = 5.0, 5.0
    y += 1.5
    checks["setitem, +="] = (y, want + 1.5)
    for name, (got, ref) in checks.items():
        np.testing.assert_allclose(got.full_tensor(), ref, rtol=1e-12, atol=1e-12, err_msg=f"{name} {placement}")
print(f"rank {meshkit.get_rank()}: NUMPY OPS OK", flush=True)
meshkit.destroy_process_group()
