"""async_op=True: progress in the background, Work.wait/is_completed, program order per group."""

from __future__ import annotations

import time

import numpy as np
import pytest

import meshkit
from meshkit.comm import local


def progress_while_computing():
    """Rank 0 starts an async all_reduce and computes; rank 1's blocking call must finish meanwhile."""
    x = np.full(1 << 20, float(meshkit.get_rank() + 1))  # 8 MB: MPI's rendezvous protocol
    if meshkit.get_rank() == 0:
        work = meshkit.all_reduce(x, async_op=True)
        time.sleep(1.0)  # "compute" without touching meshkit
        done_before_wait = work.is_completed()
        work.wait()
        return done_before_wait, float(x[0]), None
    start = time.monotonic()
    meshkit.all_reduce(x)
    return None, float(x[0]), time.monotonic() - start


@pytest.mark.parametrize("engine", ["local", "mpi"])
def test_collective_progresses_while_the_caller_computes(engine, mpirun):
    if engine == "local":
        results = local.run(progress_while_computing, 2, timeout=10)
    else:
        out = mpirun("mpi_async.py", 2, "progress").stdout
        results = [eval(line.split("RESULT ", 1)[1]) for line in sorted(out.splitlines()) if "RESULT " in line]
    (done_before_wait, x0, _), (_, x1, elapsed) = results
    assert x0 == x1 == 3.0
    assert done_before_wait, "the collective only progressed inside wait()"
    assert elapsed < 0.6, f"rank 1 waited {elapsed:.2f} s for rank 0's compute"


def test_work_wait_timeout_and_is_completed():
    def body():
        if meshkit.get_rank() == 0:
            work = meshkit.all_reduce(np.ones(2), async_op=True)
            assert not work.is_completed()
            with pytest.raises(meshkit.CollectiveTimeout, match=r"all_reduce on group world did not complete "
                                                                 r"within Work.wait\(timeout=0.05\)"):
                work.wait(timeout=0.05)
            meshkit.barrier()  # rank 1 joins the all_reduce only after this
            assert work.wait() is True and work.is_completed() and work.is_success()
        else:
            time.sleep(0.2)
            meshkit.all_reduce(np.ones(2))
            meshkit.barrier()
    # rank 0's barrier is queued behind its async all_reduce; rank 1 calls all_reduce then barrier
    local.run(body, 2, timeout=5)


def interleaved():
    """Async and blocking calls on two groups, interleaved: each matches its peer in order."""
    rank, n = meshkit.get_rank(), meshkit.get_world_size()
    other = meshkit.new_group(list(range(n)), name="copy")  # the world's rank set: the same group
    assert meshkit.get_process_group_ranks(other) == list(range(n))
    pairs = meshkit.new_group([0, 1]) if n > 1 else None
    works, arrays = [], []
    for i in range(20):
        x = np.full(3, float(rank + i))
        arrays.append(x)
        if i % 3 == 0:
            meshkit.all_reduce(x)
        else:
            works.append(meshkit.all_reduce(x, async_op=True))
        if pairs is not None and rank < 2 and i % 5 == 0:
            y = np.full(2, float(rank * i))
            meshkit.broadcast(y, src=1, group=pairs, async_op=True).wait()
            assert (y == i).all()
    gathered = np.empty(n * 3)
    meshkit.all_gather_into_tensor(gathered, arrays[-1], async_op=True).wait()
    for w in works:
        w.wait()
    for i, x in enumerate(arrays):
        assert (x == sum(r + i for r in range(n))).all(), (i, x)
    return True


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_async_and_blocking_calls_run_in_program_order(world_size):
    assert all(local.run(interleaved, world_size, timeout=10))


def test_async_and_blocking_calls_run_in_program_order_mpi(mpirun):
    out = mpirun("mpi_async.py", 3, "order").stdout
    assert out.count("ORDER OK") == 3, out


def test_async_error_is_raised_by_wait():
    def body():
        if meshkit.get_rank() == 0:
            work = meshkit.barrier(async_op=True)
            with pytest.raises(meshkit.CollectiveTimeout, match="ranks that did not arrive: \\[1\\]"):
                work.wait()
            assert work.is_completed() and not work.is_success()
            assert isinstance(work.exception(), meshkit.CollectiveTimeout)
    local.run(body, 2, timeout=0.3)
