"""On real processes (world 4): the rules of the layer ops (einsum, max, logsumexp, exp,
where, concatenate, split, take) checked by validate_rules against NumPy on a 1-D mesh of 4 and a
2x2 mesh, where their collectives cross processes over MPI; every rank gets the same report."""

import numpy as np

import meshkit
from support.tensor_validation import validate_rules

OPS = ["np.einsum", "np.max", "meshkit.tensor.logsumexp", "np.exp", "np.where", "np.concatenate", "np.split",
       "np.array_split", "np.take", "np.matmul", "np.sum"]

meshkit.init_process_group("mpi", timeout=60)
size = meshkit.get_world_size()
for shape in ((size,), (2, size // 2)):
    report = validate_rules(meshkit.init_device_mesh("cpu", shape), ops=OPS, max_combos=6)
    totals = report.totals()
    assert totals["wrong"] == 0 and totals["errors"] == 0 and totals["ops"] == len(OPS), report.summary()
    assert totals["tried"] > 150, totals
    everyone = [None] * size
    meshkit.all_gather_object(everyone, totals)
    assert all(t == totals for t in everyone), everyone
    print(f"rank {meshkit.get_rank()} mesh {shape}: {totals}", flush=True)
print("VALIDATION OK", flush=True)
meshkit.destroy_process_group()
