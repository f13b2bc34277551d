"""The NCCL engine over the strict double (tests/doubles/nccl_double.py), ranks as threads.

Every collective against the NumPy reference at world sizes 1 to 4, the routing of host and
device arrays, streams (Work.wait orders the caller's stream, no host sync), timeouts, and
tests that break the engine on purpose to show the double catches it. The double's methods
and constants are checked against the real ``cupy.cuda.nccl`` where it can be imported; tests
that need a GPU skip with the reason.
"""

from __future__ import annotations

import gc
import importlib.machinery
import importlib.util
import inspect
import re
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

import collective_cases as cases
from doubles import fake_cupy
import meshkit
from doubles import nccl_double as double
from support.nccl import on_nccl
from meshkit import ReduceOp
from meshkit.comm.engines import cuda_runtime
from meshkit.comm import local
from meshkit.comm.setup import lifecycle
from meshkit.comm.engines import nccl as nccl_engine
from meshkit.comm._seams import current_world

# NCCL's own types, and dtypes it moves as bytes (reductions need one of the first kind).
NATIVE = [np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64, np.float16, np.float32, np.float64]
MOVED_ONLY = [np.int16, np.uint16, np.longdouble]
SPECIAL = [np.bool_, np.complex64, np.complex128]  # reduced as uint8 / as float parts


