"""Tier 1: pure layout arithmetic, no communicator.

Expected groups are written out by hand (as torch's test_device_mesh does), never
recomputed with the code under test.
"""

import doctest
import math

import einops
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshkit.mesh import layout
from meshkit.mesh.layout import (
    coordinate,
    dim_groups,
    dim_index,
    dim_indices,
    flatten,
    infer_shape,
    make_mesh,
    rearrange,
    root_layout,
    same_layout,
    submeshes,
    unflatten,
    validate_dim_names,
    validate_mesh,
)


def mine(layout, rank):
    """The sibling of ``layout`` that holds ``rank``: what the mesh is on that rank."""
    return layout[coordinate(layout, rank)[0]]


def test_docstring_examples():
    assert doctest.testmod(layout).failed == 0


# ---------------------------------------------------------------- hand-written groups

@pytest.mark.parametrize("shape, mesh, groups", [
    ((2, 2), [[0, 1], [2, 3]],
     [[[0, 2], [1, 3]],
      [[0, 1], [2, 3]]]),
    ((2, 4), [[0, 1, 2, 3], [4, 5, 6, 7]],
     [[[0, 4], [1, 5], [2, 6], [3, 7]],
      [[0, 1, 2, 3], [4, 5, 6, 7]]]),
    ((4, 2), [[0, 1], [2, 3], [4, 5], [6, 7]],
     [[[0, 2, 4, 6], [1, 3, 5, 7]],
      [[0, 1], [2, 3], [4, 5], [6, 7]]]),
    ((2, 2, 2), [[[0, 1], [2, 3]], [[4, 5], [6, 7]]],
     [[[0, 4], [1, 5], [2, 6], [3, 7]],
      [[0, 2], [1, 3], [4, 6], [5, 7]],
      [[0, 1], [2, 3], [4, 5], [6, 7]]]),
])
def test_dim_groups_by_hand(shape, mesh, groups):
    m = make_mesh(shape)
    assert m.tolist() == mesh
    root = root_layout(m)
    assert root.tolist() == [mesh]
    for d, expected in enumerate(groups):
        assert dim_groups(root, d).tolist() == expected
        assert dim_groups(root, d - m.ndim).tolist() == expected


def test_dim_groups_of_a_permuted_mesh():
    m = make_mesh((2, 2), [3, 1, 0, 2])
    assert m.tolist() == [[3, 1], [0, 2]]
    assert dim_groups(root_layout(m), 0).tolist() == [[3, 0], [1, 2]]
    assert dim_groups(root_layout(m), 1).tolist() == [[3, 1], [0, 2]]


def test_dim_groups_of_sub_meshes_are_the_root_groups():
    root = root_layout(make_mesh((2, 2, 2)))          # (pp, dp, tp)
    dp_tp = submeshes(root, (1, 2))                   # one sibling per pp
    assert dp_tp.tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert dim_groups(dp_tp, 0).tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]   # root's dp groups
    assert dim_groups(dp_tp, 1).tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]   # root's tp groups
    tp_pp = submeshes(root, (2, 0))
    assert tp_pp.tolist() == [[[0, 4], [1, 5]], [[2, 6], [3, 7]]]
    assert dim_groups(tp_pp, 1).tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]   # root's pp groups


def test_submeshes_by_hand():
    root = root_layout(make_mesh((2, 2, 2)))          # (pp, dp, tp)
    assert submeshes(root, (0, 2)).tolist() == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert submeshes(root, (2, 0)).tolist() == [[[0, 4], [1, 5]], [[2, 6], [3, 7]]]
    assert submeshes(root, (1,)).tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert submeshes(root, (0, 1, 2)).tolist() == [[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]]
    assert submeshes(root, (-1,)).tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # slicing a slice: siblings follow the old sibling first, then the dropped coordinates
    assert submeshes(submeshes(root, (0, 2)), (1,)).tolist() == [[0, 1], [4, 5], [2, 3], [6, 7]]
    assert submeshes(submeshes(root, (2, 1)), (1, 0)).tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def test_the_sub_mesh_of_a_rank_by_hand():
    root = root_layout(make_mesh((2, 2, 2)))          # (pp, dp, tp)
    assert mine(submeshes(root, (1, 2)), 5).tolist() == [[4, 5], [6, 7]]
    assert mine(submeshes(root, (2, 1)), 5).tolist() == [[4, 6], [5, 7]]
    assert mine(submeshes(root, (0,)), 3).tolist() == [3, 7]
    assert mine(submeshes(root, (2,)), 3).tolist() == [2, 3]
    assert mine(submeshes(root, (0, 2)), 2).tolist() == [[2, 3], [6, 7]]
    root24 = root_layout(make_mesh((2, 4)))
    assert mine(submeshes(root24, (1, 0)), 6).tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mine(submeshes(root24, (0, 1)), 6).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert coordinate(submeshes(root24, (0,)), 6) == (2, 1)   # sibling [2, 6], position 1


