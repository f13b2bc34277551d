"""A strict double of the GPU side of meshkit's NCCL engine: communicators, device memory,
streams and events, for ranks that are threads of one process (``meshkit.comm.local.run``).

Install it with ``meshkit.comm.engines.cuda_runtime.set_runtime(FakeRuntime())``. It is strict where
NCCL is strict, and checks every call as NCCL would:

* pointers lie inside live device allocations of the communicator's device, and
  ``count`` elements of ``datatype`` fit there; ``datatype`` and ``op`` are values of the real
  ``cupy.cuda.nccl`` module (:data:`CONSTANTS`, checked against it by the tests), and the
  datatype agrees with the buffer's dtype (its own type, its bytes as UINT8/INT8, or the
  float parts of a complex);
* every rank of a communicator issues the same collectives (kind, count, datatype, op, root)
  in the same order; each send meets a receive of the same count and datatype;
* ``groupStart``/``groupEnd`` are balanced (a host synchronization inside a group is an error);
* the stream argument was ordered (``wait_event``) after everything the calling thread had
  written on its current stream, so a collective can never read stale data;
* host<->device copies (``copy_to_host``/``copy_to_device``, for MPI staging) go between a
  device allocation and a buffer of ``pinned_empty`` of the same size and dtype, on a stream
  ordered after the caller's writes (``copy_to_host``) or after the last write queued to the
  device array (``copy_to_device``); they run in stream order and only when the stream is
  synchronized (or an event/entry after them is waited for), so a host reading ``dst`` before
  synchronizing reads stale data and the tests see it.

Streams run in order: an operation becomes ready when the entries before it on its stream
(operations, waits on events) are done, and it is performed, for real, on NumPy memory, once
every rank's part is ready. Operations of one NCCL group do not wait for each other. Host
code touching a :class:`DeviceArray` (``__setitem__``, ufuncs, ``get()``) first synchronizes
the current stream, as CuPy's host transfers do. Errors found once several ranks posted are
reported as NCCL does, through ``check_async_error``.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from typing import Any

import numpy as np

__all__ = ["CONSTANTS", "DeviceArray", "FakeRuntime", "FakeNcclError", "FakeCommunicator", "Gate", "TimedKernel",
           "fake_nccl", "to_device", "to_host", "visible_devices", "misuse", "DOUBLE_TIMEOUT", "UNNAMED_STATUSES",
           "FakeGpu", "FakeCudaRuntimeModule"]

#: The constants of cupy.cuda.nccl (CuPy 14, NCCL 2.x); tests assert they equal the real module's.
CONSTANTS = {"NCCL_INT8": 0, "NCCL_CHAR": 0, "NCCL_UINT8": 1, "NCCL_INT32": 2, "NCCL_INT": 2, "NCCL_UINT32": 3,
             "NCCL_INT64": 4, "NCCL_UINT64": 5, "NCCL_FLOAT16": 6, "NCCL_HALF": 6, "NCCL_FLOAT32": 7,
             "NCCL_FLOAT": 7, "NCCL_FLOAT64": 8, "NCCL_DOUBLE": 8, "NCCL_BFLOAT16": 9,
             "NCCL_SUM": 0, "NCCL_PROD": 1, "NCCL_MAX": 2, "NCCL_MIN": 3, "NCCL_AVG": 4}
_TYPES = {0: np.dtype(np.int8), 1: np.dtype(np.uint8), 2: np.dtype(np.int32), 3: np.dtype(np.uint32),
          4: np.dtype(np.int64), 5: np.dtype(np.uint64), 6: np.dtype(np.float16), 7: np.dtype(np.float32),
          8: np.dtype(np.float64)}
try:  # bfloat16 (9): CuPy 14 maps ml_dtypes.bfloat16 (dtype kind 'V') to NCCL_BFLOAT16
    import ml_dtypes

    _TYPES[9] = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # without ml_dtypes there is no bfloat16 array to pass
    pass
_OPS = {0: "SUM", 1: "PROD", 2: "MAX", 3: "MIN", 4: "AVG"}
#: Seconds a host synchronization or a split waits in the double before it reports a hang.
DOUBLE_TIMEOUT = 30.0
#: Seconds ncclCommDestroy takes once every member entered it: milliseconds on a GPU;
#: above the watchdog's 10 ms round (comm/groups/progress.py WATCHDOG_INTERVAL), so that a watchdog
#: querying a communicator being destroyed is caught every time, not by luck.
DESTROY_SECONDS = 0.015
#: Whether a communicator still holding its handle when it is garbage-collected destroys it, as
#: CuPy's ``NcclCommunicator.__dealloc__`` does (nccl.pyx: ``self.destroy()``). On with
#: ``FakeRuntime(dealloc=True)`` (a subprocess checking interpreter teardown): the test process
#: itself keeps communicators of jobs broken on purpose, whose peers will never destroy them.
_dealloc_destroys = False

_cond = threading.Condition()  # guards every piece of state below
_allocations: list[weakref.ref] = []
_ids = itertools.count(0x7F0000001000, 0x1000)
_tls = threading.local()
_null_streams: dict[int, FakeStream] = {}
_cliques: dict[bytes, _Clique] = {}


class FakeNcclError(RuntimeError):
    """What the double raises where NCCL returns an error (cupy.cuda.nccl.NcclError). Errors of
    NCCL's own status codes carry ``status`` and CuPy's text (:func:`_nccl_status_error`)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


#: NCCL status -> CuPy's NcclError text (CuPy 14.2 cupy_backends/cuda/libs/nccl.pyx ERROR2 and
#: ncclGetErrorString; the test checks them against the real module's NcclError(status)).
_NCCL_STATUS = {4: "NCCL_ERROR_INVALID_ARGUMENT: invalid argument (run with NCCL_DEBUG=WARN for details)"}
#: Statuses CuPy 14.2's NcclError cannot name: its message table (nccl.pyx) stops at 6
#: (ncclRemoteError), so ``NcclError(7)`` (ncclInProgress) and ``NcclError(8)`` (ncclTimeout, NCCL
#: 2.32) raise ``KeyError`` from its ``__init__``: what the caller of a failed NCCL call gets.
UNNAMED_STATUSES = (7, 8)
#: ncclInProgress: what a nonblocking communicator's calls return while they run.
NCCL_IN_PROGRESS = 7


def _nccl_status_error(status: int) -> BaseException:
    """What CuPy 14.2 raises for NCCL ``status``: its NcclError, or the KeyError of a status its
    table lacks (``NcclError.__init__`` indexes the table)."""
    if status in UNNAMED_STATUSES:
        return KeyError(status)
    return FakeNcclError(_NCCL_STATUS[status], status)


def _nonblocking() -> bool:
    """Whether NCCL makes nonblocking communicators here: ``NCCL_COMM_BLOCKING`` set and read as 0
    (NCCL reads it with strtoll, so text that is no number is 0 too)."""
    raw = os.environ.get("NCCL_COMM_BLOCKING")
    if raw is None or not raw.strip():
        return False
    digits = raw.strip()
    sign = digits[:1] if digits[:1] in "+-" else ""
    digits = digits[len(sign):]
    number = digits[:len(digits) - len(digits.lstrip("0123456789"))]
    return not number or int(number) == 0