def nccl_ops(dtype) -> list[ReduceOp]:
    """The reduce ops NCCL performs for ``dtype`` (written out, not read from the engine)."""
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return [ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND, ReduceOp.BOR]
    if dtype.kind == "c":
        return [ReduceOp.SUM, ReduceOp.AVG]
    if dtype in (np.int16, np.uint16, np.longdouble):
        return []
    if dtype.kind in "iu":
        return [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
    return [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]


@pytest.fixture
def connect_at_init(monkeypatch):
    """NCCL_RUNTIME_CONNECT=0: NCCL connects the ranks in init, so a peer late at a communicator's
    first collective meets the group's timeout (by default NCCL connects at that first call and
    blocks the host inside it, where no timeout reaches: see docs/gpus.md)."""
    monkeypatch.setenv("NCCL_RUNTIME_CONNECT", "0")


def dev_cases(dtype, group=None):
    return cases.check_all(dtype, group, dev=double.to_device, host=double.to_host, ops=nccl_ops)


# --------------------------------------------------------------------------- the collective suite
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", NATIVE + SPECIAL + MOVED_ONLY, ids=lambda d: np.dtype(d).name)
def test_every_collective_matches_numpy_nccl(fake_gpu, dtype, world_size):
    checks = on_nccl(dev_cases, world_size, dtype)
    per_rank = 8 * len(nccl_ops(dtype)) + 9 + world_size  # + 1 on rank 0, the gather root
    assert checks == [per_rank + 1] + [per_rank] * (world_size - 1)


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_subgroups_split_the_communicator(fake_gpu, world_size):
    def body():
        return cases.check_subgroup(np.float32, dev=double.to_device, host=double.to_host, ops=nccl_ops)
    checks = on_nccl(body, world_size)
    assert checks[0] > 0 and all(c == 0 for c in checks[1::2])


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_host_arrays_and_objects_go_over_the_host_engine(fake_gpu, world_size):
    def body():
        assert meshkit.get_backend() == "nccl"
        return cases.check_all(np.float64) + cases.check_objects()
    per_rank = 8 * 5 + 10 + world_size + 4  # as in the suite above, plus the four object collectives
    assert on_nccl(body, world_size) == [per_rank + 1] + [per_rank] * (world_size - 1)


def test_monitored_barrier_and_barrier(fake_gpu):
    def body():
        meshkit.monitored_barrier(timeout=5)
        meshkit.barrier()
        return True
    assert on_nccl(body, 3) == [True] * 3


# --------------------------------------------------------------------------- streams and waits
def test_work_wait_orders_the_stream_without_blocking_the_host(fake_gpu):
    """Rank 1 starts its all_reduce only after rank 0's Work.wait() returned: a host-blocking
    wait would never return. The result is right once the host reads it (a stream sync). A
    warm-up all_reduce connects the ranks first (NCCL's runtime connection blocks the first)."""
    waited = threading.Event()

    def body():
        meshkit.all_reduce(double.to_device(np.ones(1, np.float32)))  # warm-up
        x = double.to_device(np.full(4, meshkit.get_rank() + 1.0, np.float32))
        if meshkit.get_rank() == 0:
            work = meshkit.all_reduce(x, async_op=True)
            work.wait()
            waited.set()
        else:
            assert waited.wait(10), "Work.wait() blocked the host until the collective completed"
            meshkit.all_reduce(x)
        return double.to_host(x)

    for out in on_nccl(body, 2):
        np.testing.assert_array_equal(out, np.full(4, 3.0, np.float32))


def test_buffers_of_an_async_collective_stay_alive(fake_gpu, connect_at_init):
    """Rank 0 drops its Work and its array before rank 1 joins; the double reports any read of
    freed device memory, so the next collective would fail. The ranks connect at init: with
    NCCL's default runtime connect, rank 0's first all_reduce blocks the host until rank 1 calls
    it, so rank 0 never got to drop anything first (rank 1 waited out its 10 s for ``dropped``)."""
    dropped = threading.Event()

    def body():
        if meshkit.get_rank() == 0:
            meshkit.all_reduce(double.to_device(np.ones(1024)), async_op=True)
            gc.collect()  # the Work and the array are gone, not just unreferenced
            dropped.set()
        else:
            assert dropped.wait(10), "rank 0's async all_reduce did not return before rank 1 joined"
            meshkit.all_reduce(double.to_device(np.ones(1024)))
        y = double.to_device(np.ones(3))
        meshkit.all_reduce(y)
        return double.to_host(y)

    for out in on_nccl(body, 2):
        np.testing.assert_array_equal(out, [2.0, 2.0, 2.0])


def _engine():
    return current_world().default_group.engine


def test_a_rank_that_never_arrives_is_named_and_the_communicator_aborted(fake_gpu, connect_at_init):
    """Rank 2 never calls; rank 0 times out first and names it (ranks 0 and 1 had arrived), both
    abort their communicators (ncclCommAbort: the double's abort is per rank, as NCCL's), rank 1
    fails at once on rank 0's notice instead of at its own timeout, and the group stays failed."""
    def body():
        rank, x = meshkit.get_rank(), double.to_device(np.ones(2))
        if rank == 2:
            time.sleep(2.5)
            return None
        if rank == 1:
            time.sleep(0.5)  # arrives after rank 0, so that rank 0 times out first
        start = time.monotonic()
        with pytest.raises(meshkit.DistError) as info:
            meshkit.all_reduce(x)
        elapsed = time.monotonic() - start
        with pytest.raises(meshkit.DistError, match=r"group world is unusable after an earlier failure: "
                                                    r"all_reduce #0 (timed out|failed)"):
            meshkit.all_reduce(x)
        return info.value, elapsed, _engine().comm._aborted, meshkit.flight_record()[0]["state"]

    (error0, _, aborted0, state0), (error1, elapsed1, aborted1, _), _ = on_nccl(body, 3, timeout=1)
    assert isinstance(error0, meshkit.CollectiveTimeout) and error0.missing == [2], error0
    assert re.search(r"rank 0: all_reduce #0 on group world \(ranks \[0, 1, 2\]\) timed out after 1.0 s; ranks that "
                     r"did not arrive: \[2\] \(NCCL all_reduce did not complete; the communicator was aborted\)",
                     str(error0)), error0
    assert isinstance(error1, meshkit.RankFailedError), error1
    assert re.search(r"rank 1: call #0 on group world .* cannot complete: rank 0 stopped using group world at call "
                     r"#0: all_reduce #0 timed out", str(error1)), error1
    assert elapsed1 < 0.9, f"rank 1 waited {elapsed1:.2f} s: its own timeout, not rank 0's notice"
    assert aborted0 and aborted1 and state0 == "timed_out"


def test_an_asynchronous_nccl_error_during_a_wait_aborts_and_tells_the_others(fake_gpu, connect_at_init):
    """check_async_error reports an error while rank 0 waits (injected into its communicator,
    as NCCL reports a network failure): the error names the operation, the communicator is
    aborted, and rank 1, whose call can no longer complete, fails at once naming rank 0."""
    told = threading.Event()

    def body():
        x = double.to_device(np.ones(2))
        if meshkit.get_rank() == 0:
            comm = _engine().comm
            threading.Timer(0.2, comm.inject_async_error, ("double: injected: NET/IB: connection closed",)).start()
            with pytest.raises(meshkit.DistBackendError) as info:
                meshkit.all_reduce(x)
            told.set()
            return str(info.value), comm._aborted
        assert told.wait(10)
        start = time.monotonic()
        with pytest.raises(meshkit.RankFailedError) as info:
            meshkit.all_reduce(x)
        return str(info.value), time.monotonic() - start

    (error0, aborted), (error1, elapsed) = on_nccl(body, 2, timeout=20)
    assert re.search(r"rank 0: all_reduce: NCCL reported an asynchronous error \(double: injected: NET/IB: connection "
                     r"closed\); the communicator was aborted", error0), error0
    assert aborted
    assert re.search(r"rank 1: call #0 on group world .* cannot complete: rank 0 stopped using group world at call "
                     r"#0: all_reduce #0 failed: .*NCCL reported an asynchronous error", error1), error1
    assert elapsed < 5, f"rank 1 waited {elapsed:.1f} s for a call rank 0 had abandoned"


def test_the_watchdog_aborts_deferred_work_past_its_deadline(fake_gpu, connect_at_init, monkeypatch, caplog):
    """Work.wait() of an async call only orders the stream; rank 1 never arrives in time. The
    watchdog fails the work at the group's timeout: the communicator is aborted (so the host's
    copy returns instead of hanging), the error is logged with the flight record and kept on
    the Work, the next call on the group raises, and rank 1, arriving late, fails at once."""
    monkeypatch.setattr(double, "DOUBLE_TIMEOUT", 6.0)  # a hang in the double, reported sooner
    monkeypatch.setenv("MESHKIT_ASYNC_ERROR_HANDLING", "log")  # the default ends the job: see the next test

    def body():
        x = double.to_device(np.ones(2))
        if meshkit.get_rank() == 1:
            time.sleep(2.0)
            start = time.monotonic()
            with pytest.raises(meshkit.RankFailedError, match=r"rank 0 stopped using group world at call #0: "
                                                              r"all_reduce #0 timed out"):
                meshkit.all_reduce(x)
            return time.monotonic() - start
        work = meshkit.all_reduce(x, async_op=True)
        work.wait()  # returns at once: the stream waits, the host does not
        start = time.monotonic()
        x.get()  # a host copy: the stream waits for the all_reduce, until the watchdog aborts it
        got = time.monotonic() - start
        with pytest.raises(meshkit.DistError, match=r"group world is unusable after an earlier failure: "
                                                    r"all_reduce #0 timed out"):
            meshkit.all_reduce(x)
        for _ in range(200):  # the copy returns once the communicator is aborted, before the
            if work.exception() is not None:  # watchdog has heard which ranks had arrived
                break
            time.sleep(0.01)
        return got, work.exception(), work.is_success(), _engine().comm._aborted

    with caplog.at_level("ERROR", logger="meshkit"):
        (got, error, success, aborted), late = on_nccl(body, 2, timeout=1)
    assert got < 3, f"x.get() waited {got:.1f} s"
    assert isinstance(error, meshkit.CollectiveTimeout) and error.missing == [1], error
    assert re.search(r"rank 0: all_reduce #0 on group world .* timed out after 1.0 s; ranks that did not arrive: "
                     r"\[1\] \(found by the watchdog; Work.wait\(\) had returned", str(error)), error
    assert not success and aborted
    assert late < 0.9, f"rank 1 waited {late:.1f} s for a call rank 0 had abandoned"
    logged = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("all_reduce #0 on group world" in m and "meshkit flight recorder, rank 0" in m for m in logged), logged


def test_by_default_the_watchdog_ends_the_job_when_deferred_work_fails(fake_gpu, connect_at_init, monkeypatch):
    """After Work.wait() returned, the caller may already have read the unreduced buffer: as
    torch's default, the watchdog ends the job rather than leave a silently wrong result (only
    the watchdog's failure of work whose wait() had returned does; a waiter gets the error)."""
    monkeypatch.setattr(double, "DOUBLE_TIMEOUT", 6.0)
    monkeypatch.delenv("MESHKIT_ASYNC_ERROR_HANDLING", raising=False)
    ended = []
    monkeypatch.setattr(meshkit.comm.job_end, "tear_down", lambda world, reason: ended.append((world.rank, reason)))

    def body():
        x = double.to_device(np.ones(2))
        if meshkit.get_rank() == 1:
            time.sleep(2.0)
            with pytest.raises(meshkit.RankFailedError):
                meshkit.all_reduce(x)
            return None
        work = meshkit.all_reduce(x, async_op=True)
        work.wait()
        for _ in range(300):
            if work.exception() is not None:
                break
            time.sleep(0.01)
        return work.exception()

    error, _ = on_nccl(body, 2, timeout=1)
    assert isinstance(error, meshkit.CollectiveTimeout)
    assert len(ended) == 1 and ended[0][0] == 0, ended
    assert "all_reduce #0" in ended[0][1] and "may have used the unreduced buffer" in ended[0][1]


def test_work_wait_with_a_timeout_blocks_the_host_on_device_work(fake_gpu, connect_at_init):
    """As torch's: Work.wait(timeout=...) waits on the host; running out raises and leaves the
    operation (and the communicator) alone, and a later wait sees it complete."""
    arrive = threading.Event()

    def body():
        x = double.to_device(np.full(2, meshkit.get_rank() + 1.0))
        if meshkit.get_rank() == 1:
            assert arrive.wait(10)
            meshkit.all_reduce(x)
            return double.to_host(x).tolist()
        work = meshkit.all_reduce(x, async_op=True)
        start = time.monotonic()
        with pytest.raises(meshkit.CollectiveTimeout, match=r"all_reduce on group world did not complete within "
                                                            r"Work.wait\(timeout=0.2\)"):
            work.wait(timeout=0.2)
        waited = time.monotonic() - start
        aborted = _engine().comm._aborted
        arrive.set()
        assert work.wait(timeout=10)
        return waited, aborted, double.to_host(x).tolist()

    (waited, aborted, out0), out1 = on_nccl(body, 2, timeout=30)
    assert waited >= 0.2 and not aborted
    assert out0 == out1 == [3.0, 3.0]


def test_destroy_does_not_hang_on_device_work_that_never_completes(fake_gpu, connect_at_init, monkeypatch):
    """destroy_process_group right after a deferred call whose peer never comes: destroying the
    communicator (ncclCommDestroy) would wait for it forever; the group waits at most its timeout
    for the device work, then aborts the communicator instead. (In log mode: whether the
    watchdog or destroy reaches the deadline first is timing; by default the watchdog would end
    the job, tested above.)"""
    monkeypatch.setattr(double, "DOUBLE_TIMEOUT", 6.0)
    monkeypatch.setenv("MESHKIT_ASYNC_ERROR_HANDLING", "log")

    def body():
        if meshkit.get_rank() == 1:
            time.sleep(2.5)
            return None
        meshkit.all_reduce(double.to_device(np.ones(2)), async_op=True).wait()
        engine = _engine()
        start = time.monotonic()
        meshkit.destroy_process_group()
        return time.monotonic() - start, engine.comm._aborted

    (took, aborted), _ = on_nccl(body, 2, timeout=1)
    assert took < 3 and aborted, (took, aborted)


@pytest.mark.parametrize("wait", ["sync", "deferred"])
def test_a_peer_that_leaves_during_a_device_wait_is_named_at_once(fake_gpu, connect_at_init, wait, monkeypatch):
    """Rank 1 destroys its process group (it leaves) while rank 0's all_reduce waits for it on
    the device, in a synchronous call or after Work.wait() returned (then the watchdog reads
    the notice): rank 0 fails within a second, not at its 20 s timeout, naming rank 1, and
    aborts its communicator. (Deferred: in log mode; by default the job would end, tested above.)"""
    monkeypatch.setenv("MESHKIT_ASYNC_ERROR_HANDLING", "log")  # else conftest's job_teardowns fails it
    def body():
        if meshkit.get_rank() == 1:
            meshkit.destroy_process_group()
            return None
        x = double.to_device(np.ones(2))
        start = time.monotonic()
        if wait == "sync":
            with pytest.raises(meshkit.RankFailedError) as info:
                meshkit.all_reduce(x)
            error = info.value
        else:
            work = meshkit.all_reduce(x, async_op=True)
            work.wait()
            while work.exception() is None and time.monotonic() - start < 10:
                time.sleep(0.01)
            error = work.exception()
        return error, time.monotonic() - start, _engine().comm._aborted

    (error, elapsed, aborted), _ = on_nccl(body, 2, timeout=20)
    assert isinstance(error, meshkit.RankFailedError), error
    assert re.search(r"rank 0: call #0 on group world \(ranks \[0, 1\]\) cannot complete: rank 1 left the job \(it "
                     r"destroyed its process group, after 0 calls on the world group\)", str(error)), error
    assert elapsed < 1, f"rank 0 waited {elapsed:.1f} s"
    assert aborted


# --------------------------------------------------------------------------- bad input
def test_unsupported_op_or_dtype_names_both(fake_gpu):
    def body():
        with pytest.raises(TypeError, match=r"rank 0: all_reduce: NCCL cannot reduce dtype int32 with "
                                            r"ReduceOp.BAND; NCCL reduces \['int8', "):
            meshkit.all_reduce(double.to_device(np.ones(3, np.int32)), ReduceOp.BAND)
        with pytest.raises(TypeError, match=r"NCCL cannot reduce dtype int16 with ReduceOp.SUM"):
            meshkit.all_reduce(double.to_device(np.ones(3, np.int16)))
        return True
    assert on_nccl(body, 1) == [True]


def test_mixing_host_and_device_arrays_is_a_type_error(fake_gpu):
    def body():
        out = double.to_device(np.zeros(4))
        with pytest.raises(TypeError, match=r"rank \d: all_gather_into_tensor: output is "
                                            r"doubles.nccl_double.DeviceArray \(device\) but input is numpy.ndarray \(host\)"):
            meshkit.all_gather_into_tensor(out, np.zeros(2))
        with pytest.raises(TypeError, match=r"all_gather: tensor_list\[1\] is numpy.ndarray \(host\) but tensor is "
                                            r"doubles.nccl_double.DeviceArray \(device\)"):
            meshkit.all_gather([double.to_device(np.zeros(2)), np.zeros(2)], double.to_device(np.zeros(2)))
        return True
    assert on_nccl(body, 2) == [True, True]


def test_device_send_needs_tag_zero_and_a_source(fake_gpu):
    def body():
        peer = 1 - meshkit.get_rank()
        with pytest.raises(ValueError, match=r"send: tag=3 on device arrays: NCCL has no tags"):
            meshkit.isend(double.to_device(np.zeros(2)), dst=peer, tag=3)
        with pytest.raises(ValueError, match=r"recv: NCCL cannot receive from any rank; pass src"):
            meshkit.irecv(double.to_device(np.zeros(2)))
        return True
    assert on_nccl(body, 2) == [True, True]


# --------------------------------------------------------------------------- the engine broken on purpose
def test_a_wrong_dtype_map_fails(fake_gpu, monkeypatch):
    monkeypatch.setitem(nccl_engine.NCCL_DTYPES, "float32", "NCCL_FLOAT64")
    with pytest.raises(Exception, match=r"datatype 8 \(float64\) does not match the buffer's dtype float32|"
                                        r"do not lie inside a live device allocation"):
        on_nccl(dev_cases, 2, np.float32)


def test_a_wrong_op_map_fails(fake_gpu, monkeypatch):
    monkeypatch.setitem(nccl_engine.NCCL_OPS, ReduceOp.SUM, "NCCL_MAX")
    with pytest.raises(AssertionError, match=r"all_reduce ReduceOp.SUM dtype=float64"):
        on_nccl(dev_cases, 2, np.float64)


def test_a_wrong_count_fails(fake_gpu, monkeypatch):
    moved = nccl_engine.NCCLEngine._moved
    monkeypatch.setattr(nccl_engine.NCCLEngine, "_moved", lambda self, x: (moved(self, x)[0], moved(self, x)[1] + 1))
    with pytest.raises(Exception, match=r"do not lie inside a live device allocation"):
        on_nccl(dev_cases, 2, np.float64)


def test_a_missing_stream_dependency_fails(monkeypatch):
    class DeafStream(double.FakeStream):
        def wait_event(self, event):  # the engine's "comm stream waits on the caller" goes missing
            pass

    class Runtime(double.FakeRuntime):
        def new_stream(self):
            stream = DeafStream(double._device())
            double._streams.add(stream)
            return stream

    previous = cuda_runtime.set_runtime(Runtime())
    try:
        with pytest.raises(Exception, match=r"the stream argument is not ordered after the caller's current stream"):
            on_nccl(dev_cases, 2, np.float64)
    finally:
        cuda_runtime.set_runtime(previous)


def test_unbalanced_groups_fail(fake_gpu, monkeypatch):
    """Without groupEnd NCCL never launches the group: the gather hangs, which the group's
    timeout (or the double, at the next host synchronization) reports."""
    monkeypatch.setattr(double._FakeNcclModule, "groupEnd", staticmethod(lambda: None))

    def body():
        gl = [double.to_device(np.zeros(2)) for _ in range(2)] if meshkit.get_rank() == 0 else None
        meshkit.gather(double.to_device(np.ones(2)), gl, dst=0)

    with pytest.raises(Exception, match=r"gather #0 .* timed out|gather: NCCL reported an asynchronous error|"
                                        r"inside groupStart\(\)/groupEnd\(\)"):
        on_nccl(body, 2, timeout=2)


# --------------------------------------------------------------------------- backend choice
def test_auto_picks_nccl_only_where_a_gpu_is_seen():
    previous = cuda_runtime.set_runtime(double.FakeRuntime(devices=2))
    try:
        assert lifecycle._resolve_backend("auto") == "nccl"
        cuda_runtime.set_runtime(double.FakeRuntime(devices=0))
        assert lifecycle._resolve_backend("auto") == "mpi"
    finally:
        cuda_runtime.set_runtime(previous)


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE", raising=False)
    previous = cuda_runtime.set_runtime(double.FakeRuntime(devices=2))
    try:
        with pytest.raises(meshkit.DistBackendError, match=r"rank \d: ranks \[0, 2\] would share one GPU "
                                                          r"\(PCI 0000:00:00\.0 of host \S+\); NCCL refuses that"):
            on_nccl(lambda: None, 3)
    finally:
        cuda_runtime.set_runtime(previous)


# --------------------------------------------------------------------------- the real module
def _real_nccl():
    """The real ``cupy.cuda.nccl``; skips only where CuPy is not installed. An installed CuPy that
    fails to import, or whose NCCL bindings are missing, fails the test (the cuda12 CI job installs
    CuPy: a broken one there must not turn every check against it into a skip)."""
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("CuPy is not installed here: pip install 'meshkit[cuda12]' (it imports without a GPU)")
    from cupy.cuda import nccl

    assert getattr(nccl, "available", True), "CuPy is installed but cupy.cuda.nccl is not available"
    return nccl


def _documented(method) -> list[str]:
    """Parameter names from a Cython docstring's first line: ``Name(self, intptr_t sendbuf, ...)``."""
    head = (method.__doc__ or "").splitlines()[0]
    inside = head[head.index("(") + 1:head.rindex(")")]
    return [p.split("=")[0].split()[-1] for p in inside.split(",") if p.strip()]


def test_double_has_the_signatures_of_the_real_communicator():
    nccl = _real_nccl()
    real = nccl.NcclCommunicator
    names = [n for n in dir(real) if not n.startswith("_")]
    assert set(names) <= set(dir(double.FakeCommunicator)), set(names) - set(dir(double.FakeCommunicator))
    for name in names:
        method = getattr(real, name)
        if not callable(method):
            continue
        fake = list(inspect.signature(getattr(double.FakeCommunicator, name)).parameters)
        assert fake == _documented(method), name
    assert _documented(real) == ["ndev", "commId", "rank", "config"]
    assert list(inspect.signature(double.FakeCommunicator).parameters) == ["ndev", "commId", "rank", "config"]


def test_double_has_the_constants_of_the_real_module():
    nccl = _real_nccl()
    real = {n: getattr(nccl, n) for n in dir(nccl) if n.startswith("NCCL_")}
    assert {n: v for n, v in double.CONSTANTS.items() if n in real} == real
    for const in list(nccl_engine.NCCL_DTYPES.values()) + list(nccl_engine.NCCL_OPS.values()):
        assert hasattr(nccl, const), const
    for fn in ("groupStart", "groupEnd", "get_unique_id", "NcclError"):
        assert hasattr(nccl, fn), fn
    assert len(nccl.get_unique_id()) == 128


#: A function's signature, read from its docstring where Cython gives none (fake_cupy's reader).
_real_signature = fake_cupy.real_signature


class _Recorder:
    """Stands in for CuPy (or one of its objects) and records every call made on it, by path:
    ``cupy.cuda.Device().use`` is ``use`` called on what ``cupy.cuda.Device(...)`` returned."""

    def __init__(self, path: str, calls: list) -> None:
        self._path, self._calls = path, calls

    def __getattr__(self, name: str) -> "_Recorder":
        return _Recorder(f"{self._path}.{name}", self._calls)

    def __call__(self, *args, **kwargs) -> "_Recorder":
        self._calls.append((self._path, args, kwargs))
        return _Recorder(f"{self._path}()", self._calls)

    def __int__(self) -> int:
        return 1

    def __bytes__(self) -> bytes:
        return b"\x01"


def _resolve(path: str, modules: dict):
    """The real callable a recorded path names, and whether it is called on an instance."""
    first, *rest = path.split(".")
    obj, bound = modules[first], False
    for part in rest:
        if obj is None or bound and part.endswith("()"):
            raise AssertionError(f"{path}: cannot follow the result of a call on an instance")
        if part.endswith("()"):  # an instance of the class called here
            obj = getattr(obj, part[:-2], None)
            assert isinstance(obj, type), f"{path}: {part[:-2]} is not a class of the real CuPy"
            bound = True
        else:
            obj = getattr(obj, part, None)
            assert obj is not None, f"{path}: the real CuPy has no {part}"
    return obj, bound


def _raises_recorder(fn) -> None:
    """``fn()`` ends raising what the recorder returned (event_done's CUDA error): not an exception."""
    with pytest.raises(TypeError, match="exceptions must derive from BaseException"):
        fn()


def test_every_cupy_call_of_the_runtime_exists_in_the_real_cupy(monkeypatch):
    """Run every method of CupyRuntime against a recorder of CuPy, then bind each recorded call
    to the real CuPy's function, class or method: a renamed function or keyword (say
    ``ndarray.get(out=, blocking=)``, which older CuPy lacks) fails here, without a GPU."""
    _real_nccl()
    import cupy
    import cupyx

    calls: list = []
    rt = cuda_runtime.CupyRuntime()
    rt._cupy = _Recorder("cupy", calls)
    monkeypatch.setitem(sys.modules, "cupyx", _Recorder("cupyx", calls))
    array = _Recorder("cupy.ndarray()", calls)  # what the MPI engine hands over: CuPy arrays
    exercised = {
        "device_count": lambda: rt.device_count(),
        "use_device": lambda: rt.use_device(0),
        "current_device": lambda: rt.current_device(),
        "device_of": lambda: rt.device_of(types.SimpleNamespace(__cuda_array_interface__={"data": (1, False)})),
        "pci_bus_id": lambda: rt.pci_bus_id(0),
        "new_stream": lambda: rt.new_stream(),
        "new_event": lambda: rt.new_event(),
        "event_done": lambda: _raises_recorder(lambda: rt.event_done(rt.new_event())),
        "current_stream": lambda: rt.current_stream(),
        "pinned_empty": lambda: rt.pinned_empty((4,), np.float32),
        "copy_to_host": lambda: rt.copy_to_host(array, np.empty(4, np.float32), rt.new_stream()),
        "copy_to_device": lambda: rt.copy_to_device(np.empty(4, np.float32), array, rt.new_stream()),
    }
    no_cupy = {"is_device_array", "pointer"}  # they read __cuda_array_interface__ only
    public = {n for n in dir(cuda_runtime.CupyRuntime) if not n.startswith("_") and n != "nccl"}
    assert public == set(exercised) | no_cupy, "a new CupyRuntime method: add it to this test"
    for name, run in exercised.items():
        run()
    paths = sorted({path for path, _, _ in calls})
    assert paths == ["cupy.cuda.Device", "cupy.cuda.Device().use", "cupy.cuda.Event", "cupy.cuda.Stream",
                     "cupy.cuda.get_current_stream", "cupy.cuda.runtime.CUDARuntimeError",
                     "cupy.cuda.runtime.deviceGetPCIBusId", "cupy.cuda.runtime.eventQuery",
                     "cupy.cuda.runtime.getDevice", "cupy.cuda.runtime.getDeviceCount",
                     "cupy.cuda.runtime.pointerGetAttributes",
                     "cupy.ndarray().get", "cupy.ndarray().set", "cupyx.empty_pinned"], paths
    modules = {"cupy": cupy, "cupyx": cupyx}
    for path, args, kwargs in calls:
        real, bound = _resolve(path, modules)
        signature = _real_signature(real)
        try:
            signature.bind(*(("self",) if bound else ()), *args, **kwargs)
        except TypeError as exc:
            raise AssertionError(f"{path}{signature} does not accept args={args} kwargs={kwargs}: {exc}") from None

    # What the engines do with the streams and events the runtime returns (the runtime's contract).
    stream, event = cupy.cuda.Stream, cupy.cuda.Event
    for method, args in [(stream.wait_event, ("event",)), (stream.synchronize, ()), (event.record, ("stream",)),
                         (event.synchronize, ())]:
        _real_signature(method).bind("self", *args)
    assert isinstance(inspect.getattr_static(event, "done"), property), "Event.done is read, not called"
    assert isinstance(stream.null.ptr, int)
    # and the double has the same names
    for fake, real in [(double.FakeStream.wait_event, stream.wait_event), (double.FakeStream.synchronize,
                       stream.synchronize), (double.FakeEvent.record, event.record),
                       (double.FakeEvent.synchronize, event.synchronize)]:
        assert list(inspect.signature(fake).parameters) == list(_real_signature(real).parameters), fake
    assert isinstance(inspect.getattr_static(double.FakeEvent, "done"), property)


def test_on_real_gpus(mpirun):
    if not cuda_runtime.gpu_available():
        pytest.skip("no GPU: CuPy sees no CUDA device here (the NCCL engine is tested over the double)")
    n = min(cuda_runtime.runtime().device_count(), 4)
    out = mpirun("nccl_gpu.py", n, timeout=600).stdout
    lines = [line for line in out.splitlines() if " OK " in f" {line.split(': ', 1)[-1]} "]
    assert len(lines) == n and all(f"of {n}" in line for line in lines), out


def test_detail_mode_checks_every_call_over_the_host_engine(fake_gpu, monkeypatch):
    monkeypatch.setenv("MESHKIT_DEBUG", "detail")
    assert on_nccl(dev_cases, 2, np.float32)[1] == 8 * 5 + 9 + 2

    def body():
        x = double.to_device(np.ones(2))
        if meshkit.get_rank() == 0:
            meshkit.all_reduce(x)
        else:
            meshkit.broadcast(x, src=0)

    with pytest.raises(meshkit.CollectiveMismatchError, match=r"collective mismatch on group world at #0"):
        on_nccl(body, 2)


def test_a_call_makes_one_cuda_event_and_a_thread_one_more(fake_gpu, monkeypatch):
    """A collective makes its done event; the event ordering it after the caller's stream is made
    once per calling thread and recorded anew (on a GPU each made event was a CUDA call of every
    collective). The results stay right, from the main thread and from the group's own thread."""
    made = []
    real = double.FakeRuntime.new_event
    monkeypatch.setattr(double.FakeRuntime, "new_event", staticmethod(lambda: made.append(1) or real()))

    def body():
        x = double.to_device(np.ones(3))
        meshkit.all_reduce(x)  # the world's first call: the engine's set-up events too
        before = len(made)
        for _ in range(10):
            meshkit.all_reduce(x)
        on_main = len(made) - before
        group = current_world().default_group  # its communication thread: another calling thread
        group.run_async(lambda: group.all_reduce(x), "hook").wait()  # (its ordering event made, if not yet)
        before = len(made)
        group.run_async(lambda: [group.all_reduce(x) for _ in range(3)], "hook").wait()
        return on_main, len(made) - before, x.get().tolist()

    on_main, on_worker, got = on_nccl(body, 1)[0]
    assert (on_main, on_worker) == (10, 3)  # a done event a call; each thread's ordering event once
    assert got == [1.0] * 3


def test_a_mesh_costs_one_comm_split_per_dimension(fake_gpu, monkeypatch):
    """A 2 x 2 mesh over an nccl world: one commSplit per dimension on every rank, and device
    all_reduces over each dimension's group match the reference."""
    calls = {}
    split = double.FakeCommunicator.commSplit

    def counted(self, color, key, config=None):
        calls[threading.get_ident()] = calls.get(threading.get_ident(), 0) + 1
        return split(self, color, key, config)

    monkeypatch.setattr(double.FakeCommunicator, "commSplit", counted)

    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        rank = meshkit.get_rank()
        out = {}
        for dim in ("dp", "tp"):
            x = double.to_device(np.full(3, float(rank)))
            meshkit.all_reduce(x, group=mesh.get_group(dim))
            out[dim] = float(double.to_host(x)[0])
        return calls[threading.get_ident()], current_world().split_count, out

    results = on_nccl(body, 4)
    # mesh [[0, 1], [2, 3]]: dp groups [0, 2], [1, 3]; tp groups [0, 1], [2, 3]
    assert [r[2] for r in results] == [{"dp": 2.0, "tp": 1.0}, {"dp": 4.0, "tp": 1.0},
                                       {"dp": 2.0, "tp": 5.0}, {"dp": 4.0, "tp": 5.0}]
    assert [r[0] for r in results] == [2] * 4
    assert [r[1] for r in results] == [2] * 4


def test_async_collectives_in_a_row_and_their_epilogues(fake_gpu):
    """Several async calls in flight, waited in order: each result right, including the list
    collectives whose rows are copied out after Work.wait (stream-ordered epilogues)."""
    def body():
        rank, n = meshkit.get_rank(), meshkit.get_world_size()
        xs = [double.to_device(np.full(5, rank + i, np.float64)) for i in range(3)]
        works = [meshkit.all_reduce(x, op=ReduceOp.AVG, async_op=True) for x in xs]
        outs = [double.to_device(np.zeros(2, np.int32)) for _ in range(n)]
        works.append(meshkit.all_gather(outs, double.to_device(np.full(2, rank, np.int32)), async_op=True))
        for w in works:
            w.wait()
        return [double.to_host(x)[0] for x in xs], [int(double.to_host(o)[1]) for o in outs]

    for avgs, gathered in on_nccl(body, 3):
        assert avgs == [1.0, 2.0, 3.0]
        assert gathered == [0, 1, 2]


def test_collectives_from_the_group_communication_thread(fake_gpu):
    """A task of run_async issues on the group's own thread (another thread, device 0 until the
    engine selects the rank's device): the stream order still holds."""
    def body():
        group = current_world().default_group
        x = double.to_device(np.full(2, meshkit.get_rank() + 1.0))
        group.run_async(lambda: group.all_reduce(x), "hook").wait()
        return double.to_host(x).tolist()

    assert on_nccl(body, 3) == [[6.0, 6.0]] * 3


def test_no_driver_means_no_gpu():
    class NoDriver(double.FakeRuntime):
        def device_count(self):
            raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")

    previous = cuda_runtime.set_runtime(NoDriver())
    try:
        assert cuda_runtime.gpu_available() is False
        assert lifecycle._resolve_backend("auto") == "mpi"
    finally:
        cuda_runtime.set_runtime(previous)


def test_nccl_without_cupy_says_what_to_install(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "cupy", None)  # `import cupy` raises ImportError
    previous = cuda_runtime.set_runtime(None)
    try:
        with pytest.raises(meshkit.DistBackendError, match=r"the 'nccl' backend needs CuPy with NCCL: "
                                                           r"pip install 'meshkit\[cuda12\]'"):
            on_nccl(lambda: None, 1)
    finally:
        cuda_runtime.set_runtime(previous)


def test_a_cupy_without_comm_split_is_refused_naming_its_version(monkeypatch):
    """commSplit arrived in CuPy 14: an older CuPy is refused when the runtime is made, with
    its version, not at the first sub-group."""
    class OldCommunicator:  # CuPy 13's NcclCommunicator: no commSplit
        def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):  # noqa: N802
            pass

    cupy = types.ModuleType("cupy")
    cupy.__version__ = "13.6.0"
    cuda = types.ModuleType("cupy.cuda")
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.NcclCommunicator, nccl.available = OldCommunicator, True
    cupy.cuda, cuda.nccl = cuda, nccl
    for name, module in [("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.nccl", nccl)]:
        monkeypatch.setitem(sys.modules, name, module)
    with pytest.raises(meshkit.DistBackendError, match=r"the 'nccl' backend needs CuPy >= 14 \(NcclCommunicator."
                                                       r"commSplit builds its sub-groups\); CuPy 13.6.0 is installed"):
        cuda_runtime.CupyRuntime()