def test_coordinate_by_hand():
    assert coordinate(make_mesh((2, 4)), 6) == (1, 2)
    assert coordinate(make_mesh((2, 4)), 0) == (0, 0)
    assert coordinate(make_mesh((2, 4)), 8) is None
    assert coordinate(make_mesh((2, 2, 2)), 5) == (1, 0, 1)
    assert coordinate(make_mesh((2, 2), [3, 1, 0, 2]), 0) == (1, 0)
    assert all(type(c) is int for c in coordinate(make_mesh((2, 4)), 6))


def test_flatten_unflatten_by_hand():
    assert flatten(root_layout([[0, 2], [1, 3]])).tolist() == [[0, 2, 1, 3]]
    assert flatten(root_layout(make_mesh((2, 2, 2)))).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert unflatten(root_layout(make_mesh((8,))), 0, (2, -1)).tolist() == [[[0, 1, 2, 3], [4, 5, 6, 7]]]
    assert unflatten(root_layout(make_mesh((2, 4))), 1, (2, 2)).tolist() == [[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]]
    assert unflatten(root_layout(make_mesh((4, 2))), -2, (-1, 2)).tolist() == [[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]]
    assert unflatten(root_layout(make_mesh((2, 4))), 1, (4,)).tolist() == [[[0, 1, 2, 3], [4, 5, 6, 7]]]


def test_flatten_unflatten_act_on_every_sibling():
    root = root_layout(make_mesh((2, 2, 2)))          # (pp, dp, tp)
    dp_tp = submeshes(root, (1, 2))
    assert flatten(dp_tp).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert flatten(submeshes(root, (2, 1))).tolist() == [[0, 2, 1, 3], [4, 6, 5, 7]]
    assert unflatten(flatten(dp_tp), 0, (-1, 2)).tolist() == dp_tp.tolist()
    assert unflatten(submeshes(root, (0,)), 0, (2, 1)).tolist() == [[[0], [4]], [[1], [5]], [[2], [6]], [[3], [7]]]


def test_same_layout_ignores_sibling_order_only():
    root = root_layout(make_mesh((2, 2)))
    dp = submeshes(root, (0,))                        # [[0, 2], [1, 3]]
    assert same_layout(dp, dp[::-1]) and same_layout(root, root)
    assert not same_layout(dp, submeshes(root, (1,)))                  # other groups
    assert not same_layout(dp, [[2, 0], [1, 3]])                       # same rank sets, other order
    assert not same_layout(flatten(root), root)                        # other shape


def test_rearrange_by_hand():
    m, names = rearrange(root_layout(make_mesh((8,))), "(node gpu) -> gpu node", node=2)
    assert m.tolist() == [[[0, 4], [1, 5], [2, 6], [3, 7]]]
    assert names == ("gpu", "node")
    m, names = rearrange(root_layout(make_mesh((2, 4))), "dp (rep shard) -> dp rep shard", rep=2)
    assert m.tolist() == [[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]]
    assert names == ("dp", "rep", "shard")
    m, names = rearrange(root_layout(make_mesh((2, 2))), "a b -> (b a)")
    assert m.tolist() == [[0, 2, 1, 3]]
    assert names == ("b_a",)
    m, names = rearrange(root_layout(make_mesh((2, 4))), "dp (x y) -> (dp x) y", x=2)
    assert m.tolist() == [[[0, 1], [2, 3], [4, 5], [6, 7]]]
    assert names == ("dp_x", "y")
    assert m.flags.c_contiguous
    # every sibling alike: the two tp rows of a 2x4 mesh, each split into 2 nodes of 2
    m, names = rearrange(submeshes(root_layout(make_mesh((2, 4))), (1,)), "(node gpu) -> gpu node", node=2)
    assert m.tolist() == [[[0, 2], [1, 3]], [[4, 6], [5, 7]]]
    assert names == ("gpu", "node")


# ---------------------------------------------------------------- construction and checks

