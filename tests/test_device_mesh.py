"""DeviceMesh: groups per dimension, slicing, flatten/unflatten/rearrange, ParallelDims, errors."""

from __future__ import annotations

import io

import numpy as np
import pytest

import meshkit
import mesh_cases
from meshkit import DeviceMesh, ParallelDims, init_device_mesh
from meshkit.comm import local
from meshkit.comm._seams import current_world
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
        world = current_world()
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
        world = current_world()
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
        world = current_world()
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
        world = current_world()
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


def test_parallel_dims_with_cp_pp_and_ep_follow_torchtitans_rules():
    """cp and pp multiply into the world size; ep borrows dp_shard x cp (a multiple of cp that
    divides dp_shard * cp) and never adds ranks; a combination that breaks either is refused."""
    dims = ParallelDims(dp_shard=-1, cp=2, tp=2, pp=2, world_size=16)
    assert (dims.dp_shard, dims.dp) == (2, 2)
    moe = ParallelDims(dp_shard=4, ep=2, world_size=4)
    assert (moe.dp_shard_in_ep, moe.dp_shard_mod_ep) == (2, 2)
    assert ParallelDims(dp_shard=2, cp=2, ep=4, world_size=4).dp_shard_in_ep == 2
    with pytest.raises(ValueError, match=r"degrees \{'dp_replicate': 1, 'dp_shard': 2, 'tp': 1, 'cp': 2\} multiply to "
                                         r"4, but world_size is 8"):
        ParallelDims(dp_shard=2, cp=2, world_size=8)
    with pytest.raises(ValueError, match=r"ParallelDims.ep 3 must borrow whole ranks of dp_shard x cp \(4 x 1\): it "
                                         r"must be a multiple of cp 1 and divide dp_shard \* cp = 4"):
        ParallelDims(dp_shard=4, ep=3, world_size=4)
    with pytest.raises(ValueError, match=r"ep 2 must borrow whole ranks of dp_shard x cp \(2 x 4\): it must be a "
                                         r"multiple of cp 4"):
        ParallelDims(dp_shard=2, cp=4, ep=2, world_size=8)
    with pytest.raises(ValueError, match=r"ParallelDims.ep must be >= 1 .* got -1"):
        ParallelDims(dp_shard=4, ep=-1, world_size=4)

    def body(dims):
        mesh = dims.build_mesh("cpu")
        return mesh.mesh_dim_names, {name: mesh[name].mesh.tolist() for name in
                                     ("dp", "dp_cp", "ep", "dp_mod_ep", "dp_shard", "tp", "cp", "pp")
                                     if name in mesh.mesh_dim_names or name in mesh._flattened}

    names, groups = local.run(body, 8, ParallelDims(dp_shard=2, cp=2, tp=2, world_size=8))[0]
    assert names == ("dp_replicate", "dp_shard", "cp", "tp")
    assert groups == {"dp": [0, 4], "dp_cp": [0, 2, 4, 6], "dp_shard": [0, 4], "tp": [0, 1], "cp": [0, 2]}
    names, groups = local.run(body, 8, ParallelDims(dp_replicate=2, dp_shard=4, ep=2, world_size=8))[5]
    assert names == ("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "tp")
    # rank 5 = (dp_replicate 1, dp_shard_mod_ep 0, dp_shard_in_ep 1): its expert group and its experts' replicas
    assert groups == {"dp": [0, 1, 2, 3, 4, 5, 6, 7], "ep": [4, 5], "dp_mod_ep": [1, 3, 5, 7],
                      "dp_shard": [4, 5, 6, 7], "tp": [5]}
    names, groups = local.run(body, 8, ParallelDims(dp_shard=2, cp=2, ep=4, pp=2, world_size=8))[3]
    assert names == ("pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")
    assert groups["ep"] == [0, 1, 2, 3] and groups["pp"] == [3, 7] and groups["dp_mod_ep"] == [3]


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


# ---------------------------------------------------------------- every bad argument, message pinned

def _mesh22():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _root_with_flattened():
    mesh = _mesh22()
    mesh.flatten("all")
    return mesh


R = r"meshkit\.mesh: rank \d: "

BAD_ARGUMENTS = {
    # init_device_mesh: shapes
    "shape 0": (lambda: init_device_mesh("cpu", (0, 4)), ValueError,
                R + r"init_device_mesh: mesh_shape \(0, 4\) has non-positive size 0; sizes must be >= 1, or -1"),
    "shape negative": (lambda: init_device_mesh("cpu", (-2, 2)), ValueError,
                       R + r"init_device_mesh: mesh_shape \(-2, 2\) has non-positive size -2"),
    "shape -1 twice": (lambda: init_device_mesh("cpu", (-1, -1)), ValueError,
                       R + r"init_device_mesh: mesh_shape \(-1, -1\) has 2 entries of -1; at most one dimension"),
    "shape float": (lambda: init_device_mesh("cpu", (2.0, 2)), TypeError,
                    R + r"init_device_mesh: mesh_shape entries must be ints, got 2\.0 \(float\) in \(2\.0, 2\)"),
    "shape str": (lambda: init_device_mesh("cpu", "22"), TypeError,
                  R + r"init_device_mesh: mesh_shape must be a sequence of ints, got '22'"),
    "shape None": (lambda: init_device_mesh("cpu", None), TypeError,
                   R + r"init_device_mesh: mesh_shape must be a sequence of ints, got None"),
    "shape empty": (lambda: init_device_mesh("cpu", ()), ValueError,
                    R + r"init_device_mesh: mesh_shape must have at least one dimension, got \(\)"),
    "shape too large": (lambda: init_device_mesh("cpu", (4, 4)), ValueError,
                        R + r"init_device_mesh: mesh_shape \(4, 4\) has 16 ranks but 4 were given "
                            r"\(init_device_mesh lays out the world's 4 ranks\)"),
    "shape not dividing": (lambda: init_device_mesh("cpu", (3, -1)), ValueError,
                           R + r"init_device_mesh: mesh_shape \(3, -1\) cannot hold 4 ranks: 4 is not a positive "
                               r"multiple of 3"),
    # dim names
    "names repeated": (lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "a")), ValueError,
                       R + r"init_device_mesh: mesh_dim_names \('a', 'a'\) repeat 'a'; names must be unique"),
    "names not str": (lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", 1)), TypeError,
                      R + r"init_device_mesh: mesh_dim_names must be strings, got 1 \(int\) in \('a', 1\)"),
    "names count": (lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("a",)), ValueError,
                    R + r"init_device_mesh: mesh_dim_names \('a',\) has 1 names but the mesh has 2 dimensions"),
    "names a str": (lambda: init_device_mesh("cpu", (4,), mesh_dim_names="dp"), TypeError,
                    R + r"init_device_mesh: mesh_dim_names must be a sequence of strings, got the string 'dp'; "
                        r"for one dimension write \('dp',\)"),
    "names not identifiers": (lambda: init_device_mesh("cpu", (4,), mesh_dim_names=("d p",)), ValueError,
                              R + r"init_device_mesh: mesh dim name 'd p' in \('d p',\) is not a valid identifier"),
    "device None": (lambda: init_device_mesh(None, (4,)), ValueError,
                    R + r"init_device_mesh: unknown device_type None; valid types are \['cpu'\]"),
    # DeviceMesh
    "mesh empty": (lambda: DeviceMesh("cpu", []), ValueError,
                   R + r"DeviceMesh: mesh must hold at least one rank, got an empty mesh of shape \(0,\)$"),
    "mesh None": (lambda: DeviceMesh("cpu", None), TypeError,
                  R + r"DeviceMesh: mesh must be an array-like of integer ranks, got None \(NoneType\)$"),
    "mesh ragged": (lambda: DeviceMesh("cpu", [[0, 1], [2]]), ValueError,
                    R + r"DeviceMesh: mesh must be a rectangular array of ranks \(rows of equal length\), "
                        r"got \[\[0, 1\], \[2\]\]$"),
    "mesh 0-d": (lambda: DeviceMesh("cpu", 3), ValueError,
                 R + r"DeviceMesh: mesh must have at least one dimension, got the 0-d array 3"),
    "mesh outside the world": (lambda: DeviceMesh("cpu", [0, 9]), ValueError,
                               R + r"DeviceMesh: mesh holds rank 9 outside the world of size 4; valid ranks are "
                                   r"0 to 3"),
    "mesh repeats": (lambda: DeviceMesh("cpu", [1, 1]), ValueError,
                     R + r"DeviceMesh: mesh of shape \(2,\) repeats rank 1; each rank may appear once"),
    # __getitem__
    "getitem unknown": (lambda: _mesh22()["pp"], KeyError,
                        R + r"DeviceMesh.__getitem__: dims 'pp': Invalid mesh dim 'pp'. Valid dims are "
                            r"\['dp', 'tp'\]$"),
    "getitem unknown, flattened names": (lambda: _root_with_flattened()["pp"], KeyError,
                                         R + r"DeviceMesh.__getitem__: dims 'pp' \(or a name flattened on it: "
                                             r"\['all'\]\): Invalid mesh dim 'pp'"),
    "getitem no names": (lambda: init_device_mesh("cpu", (4,))["dp"], KeyError,
                         R + r"DeviceMesh.__getitem__: dims 'dp': Cannot find mesh dim 'dp': the mesh has no "
                             r"mesh_dim_names; pass mesh_dim_names or use an index in \[-1, 1\)"),
    "getitem repeated": (lambda: _mesh22()["dp", "dp"], ValueError,
                         R + r"DeviceMesh.__getitem__: dims \('dp', 'dp'\): mesh dims \('dp', 'dp'\) select dim 0 "
                             r"\('dp'\) more than once; each dim may be selected once"),
    "getitem int out of range": (lambda: _mesh22()[5], IndexError,
                                 R + r"DeviceMesh.__getitem__: dims 5: mesh dim 5 is out of range for a mesh with "
                                     r"2 dimensions; valid indices are -2 to 1"),
    "getitem None": (lambda: _mesh22()[None], TypeError,
                     R + r"DeviceMesh.__getitem__: dims None: mesh dims must be a dim name, an index, or a tuple "
                         r"of them, got None \(NoneType\)"),
    "getitem float": (lambda: _mesh22()[1.0], TypeError,
                      R + r"DeviceMesh.__getitem__: dims 1\.0: mesh dims must be a dim name, an index, or a tuple "
                          r"of them, got 1\.0 \(float\)"),
    "getitem float in tuple": (lambda: _mesh22()["dp", 1.0], TypeError,
                               R + r"DeviceMesh.__getitem__: dims \('dp', 1\.0\): mesh dim must be an int or a "
                                   r"str, got 1\.0 \(float\)"),
    "getitem empty": (lambda: _mesh22()[()], ValueError,
                      R + r"DeviceMesh.__getitem__: dims \(\): at least one mesh dim must be selected, got \(\)"),
    # flatten, unflatten, rearrange
    "flatten int name": (lambda: _mesh22().flatten(3), TypeError,
                         R + r"DeviceMesh.flatten: name must be a str \(a new dim name\), got 3 \(int\)"),
    "flatten empty name": (lambda: _mesh22().flatten(""), ValueError,
                           R + r"DeviceMesh.flatten: name '' is not a valid identifier; use names like 'dp'"),
    "flatten name with a space": (lambda: _mesh22().flatten("a b"), ValueError,
                                  R + r"DeviceMesh.flatten: name 'a b' is not a valid identifier"),
    "flatten onto a root dim": (lambda: _mesh22()["tp"].flatten("dp"), ValueError,
                                R + r"DeviceMesh.flatten: the flatten name 'dp' is a dim of the root mesh with a "
                                    r"different layout; valid new names differ from \['dp', 'tp'\]"),
    "unflatten sizes": (lambda: _mesh22().unflatten("dp", (3,), ("x",)), ValueError,
                        R + r"DeviceMesh.unflatten: cannot unflatten mesh dim 0 of size 2 \(mesh shape \(2, 2\)\): "
                            r"sizes \(3,\) has 3 ranks but 2 were given"),
    "unflatten sizes None": (lambda: _mesh22().unflatten("dp", None, ("x",)), TypeError,
                             R + r"DeviceMesh.unflatten: cannot unflatten mesh dim 0 .*sizes must be a sequence of "
                                 r"ints, got None"),
    "unflatten names count": (lambda: _mesh22().unflatten("dp", (2, 1), ("x",)), ValueError,
                              R + r"DeviceMesh.unflatten: names \('x',\) has 1 names but sizes \(2, 1\) has 2; "
                                  r"give one new dim name per size"),
    "unflatten names a str": (lambda: _mesh22().unflatten("dp", (2,), "x"), TypeError,
                              R + r"DeviceMesh.unflatten: names must be a sequence of strings, got the string 'x'"),
    "unflatten names None": (lambda: _mesh22().unflatten("dp", (2,), None), TypeError,
                             R + r"DeviceMesh.unflatten: names must be a sequence of new dim names, one per size, "
                                 r"got None"),
    "unflatten names clash": (lambda: _mesh22().unflatten("dp", (2,), ("tp",)), ValueError,
                              R + r"DeviceMesh.unflatten: names \('tp',\) reuse \['tp'\], the names of dims the "
                                  r"mesh keeps; valid names differ from \['tp'\]"),
    "unflatten unknown dim": (lambda: _mesh22().unflatten("zz", (2,), ("x",)), KeyError,
                              R + r"DeviceMesh.unflatten: dim 'zz': Invalid mesh dim 'zz'. Valid dims are "
                                  r"\['dp', 'tp'\]"),
    "rearrange bad pattern": (lambda: _mesh22().rearrange("a b -> c"), ValueError,
                              R + r"DeviceMesh.rearrange: cannot rearrange mesh of shape \(2, 2\) with pattern "
                                  r"'a b -> c': .*Identifiers only on one side"),
    "rearrange None": (lambda: _mesh22().rearrange(None), TypeError,
                       R + r"DeviceMesh.rearrange: pattern must be an einops pattern string, got None"),
    "rearrange unnamed axis": (lambda: _mesh22().rearrange("a b -> a b 1"), ValueError,
                               R + r"DeviceMesh.rearrange: pattern 'a b -> a b 1' has an unnamed output axis '1'"),
    # get_group, get_local_rank, size
    "get_group unknown": (lambda: _mesh22().get_group("pp"), KeyError,
                          R + r"DeviceMesh.get_group: dim 'pp': Invalid mesh dim 'pp'. Valid dims are "
                              r"\['dp', 'tp'\]"),
    "get_group out of range": (lambda: _mesh22().get_group(-3), IndexError,
                               R + r"DeviceMesh.get_group: dim -3: mesh dim -3 is out of range for a mesh with 2 "
                                   r"dimensions; valid indices are -2 to 1"),
    "get_group float": (lambda: _mesh22().get_group(0.0), TypeError,
                        R + r"DeviceMesh.get_group: dim 0\.0: mesh dim must be an int or a str, got 0\.0 \(float\)"),
    "get_local_rank unknown": (lambda: _mesh22().get_local_rank("pp"), KeyError,
                               R + r"DeviceMesh.get_local_rank: dim 'pp': Invalid mesh dim 'pp'"),
    "get_local_rank no dim": (lambda: _mesh22().get_local_rank(), ValueError,
                              R + r"DeviceMesh.get_local_rank: the mesh has 2 dims, so dim is required; valid "
                                  r"dims are \['dp', 'tp'\]"),
    "size unknown": (lambda: _mesh22().size("pp"), KeyError, R + r"DeviceMesh.size: dim 'pp': Invalid mesh dim 'pp'"),
    # from_group
    "from_group None": (lambda: DeviceMesh.from_group(None), TypeError,
                        R + r"DeviceMesh.from_group: group must be a ProcessGroup \(e\.g\. from new_group\), got "
                            r"None \(NoneType\)"),
    "from_group ranks": (lambda: DeviceMesh.from_group([0, 1]), TypeError,
                         R + r"DeviceMesh.from_group: group must be a ProcessGroup .*got \[0, 1\] \(list\)"),
    "from_group device": (lambda: DeviceMesh.from_group(meshkit.new_group([0, 1]), "tpu"), ValueError,
                          R + r"DeviceMesh.from_group: unknown device_type 'tpu'; valid types are \['cpu'\]"),
    "from_group names": (lambda: DeviceMesh.from_group(meshkit.new_group([0, 1]), mesh_dim_names=("a", "b")),
                         ValueError,
                         R + r"DeviceMesh.from_group: mesh_dim_names \('a', 'b'\) has 2 names but the mesh has 1 "
                             r"dimensions"),
}


