"""Hand-written expected groups on real processes (world size 4: the 2x2 mesh, and any that fit)."""

import mesh_cases
import numpy as np

import meshkit

meshkit.init_process_group("mpi", timeout=60)
for shape in mesh_cases.EXPECTED:
    if int(np.prod(shape)) <= meshkit.get_world_size():
        mesh_cases.check_expected_groups(shape)
mesh = meshkit.init_device_mesh("cpu", (2, -1), mesh_dim_names=("dp", "tp"))
text = mesh.describe()
assert "host " in text and "dim 1 'tp'" in text
print("MESH OK", flush=True)
meshkit.destroy_process_group()
