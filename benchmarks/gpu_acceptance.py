"""The GPU acceptance run: one check function per behaviour, each with its negative control.

**What has run on hardware:** the one-GPU checks, on an H200 (2026-11-30, NCCL 2.28.9, CuPy 14.2):
all passed, ``host_nonblocking_mpi`` before its warm-up call was added (not rerun since); the
checks that need two GPUs or more have run only against the strict double (``--dry-run-double``,
tests/doubles/nccl_double.py), where it can model them. On a GPU they run through
``bash benchmarks/gpu_check.sh`` (docs/gpus.md, "What ran on a real GPU").

Usage::

    python benchmarks/gpu_acceptance.py --point 2            # point 2's checks, on this machine's GPUs
    python benchmarks/gpu_acceptance.py --point all          # points 1-8 (the GPU tests/benchmarks: gpu_check.sh)
    python benchmarks/gpu_acceptance.py --point 8 --dry-run-double   # over the double, ranks as threads
    python benchmarks/gpu_acceptance.py --list               # checks, their point, ranks, double or not
    meshkit-run -n 2 benchmarks/gpu_acceptance.py --worker batch_two_groups   # one check's ranks, by hand

The driver never touches CUDA itself: each check runs in a worker process (``--worker NAME``;
a CUDA fault or a hang kills only that worker), one rank under plain ``python`` (MPI singleton)
or N ranks under ``python -m meshkit.launch -n N`` for multi-rank checks, which run only where
at least two GPUs are visible (else SKIP with the reason). Each rank of a worker prints one line
``ACCEPT {"check": ..., "rank": ..., "status": "PASS"|"FAIL"|"SKIP", "detail": ...}``; the
driver merges them (any FAIL fails the check, any SKIP leaves it unverified), prints one line per
check and one verdict line per point (``POINT n: PASS|FAIL|SKIP (reason)``), and appends the
records to ``--results FILE`` (JSON lines) for gpu_check.sh's final verdict.

A negative control is part of every check whose pass could be luck: the ordering checks run once
with the order removed and must then see stale data; the late-peer checks first show that the
peer's data really is not there yet; the nvidia-smi check first makes a context on a foreign GPU
on purpose and must see it. A negative control that does not show what it must fails the check
("the check cannot tell"), since its pass would prove nothing.

Everything goes through meshkit's public API and raw CuPy, except ONE seam (:class:`Seam`, in the
section "the one internal seam"): the CUDA runtime meshkit's NCCL engine uses is wrapped through
``meshkit.comm.engines.cuda_runtime.set_runtime`` so that the engine's communication stream can (a) skip
its wait on the caller's stream (the ordering-in negative control) and (b) get a long kernel in
front of its next operation (ordering out: the collective then completes long after it was
issued). Nothing else reaches inside meshkit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

REPO = Path(__file__).resolve().parents[1]
STATUSES = ("PASS", "FAIL", "SKIP")
#: Seconds a long kernel runs: long enough that no host-side scheduling noise (ms) can hide it.
LONG = 1.5
#: A host call that "returns at once" must return within this (an MPI/NCCL issue is ~10-100 us;
#: generous for a loaded machine, still far below LONG).
QUICK = 0.25
SENTINEL = -7.0


# =========================================================================== outcomes
def outcome(status: str, detail: str = "") -> dict[str, str]:
    if status not in STATUSES:
        raise ValueError(f"gpu_acceptance: invalid status {status!r}; valid: {list(STATUSES)}")
    return {"status": status, "detail": detail}


def PASS(detail: str = "") -> dict[str, str]:  # noqa: N802 (reads as the verdict it is)
    return outcome("PASS", detail)


def FAIL(detail: str) -> dict[str, str]:  # noqa: N802
    return outcome("FAIL", detail)


def SKIP(reason: str) -> dict[str, str]:  # noqa: N802
    return outcome("SKIP", reason)


def merge(results: list[dict[str, str]]) -> dict[str, str]:
    """One outcome from several (ranks, or sub-checks): any FAIL fails, else any SKIP leaves it
    unverified, else PASS; the details of the deciding ones are kept."""
    for status in ("FAIL", "SKIP", "PASS"):
        chosen = [r for r in results if r["status"] == status]
        if chosen:
            details = list(dict.fromkeys(r["detail"] for r in chosen if r["detail"]))
            return outcome(status, "; ".join(details))
    return SKIP("nothing ran")


# =========================================================================== the GPU, real or the double
class RealGpu:
    """Raw CuPy: device arrays, ordered and unordered reads, long kernels."""

    name = "cuda"

    def __init__(self) -> None:
        import cupy

        self.cp = cupy
        self._spin = cupy.RawKernel(r"""
        extern "C" __global__ void spin(unsigned long long ns) {   // sleep on the GPU for ns nanoseconds
            unsigned long long start, now;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
            do { __nanosleep(100000); asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); }
            while (now - start < ns);
        }""", "spin")
        self._warm: set[int] = set()  # devices where the spin kernel was launched once
        self._fault = cupy.RawKernel(r"""
        extern "C" __global__ void fault(int v) { *((volatile int*)0x8) = v; }   // cudaErrorIllegalAddress
        """, "fault")

    def runtime(self) -> Any:
        from meshkit.comm.engines.cuda_runtime import CupyRuntime
        return CupyRuntime()

    @property
    def nccl(self) -> Any:
        from cupy.cuda import nccl
        return nccl

    def to_device(self, a: np.ndarray) -> Any:
        return self.cp.asarray(a)

    def zeros(self, n: int, dtype: Any = np.float32) -> Any:
        return self.cp.zeros(n, dtype)

    def read(self, x: Any) -> np.ndarray:
        """A host copy ordered after the calling thread's current stream (``cupy.asnumpy``)."""
        return self.cp.asnumpy(x)

    def peek(self, x: Any) -> np.ndarray:
        """A host copy of what ``x`` holds now, ordered after nothing (a fresh non-blocking stream)."""
        stream = self.cp.cuda.Stream(non_blocking=True)
        out = x.get(stream=stream)
        stream.synchronize()
        return out

    def spin_on(self, stream: Any, seconds: float) -> None:
        with stream:  # RawKernel launches on the current stream
            device = self.cp.cuda.Device().id
            if device not in self._warm:
                # Its first launch loads the module (and compiles it): done before any timed launch.
                self._spin((1,), (1,), (np.uint64(0),))
                stream.synchronize()
                self._warm.add(device)
            self._spin((1,), (1,), (np.uint64(int(seconds * 1e9)),))

    def fill_later(self, x: Any, value: float, seconds: float) -> None:
        """On the current stream: a kernel that runs ``seconds``, then ``x[...] = value``; the host does not wait."""
        # CuPy loads its fill kernel for x's dtype at the first fill, and loading a module while the
        # spin runs waited for the spin (seen on an H200: the first fill after a 3 s spin took 3 s, so
        # the timed calls after it found the kernel done): load it first, on a scratch array like x.
        self.cp.empty_like(x).fill(value)
        self.cp.cuda.get_current_stream().synchronize()
        self.spin_on(self.cp.cuda.get_current_stream(), seconds)
        x.fill(value)

    def fault(self) -> None:
        self._fault((1,), (1,), (np.int32(1),))

    def new_event(self) -> Any:
        return self.cp.cuda.Event(disable_timing=True)

    def device_of(self, x: Any) -> int:
        return int(x.device.id)

    def stream_class(self) -> type:
        return self.cp.cuda.Stream

    def raw_comm(self) -> Any:
        """A one-rank NcclCommunicator of its own (the negative controls' and commSplit's)."""
        nccl = self.nccl
        return nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)

    def pointer(self, x: Any) -> int:
        return int(x.data.ptr)

    def current_stream_ptr(self) -> int:
        return int(self.cp.cuda.get_current_stream().ptr)

    def synchronize(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()

    def bus_id(self) -> str:
        return str(self.cp.cuda.Device().pci_bus_id)


class DoubleGpu:
    """The strict double of tests/doubles/nccl_double.py, with the same interface (ranks are threads)."""

    name = "double"

    def __init__(self) -> None:
        sys.path.insert(0, str(REPO / "tests"))
        from doubles import nccl_double

        self.d = nccl_double
        self.nccl = nccl_double.fake_nccl

    def runtime(self) -> Any:
        return self.d.FakeRuntime()

    def to_device(self, a: np.ndarray) -> Any:
        return self.d.to_device(a)

    def zeros(self, n: int, dtype: Any = np.float32) -> Any:
        return self.d.to_device(np.zeros(n, dtype))

    def read(self, x: Any) -> np.ndarray:
        return self.d.to_host(x)

    def peek(self, x: Any) -> np.ndarray:
        return np.array(x.view(np.ndarray))

    def _later(self, stream: Any, seconds: float) -> Any:
        gate = self.d.Gate(stream)

        def open_gate() -> None:
            gate.open()
            with self.d._cond:  # the double performs what became ready when someone looks: look now
                self.d._progress()
        timer = threading.Timer(seconds, open_gate)
        timer.daemon = True
        timer.start()
        return gate

    def spin_on(self, stream: Any, seconds: float) -> None:
        self._later(stream, seconds)

    def fill_later(self, x: Any, value: float, seconds: float) -> None:
        d = self.d
        stream = d._current()
        gate = self._later(stream, seconds)
        with d._cond:  # a device write queued behind the gate: what a kernel after a long one is
            copy = d._Copy([gate], np.full(x.size, value, x.dtype), x.view(np.ndarray).reshape(-1))
            stream.pending = [e for e in stream.pending if not e.done] + [copy]
            d._wrote(stream, x)

    def fault(self) -> None:
        raise NotImplementedError("the double models no CUDA fault")

    def new_event(self) -> Any:
        return self.d.FakeEvent()

    def device_of(self, x: Any) -> int:
        return int(x.device_id)

    def stream_class(self) -> type:
        d = self.d

        class Stream(d.FakeStream):
            def __init__(self) -> None:
                super().__init__(d._device())
                d._streams.add(self)
        return Stream

    def raw_comm(self) -> Any:
        return self.d.FakeCommunicator(1, os.urandom(128), 0)

    def pointer(self, x: Any) -> int:
        return int(x.data.ptr)

    def current_stream_ptr(self) -> int:
        return self.d._current().ptr

    def synchronize(self) -> None:
        self.d._current().synchronize()

    def bus_id(self) -> str:
        return f"double:{self.d._device()}"


# =========================================================================== the one internal seam
class Seam:
    """The runtime meshkit's NCCL engine uses, wrapped (``cuda_runtime.set_runtime``): every stream
    it creates (the communication streams) can skip its next waits on the caller's stream
    (``drop_waits``) or get a long kernel in front of its next operation (``delay``). This is
    the only place the acceptance run reaches inside meshkit."""

    def __init__(self, gpu: Any) -> None:
        self.gpu = gpu
        self.inner = gpu.runtime()
        self.drop_waits = False
        self.delay = 0.0  # seconds of a long kernel, once, at the next wait_event of a comm stream
        seam, base = self, gpu.stream_class()

        class CommStream(base):  # type: ignore[misc, valid-type]
            def wait_event(self, event: Any) -> None:
                if seam.delay:
                    seconds, seam.delay = seam.delay, 0.0
                    gpu.spin_on(self, seconds)
                if not seam.drop_waits:
                    super().wait_event(event)
        self._stream = CommStream

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def new_stream(self) -> Any:
        if self.gpu.name == "cuda":
            return self._stream(non_blocking=True)
        return self._stream()

    def __enter__(self) -> Seam:
        from meshkit.comm.engines import cuda_runtime
        self._previous = cuda_runtime.set_runtime(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        from meshkit.comm.engines import cuda_runtime
        cuda_runtime.set_runtime(self._previous)


# =========================================================================== helpers of the checks
def _init(timeout: float = 60.0) -> tuple[int, int]:
    import meshkit
    meshkit.init_process_group("nccl", timeout=timeout)
    return meshkit.get_rank(), meshkit.get_world_size()


def _destroy() -> None:
    import meshkit
    if meshkit.is_initialized():
        meshkit.destroy_process_group()


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.monotonic()
    value = fn()
    return value, time.monotonic() - start


def _same(a: np.ndarray, b: Any) -> bool:
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))