@pytest.mark.parametrize("make, error, message", list(BAD_ARGUMENTS.values()), ids=list(BAD_ARGUMENTS))
def test_every_bad_argument_raises_on_every_rank_naming_rank_argument_and_what_is_valid(make, error, message):
    def body():
        with pytest.raises(error, match=message) as info:
            make()
        assert isinstance(info.value, meshkit.DistError) and isinstance(info.value, (ValueError, TypeError))
        assert f"rank {meshkit.get_rank()}: " in str(info.value)
        return True
    assert local.run(body, 4, timeout=20) == [True] * 4


def test_a_mesh_error_before_init_process_group_has_no_rank():
    with pytest.raises(TypeError, match=r"^meshkit\.mesh: DeviceMesh\.from_group: group must be a ProcessGroup"):
        DeviceMesh.from_group("world")


# ---------------------------------------------------------------- ranks passing different arguments

def _every_rank_raises(fn, n=4):
    """Run ``fn`` on ``n`` ranks; each must raise a meshkit ValueError; return the messages."""
    def body():
        with pytest.raises(ValueError) as info:
            fn(meshkit.get_rank())
        assert isinstance(info.value, meshkit.DistError)
        return info.value
    return local.run(body, n, timeout=20)


def test_different_dim_name_orders_raise_on_every_rank():
    errors = _every_rank_raises(lambda rank: init_device_mesh(
        "cpu", (2, 2), mesh_dim_names=("tp", "dp") if rank == 3 else ("dp", "tp")))
    for rank, error in enumerate(errors):
        assert isinstance(error, meshkit.CollectiveMismatchError)
        assert str(error) == (f"meshkit.mesh: rank {rank}: init_device_mesh: ranks passed different mesh_dim_names "
                              "to init_device_mesh; it is collective, so every rank must pass the same: "
                              "ranks [0, 1, 2]: mesh_dim_names ('dp', 'tp'); rank 3: mesh_dim_names ('tp', 'dp')")
        assert error.calls == {0: "mesh_dim_names ('dp', 'tp')", 1: "mesh_dim_names ('dp', 'tp')",
                               2: "mesh_dim_names ('dp', 'tp')", 3: "mesh_dim_names ('tp', 'dp')"}