def test_both_cuda_extras_require_a_cupy_with_comm_split():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for extra, wheel in (("cuda12", "cupy-cuda12x"), ("cuda13", "cupy-cuda13x")):
        assert f"{wheel}>=14" in extras[extra], (extra, extras[extra])


@pytest.mark.parametrize("case", ["other collective", "other count"])
def test_ranks_that_disagree_fail_instead_of_corrupting(fake_gpu, case):
    """Without detail mode meshkit cannot see the disagreement; the double, as NCCL would
    (by hanging or reading garbage), must not let it pass."""
    def body():
        rank = meshkit.get_rank()
        x = double.to_device(np.ones(3 if case == "other collective" or rank == 0 else 4))
        if case == "other collective" and rank == 1:
            meshkit.broadcast(x, src=0)
        else:
            meshkit.all_reduce(x)

    with pytest.raises(Exception, match=r"collective #0: rank \d issued \('(allReduce|broadcast)', [34],"):
        on_nccl(body, 2, timeout=5)


def test_async_collectives_start_at_once(fake_gpu):
    """The stream orders a group's collectives: none waits in the group's queue (as on MPI)."""
    def body():
        xs = [double.to_device(np.ones(2)) for _ in range(3)]
        works = [meshkit.all_reduce(x, async_op=True) for x in xs]
        works.append(meshkit.broadcast(double.to_device(np.ones(2)), src=0, async_op=True))
        states = [e["state"] for e in meshkit.flight_record()]
        for w in works:
            w.wait()
        return states

    assert on_nccl(body, 2) == [["started"] * 4] * 2