# =========================================================================== point 1: shutdown
def check_destroy_unpolled(gpu: Any, ctx: Context) -> dict[str, str]:
    """Point 1: async collectives whose done events fired but were never polled, then
    destroy_process_group and a second of life (the driver runs it 3 times): the job must not be
    torn down (the watchdog must not check a destroyed communicator). Negative control: on this CuPy a destroyed
    communicator's check_async_error really raises (else nothing here could fail)."""
    import meshkit
    if ctx.rank_hint == 0:
        comm = gpu.raw_comm()
        comm.destroy()
        try:
            comm.check_async_error()
            control = FAIL("negative control: check_async_error() on a destroyed communicator did not raise here, "
                           "so this check cannot show the hazard")
        except Exception as exc:  # NcclError: the hazard exists on this CuPy
            control = PASS(f"destroyed communicator's check_async_error raises ({type(exc).__name__})")
    else:
        control = PASS()
    rank, n = _init()
    x = gpu.to_device(np.full(1 << 16, rank + 1.0, np.float32))
    for i in range(20):
        meshkit.all_reduce(x, async_op=True).wait()  # Work.wait orders the stream; nothing polls the event
        if i < 17:  # (the double's event chains grow exponentially with unsynchronized waits: keep them short)
            gpu.synchronize()
    gpu.synchronize()  # every done event has fired; the last ones at least were never polled
    _, took = _timed(meshkit.destroy_process_group)
    time.sleep(1.0)  # the watchdog's interval: a teardown would have ended this process by now
    return merge([control, PASS(f"20 async all_reduce, destroy_process_group in {took * 1e3:.0f} ms, no teardown")])


# =========================================================================== point 2: one NCCL group per batch
def check_batch_self_ordering(gpu: Any, ctx: Context) -> dict[str, str]:
    """Point 2 on one GPU: a batch_isend_irecv to oneself whose transfer sits behind a long kernel
    on the communication stream. Negative control: read without waiting, must see the sentinel;
    then Work.wait() and read: must see the data, after the host waited for the kernel."""
    import meshkit
    with Seam(gpu) as seam:
        rank, _ = _init()
        try:
            x = gpu.to_device(np.arange(1 << 16, dtype=np.float32) + rank)
            meshkit.batch_isend_irecv([meshkit.P2POp(meshkit.isend, x, rank),  # warm-up: connect
                                       meshkit.P2POp(meshkit.irecv, gpu.zeros(x.size), rank)])[1].wait()
            gpu.synchronize()
            results = []
            for waited in (False, True):
                y = gpu.to_device(np.full(x.size, SENTINEL, np.float32))
                seam.delay = LONG
                works = meshkit.batch_isend_irecv([meshkit.P2POp(meshkit.isend, x, rank),
                                                   meshkit.P2POp(meshkit.irecv, y, rank)])
                if not waited:
                    got = gpu.read(y)  # ordered after the caller's stream only, not the transfer
                    results.append(PASS() if (got == SENTINEL).all() else FAIL(
                        "negative control: without Work.wait() the received data was already there: the long "
                        "kernel did not delay the transfer, so this check cannot tell"))
                    for w in works:
                        w.wait()
                    gpu.synchronize()
                    continue
                for w in works:
                    w.wait()
                got, took = _timed(lambda: gpu.read(y))
                ok = _same(got, gpu.read(x))
                results.append(PASS(f"read after Work.wait() waited {took:.2f} s for the transfer") if ok
                               and took > LONG / 2 else FAIL(
                    f"after Work.wait() the read {'returned in %.3f s' % took} with "
                    f"{'the right data' if ok else 'stale data'}: Work.wait() did not order the batch's transfer"))
            return merge(results)
        finally:
            _destroy()