def test_different_shapes_and_meshes_raise_on_every_rank():
    errors = _every_rank_raises(lambda rank: init_device_mesh("cpu", (2, 2) if rank < 2 else (-1,)))
    assert all("ranks passed different mesh shapes to init_device_mesh; it is collective, so every rank must "
               "pass the same: ranks [0, 1]: mesh_shape (2, 2); ranks [2, 3]: mesh_shape (4,)" in str(e)
               for e in errors)
    errors = _every_rank_raises(lambda rank: DeviceMesh(
        "cpu", [[0, 1], [2, 3]] if rank != 1 else [[0, 2], [1, 3]], mesh_dim_names=("a", "b") if rank else None))
    assert all(str(e).startswith(f"meshkit.mesh: rank {r}: DeviceMesh: ranks passed different meshes and "
                                 "mesh_dim_names to DeviceMesh") for r, e in enumerate(errors))
    assert ("rank 0: mesh [[0, 1], [2, 3]], mesh_dim_names None; rank 1: mesh [[0, 2], [1, 3]], mesh_dim_names "
            "('a', 'b'); ranks [2, 3]: mesh [[0, 1], [2, 3]], mesh_dim_names ('a', 'b')") in str(errors[0])


def test_one_rank_with_a_bad_argument_makes_every_rank_raise():
    errors = _every_rank_raises(lambda rank: init_device_mesh("cpu", (3, -1) if rank == 2 else (2, -1)))
    assert "mesh_shape (3, -1) cannot hold 4 ranks" in str(errors[2]) and str(errors[2]).startswith(
        "meshkit.mesh: rank 2: init_device_mesh: mesh_shape")
    for rank in (0, 1, 3):
        assert str(errors[rank]) == (f"meshkit.mesh: rank {rank}: init_device_mesh: init_device_mesh failed on other "
                                     "ranks (rank 2: mesh_shape (3, -1) cannot hold 4 ranks: 4 is not a positive "
                                     "multiple of 3, the product of the other sizes (init_device_mesh lays out the "
                                     "world's 4 ranks)); it is collective, so every rank raises")


