"""A two-level machine calibrated over a host-aware mesh, as a rank of ``meshkit-run
-n 4 [--simulate-nodes 2]`` sees it.

argv[1] "calibrate": build benchmarks/two_level.py's ``host_mesh()`` (rows = hosts), calibrate it
(small sizes, one repeat: the test checks structure, not speed) and save the Machine to argv[2]
(rank 0); every rank prints its row of the mesh and the hosts of its ``local`` group, and the mesh
``init_device_mesh((2, 2))`` gives (what examples/mlp.py's hsdp 2x2 runs on).
argv[1] "named": each rank names its host ``box{rank % 2}`` itself (not the rank order's blocks)
and prints the host mesh: its rows must follow the names.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import meshkit  # noqa: E402
from meshkit.plan import calibrate  # noqa: E402
from two_level import host_mesh  # noqa: E402

case = sys.argv[1]
meshkit.init_process_group("mpi", timeout=60)
rank = meshkit.get_rank()
if case == "named":
    os.environ["MESHKIT_HOST_NAME"] = f"box{rank % 2}"
mesh = host_mesh()
local = mesh.get_group("local")
hosts: list = [None] * local.size
meshkit.all_gather_object(hosts, local.host_name(), group=local)
print(f"mesh {mesh.mesh.tolist()} local group {list(local.ranks)} hosts {hosts}", flush=True)
if case == "calibrate":
    machine = calibrate(mesh, sizes=(1 << 10, 1 << 14), repeats=1,
                        kinds=("all_reduce", "all_gather", "reduce_scatter"))
    flat_order = meshkit.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")).mesh.tolist()
    print(f"init_device_mesh (2, 2) {flat_order}", flush=True)
    if rank == 0:
        Path(sys.argv[2]).write_text(json.dumps(machine.to_dict()))
meshkit.destroy_process_group()
