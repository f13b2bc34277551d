"""Redistribution: every pair of placements, 1-D and 2-D meshes, uneven sizes, bit for bit (to a
few ulp through Partial("avg"), see tensor_cases)."""

from __future__ import annotations

import numpy as np
import pytest
import tensor_cases

import meshkit
from meshkit.comm import local
from meshkit.tensor import Partial, Replicate, Shard, distribute_tensor
from meshkit.tensor.redistribute import plan

S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(5, 3), (2, 7), (4, 4), (1, 1)])
def test_every_pair_on_a_1d_mesh(world, shape):
    counts = local.run(tensor_cases.check_all_pairs, world, (world,), shape, timeout=60)
    assert counts == [16] * world


@pytest.mark.parametrize("shape", [(5, 3), (3, 6), (4, 4), (1, 2)])
def test_every_pair_on_a_2x2_mesh(shape):
    counts = local.run(tensor_cases.check_all_pairs, 4, (2, 2), shape, timeout=120)
    assert counts == [256] * 4


@pytest.mark.parametrize("dtype", ["float32", "int64", "complex128"])
def test_other_dtypes_and_a_3d_array(dtype):
    options = [Shard(0), Shard(2), Replicate(), Partial()]
    counts = local.run(tensor_cases.check_all_pairs, 4, (2, 2), (3, 2, 5), dtype, options, timeout=120)
    assert counts == [256] * 4


ALL = [S0, S1, R, P, Partial("avg"), Partial("max"), Partial("min")]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_pair_with_avg_max_min_on_a_1d_mesh(world):
    # bit for bit except through Partial("avg"): at 3 ranks (x + x + x) / 3 is one ulp off x
    counts = local.run(tensor_cases.check_all_pairs, world, (world,), (5, 3), "float64", ALL, timeout=60)
    assert counts == [49] * world


def test_avg_max_min_pairs_on_a_2x2_mesh():
    options = [S0, R, P, Partial("avg"), Partial("max"), Partial("min")]
    counts = local.run(tensor_cases.check_all_pairs, 4, (2, 2), (3, 5), "float64", options, timeout=120)
    assert counts == [36 * 36] * 4


def test_plan_uses_the_direct_collective_where_nothing_nests():
    assert plan([S0], [S1]) == [(0, S0, S1)]
    assert plan([S0, R], [S1, R]) == [(0, S0, S1)]
    assert plan([P, S0], [R, S0]) == [(0, P, R)]
    # nested on one array dim: the inner (right) shard is undone first, then rebuilt outer first
    assert plan([S0, S0], [R, S0]) == [(1, S0, R), (0, S0, R), (1, R, S0)]
    # swapping which mesh dim shards which array dim cannot be two all-to-alls (they would nest)
    assert plan([S0, S1], [S1, S0]) == [(1, S1, R), (0, S0, R), (0, R, S1), (1, R, S0)]
    assert plan([R, S0], [S0, S0]) == [(1, S0, R), (0, R, S0), (1, R, S0)]
    assert plan([S0], [P]) == [(0, S0, R), (0, R, P)]