# --------------------------------------------------------------------------- device memory
class _Pointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class DeviceArray(np.ndarray):
    """A device array backed by NumPy memory, shaped like a CuPy array: ``.data.ptr``,
    ``__cuda_array_interface__``, ``get()``. Creating one (``empty_like``, ``copy``,
    ``np.stack`` of device arrays, :func:`to_device`) is a device allocation on the calling
    thread's current device; host code touching it synchronizes the current stream first."""

    def __array_finalize__(self, obj: Any) -> None:
        if not isinstance(self.base, DeviceArray):  # owns its memory (or NumPy's, e.g. x[idx]): a new allocation
            self._device = _device()
            with _cond:
                _allocations[:] = [r for r in _allocations if r() is not None]
                _allocations.append(weakref.ref(self))
            _touch(self)

    @property
    def data(self) -> _Pointer:  # type: ignore[override]
        # CuPy 14.2 cupy/cuda/memory.pyx: an allocation of 0 bytes is MemoryPointer(Memory(0), 0),
        # whose ptr is 0; so is every empty array's pointer (arithmetic: count 0 is a no-op)
        return _Pointer(self.__array_interface__["data"][0] if self.size else 0)

    @property
    def device_id(self) -> int:
        device = getattr(_allocation(self), "_device", None)
        return device if device is not None else _owner(self.__array_interface__["data"][0])._device

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        strides = None if self.flags.c_contiguous else self.strides
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.data.ptr, False),
                "strides": strides, "version": 3}

    def __setitem__(self, key: Any, value: Any) -> None:
        _on_current_device("__setitem__", self, value)
        _host_sync()
        super().__setitem__(key, value)
        _touch(self)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        _on_current_device(ufunc.__name__, *inputs, *kwargs.get("out", ()))
        _host_sync()
        args = [x.view(np.ndarray) if isinstance(x, DeviceArray) else x for x in inputs]
        if "out" in kwargs:
            written = [x for x in kwargs["out"] if isinstance(x, DeviceArray)]
            for x in written:
                _touch(x)
            given = kwargs["out"]
            kwargs["out"] = tuple(x.view(np.ndarray) if isinstance(x, DeviceArray) else x for x in given)
            getattr(ufunc, method)(*args, **kwargs)
            return given[0] if len(given) == 1 else given  # the arrays themselves (x += 1 keeps x a DeviceArray)
        result = getattr(ufunc, method)(*args, **kwargs)
        return to_device(result) if isinstance(result, np.ndarray) else result

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        _on_current_device(func.__name__, *args, *(a for v in args if isinstance(v, (list, tuple)) for a in v),
                           *kwargs.values())
        _host_sync()
        result = super().__array_function__(func, types, args, kwargs)
        if isinstance(result, np.ndarray) and not isinstance(result, DeviceArray):
            result = to_device(result)  # as CuPy's np.stack of CuPy arrays gives a CuPy array
        return result

    def get(self) -> np.ndarray:
        """A host copy, after the work of the current stream of the array's device: CuPy's ``get``
        runs ``with self.device:`` (cupy/_core/core.pyx, ``_ndarray_base.get``), so it works from
        any current device."""
        _host_sync(self.device_id)
        return np.array(self.view(np.ndarray))


def to_device(x: Any) -> DeviceArray:
    """A new device allocation holding a copy of host array ``x``."""
    x = np.asarray(x)
    out = DeviceArray(x.shape, x.dtype)
    np.copyto(out.view(np.ndarray), x)
    return out


def to_host(x: Any) -> np.ndarray:
    return x.get() if hasattr(x, "__cuda_array_interface__") else np.asarray(x)


def _owner(ptr: int, nbytes: int = 1) -> DeviceArray | None:
    """The live allocation holding bytes ``[ptr, ptr + nbytes)``, or None."""
    with _cond:  # another rank's thread may be pruning the list
        refs = list(_allocations)
    for ref in refs:
        a = ref()
        if a is not None:
            start = a.__array_interface__["data"][0]
            if start <= ptr and ptr + nbytes <= start + a.nbytes:
                return a
    return None


def _region(ptr: int, count: int, dtype: np.dtype) -> np.ndarray:
    """A NumPy view of ``count`` elements at device address ``ptr`` (checked at post time)."""
    a = _owner(ptr, max(count * dtype.itemsize, 1))
    if a is None:
        raise FakeNcclError(f"double: device memory at {ptr:#x} was freed before the operation ran")
    raw = a.view(np.ndarray).reshape(-1).view(np.uint8)
    offset = ptr - a.__array_interface__["data"][0]
    return raw[offset:offset + count * dtype.itemsize].view(dtype)


# --------------------------------------------------------------------------- devices, streams, events
# Devices. CUDA's current device is per host thread and 0 until the thread
# sets another (CUDA C++ Programming Guide, "Device Selection": "a host thread can set the device
# it operates on at any time by calling cudaSetDevice()"; a new thread starts on device 0). What
# the double refuses, as the hardware does:
# * an event recorded on a stream of another device ("Stream and Event Behavior":
#   "cudaEventRecord() will fail if the input event and input stream are associated to
#   different devices"); events are made on the current device (cudaEventCreate);
# * a kernel on an array of another device than the current one: CuPy checks every array
#   argument of a kernel (cupy/_core/_kernel.pyx, ``_check_peer_access``: "The device where the
#   array resides (1) is different from the current device (0). Peer access is unavailable
#   between these devices."). With peer access CuPy only warns and runs the kernel on the
#   current device's stream, outside the array's stream order: the double refuses both.
# What CUDA allows, the double allows: cudaStreamWaitEvent, cudaEventQuery/Synchronize and
# memory copies across devices ("will succeed even if ..."), and ``get()`` (CuPy makes the
# array's device current for the copy).
def _device() -> int:
    return getattr(_tls, "device", 0)


# Visible devices. CUDA numbers the GPUs a process sees 0..n-1 in the order
# of CUDA_VISIBLE_DEVICES (CUDA C++ Programming Guide, "CUDA Environment Variables"), so under
# ``--gpus-per-task=1`` every rank sees one GPU, device 0, and each a different physical one.
# A thread-rank of the double sets what its "process" sees with :func:`visible_devices`; a GPU's
# identity (its UUID; NCCL compares host hash and PCI bus id) is the physical index.
def visible_devices(physical: list[int] | None) -> None:
    """This thread-rank sees GPUs ``physical`` (as CUDA_VISIBLE_DEVICES=...), None: all of them.

    Only the calling thread: threads it starts (meshkit's helper threads) still see every GPU,
    so tests of this keep their device work on the rank's own thread."""
    _tls.visible = None if physical is None else list(physical)


def _physical(index: int) -> int:
    visible = getattr(_tls, "visible", None)
    return index if visible is None else visible[index]


def _on_current_device(what: str, *arrays: Any) -> None:
    """Refuse a kernel (``what``) touching a device array of another device than the current one."""
    here = _device()
    for a in arrays:
        a = getattr(a, "_device_memory", a)  # tests/doubles/fake_cupy.py's arrays wrap a DeviceArray
        if isinstance(a, DeviceArray) and a.device_id != here:
            raise ValueError(f"The device where the array resides ({a.device_id}) is different from the current "
                             f"device ({here}). Peer access is unavailable between these devices. "
                             f"(double: {what} on thread {threading.current_thread().name})")


def _current(device: int | None = None) -> FakeStream:
    """The calling thread's current stream (of ``device``, default the current device)."""
    device = _device() if device is None else device
    key = _physical(device)  # one null stream per GPU (thread-ranks seeing one GPU each all call it device 0)
    with _cond:
        stream = _null_streams.get(key)
        if stream is None:
            stream = _null_streams[key] = FakeStream(device)
            _streams.add(stream)
        return stream


def _touch(of: DeviceArray | None = None) -> None:
    """The calling thread wrote device memory (``of``, where known) on its current stream."""
    stream = _current()
    with _cond:
        _wrote(stream, of)


def _wrote(stream: FakeStream, of: DeviceArray | None = None, entry: Any = None) -> None:
    """The calling thread enqueued a write on ``stream`` (under ``_cond``): it counts, and the
    thread remembers its own latest write there (what its later collectives must be ordered after);
    the allocation written (``of``) remembers it too (what a later copy into it must be ordered
    after, unless that write is an ``entry`` of the stream already seen done)."""
    stream.work += 1
    writes = getattr(_tls, "writes", None)
    if writes is None:
        writes = _tls.writes = weakref.WeakKeyDictionary()
    writes[stream] = stream.work
    if of is not None:
        _allocation(of)._written = (stream, stream.work, entry)


def _allocation(a: DeviceArray) -> DeviceArray:
    """The allocation a device array (or view) lies in."""
    while isinstance(a.base, DeviceArray):
        a = a.base
    return a