def test_derived_meshes_check_their_arguments_across_the_root():
    def flatten(rank):
        _mesh22()["dp"].flatten("x" if rank == 0 else "y")
    errors = _every_rank_raises(flatten)
    assert all("ranks passed different names to DeviceMesh.flatten; it is collective, so every rank must pass "
               "the same: rank 0: name 'x'; ranks [1, 2, 3]: name 'y'" in str(e) for e in errors)

    def flatten_other_dims(rank):
        mesh = _mesh22()
        mesh["dp" if rank < 2 else "tp"].flatten("x")
    errors = _every_rank_raises(flatten_other_dims)
    assert ("ranks passed different layouts to DeviceMesh.flatten; it is collective, so every rank must pass the "
            "same: ranks [0, 1]: layout [[0, 2], [1, 3]]; ranks [2, 3]: layout [[0, 1], [2, 3]]") in str(errors[3])

    def unflatten(rank):  # the same groups either way: without the check, rank 1's "a" would be the others' "b"
        init_device_mesh("cpu", (4,)).unflatten(0, (2, 2), ("b", "a") if rank == 1 else ("a", "b"))
    errors = _every_rank_raises(unflatten)
    assert all("ranks passed different names to DeviceMesh.unflatten" in str(e) and
               "rank 1: names ('b', 'a')" in str(e) for e in errors)

    def rearrange(rank):
        init_device_mesh("cpu", (4,)).rearrange("(a b) -> b a" if rank == 0 else "(a b) -> a b", a=2)
    errors = _every_rank_raises(rearrange)
    assert all("ranks passed different patterns to DeviceMesh.rearrange" in str(e) and
               "rank 0: pattern '(a b) -> b a'; ranks [1, 2, 3]: pattern '(a b) -> a b'" in str(e) for e in errors)


