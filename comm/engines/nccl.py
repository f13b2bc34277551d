"""The NCCL engine: device arrays over NCCL, host arrays and objects over the host engine.

A group on the ``nccl`` backend holds one :class:`NCCLEngine`, which composes two engines of
the same ranks: a host engine (MPI in a job, the in-process hub inside ``local.run``) and one
``NcclCommunicator``. Every call is routed by where its arrays live: device arrays (anything
with ``__cuda_array_interface__``, e.g. CuPy) go to NCCL, NumPy arrays to the host engine (as
torch's default ``cpu:gloo,cuda:nccl``), and a call that mixes both is a TypeError naming both.
Object collectives, ``monitored_barrier``, detail-mode checks (``exchange``) and ``barrier``
run on the host engine.

Creation: the world's communicator comes from a unique id made on rank 0 and broadcast over
the host engine (no rendezvous server), on the device ``init_process_group(device_id=...)``,
else ``MESHKIT_DEVICE_ID``, else the node-local rank modulo the GPUs the process sees names
(:mod:`.nccl_creation`); sub-groups come from ``commSplit`` beside the host engine's split
(:meth:`NCCLEngine.split`), so a mesh still costs one split per dimension.

Streams, as torch does it. Each engine owns a communication stream. Every collective records
an event on the caller's current stream and makes the communication stream wait on it (the
collective sees the caller's writes, with no host synchronization), is issued on the
communication stream (``groupStart``/``groupEnd`` around the send/recv of gather, scatter and
all_to_all), and records a *done* event there. The returned request's ``Test()`` queries that
event's status (a fired event is success; a CUDA fault is raised, named) and, while it has not
fired, polls ``check_async_error`` (never on a communicator destroyed or being destroyed). A
process exiting without ``destroy_process_group`` aborts its communicators at exit. Waiting has
two forms:

* a synchronous call (``async_op=False``) blocks the host until the done event fires, under
  the group's timeout, reading notices from other ranks meanwhile (``Engine.wait``); on a
  timeout, an asynchronous NCCL error or a peer's failure the group breaks, which aborts the
  communicator (:meth:`NCCLEngine.abandon`) and tells the other members; the error names the
  operation, and a timeout the ranks that did not arrive (the members that had arrived fail
  at once on the notice and say so: see ``ProcessGroup._not_arrived``);
* ``Work.wait()`` of an ``async_op=True`` call makes the caller's current stream wait on the
  done event (:meth:`NCCLEngine.defer`) and returns at once, as torch's does; the work counts
  as finished for the host. Its buffers stay referenced by the engine until the event fires.

Each rank drives one GPU: every call makes the engine's device the calling thread's current
device (CuPy's ``Device.use()``), so that a communication thread issues on the right device.
Async collectives start at once (``capabilities.queues`` False: the group does not hold them back behind
the one before, as it does for MPI), since the communication stream runs them in order.

Everything GPU-specific goes through the runtime of :mod:`meshkit.comm.engines.cuda_runtime`.
The engine's parts are modules of their own: its requests (:mod:`.nccl_requests`), the batches of
``batch_isend_irecv`` (:mod:`.nccl_coalescing`), the guard of the communicator's handle, which
aborts it (:mod:`.nccl_abort`), and the world communicator's creation (:mod:`.nccl_creation`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable

from . import nccl_coalescing
from .engine import DeadlineExceeded, EngineCapabilities
from .nccl_abort import CommGuard
from .nccl_requests import DeviceRequest, HostAverage
from ..errors import DistBackendError, DistTypeError, DistValueError
from ..notices import WATCH_INTERVAL, Notice
from ..reduce_op import ReduceOp

__all__ = ["NCCLEngine", "DeviceRequest", "NCCL_DTYPES", "NCCL_OPS"]

#: NumPy dtype name -> NCCL datatype constant. Other dtypes move as bytes (NCCL_UINT8) and
#: cannot be reduced, except bool (as uint8: MIN/BAND, MAX/BOR) and complex (SUM/AVG of the
#: real and imaginary parts as floats).
NCCL_DTYPES = {"int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32", "uint32": "NCCL_UINT32",
               "int64": "NCCL_INT64", "uint64": "NCCL_UINT64", "float16": "NCCL_FLOAT16",
               "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64", "bfloat16": "NCCL_BFLOAT16"}
#: ReduceOp -> NCCL reduction constant (NCCL has no bitwise ops; AVG is NCCL's own).
NCCL_OPS = {ReduceOp.SUM: "NCCL_SUM", ReduceOp.AVG: "NCCL_AVG", ReduceOp.PRODUCT: "NCCL_PROD",
            ReduceOp.MIN: "NCCL_MIN", ReduceOp.MAX: "NCCL_MAX"}
_BOOL_OPS = {ReduceOp.MIN: "NCCL_MIN", ReduceOp.BAND: "NCCL_MIN", ReduceOp.MAX: "NCCL_MAX", ReduceOp.BOR: "NCCL_MAX"}
_COMPLEX_PARTS = {"complex64": "float32", "complex128": "float64"}
#: NCCL runtime versions (``nccl.get_version()``, major*10000 + minor*100 + patch) that brought what
#: the engine uses: ncclCommSplit in 2.18, ncclAvg in 2.10 (NCCL release notes / user guide). CuPy
#: checks only the NCCL it was built against; the library loaded at run time may be older.
_SPLIT_VERSION, _AVG_VERSION = 21800, 21000
#: Seconds a blocked caller polls without sleeping before it naps between event queries.
_SPIN_SECONDS = 0.001
_NAP_SECONDS = 0.0001


def _runtime_version(nccl: Any) -> int:
    """The NCCL library's own version, as loaded at run time."""
    try:
        return int(nccl.get_version())
    except Exception as exc:  # no ncclGetVersion: older than anything CuPy 14 supports
        raise DistBackendError(f"meshkit.comm: cannot read the NCCL runtime version ({exc}); the nccl backend "
                               "needs NCCL >= 2.18: pip install -U nvidia-nccl-cu12 (or -cu13)") from None