def _wait(pred: Any, what: str) -> None:
    """Block the host until ``pred()``; the "GPU" keeps running meanwhile (an operation whose
    inputs became ready after it was posted, e.g. behind a copy, is performed here)."""
    deadline = time.monotonic() + DOUBLE_TIMEOUT
    with _cond:
        while True:
            _progress()
            if pred():
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise FakeNcclError(f"double: {what} did not happen within {DOUBLE_TIMEOUT} s (a hang on a GPU)")
            _cond.wait(min(left, 0.01))


def _host_sync(device: int | None = None) -> None:
    """The host waits for the current stream's work (before touching device memory); that of
    ``device`` when given (a call that makes the array's device current first, as CuPy's ``get``)."""
    if getattr(_tls, "depth", 0):
        raise FakeNcclError("double: the host synchronized inside groupStart()/groupEnd() (unbalanced group)")
    stream = _current(device)
    _sync(lambda: stream.pending, "the current stream's pending work")


class FakeStream:
    """A stream: entries (operations, waits) in order; ``waited`` records which work of which
    stream it was ordered after."""

    def __init__(self, device: int) -> None:
        self.ptr = next(_ids)
        self.device = device
        self.pending: list[Any] = []  # entries not known done
        self.work = 0  # writes the host made on this (current) stream
        self.waited: dict[FakeStream, int] = {}

    def wait_event(self, event: FakeEvent) -> None:
        with _cond:
            self.pending = [e for e in self.pending if not e.done] + [_EventWait(event)]
            for stream, work in event.ordered.items():
                self.waited[stream] = max(self.waited.get(stream, -1), work)

    def ordered_after(self, stream: FakeStream) -> bool:
        """Ordered after every write the *calling thread* made on ``stream``. Another thread's later
        writes (a rank's compute thread beside its communication thread, both on the device's
        null stream) are not the caller's to order: its event was recorded before them."""
        mine = getattr(_tls, "writes", {}).get(stream, -1)
        return stream is self or self.waited.get(stream, -1) >= mine

    def synchronize(self) -> None:
        _sync(lambda: self.pending, "stream synchronize")

    def __hash__(self) -> int:
        return self.ptr


class Gate:
    """Work queued on a stream that runs until :meth:`open` (a long kernel): everything queued
    after it on that stream waits, what does not depend on it goes on (tests of what waits for what)."""

    def __init__(self, stream: FakeStream) -> None:
        self.done = False
        with _cond:
            stream.pending = [e for e in stream.pending if not e.done] + [self]

    def open(self) -> None:
        with _cond:
            self.done = True
            _cond.notify_all()


# --------------------------------------------------------------------------- timed kernels
# Timed kernels: a kernel occupies its stream for a given time, as a real
# one does, so that a test can measure whether a call waits for the device: everything queued
# after it on its stream waits; the host returns from launching it at once (kernel launches are
# asynchronous, CUDA C++ Programming Guide, "Asynchronous Concurrent Execution").
class TimedKernel:
    """A kernel on ``stream`` (default: the current stream) that runs for ``seconds`` once the
    work queued before it is done, writing ``writes`` (device arrays): ``effect()`` runs on the
    host as it finishes (what the kernel computed), so a reader ordered before it sees old data."""

    def __init__(self, seconds: float, stream: FakeStream | None = None, *, writes: tuple = (),
                 effect: Any = None) -> None:
        stream = stream or _current()
        for a in writes:
            _on_current_device("TimedKernel", a)
        self.seconds, self.effect, self._done = seconds, effect, False
        with _cond:
            self.deps = [e for e in stream.pending if not e.done]
            stream.pending = self.deps + [self]
            self.began = time.monotonic() if all(d.done for d in self.deps) else None
            for a in writes or (None,):
                _wrote(stream, getattr(a, "_device_memory", a))

    @property
    def done(self) -> bool:
        if self._done:
            return True
        if self.began is None:
            if not all(d.done for d in self.deps):
                return False
            self.began = time.monotonic()
        if time.monotonic() - self.began < self.seconds:
            return False
        self._done = True
        if self.effect is not None:
            self.effect()
        return True


class _EventWait:
    """A stream's wait for an event as recorded when the wait was queued: cudaStreamWaitEvent waits
    for "the most recent call to cudaEventRecord on event at the time of this call", so recording
    the event again later (reusing it) moves no wait queued before."""
    __slots__ = ("entries",)

    def __init__(self, event: FakeEvent) -> None:
        self.entries = event.entries  # (record replaces the list: this one stays the record of now)

    @property
    def done(self) -> bool:
        return all(e.done for e in self.entries)


class FakeEvent:
    """An event of the device current when it was made: done once the entries its stream had
    when recorded are done."""

    def __init__(self) -> None:
        self.entries: list[Any] = []
        self.ordered: dict[FakeStream, int] = {}
        self.device = _device()

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or _current()
        if stream.device != self.device:  # cudaEventRecord fails (see "Devices" above)
            raise FakeNcclError(f"double: cudaErrorInvalidResourceHandle: an event of device {self.device} "
                                f"recorded on a stream of device {stream.device} (thread "
                                f"{threading.current_thread().name}, current device {_device()})")
        with _cond:
            self.entries = [e for e in stream.pending if not e.done]
            self.ordered = {**stream.waited, stream: stream.work}

    @property
    def done(self) -> bool:
        return all(e.done for e in self.entries)

    @property
    def status(self) -> int:
        """What ``cudaEventQuery`` returns (see "event status" below)."""
        return _status(self.entries)

    def synchronize(self) -> None:
        _sync(lambda: self.entries, "event synchronize")


# --------------------------------------------------------------------------- event status
# CuPy 14.2 cupy/cuda/stream.pyx: ``Event.done`` is ``runtime.eventQuery(self.ptr) == 0`` and
# runtime.pyx's ``eventQuery`` returns cudaEventQuery's status without raising. After a kernel
# faulted (cudaErrorIllegalAddress, say), cudaEventQuery of an event recorded after it returns that
# error, never cudaSuccess (CUDA runtime API, cudaEventQuery: "may also return error codes from
# previous, asynchronous launches"), so ``done`` stays False forever; cudaStreamSynchronize and
# cudaEventSynchronize return the error. :func:`inject_fault` puts such a kernel on a stream; an
# event's :attr:`FakeEvent.status` is cudaEventQuery's answer, through the runtime's ``event_done``.
CUDA_SUCCESS, CUDA_NOT_READY = 0, 600
#: CUDA error -> CuPy's CUDARuntimeError text (checked against the real class by the tests).
CUDA_ERRORS = {600: "cudaErrorNotReady: device not ready",
               700: "cudaErrorIllegalAddress: an illegal memory access was encountered"}


class FakeCudaError(RuntimeError):
    """cupy_backends.cuda.api.runtime.CUDARuntimeError: ``status`` and CuPy's text."""

    def __init__(self, status: int) -> None:
        super().__init__(CUDA_ERRORS[status])
        self.status = status


class _Fault:
    """A kernel that faulted: never done, and what every later query of its stream reports."""

    __slots__ = ("code",)
    done = False

    def __init__(self, code: int) -> None:
        self.code = code


def inject_fault(stream: FakeStream | None = None, code: int = 700) -> None:
    """A kernel faults on ``stream`` (default: the calling thread's current stream)."""
    stream = stream or _current()
    with _cond:
        stream.pending = [e for e in stream.pending if not e.done] + [_Fault(code)]
        _cond.notify_all()


def _fault(entries: list[Any]) -> int | None:
    """The code of a faulted kernel that ``entries`` (not done) wait for, directly or through
    events, operations and copies; None if none does."""
    seen: set[int] = set()
    todo = [e for e in entries if not e.done]
    while todo:
        e = todo.pop()
        if id(e) in seen or e.done:
            continue
        seen.add(id(e))
        if isinstance(e, _Fault):
            return e.code
        if isinstance(e, _EventWait):
            todo.extend(e.entries)
        todo.extend(getattr(e, "deps", ()))
    return None


def _status(entries: list[Any]) -> int:
    """cudaEventQuery's answer for an event holding ``entries``."""
    with _cond:
        if all(e.done for e in entries):
            return CUDA_SUCCESS
        code = _fault(entries)
    return CUDA_NOT_READY if code is None else code