def test_after_a_mismatch_the_right_mesh_still_builds():
    def body():
        rank = meshkit.get_rank()
        with pytest.raises(meshkit.CollectiveMismatchError):
            init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp") if rank == 0 else ("dp", "tp"))
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        return list(mesh.get_group("dp").ranks)
    assert local.run(body, 4, timeout=20) == [[0, 2], [1, 3], [0, 2], [1, 3]]


# ---------------------------------------------------------------- one cache of partitions

def test_partitions_split_over_a_larger_group_are_not_split_again():
    def body():
        world = current_world()
        n = world.split_count
        mesh = DeviceMesh("cpu", [[0, 2], [4, 6]], mesh_dim_names=("dp", "tp"))
        assert world.split_count == n + 3, "the group of the mesh's ranks, then one split per dimension"
        if meshkit.get_rank() % 2:
            return None
        # dp's groups were split over the world while building: every rank of the mesh's group saw it
        assert mesh["dp"].flatten().get_group() is mesh.get_group("dp")
        # the mesh's own ranks: its root group, no split
        assert sorted(mesh.flatten("all").get_group().ranks) == [0, 2, 4, 6]
        assert world.split_count == n + 3
        pairs = mesh.flatten("all").unflatten(0, (2, 2), ("x", "y"))      # x == dp, y == tp
        assert pairs.get_group("x") is mesh.get_group("dp") and world.split_count == n + 3
        mesh.flatten("all").unflatten(0, (4, 1), ("i", "j"))              # singletons: new, split over the mesh
        assert world.split_count == n + 4
        return mesh.get_coordinate()
    assert local.run(body, 8) == [(0, 0), None, (0, 1), None, (1, 0), None, (1, 1), None]


def test_a_partition_of_the_parent_itself_is_the_parent():
    def body():
        world = current_world()
        n = world.split_count
        assert meshkit.new_group(list(range(4))) is world.default_group
        mesh = DeviceMesh("cpu", [3, 1, 2, 0])
        assert mesh.get_group() is world.default_group and world.split_count == n
        return True
    assert local.run(body, 4) == [True] * 4


def test_torchtitans_private_flatten_is_flatten():
    """torchtitan calls ``mesh["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp")``,
    which was missing."""
    def body():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        dp = mesh["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp")
        assert dp is mesh["dp_replicate", "dp_shard"].flatten("dp") and mesh["dp"] is dp
        assert mesh._flatten().mesh_dim_names == ("dp_replicate_dp_shard",)
        with pytest.raises(ValueError, match=r"DeviceMesh._flatten: backend_override='nccl' is not supported"):
            mesh._flatten("x", backend_override="nccl")
        return dp.mesh.tolist(), dp.get_local_rank()

    assert local.run(body, 4) == [([0, 1, 2, 3], r) for r in range(4)]
