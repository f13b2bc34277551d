"""The in-process engine: the ranks of a :func:`meshkit.comm.local.run` job, as threads.

Every collective is one rendezvous in the job's :class:`Hub`: each rank deposits a copy of its
contribution when it starts the operation, and completes it once every member has deposited,
computing its own output from the same list, in rank order, so results are deterministic and
equal NumPy's reference. A rank that raises wakes all the others (they raise
:class:`RankFailedError`), so a local job never hangs.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import numpy as np

from .. import env
from .engine import CallsDiffer, DeadlineExceeded, EngineCapabilities
from ..errors import DistValueError, RankFailedError
from ..notices import WATCH_INTERVAL, Notice
from ..reduce_op import ReduceOp, combine_into

__all__ = ["Hub", "RankContext", "LocalEngine", "create_world_engine"]


class RankContext:
    """What a rank thread of a local job knows: its hub, its rank, its world generation."""

    def __init__(self, hub: Hub, rank: int) -> None:
        self.hub, self.rank, self.generation = hub, rank, 0


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()  # a member that has not deposited yet


class _Slot:
    __slots__ = ("values", "arrived", "readers")

    def __init__(self, n: int) -> None:
        self.values: list[Any] = [_ABSENT] * n
        self.arrived = 0
        self.readers = 0


class Hub:
    """State shared by the ranks of one local job, guarded by one condition variable."""

    def __init__(self, world_size: int) -> None:
        self.size = world_size
        self.cond = threading.Condition()
        self.slots: dict[tuple, _Slot] = {}
        self.mail: dict[tuple, list[tuple[int, np.ndarray]]] = {}
        self.receivers: dict[tuple, list[_Receive]] = {}
        self.failure: tuple[int, BaseException] | None = None
        self.inbox: dict[int, list[Notice]] = {r: [] for r in range(world_size)}

    def fail(self, rank: int, exc: BaseException) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = (rank, exc)
            self.cond.notify_all()

    def check(self, rank: int) -> None:
        if self.failure is not None and self.failure[0] != rank:
            failed, exc = self.failure
            raise RankFailedError(f"meshkit.comm.local: rank {failed} failed with {type(exc).__name__}: {exc}; "
                                  f"rank {rank} stops")

    def wait_until(self, ready: Callable[[], bool], deadline: float, rank: int,
                   watch: Callable[[], None] | None = None) -> bool:
        """Wait (holding ``cond``) until ``ready()``; False at the deadline. ``watch`` is called
        on every wake-up once the wait has lasted WATCH_INTERVAL (it reads notices)."""
        since = time.monotonic()
        while not ready():
            self.check(rank)
            now = time.monotonic()
            if watch is not None and now - since > WATCH_INTERVAL:
                watch()
            left = deadline - now
            if left <= 0:
                return False
            self.cond.wait(min(left, WATCH_INTERVAL))
        return True

    def deposit(self, key: tuple, n: int, index: int, value: Any) -> _Slot:
        """Member ``index`` of an ``n``-rank rendezvous ``key`` leaves ``value``."""
        with self.cond:
            slot = self.slots.get(key)
            if slot is None:
                slot = self.slots[key] = _Slot(n)
            slot.values[index] = value
            slot.arrived += 1
            if slot.arrived == n:
                self.cond.notify_all()
            return slot

    def read(self, key: tuple, slot: _Slot) -> list[Any]:
        """Every value of a complete rendezvous (the last reader frees it). Hold ``cond``."""
        slot.readers += 1
        if slot.readers == len(slot.values):
            del self.slots[key]
        return slot.values


class _Rendezvous:
    """A started collective: complete once every member deposited; its members' tags are then
    compared (:meth:`LocalEngine.announce`) and ``finish(values)`` computes this rank's
    output, exactly once. ``values``: the members' data, in group rank order."""

    __slots__ = ("engine", "key", "slot", "finish", "done", "values", "error")

    def __init__(self, engine: LocalEngine, key: tuple, slot: _Slot, finish: Callable[[list[Any]], None] | None):
        self.engine, self.key, self.slot, self.finish, self.done = engine, key, slot, finish, False
        self.values: list[Any] = []
        self.error: BaseException | None = None

    def Test(self) -> bool:  # noqa: N802 (the Request protocol's name)
        if self.error is not None:
            raise self.error
        if not self.done:
            hub = self.engine.hub
            with hub.cond:
                hub.check(self.engine.global_rank)
                if self.slot.arrived < len(self.slot.values):
                    return False
                self._complete()
        return True

    def wait(self, deadline: float, *, watched: bool = True) -> None:
        if self.error is not None:
            raise self.error
        if self.done:
            return
        hub, slot, me = self.engine.hub, self.slot, self.engine.global_rank
        watch = self.engine.watch if watched else None
        with hub.cond:
            if not hub.wait_until(lambda: slot.arrived == len(slot.values), deadline, me, watch):
                ranks = self.engine.world_ranks
                raise DeadlineExceeded([ranks[i] for i, v in enumerate(slot.values) if v is _ABSENT])
            self._complete()

    def _complete(self) -> None:
        deposits = self.engine.hub.read(self.key, self.slot)
        self.done = True
        tags = [tag for tag, _ in deposits]
        mine = tags[self.engine.rank]
        # Every member compares the same list, so all raise or none does (before writing anything).
        if mine is None:
            differ = any(t is not None for t in tags)
        else:
            differ = any(t is None or t[0] != mine[0] for t in tags) or not mine[1].agrees([t[1] for t in tags])
        if differ:
            self.error = CallsDiffer([(-1, None) if t is None else t for t in tags])
            raise self.error
        self.values = [value for _, value in deposits]
        if self.finish is not None:
            self.finish(self.values)


