"""The MPI engine (mpi4py): NumPy buffers go to MPI as they are, in place where MPI allows.

Every collective is MPI's nonblocking form (``Iallreduce``, ``Ibcast``, ...) polled with
``Test`` until it completes or the deadline passes; that is how a blocking call honours the
group's timeout. Polling spins, then yields the core, then naps once a wait is over a second,
so a rank waiting for a busy peer does not keep a core busy. How long it spins depends on the
host: a blocked caller spins up to 2 ms when every rank has a core of its own (as MPI's
blocking calls do), but only a few polls when ranks outnumber cores (measured on 2 cores with
4 ranks: a pure spin loop made an 8-byte all_reduce 200x slower than MPI's blocking call,
spin-then-``sched_yield`` matches it); a communication thread working beside the caller's
computation never spins.

Device arrays (``__cuda_array_interface__``: CuPy, ...) go to MPI as they are when MPI is
CUDA-aware, once the caller's current stream has finished writing them (MPI is not
stream-aware: an event recorded at issue, tested later, so that the issuing call does not wait
for the caller's kernels). Otherwise they are staged: copied into pinned host buffers (reused per size and
dtype, through :mod:`~meshkit.comm.cuda_runtime`) on the engine's staging stream, which waits
for the caller's stream through an event (so only for the caller's writes so far), moved by MPI,
and copied back on the same stream (all_reduce, reduce and broadcast above :data:`CHUNK_BYTES`
go to MPI chunk by chunk, each as its copy arrives); the request completes only once the copy
back is done, and an operation that fails or times out never copies back, so its output keeps
its old contents. Whether MPI is CUDA-aware:
``MESHKIT_CUDA_AWARE_MPI=1`` or ``0`` decides; without it, mpi4py's ``MPI.Query_cuda_support()``
where mpi4py has it, else the MPI library's ``MPIX_Query_cuda_support()`` /
``MPIX_GPU_query_support()`` (through ctypes), else staging (always correct, slower).

This module imports ``mpi4py.MPI``, which initializes MPI: it is imported only when the ``mpi``
backend is chosen. MPI is asked for ``MPI_THREAD_MULTIPLE`` (mpi4py's default), because each
group's communication thread calls MPI beside the caller.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import os
import threading
import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from . import cuda_runtime, env
from .arrays import is_device_array
from .engine import DeadlineExceeded, EngineCapabilities
from .errors import DistBackendError, DistValueError
from .notices import WATCH_INTERVAL, Notice
from .reduce_op import ReduceOp, combine_into
from .work import in_background

__all__ = ["MPIEngine", "create_world_engine", "cuda_aware_mpi", "CUDA_AWARE_ENV"]

logger = logging.getLogger("meshkit")

#: Polls per ``sched_yield`` (the first after as many). Few: with more ranks than cores, the
#: peer this rank waits for may need this very core; but not one: every yield is a context
#: switch, and MPI progresses only inside ``Test``. Measured with raw ``Iallreduce`` polls at 4
#: ranks on 2 cores, relative to blocking ``Allreduce``: yielding at every poll 0.62-0.67 (4 KB),
#: 1.13-1.17 (64 KB), 1.05-1.13 (256 KB); every 4th poll 0.44-0.47, 0.89-0.93, 0.97-1.07;
#: every 64th 0.54, 1.38, 1.19 (and 64 polls before the first yield cost small all_reduces
#: +14 to +19 us over raw mpi4py).
_POLLS_PER_YIELD = 4
_BATCH = range(_POLLS_PER_YIELD)
#: Seconds a blocked caller keeps polling without yielding when every rank of this host has a
#: core of its own (set by :func:`create_world_group`; 0 when the host is oversubscribed).
#: Yielding between polls costs a system call per poll and slows MPI's progress, which only
#: happens inside ``Test``: at 2 ranks on 2 cores a 64 KB all_reduce took 25.2 us polled with
#: ``sched_yield`` against 20.7 us spinning (blocking ``Allreduce``: 21.6 us). A communication
#: thread spins only while a caller waits for it; otherwise it runs beside the caller's
#: computation (see ``work.in_background``).
CALLER_SPIN_SECONDS = 0.002
_caller_spin = 0.0
#: Seconds of yielding before napping. MPI's nonblocking collectives progress only inside
#: ``Test``, so a poller that naps throttles any transfer still running: with naps after 20 ms,
#: a 64 MB all_to_all at 4 ranks took 185 ms instead of 19 ms (benchmarks/collectives.py).
#: Yielding still gives the core to other processes; only a wait longer than this (a peer
#: computing elsewhere, or hung) naps, so that it does not keep a core busy for minutes.
_YIELD_SECONDS = 1.0
#: Nap length once a wait is long.
_NAP_SECONDS = 0.0002
#: Extra seconds non-root ranks of a monitored exchange wait for rank 0's verdict, which rank 0
#: may send only at its own deadline.
_VERDICT_GRACE = 5.0


class _Poller:
    """Spin, then yield, then nap: the waiting policy of every MPI wait.

    ``spin``: seconds to keep spinning (no yield between batches) after the first batch, while
    nobody computes beside this wait (see ``work.in_background``). ``watch``: called every
    :data:`~meshkit.comm.notices.WATCH_INTERVAL` once the wait has lasted that long (it reads
    notices and raises if the wait is in vain).
    """

    __slots__ = ("since", "deadline", "spin", "watch", "watched")

    def __init__(self, deadline: float, spin: float = 0.0, watch: Callable[[], None] | None = None) -> None:
        self.since, self.deadline, self.spin, self.watch, self.watched = 0.0, deadline, spin, watch, 0.0

    def pause(self) -> bool:
        """Between two batches of polls: maybe yield or nap; False once the deadline has passed."""
        now = time.monotonic()
        if now > self.deadline:
            return False
        if not self.since:
            self.since = self.watched = now
        elif self.watch is not None and now - self.watched > WATCH_INTERVAL:
            self.watched = now
            self.watch()
        waited = now - self.since
        if waited < self.spin and not in_background():
            return True
        if waited < _YIELD_SECONDS:
            os.sched_yield()
        else:
            time.sleep(_NAP_SECONDS)
        return True


def _completes(request: Any, deadline: float, watch: Callable[[], None] | None = None) -> bool:
    """Poll ``request`` until it completes (True) or the deadline passes (False)."""
    poller = _Poller(deadline, _caller_spin, watch)
    test = request.Test
    while True:
        for _ in _BATCH:  # a tight batch: MPI progresses only inside Test, so react fast
            if test():
                return True
        if not poller.pause():
            return False


def _wait(request: Any, deadline: float) -> None:
    # Small messages are often done at the first Test: no poller, no extra call.
    if not request.Test() and not _completes(request, deadline):
        raise DeadlineExceeded()


# --------------------------------------------------------------------------- datatypes and ops
_BOOL_OPS = {ReduceOp.MIN: MPI.LAND, ReduceOp.MAX: MPI.LOR, ReduceOp.BAND: MPI.LAND, ReduceOp.BOR: MPI.LOR,
             ReduceOp.BXOR: MPI.LXOR}
_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.AVG: MPI.SUM, ReduceOp.PRODUCT: MPI.PROD, ReduceOp.MIN: MPI.MIN,
        ReduceOp.MAX: MPI.MAX, ReduceOp.BAND: MPI.BAND, ReduceOp.BOR: MPI.BOR, ReduceOp.BXOR: MPI.BXOR}
_specs: dict[np.dtype, tuple[MPI.Datatype, dict[ReduceOp, MPI.Op]]] = {}


def _spec(dtype: np.dtype) -> tuple[MPI.Datatype, dict[ReduceOp, MPI.Op]]:
    """The MPI datatype of ``dtype`` and the MPI op of every ReduceOp for it (cached per dtype).

    Dtypes MPI does not know (e.g. float16 on an MPI without MPIX_C_FLOAT16) travel as opaque
    elements of their size, reduced by NumPy user ops; booleans reduce with MPI's logical ops.
    """
    found = _specs.get(dtype)
    if found is None:
        try:
            datatype = MPI.Datatype.fromcode(dtype.char)
            ops = _BOOL_OPS if dtype.kind == "b" else _OPS
        except (ValueError, KeyError):
            datatype = MPI.BYTE.Create_contiguous(dtype.itemsize).Commit()
            ops = {op: _user_op(op, dtype) for op in ReduceOp}
        found = _specs[dtype] = (datatype, ops)
    return found


def _user_op(op: ReduceOp, dtype: np.dtype) -> MPI.Op:
    def combine(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        combine_into(op, np.frombuffer(inoutbuf, dtype), np.frombuffer(inbuf, dtype))
    return MPI.Op.Create(combine, commute=True)


def _own_chunk(out: np.ndarray, inp: np.ndarray, rank: int) -> bool:
    """True when ``inp`` is this rank's chunk of ``out`` (FSDP's layout): gather in place."""
    # Only a view can be; addresses through mpi4py's buffer (0.2 us) rather than
    # ``__array_interface__`` (1 us each).
    return inp.base is not None and MPI.buffer(inp).address == MPI.buffer(out).address + rank * inp.nbytes


class _Receive:
    """A posted receive: completes with ``source`` and ``count``, the message's size in elements
    of the buffer's dtype (-1 if the message was larger than the buffer, which MPI reports as a
    truncation; a fraction if its bytes do not divide into such elements)."""

    __slots__ = ("request", "status", "itemsize", "source", "count")
    dtype = None  # messages carry no dtype: only their size is checked

    def __init__(self, request: MPI.Request, itemsize: int) -> None:
        self.request, self.status, self.itemsize = request, MPI.Status(), itemsize
        self.source, self.count = -1, -1

    def Test(self) -> bool:  # noqa: N802 (the Request protocol's name)
        try:
            if not self.request.Test(self.status):
                return False
            nbytes = self.status.Get_count(MPI.BYTE)
            self.count = nbytes // self.itemsize if nbytes % self.itemsize == 0 else nbytes / self.itemsize
        except MPI.Exception as exc:
            if exc.Get_error_class() != MPI.ERR_TRUNCATE:
                raise DistBackendError(f"meshkit.comm: recv failed in MPI: {exc}") from None
            self.count = -1  # the message did not fit: the group reports it with both sizes
        self.source = self.status.Get_source()
        return True


# --------------------------------------------------------------------------- device arrays
#: Launchers' node-local rank, in the order asked: torchrun, MPICH's Hydra, Open MPI, Slurm.
LOCAL_RANK_ENVS = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")

#: The environment variable that says whether MPI reads device memory (1) or not (0).
CUDA_AWARE_ENV = env.CUDA_AWARE_MPI


#: ``MPIX_GPU_SUPPORT_CUDA`` in MPICH's mpi.h: the ``gpu_type`` of ``MPIX_GPU_query_support``.
_MPIX_GPU_SUPPORT_CUDA = 0


def cuda_aware_mpi() -> bool:
    """Whether device arrays go to MPI directly.

    In order: :data:`CUDA_AWARE_ENV` when set; mpi4py's ``MPI.Query_cuda_support()`` where
    mpi4py has it; else the MPI library's own extension, asked through ctypes
    (``MPIX_Query_cuda_support()``: MPICH and Open MPI; ``MPIX_GPU_query_support``: MPICH);
    else False (stage through host memory: always correct, slower).

    Raises:
        DistValueError: :data:`CUDA_AWARE_ENV` is set to something other than 0 or 1.
    """
    forced = env.cuda_aware_mpi(MPI.COMM_WORLD.Get_rank())
    if forced is not None:
        return forced
    query = getattr(MPI, "Query_cuda_support", None)  # mpi4py 4.1 has none (MPIX is not its API)
    if query is not None:
        return bool(query())
    lib = _libmpi()
    return lib is not None and _mpix_cuda_support(lib)


def _libmpi() -> Any | None:
    """The MPI library mpi4py loaded, for the MPIX queries mpi4py does not wrap; None if not found.

    mpi4py dlopens libmpi with ``RTLD_LOCAL`` (the ``mpich`` wheel's ``lib/libmpi.so.12``), so its
    symbols are not global: the library is found by path among this process's mappings and
    opened again with ``RTLD_NOLOAD`` (the same handle, never a second MPI). A libmpi linked into
    the executable or loaded ``RTLD_GLOBAL`` is found first, through the global namespace.
    """
    import ctypes

    try:
        lib = ctypes.CDLL(None)
        lib.MPI_Get_version  # noqa: B018 (a lookup: AttributeError where the symbols are not global)
        return lib
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/maps") as maps:  # Linux; elsewhere MESHKIT_CUDA_AWARE_MPI decides
            fields = [line.split(None, 5) for line in maps if "libmpi" in line]
    except OSError:
        return None
    paths = sorted({f[5].strip() for f in fields if len(f) == 6})  # address perms offset dev inode path
    for path in paths:
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            lib.MPI_Get_version  # noqa: B018
            return lib
        except (OSError, AttributeError):
            continue
    return None


def _mpix_cuda_support(lib: Any) -> bool:
    """What ``lib`` says of CUDA support: ``MPIX_Query_cuda_support()`` (Open MPI, MPICH), else
    ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)`` (MPICH); False if it has neither."""
    import ctypes

    query = getattr(lib, "MPIX_Query_cuda_support", None)
    if query is not None:
        query.restype, query.argtypes = ctypes.c_int, []
        return bool(query())
    query = getattr(lib, "MPIX_GPU_query_support", None)
    if query is not None:
        query.restype, query.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        flag = ctypes.c_int(0)
        return query(_MPIX_GPU_SUPPORT_CUDA, ctypes.pointer(flag)) == 0 and bool(flag.value)  # 0: MPI_SUCCESS
    return False


_NDARRAY = np.ndarray
_on_device = is_device_array  # NumPy's path pays one class check (all_reduce's, not even a call)


class _Pool:
    """Pinned host buffers for staging, reused per (element count, dtype).

    A buffer is taken for one operation and given back once that operation completed; a failed
    or timed-out one keeps its buffers (MPI may still write into them).
    """

    def __init__(self) -> None:
        self._free: dict[tuple[int, np.dtype], list[np.ndarray]] = {}
        self._lock = threading.Lock()  # the caller and the progress thread both take and give

    def take(self, rt: Any, size: int, dtype: np.dtype) -> np.ndarray:
        with self._lock:
            free = self._free.get((size, dtype))
            if free:
                return free.pop()
        return rt.pinned_empty((size,), dtype)

    def give(self, bufs: list[np.ndarray]) -> None:
        with self._lock:
            for b in bufs:
                self._free.setdefault((b.size, b.dtype), []).append(b)


#: Staged all_reduce, reduce and broadcast buffers above this many bytes go to MPI in chunks of
#: it: each chunk is handed to MPI as soon as its device-to-host copy is over, so the copy of the
#: next chunk overlaps MPI's work on this one. 4 MB: at PCIe 4 pinned rates (~20-25 GB/s) a chunk
#: copies in ~0.2 ms, far above one MPI call's fixed cost (~10 us at 2 ranks on one host), and a
#: 64 MB bucket overlaps in 16 steps. Not yet tuned on a GPU. Only these collectives are chunked:
#: each element of their output depends on the same element of the inputs alone, so chunks are
#: independent collectives; every rank cuts the same chunks (the sizes agree) and posts them all
#: within one call, so the order of collectives on the communicator stays the same on every rank.
CHUNK_BYTES = 4 << 20


class _Posts:
    """Device operations of one engine waiting for the device before MPI may see their buffers,
    posted to MPI in issue order (so messages between two ranks keep their order, and every rank
    posts its chunks of a collective in the same order), by whichever thread tests one of them.

    MPI is not stream-aware: it may read a buffer only once the device work that writes it is
    over. Waiting for that at issue blocks the caller behind every kernel it queued before (a
    DDP bucket's all-reduce behind the rest of the backward pass: no overlap left), so an
    operation is posted when an event recorded at issue has fired, found by the tests that the
    caller's wait and the progress agent make anyway (issue 24, point 8).
    """

    __slots__ = ("queue", "lock")

    def __init__(self) -> None:
        self.queue: collections.deque[_Deferred] = collections.deque()
        self.lock = threading.Lock()

    def advance(self) -> None:
        """Post every step whose event has fired, in issue order, up to the first that has not."""
        with self.lock:
            queue = self.queue
            while queue:
                head = queue[0]
                try:
                    if not head.post_ready():
                        return
                except BaseException:  # its operation fails (its waiter raises this); the others go on
                    queue.popleft()
                    raise
                queue.popleft()


class _Deferred:
    """An MPI operation in steps ``(event, start)``: each ``start()`` is posted once its event
    (None: at once) has fired and the steps before it were posted; complete once every posted
    request is (a chunked collective has one step per chunk). Forwards a receive's
    ``source``/``count``/``dtype`` from its (one) request."""

    __slots__ = ("steps", "requests", "posts")

    def __init__(self, steps: list[tuple[Any, Callable[[], Any]]], posts: _Posts) -> None:
        self.steps, self.requests, self.posts = collections.deque(steps), [], posts
        with posts.lock:
            if posts.queue or not self.post_ready():
                posts.queue.append(self)

    def post_ready(self) -> bool:
        """Post the steps whose events have fired (hold ``posts.lock``); True once all are posted."""
        steps = self.steps
        while steps:
            event, start = steps[0]
            if event is not None and not event.done:
                return False
            self.requests.append(start())
            steps.popleft()
        return True

    def Test(self) -> bool:  # noqa: N802 (the Request protocol's name)
        if self.steps:
            self.posts.advance()
            if self.steps:
                return False
        requests = self.requests
        return requests[0].Test() if len(requests) == 1 else MPI.Request.Testall(requests)

    def __getattr__(self, name: str) -> Any:
        if not self.requests:
            raise AttributeError(name)
        return getattr(self.requests[0], name)


def _drain(rt: Any, stream: Any) -> None:
    """Block until the work queued on ``stream`` so far is done (not work queued later, by
    another operation's thread). The event is made on the stream's device, which the caller made
    current (CUDA refuses to record an event on a stream of another device)."""
    event = rt.new_event()
    event.record(stream)
    event.synchronize()


class _Staged:
    """An MPI request over staged host buffers: completes once MPI has and the outputs have been
    copied back to the device (on the engine's staging stream, and the copy has finished), so a
    caller never sees a half-copied output as done. Forwards a receive's ``source``/``count``/``dtype``.

    Whichever thread completes it (the caller, the group's communication thread, the progress
    agent) makes ``device`` current first: the copy back and its event belong to that GPU."""

    __slots__ = ("request", "outputs", "stream", "release", "done", "device")

    def __init__(self, request: Any, outputs: list[tuple[np.ndarray, Any]], stream: Any,
                 release: Callable[[], None], device: int) -> None:
        self.request, self.outputs, self.stream, self.release = request, outputs, stream, release
        self.done, self.device = False, device

    def Test(self) -> bool:  # noqa: N802 (the Request protocol's name)
        if self.done:
            return True
        if not self.request.Test():
            return False
        if self.outputs:
            rt = cuda_runtime.runtime()
            _use(rt, self.device)
            for host, dev in self.outputs:
                rt.copy_to_device(host, dev, self.stream)
            _drain(rt, self.stream)  # the host buffers go back to the pool: the copies must be over
        self.done = True
        self.release()
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.request, name)


def _use(rt: Any, device: int) -> None:
    """Make ``device`` current on the calling thread (where it is not already)."""
    if rt.current_device() != device:
        rt.use_device(device)


class _Mailbox:
    """The notice channel of a world: its own duplicate of MPI_COMM_WORLD, shared by every
    engine of the world, so notices never meet collective or user traffic."""

    _TAG = 7

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm
        self._sent: list[MPI.Request] = []

    def post(self, ranks: list[int], notice: Notice) -> None:
        self._sent = [r for r in self._sent if not r.Test()]
        self._sent += [self.comm.isend(notice, dest=r, tag=self._TAG) for r in ranks]

    def drain(self) -> list[Notice]:
        got = []
        status = MPI.Status()
        while self.comm.iprobe(source=MPI.ANY_SOURCE, tag=self._TAG, status=status):
            got.append(self.comm.recv(source=status.Get_source(), tag=self._TAG))
        return got

    def flush(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until the notices sent have left."""
        deadline = time.monotonic() + timeout
        for request in self._sent:
            _completes(request, deadline)
        self._sent = []


class MPIEngine:
    """The engine of a group over an MPI communicator (group rank == communicator rank)."""

    backend = "mpi"
    native_avg = False
    # MPI moves nonblocking data only inside MPI calls (needs_progress); MPI_Abort ends the job.
    capabilities = EngineCapabilities(needs_progress=True, aborts_job=True)
    device = None  # a host engine (device arrays are staged or passed to a CUDA-aware MPI)

    def __init__(self, comm: MPI.Intracomm, mailbox: _Mailbox) -> None:
        self.comm = comm
        self.mailbox = mailbox
        self.watch: Callable[[], None] | None = None  # set by the group: reads notices while stalled
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        self._tag_up, self._tag_down = tag_ub, tag_ub - 1
        self.max_tag = tag_ub - 16  # the top tags carry monitored exchanges
        self._Iallreduce = comm.Iallreduce
        self._aware: bool | None = None  # CUDA-aware MPI; asked at the first device array
        self._pool = _Pool()
        self._staging: dict[int, Any] = {}  # device -> its stream of staging copies, made at its first staged array
        self._posts = _Posts()  # device operations waiting for the device before MPI sees them

    def wait(self, request: Any, deadline: float) -> None:
        if not _completes(request, deadline, self.watch):
            raise DeadlineExceeded()

    def notify(self, ranks: list[int], notice: Notice) -> None:
        """Send ``notice`` to these global ranks (fire and forget)."""
        self.mailbox.post(ranks, notice)

    def notices(self) -> list[Notice]:
        """Notices received since the last call."""
        return self.mailbox.drain()

    def flush(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until the notices this rank sent have left."""
        self.mailbox.flush(timeout)

    @staticmethod
    def abort(code: int) -> None:
        """End the whole MPI job now (MPI_Abort on the world)."""
        MPI.COMM_WORLD.Abort(code)

    def _device(self, start: Callable[..., Any], arrays: tuple[Any, ...], reads: tuple[bool, ...],
                writes: tuple[bool, ...], *, chunked: bool = False) -> Any:
        """Run ``start(*arrays)`` for device arrays: on them (CUDA-aware MPI) or on staged host copies.

        ``reads[i]``/``writes[i]``: MPI reads/writes ``arrays[i]`` on this rank (None: no array).
        ``chunked``: ``start`` works element by element on one array (all_reduce, reduce,
        broadcast), so a staged array above :data:`CHUNK_BYTES` goes to MPI chunk by chunk.
        Staging copies run on the engine's own stream, ordered after the caller's current stream
        through an event recorded now: they follow the caller's writes so far, but neither wait
        for nor hold up work the caller queues later (the copy back may run on the progress
        thread while the caller computes). One staging stream per device. Nothing here waits for the
        device: MPI gets the buffers once an event says the device is done with them (see
        :class:`_Posts`), so an async call returns while the caller's kernels still run.
        """
        rt = cuda_runtime.runtime()
        # The arrays' GPU is current from here on: the caller's stream, the events and the copies
        # below are that GPU's (this may be the group's communication thread, which CUDA starts
        # on device 0).
        device = next((rt.device_of(a) for a in arrays if a is not None and a.nbytes), None)
        if device is None:  # nothing but empty arrays: no memory, no device to follow
            device = rt.current_device()
        _use(rt, device)
        caller = rt.current_stream()
        if self._aware is None:
            self._aware = cuda_aware_mpi()
        ready = rt.new_event()
        ready.record(caller)
        if self._aware:
            # MPI is not stream-aware: it reads the arrays once the caller's writes so far are
            # done, posted when this event fires (not by synchronizing the caller's stream here).
            return _Deferred([(ready, lambda: start(*arrays))], self._posts)
        stream = self._staging.get(device)
        if stream is None:
            stream = self._staging[device] = rt.new_stream()
        stream.wait_event(ready)  # also for outputs only: the copy back follows the caller's earlier writes
        if chunked and arrays[0].nbytes > CHUNK_BYTES:
            return self._chunked(rt, stream, start, arrays[0], reads[0], writes[0], device)
        hosts: list[Any] = []
        taken: list[np.ndarray] = []
        copied = None
        for a, read in zip(arrays, reads):
            if a is None:
                hosts.append(None)
                continue
            h = self._pool.take(rt, a.size, np.dtype(a.dtype))
            taken.append(h)
            h = h.reshape(a.shape)  # CuPy's copies want the device array's shape
            if read:
                rt.copy_to_host(a, h, stream)
                copied = rt.new_event()
            hosts.append(h)
        if copied is not None:
            copied.record(stream)  # MPI reads the host buffers once the copies are over
        try:
            request = _Deferred([(copied, lambda: start(*hosts))], self._posts)
        except BaseException:
            self._pool.give(taken)  # MPI never saw them
            raise
        outputs = [(h, a) for h, a, w in zip(hosts, arrays, writes) if w and a is not None]
        pool = self._pool
        return _Staged(request, outputs, stream, lambda: pool.give(taken), device)

    def _chunked(self, rt: Any, stream: Any, start: Callable[[Any], Any], a: Any, read: bool,
                 write: bool, device: int) -> _Staged:
        """``start`` on chunks of ``a``'s staged copy, each posted once its copy to the host is
        over (found by the tests of the request: nobody waits for a copy at issue). The copy back
        is one copy, once every chunk completed: a failed operation copies nothing."""
        taken = self._pool.take(rt, a.size, np.dtype(a.dtype))
        host, dev = taken, a.reshape(-1)
        step = max(CHUNK_BYTES // a.itemsize, 1)
        steps = []
        for lo in range(0, a.size, step):
            chunk, event = host[lo:min(lo + step, a.size)], None
            if read:
                rt.copy_to_host(dev[lo:lo + chunk.size], chunk, stream)
                event = rt.new_event()
                event.record(stream)
            steps.append((event, functools.partial(start, chunk)))
        try:
            request = _Deferred(steps, self._posts)
        except BaseException:
            self._pool.give([taken])  # MPI never saw them (or some of them: a failed op keeps nothing)
            raise
        pool = self._pool
        outputs = [(host.reshape(a.shape), a)] if write else []
        return _Staged(request, outputs, stream, lambda: pool.give([taken]), device)

    def all_reduce(self, buf: np.ndarray, op: ReduceOp) -> MPI.Request:
        if buf.__class__ is not _NDARRAY and _on_device(buf):  # one global, one compare for NumPy
            return self._device(lambda b: self._all_reduce(b, op), (buf,), (True,), (True,), chunked=True)
        t, ops = _specs.get(buf.dtype) or _spec(buf.dtype)  # the hottest call: no function call when cached
        return self._Iallreduce(MPI.IN_PLACE, [buf, t], ops[op])

    def _all_reduce(self, buf: np.ndarray, op: ReduceOp) -> MPI.Request:
        t, ops = _spec(buf.dtype)
        return self._Iallreduce(MPI.IN_PLACE, [buf, t], ops[op])

    def reduce(self, buf: np.ndarray, op: ReduceOp, root: int) -> MPI.Request:
        if _on_device(buf):
            mine = self.rank == root
            return self._device(lambda b: self._reduce(b, op, root), (buf,), (True,), (mine,), chunked=True)
        return self._reduce(buf, op, root)

    def _reduce(self, buf: np.ndarray, op: ReduceOp, root: int) -> MPI.Request:
        t, ops = _spec(buf.dtype)
        if self.rank == root:
            return self.comm.Ireduce(MPI.IN_PLACE, [buf, t], ops[op], root)
        return self.comm.Ireduce([buf, t], None, ops[op], root)

    def broadcast(self, buf: np.ndarray, root: int) -> MPI.Request:
        if _on_device(buf):
            mine = self.rank == root
            return self._device(lambda b: self._broadcast(b, root), (buf,), (mine,), (not mine,), chunked=True)
        return self._broadcast(buf, root)

    def _broadcast(self, buf: np.ndarray, root: int) -> MPI.Request:
        return self.comm.Ibcast([buf, _spec(buf.dtype)[0]], root)

    def all_gather(self, out: np.ndarray, inp: np.ndarray) -> MPI.Request:
        if _on_device(out):
            return self._device(self._all_gather, (out, inp), (False, True), (True, False))
        return self._all_gather(out, inp)

    def _all_gather(self, out: np.ndarray, inp: np.ndarray) -> MPI.Request:
        t = _spec(out.dtype)[0]
        send = MPI.IN_PLACE if _own_chunk(out, inp, self.rank) else [inp, t]
        return self.comm.Iallgather(send, [out, t])

    def reduce_scatter(self, out: np.ndarray, inp: np.ndarray, op: ReduceOp) -> MPI.Request:
        if _on_device(out):
            return self._device(lambda o, i: self._reduce_scatter(o, i, op), (out, inp), (False, True), (True, False))
        return self._reduce_scatter(out, inp, op)

    def _reduce_scatter(self, out: np.ndarray, inp: np.ndarray, op: ReduceOp) -> MPI.Request:
        t, ops = _spec(out.dtype)
        return self.comm.Ireduce_scatter_block([inp, t], [out, t], ops[op])

    def gather(self, out: np.ndarray | None, inp: np.ndarray, root: int) -> MPI.Request:
        if _on_device(inp):
            return self._device(lambda o, i: self._gather(o, i, root), (out, inp), (False, True), (True, False))
        return self._gather(out, inp, root)

    def _gather(self, out: np.ndarray | None, inp: np.ndarray, root: int) -> MPI.Request:
        t = _spec(inp.dtype)[0]
        return self.comm.Igather([inp, t], None if out is None else [out, t], root)

    def scatter(self, out: np.ndarray, inp: np.ndarray | None, root: int) -> MPI.Request:
        if _on_device(out):
            return self._device(lambda o, i: self._scatter(o, i, root), (out, inp), (False, True), (True, False))
        return self._scatter(out, inp, root)

    def _scatter(self, out: np.ndarray, inp: np.ndarray | None, root: int) -> MPI.Request:
        t = _spec(out.dtype)[0]
        return self.comm.Iscatter(None if inp is None else [inp, t], [out, t], root)

    def all_to_all(self, out: np.ndarray, recv_counts: list[int], inp: np.ndarray,
                   send_counts: list[int]) -> MPI.Request:
        if _on_device(out):
            return self._device(lambda o, i: self._all_to_all(o, recv_counts, i, send_counts), (out, inp),
                                (False, True), (True, False))
        return self._all_to_all(out, recv_counts, inp, send_counts)

    def _all_to_all(self, out: np.ndarray, recv_counts: list[int], inp: np.ndarray,
                   send_counts: list[int]) -> MPI.Request:
        t = _spec(out.dtype)[0]
        if len(set(send_counts)) == 1 and len(set(recv_counts)) == 1:
            # Equal parts: MPI_Alltoall, about 2x faster than Alltoallv in MPICH at >= 1 MB.
            return self.comm.Ialltoall([inp, t], [out, t])
        sdispl = [0, *itertools.accumulate(send_counts[:-1])]
        rdispl = [0, *itertools.accumulate(recv_counts[:-1])]
        return self.comm.Ialltoallv([inp, (send_counts, sdispl), t], [out, (recv_counts, rdispl), t])

    def barrier(self) -> MPI.Request:
        return self.comm.Ibarrier()

    # Point-to-point messages travel as bytes: a receive of another dtype than was sent must be
    # an error meshkit reports, and MPICH aborts the process (an internal assertion) when a
    # typed receive gets a message whose bytes do not divide into its elements.
    def send(self, buf: np.ndarray, dst: int, tag: int) -> MPI.Request:
        if _on_device(buf):
            return self._device(lambda b: self._send(b, dst, tag), (buf,), (True,), (False,))
        if self._posts.queue:  # behind a device message not yet posted: keep the order of messages
            return _Deferred([(None, lambda: self._send(buf, dst, tag))], self._posts)
        return self._send(buf, dst, tag)

    def _send(self, buf: np.ndarray, dst: int, tag: int) -> MPI.Request:
        return self.comm.Isend([buf, MPI.BYTE], dst, tag)

    def recv(self, buf: np.ndarray, src: int | None, tag: int) -> _Receive:
        if _on_device(buf):
            return self._device(lambda b: self._recv(b, src, tag), (buf,), (False,), (True,))
        if self._posts.queue:  # behind a device message not yet posted: keep the order of messages
            return _Deferred([(None, lambda: self._recv(buf, src, tag))], self._posts)
        return self._recv(buf, src, tag)

    def _recv(self, buf: np.ndarray, src: int | None, tag: int) -> _Receive:
        source = MPI.ANY_SOURCE if src is None else src
        return _Receive(self.comm.Irecv([buf, MPI.BYTE], source, tag), buf.itemsize)

    def exchange(self, payload: Any, seq: int, deadline: float, *, watched: bool = False) -> list[Any]:
        """Rank 0 collects every rank's payload by point-to-point and answers each one.

        Messages carry ``seq`` so that a late message of an earlier, timed-out exchange is never
        taken for this one. DeadlineExceeded names global ranks through ``self.world_ranks``.
        """
        watch = self.watch if watched else None  # read notices while waiting (detail-mode checks)
        n, comm = self.size, self.comm
        if n == 1:
            return [payload]
        if self.rank != 0:
            sent = comm.isend((seq, payload), dest=0, tag=self._tag_up)
            poller = _Poller(deadline + _VERDICT_GRACE, watch=watch)
            while True:
                if comm.iprobe(source=0, tag=self._tag_down):
                    s, (kind, value) = comm.recv(source=0, tag=self._tag_down)
                    if s == seq:
                        break
                elif not poller.pause():
                    raise DeadlineExceeded([self.world_ranks[0]], "group rank 0 never answered the arrival check")
            sent.Wait()
            if kind == "timeout":
                raise DeadlineExceeded(value)
            return value
        got: dict[int, Any] = {0: payload}
        poller = _Poller(deadline, watch=watch)
        status = MPI.Status()
        while len(got) < n:
            if comm.iprobe(source=MPI.ANY_SOURCE, tag=self._tag_up, status=status):
                source = status.Get_source()
                s, value = comm.recv(source=source, tag=self._tag_up)
                if s == seq:
                    got[source] = value
            elif not poller.pause():
                missing = [self.world_ranks[i] for i in range(n) if i not in got]
                verdict: tuple[str, Any] = ("timeout", missing)
                for i in got:
                    if i:
                        comm.isend((seq, verdict), dest=i, tag=self._tag_down)
                raise DeadlineExceeded(missing)
        values = [got[i] for i in range(n)]
        requests = [comm.isend((seq, ("ok", values)), dest=i, tag=self._tag_down) for i in range(1, n)]
        MPI.Request.Waitall(requests)
        return values

    @property
    def world_ranks(self) -> list[int]:
        """The global rank of each rank of this communicator."""
        ranks = getattr(self, "_world_ranks", None)
        if ranks is None:
            ranks = self._world_ranks = self.comm.Get_group().Translate_ranks(list(range(self.size)),
                                                                               MPI.COMM_WORLD.Get_group())
        return ranks

    def split(self, color: int | None, ranks: tuple[int, ...], deadline: float) -> MPIEngine | None:
        # Comm.Split has no nonblocking form: a barrier first makes it honour the deadline, and
        # reads notices while it stalls, so a member that left (or broke) is named at once
        # instead of at the timeout (issue 23.5).
        if not _completes(self.comm.Ibarrier(), deadline, self.watch):
            raise DeadlineExceeded()
        me = MPI.COMM_WORLD.Get_rank()
        child = self.comm.Split(MPI.UNDEFINED if color is None else color, me)
        if child == MPI.COMM_NULL:
            return None
        engine = MPIEngine(child, self.mailbox)
        members = tuple(engine.world_ranks)
        if members != ranks:
            raise DistBackendError(f"meshkit.comm: rank {me}: split: expected group {list(ranks)}, "
                                   f"MPI formed {list(members)}")
        return engine

    def host_name(self) -> str:
        return MPI.Get_processor_name()

    def local_rank(self) -> int:
        """This rank's index among the ranks of its node (the world's engine): the launcher's
        own (the first of :data:`LOCAL_RANK_ENVS` set), else the rank in MPI's shared-memory
        split of the world (``MPI_COMM_TYPE_SHARED``); host names are not used (containers may
        share one).

        Raises:
            DistValueError: a launcher variable that is not a non-negative integer.
        """
        for name in LOCAL_RANK_ENVS:
            value = os.environ.get(name, "").strip()
            if value:
                if not value.isdigit():
                    raise DistValueError(f"meshkit.comm: rank {MPI.COMM_WORLD.Get_rank()}: {name}={value!r} is not "
                                         "a node-local rank (a non-negative integer)")
                return int(value)
        node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            return node.Get_rank()
        finally:
            node.Free()

    def free(self) -> None:
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()


def create_world_engine() -> MPIEngine:
    """The world's engine: a duplicate of MPI_COMM_WORLD, so meshkit's traffic never meets the user's."""
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        logger.warning("meshkit: MPI provides thread level %d, not MPI_THREAD_MULTIPLE; async_op=True "
                       "collectives call MPI from a second thread and may fail", MPI.Query_thread())
    global _caller_spin
    host = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    ranks_here = host.Get_size()
    host.Free()
    _caller_spin = CALLER_SPIN_SECONDS if ranks_here <= len(os.sched_getaffinity(0)) else 0.0
    return MPIEngine(MPI.COMM_WORLD.Dup(), _Mailbox(MPI.COMM_WORLD.Dup()))