def test_make_mesh():
    assert make_mesh((2, -1), range(4, 8)).tolist() == [[4, 5], [6, 7]]
    assert make_mesh([3]).tolist() == [0, 1, 2]
    assert make_mesh((np.int64(2), 1)).shape == (2, 1)
    m = make_mesh((2, 2))
    assert m.dtype == np.int64 and not m.flags.writeable


def test_validate_mesh_returns_frozen_contiguous_int64_copy():
    src = np.arange(6, dtype=np.int32).reshape(2, 3).T  # non-contiguous, int32
    out = validate_mesh(src, world_size=6)
    assert out.dtype == np.int64
    assert out.flags.c_contiguous and not out.flags.writeable
    assert out.tolist() == [[0, 3], [1, 4], [2, 5]]
    src[0, 0] = 5
    assert out[0, 0] == 0
    assert validate_mesh([[0, 1], [2, 3]]).tolist() == [[0, 1], [2, 3]]
    assert validate_mesh(np.array([1, 0], dtype=np.uint8)).tolist() == [1, 0]
    with pytest.raises(ValueError, match="read-only"):
        out[0, 0] = 1


def test_infer_shape_ok():
    assert infer_shape((2, 3), 6) == (2, 3)
    assert infer_shape((-1,), 5) == (5,)
    assert infer_shape((2, -1, 2), 8) == (2, 2, 2)
    assert all(type(s) is int for s in infer_shape((np.int32(2), -1), 4))


def test_validate_dim_names_ok():
    assert validate_dim_names(None, 3) is None
    assert validate_dim_names(["dp", "tp"], 2) == ("dp", "tp")


def test_dim_index_and_indices():
    names = ("pp", "dp", "tp")
    assert dim_index("dp", names, 3) == 1
    assert dim_index(-1, names, 3) == 2
    assert dim_index(np.int64(0), None, 3) == 0
    assert dim_indices(("tp", "dp"), names, 3) == (2, 1)
    assert dim_indices("pp", names, 3) == (0,)
    assert dim_indices(2, None, 3) == (2,)
    assert dim_indices(["dp", -1], names, 3) == (1, 2)


# ---------------------------------------------------------------- bad input, messages pinned

@pytest.mark.parametrize("shape, size, exc, match", [
    ((-1, -1), 4, ValueError, r"mesh_shape \(-1, -1\) has 2 entries of -1; at most one"),
    ((0, 2), 4, ValueError, r"mesh_shape \(0, 2\) has non-positive size 0; sizes must be >= 1"),
    ((2, -3), 4, ValueError, r"non-positive size -3"),
    ((2.0, 2), 4, TypeError, r"mesh_shape entries must be ints, got 2\.0 \(float\)"),
    ((True, 2), 2, TypeError, r"got True \(bool\)"),
    ("22", 4, TypeError, r"mesh_shape must be a sequence of ints, got '22'"),
    (4, 4, TypeError, r"mesh_shape must be a sequence of ints, got 4"),
    ((), 1, ValueError, r"mesh_shape must have at least one dimension, got \(\)"),
    ((2, 3), 4, ValueError, r"mesh_shape \(2, 3\) has 6 ranks but 4 were given"),
    ((3, -1), 4, ValueError,
     r"mesh_shape \(3, -1\) cannot hold 4 ranks: 4 is not a positive multiple of 3"),
    ((3, -1), 0, ValueError, r"cannot hold 0 ranks"),
])
def test_infer_shape_errors(shape, size, exc, match):
    with pytest.raises(exc, match=match):
        infer_shape(shape, size)


def test_make_mesh_errors():
    with pytest.raises(ValueError, match=r"mesh_shape \(2, -1\) has a -1 but no ranks were given"):
        make_mesh((2, -1))
    with pytest.raises(ValueError, match=r"ranks must be 1-D, got an array of shape \(2, 2\)"):
        make_mesh((4,), [[0, 1], [2, 3]])
    with pytest.raises(ValueError, match=r"mesh_shape \(2, 2\) has 4 ranks but 3 were given"):
        make_mesh((2, 2), [0, 1, 2])
    with pytest.raises(TypeError, match="mesh must hold integer ranks, got dtype float64"):
        make_mesh((2,), [0.0, 1.0])
    with pytest.raises(ValueError, match=r"repeats rank 1;"):
        make_mesh((2, 2), [0, 1, 1, 2])