def check_batch_two_groups(gpu: Any, ctx: Context) -> dict[str, str]:
    """Point 2, the bug itself: one batch over two groups (the world and each rank's own
    one-rank group). Rank 1 comes late; rank 0 waits only on the world's works and reads: it must
    get rank 1's data (the world's done event covers the transfer). Negative control: right after
    the batch, before any wait, the data is not there (rank 1 has not sent)."""
    import meshkit
    rank, n = _init()
    try:
        own = [meshkit.new_group([r]) for r in range(n)][rank]
        right, left = (rank + 1) % n, (rank - 1) % n
        x = gpu.to_device(np.full(1 << 16, rank + 1.0, np.float32))
        a = gpu.to_device(np.full(16, 100.0 + rank, np.float32))

        def batch(y: Any, b: Any) -> list[Any]:
            return meshkit.batch_isend_irecv([
                meshkit.P2POp(meshkit.isend, x, right), meshkit.P2POp(meshkit.irecv, y, left),
                meshkit.P2POp(meshkit.isend, a, rank, group=own), meshkit.P2POp(meshkit.irecv, b, rank, group=own)])

        for w in batch(gpu.zeros(x.size), gpu.zeros(a.size)):  # warm-up: connections made
            w.wait()
        gpu.synchronize()
        meshkit.barrier()
        y = gpu.to_device(np.full(x.size, SENTINEL, np.float32))
        b = gpu.to_device(np.full(a.size, SENTINEL, np.float32))
        late = rank == 1
        if late:
            time.sleep(LONG)
        works = batch(y, b)
        results = []
        if rank == 0:
            results.append(PASS() if (gpu.peek(y) == SENTINEL).all() else FAIL(
                "negative control: rank 1's data arrived before rank 1 sent it?"))
        works[0].wait()
        works[1].wait()  # the world's works only
        got = gpu.read(y)
        if not (got == left + 1.0).all():
            results.append(FAIL(f"rank {rank}: after Work.wait() of the world's works the received buffer held "
                                f"{np.unique(got)[:4]} (expected {left + 1.0}): the world's done event did not cover "
                                "the transfer (two NCCL groups in one batch?)"))
        for w in works[2:]:
            w.wait()
        if not (gpu.read(b) == 100.0 + rank).all():
            results.append(FAIL(f"rank {rank}: the one-rank group's exchange gave {np.unique(gpu.read(b))[:4]}"))
        return merge(results or [PASS()])
    finally:
        _destroy()


# =========================================================================== point 3: devices on every thread
def check_agent_thread_devices(gpu: Any, ctx: Context) -> dict[str, str]:
    """Point 3: on rank r (GPU r), the list copy-out of an async all_gather (progress agent) and an
    allocation inside a run_async task (communication thread) land on GPU r with the right data."""
    import meshkit
    rank, n = _init()
    try:
        outs = [gpu.zeros(4) for _ in range(n)]
        w = meshkit.all_gather(outs, gpu.to_device(np.full(4, rank, np.float32)), async_op=True)
        w.wait()
        got = [gpu.read(o)[0] for o in outs]
        devices = {gpu.device_of(o) for o in outs}
        made: list[Any] = []
        group = meshkit.comm._seams.current_world().default_group

        def task() -> None:
            z = gpu.to_device(np.full(4, 1.0, np.float32))
            meshkit.all_reduce(z, group=group)
            made.append(z)
        group.run_async(task, "acceptance").wait()
        results = []
        if got != [float(r) for r in range(n)]:
            results.append(FAIL(f"rank {rank}: all_gather's rows {got}"))
        mine = gpu.device_of(outs[0])
        if devices != {mine} or gpu.device_of(made[0]) != mine:
            results.append(FAIL(f"rank {rank}: arrays on devices {sorted(devices)} and {gpu.device_of(made[0])}, "
                                f"the rank's device is {mine}"))
        if not (gpu.read(made[0]) == n).all():
            results.append(FAIL(f"rank {rank}: run_async task's all_reduce gave {gpu.read(made[0])}"))
        ctx.report_context(gpu)
        return merge(results or [PASS(f"rank {rank} on device {mine}")])
    finally:
        _destroy()


def check_thread_without_device(gpu: Any, ctx: Context) -> dict[str, str]:
    """Point 3's negative control for the nvidia-smi check (one process, GPU 1 current on the
    main thread): a helper thread that allocates without selecting a device makes a context on
    GPU 0, and the driver's nvidia-smi look must find this process there."""
    gpu.cp.cuda.Device(1).use()
    gpu.cp.zeros(1)
    t = threading.Thread(target=lambda: gpu.cp.zeros(1))
    t.start()
    t.join()
    ctx.report_context(gpu, devices=(0, 1))
    return PASS()


# =========================================================================== point 4: device selection
def check_device_per_task(gpu: Any, ctx: Context) -> dict[str, str]:
    """Point 4: one visible GPU per rank (CUDA_VISIBLE_DEVICES set per task, as Slurm's
    --gpus-per-task=1; the worker sets it from its launcher rank before CuPy loads): init and an
    all_reduce work, and the ranks are on different GPUs."""
    import meshkit
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    try:
        rank, n = _init()
    except Exception as exc:  # today's main refuses: "host runs 2 ranks but sees 1 GPUs"
        return FAIL(f"init with CUDA_VISIBLE_DEVICES={visible!r} per rank: {type(exc).__name__}: {exc}")
    try:
        x = gpu.to_device(np.full(8, rank + 1.0, np.float32))
        meshkit.all_reduce(x)
        buses: list[Any] = [None] * n
        meshkit.all_gather_object(buses, gpu.bus_id())
        if not (gpu.read(x) == n * (n + 1) / 2).all():
            return FAIL(f"rank {rank}: all_reduce gave {gpu.read(x)[:2]}")
        if len(set(buses)) != n:
            return FAIL(f"ranks on GPUs {buses}: two ranks share one")
        return PASS(f"rank {rank} sees only {visible!r}, on {buses[rank]}")
    finally:
        _destroy()


def check_shared_gpu(gpu: Any, ctx: Context) -> dict[str, str]:
    """Point 4: two ranks that see the same single GPU. NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1
    allows it (then an all_reduce must be right); otherwise every rank must get a meshkit error
    (DistBackendError), not a raw NCCL error and not a hang."""
    import meshkit
    version = int(gpu.nccl.get_version())
    allowed = version >= 23000 and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1"
    try:
        rank, n = _init(timeout=30)
    except meshkit.DistBackendError as exc:
        return (FAIL(f"NCCL {version} allows ranks sharing a GPU, but init failed: {exc}") if allowed
                else PASS(f"refused with a meshkit error: {str(exc)[:160]}"))
    except Exception as exc:  # a raw NcclError or anything else: not a clear error
        return FAIL(f"init of ranks sharing a GPU raised {type(exc).__name__} (not a meshkit error): {exc}")
    try:
        if not allowed:
            return FAIL(f"NCCL {version} (NCCL_MULTI_RANK_GPU_ENABLE={os.environ.get('NCCL_MULTI_RANK_GPU_ENABLE')}) "
                        "should refuse ranks sharing a GPU, yet init succeeded")
        x = gpu.to_device(np.full(8, rank + 1.0, np.float32))
        meshkit.all_reduce(x)
        return PASS(f"NCCL {version} shares the GPU; all_reduce right") if (gpu.read(x) == n * (n + 1) / 2).all() \
            else FAIL(f"rank {rank}: all_reduce on a shared GPU gave {gpu.read(x)[:2]}")
    finally:
        _destroy()


# =========================================================================== point 5: blocking calls
def check_late_first_collective(gpu: Any, ctx: Context) -> dict[str, str]:
    """Point 5: rank 1 comes LONG seconds late to the communicator's first collective (NCCL's
    runtime connection blocks the host inside the first call): the result must be right, the
    call must complete within the group's timeout; how long the host blocked at issue is reported."""
    import meshkit
    rank, n = _init(timeout=30)
    try:
        x = gpu.to_device(np.full(1 << 10, rank + 1.0, np.float32))
        if rank == 1:
            time.sleep(2 * LONG)
        work, issued = _timed(lambda: meshkit.all_reduce(x, async_op=True))
        _, waited = _timed(work.wait)
        got = gpu.read(x)
        connect = os.environ.get("NCCL_RUNTIME_CONNECT", "default")
        if not (got == n * (n + 1) / 2).all():
            return FAIL(f"rank {rank}: first all_reduce gave {got[:2]}")
        return PASS(f"rank {rank}: NCCL_RUNTIME_CONNECT={connect}: the first call's issue blocked the host "
                    f"{issued:.2f} s, Work.wait {waited:.2f} s (peer {2 * LONG:.1f} s late)")
    finally:
        _destroy()


