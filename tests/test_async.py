"""async_op=True: progress in the background, Work.wait/is_completed, program order per group."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import meshkit
from meshkit.comm import local
from meshkit.comm.work import CommThread, Work, in_background
from meshkit.comm.world import current_world


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
        else:
            time.sleep(0.6)  # present but never arriving (a rank that left would be named at once)
    local.run(body, 2, timeout=0.3)


def _queue_without_thread() -> CommThread:
    """A CommThread whose own thread never runs: only waiters can execute its operations."""
    queue = CommThread("test")
    queue._thread = threading.Thread(target=lambda: None)  # never started
    return queue


def test_a_waiter_runs_queued_operations_in_order_up_to_its_own():
    queue, ran = _queue_without_thread(), []
    works = [queue.submit(lambda i=i: ran.append(i) or i, Work(f"op{i}")) for i in range(3)]
    with pytest.raises(meshkit.CollectiveTimeout, match=r"op1 did not complete within Work.wait\(timeout=0.05\)"):
        works[1].wait(timeout=0.05)  # a bounded wait never executes work itself
    assert ran == []
    assert works[1].wait() and works[1].result() == 1
    assert ran == [0, 1] and works[0].is_completed() and not works[2].is_completed()
    assert not queue.idle
    works[2].wait()
    assert ran == [0, 1, 2] and queue.idle


def test_an_operation_runs_its_own_synchronous_calls_inline_and_cannot_wait_for_later_ones():
    queue, ran = _queue_without_thread(), []

    def outer():
        ran.append("outer starts")
        later = queue.submit(lambda: ran.append("later"), Work("later op"))
        # part of this operation: runs now, ahead of what is queued (as a hook's collectives do)
        assert queue.run_in_order(lambda: ran.append("inline") or 7, "sync") == 7
        with pytest.raises(meshkit.DistError, match="waits for later op, queued after it on the same group"):
            later.wait()
        ran.append("outer ends")

    queue.submit(outer, Work("outer")).wait()
    assert ran == ["outer starts", "inline", "outer ends"]
    queue.run_until(queue._queue[-1][1])
    assert ran[-1] == "later" and queue.idle


def test_operations_stay_on_the_thread_while_it_executes_one():
    queue, ran, started = CommThread("test"), [], threading.Event()
    release = threading.Event()

    def slow():
        started.set()
        release.wait(5)
        ran.append(("slow", threading.get_ident()))

    first = queue.submit(slow, Work("slow"))
    started.wait(5)
    second = queue.submit(lambda: ran.append(("next", threading.get_ident())), Work("next"))
    threading.Timer(0.1, release.set).start()
    second.wait()  # the thread is busy: the waiter must not overtake it
    assert first.is_completed() and [name for name, _ in ran] == ["slow", "next"]
    queue.close()


def waiting_policy() -> tuple[bool, bool, bool, bool]:
    """On an MPI rank: (caller spin chosen for this host, spinning poller never yields,
    yielding poller yields at every pause, role of the thread that runs the operation)."""
    from meshkit.comm import mpi as engine  # imports mpi4py: only on MPI ranks

    cores, ranks = len(os.sched_getaffinity(0)), meshkit.get_world_size()  # one host in tests
    spin_ok = engine._caller_spin == (engine.CALLER_SPIN_SECONDS if ranks <= cores else 0.0)
    yields: list[int] = []
    real_yield, os.sched_yield = os.sched_yield, lambda: yields.append(1)
    try:
        spinning = engine._Poller(time.monotonic() + 60, spin=30.0)
        for _ in range(100):
            spinning.pause()
        never_yielded = not yields
        yielding = engine._Poller(time.monotonic() + 60, spin=0.0)
        for _ in range(100):
            yielding.pause()
        yielded_after_polls = len(yields) == 100  # a pause comes after each batch of polls
    finally:
        os.sched_yield = real_yield
    group = current_world().default_group
    unwatched = group.run_async(in_background, "probe")
    deadline = time.monotonic() + 10
    while not unwatched.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)  # computing, not waiting: the thread may not spin
    watched = group.run_async(lambda: (time.sleep(0.05), in_background())[1], "probe")
    watched.wait(timeout=10)  # a bounded wait never runs the operation itself, but it is waited for
    roles = unwatched.result() is True and watched.result() is False and not in_background()
    return spin_ok, never_yielded, yielded_after_polls, roles


@pytest.mark.parametrize("n", [2, 4])
def test_blocked_callers_spin_only_with_a_core_each_and_threads_only_when_waited_for(mpirun, n):
    out = mpirun("mpi_async.py", n, "policy").stdout
    assert out.count("POLICY (True, True, True, True)") == n, out
