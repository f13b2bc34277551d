"""async_op=True: progress in the background, Work.wait/is_completed, program order per group."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import meshkit
from meshkit.comm import local
from meshkit.comm.engines.engine import in_background
from meshkit.comm.groups.work import CommThread, Work
from meshkit.comm.groups.world import current_world


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
    from meshkit.comm.engines import mpi_polling as policy  # the MPI engine's: only on MPI ranks

    cores, ranks = len(os.sched_getaffinity(0)), meshkit.get_world_size()  # one host in tests
    spin_ok = policy._caller_spin == (policy.CALLER_SPIN_SECONDS if ranks <= cores else 0.0)
    yields: list[int] = []
    real_yield, os.sched_yield = os.sched_yield, lambda: yields.append(1)
    try:
        spinning = policy.Poller(time.monotonic() + 60, spin=30.0)
        for _ in range(100):
            spinning.pause()
        never_yielded = not yields
        yielding = policy.Poller(time.monotonic() + 60, spin=0.0)
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


# --------------------------------------------------------------------------- the queue of async collectives
def queued_chain_progresses():
    """Three async 8 MB all_reduces, then compute: they start one after the other (one in MPI at
    a time) and all complete while the caller computes, driven by the progress agent."""
    rank = meshkit.get_rank()
    xs = [np.full(1 << 20, float(rank + i)) for i in range(3)]
    works = [meshkit.all_reduce(x, async_op=True) for x in xs]
    group = current_world().default_group
    queued = [w._request is None for w in works]
    deadline = time.monotonic() + 10
    while not all(w._finished for w in works) and time.monotonic() < deadline:
        time.sleep(0.01)  # "compute" without calling meshkit
    done_before_wait = all(w._finished for w in works)
    for w in works:
        w.wait()
    n = meshkit.get_world_size()
    right = all(float(x[0]) == sum(r + i for r in range(n)) for i, x in enumerate(xs))
    return queued[0], all(queued[1:]) or n == 1, done_before_wait, right, len(group.queue.inflight)


def test_a_chain_of_async_collectives_completes_in_the_background_on_mpi(mpirun):
    # MPI's queue: the shared-memory path (comm/engines/shm.py) completes an 8 MB all_reduce at 2
    # ranks before the next call is made, so nothing would be queued behind it
    out = mpirun("mpi_async.py", 2, "chain", env={"MESHKIT_SHM": "0"}).stdout
    assert out.count("CHAIN (False, True, True, True, 0)") == 2, out


def test_async_collectives_start_in_order_and_a_blocking_call_waits_for_them():
    def body():
        rank = meshkit.get_rank()
        group = current_world().default_group
        a, b = np.full(3, float(rank)), np.full(3, 10.0 * rank)
        engine, seen = group.engine, []
        real = engine.broadcast

        def spy(*args):  # when the broadcast reaches the engine, the all_reduce must be complete
            seen.append(wa._request.done)
            return real(*args)

        engine.broadcast = spy
        wa = meshkit.all_reduce(a, async_op=True)
        wb = meshkit.broadcast(b, src=1, async_op=True)
        c = np.full(2, 1.0)
        meshkit.all_reduce(c)  # blocking: every earlier collective of the group completes first
        state = [wa.is_completed(), wb.is_completed(), len(group.queue.inflight)]
        wb.wait()
        wa.wait()
        return seen == [True], state, a.tolist(), b.tolist(), c.tolist()
    for started, state, a, b, c in local.run(body, 3, timeout=10):
        assert started, "the second collective started before the first completed"
        assert state == [True, True, 0]
        assert a == [3.0] * 3 and b == [10.0] * 3 and c == [3.0, 3.0]


def test_waiting_on_a_queued_collective_waits_for_those_before_it():
    def body():
        rank = meshkit.get_rank()
        xs = [np.full(2, float(rank * 10 + i)) for i in range(4)]
        works = [meshkit.all_reduce(x, meshkit.ReduceOp.MAX, async_op=True) for x in xs]
        works[-1].wait()  # the last one: the three before it run first, in order
        states = [w.is_completed() for w in works]
        for w in works:
            w.wait()
        return states, [x[0] for x in xs]
    for states, values in local.run(body, 2, timeout=10):
        assert states == [True] * 4 and values == [10.0, 11.0, 12.0, 13.0]


def test_a_failed_collective_fails_the_ones_queued_behind_it_on_every_rank():
    def body():
        if meshkit.get_rank() == 1:
            time.sleep(0.8)  # present, never joining: rank 0's first collective times out
            return None
        first = meshkit.barrier(async_op=True)
        second = meshkit.all_reduce(np.ones(2), async_op=True)
        with pytest.raises(meshkit.CollectiveTimeout, match="barrier #0 on group world"):
            first.wait()
        with pytest.raises(meshkit.DistError, match="group world is unusable after an earlier failure"):
            second.wait()
        return second.is_completed() and not second.is_success()
    assert local.run(body, 2, timeout=0.3)[0] is True


def test_a_bounded_wait_on_a_queued_collective_times_out_without_failing_it():
    def body():
        rank = meshkit.get_rank()
        if rank == 0:
            first = meshkit.all_reduce(np.ones(2), async_op=True)
            second = meshkit.all_reduce(np.ones(2), async_op=True)
            with pytest.raises(meshkit.CollectiveTimeout, match="did not start within Work.wait"):
                second.wait(timeout=0.05)  # rank 1 joins only after 0.3 s
            first.wait()
            second.wait()
            return second.is_success()
        time.sleep(0.3)
        meshkit.all_reduce(np.ones(2))
        meshkit.all_reduce(np.ones(2))
        return True
    assert local.run(body, 2, timeout=10) == [True, True]


def test_a_task_that_raises_midway_breaks_the_group_on_every_rank():
    """Rank 0's task issues one of its two collectives and raises: rank 1's second all_reduce must
    fail at once (not pair with rank 0's next call, nor wait the whole timeout), and rank 0's
    later calls on the group must raise."""
    def body():
        group = meshkit.comm.groups.world.current_world().default_group
        x = np.ones(3)

        rank = meshkit.get_rank()

        def task():  # runs on the group's communication thread: it uses the group itself
            group.all_reduce(x)
            if rank == 0:
                raise ValueError("hook bug")
            group.all_reduce(x)

        started = time.monotonic()
        with pytest.raises(Exception) as info:
            group.run_async(task, "hook").wait()
        took = time.monotonic() - started
        if rank == 0:
            assert isinstance(info.value, ValueError)
            with pytest.raises(meshkit.DistError, match=r"unusable after an earlier failure: hook raised ValueError"):
                meshkit.all_reduce(x)
        else:
            assert isinstance(info.value, meshkit.RankFailedError), info.value
            assert "rank 0" in str(info.value) and "hook raised ValueError: hook bug" in str(info.value)
        return took

    took = local.run(body, 2, timeout=30)
    assert max(took) < 5, took