def check_hung_peer(gpu: Any, ctx: Context) -> dict[str, str]:
    """Point 5: after a warm-up, rank 1 stops calling. Rank 0's all_reduce must end in a
    CollectiveTimeout naming rank 1 within about the timeout and saying the communicator was
    aborted, and the group must refuse the next call. Negative control: the same peer late by less than the timeout
    causes no timeout."""
    import meshkit
    timeout = 4.0
    rank, n = _init(timeout=timeout)
    results = []
    try:
        x = gpu.to_device(np.ones(1024, np.float32))
        meshkit.all_reduce(x)  # warm-up: connected
        if rank == 1:
            time.sleep(timeout / 4)
        try:
            meshkit.all_reduce(x)
            results.append(PASS())
        except Exception as exc:
            results.append(FAIL(f"negative control: a peer {timeout / 4:.0f} s late (timeout {timeout:.0f} s) "
                                f"made rank {rank} raise {type(exc).__name__}: {exc}"))
        if rank == 1:
            time.sleep(3 * timeout)  # hung: never calls again
            return merge(results or [PASS()])
        start = time.monotonic()
        try:
            meshkit.all_reduce(x)
            return FAIL(f"rank {rank}: all_reduce with rank 1 hung completed")
        except meshkit.CollectiveTimeout as exc:
            took = time.monotonic() - start
            if 1 not in (exc.missing or []) or took > 2.5 * timeout:
                results.append(FAIL(f"rank {rank}: timeout after {took:.1f} s naming {exc.missing}: {exc}"))
            elif "abort" not in str(exc).lower():
                results.append(FAIL(f"rank {rank}: the timeout does not say the communicator was aborted: {exc}"))
            else:
                results.append(PASS(f"CollectiveTimeout after {took:.1f} s naming ranks {exc.missing}, "
                                    "communicator aborted"))
        except meshkit.DistError as exc:  # a rank other than the first to time out hears of it from that rank
            if rank == 0:
                results.append(FAIL(f"rank 0: {type(exc).__name__} instead of a CollectiveTimeout: {exc}"))
        try:
            meshkit.all_reduce(x)
            results.append(FAIL(f"rank {rank}: the group still accepted a collective after the timeout"))
        except meshkit.DistError:
            pass  # a broken group refuses every later call
        return merge(results)
    finally:
        try:
            _destroy()
        except Exception:  # a broken group's teardown may report the break again: not what is checked
            pass


# =========================================================================== point 6: errors
def check_cuda_fault(gpu: Any, ctx: Context) -> dict[str, str]:
    """Point 6: a kernel queued behind a long one faults (illegal address) while an all_reduce
    ordered after it waits: the call must raise naming the CUDA error within the timeout, not a
    collective timeout. Negative control: an event recorded after the faulting kernel never
    completes (else the kernel did not fault and nothing was tested)."""
    import meshkit
    if gpu.name != "cuda":
        return SKIP("the double models no CUDA fault")
    _init(timeout=10)
    x = gpu.to_device(np.ones(8, np.float32))
    meshkit.all_reduce(x)  # warm-up: the call below does not block in NCCL's connection
    gpu.spin_on(gpu.cp.cuda.get_current_stream(), LONG)  # the fault happens after the call was issued
    gpu.fault()
    event = gpu.new_event()
    event.record()
    results = []
    start = time.monotonic()
    try:
        meshkit.all_reduce(x)
        results.append(FAIL("all_reduce ordered after a faulting kernel returned"))
    except meshkit.CollectiveTimeout as exc:
        results.append(FAIL(f"the CUDA fault read as a timeout after {time.monotonic() - start:.1f} s: {exc}"))
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
        named = re.search(r"illegal|cudaError|CUDA_ERROR", text, re.IGNORECASE)
        results.append(PASS(f"raised in {time.monotonic() - start:.1f} s: {text[:160]}") if named else FAIL(
            f"the error does not name the CUDA fault: {text[:300]}"))
    try:
        done = bool(event.done)
    except Exception:  # CuPy raising the fault here is as good: the event did not complete
        done = False
    if done:
        results.append(FAIL("negative control: the event after the faulting kernel completed: no fault happened"))
    ctx.emit(merge(results))
    os._exit(0)  # the context is dead: leave without CUDA teardown (its own hang is not this check)


def check_nccl_version_split(gpu: Any, ctx: Context) -> dict[str, str]:
    """Point 6: the NCCL runtime version, and a real commSplit (needs 2.18) of a raw one-rank
    communicator with an all_reduce on the child; at two ranks or more, meshkit's new_group too."""
    import meshkit
    nccl = gpu.nccl
    version = int(nccl.get_version())
    if version < 21800:
        return SKIP(f"NCCL {version} has no commSplit: meshkit must refuse sub-groups (tested on CPU)")
    comm = gpu.raw_comm()
    child = comm.commSplit(0, 0)
    x = gpu.to_device(np.full(8, 3.0, np.float32))
    p = gpu.pointer(x)
    child.allReduce(p, p, 8, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, gpu.current_stream_ptr())
    got = gpu.read(x)
    child.destroy()
    comm.destroy()
    if not (got == 3.0).all():
        return FAIL(f"all_reduce on a raw commSplit child gave {got[:2]}")
    detail = f"NCCL runtime {version}: raw commSplit + all_reduce right"
    rank, n = _init()
    try:
        if n >= 2:
            g = meshkit.new_group(list(range(n - 1)))  # a real split: the world minus its last rank
            y = gpu.to_device(np.full(8, rank + 1.0, np.float32))
            if rank < n - 1:
                meshkit.all_reduce(y, group=g)
                want = (n - 1) * n / 2
                if not (gpu.read(y) == want).all():
                    return FAIL(f"rank {rank}: all_reduce over new_group gave {gpu.read(y)[:2]}, want {want}")
            detail += f"; meshkit new_group of {n - 1} ranks right"
        return PASS(detail)
    finally:
        _destroy()


def check_exit_without_destroy(gpu: Any, ctx: Context) -> dict[str, str]:
    """Point 6: a script that never calls destroy_process_group, with async work done, must exit
    (the driver gives it 60 s and checks exit status 0)."""
    import meshkit
    rank, n = _init()
    x = gpu.to_device(np.ones(1 << 16, np.float32))
    meshkit.all_reduce(x, async_op=True).wait()
    meshkit.all_reduce(x)
    ctx.emit(PASS("returned from the script without destroy_process_group"))
    sys.exit(0)


def check_exit_hang_control(gpu: Any, ctx: Context) -> dict[str, str]:
    """Point 6's negative control: a worker that hangs at exit must be reported as hung."""
    import atexit
    atexit.register(time.sleep, 3600)
    ctx.emit(PASS("about to hang at exit"))
    sys.exit(0)


# =========================================================================== point 7: semantics
def check_zero_size(gpu: Any, ctx: Context) -> dict[str, str]:
    """Point 7: count-0 collectives are no-ops (sync and async), and the communicator still
    agrees afterwards (a right all_reduce follows)."""
    import meshkit
    rank, n = _init()
    try:
        e = gpu.zeros(0)
        for async_op in (False, True):
            works = [meshkit.all_reduce(e, async_op=async_op), meshkit.broadcast(e, src=0, async_op=async_op),
                     meshkit.all_gather_into_tensor(gpu.zeros(0), e, async_op=async_op),
                     meshkit.reduce_scatter_tensor(gpu.zeros(0), gpu.zeros(0), async_op=async_op)]
            for w in works:
                if w is not None:
                    w.wait()
        x = gpu.to_device(np.full(8, rank + 1.0, np.float32))
        meshkit.all_reduce(x)
        ok = (gpu.read(x) == n * (n + 1) / 2).all()
        return PASS("count-0 all_reduce, broadcast, all_gather_into_tensor, reduce_scatter_tensor") if ok else FAIL(
            f"rank {rank}: all_reduce after count-0 calls gave {gpu.read(x)[:2]}")
    except Exception as exc:
        return FAIL(f"rank {rank}: a count-0 collective raised {type(exc).__name__}: {exc}")
    finally:
        _destroy()


