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


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.complex64, np.int32])
def test_avg_equals_sum_then_division_bit_for_bit(dtype, world_size):
    """AVG is the engine's sum then one division by the group size; for power-of-two sizes the
    group multiplies by 1/size instead, which must give the same bits (subnormals included)."""
    import meshkit

    info = np.finfo(dtype) if np.dtype(dtype).kind in "fc" else None
    values = ([1.0, 3.0, 1 / 3, -7.25, 1e-3, info.tiny, info.smallest_subnormal, -info.smallest_subnormal * 3,
               float(info.max) / world_size ** 2] if info is not None else [1, 3, -7, 100, 12345])

    def body():
        rank = meshkit.get_rank()
        x = (np.array(values) * (rank + 1)).astype(dtype)
        if np.dtype(dtype).kind == "c":
            x = x + 1j * x[::-1]
        if np.dtype(dtype).kind == "i":
            with pytest.raises(meshkit.DistTypeError, match="AVG"):
                meshkit.all_reduce(x.copy(), op=meshkit.ReduceOp.AVG)
            return None
        summed, averaged = x.copy(), x.copy()
        meshkit.all_reduce(summed)
        meshkit.all_reduce(averaged, op=meshkit.ReduceOp.AVG)
        return summed, averaged

    for result in local.run(body, world_size, timeout=30):
        if result is not None:
            summed, averaged = result
            expected = summed / np.asarray(world_size, dtype=summed.real.dtype)
            assert averaged.dtype == expected.dtype
            np.testing.assert_array_equal(averaged.view(f"u{averaged.itemsize}") if averaged.dtype.kind == "f"
                                          else averaged, expected.view(f"u{expected.itemsize}")
                                          if expected.dtype.kind == "f" else expected)
