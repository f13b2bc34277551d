"""Device arrays through the MPI engine: staged through pinned host buffers, or handed to a
CUDA-aware MPI as they are; either way posted only once the device is done writing them.

Device arrays (``__cuda_array_interface__``: CuPy, ...) go to MPI as they are when MPI is
CUDA-aware (:mod:`~meshkit.comm.engines.mpi_cuda_aware`), once the caller's current stream has finished
writing them (MPI is not stream-aware: an event recorded at issue, tested later, so that the
issuing call does not wait for the caller's kernels). Otherwise they are staged: copied into
pinned host buffers (reused per size and dtype, through :mod:`~meshkit.comm.engines.cuda_runtime`) on
the engine's staging stream, which waits for the caller's stream through an event (so only for
the caller's writes so far), moved by MPI, and copied back on the same stream (all_reduce,
reduce and broadcast above :data:`CHUNK_BYTES` go to MPI chunk by chunk, each as its copy
arrives); the request completes only once the copy back is done, and an operation that fails
or times out never copies back, so its output keeps its old contents.

Apart from the engine because the NumPy path never enters it (a NumPy send or receive only
looks whether a device message waits before it, in :class:`Posts`): the engine's methods hand a
device array to :meth:`Staging.start` and get back a request that tests like MPI's.
"""

from __future__ import annotations

import collections
import functools
import threading
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from . import cuda_runtime
from .mpi_cuda_aware import cuda_aware_mpi

__all__ = ["Staging", "Posts", "Deferred", "CHUNK_BYTES"]


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
#: copies in ~0.2 ms, far above one MPI call's fixed cost, and a
#: 64 MB bucket overlaps in 16 steps. Not yet tuned on a GPU. Only these collectives are chunked:
#: each element of their output depends on the same element of the inputs alone, so chunks are
#: independent collectives; every rank cuts the same chunks (the sizes agree) and posts them all
#: within one call, so the order of collectives on the communicator stays the same on every rank.
CHUNK_BYTES = 4 << 20


class Posts:
    """Device operations of one engine waiting for the device before MPI may see their buffers,
    posted to MPI in issue order (so messages between two ranks keep their order, and every rank
    posts its chunks of a collective in the same order), by whichever thread tests one of them.

    MPI is not stream-aware: it may read a buffer only once the device work that writes it is
    over. Waiting for that at issue blocks the caller behind every kernel it queued before (a
    DDP bucket's all-reduce behind the rest of the backward pass: no overlap left), so an
    operation is posted when an event recorded at issue has fired, found by the tests that the
    caller's wait and the progress agent make anyway.
    """

    __slots__ = ("queue", "lock")

    def __init__(self) -> None:
        self.queue: collections.deque[Deferred] = collections.deque()
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


class Deferred:
    """An MPI operation in steps ``(event, start)``: each ``start()`` is posted once its event
    (None: at once) has fired and the steps before it were posted; complete once every posted
    request is (a chunked collective has one step per chunk). Forwards a receive's
    ``source``/``count``/``dtype`` from its (one) request."""

    __slots__ = ("steps", "requests", "posts")

    def __init__(self, steps: list[tuple[Any, Callable[[], Any]]], posts: Posts) -> None:
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

    # a receive's fields (engine.Received), from its one request once complete
    @property
    def source(self) -> int:
        return self.requests[0].source

    @property
    def count(self) -> int | float:
        return self.requests[0].count

    @property
    def dtype(self) -> Any:
        return self.requests[0].dtype


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

    # a receive's fields (engine.Received), from the MPI request it stages
    @property
    def source(self) -> int:
        return self.request.source

    @property
    def count(self) -> int | float:
        return self.request.count

    @property
    def dtype(self) -> Any:
        return self.request.dtype


def _use(rt: Any, device: int) -> None:
    """Make ``device`` current on the calling thread (where it is not already)."""
    if rt.current_device() != device:
        rt.use_device(device)


class Staging:
    """How one engine's operations on device arrays reach MPI: CUDA-aware or staged, posted in
    issue order once the device is done (:class:`Posts`). One per engine: it holds the engine's
    pinned buffers, its staging stream per device and whether MPI is CUDA-aware (asked at the
    first device array)."""

    def __init__(self) -> None:
        self._aware: bool | None = None  # CUDA-aware MPI; asked at the first device array
        self._pool = _Pool()
        self._streams: dict[int, Any] = {}  # device -> its stream of staging copies, made at its first staged array
        self.posts = Posts()  # device operations waiting for the device before MPI sees them

    def start(self, start: Callable[..., Any], arrays: tuple[Any, ...], reads: tuple[bool, ...],
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
        :class:`Posts`), so an async call returns while the caller's kernels still run.
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
            return Deferred([(ready, lambda: start(*arrays))], self.posts)
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = rt.new_stream()
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
            request = Deferred([(copied, lambda: start(*hosts))], self.posts)
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
            request = Deferred(steps, self.posts)
        except BaseException:
            self._pool.give([taken])  # MPI never saw them (or some of them: a failed op keeps nothing)
            raise
        pool = self._pool
        outputs = [(host.reshape(a.shape), a)] if write else []
        return _Staged(request, outputs, stream, lambda: pool.give([taken]), device)