def test_nccl_over_mpi_as_host_engine(mpirun):
    """A real process: MPI carries the unique id, host arrays and objects (a world of one: the
    double's communicators cannot span processes)."""
    out = mpirun("mpi_nccl_double.py", 1).stdout
    lines = [line for line in out.splitlines() if " OK " in f" {line.split(': ', 1)[-1]} "]
    assert len(lines) == 1 and "checks on rank 0 of 1" in lines[0], out


@pytest.mark.parametrize("module", ["test_nccl", "test_nccl_strict"])
def test_a_broken_cupy_fails_the_checks_against_it_instead_of_skipping(monkeypatch, module):
    """Only a CuPy that is not installed skips the checks against the real module; one that is
    installed and fails to import (a broken wheel, missing NCCL bindings) fails them, so a broken
    CuPy in the cuda12 CI job cannot pass as "skipped"."""
    import test_nccl_strict

    real = _real_nccl if module == "test_nccl" else lambda: test_nccl_strict._real("nccl")
    monkeypatch.setitem(sys.modules, "cupy", None)  # not installed: find_spec says None
    with pytest.raises(pytest.skip.Exception, match="CuPy is not installed here"):
        real()
    broken = types.ModuleType("cupy")
    broken.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
    monkeypatch.setitem(sys.modules, "cupy", broken)
    monkeypatch.setitem(sys.modules, "cupy.cuda", None)  # installed, and `from cupy.cuda import nccl` fails
    with pytest.raises(ImportError):
        real()