@pytest.mark.parametrize("mesh, world_size, exc, match", [
    (np.array([[0.0, 1.0]]), None, TypeError, "mesh must hold integer ranks, got dtype float64"),
    ([True, False], None, TypeError, "mesh must hold integer ranks, got dtype bool"),
    (["0", "1"], None, TypeError, "mesh must hold integer ranks, got dtype <U1"),
    (np.array(3), None, ValueError, "mesh must have at least one dimension, got the 0-d array 3"),
    (np.zeros((0, 2), dtype=int), None, ValueError,
     r"mesh must hold at least one rank, got an empty mesh of shape \(0, 2\)"),
    ([[0, 1], [2]], None, ValueError,
     r"mesh must be a rectangular array of ranks \(rows of equal length\), got \[\[0, 1\], \[2\]\]$"),
    ([], None, ValueError, r"mesh must hold at least one rank, got an empty mesh of shape \(0,\)$"),
    ([[]], None, ValueError, r"got an empty mesh of shape \(1, 0\)$"),
    (None, None, TypeError, r"mesh must be an array-like of integer ranks, got None \(NoneType\)$"),
    ([0, "a"], None, TypeError, r"mesh must hold integer ranks, got dtype <U21$"),
    ([[0, 1], [1, 2]], None, ValueError, r"mesh of shape \(2, 2\) repeats rank 1; each rank may appear once"),
    ([[0, 1], [1, 0]], None, ValueError, r"repeats ranks \[0, 1\]"),
    ([0, -1], None, ValueError, "mesh holds negative rank -1; ranks must be >= 0"),
    ([[0, 1], [2, 7]], 4, ValueError,
     "mesh holds rank 7 outside the world of size 4; valid ranks are 0 to 3"),
    ([-2, 5, 6, 0], 4, ValueError, r"mesh holds ranks \[-2, 5, 6\] outside the world of size 4"),
    ([0, 1], 0, ValueError, "world_size must be a positive int, got 0"),
])
def test_validate_mesh_errors(mesh, world_size, exc, match):
    with pytest.raises(exc, match=match):
        validate_mesh(mesh, world_size)


@pytest.mark.parametrize("names, ndim, exc, match", [
    ("dp", 1, TypeError, r"got the string 'dp'; for one dimension write \('dp',\)"),
    (3, 1, TypeError, "mesh_dim_names must be a sequence of strings, got 3"),
    (("dp", 0), 2, TypeError, r"mesh_dim_names must be strings, got 0 \(int\)"),
    (("dp", ""), 2, ValueError, "mesh dim name '' .* is not a valid identifier"),
    (("dp", "t p"), 2, ValueError, "mesh dim name 't p' .* is not a valid identifier"),
    (("dp", "tp", "dp"), 3, ValueError, r"mesh_dim_names \('dp', 'tp', 'dp'\) repeat 'dp'; names must be unique"),
    (("dp",), 2, ValueError, r"has 1 names but the mesh has 2 dimensions"),
    (("dp", "tp", "pp"), 2, ValueError, r"has 3 names but the mesh has 2 dimensions"),
])
def test_validate_dim_names_errors(names, ndim, exc, match):
    with pytest.raises(exc, match=match):
        validate_dim_names(names, ndim)


@pytest.mark.parametrize("dim, names, exc, match", [
    ("pp", ("dp", "tp"), KeyError, r"Invalid mesh dim 'pp'. Valid dims are \['dp', 'tp'\]"),
    ("dp", None, KeyError, r"Cannot find mesh dim 'dp': the mesh has no mesh_dim_names"),
    (2, None, IndexError, "mesh dim 2 is out of range for a mesh with 2 dimensions; valid indices are -2 to 1"),
    (-3, ("dp", "tp"), IndexError, "mesh dim -3 is out of range"),
    (1.0, None, TypeError, r"mesh dim must be an int or a str, got 1\.0 \(float\)"),
    (True, None, TypeError, r"got True \(bool\)"),
])
def test_dim_index_errors(dim, names, exc, match):
    with pytest.raises(exc, match=match):
        dim_index(dim, names, 2)


