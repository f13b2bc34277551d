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


# ---------------------------------------------------------------- the local engine is as strict as detail mode
# Code that passes on the local engine must not produce garbage under MPI, so the local
# engine compares every rank's call (kind, shape, dtype, op, root, counts) on every collective, and
# raises on every rank what MESHKIT_DEBUG=detail raises under MPI.

def _odd_rank_out(call):
    """Each rank calls ``call(rank)``; returns its mismatch message, after checking that the group
    still works (as in detail mode, a mismatch breaks nothing: no data moved)."""
    import meshkit

    def body():
        try:
            call(meshkit.get_rank())
        except meshkit.CollectiveMismatchError as exc:
            x = np.ones(2)
            meshkit.all_reduce(x)
            assert x.tolist() == [meshkit.get_world_size()] * 2
            return str(exc)
        return None
    return body


def _mismatch_cases():
    import meshkit

    def odd(rank, a, b):
        return b if rank == 1 else a

    def out(n, dtype=np.float64):
        return np.empty(n, dtype)
    return {
        "all_reduce dtype": (lambda r: meshkit.all_reduce(np.ones(4, odd(r, np.float32, np.float64))),
                             "ranks [0, 2]: all_reduce(shape=(4,), dtype=float32, op=SUM) #0; "
                             "rank 1: all_reduce(shape=(4,), dtype=float64, op=SUM) #0"),
        "all_reduce size": (lambda r: meshkit.all_reduce(np.ones(odd(r, 4, 5))),
                            "rank 1: all_reduce(shape=(5,), dtype=float64, op=SUM) #0"),
        "all_reduce op": (lambda r: meshkit.all_reduce(np.ones(2), op=odd(r, meshkit.ReduceOp.SUM, meshkit.ReduceOp.MAX)),
                          "rank 1: all_reduce(shape=(2,), dtype=float64, op=MAX) #0"),
        "broadcast root": (lambda r: meshkit.broadcast(np.ones(2), src=odd(r, 0, 2)),
                           "ranks [0, 2]: broadcast(shape=(2,), dtype=float64, root=0) #0; "
                           "rank 1: broadcast(shape=(2,), dtype=float64, root=2) #0"),
        "broadcast size": (lambda r: meshkit.broadcast(np.ones(odd(r, 2, 3)), src=0),
                           "rank 1: broadcast(shape=(3,), dtype=float64, root=0) #0"),
        "reduce root": (lambda r: meshkit.reduce(np.ones(2), dst=odd(r, 0, 1)),
                        "rank 1: reduce(shape=(2,), dtype=float64, op=SUM, root=1) #0"),
        "all_gather_into_tensor size": (lambda r: meshkit.all_gather_into_tensor(out(3 * odd(r, 2, 3)),
                                                                                 np.ones(odd(r, 2, 3))),
                                        "rank 1: all_gather_into_tensor(shape=(3,), dtype=float64) #0"),
        "all_gather dtype": (lambda r: meshkit.all_gather([out(2, odd(r, np.int64, np.float64)) for _ in range(3)],
                                                          np.ones(2, odd(r, np.int64, np.float64))),
                             "rank 1: all_gather(shape=(2,), dtype=float64) #0"),
        "gather size": (lambda r: meshkit.gather(np.ones(odd(r, 2, 1)), [out(2) for _ in range(3)] if r == 0 else None,
                                                 dst=0),
                        "rank 1: gather(shape=(1,), dtype=float64, root=0) #0"),
        "scatter size": (lambda r: meshkit.scatter(out(odd(r, 2, 4)), [np.ones(2)] * 3 if r == 0 else None, src=0),
                         "rank 1: scatter(shape=(4,), dtype=float64, root=0) #0"),
        "reduce_scatter_tensor dtype": (lambda r: meshkit.reduce_scatter_tensor(
                                            out(2, odd(r, np.float32, np.float64)),
                                            np.ones(6, odd(r, np.float32, np.float64))),
                                        "rank 1: reduce_scatter_tensor(shape=(6,), dtype=float64, op=SUM) #0"),
        "all_to_all_single counts": (lambda r: meshkit.all_to_all_single(out(3), np.ones(3), [1, 1, 1],
                                                                         odd(r, [1, 1, 1], [2, 0, 1])),
                                     "ranks [0, 1, 2]: all_to_all_single(dtype=float64) #0; counts disagree: "
                                     "rank 1 sends 2 elements to rank 0, which expects 1 from it; "
                                     "rank 1 sends 0 elements to rank 1, which expects 1 from it"),
        "kind": (lambda r: [meshkit.all_reduce, lambda x: meshkit.broadcast(x, src=0), lambda x: meshkit.barrier()][r](
                     np.ones(2)),
                 "rank 0: all_reduce(shape=(2,), dtype=float64, op=SUM) #0; rank 1: broadcast(shape=(2,), "
                 "dtype=float64, root=0) #0; rank 2: barrier() #0"),
        "monitored_barrier": (lambda r: meshkit.monitored_barrier() if r == 1 else meshkit.all_reduce(np.ones(2)),
                              "ranks [0, 2]: all_reduce(shape=(2,), dtype=float64, op=SUM) #0; "
                              "rank 1: monitored_barrier() #0"),
    }


