"""DeviceMesh: groups per dimension, slicing, flatten/unflatten/rearrange, ParallelDims, errors."""

from __future__ import annotations

import io

import numpy as np
import pytest

import meshkit
import mesh_cases
from meshkit import DeviceMesh, ParallelDims, init_device_mesh
from meshkit.comm import local
from meshkit.mesh import device_mesh


@pytest.mark.parametrize("shape", list(mesh_cases.EXPECTED), ids=str)
def test_expected_groups_local_world_8(shape):
    checks = local.run(mesh_cases.check_expected_groups, 8, shape, timeout=30)
    size = int(np.prod(shape))
    assert checks[:size] == [len(shape)] * size and checks[size:] == [0] * (8 - size)


def test_expected_groups_mpi_world_4(mpirun):
    out = mpirun("mpi_mesh.py", 4).stdout
    assert out.count("MESH OK") == 4, out


def test_rank_zero_example_from_the_issue():
    def body():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        return list(mesh.get_group("dp").ranks), list(mesh.get_group("tp").ranks)
    assert local.run(body, 4)[0] == ([0, 2], [0, 1])


def test_out_of_order_slice_is_transposed_and_remembers_its_root():
    def body():
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        sub = mesh["tp", "dp"]
        assert sub.mesh_dim_names == ("tp", "dp") and sub.shape == (4, 2)
        assert sub.mesh.tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
        assert sub.get_group("dp") is mesh.get_group("dp")
        assert sub._anchor is mesh and mesh["dp"]._anchor is mesh
        return sub.get_local_rank("tp"), sub.get_coordinate()
    results = local.run(body, 8)
    assert results[5] == (1, (1, 1))


def test_flatten_unflatten_rearrange_and_their_split_counts():
    def body():
        world = meshkit.current_world()
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
        n = world.split_count
        ab = mesh["a", "b"].flatten("ab")
        assert world.split_count == n + 1 and mesh["ab"] is ab
        assert mesh["a", "b"].flatten("ab") is ab and world.split_count == n + 1
        with pytest.raises(ValueError, match="flatten name 'ab' is already used for a different layout"):
            mesh["b", "c"].flatten("ab")
        full = mesh.flatten()
        assert full.mesh.tolist() == list(range(8)) and full.mesh_dim_names == ("a_b_c",)
        assert full.get_group() is world.default_group  # the world's rank set: no new communicator
        un = full.unflatten(0, (4, -1), ("x", "y"))
        assert un.mesh.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
        assert un.get_group("y") is mesh.get_group("c")  # same rank sets: same communicator
        assert world.split_count == n + 1, "flatten to the root's ranks and unflatten to known sets: no split"
        r = full.rearrange("(node gpu) -> gpu node", node=2)
        assert r.mesh.tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]] and r.mesh_dim_names == ("gpu", "node")
        assert r.get_group("node") is mesh.get_group("a")
        assert world.split_count == n + 2, "'gpu' groups [0..3], [4..7] are new rank sets: one split"
        r2 = mesh.rearrange("a b c -> c (a b)")
        assert r2.mesh_dim_names == ("c", "a_b") and r2.get_group("a_b") is ab.get_group()
        assert world.split_count == n + 2, "rearrange reused the communicators of known rank sets"
        return True
    assert all(local.run(body, 8))


def test_unflatten_of_a_sub_mesh_builds_new_groups_collectively():
    def body():
        world = meshkit.current_world()
        mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("world",))
        n = world.split_count
        m = mesh.unflatten("world", (2, 2, 2), ("pp", "dp", "tp"))
        assert world.split_count == n + 3
        sub = m["dp", "tp"].unflatten("dp", (2, 1), ("dpr", "dps"))
        assert sub.shape == (2, 1, 2) and sub.mesh_dim_names == ("dpr", "dps", "tp")
        return list(m.get_group("dp").ranks), list(sub.get_group("dps").ranks)
    results = local.run(body, 8)
    assert results[5] == ([5, 7], [5])


def test_mesh_over_a_subset_of_the_world():
    def body():
        mesh = DeviceMesh("cpu", [[0, 2], [4, 6]], mesh_dim_names=("dp", "tp"))
        if meshkit.get_rank() % 2:
            assert mesh.get_coordinate() is None
            with pytest.raises(ValueError, match=r"rank \d: DeviceMesh.get_group: this rank is not in the mesh"):
                mesh.get_group("dp")
            return None
        flat = mesh.flatten()  # collective over the mesh's ranks only
        return mesh.get_coordinate(), list(mesh.get_group("dp").ranks), flat.mesh.tolist()
    results = local.run(body, 8)
    assert results[6] == ((1, 1), [2, 6], [0, 2, 4, 6])
    assert results[1] is None


def test_from_group_creates_no_communicator():
    def body():
        world = meshkit.current_world()
        group = meshkit.new_group([1, 2, 3])
        n = world.split_count
        mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("dp",))
        assert world.split_count == n
        if meshkit.get_rank() == 0:
            return mesh.get_coordinate()
        assert mesh.get_group("dp") is group and mesh.flatten("dp2").get_group() is group
        return mesh.get_local_rank()
    assert local.run(body, 4) == [None, 0, 1, 2]