@pytest.mark.parametrize("dims, names, exc, match", [
    (("dp", "dp"), ("dp", "tp"), ValueError, r"select dim 0 \('dp'\) more than once"),
    (("tp", 1), ("dp", "tp"), ValueError, r"select dim 1 \('tp'\) more than once"),
    ((0, -2), None, ValueError, r"mesh dims \(0, -2\) select dim 0 more than once"),
    ((), ("dp", "tp"), ValueError, r"at least one mesh dim must be selected, got \(\)"),
    (("dp", "pp"), ("dp", "tp"), KeyError, r"Invalid mesh dim 'pp'. Valid dims are \['dp', 'tp'\]"),
    (None, ("dp", "tp"), TypeError,
     r"mesh dims must be a dim name, an index, or a tuple of them, got None \(NoneType\)"),
    (1.5, None, TypeError, r"mesh dims must be a dim name, an index, or a tuple of them, got 1\.5 \(float\)"),
    ({"dp"}, ("dp", "tp"), TypeError, r"got \{'dp'\} \(set\)"),
    (("dp", None), ("dp", "tp"), TypeError, r"mesh dim must be an int or a str, got None \(NoneType\)"),
])
def test_dim_indices_errors(dims, names, exc, match):
    with pytest.raises(exc, match=match):
        dim_indices(dims, names, 2)


def test_groups_and_submeshes_errors():
    root = root_layout(make_mesh((2, 2)))
    with pytest.raises(IndexError, match="mesh dim 2 is out of range"):
        dim_groups(root, 2)
    with pytest.raises(ValueError, match="select dim 1 more than once"):
        submeshes(root, (1, 1))
    with pytest.raises(IndexError, match="mesh dim -3 is out of range"):
        submeshes(root, (-3,))
    with pytest.raises(TypeError, match=r"mesh dims must be a dim name, an index, or a tuple of them, got None"):
        submeshes(root, None)
    with pytest.raises(ValueError, match=r"a layout has shape \(n_siblings, \*mesh_shape\), got an array of "
                                         r"shape \(4,\); root_layout\(mesh\) is the layout of a root mesh"):
        submeshes(make_mesh((4,)), (0,))
    with pytest.raises(ValueError, match=r"a layout has shape"):
        flatten([0, 1])


def test_unflatten_errors():
    root = root_layout(make_mesh((4, 2)))
    with pytest.raises(ValueError, match=(r"cannot unflatten mesh dim 0 of size 4 \(mesh shape \(4, 2\)\): "
                                          r"sizes \(3, -1\) cannot hold 4 ranks")):
        unflatten(root, 0, (3, -1))
    with pytest.raises(ValueError, match=r"sizes \(2, 3\) has 6 ranks but 4 were given"):
        unflatten(root, 0, (2, 3))
    with pytest.raises(TypeError, match=r"cannot unflatten mesh dim 1 .*sizes entries must be ints"):
        unflatten(root, 1, (2.0,))
    with pytest.raises(IndexError, match="mesh dim 2 is out of range"):
        unflatten(root, 2, (2,))


@pytest.mark.parametrize("pattern, sizes, exc, match", [
    ("(node gpu) -> gpu node", {"node": 3}, ValueError,
     r"cannot rearrange mesh of shape \(8,\) with pattern '\(node gpu\) -> gpu node': .*"
     r"can't divide axis of length 8 in chunks of 3"),
    ("a b -> a", {}, ValueError, r"cannot rearrange mesh of shape \(8,\) with pattern 'a b -> a'"),
    ("a -> b", {}, ValueError, r"with pattern 'a -> b': .*Identifiers only on one side"),
    ("... a -> ... a", {}, ValueError, r"pattern '\.\.\. a -> \.\.\. a' has '\.\.\.' in its output"),
    ("... a -> (... a)", {}, ValueError, r"has '\.\.\.' in its output"),
    ("a -> a 1", {}, ValueError, r"pattern 'a -> a 1' has an unnamed output axis '1'"),
    ("a -> a ()", {}, ValueError, r"has an unnamed output axis '\(\)'"),
    (None, {}, TypeError, "pattern must be an einops pattern string, got None"),
])
def test_rearrange_errors(pattern, sizes, exc, match):
    with pytest.raises(exc, match=match):
        rearrange(root_layout(make_mesh((8,))), pattern, **sizes)


def test_rearrange_keeps_group_names_distinct():
    # '(a b)' is named 'a_b'; an input axis literally called 'a_b' would collide.
    with pytest.raises(ValueError, match=r"mesh_dim_names \('a_b', 'a_b'\) repeat 'a_b'"):
        rearrange(root_layout(make_mesh((2, 2, 4))), "a b a_b -> (a b) a_b")


# ---------------------------------------------------------------- properties