@pytest.mark.parametrize("case", list(_mismatch_cases()))
def test_the_local_engine_raises_detail_modes_mismatch_error_without_detail_mode(case, monkeypatch):
    call, expected = _mismatch_cases()[case]
    monkeypatch.delenv("MESHKIT_DEBUG", raising=False)
    plain = local.run(_odd_rank_out(call), 3, timeout=20)
    for rank, message in enumerate(plain):
        assert message is not None, f"rank {rank} did not raise"
        assert message.startswith(f"meshkit.comm: rank {rank}: collective mismatch on group world at #0: "), message
        assert expected in message, message
    monkeypatch.setenv("MESHKIT_DEBUG", "detail")  # the same error, word for word, as MPI's detail mode gives
    assert local.run(_odd_rank_out(call), 3, timeout=20) == plain


def test_a_dtype_mismatch_is_no_longer_promoted_on_the_local_engine():
    """The issue's case: float32 on one rank and float64 on the other summed to 2.0 here (promoted)
    and to garbage under MPI; every rank now raises, and no buffer was written."""
    import meshkit

    def body():
        x = np.ones(4, np.float32 if meshkit.get_rank() == 0 else np.float64)
        with pytest.raises(meshkit.CollectiveMismatchError, match=r"rank 0: all_reduce\(shape=\(4,\), dtype=float32"):
            meshkit.all_reduce(x)
        return x.tolist()
    assert local.run(body, 2, timeout=20) == [[1.0] * 4, [1.0] * 4]


def test_async_and_queued_collectives_are_checked_too():
    import meshkit

    def body():
        rank = meshkit.get_rank()
        first = meshkit.all_reduce(np.ones(2), async_op=True)
        second = meshkit.all_reduce(np.ones(3 if rank else 2), async_op=True)  # queued behind the first
        first.wait()
        with pytest.raises(meshkit.CollectiveMismatchError, match=r"at #1: rank 0: all_reduce\(shape=\(2,\)"):
            second.wait()
        with pytest.raises(meshkit.CollectiveMismatchError):  # waiting again raises again
            second.wait()
        x = np.ones(2)
        meshkit.all_reduce(x)
        return x.tolist()
    assert local.run(body, 2, timeout=20) == [[2.0, 2.0]] * 2


def test_new_group_against_a_collective_is_a_mismatch_not_a_hang():
    import meshkit

    def body():
        if meshkit.get_rank() != 1:
            meshkit.new_group([0, 1])
        else:
            meshkit.all_reduce(np.ones(2))
    with pytest.raises(meshkit.CollectiveMismatchError, match=r"ranks \[0, 2\]: split\(\) #0; rank 1: all_reduce"):
        local.run(body, 3, timeout=20)