def test_parallel_dims_infers_validates_and_builds():
    assert ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, world_size=8).dp_shard == 2
    assert ParallelDims(dp_replicate=1, dp_shard=-1, tp=1, world_size=4).dp == 4
    with pytest.raises(ValueError, match=r"can infer one degree, but \['dp_shard', 'tp'\] are all -1"):
        ParallelDims(dp_shard=-1, tp=-1, world_size=4)
    with pytest.raises(ValueError, match=r"degrees \{'dp_replicate': 2, 'dp_shard': 2, 'tp': 2\} multiply to 8, "
                                         r"but world_size is 4"):
        ParallelDims(dp_replicate=2, dp_shard=2, tp=2, world_size=4)
    with pytest.raises(ValueError, match="world_size 6 is not divisible by the other degrees' product 4"):
        ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, world_size=6)
    with pytest.raises(ValueError, match=r"degrees must be >= 1 or -1 \(infer\), got \{'tp': 0\}"):
        ParallelDims(tp=0, world_size=4)
    with pytest.raises(TypeError, match="ParallelDims.tp must be an int, got 2.0"):
        ParallelDims(tp=2.0, world_size=4)
    with pytest.raises(Exception):
        ParallelDims(world_size=2).tp = 3  # frozen

    def body():
        world = meshkit.current_world()
        n = world.split_count
        mesh = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, world_size=8).build_mesh("cpu")
        assert world.split_count == n + 4
        assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")
        return mesh["dp"].mesh.tolist(), list(mesh["dp"].get_group().ranks)
    assert local.run(body, 8)[3] == ([1, 3, 5, 7], [1, 3, 5, 7])

    def ones():
        mesh = ParallelDims(dp_replicate=1, dp_shard=-1, tp=1, world_size=2).build_mesh()
        return mesh["dp"].get_group() is mesh.get_group("dp_shard")
    assert local.run(ones, 2) == [True, True]


def test_repr_and_describe_warn_about_dim_order(monkeypatch):
    # Four ranks on two hosts: ranks 0, 1 on "a" and 2, 3 on "b".
    monkeypatch.setattr(device_mesh, "host_names", lambda group: ["a" if r < 2 else "b" for r in group.ranks])

    def body(order):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=order)
        out = io.StringIO()
        return repr(mesh), mesh.describe(file=out), out.getvalue()

    good = local.run(body, 4, ("dp", "tp"))
    assert good[0][0] == "DeviceMesh('cpu', [[0, 1], [2, 3]], mesh_dim_names=('dp', 'tp'))"
    text = good[0][1]
    assert "dim 0 'dp' (size 2) crosses hosts: groups [[0, 2], [1, 3]]" in text
    assert "dim 1 'tp' (size 2): groups [[0, 1], [2, 3]]" in text
    assert "host a: ranks [0, 1]" in text and "warning" not in text
    assert good[0][2] == text + "\n" and good[1][2] == ""  # printed once, by the mesh's first rank

    def transposed():
        mesh = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("dp", "tp"))
        return mesh.describe(file=io.StringIO())
    text = local.run(transposed, 4)[0]
    assert "warning: dim 'tp' crosses hosts while the earlier dim 'dp' does not" in text


@pytest.mark.parametrize("make, error, message", [
    (lambda: DeviceMesh("cpu", [[0, 1], [1, 2]]), ValueError, r"rank 1"),
    (lambda: DeviceMesh("cpu", [0, 4]), ValueError, r"4"),
    (lambda: DeviceMesh("cpu", [0.0, 1.0]), TypeError, r"mesh must hold integer ranks, got dtype float64"),
    (lambda: DeviceMesh("cpu", [0, 1], mesh_dim_names=("a", "b")), ValueError, r"2 .*1|1 .*2"),
    (lambda: DeviceMesh("cpu", [[0, 1]], mesh_dim_names=("a", "a")), ValueError, r"'a'"),
    (lambda: init_device_mesh("cpu", (3, 2)), ValueError, r"mesh_shape \(3, 2\) has 6 ranks but 4"),
    (lambda: init_device_mesh("cuda", (4,)), ValueError, r"device_type 'cuda' needs meshkit's NCCL engine"),
    (lambda: init_device_mesh("tpu", (4,)), ValueError, r"unknown device_type 'tpu'; valid types are \['cpu'\]"),
    (lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["pp"], KeyError,
     r"Invalid mesh dim 'pp'. Valid dims are \['dp', 'tp'\]"),
    (lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")).get_group(), ValueError,
     r"DeviceMesh.get_group: the mesh has 2 dims, so dim is required; valid dims are \['dp', 'tp'\]"),
    (lambda: init_device_mesh("cpu", (2, 2)).unflatten(0, (3, -1), ("a", "b")), ValueError, r"sizes"),
])
def test_bad_input(make, error, message):
    with pytest.raises(error, match=message):
        local.run(make, 4)


def test_detail_mode_reports_a_mesh_that_differs_across_ranks(monkeypatch):
    monkeypatch.setenv("MESHKIT_DEBUG", "detail")

    def body():
        mesh = [[0, 1], [2, 3]] if meshkit.get_rank() != 3 else [[0, 2], [1, 3]]
        try:
            DeviceMesh("cpu", mesh)
        except meshkit.CollectiveMismatchError as exc:
            return str(exc)
    messages = local.run(body, 4, timeout=10)
    assert all("ranks passed different meshes to DeviceMesh" in m for m in messages)
    assert "rank 3: mesh [[0, 2], [1, 3]]" in messages[0]