@st.composite
def meshes(draw, max_ranks=64):
    """A mesh of 1..4 dims of sizes 1..6 (at most 64 ranks), holding a permutation of ranks."""
    shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)
                 .filter(lambda s: math.prod(s) <= max_ranks))
    ranks = draw(st.permutations(range(math.prod(shape))))
    return make_mesh(shape, ranks)


@settings(max_examples=50, deadline=None)
@given(meshes())
def test_groups_partition_the_mesh(m):
    for d in range(m.ndim):
        groups = dim_groups(root_layout(m), d)
        assert groups.shape == (m.size // m.shape[d], m.shape[d])
        assert sorted(groups.ravel().tolist()) == sorted(m.ravel().tolist())
        for row in groups:
            coords = [coordinate(m, r) for r in row]
            # members differ only along d, and sit at positions 0..n-1 of d in order
            assert [c[d] for c in coords] == list(range(m.shape[d]))
            assert len({c[:d] + c[d + 1:] for c in coords}) == 1


@settings(max_examples=50, deadline=None)
@given(meshes())
def test_unflatten_inverts_flatten(m):
    flat = flatten(root_layout(m))
    assert flat.shape == (1, m.size)
    np.testing.assert_array_equal(unflatten(flat, 0, m.shape), root_layout(m))


@settings(max_examples=50, deadline=None)
@given(meshes(), st.data())
def test_submeshes_over_all_dims_are_the_mesh(m, data):
    root = root_layout(m)
    rank = data.draw(st.sampled_from(m.ravel().tolist()))
    np.testing.assert_array_equal(submeshes(root, tuple(range(m.ndim))), root)
    perm = data.draw(st.permutations(range(m.ndim)))
    np.testing.assert_array_equal(mine(submeshes(root, perm), rank), m.transpose(perm))
    for d in range(m.ndim):
        assert mine(submeshes(root, (d,)), rank).tolist() in dim_groups(root, d).tolist()


@settings(max_examples=50, deadline=None)
@given(meshes(), st.data())
def test_slicing_a_slice_gives_the_slice_of_the_root(m, data):
    """``mesh[a][b]`` holds the same sub-meshes as ``mesh[a[b]]``, and its groups are the root's."""
    root = root_layout(m)
    first = data.draw(st.lists(st.integers(0, m.ndim - 1), min_size=1, max_size=m.ndim, unique=True))
    second = data.draw(st.lists(st.integers(0, len(first) - 1), min_size=1, max_size=len(first), unique=True))
    twice = submeshes(submeshes(root, first), second)
    once = submeshes(root, [first[i] for i in second])
    assert same_layout(twice, once)
    for j, i in enumerate(second):
        assert same_layout(dim_groups(twice, j), dim_groups(root, first[i]))
    rank = data.draw(st.sampled_from(m.ravel().tolist()))
    np.testing.assert_array_equal(mine(twice, rank), mine(once, rank))


@settings(max_examples=50, deadline=None)
@given(meshes(), st.data())
def test_rearrange_matches_einops_and_numpy(m, data):
    axes = [f"a{i}" for i in range(m.ndim)]
    perm = data.draw(st.permutations(range(m.ndim)))
    # group consecutive output axes: cut points between them
    cuts = sorted(data.draw(st.sets(st.integers(1, m.ndim - 1), max_size=m.ndim - 1))) if m.ndim > 1 else []
    bounds = [0, *cuts, m.ndim]
    groups = [[axes[p] for p in perm[a:b]] for a, b in zip(bounds, bounds[1:])]
    rhs = " ".join(g[0] if len(g) == 1 else f"({' '.join(g)})" for g in groups)
    pattern = f"{' '.join(axes)} -> {rhs}"

    out, names = rearrange(root_layout(m), pattern)
    np.testing.assert_array_equal(out[0], einops.rearrange(m, pattern))
    sizes = [math.prod(m.shape[int(a[1:])] for a in g) for g in groups]
    np.testing.assert_array_equal(out[0], m.transpose(perm).reshape(sizes))
    assert names == tuple("_".join(g) for g in groups)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_infer_shape_agrees_with_numpy_reshape(shape, data):
    size = math.prod(shape)
    i = data.draw(st.integers(0, len(shape) - 1))
    with_hole = shape[:i] + [-1] + shape[i + 1:]
    assert infer_shape(with_hole, size) == np.arange(size).reshape(with_hole).shape == tuple(shape)
    assert infer_shape(shape, size) == tuple(shape)