def test_partial_avg_max_min_and_between_partials():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (3,))
        rank = meshkit.get_rank()
        terms = np.array([1.0, 4.0, -2.0]) * (rank + 1)
        out = {}
        for op in ("sum", "avg", "max", "min"):
            d = meshkit.tensor.DTensor.from_local(terms, mesh, [Partial(op)])
            out[op] = (d.full_tensor().tolist(), d.redistribute(placements=[S0]).to_local().tolist())
        as_max = meshkit.tensor.DTensor.from_local(terms, mesh, [P]).redistribute(placements=[Partial("max")])
        out["sum->max"] = as_max.full_tensor().tolist()
        return out

    results = local.run(body, 3)
    stacked = np.array([[1.0, 4.0, -2.0]]) * np.array([[1], [2], [3]])
    want = {"sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.max(0), "min": stacked.min(0)}
    for rank, out in enumerate(results):
        for op, full in want.items():
            assert out[op][0] == full.tolist(), op
            assert out[op][1] == [full[rank]], op
        assert out["sum->max"] == want["sum"].tolist()


def test_a_redistribution_logs_its_steps_at_debug(caplog):
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        distribute_tensor(np.ones((4, 2)), mesh, [S0]).redistribute(placements=[S1])

    with caplog.at_level("DEBUG", logger="meshkit.tensor"):
        local.run(body, 2)
    assert any("mesh dim 0: Shard(dim=0) -> Shard(dim=1)" in r.getMessage() for r in caplog.records)


def test_every_pair_on_real_processes(mpirun):
    out = mpirun("mpi_tensor.py", 4).stdout
    assert out.count("TENSOR OK") == 4, out


def test_every_shard_and_replicate_pair_on_a_2x2x2_mesh():
    # three mesh dims over two array dims: Shards nest two and three deep on one array dim
    counts = local.run(tensor_cases.check_all_pairs, 8, (2, 2, 2), (5, 3), "float64", [S0, S1, R], timeout=120)
    assert counts == [27 * 27] * 8


@pytest.mark.parametrize("world", [1, 2])
def test_compiled_programs_are_per_mesh_and_the_table_is_bounded(monkeypatch, world):
    from meshkit.tensor import redistribute as rd

    monkeypatch.setattr(rd, "PROGRAMS_MAX", 4)
    monkeypatch.setattr(rd, "_programs", {})

    def body():
        mesh = meshkit.init_device_mesh("cpu", (world,))
        a = np.arange(60.0).reshape(6, 10)
        d = distribute_tensor(a, mesh, [S0])
        first = rd.program(mesh, d.shape, d.placements, (S1,))
        if world == 1:  # (ranks of the local engine are threads sharing the table: one may evict)
            assert rd.program(mesh, d.shape, d.placements, (S1,)) is first  # compiled once
        for rows in range(1, 9):  # more layouts than the table keeps: the oldest make way
            b = distribute_tensor(np.arange(rows * 3.0).reshape(rows, 3), mesh, [S0])
            assert np.array_equal(b.redistribute(placements=[S1]).full_tensor(), b.full_tensor())
        assert len(rd._programs) <= 4
        # an entry under this mesh's key made for another mesh (a dead mesh whose id was reused)
        # is not run: the program is compiled again for this one
        other = meshkit.init_device_mesh("cpu", (world,))
        key = (id(mesh), d.shape, d.placements, (S1,))
        rd._programs[key] = rd._compile(other, d.shape, d.placements, (S1,))
        again = rd.program(mesh, d.shape, d.placements, (S1,))
        assert again.mesh() is mesh
        return d.redistribute(placements=[S1]).to_local().tolist()

    a = np.arange(60.0).reshape(6, 10)
    assert local.run(body, world) == [block.tolist() for block in np.split(a, world, axis=1)]


def test_the_programs_kept_follow_their_variable(monkeypatch):
    """MESHKIT_DTENSOR_PROGRAMS bounds the compiled programs kept; a bad value is refused naming it."""
    from meshkit.tensor import redistribute as rd

    monkeypatch.setattr(rd, "_programs", {})
    monkeypatch.setenv("MESHKIT_DTENSOR_PROGRAMS", "3")

    def body():
        mesh = meshkit.init_device_mesh("cpu", (1,))
        for rows in range(1, 7):
            b = distribute_tensor(np.arange(rows * 3.0).reshape(rows, 3), mesh, [S0])
            assert np.array_equal(b.redistribute(placements=[S1]).full_tensor(), b.full_tensor())
        return len(rd._programs)

    assert local.run(body, 1) == [3]
    monkeypatch.setenv("MESHKIT_DTENSOR_PROGRAMS", "0")
    with pytest.raises(meshkit.DistValueError, match=r"meshkit.tensor: MESHKIT_DTENSOR_PROGRAMS='0' is not valid; "
                                                     r"valid values are a positive integer \(default 1024\)"):
        local.run(lambda: distribute_tensor(np.ones((4, 3)), meshkit.init_device_mesh("cpu", (1,)), [S0])
                  .redistribute(placements=[S1]), 1)
