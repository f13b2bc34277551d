"""Devices on every thread, and calls that must not wait for the device.

CUDA's current device is per thread and 0 on a new thread, so every helper thread of meshkit
(the progress agent and watchdog, a group's communication thread) that touches CUDA for a rank
on GPU k must make GPU k current first. The double (tests/doubles/nccl_double.py) refuses what CUDA and
CuPy refuse: an event recorded on another device's stream, a kernel on another device's array.
``all_reduce(x, async_op=True)`` must return while a long kernel still runs on the caller's
stream, on every engine (NCCL, MPI staged and CUDA-aware). Nothing here has run on a GPU.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time

import numpy as np
import pytest

import meshkit
from doubles import nccl_double as double
from meshkit.comm.engines import cuda_runtime, local_engine
from meshkit.comm import local
from meshkit.comm.groups.world import local_context


@pytest.fixture
def rt():
    previous = cuda_runtime.set_runtime(double.FakeRuntime())
    yield cuda_runtime.runtime()
    cuda_runtime.set_runtime(previous)


def on_device(rt, index):
    """Make ``index`` current on this thread for the block (the double's ``use_device``)."""
    rt.use_device(index)


# --------------------------------------------------------------------------- the double
def test_double_refuses_an_event_recorded_on_a_stream_of_another_device(rt):
    rt.use_device(1)
    stream = rt.new_stream()
    event = rt.new_event()
    event.record(stream)  # both on device 1
    done = []

    def helper():  # a new thread starts on device 0, as in CUDA
        mine = rt.new_event()
        try:
            mine.record(stream)
        except double.FakeNcclError as exc:
            done.append(str(exc))
        rt.use_device(1)
        again = rt.new_event()
        again.record(stream)
        other = rt.new_stream()
        rt.use_device(0)
        other.wait_event(again)  # cudaStreamWaitEvent across devices is allowed
        again.synchronize()  # and so is cudaEventSynchronize
        done.append(again.done)

    t = threading.Thread(target=helper)
    t.start()
    t.join()
    assert re.match(r"double: cudaErrorInvalidResourceHandle: an event of device 0 recorded on a stream of device 1",
                    done[0]), done
    assert done[1] is True


def test_double_refuses_a_kernel_on_an_array_of_another_device_but_not_get(rt):
    rt.use_device(2)
    x = double.to_device(np.arange(3.0))
    assert x.device_id == 2 and rt.device_of(x) == 2 and rt.device_of(x[1:]) == 2
    rt.use_device(0)
    with pytest.raises(ValueError, match=r"The device where the array resides \(2\) is different from the current "
                                         r"device \(0\)\. Peer access is unavailable"):
        x += 1
    with pytest.raises(ValueError, match=r"resides \(2\)"):
        x[0] = 5
    with pytest.raises(ValueError, match=r"resides \(2\)"):
        np.stack([x, x])
    assert x.get().tolist() == [0.0, 1.0, 2.0]  # CuPy's get makes the array's device current
    y = double.to_device(np.ones(2))  # allocated on the current device
    assert y.device_id == 0


def test_double_timed_kernel_occupies_its_stream(rt):
    x = double.to_device(np.ones(4))
    began = time.monotonic()
    kernel = double.TimedKernel(0.3, writes=(x,), effect=lambda: x.view(np.ndarray).__imul__(7))
    assert time.monotonic() - began < 0.05 and not kernel.done  # launching does not wait
    event = rt.new_event()
    event.record(rt.current_stream())
    assert not event.done
    assert x.get().tolist() == [7.0] * 4  # the host reads after the stream's work: the kernel's write
    assert time.monotonic() - began >= 0.3 and event.done


# --------------------------------------------------------------------------- the NCCL engine's threads
def test_the_progress_agent_settles_list_collectives_on_the_ranks_gpu(rt, monkeypatch):
    """NCCL over a host engine that needs the progress agent (MPI): the agent completes async
    all_gather/gather/all_to_all and copies their rows out, a kernel on each rank's GPU (rank 1
    on GPU 1). It used to run it with device 0 current, which CuPy refuses."""
    monkeypatch.setattr(local_engine.LocalEngine, "capabilities",
                        dataclasses.replace(local_engine.LocalEngine.capabilities, needs_progress=True))

    def body():
        meshkit.init_process_group("nccl", timeout=20)
        rank, n = meshkit.get_rank(), meshkit.get_world_size()
        mine = double.to_device(np.full(2, float(rank)))
        outs = [double.to_device(np.zeros(2)) for _ in range(n)]
        gathered = [double.to_device(np.zeros(2)) for _ in range(n)] if rank == 0 else None
        swapped = [double.to_device(np.zeros(2)) for _ in range(n)]
        works = [meshkit.all_gather(outs, mine, async_op=True),
                 meshkit.gather(mine, gathered, dst=0, async_op=True),
                 meshkit.all_to_all(swapped, [double.to_device(np.full(2, 10.0 * rank + j)) for j in range(n)],
                                    async_op=True)]
        deadline = time.monotonic() + 10
        while not all(w._finished for w in works) and time.monotonic() < deadline:
            time.sleep(0.01)  # nobody waits: the agent completes them
        for w in works:
            w.wait()
        return ([double.to_host(o)[0] for o in outs], gathered and [double.to_host(o)[0] for o in gathered],
                [double.to_host(o)[0] for o in swapped], meshkit.comm._seams.current_world().default_group.device)

    results = local.run(body, 2, init=False)
    assert results[0] == ([0.0, 1.0], [0.0, 1.0], [0.0, 10.0], 0)
    assert results[1] == ([0.0, 1.0], None, [1.0, 11.0], 1)


# --------------------------------------------------------------------------- the MPI engine's threads
@pytest.mark.parametrize("mode", ["staged", "aware"])
def test_mpi_device_work_from_helper_threads_stays_on_the_ranks_gpu(mpirun, mode):
    """Ranks on GPU 1: the progress agent completes a staged all_reduce (its copy back and the
    event after it belong to GPU 1), and a run_async task allocates and reduces on GPU 1."""
    env = {"MESHKIT_CUDA_AWARE_MPI": "1" if mode == "aware" else "0"}
    out = mpirun("mpi_device_threads.py", 2, "devices", env=env, timeout=60).stdout
    for rank in (0, 1):
        assert f"[rank{rank}]: agent-settled all_reduce: [3.0, 3.0, 3.0, 3.0]" in out, out
        assert f"[rank{rank}]: run_async task: ([3.0, 3.0, 3.0], 'on device 1')" in out, out


# --------------------------------------------------------------------------- async does not block the host
KERNEL_SECONDS = 1.5
#: An async call may take this long to return with a KERNEL_SECONDS kernel ahead of it on the
#: caller's stream (it took 1.5 s when the engines waited for the kernel; a few ms since, on a
#: 2-core machine shared with other jobs).
ISSUE_LIMIT = 0.5


@pytest.mark.parametrize("mode", ["staged", "aware"])
def test_an_async_mpi_call_returns_while_a_kernel_runs_on_the_callers_stream(mpirun, mode):
    env = {"MESHKIT_CUDA_AWARE_MPI": "1" if mode == "aware" else "0"}
    out = mpirun("mpi_device_threads.py", 2, "latency", env=env, timeout=60).stdout
    latencies = [float(v) / 1e3 for v in re.findall(r"issue latency ([\d.]+) ms", out)]
    assert len(latencies) == 2 and max(latencies) < ISSUE_LIMIT, out
    for rank in (0, 1):
        assert f"[rank{rank}]: result [30.0, 30.0]" in out, out  # MPI saw the kernel's write


def test_an_async_nccl_call_returns_while_a_kernel_runs_on_the_callers_stream(rt):
    def body():
        meshkit.init_process_group("nccl", timeout=20)
        rank = meshkit.get_rank()
        x = double.to_device(np.full(8, rank + 1.0))
        meshkit.all_reduce(double.to_device(np.ones(1)))  # connects the ranks (NCCL's runtime connection)
        double.TimedKernel(KERNEL_SECONDS, writes=(x,), effect=lambda: x.view(np.ndarray).__imul__(10))
        began = time.monotonic()
        work = meshkit.all_reduce(x, async_op=True)
        issued = time.monotonic() - began
        work.wait()
        return issued, double.to_host(x)[:2].tolist()

    for issued, result in local.run(body, 2, init=False):
        assert issued < ISSUE_LIMIT and result == [30.0, 30.0]


# --------------------------------------------------------------------------- device selection
def _world(body, n, *, visible=None, device_id=None):
    """``body()`` on ``n`` thread-ranks with an nccl world; ``visible(rank)``: the GPUs that
    rank's "process" sees (CUDA_VISIBLE_DEVICES); ``device_id(rank)``: its explicit device."""
    def rank_main(rank):
        if visible is not None:
            double.visible_devices(visible(rank))
        try:
            meshkit.init_process_group("nccl", timeout=20,
                                       device_id=None if device_id is None else device_id(rank))
            x = double.to_device(np.full(2, rank + 1.0))
            meshkit.all_reduce(x)
            return meshkit.comm._seams.current_world().default_group.device, double.to_host(x).tolist(), body()
        finally:
            double.visible_devices(None)

    return local.run(lambda: rank_main(local_context().rank), n, init=False)


def test_one_visible_gpu_per_rank_gives_every_rank_its_device_0(rt):
    """Slurm's --gpus-per-task=1: each rank sees one GPU, another one. It was refused as "host
    runs 3 ranks but sees 1 GPUs"."""
    got = _world(lambda: None, 3, visible=lambda rank: [rank + 2])
    assert got == [(0, [6.0, 6.0], None)] * 3


def test_an_explicit_device_id_is_the_ranks_gpu(rt):
    got = _world(lambda: None, 2, device_id=lambda rank: 3 - rank)
    assert [g[:2] for g in got] == [(3, [3.0, 3.0]), (2, [3.0, 3.0])]


@pytest.mark.parametrize("value, message", [
    ("5", None),
    ("8", r"rank 0: MESHKIT_DEVICE_ID=8 is not a GPU of this process; valid devices are 0\.\.7 \(8 visible\)"),
    ("x", r"MESHKIT_DEVICE_ID='x' is not valid; valid values are a GPU index of this process"),
    ("-1", r"MESHKIT_DEVICE_ID='-1' is not valid; valid values are a GPU index of this process"),
])
def test_the_device_env_var_names_the_gpu_or_a_clear_error(rt, monkeypatch, value, message):
    monkeypatch.setenv("MESHKIT_DEVICE_ID", value)
    if message is None:
        assert _world(lambda: None, 1)[0][0] == 5
        return
    with pytest.raises(meshkit.DistValueError, match=message):
        _world(lambda: None, 1)


def test_a_bad_device_id_argument_is_a_clear_error(rt):
    with pytest.raises(meshkit.DistValueError, match=r"rank 1: device_id=9 is not a GPU of this process; valid "
                                                     r"devices are 0\.\.7"):
        _world(lambda: None, 2, device_id=lambda rank: 9 * rank)


def test_ranks_on_one_gpu_need_an_nccl_that_shares_it(rt, monkeypatch):
    monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE", raising=False)
    one_gpu = dict(visible=lambda rank: [4])
    with pytest.raises(meshkit.DistBackendError, match=r"rank \d: ranks \[0, 1\] would share one GPU \(PCI "
                                                       r"0000:04:00\.0 of host \S+\); "
                                                       r"NCCL refuses that .*or set NCCL_MULTI_RANK_GPU_ENABLE=1 "
                                                       r"\(NCCL 2\.32\.3 can share\)"):
        _world(lambda: None, 2, **one_gpu)
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    assert _world(lambda: None, 2, **one_gpu) == [(0, [3.0, 3.0], None)] * 2
    monkeypatch.setattr(double.fake_nccl, "get_version", lambda: 22703)
    with pytest.raises(meshkit.DistBackendError, match=r"or NCCL >= 2\.30 with NCCL_MULTI_RANK_GPU_ENABLE=1 \(this "
                                                       r"is NCCL 2\.27\.3\)"):
        _world(lambda: None, 2, **one_gpu)


def test_double_refuses_two_ranks_on_one_physical_gpu_as_nccl_does(rt, monkeypatch):
    monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE", raising=False)
    # The refused rank fails at once, when it joins; the rank that joined first waits for it in
    # ncclCommInitRank until the double's own hang limit (30 s, the whole of this test's time).
    monkeypatch.setattr(double, "DOUBLE_TIMEOUT", 1.0)
    uid = double.fake_nccl.get_unique_id()
    errors = []

    def rank_main(rank):
        double.visible_devices([6])
        try:
            double.FakeCommunicator(2, uid, rank)
        except double.FakeNcclError as exc:
            errors.append(str(exc))
        finally:
            double.visible_devices(None)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert any(re.match(r"double: ncclInvalidUsage: Duplicate GPU detected : rank \d and rank \d both on CUDA "
                        r"device 6", e) for e in errors), errors
    assert len(errors) == 2 and any("ncclCommInitRank waiting for ranks" in e for e in errors), errors


def test_the_mpi_engine_reports_the_node_local_rank(mpirun):
    """Four cases in one job: meshkit-run's LOCAL_RANK, another value of it (the launcher's word
    first), one that is not a number, and none at all (MPI's shared-memory split)."""
    out = mpirun("mpi_device_select.py", 2, "local-rank", "local-rank=5", "local-rank=two", "split", timeout=60).stdout
    for rank in (0, 1):
        lines = [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith(f"[rank{rank}]: ")]
        assert lines == [f"local rank {rank}", "local rank 5",
                         f"DistValueError: meshkit.comm: rank {rank}: LOCAL_RANK='two' is not a node-local rank (a "
                         "non-negative integer)", f"split local rank {rank}"], out


def test_over_mpi_one_visible_gpu_per_rank_is_device_0_and_one_shared_gpu_is_refused(mpirun):
    out = mpirun("mpi_device_select.py", 2, "per-task", "one-gpu", env={"NCCL_MULTI_RANK_GPU_ENABLE": "0"},
                 timeout=60).stdout
    assert "[rank0]: device 0 (0000:00:00.0)" in out and "[rank1]: device 0 (0000:01:00.0)" in out, out
    for rank in (0, 1):
        assert f"[rank{rank}]: DistBackendError: meshkit.comm: rank {rank}: ranks [0, 1] would share one GPU" in out, out


# --------------------------------------------------------------------------- blocking calls
def _threads(*fns):
    """Run each ``fn`` on a thread of its own (a thread-rank of the double); their results."""
    out = [None] * len(fns)

    def run(i, fn):
        try:
            out[i] = fn()
        except Exception as exc:  # noqa: BLE001 (returned for the test to look at)
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_double_blocks_creation_and_first_use_until_the_peers_arrive(rt, monkeypatch):
    monkeypatch.delenv("NCCL_RUNTIME_CONNECT", raising=False)
    uid = double.fake_nccl.get_unique_id()
    comms = [None, None]

    def rank(r, late):
        def main():
            rt.use_device(r)
            time.sleep(late)
            began = time.monotonic()
            comms[r] = comm = double.FakeCommunicator(2, uid, r)
            created = time.monotonic() - began
            x = double.to_device(np.ones(4))
            stream = rt.current_stream()
            time.sleep(late)
            began = time.monotonic()
            comm.allReduce(x.data.ptr, x.data.ptr, 4, double.CONSTANTS["NCCL_FLOAT64"], 0, stream.ptr)
            first = time.monotonic() - began
            began = time.monotonic()
            comm.allReduce(x.data.ptr, x.data.ptr, 4, double.CONSTANTS["NCCL_FLOAT64"], 0, stream.ptr)
            return created, first, time.monotonic() - began, x.get().tolist()
        return main

    (created, first, second, out), late = _threads(rank(0, 0.0), rank(1, 0.4))
    assert created >= 0.35 and first >= 0.35 and second < 0.1, (created, first, second)
    assert out == late[3] == [4.0] * 4

    monkeypatch.setenv("NCCL_RUNTIME_CONNECT", "0")  # NCCL connects in init: the first use does not wait
    uid = double.fake_nccl.get_unique_id()
    (created, first, second, out), _ = _threads(rank(0, 0.0), rank(1, 0.4))
    assert created >= 0.35 and first < 0.1, (created, first)


def test_double_refuses_an_abort_while_another_thread_is_inside_a_call(rt, monkeypatch):
    monkeypatch.setattr(double, "misuse", [])
    monkeypatch.setattr(double, "DOUBLE_TIMEOUT", 1.0)
    monkeypatch.delenv("NCCL_RUNTIME_CONNECT", raising=False)
    uid = double.fake_nccl.get_unique_id()
    comms = []

    def rank(r):
        rt.use_device(r)
        comms.append(double.FakeCommunicator(2, uid, r))
        return comms[-1]

    c0, c1 = _threads(lambda: rank(0), lambda: rank(1))
    rt.use_device(c0.device_id())
    x = double.to_device(np.ones(2))
    sender = threading.Thread(target=_threads, args=(lambda: c0.send(x.data.ptr, 2, 8, 1, rt.current_stream().ptr),))
    sender.start()  # blocks: rank 1 never receives (the first send between them connects)
    time.sleep(0.3)
    with pytest.raises(double.FakeNcclError, match=r"ncclCommAbort of rank 0 on thread .* while thread\(s\) "
                                                   r"\[.*\] are inside an NCCL call on this blocking communicator"):
        c0.abort()
    sender.join()
    assert len(double.misuse) == 1
    c0.abort()  # nobody inside any more


def test_a_late_peer_at_the_first_collective_blocks_inside_nccl_past_the_timeout(rt, monkeypatch):
    """What docs/gpus.md says is not guaranteed: by default (NCCL_RUNTIME_CONNECT=1) the first
    collective connects the ranks inside NCCL; rank 0 waits there for rank 1, arriving after the
    group's 1 s timeout, and no timeout fires (a warm-up or NCCL_RUNTIME_CONNECT=0 moves the wait)."""
    monkeypatch.delenv("NCCL_RUNTIME_CONNECT", raising=False)

    def body():
        meshkit.init_process_group("nccl", timeout=1)
        x = double.to_device(np.ones(2))
        if meshkit.get_rank() == 1:
            time.sleep(1.8)
        began = time.monotonic()
        meshkit.all_reduce(x)
        return time.monotonic() - began, double.to_host(x).tolist()

    (took, out), _ = local.run(body, 2, init=False)
    assert took > 1.5 and out == [2.0, 2.0]


def test_the_engine_never_aborts_a_communicator_another_thread_is_inside(rt, monkeypatch):
    """Rank 0's watchdog fails an async all_reduce (rank 1 never joins) while rank 0's own thread
    is blocked inside NCCL, in the first send to rank 1 (a runtime connection rank 1 never
    makes). ncclCommAbort beside that call is unsafe on a blocking communicator: the engine
    leaves it to the thread inside, which aborts as it leaves (here when the double gives up)."""
    monkeypatch.setattr(double, "misuse", [])
    monkeypatch.setattr(double, "DOUBLE_TIMEOUT", 3.0)
    monkeypatch.delenv("NCCL_RUNTIME_CONNECT", raising=False)
    monkeypatch.setenv("MESHKIT_ASYNC_ERROR_HANDLING", "log")
    rank_0_done = threading.Event()

    def body():
        meshkit.init_process_group("nccl", timeout=1)
        meshkit.all_reduce(double.to_device(np.ones(1)))  # warm-up: all_reduce is connected
        if meshkit.get_rank() == 1:
            rank_0_done.wait(20)  # absent until rank 0 is through (was a 5 s sleep, 2 s past it)
            return None
        try:
            engine = meshkit.comm._seams.current_world().default_group.engine
            work = meshkit.all_reduce(double.to_device(np.ones(2)), async_op=True)
            work.wait()  # orders the stream; the watchdog watches it
            with pytest.raises(Exception, match=r"runtime connection .* did not happen"):
                meshkit.send(double.to_device(np.ones(2)), dst=1)  # blocks inside NCCL for 3 s
            return list(double.misuse), engine.comm._aborted, work.exception()
        finally:
            rank_0_done.set()

    (misuse, aborted, error), _ = local.run(body, 2, init=False)
    assert misuse == [], misuse
    assert aborted, "the thread inside did not abort the communicator as it left"
    assert isinstance(error, meshkit.CollectiveTimeout), error


def test_double_connects_a_groups_operations_at_its_outermost_group_end(rt, monkeypatch):
    """Inside groupStart/groupEnd the calls return at once; the first send/recv between two ranks
    connects (and blocks) at the outermost groupEnd, as NCCL's group launch does."""
    monkeypatch.delenv("NCCL_RUNTIME_CONNECT", raising=False)
    uid = double.fake_nccl.get_unique_id()
    comms = [None, None]

    def rank(r, late):
        def main():
            rt.use_device(r)
            comms[r] = comm = double.FakeCommunicator(2, uid, r)
            x = double.to_device(np.full(3, r + 5.0))
            stream = rt.current_stream()
            time.sleep(late)
            double.fake_nccl.groupStart()
            began = time.monotonic()
            if r == 0:
                comm.send(x.data.ptr, 3, double.CONSTANTS["NCCL_FLOAT64"], 1, stream.ptr)
            else:
                comm.recv(x.data.ptr, 3, double.CONSTANTS["NCCL_FLOAT64"], 0, stream.ptr)
            issued = time.monotonic() - began
            double.fake_nccl.groupEnd()
            return issued, time.monotonic() - began, x.get().tolist()
        return main

    (issued, ended, _), (_, _, got) = _threads(rank(0, 0.0), rank(1, 0.4))
    assert issued < 0.1 and ended >= 0.35, (issued, ended)
    assert got == [5.0, 5.0, 5.0]
