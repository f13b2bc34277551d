"""Local DTensor operations against NumPy: copies, casts, shape queries, np.where/np.clip, the
reduction methods, in-place operators and basic indexing, on 1-D (uneven) and 2-D meshes."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
from tensor_cases import new_records

import meshkit
from meshkit.comm import local
from meshkit.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial()
RNG = np.random.default_rng(11)
A, E = RNG.standard_normal((5, 7)), RNG.standard_normal((5, 7))  # uneven over 3 and over 2x2
MESHES = [(3,), (2, 2)]


def _placements(mesh_shape, options=(S0, S1, R, P)):
    return list(itertools.product(options, repeat=len(mesh_shape)))


def _each(mesh_shape, fn):
    """``fn(mesh, placements)`` for every placement tuple on every rank: a list of (name, got, want)."""
    def body():
        mesh = meshkit.init_device_mesh("cpu", mesh_shape)
        return [row for pl in _placements(mesh_shape) for row in fn(mesh, pl)]
    return local.run(body, int(np.prod(mesh_shape)), timeout=120)


def _check(results):
    for rank in results:
        for name, got, want in rank:
            assert np.shape(got) == np.shape(want), name
            assert np.asarray(got).dtype == np.asarray(want).dtype, name
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_copies_casts_and_shape_queries(mesh_shape):
    ints = np.arange(35).reshape(5, 7) - 17

    def fn(mesh, pl):
        d = distribute_tensor(A, mesh, pl)
        rows = []
        for name, got, want in [("copy", d.copy(), A), ("np.copy", np.copy(d), A),
                                ("deepcopy", copy.deepcopy(d), A)]:
            assert got.placements == d.placements and got.device_mesh is mesh, name
            assert not np.shares_memory(got.to_local(), d.to_local()), name
            rows.append((name, got.full_tensor(), want))
        assert np.shape(d) == (5, 7) and np.ndim(d) == 2 and np.size(d) == 35 and np.size(d, 1) == 7
        for dtype in (np.float32, np.int64, np.complex128, bool):
            cast = d.astype(dtype)
            rows.append((f"astype({dtype.__name__}) {pl}", cast.full_tensor(), A.astype(dtype)))
            assert cast.dtype == np.dtype(dtype)
        half = distribute_tensor(np.full((5, 7), 0.6), mesh, pl)  # Partial terms 0.6 cast alone give 0
        rows.append(("astype(int) of 0.6 terms", (half * 2.0).astype(np.int64).full_tensor(), np.ones((5, 7), int)))
        i = distribute_tensor(ints, mesh, pl)
        rows.append(("int astype(float64)", np.astype(i, np.float64).full_tensor(), ints.astype(np.float64)))
        return rows

    _check(_each(mesh_shape, fn))


def test_astype_keeps_a_partial_only_for_safe_casts():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        p = distribute_tensor(A, mesh, [P])
        start = meshkit.flight_record()
        kept = p.astype(np.complex128), p.astype(np.float64, copy=False)
        assert new_records(start) == []
        reduced = p.astype(np.float32)
        m = distribute_tensor(A > 0, mesh, [Partial("max")]).astype(np.int8)  # bool -> int: order kept
        return [x.placements for x in (*kept, reduced, m)], m.full_tensor().tolist()

    for placements, m in local.run(body, 2):
        assert placements == [(P,), (P,), (R,), (Partial("max"),)]
        assert m == (A > 0).astype(np.int8).tolist()


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_where_clip_and_the_reduction_methods(mesh_shape):
    def fn(mesh, pl):
        d, e = distribute_tensor(A, mesh, pl), distribute_tensor(E, mesh, pl)
        lo, hi = distribute_tensor(E - 1, mesh, pl), distribute_tensor(E + 1, mesh, pl)
        c = d > 0
        return [(f"where {pl}", np.where(c, d, e).full_tensor(), np.where(A > 0, A, E)),
                (f"where scalar {pl}", np.where(c, d, 0.0).full_tensor(), np.where(A > 0, A, 0.0)),
                (f"where P cond {pl}", np.where(d, e, d).full_tensor(), np.where(A, E, A)),
                (f"clip {pl}", np.clip(d, -0.5, 0.5).full_tensor(), np.clip(A, -0.5, 0.5)),
                (f"clip lo {pl}", np.clip(d, -0.5, None).full_tensor(), np.clip(A, -0.5, None)),
                (f"clip min= {pl}", np.clip(d, max=0.25).full_tensor(), np.clip(A, max=0.25)),
                (f"clip arrays {pl}", np.clip(d, lo, hi).full_tensor(), np.clip(A, E - 1, E + 1)),
                (f".clip {pl}", d.clip(-1, 1).full_tensor(), A.clip(-1, 1)),
                (f".max {pl}", d.max().full_tensor(), A.max()),
                (f".min(0) {pl}", d.min(axis=0).full_tensor(), A.min(axis=0)),
                (f".sum(1) {pl}", d.sum(axis=1).full_tensor(), A.sum(axis=1)),
                (f".mean {pl}", d.mean().full_tensor(), A.mean())]

    _check(_each(mesh_shape, fn))


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_in_place_operators_write_the_block_where_placements_hold(mesh_shape):
    def fn(mesh, pl):
        x, e = distribute_tensor(A.copy(), mesh, pl), distribute_tensor(E, mesh, pl)
        block = x.to_local()
        x += e
        x *= 2.0
        np.subtract(x, e, out=x)
        y = np.add(x, 1.0, out=(x,)) if not any(p.is_partial() for p in pl) else x
        assert y is x and x.to_local() is block and x.placements == pl
        want = (A + E) * 2.0 - E + (0.0 if any(p.is_partial() for p in pl) else 1.0)
        return [(f"in place {pl}", x.full_tensor(), want)]

    _check(_each(mesh_shape, fn))


def test_in_place_operators_that_would_change_placements_raise_on_every_rank():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        messages = []
        for x, y in [(distribute_tensor(A, mesh, [P]), distribute_tensor(A, mesh, [S1])),  # P + S1 is S1
                     (distribute_tensor(A, mesh, [R]), distribute_tensor(E, mesh, [S1]))]:  # R + S1 is S1
            start = meshkit.flight_record()
            with pytest.raises(ValueError, match=r"np.add: in place \(x op= y, or out=x\) the result would have "
                                                 r"placements \((Replicate|Shard\(dim=1\))") as info:
                x += y
            assert new_records(start) == [], "refused before any communication"
            messages.append(str(info.value).split(": ", 2)[2])
        w = distribute_tensor(np.eye(7), mesh, [R])
        with pytest.raises(NotImplementedError, match=r"np.matmul: out= is not supported on DTensors \(an in-place "
                                                      r"operator such as x @= y passes it\): write x = x @ y"):
            w @= w
        with pytest.raises(TypeError, match="out= must be a DTensor"):
            np.add(distribute_tensor(A, mesh, [R]), 1.0, out=np.empty((5, 7)))
        return messages

    first, second = local.run(body, 2)
    assert first == second


def _index_cases():
    return [(np.s_[1:4], (R, S1)), (np.s_[2], (R, S1)), (np.s_[-1, ::2], (R, R)), (np.s_[..., 3], (S0, R)),
            (np.s_[None, :, 1:6:2], (S0, P)), (np.s_[:, None, -2], (S0, R)), (np.s_[::-1], (R, S1)),
            (np.s_[:, :], (S0, S1)), (np.s_[0:5, 3], (S0, S0)), (np.s_[4, 0], (P, R))]


@pytest.mark.parametrize("key,pl", _index_cases())
def test_basic_indexing_along_unsharded_dims(key, pl):
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2))
        d = distribute_tensor(A, mesh, pl)
        r = d[key]
        return r.shape, r.placements, r.full_tensor()

    want = A[key]
    for shape, placements, full in local.run(body, 4):
        assert shape == want.shape
        np.testing.assert_array_equal(full, want)


def test_deepcopy_shares_the_mesh_and_copies_the_block():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        d = distribute_tensor(A.copy(), mesh, [S0])
        twin = copy.deepcopy({"w": d})["w"]
        assert isinstance(twin, DTensor) and twin.device_mesh is mesh
        twin += 1.0
        return d.full_tensor(), twin.full_tensor()

    for full, twin in local.run(body, 2):
        np.testing.assert_array_equal(full, A)
        np.testing.assert_array_equal(twin, A + 1.0)


def test_indexing_a_sharded_dim_moves_data_and_index_arrays_beside_a_slice_are_refused():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (3,))
        d = distribute_tensor(A, mesh, [S1])
        np.testing.assert_array_equal(d[:, 2].full_tensor(), A[:, 2])  # issue 40: the sharded dim gathered
        assert d[:, 2].placements == (R,) and d[0, 1:].placements == (Shard(0),)
        np.testing.assert_array_equal(d[0, 1:].full_tensor(), A[0, 1:])
        np.testing.assert_array_equal(d[[0, 1]].full_tensor(), A[[0, 1]])
        np.testing.assert_array_equal(d[[0, 1], [1, 2]].full_tensor(), A[[0, 1], [1, 2]])  # two index arrays
        with pytest.raises(NotImplementedError, match=r"DTensor.__getitem__: index \(\[0, 1\], slice\(1, 3, None\)\) "
                                                      r"\(placements \(Shard\(dim=1\),\)\): integer arrays are "
                                                      r"supported beside integers and full slices"):
            d[[0, 1], 1:3]
        with pytest.raises(IndexError, match=r"index 7 is out of bounds for axis 1 with size"):
            d[[0, 1], [1, 7]]
        with pytest.raises(IndexError, match="index 5 is out of bounds for dim 0 with size 5"):
            d[5]
        with pytest.raises(IndexError, match="too many indices"):
            d[0, :, 1]
        with pytest.raises(TypeError, match=r"len\(\) of a 0-d DTensor"):
            len(distribute_tensor(A, mesh, [R])[0, 0])
        return d[-2].placements, d[1:3, 0:7].shape

    assert local.run(body, 3) == [((Shard(0),), (2, 7))] * 3
