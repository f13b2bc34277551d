"""Every collective × ReduceOp × dtype against a NumPy reference, local engine and real MPI."""

from __future__ import annotations

import numpy as np
import pytest

import collective_cases as cases
from meshkit.comm import local


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("dtype", cases.DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_collective_matches_numpy_local(dtype, world_size):
    checks = local.run(cases.check_all, world_size, dtype, timeout=30)
    assert len(checks) == world_size
    assert min(checks) >= 10  # rank 0 checks one more: it is the gather root


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_subgroup_collectives_local(world_size):
    checks = local.run(cases.check_subgroup, world_size, np.float64, timeout=30)
    assert checks[0] > 0 and all(c == 0 for c in checks[1::2])


@pytest.mark.parametrize("world_size", [1, 2, 5])
def test_object_collectives_local(world_size):
    assert local.run(cases.check_objects, world_size, timeout=30) == [4] * world_size


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_collective_matches_numpy_mpi(mpirun, world_size):
    out = mpirun("mpi_collectives.py", world_size).stdout
    lines = [line for line in out.splitlines() if " OK " in f" {line.split(': ', 1)[-1]} "]
    assert len(lines) == world_size, out
    assert all("checks on rank" in line for line in lines)