def check_bfloat16(gpu: Any, ctx: Context) -> dict[str, str]:
    """Point 7: all_reduce(SUM) and broadcast of bfloat16 (ml_dtypes) device arrays."""
    import meshkit
    try:
        import ml_dtypes
    except ImportError:
        return SKIP("ml_dtypes is not installed (pip install ml_dtypes)")
    rank, n = _init()
    try:
        host = (np.arange(8) + rank).astype(ml_dtypes.bfloat16)
        try:
            x = gpu.to_device(host)
        except Exception as exc:
            return SKIP(f"this CuPy makes no bfloat16 array: {type(exc).__name__}: {exc}")
        meshkit.all_reduce(x)
        want = sum((np.arange(8) + r) for r in range(n)).astype(np.float32)
        got = gpu.read(x).astype(np.float32)
        if not np.array_equal(got, want):  # small integers: exact in bfloat16
            return FAIL(f"rank {rank}: bfloat16 all_reduce gave {got}, want {want}")
        return PASS(f"bfloat16 all_reduce at {n} ranks")
    except Exception as exc:
        return FAIL(f"rank {rank}: bfloat16 all_reduce raised {type(exc).__name__}: {exc}")
    finally:
        _destroy()


def check_one_rank_avg(gpu: Any, ctx: Context) -> dict[str, str]:
    """Point 7: AVG over a one-rank group is the input, whole: reduce_scatter_tensor out of place and
    all_reduce, float64/float32 of 4160 and 100003 elements. Negative control: raw NCCL before 2.29.7
    leaves the tail of a one-rank out-of-place ncclAvg unwritten (NVIDIA/nccl issue 1950; float64
    4160 -> 4158 written on an H200 with 2.28.9), which meshkit must not hand on."""
    import meshkit
    nccl = gpu.nccl
    version = nccl.get_version()
    control = "raw ncclAvg writes every element (NCCL >= 2.29.7: the control does not apply)"
    if version < 22907:
        comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
        src = gpu.to_device(np.arange(4160, dtype=np.float64) + 1)
        dst = gpu.to_device(np.full(4160, -7.0))
        stream = gpu.runtime().current_stream()
        comm.reduceScatter(src.data.ptr, dst.data.ptr, 4160, nccl.NCCL_FLOAT64, nccl.NCCL_AVG, stream.ptr)
        unwritten = int((gpu.read(dst) == -7.0).sum())
        comm.destroy()
        if unwritten == 0:
            return FAIL(f"negative control: NCCL {version}'s one-rank ncclAvg wrote all 4160 elements, "
                        "so this check cannot tell")
        control = f"raw NCCL {version} ncclAvg left {unwritten} of 4160 unwritten"
    rank, n = _init()
    try:
        if n != 1:
            return SKIP(f"a one-rank check, run at {n} ranks")
        for dtype in (np.float64, np.float32):
            for count in (4160, 100003):
                inp = gpu.to_device((np.arange(count) % 100 + 1).astype(dtype))
                out = gpu.to_device(np.full(count, -7, dtype))
                meshkit.reduce_scatter_tensor(out, inp, meshkit.ReduceOp.AVG)
                x = gpu.to_device((np.arange(count) % 100 + 1).astype(dtype))
                meshkit.all_reduce(x, meshkit.ReduceOp.AVG)
                want = gpu.read(inp)
                for what, got in (("reduce_scatter_tensor", gpu.read(out)), ("all_reduce", gpu.read(x))):
                    wrong = np.flatnonzero(got != want)
                    if wrong.size:
                        return FAIL(f"one-rank {what} AVG of {count} {np.dtype(dtype).name}: {wrong.size} elements "
                                    f"wrong, first at {wrong[0]} ({control})")
        return PASS(f"one-rank AVG whole ({control})")
    finally:
        _destroy()


def check_avg(gpu: Any, ctx: Context) -> dict[str, str]:
    """Point 7: ReduceOp.AVG of float32 and float16 (NCCL pre-multiplies by 1/n, in half precision
    for float16): within n ulps of the exact mean. (meshkit refuses AVG of integers, as torch's
    front end does, so NCCL's integer AVG is not reached.)"""
    import meshkit
    rank, n = _init()
    try:
        if n < 2:
            return SKIP("AVG over one rank is the identity")
        results = []
        for dtype in (np.float32, np.float16):
            values = np.linspace(0.1, 1.0, 64) * (rank + 1)
            x = gpu.to_device(values.astype(dtype))
            meshkit.all_reduce(x, op=meshkit.ReduceOp.AVG)
            exact = sum(np.linspace(0.1, 1.0, 64) * (r + 1) for r in range(n)) / n
            error = float(np.max(np.abs(gpu.read(x).astype(np.float64) - exact)))
            bound = n * float(np.finfo(dtype).eps) * float(np.max(np.abs(exact)))
            if error > bound:
                results.append(FAIL(f"{np.dtype(dtype).name} AVG off by {error:.2e} (bound {bound:.2e})"))
        return merge(results or [PASS(f"AVG of float32/float16 at {n} ranks")])
    finally:
        _destroy()


# =========================================================================== point 8: ordering, host not blocked
def check_ordering_in(gpu: Any, ctx: Context) -> dict[str, str]:
    """Point 8, ordering into the communication stream: a kernel still writing x when
    all_gather_into_tensor(out, x) is called; out must hold what the kernel wrote. Negative
    control: the same with the communication stream's wait on the caller removed must read the
    stale x (or the double refuses the unordered stream)."""
    import meshkit
    with Seam(gpu) as seam:
        rank, n = _init()
        try:
            results = []
            for ordered in (True, False):  # the control last: over the double its refusal breaks the group
                x = gpu.to_device(np.zeros(1 << 16, np.float32))
                out = gpu.zeros(x.size * n)
                gpu.fill_later(x, rank + 1.0, LONG)
                seam.drop_waits = not ordered
                try:
                    meshkit.all_gather_into_tensor(out, x)
                except Exception as exc:
                    if ordered:
                        raise
                    results.append(PASS(f"(unordered stream refused: {str(exc)[:80]})"))
                    break  # the double refuses at once; a group broken by it cannot go on
                finally:
                    seam.drop_waits = False
                got = gpu.read(out)[::x.size]
                fresh = _same(got, np.arange(1, n + 1, dtype=np.float32))
                if not ordered:
                    results.append(FAIL("negative control: with the stream wait removed the collective still saw "
                                        "the kernel's writes, so this check cannot tell") if fresh else PASS())
                else:
                    results.append(PASS("the collective saw the writes of a kernel still running when it was called")
                                   if fresh else FAIL(f"rank {rank}: the collective read stale data {got}"))
            return merge(results)
        finally:
            _destroy()


