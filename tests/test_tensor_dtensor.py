"""DTensor construction, description and bad input, on the local engine."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from tensor_cases import new_records

import meshkit
from meshkit.comm import local
from meshkit.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor


def test_distribute_tensor_gives_each_rank_its_block_and_the_global_description():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2))
        a = np.arange(24.0).reshape(6, 4)
        d = distribute_tensor(a, mesh, [Shard(0), Shard(1)])
        assert d.shape == (6, 4) and d.ndim == 2 and d.dtype == np.float64 and d.size == 24
        assert d.device_mesh is mesh and d.placements == (Shard(0), Shard(1))
        nested = distribute_tensor(np.arange(6), mesh, [Shard(0), Shard(-1)])
        assert nested.placements == (Shard(0), Shard(0))
        return d.to_local().tolist(), nested.to_local().tolist()

    blocks = local.run(body, 4)
    a = np.arange(24.0).reshape(6, 4)
    assert [b for b, _ in blocks] == [a[0:3, 0:2].tolist(), a[0:3, 2:4].tolist(), a[3:6, 0:2].tolist(),
                                      a[3:6, 2:4].tolist()]
    assert [n for _, n in blocks] == [[0, 1], [2], [3, 4], [5]]


def test_from_local_even_and_uneven():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (4,))
        rank = meshkit.get_rank()
        even = DTensor.from_local(np.full((2, 3), rank), mesh, [Shard(0)])
        sizes = [2, 2, 1, 0]  # 5 rows over 4 ranks, torch.chunk
        uneven = DTensor.from_local(np.full((sizes[rank], 3), float(rank)), mesh, [Shard(0)], shape=(5, 3),
                                    run_check=True)
        return even.shape, uneven.full_tensor()[:, 0].tolist()

    for shape, column in local.run(body, 4):
        assert shape == (8, 3) and column == [0, 0, 1, 1, 2]


def test_bad_placements_are_named_with_rank_and_argument():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        a = np.zeros((4, 4))
        errors = []
        for placements, kind in [([Shard(0), Shard(1)], ValueError), ([Shard(2)], IndexError),
                                 ([Shard(-3)], IndexError), (["S0"], TypeError), (Shard(0), TypeError)]:
            with pytest.raises(kind) as info:
                distribute_tensor(a, mesh, placements)
            errors.append(str(info.value))
        with pytest.raises(ValueError) as info:
            DTensor.from_local(np.zeros((3, 4)), mesh, [Shard(0)], shape=(4, 4))
        errors.append(str(info.value))
        return errors

    errors = local.run(body, 2)[1]
    assert "rank 1: distribute_tensor: placements has 2 entries" in errors[0] and "mesh has 1 dimensions" in errors[0]
    assert "placements[0] Shard(dim=2): dim 2 is out of range for an array of 2 dimensions" in errors[1]
    assert "Shard(dim=-3)" in errors[2] and "placements[0] must be Shard, Replicate or Partial" in errors[3]
    assert "a sequence of Placement" in errors[4]
    assert "rank 1: DTensor.from_local: local has shape (3, 4)" in errors[5] and "(2, 4)" in errors[5]


def test_inconsistent_from_local_fails_on_every_rank_when_checked():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        rows = 3 if meshkit.get_rank() == 1 else 2  # shape (4, 2) gives each rank 2 rows
        with pytest.raises(ValueError) as info:
            DTensor.from_local(np.zeros((rows, 2)), mesh, [Shard(0)], shape=(4, 2), run_check=True)
        return str(info.value)

    for msg in local.run(body, 2):
        assert "rank 1's local has shape (3, 2) but global shape (4, 2)" in msg


def test_dtensor_is_never_silently_an_ndarray_and_meshes_do_not_mix():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        other = meshkit.DeviceMesh("cpu", [1, 0])
        d = distribute_tensor(np.ones(4), mesh, [Shard(0)])
        with pytest.raises(TypeError, match="full_tensor"):
            np.asarray(d)
        with pytest.raises(ValueError, match="not this DTensor's mesh"):
            d.redistribute(other, [Replicate()])
        assert "placements=(Shard(dim=0),)" in repr(d)
        p = distribute_tensor(np.arange(4.0), mesh, [Partial()])
        return p.to_local().tolist(), p.full_tensor().tolist()

    (l0, f0), (l1, f1) = local.run(body, 2)
    assert l0 == [0, 1, 2, 3] and f0 == f1 == [0, 1, 2, 3]
    assert all(x == 0 and np.signbit(x) for x in l1), "sum Partial: -0.0 (the identity) on the other ranks"


def test_detail_mode_checks_from_local_across_ranks(monkeypatch):
    monkeypatch.setenv("MESHKIT_DEBUG", "detail")

    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2))
        rank = meshkit.get_rank()
        # 5 rows over mesh dim 0 (3, 2); rank 2 claims the global shape is (6, 4)
        rows = 3 if mesh.get_coordinate()[0] == 0 else 2
        shape = (6, 4) if rank == 2 else (5, 4)
        with pytest.raises(ValueError) as info:
            DTensor.from_local(np.zeros((rows, 2)), mesh, [Shard(0), Shard(1)], shape=shape)
        good = DTensor.from_local(np.zeros((rows, 2)), mesh, [Shard(0), Shard(1)], shape=(5, 4))
        return str(info.value), good.shape

    results = local.run(body, 4)
    for rank, (msg, shape) in enumerate(results):
        assert msg.startswith(f"meshkit.tensor: rank {rank}: DTensor.from_local:"), msg
        assert shape == (5, 4)
    # rank 1 shares no mesh dim with rank 2 (mesh [[0, 1], [2, 3]]) but hears of it too: every rank
    # raises the same error, none waits
    assert len({msg.split(": ", 2)[2] for msg, _ in results}) == 1
    assert "rank 2 passed shape (6, 4)" in results[1][0]


def test_ranks_outside_the_mesh_and_a_bad_src_data_rank_are_named():
    def body():
        mesh = meshkit.DeviceMesh("cpu", [0, 1])
        if meshkit.get_rank() == 2:
            with pytest.raises(ValueError, match=r"rank 2: distribute_tensor: this rank is not in the mesh \[0, 1\]"):
                distribute_tensor(np.ones(4), mesh, [Shard(0)])
            return None
        with pytest.raises(ValueError, match=r"distribute_tensor: src_data_rank=2 is not a rank of every mesh "
                                             r"dimension: the mesh has shape \(2,\)"):
            distribute_tensor(np.ones(4), mesh, [Shard(0)], src_data_rank=2)
        with pytest.raises(TypeError, match=r"src_data_rank must be an int or None, got '0'"):
            distribute_tensor(np.ones(4), mesh, [Shard(0)], src_data_rank="0")
        return distribute_tensor(np.arange(4.0), mesh, [Shard(0)]).to_local().tolist()

    assert local.run(body, 3) == [[0.0, 1.0], [2.0, 3.0], None]


@pytest.mark.parametrize("mesh_shape,src", [((3,), 0), ((3,), 2), ((2, 2), 0), ((2, 2), 1)])
def test_src_data_rank_scatters_and_broadcasts_from_that_rank(mesh_shape, src):
    # torch's default: ranks need not agree; only the source's values count (here each rank's
    # array differs). The source is group rank src on every mesh dim (global rank mesh[src, src]).
    a = np.arange(35.0).reshape(5, 7) - 11.5
    options = [Shard(0), Shard(1), Replicate(), Partial()]

    def body():
        mesh = meshkit.init_device_mesh("cpu", mesh_shape)
        mine = a + 100 * meshkit.get_rank()
        source = int(mesh.mesh[(src,) * len(mesh_shape)])
        groups = [mesh.get_group(i).name for i in range(len(mesh_shape))]
        out = []
        for pl in itertools.product(options, repeat=len(mesh_shape)):
            start = meshkit.flight_record()
            d = distribute_tensor(mine, mesh, pl, src_data_rank=src)
            issued = [(r["group"], r["op"]) for r in new_records(start)]
            assert issued == [(g, "scatter" if p.is_shard() else "broadcast") for g, p in zip(groups, pl)], issued
            assert d.to_local().shape == distribute_tensor(mine, mesh, pl).to_local().shape
            out.append((pl, d.full_tensor(), source))
        return out

    for rank in local.run(body, int(np.prod(mesh_shape))):
        for pl, full, source in rank:
            np.testing.assert_array_equal(full, a + 100 * source, err_msg=str(pl))


def test_distributed_blocks_never_alias_the_callers_array_or_the_source_dtensor():
    # an in-place step on a parameter must not write into the array it came from
    a = np.arange(35.0).reshape(5, 7)

    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2))
        mine = a.copy()
        options = [Shard(0), Shard(1), Replicate(), Partial(), Partial("max")]
        for pl in itertools.product(options, repeat=2):
            for src in (None, 0):
                d = distribute_tensor(mine, mesh, pl, src_data_rank=src)
                assert not np.shares_memory(d.to_local(), mine), (pl, src)
                d.to_local()[...] = -1.0  # what an optimizer's in-place step does to a block
            r = distribute_tensor(mine, mesh, [Replicate(), Replicate()])
            if pl != r.placements:  # (an unchanged placement returns r itself, as torch)
                moved = r.redistribute(placements=pl)
                assert not np.shares_memory(moved.to_local(), r.to_local()), pl
                moved.to_local()[...] = -1.0
                np.testing.assert_array_equal(r.to_local(), a)
        return mine

    for mine in local.run(body, 4):
        np.testing.assert_array_equal(mine, a)


def test_truth_value_and_len_are_never_silently_wrong():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        zero = distribute_tensor(np.zeros(1), mesh, [Replicate()])
        with pytest.raises(TypeError, match=r"bool\(\): the truth value of a DTensor.*full_tensor\(\)"):
            bool(zero)  # was True: an object's default truth
        loss = np.sum(distribute_tensor(np.arange(4.0), mesh, [Shard(0)]))  # 0-d, Partial
        with pytest.raises(TypeError, match=r"bool\(\).*\(Partial\(sum\),\)"):
            bool(loss)
        with pytest.raises(TypeError, match=r"bool\(\).*\(Replicate\(\),\)"):
            if loss > 100:  # the comparison all-reduces; the branch still needs an explicit value
                pass
        with pytest.raises(TypeError, match=r"len\(\) of a 0-d DTensor"):
            len(loss)  # was IndexError
        return len(distribute_tensor(np.zeros((5, 2)), mesh, [Shard(0)])), bool(zero.full_tensor())

    assert local.run(body, 2) == [(5, False)] * 2