def _version_text(code: int) -> str:
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


class NCCLEngine:
    """The engine of a group over one NcclCommunicator and a host engine of the same ranks."""

    backend = "nccl"
    native_avg = True
    # queues=False: the stream orders a group's collectives, so each starts when it is called.
    # needs_progress and reports_dtype are the host engine's (its host arrays and objects).
    # watched_requests: device work is watched until done, even after Work.wait() returned; a host
    # array's request (the host engine's) is not
    capabilities = EngineCapabilities(queues=False, defers=True, abandons=True, coalesces=True, aborts_job=True,
                                      watched_requests=(DeviceRequest,))

    def __init__(self, host: Any, comm: Any, rt: Any, device: int) -> None:
        self.host, self.comm, self.rt, self.device = host, comm, rt, device
        self.rank, self.size = host.rank, host.size
        self.max_tag = host.max_tag
        self.capabilities = dataclasses.replace(NCCLEngine.capabilities,
                                                needs_progress=host.capabilities.needs_progress,
                                                reports_dtype=host.capabilities.reports_dtype,
                                                aborts_job=host.capabilities.aborts_job,
                                                # a host over a store (no MPI) moves no host arrays:
                                                # object collectives go through exchange (comm/objects.py)
                                                host_arrays=host.capabilities.host_arrays,
                                                # its peers are whom the host engine's are (they met there)
                                                authenticated_peers=host.capabilities.authenticated_peers)
        nccl = rt.nccl
        self._types = {name: getattr(nccl, const) for name, const in NCCL_DTYPES.items() if hasattr(nccl, const)}
        self._ops = {op: getattr(nccl, const) for op, const in NCCL_OPS.items()}
        self._bool_ops = {op: getattr(nccl, const) for op, const in _BOOL_OPS.items()}
        self._bytes = nccl.NCCL_UINT8
        self._move_types: dict[Any, int | None] = {}  # dtype -> its NCCL type (None: moved as bytes)
        self._reductions: dict[tuple[Any, ReduceOp], tuple[int, int, int]] = {}  # (dtype, op) -> type, count factor, op
        rt.use_device(device)
        self.stream = rt.new_stream()
        self._outstanding: list[DeviceRequest] = []
        self._ready = threading.local()  # each calling thread's event that orders a call after its stream
        # Who may touch the communicator's handle, and its abort (comm/engines/nccl_abort.py).
        self.guard = CommGuard(comm)
        nccl_version = _runtime_version(nccl)
        self.nccl_version = nccl_version
        if nccl_version < _AVG_VERSION:  # no ncclAvg: NCCL sums, the group divides (as on MPI)
            self.native_avg = False
            self._ops = {**self._ops, ReduceOp.AVG: self._ops[ReduceOp.SUM]}
        elif self.size == 1:
            # One rank: the average is the value itself, and NCCL's one-rank SUM is a copy. Its
            # one-rank ncclAvg of floats (a kernel) leaves the last n mod (blocks) elements unwritten
            # before NCCL 2.29.7 (NVIDIA/nccl issue 1950): an out-of-place reduce_scatter then
            # returns garbage there. Seen on an H200 with NCCL 2.28.9: FSDP at one rank trained
            # on garbage gradients (docs/gpus.md).
            self._ops = {**self._ops, ReduceOp.AVG: self._ops[ReduceOp.SUM]}
        self._watch: Callable[[], None] | None = None
        # requests issued since start_coalescing (comm/engines/nccl_coalescing.py), None outside a batch
        self.coalesced: list[DeviceRequest] | None = None

    # ----------------------------------------------------------------- shared with the host engine
    @property
    def watch(self) -> Callable[[], None] | None:
        return self._watch

    @watch.setter
    def watch(self, fn: Callable[[], None] | None) -> None:  # the group's notice reader, for both engines
        self._watch = fn
        self.host.watch = fn

    @property
    def world_ranks(self) -> list[int]:
        return list(self.host.world_ranks)

    def notify(self, ranks: list[int], notice: Notice) -> None:
        self.host.notify(ranks, notice)

    def notices(self) -> list[Notice]:
        return self.host.notices()

    def flush(self, timeout: float) -> None:
        self.host.flush(timeout)

    def abort(self, code: int) -> None:
        """End the whole job (the host engine's abort, e.g. MPI_Abort)."""
        self.host.abort(code)

    def exchange(self, payload: Any, seq: int, deadline: float, *, watched: bool = False) -> list[Any]:
        return self.host.exchange(payload, seq, deadline, watched=watched)

    def host_name(self) -> str:
        return self.host.host_name()

    # ----------------------------------------------------------------- routing and maps
    def _on_device(self, op: str, *named: tuple[str, Any]) -> bool:
        """True if every array given is a device array, False if none is; TypeError if mixed."""
        where = [(name, x, self.rt.is_device_array(x)) for name, x in named if x is not None]
        if all(d for _, _, d in where):
            return True
        if not any(d for _, _, d in where):
            return False
        desc = ", ".join(f"{name} is {type(x).__module__}.{type(x).__name__} ({'device' if d else 'host'})"
                         for name, x, d in where)
        raise DistTypeError(f"meshkit.comm: rank {self._me}: {op}: mixes host (NumPy) and device arrays: {desc}; "
                            "pass all of them on the device or all on the host")

    @property
    def _me(self) -> int:
        return self.world_ranks[self.rank]

    def _moved(self, x: Any) -> tuple[int, int]:
        """``(datatype, count)`` to move ``x``: its own NCCL type, or its bytes."""
        dtype = x.dtype
        try:
            t = self._move_types[dtype]
        except KeyError:  # (a dtype's name is computed in Python by NumPy: looked up once per dtype)
            t = self._move_types[dtype] = self._types.get(dtype.name)
        return (self._bytes, x.nbytes) if t is None else (t, x.size)

    def _reduction(self, op_name: str, x: Any, op: ReduceOp) -> tuple[int, int, int]:
        """``(datatype, count, nccl op)`` to reduce ``x`` with ``op``; TypeError naming both if NCCL
        cannot. What a dtype and op give is kept (a call's cost on a GPU is mostly such Python)."""
        dtype = x.dtype
        known = self._reductions.get((dtype, op))
        if known is not None:
            t, factor, nop = known
            return t, factor * x.size, nop
        factor, ops, t = 1, self._ops, self._types.get(dtype.name)
        if dtype.kind == "b":
            t, ops = self._bytes, self._bool_ops
        elif dtype.name in _COMPLEX_PARTS and op in (ReduceOp.SUM, ReduceOp.AVG):
            t, factor = self._types.get(_COMPLEX_PARTS[dtype.name]), 2
        nop = ops.get(op)
        count = factor * x.size
        if t is not None and nop is not None:
            self._reductions[(dtype, op)] = (t, factor, nop)
        if t is None or nop is None:
            names = [n for n in NCCL_DTYPES if n in self._types]
            raise DistTypeError(
                f"meshkit.comm: rank {self._me}: {op_name}: NCCL cannot reduce dtype {dtype} with ReduceOp.{op.name}; "
                f"NCCL reduces {names} with {[o.name for o in NCCL_OPS]} (also complex with SUM/AVG, bool with "
                "MIN/MAX/BAND/BOR); cast the array or reduce it on the host (mpi backend)")
        return t, count, nop

    def use_device(self) -> None:
        """Make this group's GPU the calling thread's current device (CUDA's is per thread)."""
        self.rt.use_device(self.device)

    # ----------------------------------------------------------------- launching
    def _launch(self, op: str, keep: tuple, issue: Callable[[int], None], *, grouped: bool = False) -> DeviceRequest:
        """Issue one operation on the communication stream, ordered after the caller's stream."""
        if self.guard.aborted is not None:
            raise DistBackendError(f"meshkit.comm: rank {self._me}: {op}: the NCCL communicator was aborted "
                                   f"earlier ({self.guard.aborted})")
        rt = self.rt
        rt.use_device(self.device)
        # One event per calling thread, recorded anew each call: a stream's wait is for the record as
        # of the wait (cudaStreamWaitEvent), so a later record moves no earlier wait; per thread, as two
        # threads' records between one's record and its wait would order it after the other's stream.
        ready = getattr(self._ready, "event", None)
        if ready is None:
            ready = self._ready.event = rt.new_event()
        ready.record(rt.current_stream())
        stream = self.stream
        stream.wait_event(ready)  # the collective sees the caller's writes; the host does not wait
        nccl = rt.nccl
        with self.guard.calling():
            if grouped:
                nccl.groupStart()
            try:
                issue(stream.ptr)
            finally:
                if grouped:
                    nccl.groupEnd()
        if self.coalesced is not None:  # inside batch_isend_irecv: NCCL enqueues at groupEnd
            request = DeviceRequest(self, op, None, keep)
            self.coalesced.append(request)
            return request
        done = rt.new_event()
        done.record(stream)
        request = DeviceRequest(self, op, done, keep)
        # Buffers of unfinished collectives stay referenced here, whether or not anyone waits.
        self._outstanding = [r for r in self._outstanding if r.event is None or not r.event.done]
        self._outstanding.append(request)
        return request

    def check_error(self, op: str) -> None:
        """Raise (after aborting the communicator) if NCCL reported an asynchronous error, or if the
        communicator was aborted (an aborted communicator must not be called again). A communicator
        this rank destroyed (or is destroying) is not queried: there is nothing left to report."""
        guard = self.guard
        if guard.exited:  # aborted at interpreter exit: the watchdog must not end a job that finished
            return
        if guard.aborted is not None:
            raise DistBackendError(f"meshkit.comm: rank {self._me}: {op}: the NCCL communicator was aborted "
                                   f"({guard.aborted})")
        with guard.handle_lock:
            if guard.released:
                return
            try:
                self.comm.check_async_error()
            except Exception as exc:  # NcclError, whatever its module
                error = exc
            else:
                return
        guard.abort(f"{op}: {error}")
        raise DistBackendError(f"meshkit.comm: rank {self._me}: {op}: NCCL reported an asynchronous error "
                               f"({error}); the communicator was aborted") from None

    def event_done(self, event: Any, op: str) -> bool:
        """Whether ``event`` fired; a CUDA error (a kernel before it faulted) is raised, named.

        CuPy's ``Event.done`` reads a faulted event as "not done" forever, which would turn a
        CUDA error into a timeout naming ranks that did arrive: the runtime queries the status.
        """
        try:
            return self.rt.event_done(event)
        except Exception as exc:  # CUDARuntimeError, whatever its module
            raise DistBackendError(f"meshkit.comm: rank {self._me}: {op}: CUDA error on device {self.device}: {exc} "
                                   "(a kernel ordered before this operation, or the operation itself, failed; "
                                   "the CUDA context of this process is unusable)") from None

    def abandon(self, why: str) -> None:
        """The group broke (a timeout, a peer's failure, ``ProcessGroup.abort``): abort the
        communicator (``ncclCommAbort``), so that its kernels stop waiting for the other ranks
        and the streams ordered after them go on. Idempotent. If another thread is inside an
        NCCL call on it (blocked in a runtime connection, a split, a destroy), the abort is left
        to that thread as it leaves the call: aborting beside it is unsafe on a blocking
        communicator (comm/engines/nccl_abort.py)."""
        self.guard.abort(why)

    def wait(self, request: Any, deadline: float) -> None:
        """Block the host until ``request`` completes, under ``deadline``.

        Past the deadline it raises DeadlineExceeded and leaves the communicator alone: the group
        aborts it (:meth:`abandon`) when the operation itself timed out, not when a caller's own
        ``Work.wait(timeout=...)`` ran out (the operation goes on, as in torch).
        """
        if isinstance(request, HostAverage):
            if not request.done:
                self.host.wait(request.inner, deadline)
                request.Test()
            return
        if not isinstance(request, DeviceRequest):
            self.host.wait(request, deadline)
            return
        since = watched = time.monotonic()
        try:
            while not request.Test():
                now = time.monotonic()
                if now > deadline:
                    raise DeadlineExceeded(detail=f"NCCL {request.op} did not complete")
                if self._watch is not None and now - watched > WATCH_INTERVAL:
                    watched = now
                    self._watch()
                time.sleep(0 if now - since < _SPIN_SECONDS else _NAP_SECONDS)
        except DeadlineExceeded:
            raise
        except BaseException as exc:  # a peer failed (notice) or NCCL failed: the communicator is unusable
            self.guard.abort(f"{request.op}: {exc}")
            raise

    def defer(self, request: Any) -> bool:
        """``Work.wait()`` of an async call: make the caller's current stream wait for ``request``
        and return True (no host synchronization); False for a host request (the caller waits)."""
        if not isinstance(request, DeviceRequest):
            return False
        self.check_error(request.op)
        if request.event is None:
            raise DistValueError(f"meshkit.comm: rank {self._me}: {request.op} was issued inside "
                                 "batch_isend_irecv and is waited on before the batch was posted")
        self.rt.use_device(self.device)
        self.rt.current_stream().wait_event(request.event)
        return True

    def _averaged(self, request: Any, buf: Any) -> HostAverage:
        return HostAverage(request, buf, self.size)

    # ----------------------------------------------------------------- collectives
    def all_reduce(self, buf: Any, op: ReduceOp) -> Any:
        if not self._on_device("all_reduce", ("tensor", buf)):
            request = self.host.all_reduce(buf, op)
            return self._averaged(request, buf) if op is ReduceOp.AVG and self.native_avg else request
        t, n, o = self._reduction("all_reduce", buf, op)
        p = self.rt.pointer(buf)
        return self._launch("all_reduce", (buf,), lambda s: self.comm.allReduce(p, p, n, t, o, s))

    def reduce(self, buf: Any, op: ReduceOp, root: int) -> Any:
        if not self._on_device("reduce", ("tensor", buf)):
            request = self.host.reduce(buf, op, root)
            if op is not ReduceOp.AVG or not self.native_avg:
                return request
            return self._averaged(request, buf if self.rank == root else None)
        t, n, o = self._reduction("reduce", buf, op)
        p = self.rt.pointer(buf)
        return self._launch("reduce", (buf,), lambda s: self.comm.reduce(p, p, n, t, o, root, s))

    def broadcast(self, buf: Any, root: int) -> Any:
        if not self._on_device("broadcast", ("tensor", buf)):
            return self.host.broadcast(buf, root)
        t, n = self._moved(buf)
        p = self.rt.pointer(buf)
        return self._launch("broadcast", (buf,), lambda s: self.comm.broadcast(p, p, n, t, root, s))

    def all_gather(self, out: Any, inp: Any) -> Any:
        if not self._on_device("all_gather", ("output", out), ("input", inp)):
            return self.host.all_gather(out, inp)
        t, n = self._moved(inp)
        pi, po = self.rt.pointer(inp), self.rt.pointer(out)
        return self._launch("all_gather", (out, inp), lambda s: self.comm.allGather(pi, po, n, t, s))

    def reduce_scatter(self, out: Any, inp: Any, op: ReduceOp) -> Any:
        if not self._on_device("reduce_scatter", ("output", out), ("input", inp)):
            request = self.host.reduce_scatter(out, inp, op)
            return self._averaged(request, out) if op is ReduceOp.AVG and self.native_avg else request
        t, n, o = self._reduction("reduce_scatter", out, op)
        pi, po = self.rt.pointer(inp), self.rt.pointer(out)
        return self._launch("reduce_scatter", (out, inp), lambda s: self.comm.reduceScatter(pi, po, n, t, o, s))

    def gather(self, out: Any | None, inp: Any, root: int) -> Any:
        if not self._on_device("gather", ("output", out), ("input", inp)):
            return self.host.gather(out, inp, root)
        t, n = self._moved(inp)
        pi, step = self.rt.pointer(inp), inp.nbytes
        po = self.rt.pointer(out) if out is not None else 0

        def issue(s: int) -> None:
            if self.rank == root:
                for peer in range(self.size):
                    self.comm.recv(po + peer * step, n, t, peer, s)
            self.comm.send(pi, n, t, root, s)
        return self._launch("gather", (out, inp), issue, grouped=True)

    def scatter(self, out: Any, inp: Any | None, root: int) -> Any:
        if not self._on_device("scatter", ("output", out), ("input", inp)):
            return self.host.scatter(out, inp, root)
        t, n = self._moved(out)
        po, step = self.rt.pointer(out), out.nbytes
        pi = self.rt.pointer(inp) if inp is not None else 0

        def issue(s: int) -> None:
            if self.rank == root:
                for peer in range(self.size):
                    self.comm.send(pi + peer * step, n, t, peer, s)
            self.comm.recv(po, n, t, root, s)
        return self._launch("scatter", (out, inp), issue, grouped=True)

    def all_to_all(self, out: Any, recv_counts: list[int], inp: Any, send_counts: list[int]) -> Any:
        if not self._on_device("all_to_all", ("output", out), ("input", inp)):
            return self.host.all_to_all(out, recv_counts, inp, send_counts)
        t, _ = self._moved(inp)
        size = inp.itemsize
        scale = 1 if inp.dtype.name in self._types else size  # moved as bytes: counts in bytes
        pi, po = self.rt.pointer(inp), self.rt.pointer(out)

        def issue(s: int) -> None:
            sent = got = 0
            for peer in range(self.size):
                if send_counts[peer]:  # NCCL moves nothing for 0 elements; the peer posts no receive either
                    self.comm.send(pi + sent * size, send_counts[peer] * scale, t, peer, s)
                if recv_counts[peer]:
                    self.comm.recv(po + got * size, recv_counts[peer] * scale, t, peer, s)
                sent += send_counts[peer]
                got += recv_counts[peer]
        return self._launch("all_to_all", (out, inp), issue, grouped=True)

    def barrier(self) -> Any:
        """A barrier of the ranks, on the host engine (it does not wait for device work)."""
        return self.host.barrier()

    def send(self, buf: Any, dst: int, tag: int) -> Any:
        if not self._on_device("send", ("tensor", buf)):
            return self.host.send(buf, dst, tag)
        self._no_tag("send", tag)
        t, n = self._moved(buf)
        p = self.rt.pointer(buf)
        return self._launch("send", (buf,), lambda s: self.comm.send(p, n, t, dst, s))

    def recv(self, buf: Any, src: int | None, tag: int) -> Any:
        if not self._on_device("recv", ("tensor", buf)):
            return self.host.recv(buf, src, tag)
        self._no_tag("recv", tag)
        if src is None:
            raise DistValueError(f"meshkit.comm: rank {self._me}: recv: NCCL cannot receive from any rank; pass src")
        t, n = self._moved(buf)
        p = self.rt.pointer(buf)
        request = self._launch("recv", (buf,), lambda s: self.comm.recv(p, n, t, src, s))
        request.source, request.count = src, buf.size  # NCCL receives exactly what was posted
        return request

    def start_coalescing(self) -> None:
        """Open an NCCL group (``batch_isend_irecv``): see :func:`~.nccl_coalescing.start`."""
        nccl_coalescing.start(self)

    def end_coalescing(self) -> None:
        """Close it; the outermost end records the batch's done events (:func:`~.nccl_coalescing.end`)."""
        nccl_coalescing.end(self)

    def complete_batch(self, requests: list[DeviceRequest]) -> None:
        """One done event, recorded on the communication stream after the batch was enqueued."""
        self.rt.use_device(self.device)
        done = self.rt.new_event()
        done.record(self.stream)
        for request in requests:
            request.event = done
        self._outstanding = [r for r in self._outstanding if r.event is None or not r.event.done] + requests

    def _no_tag(self, op: str, tag: int) -> None:
        if tag != 0:
            raise DistValueError(f"meshkit.comm: rank {self._me}: {op}: tag={tag} on device arrays: NCCL has no tags "
                                 "(messages between two ranks match in order); use tag=0")

    # ----------------------------------------------------------------- groups
    def split(self, color: int | None, ranks: tuple[int, ...], deadline: float) -> NCCLEngine | None:
        """The host engine splits first (it checks the members and honours the deadline), then
        NCCL's commSplit, collective over this communicator, with the same colour."""
        if self.nccl_version < _SPLIT_VERSION:  # every rank loads the same NCCL: all raise, none splits
            raise DistBackendError(
                f"meshkit.comm: rank {self._me}: new_group/split: NCCL {_version_text(self.nccl_version)} is loaded, "
                f"and sub-groups (mesh dimensions) need ncclCommSplit, new in NCCL 2.18; pip install -U "
                "nvidia-nccl-cu12 (or -cu13), or point LD_LIBRARY_PATH at NCCL >= 2.18")
        host = self.host.split(color, ranks, deadline)
        # NCCL: no operation may be outstanding on a communicator being split (async work that
        # Work.wait() only ordered may still run on the device): wait for the stream first.
        self.drain("split", deadline)
        with self.guard.calling():  # blocks until every rank of this communicator calls it
            child = self.comm.commSplit(-1 if color is None else int(color), self.rank)
        if host is None:
            return None
        if child.rank_id() != host.rank or child.size() != host.size:
            raise DistBackendError(f"meshkit.comm: rank {self._me}: split: NCCL formed rank {child.rank_id()} of "
                                   f"{child.size()}, the host engine rank {host.rank} of {host.size}")
        return NCCLEngine(host, child, self.rt, self.device)

    def drain(self, op: str, deadline: float) -> None:
        """Block the host until everything issued on the communication stream so far completed
        (before ``op``: a split, or destroying the communicator), under ``deadline``."""
        rt = self.rt
        rt.use_device(self.device)
        drained = rt.new_event()
        drained.record(self.stream)
        self.wait(DeviceRequest(self, op, drained, ()), deadline)

    def free(self) -> None:
        """Destroy the communicator (``ncclCommDestroy``: collective over its ranks, it blocks until
        they all destroy it). From here on nothing queries it (see :meth:`check_error`)."""
        if self.guard.release():
            try:
                with self.guard.calling():  # ncclCommDestroy is collective within the node: it may block
                    self.comm.destroy()
            except Exception as exc:  # freeing at shutdown must not mask the caller's own state
                raise DistBackendError(f"meshkit.comm: rank {self._me}: destroying the NCCL communicator "
                                       f"failed: {exc}") from None
        self.host.free()