def check_ordering_out(gpu: Any, ctx: Context) -> dict[str, str]:
    """Point 8, ordering out of the communication stream: the collective runs behind a long
    kernel on the communication stream; after Work.wait() a read on the caller's stream must see
    its result (and wait for it). Negative control: the same read without Work.wait() sees the
    old contents."""
    import meshkit
    with Seam(gpu) as seam:
        rank, n = _init()
        try:
            results = []
            x = gpu.to_device(np.full(1 << 16, rank + 1.0, np.float32))
            for waited in (False, True):
                out = gpu.to_device(np.full(x.size * n, SENTINEL, np.float32))
                seam.delay = LONG
                work = meshkit.all_gather_into_tensor(out, x, async_op=True)
                if waited:
                    _, took = _timed(work.wait)
                got, read_took = _timed(lambda: gpu.read(out)[::x.size])
                fresh = _same(got, np.arange(1, n + 1, dtype=np.float32))
                if not waited:
                    results.append(PASS() if not fresh else FAIL(
                        "negative control: without Work.wait() the result was already there, so this check "
                        "cannot tell"))
                    work.wait()
                    gpu.synchronize()
                elif not fresh:
                    results.append(FAIL(f"rank {rank}: after Work.wait() the caller's stream read {got}"))
                elif took > QUICK:
                    results.append(FAIL(f"rank {rank}: Work.wait() blocked the host {took:.2f} s"))
                else:
                    results.append(PASS(f"Work.wait() took {took * 1e3:.1f} ms, the read then waited "
                                        f"{read_took:.2f} s for the collective"))
            return merge(results)
        finally:
            _destroy()


def _host_nonblocking(gpu: Any, backend: str) -> dict[str, str]:
    import meshkit
    meshkit.init_process_group(backend, timeout=60)
    try:
        rank, n = meshkit.get_rank(), meshkit.get_world_size()
        x = gpu.to_device(np.zeros(1 << 20, np.float32))
        # A first call of this size, untimed: the MPI engine's first staged call allocates its pinned
        # host buffers (its issue blocked 0.33-0.51 s on an H200 VM, behind no kernel); the check is
        # about the calls after it.
        _, first = _timed(lambda: meshkit.all_reduce(x, async_op=True).wait())
        gpu.fill_later(x, rank + 1.0, 2 * LONG)
        work, issued = _timed(lambda: meshkit.all_reduce(x, async_op=True))
        _, waited = _timed(work.wait)
        got, read = _timed(lambda: gpu.read(x))
        right = (got == n * (n + 1) / 2).all()
        if not right:
            return FAIL(f"{backend}: rank {rank}: async all_reduce behind a long kernel gave {got[:2]}")
        if issued + waited + read < LONG:  # negative control: the kernel really ran that long
            return FAIL(f"{backend}: negative control: issue+wait+read took {issued + waited + read:.2f} s, less "
                        f"than the {2 * LONG:.1f} s kernel, so this check cannot tell")
        if issued > QUICK:
            return FAIL(f"{backend}: all_reduce(async_op=True) blocked the host {issued:.2f} s behind a "
                        f"{2 * LONG:.1f} s kernel")
        if backend == "nccl" and waited > QUICK:
            return FAIL(f"nccl: Work.wait() blocked the host {waited:.2f} s")
        return PASS(f"{backend}: issue {issued * 1e3:.1f} ms, wait {waited * 1e3:.1f} ms, read {read:.2f} s "
                    f"(a first call of the size before: {first * 1e3:.0f} ms)")
    finally:
        _destroy()


def check_host_nonblocking(gpu: Any, ctx: Context) -> dict[str, str]:
    """Point 8: all_reduce(x, async_op=True) and Work.wait() return while a long kernel writing
    x still runs; the result is right. Negative control: the read after them did wait for the kernel."""
    return _host_nonblocking(gpu, "nccl")


def check_host_nonblocking_mpi(gpu: Any, ctx: Context) -> dict[str, str]:
    """Point 8 for the MPI engine on device arrays (staged or CUDA-aware): the async issue must
    not wait for the long kernel (Work.wait may: MPI needs the data)."""
    if gpu.name != "cuda":
        return SKIP("the MPI engine on device arrays is tested over the double by tests/test_mpi_device.py")
    return _host_nonblocking(gpu, "mpi")


# =========================================================================== the checks and how they run
@dataclass(frozen=True)
class Check:
    point: int
    fn: Callable[[Any, Any], dict[str, str]]
    ranks: str  # "1": one rank; "multi": one rank per GPU, >= 2 GPUs; "shared": 2 ranks on GPU 0
    double: bool  # meaningful over the double (--dry-run-double)
    env: tuple[tuple[str, str], ...] = ()
    expect_exit: str = "0"  # "0": the worker must exit 0; "hang": must be killed at the limit
    limit: float = 180.0
    repeat: int = 1  # workers run one after the other (a race caught by luck once is still caught)


CHECKS: dict[str, Check] = {
    "destroy_unpolled": Check(1, check_destroy_unpolled, "1", True, repeat=3),
    "destroy_unpolled_multi": Check(1, check_destroy_unpolled, "multi", True, repeat=3),
    "batch_self_ordering": Check(2, check_batch_self_ordering, "1", True),
    "batch_two_groups": Check(2, check_batch_two_groups, "multi", True),
    "agent_thread_devices": Check(3, check_agent_thread_devices, "multi", True),
    "foreign_context_control": Check(3, check_thread_without_device, "1", False),
    "device_per_task": Check(4, check_device_per_task, "multi", False, (("MESHKIT_ACCEPT_VISIBLE_PER_RANK", "1"),)),
    "shared_gpu": Check(4, check_shared_gpu, "shared", False, (("CUDA_VISIBLE_DEVICES", "0"),), limit=120),
    "shared_gpu_enabled": Check(4, check_shared_gpu, "shared", False,
                                (("CUDA_VISIBLE_DEVICES", "0"), ("NCCL_MULTI_RANK_GPU_ENABLE", "1")), limit=120),
    "late_first_collective": Check(5, check_late_first_collective, "multi", True),
    "late_first_collective_connect0": Check(5, check_late_first_collective, "multi", False,
                                            (("NCCL_RUNTIME_CONNECT", "0"),)),
    "hung_peer": Check(5, check_hung_peer, "multi", True, limit=120),
    "cuda_fault": Check(6, check_cuda_fault, "1", False, limit=90),
    "nccl_version_split": Check(6, check_nccl_version_split, "1", False),
    "nccl_version_split_multi": Check(6, check_nccl_version_split, "multi", False),
    "exit_without_destroy": Check(6, check_exit_without_destroy, "1", False, limit=60),
    "exit_hang_control": Check(6, check_exit_hang_control, "1", False, expect_exit="hang", limit=20),
    "zero_size": Check(7, check_zero_size, "1", True),
    "zero_size_multi": Check(7, check_zero_size, "multi", True),
    "bfloat16": Check(7, check_bfloat16, "1", True),
    "bfloat16_multi": Check(7, check_bfloat16, "multi", True),
    "avg": Check(7, check_avg, "multi", True),
    "one_rank_avg": Check(7, check_one_rank_avg, "1", False),
    "ordering_in": Check(8, check_ordering_in, "1", True),
    "ordering_out": Check(8, check_ordering_out, "1", True),
    "host_nonblocking": Check(8, check_host_nonblocking, "1", True),
    "host_nonblocking_mpi": Check(8, check_host_nonblocking_mpi, "1", False, (("MESHKIT_CUDA_AWARE_MPI", "0"),)),
}
#: Ranks of a "multi" check over the double (threads on the double's GPUs).
DOUBLE_RANKS = 2


class Context:
    """What a check may ask of the worker around it: its rank (before init) and a way to report."""

    def __init__(self, check: str, rank_hint: int, lock: threading.Lock | None = None) -> None:
        self.check, self.rank_hint, self.lock = check, rank_hint, lock or threading.Lock()
        self.emitted = False

    def emit(self, result: dict[str, str]) -> None:
        with self.lock:
            print("ACCEPT " + json.dumps({"check": self.check, "rank": self.rank_hint, **result}), flush=True)
        self.emitted = True

    def report_context(self, gpu: Any, devices: tuple[int, ...] | None = None) -> None:
        """Print this process's pid and the bus ids it may use, for the driver's nvidia-smi look
        (done while the worker waits, since a context lives only as long as its process)."""
        if gpu.name != "cuda":
            return
        own = [gpu.bus_id()] if devices is None else [str(gpu.cp.cuda.Device(d).pci_bus_id) for d in devices]
        print("CONTEXT " + json.dumps({"rank": self.rank_hint, "pid": os.getpid(), "bus": own}), flush=True)
        barrier = os.environ.get("MESHKIT_ACCEPT_CONTEXT_FILE")
        if barrier:  # the driver writes the file once it has looked
            deadline = time.monotonic() + 30
            while not os.path.exists(barrier) and time.monotonic() < deadline:
                time.sleep(0.05)