class _Sent:
    """Sends are buffered (the data is copied at once), so they complete immediately."""

    source, count, dtype = -1, -1, None

    def Test(self) -> bool:  # noqa: N802
        return True

    def wait(self, deadline: float) -> None:
        pass


class _Receive:
    """A posted receive: completes with ``source``, ``count`` and ``dtype`` of the message. The
    buffer is filled only when the message has its size and dtype."""

    def __init__(self, engine: LocalEngine, buf: np.ndarray, src: int | None, rank: int) -> None:
        self.engine, self.hub, self.buf, self.src, self.rank = engine, engine.hub, buf, src, rank
        self.done = False
        self.source, self.count, self.dtype = -1, -1, None

    def deliver(self, source: int, data: np.ndarray) -> None:
        self.source, self.count, self.dtype = source, int(data.size), data.dtype
        if data.size == self.buf.size and data.dtype == self.buf.dtype:
            self.buf.reshape(-1)[...] = data.reshape(-1)
        self.done = True

    def Test(self) -> bool:  # noqa: N802
        return self.done

    def wait(self, deadline: float) -> None:
        with self.hub.cond:
            if not self.hub.wait_until(lambda: self.done, deadline, self.rank, self.engine.watch):
                raise DeadlineExceeded()


class LocalEngine:
    """The engine of a group whose ranks are threads of this process."""

    backend = "local"
    native_avg = False
    # checks_calls: announce(), every rendezvous compares what its members called; reports_dtype: a
    # receive knows the sent array's dtype. No progress to drive: a rendezvous completes as the
    # others deposit. No job to abort: the ranks are threads of this process (local.run wakes them),
    # hence its own peers (object collectives unpickle).
    capabilities = EngineCapabilities(checks_calls=True, reports_dtype=True, authenticated_peers=True)
    device = None
    max_tag = 2**20

    def __init__(self, hub: Hub, generation: int, ranks: tuple[int, ...], rank: int) -> None:
        self.hub = hub
        self.world_ranks = ranks
        self.rank, self.size = rank, len(ranks)
        self.global_rank = ranks[rank]
        self._uid = (generation, ranks)
        self._generation = generation
        self._ops = 0  # rendezvous so far; the same sequence on every member
        self._tag: tuple[int, Any] | None = None  # the fingerprint of the operation being started
        self.watch: Callable[[], None] | None = None  # set by the group: reads notices while stalled

    def notify(self, ranks: list[int], notice: Notice) -> None:
        """Leave ``notice`` for these global ranks, and wake them."""
        with self.hub.cond:
            for r in ranks:
                self.hub.inbox[r].append(notice)
            self.hub.cond.notify_all()

    def notices(self) -> list[Notice]:
        """Notices received since the last call."""
        with self.hub.cond:
            mine = self.hub.inbox[self.global_rank]
            got, mine[:] = list(mine), []
        return got

    def announce(self, tag: tuple[int, Any]) -> None:
        """The next operation this rank starts (the group's next engine call, made right after) is
        ``tag``, the group's ``(seq, Call)``: its rendezvous carries it, the members compare their
        tags before computing anything, and all raise :class:`CallsDiffer` if they differ. Under
        MPI only ``MESHKIT_DEBUG=detail`` checks this (with an extra exchange); here every rank's
        call is in one place, so the check costs no communication: it is always on."""
        self._tag = tag

    def _start(self, value: Any, finish: Callable[[list[Any]], None] | None = None) -> _Rendezvous:
        self._ops += 1
        key = (self._uid, self._ops)
        tag, self._tag = self._tag, None
        slot = self.hub.deposit(key, self.size, self.rank, (tag, value))
        return _Rendezvous(self, key, slot, finish)

    @staticmethod
    def wait(request: Any, deadline: float) -> None:
        request.wait(deadline)

    def _reduced(self, op: ReduceOp, parts: list[np.ndarray]) -> np.ndarray:
        out = parts[0].copy()
        for part in parts[1:]:
            combine_into(op, out, part)  # AVG sums here; the group divides once
        return out

    def all_reduce(self, buf: np.ndarray, op: ReduceOp) -> _Rendezvous:
        def finish(parts: list[Any]) -> None:
            buf[...] = self._reduced(op, parts)
        return self._start(buf.copy(), finish)

    def reduce(self, buf: np.ndarray, op: ReduceOp, root: int) -> _Rendezvous:
        def finish(parts: list[Any]) -> None:
            if self.rank == root:
                buf[...] = self._reduced(op, parts)
        return self._start(buf.copy(), finish)

    def broadcast(self, buf: np.ndarray, root: int) -> _Rendezvous:
        def finish(parts: list[Any]) -> None:
            if self.rank != root:
                buf[...] = parts[root]
        return self._start(buf.copy() if self.rank == root else None, finish)

    def all_gather(self, out: np.ndarray, inp: np.ndarray) -> _Rendezvous:
        def finish(parts: list[Any]) -> None:
            rows = out.reshape(self.size, -1)
            for i, part in enumerate(parts):
                rows[i] = part.reshape(-1)
        return self._start(inp.copy(), finish)

    def reduce_scatter(self, out: np.ndarray, inp: np.ndarray, op: ReduceOp) -> _Rendezvous:
        def finish(parts: list[Any]) -> None:
            mine = [p.reshape(self.size, -1)[self.rank] for p in parts]
            out.reshape(-1)[...] = self._reduced(op, mine)
        return self._start(inp.copy(), finish)

    def gather(self, out: np.ndarray | None, inp: np.ndarray, root: int) -> _Rendezvous:
        def finish(parts: list[Any]) -> None:
            if out is not None:
                out[...] = np.stack(parts)
        return self._start(inp.copy(), finish)

    def scatter(self, out: np.ndarray, inp: np.ndarray | None, root: int) -> _Rendezvous:
        def finish(parts: list[Any]) -> None:
            out.reshape(-1)[...] = parts[root].reshape(self.size, -1)[self.rank]
        return self._start(inp.copy() if inp is not None else None, finish)

    def all_to_all(self, out: np.ndarray, recv_counts: list[int], inp: np.ndarray,
                   send_counts: list[int]) -> _Rendezvous:
        def finish(parts: list[Any]) -> None:
            flat = out.reshape(-1)
            start = 0
            for j, (data, counts) in enumerate(parts):
                if counts[self.rank] != recv_counts[j]:
                    raise DistValueError(
                        f"meshkit.comm: rank {self.global_rank}: all_to_all: rank {self.world_ranks[j]} sends "
                        f"{counts[self.rank]} elements but this rank expects {recv_counts[j]} from it")
                offset = sum(counts[:self.rank])
                flat[start:start + recv_counts[j]] = data[offset:offset + recv_counts[j]]
                start += recv_counts[j]
        return self._start((inp.reshape(-1).copy(), list(send_counts)), finish)

    def barrier(self) -> _Rendezvous:
        return self._start(True)

    def exchange(self, payload: Any, seq: int, deadline: float, *, watched: bool = False) -> list[Any]:
        request = self._start(payload)
        request.wait(deadline, watched=watched)
        return list(request.values)

    def split(self, color: int | None, ranks: tuple[int, ...], deadline: float) -> LocalEngine | None:
        # watched: reads notices while it waits, so a member that left is named at once
        parts = self.exchange((color, self.global_rank), -1, deadline, watched=True)
        if color is None:
            return None
        members = tuple(sorted(g for c, g in parts if c == color))
        if members != ranks:
            raise DistValueError(f"meshkit.comm: rank {self.global_rank}: split: ranks disagree on group "
                                 f"{list(ranks)}: the split gave {list(members)}")
        return LocalEngine(self.hub, self._generation, members, members.index(self.global_rank))

    def send(self, buf: np.ndarray, dst: int, tag: int) -> _Sent:
        key = (self._uid, dst, tag)
        hub = self.hub
        with hub.cond:
            waiting = hub.receivers.get(key, [])
            for i, receiver in enumerate(waiting):
                if receiver.src is None or receiver.src == self.rank:
                    del waiting[i]
                    receiver.deliver(self.rank, buf)
                    hub.cond.notify_all()
                    break
            else:
                hub.mail.setdefault(key, []).append((self.rank, buf.copy()))
        return _Sent()

    def recv(self, buf: np.ndarray, src: int | None, tag: int) -> _Receive:
        key = (self._uid, self.rank, tag)
        hub = self.hub
        receiver = _Receive(self, buf, src, self.global_rank)
        with hub.cond:
            queued = hub.mail.get(key, [])
            for i, (source, data) in enumerate(queued):
                if src is None or src == source:
                    del queued[i]
                    receiver.deliver(source, data)
                    break
            else:
                hub.receivers.setdefault(key, []).append(receiver)
        return receiver

    def host_name(self) -> str:
        return env.this_host()

    def flush(self, timeout: float) -> None:
        """Nothing to wait for: a notice is in the other rank's inbox once ``notify`` returned."""

    def local_rank(self) -> int:
        """This rank's index among the ranks of its node: all are threads of this process."""
        return self.rank

    def free(self) -> None:
        pass


def create_world_engine(context: RankContext) -> LocalEngine:
    """The world's engine for a rank of a local job (called by ``init_process_group``)."""
    context.generation += 1
    return LocalEngine(context.hub, context.generation, tuple(range(context.hub.size)), context.rank)