def _sync(entries: Any, what: str) -> None:
    """A host synchronization on ``entries()``: returns once they are done, raises a fault's error."""
    code: list[int] = []

    def over() -> bool:
        found = _fault(entries())
        if found is not None:
            code.append(found)
            return True
        return all(e.done for e in entries())

    _wait(over, what)
    if code:
        raise FakeCudaError(code[0])


# --------------------------------------------------------------------------- groups
# NCCL enqueues nothing on a stream until the outermost ncclGroupEnd: inside a group the calls
# only record their arguments, and the group depth is per thread (NCCL src/group.cc,
# ncclGroupStart/ncclGroupEnd keep ncclGroupDepth thread_local; src/enqueue.cc ncclEnqueueCheck
# appends a task to the planner while ncclGroupDepth > 0, launched by groupEnd; user guide
# "Group Calls"). So an event recorded on the stream before the outermost groupEnd, at any depth,
# covers none of the group's operations: the double puts them on their streams only there.
class _Group:
    """An open groupStart()/groupEnd() on one thread: its operations, held until its outermost end."""

    def __init__(self) -> None:
        self.closed = False
        self.queued: list[tuple[FakeStream, _Op]] = []  # (stream, operation), in call order


def _group_start() -> None:
    depth = getattr(_tls, "depth", 0)
    if depth == 0:
        _tls.group = _Group()
    _tls.depth = depth + 1


def _group_end() -> None:
    depth = getattr(_tls, "depth", 0)
    if depth == 0:
        raise FakeNcclError("double: groupEnd() without groupStart()")
    _tls.depth = depth - 1
    if depth == 1:
        with _cond:
            group, _tls.group = _tls.group, None
            for stream, op in group.queued:  # enqueued now, each after what its stream holds (not its group)
                pending = [e for e in stream.pending if not e.done]
                op.deps = [e for e in pending if getattr(e, "group", None) is not group]
                stream.pending = pending + [op]
            group.closed = True
            _progress()
        _connect_group()  # blocking calls: runtime connections happen here for a group


# --------------------------------------------------------------------------- blocking calls
# Blocking calls. These block the calling host thread inside NCCL until the
# peers arrive, with no timeout of their own (gpu-reality.md; NCCL init.cc, enqueue.cc):
# * ncclCommInitRank (``NcclCommunicator(...)``): until every rank of the communicator joined;
# * commSplit: until every rank of the parent called it (see ``FakeCommunicator.commSplit``);
# * the first collective of an algorithm and the first send/recv between two ranks: NCCL >= 2.22
#   connects at run time (``NCCL_RUNTIME_CONNECT``, default 1; 0 connects everything in init),
#   inside the enqueue call, or at the outermost ncclGroupEnd of a group. The double takes "an
#   algorithm" to be a collective kind (allReduce, broadcast, ...), a p2p connection a pair of ranks.
# The double blocks the same way, for at most DOUBLE_TIMEOUT (its own safety net; a GPU has none).
# ncclCommAbort must not run while another thread is inside a call on the same blocking
# communicator (gpu-reality.md: safe only for nonblocking communicators with no concurrent call;
# CuPy 14.2's NcclConfig cannot make a nonblocking one): the double raises, and records it in
# ``misuse``, since an engine may swallow abort's errors.
misuse: list[str] = []


class _Inside:
    """The calling thread is inside an NCCL call on ``comm`` for the block."""

    __slots__ = ("comm", "me")

    def __init__(self, comm: FakeCommunicator) -> None:
        self.comm, self.me = comm, threading.get_ident()

    def __enter__(self) -> None:
        with _cond:
            inside = self.comm._inside
            inside[self.me] = inside.get(self.me, 0) + 1

    def __exit__(self, *exc: Any) -> None:
        with _cond:
            inside = self.comm._inside
            inside[self.me] -= 1
            if not inside[self.me]:
                del inside[self.me]


def _connect(comm: FakeCommunicator, key: tuple, what: str) -> None:
    """NCCL's runtime connection for ``key`` (("collective", kind) or ("p2p", (a, b))): block the
    calling thread until every rank it joins has asked for it too."""
    clique = comm._clique
    needed = set(range(clique.size)) if key[0] == "collective" else set(key[1])
    with _cond:
        if key in clique.connected:
            return
        clique.arrivals.setdefault(key, set()).add(comm._rank)
        _cond.notify_all()
    with _Inside(comm):
        _wait(lambda: key in clique.connected or clique.arrivals[key] >= needed or clique.error is not None,
              f"{what}: NCCL's runtime connection (first use, NCCL_RUNTIME_CONNECT=1) waiting for ranks "
              f"{sorted(needed - clique.arrivals[key])}")
    with _cond:
        if clique.arrivals[key] >= needed:
            clique.connected.add(key)


def _connect_group() -> None:
    """At the outermost groupEnd: the connections the group's operations need (each blocks)."""
    pending, _tls.connects = getattr(_tls, "connects", []), []
    for comm, key, what in pending:
        _connect(comm, key, what)


# --------------------------------------------------------------------------- the NCCL module


class _Op:
    """One rank's part of an operation, on its stream."""

    def __init__(self, kind: str, key: tuple, args: dict[str, Any], deps: list[Any], group: _Group | None) -> None:
        self.kind, self.key, self.args, self.deps, self.group = kind, key, args, deps, group
        self.done = False

    @property
    def ready(self) -> bool:
        return (self.group is None or self.group.closed) and all(d.done for d in self.deps)