def _launcher_rank() -> int:
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def worker(name: str, double: bool) -> int:
    """Run one check in this process (one rank of a job, or every rank as threads over the double)."""
    check = CHECKS[name]
    if double:
        from meshkit.comm.engines import cuda_runtime
        from meshkit.comm import local
        gpu = DoubleGpu()
        previous = cuda_runtime.set_runtime(gpu.runtime())
        n = DOUBLE_RANKS if check.ranks != "1" else 1
        try:
            results = local.run(lambda: _result(check, gpu, Context(name, _local_rank())), n, init=False,
                                timeout=120)
        finally:
            cuda_runtime.set_runtime(previous)
        for rank, result in enumerate(results):
            Context(name, rank).emit(result)
        return 0
    rank = _launcher_rank()
    if os.environ.get("MESHKIT_ACCEPT_VISIBLE_PER_RANK") == "1":  # one GPU per task, set before CuPy loads
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    ctx = Context(name, rank)
    result = _result(check, RealGpu(), ctx)
    if not ctx.emitted:
        ctx.emit(result)
    return 0


def _local_rank() -> int:
    """The rank of a thread of ``meshkit.comm.local.run`` (its thread is named after it)."""
    return int(threading.current_thread().name.rsplit("rank", 1)[-1])


def _result(check: Check, gpu: Any, ctx: Context) -> dict[str, str]:
    try:
        return check.fn(gpu, ctx)
    except Exception as exc:  # a check that breaks is a failed check, reported with its error
        import traceback
        traceback.print_exc()
        return FAIL(f"{type(exc).__name__}: {str(exc)[:300]}")


