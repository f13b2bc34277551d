"""Hand-written expected groups on real processes (world size 4: the 2x2 mesh, and any that fit),
and ranks passing different arguments: every rank raises, none waits for the others."""

import mesh_cases
import numpy as np

import meshkit

meshkit.init_process_group("mpi", timeout=60)
rank, size = meshkit.get_rank(), meshkit.get_world_size()
for shape in mesh_cases.EXPECTED:
    if int(np.prod(shape)) <= size:
        mesh_cases.check_expected_groups(shape)
mesh = meshkit.init_device_mesh("cpu", (2 if size % 2 == 0 else 1, -1), mesh_dim_names=("dp", "tp"))
text = mesh.describe()
assert "host " in text and "dim 1 'tp'" in text

if size > 1:
    last = size - 1
    try:  # the last rank names the dimension differently: same groups, other names
        meshkit.init_device_mesh("cpu", (size,), mesh_dim_names=("b",) if rank == last else ("a",))
    except meshkit.CollectiveMismatchError as exc:
        message = str(exc)
    else:
        raise AssertionError(f"rank {rank}: different mesh_dim_names were accepted")
    others = "rank 0" if last == 1 else f"ranks {list(range(last))}"
    assert message == (f"meshkit.mesh: rank {rank}: init_device_mesh: ranks passed different mesh_dim_names to "
                       "init_device_mesh; it is collective, so every rank must pass the same: "
                       f"{others}: mesh_dim_names ('a',); rank {last}: mesh_dim_names ('b',)"), message

    try:  # rank 0 passes a shape that cannot hold the world: it raises, and so do the others
        meshkit.init_device_mesh("cpu", (size + 1,) if rank == 0 else (size,))
    except ValueError as exc:
        message = str(exc)
    else:
        raise AssertionError(f"rank {rank}: a bad mesh_shape on rank 0 was accepted")
    wrong = f"mesh_shape ({size + 1},) has {size + 1} ranks but {size} were given"
    expected = f"meshkit.mesh: rank 0: init_device_mesh: {wrong}" if rank == 0 else \
        f"meshkit.mesh: rank {rank}: init_device_mesh: init_device_mesh failed on other ranks (rank 0: {wrong}"
    assert message.startswith(expected), message

    mesh = meshkit.init_device_mesh("cpu", (size,), mesh_dim_names=("a",))  # the right call still works
    assert list(mesh.get_group("a").ranks) == list(range(size))
print("MESH OK", flush=True)
meshkit.destroy_process_group()