class _Clique:
    """The ranks of one communicator: their posted collectives and point-to-point messages."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.members: dict[int, FakeCommunicator] = {}
        self.collectives: list[list[_Op]] = [[] for _ in range(size)]  # per rank, not yet performed
        self.posted = [0] * size
        self.history: list[tuple] = []  # signature of collective k, from the first rank to post it
        self.sends: dict[tuple[int, int], list[_Op]] = {}
        self.recvs: dict[tuple[int, int], list[_Op]] = {}
        self.splits: list[dict[int, tuple[int, int]]] = []
        self.split_results: list[dict[int, Any]] = []
        self.error: str | None = None
        self.destroying: set[int] = set()  # ranks that entered ncclCommDestroy
        self.arrivals: dict[tuple, set[int]] = {}  # blocking calls: who asked for each runtime connection
        self.connected: set[tuple] = set()

    def fail(self, why: str) -> None:
        if self.error is None:
            self.error = why
        for ops in self.collectives:
            for op in ops:
                op.done = True
        for ops in itertools.chain(self.sends.values(), self.recvs.values()):
            for op in ops:
                op.done = True

    def step(self) -> bool:
        """Perform every operation whose parts are all ready; True if any was."""
        moved = False
        while all(self.collectives) and all(ops[0].ready for ops in self.collectives):
            parts = [ops.pop(0) for ops in self.collectives]
            try:
                _perform(parts)
            except Exception as exc:  # reported through check_async_error, as NCCL does
                self.fail(f"{type(exc).__name__}: {exc}")
            for op in parts:
                op.done = True
            moved = True
        for pair, sends in self.sends.items():
            recvs = self.recvs.get(pair, [])
            while sends and recvs and sends[0].ready and recvs[0].ready:
                s, r = sends.pop(0), recvs.pop(0)
                if (s.args["count"], s.args["datatype"]) != (r.args["count"], r.args["datatype"]):
                    self.fail(f"double: rank {pair[0]} sends {s.args['count']} of datatype {s.args['datatype']} "
                              f"but rank {pair[1]} receives {r.args['count']} of datatype {r.args['datatype']}")
                else:
                    dtype = _TYPES[s.args["datatype"]]
                    if r.args["count"]:  # a 0-element message moves nothing (its pointers may be 0)
                        _region(r.args["buf"], r.args["count"], dtype)[...] = _region(s.args["buf"], s.args["count"],
                                                                                      dtype)
                s.done = r.done = True
                moved = True
        return moved


def _progress() -> None:
    """Perform what can be performed, everywhere (hold ``_cond``)."""
    while any(c.step() for c in list(_cliques.values()) if c.error is None):
        pass
    _cond.notify_all()


# --------------------------------------------------------------------------- arithmetic
# NCCL's reductions, as the device code computes them (NCCL src/enqueue.cc hostToDevRedOp,
# src/device/reduce_kernel.h):
# * ncclAvg on floating types is FuncPreMulSum: every input is first multiplied by the scalar
#   1/nRanks *in its own type* (fp16 and bf16 too: float(1.0/nRanks) rounded to half), then
#   summed, each addition rounded in that type. fp16 AVG at 7 ranks of 512 inputs in [0.5, 2] so
#   differs by up to 1.5e-3 from the exact mean and 1.7e-3 from fp16 sum/n (1.4e-3;
#   tests/test_nccl_strict.py::test_fp16_avg_at_7_ranks_is_premultiplied_and_within_the_tolerance).
# * ncclAvg on integer types is FuncSumPostDiv: the wrapping sum, then divided by nRanks with the
#   quotient truncated toward zero (|x| / n, negated back for a negative signed sum).
# * SUM/PROD/MIN/MAX accumulate in the type. The double adds in rank order (NCCL's ring order
#   differs per chunk: tolerances must not depend on the order).
def _reduce(op: int, parts: list[np.ndarray]) -> np.ndarray:
    n = len(parts)
    dtype = parts[0].dtype
    if op == 4 and dtype.kind not in "iu":  # PreMulSum, in the type itself
        scale = dtype.type(1.0 / n)
        acc = parts[0] * scale
        for p in parts[1:]:
            acc = (acc + p * scale).astype(dtype)
        return acc.astype(dtype)
    acc = parts[0].copy()
    with np.errstate(over="ignore"):  # integer sums wrap, as on the device
        for p in parts[1:]:
            {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum, 4: np.add}[op](acc, p, out=acc)
    if op == 4:  # SumPostDiv: truncated toward zero, on the magnitude's unsigned bits
        unsigned = np.dtype(f"u{dtype.itemsize}")
        bits = acc.view(unsigned)
        negative = acc < 0 if dtype.kind == "i" else np.zeros(acc.shape, bool)
        magnitude = np.where(negative, (~bits + unsigned.type(1)).astype(unsigned), bits)
        quotient = (magnitude // unsigned.type(n)).astype(unsigned)
        acc = np.where(negative, (~quotient + unsigned.type(1)).astype(unsigned), quotient).view(dtype)
    return acc


#: The first NCCL whose one-rank ncclAvg of floats writes every element (2.29.7: NVIDIA/nccl issue 1950).
ONE_RANK_AVG_FIXED = 22907


def one_rank_avg_written(count: int, itemsize: int, version: int) -> int:
    """How many leading elements NCCL ``version``'s one-rank ncclAvg of a floating type writes.

    Before 2.29.7 its kernel (oneRankReduce in src/device/onerank.cu) splits ``count`` over
    ``bn = min(32, ceil(bytes / 16 KiB))`` blocks of ``align_up(count // bn, 16 // itemsize)``
    elements, and the elements past ``bn`` such blocks are never written: out-of-place, they keep
    whatever the output held. Seen on an H200 with NCCL 2.28.9 (reduceScatter, 1 rank): float64
    4160 -> 4158, 2049 -> 2048, 1048581 -> 1048576; float32 4161 -> 4160, 100003 -> 100000; all
    written for float64 2048 and float32 4160 (tests/test_nccl_strict.py holds the table)."""
    if version >= ONE_RANK_AVG_FIXED or count == 0:
        return count
    blocks = min(32, -(-count * itemsize // (16 << 10)))
    pack = 16 // itemsize
    per_block = -(-(count // blocks) // pack) * pack
    return min(count, blocks * per_block)


def _write_reduced(recv: np.ndarray, op: int, sends: list[np.ndarray]) -> None:
    """``recv[...] = `` the reduction, as NCCL writes it: a one-rank ncclAvg of floats (PreMulSum) before
    2.29.7 leaves its tail unwritten (:func:`one_rank_avg_written`); every other case writes all."""
    result = _reduce(op, sends)
    if len(sends) == 1 and op == 4 and result.dtype.kind not in "iu":
        written = one_rank_avg_written(result.size, result.dtype.itemsize, fake_nccl.version)
        recv[:written] = result[:written]
        return
    recv[...] = result


def _perform(parts: list[_Op]) -> None:
    """One collective, all ranks' parts ready: read every send buffer, then write."""
    a = parts[0].args
    kind, count, dtype = parts[0].kind, a["count"], _TYPES[a["datatype"]]
    sends = [_region(p.args["send"], count * (len(parts) if kind == "reduceScatter" else 1), dtype).copy()
             for p in parts]
    for rank, p in enumerate(parts):
        if kind == "allReduce":
            _write_reduced(_region(p.args["recv"], count, dtype), a["op"], sends)
        elif kind == "reduce" and rank == a["root"]:
            _write_reduced(_region(p.args["recv"], count, dtype), a["op"], sends)
        elif kind == "broadcast":
            _region(p.args["recv"], count, dtype)[...] = sends[a["root"]]
        elif kind == "allGather":
            _region(p.args["recv"], count * len(parts), dtype)[...] = np.concatenate(sends)
        elif kind == "reduceScatter":
            _write_reduced(_region(p.args["recv"], count, dtype), a["op"],
                           [s[rank * count:(rank + 1) * count] for s in sends])


def _check_buffer(comm: FakeCommunicator, what: str, ptr: int, count: int, datatype: int) -> None:
    if datatype not in _TYPES:
        raise FakeNcclError(f"double: {what}: datatype {datatype} is not an NCCL datatype the double knows "
                            f"(valid: {sorted(_TYPES)})")
    if count == 0:  # NCCL reads no pointer for 0 elements (CuPy's pointer of an empty array is 0)
        return
    nbytes = count * _TYPES[datatype].itemsize
    owner = _owner(ptr, max(nbytes, 1))
    if owner is None:
        raise FakeNcclError(f"double: {what}: {count} elements of datatype {datatype} at {ptr:#x} do not lie "
                            "inside a live device allocation")
    if owner._device != comm._device:
        raise FakeNcclError(f"double: {what}: buffer on device {owner._device}, communicator on {comm._device}")
    have, want = owner.dtype, _TYPES[datatype]
    if not (have == want or datatype in (0, 1) or (have.kind == "c" and have.itemsize == 2 * want.itemsize
                                                     and want.kind == "f")):
        raise FakeNcclError(f"double: {what}: datatype {datatype} ({want}) does not match the buffer's dtype {have}")


class FakeCommunicator:
    """``cupy.cuda.nccl.NcclCommunicator`` with the same methods and argument names."""

    def __init__(self, ndev: int, commId: bytes, rank: int, config: Any = None) -> None:  # noqa: N803
        if _nonblocking():  # ncclCommInitRank returns ncclInProgress, which CuPy 14.2 cannot name
            raise _nccl_status_error(NCCL_IN_PROGRESS)
        with _cond:
            clique = _cliques.get(bytes(commId))
            if clique is None:
                clique = _cliques[bytes(commId)] = _Clique(ndev)
            self._join(clique, ndev, rank)
            _cond.notify_all()
        # Blocking calls: ncclCommInitRank returns once every rank joined.
        with _Inside(self):
            _wait(lambda: len(clique.members) == clique.size, f"NcclCommunicator(ndev={ndev}, rank={rank}): "
                  f"ncclCommInitRank waiting for ranks {sorted(set(range(ndev)) - set(clique.members))}")

    def _join(self, clique: _Clique, ndev: int, rank: int) -> None:
        if ndev != clique.size or not 0 <= rank < ndev or rank in clique.members:
            raise FakeNcclError(f"double: NcclCommunicator(ndev={ndev}, rank={rank}) does not fit a clique of "
                                f"{clique.size} with ranks {sorted(clique.members)} already")
        device = _device()
        gpu = _physical(device)
        # init.cc (initTransportsRank): two ranks with the same host hash and PCI bus id are
        # "Duplicate GPU detected : rank %d and rank %d both on CUDA device %lx" (ncclInvalidUsage);
        # NCCL 2.30 lets them share with NCCL_MULTI_RANK_GPU_ENABLE=1 (gpu-reality.md).
        shares = fake_nccl.get_version() >= 23000 and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1"
        for other, m in clique.members.items():
            if m._gpu == gpu and not shares:
                raise FakeNcclError(f"double: ncclInvalidUsage: Duplicate GPU detected : rank {rank} and rank {other} "
                                    f"both on CUDA device {gpu}")
        runtime_connect = os.environ.get("NCCL_RUNTIME_CONNECT", "1").strip() != "0"  # read at init
        self._member_of(clique, rank, device, gpu, runtime_connect)

    def _member_of(self, clique: _Clique, rank: int, device: int, gpu: Any, runtime_connect: bool) -> None:
        """This handle becomes rank ``rank`` of ``clique`` (under ``_cond``)."""
        self._clique, self._rank, self._device, self._destroyed = clique, rank, device, False
        self._gpu, self._runtime_connect = gpu, runtime_connect
        self._aborted, self._injected, self._destroying = False, None, False
        self._inside: dict[int, int] = {}  # blocking calls: threads inside a call on this communicator
        self._handle = next(_ids)  # CuPy's ncclComm_t: 0 once destroyed or aborted
        clique.members[rank] = self

    # ------------------------------------------------------------------ checks
    def _post(self, kind: str, stream: int, collective: bool, key: tuple = (), **args: Any) -> None:
        if self._destroyed:
            raise FakeNcclError(f"double: {kind} on a destroyed communicator")
        clique = self._clique
        if clique.error is not None:
            raise FakeNcclError(f"double: {kind}: communicator failed earlier: {clique.error}")
        s = _stream(stream)
        if s.device != self._device:
            raise FakeNcclError(f"double: {kind}: stream of device {s.device} on a communicator of device "
                                f"{self._device}")
        caller = _current()
        if not s.ordered_after(caller):
            raise FakeNcclError(f"double: {kind}: the stream argument is not ordered after the caller's current "
                                f"stream (write #{caller.work} on it); record an event there and wait_event it")
        with _cond:
            group = getattr(_tls, "group", None)
            if group is None:
                op = _Op(kind, key, args, [e for e in s.pending if not e.done], None)
                s.pending = [e for e in s.pending if not e.done] + [op]
            else:  # on its stream at the outermost groupEnd (see "groups" above)
                op = _Op(kind, key, args, [], group)
                group.queued.append((s, op))
            if collective:
                k = clique.posted[self._rank]
                clique.posted[self._rank] = k + 1
                signature = (kind, *key)
                if k == len(clique.history):
                    clique.history.append(signature)
                elif clique.history[k] != signature:
                    why = (f"double: collective #{k}: rank {self._rank} issued {signature}, another rank "
                           f"{clique.history[k]}")
                    clique.fail(why)
                    _progress()
                    raise FakeNcclError(why)
                clique.collectives[self._rank].append(op)
            elif kind == "send":
                clique.sends.setdefault((self._rank, args["peer"]), []).append(op)
            else:
                clique.recvs.setdefault((args["peer"], self._rank), []).append(op)
            _progress()
        if self._runtime_connect:  # blocking calls: the first use of a connection waits for the peers
            key = ("collective", kind) if collective else ("p2p", tuple(sorted((self._rank, args["peer"]))))
            if key not in clique.connected:
                what = f"rank {self._rank}: {kind}"
                if group is not None:
                    _tls.connects = [*getattr(_tls, "connects", []), (self, key, what)]
                else:
                    _connect(self, key, what)

    def _collective(self, kind: str, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int | None,
                    root: int | None, stream: int, recv_count: int | None = None,
                    send_count: int | None = None) -> None:
        if not self._handle:  # CuPy passes its NULL handle on: NCCL's CommCheck refuses it
            raise _nccl_status_error(4)
        if op is not None and op not in _OPS:
            raise FakeNcclError(f"double: {kind}: op {op} is not an NCCL reduction (valid: {sorted(_OPS)})")
        if op == 4 and fake_nccl.version < 21000:  # ncclAvg is new in 2.10: before, op 4 >= ncclNumOps (argcheck.cc)
            raise _nccl_status_error(4)
        if root is not None and not 0 <= root < self._clique.size:
            raise FakeNcclError(f"double: {kind}: root {root} out of range for {self._clique.size} ranks")
        _check_buffer(self, f"{kind} sendbuf", sendbuf, count if send_count is None else send_count, datatype)
        if recvbuf or kind != "reduce" or root == self._rank:
            _check_buffer(self, f"{kind} recvbuf", recvbuf, count if recv_count is None else recv_count, datatype)
        if count == 0:  # NCCL src/enqueue.cc taskAppend: "Empty collectives can be discarded." (after ArgsCheck)
            return
        self._post(kind, stream, True, (count, datatype, op, root), send=sendbuf, recv=recvbuf, count=count,
                   datatype=datatype, op=op, root=root)

    # ------------------------------------------------------------------ NcclCommunicator's methods
    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,  # noqa: N802
                  stream: int) -> None:
        self._collective("allReduce", sendbuf, recvbuf, count, datatype, op, None, stream)

    def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, root: int, stream: int) -> None:
        self._collective("reduce", sendbuf, recvbuf, count, datatype, op, root, stream)

    def broadcast(self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int, stream: int) -> None:
        self._collective("broadcast", sendbuff, recvbuff, count, datatype, None, root, stream)

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
        self._collective("broadcast", buff, buff, count, datatype, None, root, stream)

    def reduceScatter(self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int, op: int,  # noqa: N802
                      stream: int) -> None:
        self._collective("reduceScatter", sendbuf, recvbuf, recvcount, datatype, op, None, stream,
                         send_count=recvcount * self._clique.size)

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:  # noqa: N802
        self._collective("allGather", sendbuf, recvbuf, count, datatype, None, None, stream,
                         recv_count=count * self._clique.size)

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._p2p("send", sendbuf, count, datatype, peer, stream)

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._p2p("recv", recvbuf, count, datatype, peer, stream)

    def _p2p(self, kind: str, buf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        if not 0 <= peer < self._clique.size:
            raise FakeNcclError(f"double: {kind}: peer {peer} out of range for {self._clique.size} ranks")
        if not self._handle:
            raise _nccl_status_error(4)
        _check_buffer(self, f"{kind} buffer", buf, count, datatype)
        self._post(kind, stream, False, buf=buf, count=count, datatype=datatype, peer=peer)

    def commSplit(self, color: int, key: int, config: Any = None) -> FakeCommunicator | None:  # noqa: N802
        if fake_nccl.version < 21800:  # ncclCommSplit is new in NCCL 2.18 (user guide, ncclCommSplit)
            raise FakeNcclError(f"double: ncclCommSplit does not exist in NCCL {fake_nccl.version} (added in 2.18)")
        if not self._handle:
            raise _nccl_status_error(4)
        if _nonblocking():  # as ncclCommInitRank: ncclInProgress
            raise _nccl_status_error(NCCL_IN_PROGRESS)
        clique = self._clique
        with _cond:
            k = sum(1 for s in clique.splits if self._rank in s)
            if k == len(clique.splits):
                clique.splits.append({})
                clique.split_results.append({})
            clique.splits[k][self._rank] = (color, key)
            if len(clique.splits[k]) == clique.size:  # the last to arrive forms the new communicators
                colors = {c for c, _ in clique.splits[k].values() if c >= 0}
                for c in colors:
                    ranks = sorted((kk, r) for r, (cc, kk) in clique.splits[k].items() if cc == c)
                    child = _Clique(len(ranks))
                    _cliques[os.urandom(16)] = child
                    for new_rank, (_, r) in enumerate(ranks):
                        clique.split_results[k][r] = (child, new_rank)
                _cond.notify_all()
        with _Inside(self):  # blocking calls: commSplit returns once every rank of the parent called it
            _wait(lambda: len(clique.splits[k]) == clique.size, f"commSplit #{k} on every rank")
        found = clique.split_results[k].get(self._rank)
        if color < 0 or found is None:
            return None
        out = FakeCommunicator.__new__(FakeCommunicator)
        with _cond:
            out._member_of(found[0], found[1], self._device, self._gpu, self._runtime_connect)
        return out

    # ------------------------------------------------------------------ communicator lifecycle
    # CuPy 14.2 cupy_backends/cuda/libs/nccl.pyx: destroy() and abort() call ncclCommDestroy /
    # ncclCommAbort only ``if self._comm`` and then set the handle to 0; every other method passes
    # the handle on, and NCCL refuses a NULL communicator with ncclInvalidArgument (src/argcheck.cc
    # CommCheck), so check_async_error() after destroy() raises NCCL_ERROR_INVALID_ARGUMENT.
    # ncclCommDestroy blocks the host: it finalizes the rank's outstanding operations and is an
    # intra-node collective (src/init.cc ncclCommDestroy -> commReclaim waits for the other local
    # ranks of the communicator; the "takes milliseconds"): the double waits until every
    # member entered it (or aborted) and then takes DESTROY_SECONDS. Querying a communicator while
    # another thread destroys it reads freed memory in NCCL: the double refuses it.
    def destroy(self) -> None:
        if not self._handle:  # CuPy: a destroyed or aborted communicator's destroy() does nothing
            return
        if getattr(_tls, "depth", 0):
            raise FakeNcclError("double: destroy() inside groupStart()/groupEnd()")
        clique = self._clique
        with _cond:
            mine = [*clique.collectives[self._rank],
                    *(op for (a, b), ops in [*clique.sends.items(), *clique.recvs.items()] if self._rank in (a, b)
                      for op in ops)]
            self._destroying = True
        try:
            with _Inside(self):  # blocking calls: an abort beside a destroy is misuse
                # ncclCommDestroy finalizes first: the operations this rank issued complete (their peers
                # still have to issue theirs); an aborted or failed communicator has nothing to finish.
                _wait(lambda: clique.error is not None or all(op.done for op in mine), "ncclCommDestroy's finalize")
                with _cond:
                    clique.destroying.add(self._rank)
                    _cond.notify_all()
                _wait(lambda: clique.error is not None or all(r in clique.destroying or m._aborted
                                                              for r, m in clique.members.items()),
                      f"ncclCommDestroy: every rank of the communicator destroying it (rank {self._rank} waits for "
                      f"ranks {sorted(set(clique.members) - clique.destroying)})")
                time.sleep(DESTROY_SECONDS)
        finally:
            with _cond:
                self._destroying, self._destroyed, self._handle = False, True, 0
                if all(m._destroyed for m in clique.members.values()):  # forget it: progress scans every clique
                    for key in [k for k, c in _cliques.items() if c is clique]:
                        del _cliques[key]

    def abort(self) -> None:
        """ncclCommAbort on this rank only: its own operations stop (its streams go on, past
        them); the other ranks are told nothing, and their parts of operations that needed this
        rank never complete (on a GPU their kernels spin), until they abort too."""
        if not self._handle:  # CuPy: nothing to abort once the handle is 0
            return
        clique = self._clique
        with _cond:
            others = sorted(t for t in self._inside if t != threading.get_ident())
            if others:  # blocking calls: see the section above
                names = [t.name for t in threading.enumerate() if t.ident in others]
                why = (f"double: ncclCommAbort of rank {self._rank} on thread {threading.current_thread().name} while "
                       f"thread(s) {names} are inside an NCCL call on this blocking communicator")
                misuse.append(why)
                raise FakeNcclError(why)
            self._destroyed = self._aborted = True
            self._handle = 0
            ops = clique.collectives[self._rank]
            for op in ops:
                op.done = True
            ops.clear()  # and never refilled (it cannot post): no collective of the clique runs again
            # sends[(a, b)] are rank a's, recvs[(a, b)] rank b's: this rank's own parts stop
            mine = [q for (a, _), q in clique.sends.items() if a == self._rank]
            mine += [q for (_, b), q in clique.recvs.items() if b == self._rank]
            for queue in mine:
                for op in queue:
                    op.done = True
                queue.clear()
            _progress()

    def _check_handle(self, what: str) -> None:
        if self._destroying:
            raise FakeNcclError(f"double: {what} while another thread is inside ncclCommDestroy of this "
                                "communicator (NCCL reads freed memory)")
        if not self._handle:
            raise _nccl_status_error(4)

    def inject_async_error(self, why: str) -> None:
        """Make this rank's ``check_async_error`` report ``why`` from now on, as NCCL reports a
        failure it met while running (a network error, a peer's process dying): for tests."""
        self._injected = why

    def check_async_error(self) -> None:
        self._check_handle("check_async_error")
        if self._injected is not None:
            raise FakeNcclError(self._injected)
        if self._clique.error is not None:
            raise FakeNcclError(self._clique.error)

    def device_id(self) -> int:
        self._check_handle("device_id")
        return self._device

    def rank_id(self) -> int:
        self._check_handle("rank_id")
        return self._rank

    def size(self) -> int:
        self._check_handle("size")
        return self._clique.size

    @property
    def comm(self) -> int:
        return self._handle

    def __del__(self) -> None:
        if _dealloc_destroys and getattr(self, "_handle", 0):
            self.destroy()  # may wait, collectively, for peers that never come: a hang at exit

    @staticmethod
    def initAll(devices: Any) -> None:  # noqa: N802
        raise FakeNcclError("double: initAll (one process driving several GPUs) is not modelled")


def _stream(ptr: int) -> FakeStream:
    with _cond:  # another rank's thread may be adding a stream
        streams = list(_streams)
    for stream in streams:
        if stream.ptr == ptr:
            return stream
    raise FakeNcclError(f"double: stream {ptr:#x} is not a stream of the double")


_streams: weakref.WeakSet[FakeStream] = weakref.WeakSet()


class _FakeNcclModule:
    """The parts of ``cupy.cuda.nccl`` the engine uses, with the real constants."""

    NcclCommunicator = FakeCommunicator
    NcclError = FakeNcclError
    available = True

    def __init__(self) -> None:
        for name, value in CONSTANTS.items():
            setattr(self, name, value)
        self.version = 23203  # what nvidia-nccl-cu12 2.32.3 reports

    @staticmethod
    def groupStart() -> None:  # noqa: N802
        _group_start()

    @staticmethod
    def groupEnd() -> None:  # noqa: N802
        _group_end()

    @staticmethod
    def get_unique_id() -> bytes:
        return os.urandom(128)

    @staticmethod
    def get_version() -> int:
        """The runtime NCCL's version (CuPy: ncclGetVersion), FakeRuntime(nccl_version=) sets it."""
        return fake_nccl.version


fake_nccl = _FakeNcclModule()


class _Copy:
    """A host<->device copy on a stream: performed, in order, the first time anyone asks
    whether it is done once the entries before it are."""

    __slots__ = ("deps", "src", "dst", "_done")

    def __init__(self, deps: list[Any], src: np.ndarray, dst: np.ndarray) -> None:
        self.deps, self.src, self.dst, self._done = deps, src, dst, False

    @property
    def done(self) -> bool:
        if not self._done and all(d.done for d in self.deps):
            np.copyto(self.dst, self.src)
            self._done = True
        return self._done


class FakeRuntime:
    """The runtime of :mod:`meshkit.comm.engines.cuda_runtime`, over the double.

    Counts what MPI staging does: ``pinned_allocations``, ``copies_to_host``, ``copies_to_device``.
    """

    nccl = fake_nccl

    def __init__(self, devices: int = 8, *, nccl_version: int = 23203, dealloc: bool = False) -> None:
        global _dealloc_destroys
        self.devices = devices
        fake_nccl.version = nccl_version  # what nccl.get_version() reports (NCCL's runtime, not CuPy's build)
        _dealloc_destroys = dealloc
        self.pinned_allocations = 0
        self.copies_to_host = 0
        self.copies_to_device = 0
        self._pinned: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()
        with _cond:  # fresh GPUs: an earlier test's stream left waiting (a hang it tested) does not leak here
            _null_streams.clear()

    def pinned_empty(self, shape: Any, dtype: Any) -> np.ndarray:
        buf = np.empty(shape, dtype)
        with _cond:
            self.pinned_allocations += 1
            self._pinned[id(buf)] = buf
        return buf

    def _check_pinned(self, what: str, x: Any) -> None:
        base = x
        while isinstance(base, np.ndarray) and isinstance(base.base, np.ndarray):
            base = base.base
        if isinstance(x, DeviceArray) or not isinstance(x, np.ndarray) or self._pinned.get(id(base)) is not base:
            raise FakeNcclError(f"double: {what}: {type(x).__name__} is not a buffer of pinned_empty "
                                "(a pageable copy would be synchronous)")

    def _copy(self, what: str, device: Any, host: Any, stream: Any, to_device: bool) -> None:
        self._check_pinned(what, host)
        device = getattr(device, "_device_memory", device)  # tests/doubles/fake_cupy.py's arrays wrap a DeviceArray
        if not isinstance(device, DeviceArray) or (device.nbytes and _owner(device.__array_interface__["data"][0],
                                                                            device.nbytes) is None):
            raise FakeNcclError(f"double: {what}: {type(device).__name__} is not live device memory")
        if host.shape != device.shape or host.dtype != device.dtype:  # CuPy's get(out=)/set() check both
            raise FakeNcclError(f"double: {what}: host buffer of shape {host.shape} {host.dtype} for a device array "
                                f"of shape {device.shape} {device.dtype}")
        if not isinstance(stream, FakeStream):
            raise FakeNcclError(f"double: {what}: {stream!r} is not a stream of the double")
        if to_device:
            # A copy into device memory must come after the writes queued to it before (or it is
            # overwritten by them); writes the caller queued since, elsewhere, are no hazard, so it
            # may run on a stream that waited only for what the caller had queued when it began.
            last, work, entry = getattr(_allocation(device), "_written", (None, -1, None))
            finished = entry is not None and entry._done  # a copy the host has seen complete
            if last is not None and last is not stream and not finished and stream.waited.get(last, -1) < work:
                raise FakeNcclError(f"double: {what}: the stream is not ordered after write #{work} to the device "
                                    "array on another stream: that write could overwrite the copy")
        else:
            caller = _current()
            if not stream.ordered_after(caller):
                raise FakeNcclError(f"double: {what}: the stream is not ordered after the caller's current stream "
                                    f"(write #{caller.work} on it): the copy could miss the caller's writes")
        dev = device.view(np.ndarray).reshape(-1)
        src, dst = (host.reshape(-1), dev) if to_device else (dev, host.reshape(-1))
        with _cond:
            pending = [e for e in stream.pending if not e.done]
            copy = _Copy(pending, src, dst)
            stream.pending = pending + [copy]
            if to_device:
                _wrote(stream, device, copy)
                self.copies_to_device += 1
            else:
                self.copies_to_host += 1

    def copy_to_host(self, src: Any, dst: Any, stream: Any) -> None:
        self._copy("copy_to_host", src, dst, stream, False)

    def copy_to_device(self, src: Any, dst: Any, stream: Any) -> None:
        self._copy("copy_to_device", dst, src, stream, True)

    def device_count(self) -> int:
        visible = getattr(_tls, "visible", None)
        return self.devices if visible is None else len(visible)

    def use_device(self, index: int) -> None:
        if not 0 <= index < self.device_count():
            raise FakeNcclError(f"double: cudaErrorInvalidDevice: device {index} does not exist "
                                f"({self.device_count()} devices)")
        _tls.device = index

    @staticmethod
    def current_device() -> int:
        return _device()

    @staticmethod
    def device_of(x: Any) -> int:
        a = getattr(x, "_device_memory", x)  # tests/doubles/fake_cupy.py's arrays wrap a DeviceArray
        if isinstance(a, DeviceArray):  # also an empty one (CuPy's ``x.device``)
            return a.device_id
        owner = _owner(int(x.__cuda_array_interface__["data"][0]))
        if owner is None:
            raise FakeNcclError("double: cudaErrorInvalidValue: pointerGetAttributes of memory that is not a live "
                                "device allocation")
        return owner._device

    def pci_bus_id(self, index: int) -> str:
        """CupyRuntime.pci_bus_id: the physical GPU's bus id (the double's GPUs are one machine's)."""
        if not 0 <= index < self.device_count():
            raise FakeNcclError(f"double: cudaErrorInvalidDevice: device {index} does not exist "
                                f"({self.device_count()} devices)")
        return f"0000:{_physical(index):02x}:00.0"

    def new_stream(self) -> FakeStream:
        stream = FakeStream(_device())
        with _cond:
            _streams.add(stream)
        return stream

    @staticmethod
    def new_event() -> FakeEvent:
        return FakeEvent()

    @staticmethod
    def event_done(event: FakeEvent) -> bool:
        """CupyRuntime.event_done: True once fired, False while pending, the CUDA error of a fault
        (see "event status")."""
        status = event.status
        if status == CUDA_SUCCESS:
            return True
        if status == CUDA_NOT_READY:
            return False
        raise FakeCudaError(status)

    @staticmethod
    def current_stream() -> FakeStream:
        return _current()

    @staticmethod
    def is_device_array(x: Any) -> bool:
        from meshkit.comm._seams import is_device_array  # meshkit's one rule, as CupyRuntime's

        return is_device_array(x)

    @staticmethod
    def pointer(x: Any) -> int:
        return int(x.__cuda_array_interface__["data"][0])


# --------------------------------------------------------------------------- cupy.cuda.runtime
# What CupyRuntime reads of a GPU's identity, from a double of ``cupy.cuda.runtime`` (CuPy 14.2
# cupy_backends/cuda/api/runtime.pyx). ``getDeviceProperties(i)["uuid"]`` is ``props.uuid.bytes``,
# the ``char[16]`` of cudaUUID_t, which Cython converts as a C string: cut at the first zero byte
# (cython issue 3234: "autoconverts uint8_t[32] using PyObject_FromCString(), stopping at NUL
# bytes"), so GPUs whose UUIDs agree up to a zero byte read alike. ``deviceGetPCIBusId`` returns
# cudaDeviceGetPCIBusId's text whole (a 13-byte buffer, upper-case hex as the driver writes it).
class FakeGpu:
    """One GPU as CUDA describes it: its 16-byte UUID and PCI location."""

    def __init__(self, uuid: bytes, bus: int, domain: int = 0, device: int = 0) -> None:
        if len(uuid) != 16:
            raise ValueError(f"double: a CUDA UUID is 16 bytes, got {len(uuid)}")
        self.uuid, self.bus, self.domain, self.device = uuid, bus, domain, device


class FakeCudaRuntimeModule:
    """``cupy.cuda.runtime`` for the device calls of CupyRuntime (argument names as CuPy's)."""

    def __init__(self, gpus: list[FakeGpu]) -> None:
        self.gpus = list(gpus)

    def getDeviceCount(self) -> int:  # noqa: N802 (CuPy's name)
        return len(self.gpus)

    def _gpu(self, device: int) -> FakeGpu:
        if not 0 <= device < len(self.gpus):
            raise FakeNcclError(f"double: cudaErrorInvalidDevice: device {device} does not exist")
        return self.gpus[device]

    def getDeviceProperties(self, device: int) -> dict[str, Any]:  # noqa: N802
        gpu = self._gpu(device)
        cut = gpu.uuid.split(b"\0", 1)[0]  # Cython's char[16] -> bytes: up to the first zero byte
        return {"name": b"double GPU", "uuid": cut, "pciBusID": gpu.bus, "pciDomainID": gpu.domain,
                "pciDeviceID": gpu.device}

    def deviceGetPCIBusId(self, device: int) -> str:  # noqa: N802
        gpu = self._gpu(device)
        return f"{gpu.domain:04X}:{gpu.bus:02X}:{gpu.device:02X}.0"