# =========================================================================== the driver
def gpu_count() -> int:
    """GPUs visible here, asked of a child process (the driver itself never initializes CUDA)."""
    code = "import cupy; print(cupy.cuda.runtime.getDeviceCount())"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        return int(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else 0
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return 0


def parse_worker_output(text: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The ACCEPT and CONTEXT records in a worker's output (launcher prefixes allowed)."""
    accepts, contexts = [], []
    for line in text.splitlines():
        m = re.search(r"\b(ACCEPT|CONTEXT) (\{.*\})\s*$", line)
        if m:
            (accepts if m.group(1) == "ACCEPT" else contexts).append(json.loads(m.group(2)))
    return accepts, contexts


def nvidia_smi_apps() -> list[tuple[int, str]] | None:
    """(pid, bus id) of each compute context nvidia-smi lists, or None if it cannot say."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    apps = []
    for line in proc.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            apps.append((int(parts[0]), parts[1]))
    return apps


def _bus(b: str) -> str:
    """Bus ids as nvidia-smi ("00000000:1B:00.0") and CUDA ("0000:1B:00.0") write them, compared."""
    domain, _, rest = b.strip().upper().partition(":")
    return f"{int(domain, 16):x}:{rest}" if rest else b.upper()


def judge_contexts(contexts: list[dict[str, Any]], apps: list[tuple[int, str]] | None,
                   control: bool) -> dict[str, str]:
    """nvidia-smi's view of the workers' contexts: each rank's pid only on its own GPU (or, for
    the negative control, the control's pid on GPU 0 too)."""
    if apps is None:
        return SKIP("nvidia-smi --query-compute-apps gave no answer")
    on: dict[int, set[str]] = {}
    for pid, bus in apps:
        on.setdefault(pid, set()).add(_bus(bus))
    if control:
        c = contexts[0]
        if _bus(c["bus"][0]) in on.get(c["pid"], set()):
            return PASS("nvidia-smi sees the context a device-less thread made on GPU 0")
        return SKIP("negative control: nvidia-smi did not list the context a thread made on GPU 0 (a PID "
                    f"namespace?); it listed {apps}: it cannot show foreign contexts here")
    bad = [f"rank {c['rank']} (pid {c['pid']}) has contexts on {sorted(on.get(c['pid'], set()))}, "
           f"its GPU is {_bus(c['bus'][0])}" for c in contexts if on.get(c["pid"], set()) - {_bus(c["bus"][0])}]
    missing = [c["rank"] for c in contexts if c["pid"] not in on]
    if bad:
        return FAIL("; ".join(bad))
    if missing:
        return SKIP(f"nvidia-smi does not list ranks {missing}' processes")
    return PASS(f"nvidia-smi: {len(contexts)} ranks, each only on its own GPU")


def run_check(name: str, *, double: bool, gpus: int, python: str = sys.executable) -> dict[str, Any]:
    """Run check ``name`` in ``repeat`` workers, one after the other; the merged record
    ``{check, point, status, detail, log}``."""
    runs = [_run_worker(name, double=double, gpus=gpus, python=python) for _ in range(CHECKS[name].repeat)]
    record = {**runs[0], **merge(runs)}
    record["log"] = "\n".join(r.get("log", "") for r in runs)[-8000:]
    return record


def _run_worker(name: str, *, double: bool, gpus: int, python: str) -> dict[str, Any]:
    check = CHECKS[name]
    record = {"check": name, "point": check.point}
    if double and not check.double:
        return {**record, **SKIP("not meaningful over the double (needs the hardware)")}
    if not double:
        if gpus < 1:
            return {**record, **SKIP("no GPU visible")}
        if check.ranks == "multi" and gpus < 2:
            return {**record, **SKIP(f"needs >= 2 GPUs, {gpus} visible")}
        if check.ranks == "1" and name == "foreign_context_control" and gpus < 2:
            return {**record, **SKIP(f"needs >= 2 GPUs, {gpus} visible")}
    script = str(Path(__file__).resolve())
    argv = [script, "--worker", name] + (["--double"] if double else [])
    n = 1 if double or check.ranks == "1" else (2 if check.ranks == "shared" else min(gpus, 8))
    if n > 1:
        command = [python, "-m", "meshkit.launch", "-n", str(n), "--timeout", str(int(check.limit)), *argv]
    else:
        command = [python, *argv]
    env = {**os.environ, **dict(check.env), "PYTHONUNBUFFERED": "1"}
    context_file = None
    watching = name in ("agent_thread_devices", "foreign_context_control") and not double
    if watching:
        context_file = f"/tmp/meshkit-accept-{os.getpid()}-{name}"
        env["MESHKIT_ACCEPT_CONTEXT_FILE"] = context_file
    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # killed as a group: the launcher's ranks too
    lines: list[str] = []
    looked: dict[str, str] | None = None
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        while proc.poll() is None and time.monotonic() - start < check.limit:
            if watching and looked is None:
                _, contexts = parse_worker_output("".join(lines))
                if len(contexts) == n:
                    looked = judge_contexts(contexts, nvidia_smi_apps(), name == "foreign_context_control")
                    Path(context_file).touch()  # type: ignore[arg-type]
            time.sleep(0.05)
        hung = proc.poll() is None
        if hung:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if context_file and os.path.exists(context_file):
            os.unlink(context_file)
    reader.join(5)
    text = "".join(lines)
    took = time.monotonic() - start
    accepts, _ = parse_worker_output(text)
    if check.expect_exit == "hang":
        result = PASS(f"a worker hung at exit was killed after {took:.0f} s") if hung else FAIL(
            f"negative control: a worker meant to hang at exit ended (exit {proc.returncode})")
    elif hung:
        result = FAIL(f"hung: killed after {check.limit:.0f} s" + (f" ({merge(accepts)['detail']})"
                                                                     if accepts else ""))
    elif proc.returncode != 0:
        tail = " | ".join(text.strip().splitlines()[-3:])
        result = FAIL(f"worker exited {proc.returncode}: {tail[-400:]}")
    elif len(accepts) < n:
        result = FAIL(f"{len(accepts)} of {n} ranks reported a result")
    else:
        result = merge(accepts)
    if looked is not None:
        result = merge([result, looked])
    elif watching and result["status"] == "PASS":
        result = merge([result, SKIP("the ranks' contexts were not seen in time for nvidia-smi")])
    record.update(result)
    record["log"] = text[-4000:]
    return record


def point_verdicts(records: list[dict[str, Any]], points: list[int]) -> list[str]:
    """One line per point: PASS (every check passed), FAIL (any failed), SKIP (reasons: some not run)."""
    lines = []
    for p in points:
        mine = [r for r in records if int(r["point"]) == p]
        if not mine:
            lines.append(f"POINT {p}: SKIP (no check ran)")
            continue
        verdict = merge(mine)
        if verdict["status"] == "PASS":
            lines.append(f"POINT {p}: PASS ({len(mine)} checks)")
        else:
            why = "; ".join(f"{r.get('check', '?')}: {r['detail']}" for r in mine if r["status"] == verdict["status"])
            lines.append(f"POINT {p}: {verdict['status']} ({why})")
    return lines


def final_line(records: list[dict[str, Any]], points: list[int]) -> str:
    verdicts = {p: merge([r for r in records if int(r["point"]) == p] or [SKIP("no check ran")])["status"]
                for p in points}
    failed = [p for p, s in verdicts.items() if s == "FAIL"]
    unverified = [p for p, s in verdicts.items() if s == "SKIP"]
    passed = [p for p, s in verdicts.items() if s == "PASS"]
    if failed:
        return f"VERDICT: FAIL (points {failed} failed; {unverified or 'none'} not verified)"
    if unverified:
        return f"VERDICT: NOT VERIFIED (points {unverified} not verified; {passed or 'none'} passed)"
    return f"VERDICT: PASS (points {points} verified on this machine)"


# =========================================================================== the GPU tests' pytest outcome
def pytest_outcome(output: str, rc: int) -> dict[str, str]:
    """PASS / FAIL / SKIP (reason) of one pytest run from its output (run with ``-rs``) and exit
    status: a file whose every test skipped verified nothing, so it is SKIP with the reasons
    pytest printed, never "ok"; none collected (exit 5) is SKIP too."""
    summary = ""
    for line in output.splitlines()[::-1]:
        if re.match(r"^=*\s*(\d+ \w+|no tests ran)", line.strip("= ").strip()) and (" in " in line):
            summary = line.strip("= ").strip()
            break
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)",
                                               summary)}
    failed = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    reasons = list(dict.fromkeys(m.strip() for m in re.findall(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", output, re.M)))
    if rc == 5 or (rc == 0 and not counts) or "no tests ran" in summary:
        return SKIP(f"no tests collected ({summary or 'no summary line'})")
    if failed or rc not in (0, 5):
        return FAIL(f"exit {rc}: {summary or 'no summary line'}")
    if counts.get("passed", 0) == 0 and counts.get("xpassed", 0) == 0 and counts.get("skipped", 0):
        return SKIP(f"all {counts.get('skipped', 0)} tests skipped: " + ("; ".join(reasons) or "no reason printed"))
    skipped = f", {counts['skipped']} skipped: " + "; ".join(reasons) if counts.get("skipped") else ""
    return PASS(f"{summary}{skipped}")


#: What point 9 (gpu_check.sh's own steps) needs among its records: check name prefix -> why not verified.
POINT_9_NEEDS = {"pytest ": "no GPU test file ran (gpu_check.sh step 3)",
                 "collectives ": "benchmarks/collectives.py --device cuda did not run (gpu_check.sh step 4)"}


def read_records(path: str) -> list[dict[str, Any]]:
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def append_record(path: str | None, record: dict[str, Any]) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({k: v for k, v in record.items() if k != "log"}) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--point", action="append", help="a point of this run (1-8) or 'all'; repeatable")
    parser.add_argument("--check", action="append", help="one check by name; repeatable")
    parser.add_argument("--dry-run-double", action="store_true", help="over tests/doubles/nccl_double.py, ranks as threads")
    parser.add_argument("--results", help="append each check's record to this JSON-lines file")
    parser.add_argument("--list", action="store_true", help="list the checks")
    parser.add_argument("--verbose", action="store_true", help="print each worker's output")
    # plumbing of gpu_check.sh and the workers
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--double", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pytest-outcome", nargs=4, metavar=("NAME", "LOG", "RC", "POINT"),
                        help="record the outcome of one pytest run (gpu_check.sh)")
    parser.add_argument("--record", nargs=4, metavar=("NAME", "POINT", "STATUS", "DETAIL"),
                        help="record one step's outcome (gpu_check.sh)")
    parser.add_argument("--verdict", metavar="RESULTS", help="print the verdict lines of a results file")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.double)
    if args.list:
        for name, c in CHECKS.items():
            print(f"{name:32} point {c.point}  ranks {c.ranks:6} double {'yes' if c.double else 'no'}  "
                  f"{(c.fn.__doc__ or '').split('.')[0].strip()}")
        return 0
    if args.pytest_outcome:
        name, log, rc, point = args.pytest_outcome
        result = {"check": name, "point": int(point), **pytest_outcome(Path(log).read_text(errors="replace"), int(rc))}
        append_record(args.results, result)
        print(f"{name:44} {result['status']}" + (f" ({result['detail']})" if result["detail"] else ""))
        return 0
    if args.record:
        name, point, status, detail = args.record
        if status not in STATUSES:
            parser.error(f"invalid STATUS {status!r}; valid: {list(STATUSES)}")
        result = {"check": name, "point": int(point), "status": status, "detail": detail}
        append_record(args.results, result)
        print(f"{name:44} {status}" + (f" ({detail})" if detail else ""))
        return 0
    if args.verdict:
        records = read_records(args.verdict)
        for prefix, why in POINT_9_NEEDS.items():  # point 9 is not verified by its setup alone
            if not any(int(r["point"]) == 9 and r["check"].startswith(prefix) for r in records):
                records.append({"check": prefix.strip(), "point": 9, **SKIP(why)})
        points = sorted({int(r["point"]) for r in records} | set(range(1, 10)))
        for line in point_verdicts(records, points):
            print(line)
        line = final_line(records, points)
        print(line)
        return 0 if line.startswith("VERDICT: PASS") else 1 if line.startswith("VERDICT: FAIL") else 2
    names = list(args.check or [])
    wanted = args.point or ([] if names else ["all"])
    for p in wanted:
        if p == "all":
            names += list(CHECKS)
        elif p.isdigit() and 1 <= int(p) <= 8:
            names += [n for n, c in CHECKS.items() if c.point == int(p)]
        else:
            parser.error(f"invalid --point {p!r}; valid: 1-8 or all (point 9 is benchmarks/gpu_check.sh)")
    bad = [n for n in names if n not in CHECKS]
    if bad:
        parser.error(f"invalid --check {bad}; valid: {list(CHECKS)}")
    names = sorted(dict.fromkeys(names), key=lambda n: CHECKS[n].ranks == "multi")  # one-GPU stage first
    gpus = 0 if args.dry_run_double else gpu_count()
    print(f"# gpu_acceptance: {'the double (tests/doubles/nccl_double.py)' if args.dry_run_double else f'{gpus} GPU(s)'}, "
          f"{len(names)} checks", flush=True)
    records = []
    stage = None
    for name in names:
        if stage != (CHECKS[name].ranks == "multi"):
            stage = CHECKS[name].ranks == "multi"
            print("# multi-GPU stage (one rank per GPU; runs where >= 2 GPUs are visible)" if stage
                  else "# one-GPU stage", flush=True)
        record = run_check(name, double=args.dry_run_double, gpus=gpus)
        records.append(record)
        append_record(args.results, record)
        print(f"  point {record['point']} {name:32} {record['status']}"
              + (f" ({record['detail']})" if record["detail"] else ""), flush=True)
        if args.verbose or (record["status"] == "FAIL" and os.environ.get("MESHKIT_ACCEPT_QUIET") != "1"):
            print("    | " + record.get("log", "").strip().replace("\n", "\n    | "), flush=True)
    points = sorted({CHECKS[n].point for n in names})
    for line in point_verdicts(records, points):
        print(line)
    failed = any(r["status"] == "FAIL" for r in records)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
