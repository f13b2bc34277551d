"""How a ProcessGroup runs an operation: number it, start it with one engine call, complete it.

Steps 2-4 of :mod:`meshkit.comm.groups.group`'s docstring are the phases of a
:class:`CollectiveQueue`, the part of a :class:`~meshkit.comm.groups.group.ProcessGroup` that orders
its operations (the group's ``queue``). Every collective takes the same path through them:

1. :meth:`~CollectiveQueue.issue`: the operation number and, in detail mode, the check that every
   rank called the same operation; a synchronous call first waits for the async ones before it;
2. the engine call, made by the caller itself (``ProcessGroup.all_reduce`` calls
   ``engine.all_reduce`` in its own frame: DDP's five calls; every other collective through
   :meth:`~CollectiveQueue.run`, which calls the ``start`` it is given), or, for an async call
   behind the collective in flight, :meth:`~CollectiveQueue.enqueue`: it starts when the one
   ahead completes (:meth:`~CollectiveQueue.advance`, called by whichever thread sees that);
3. :meth:`~CollectiveQueue.started`: the flight record, then the wait under the group's timeout,
   or a :class:`~meshkit.comm.groups.work.RequestWork` in the queue of in-flight collectives, at most
   one of which is in the engine at a time (on engines that do not order them themselves).

It also runs blocking steps (split, monitored barrier), calls made while ``run_async`` tasks are
queued, and the epilogue of ``AVG`` on an engine that only sums. It is the owner
(:class:`~meshkit.comm.groups.work.WorkOwner`) of the works it hands out. A failure is recorded by the
group's other part, its :class:`~meshkit.comm.groups.failures.FailureState`.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from typing import Any, Callable, cast

import numpy as np

from .. import job_end
from ..debug import ERROR, PATH, STATE, T_END, Call, CollectiveRecord, DebugLevel, fingerprint
from ..engines.engine import ChecksCalls, Defers, DeviceEngine, Engine, ReportsPath, Request
from ..errors import CollectiveTimeout
from .failures import FailureState
from ..notices import REJECTED, Notice
from ..reduce_op import ReduceOp
from .call_fingerprint import CallSequence, entry, stamp, verify
from .work import CommThread, RequestWork, Work

__all__ = ["CollectiveQueue"]

#: The highest level, compared by identity: read through the class (``DebugLevel.DETAIL``) it
#: costs an Enum lookup a call, through this name a global read.
_DETAIL = DebugLevel.DETAIL

_get_ident = threading.get_ident


class CollectiveQueue:
    """How a :class:`~meshkit.comm.groups.group.ProcessGroup` numbers, starts, queues and completes its operations.

    Attributes:
        group: the group it belongs to (its name, ranks and world, for records and messages).
        engine: the group's engine.
        failures: the group's failure state.
        thread: the group's communication thread (``run_async`` tasks, and the calls behind them).
        seq: the number the group's next operation gets (the same on every rank: program order).
        sequence: the running fingerprint of the group's calls and the last ones (comm/groups/call_fingerprint.py),
            compared at the group's barriers, creations, object collectives and strategies' steps.
        inflight: the group's async collectives not finished, in order; the first is in the engine,
            the others too where the engine orders them itself (``capabilities.queues`` False).
        lock: guards ``inflight`` and ``tags``.
        tags: fingerprints of queued calls, announced as each starts (engines that check calls).
        queues, tracks, defers, on_device, fingerprints, divides, checks_barrier: decided once from the
            engine's capabilities (see ``__init__``); ``detail`` is read from the world's debug level at each call.
    """

    __slots__ = ("group", "engine", "failures", "thread", "seq", "inflight", "lock", "tags", "queues", "tracks",
                 "defers", "on_device", "fingerprints", "paths", "divides", "world", "name", "timeout", "flight_entry", "agent",
                 "sequence", "checks_barrier", "_next_tag", "watched")

    def __init__(self, group: Any, engine: Engine | None, failures: FailureState) -> None:
        self.group, self.engine, self.failures = group, engine, failures
        self.name, self.timeout = group.name, group.timeout
        self.thread = CommThread(f"meshkit-comm[{group.name}]")
        self.flight_entry = group.world.recorder.record  # bound once: called on every operation
        self.agent = group.world.progress  # the world's progress agent (and device work's watchdog)
        self.seq = 0
        self.sequence = CallSequence()
        # At most one collective of the group is in the engine at a time; later async calls wait in
        # this queue, in order, and start as the one before completes (see advance). MPICH runs two
        # concurrent Iallreduce of 256 KB-4 MB 1.8-2.6x slower than the same two one after the other
        # (2 ranks, raw mpi4py; benchmarks/collectives.py --mode async), and DDP's buckets are such.
        self.inflight: collections.deque[RequestWork] = collections.deque()
        self.lock = threading.Lock()
        self.tags: dict[RequestWork, tuple] = {}
        self._next_tag: tuple | None = None  # the tag of the call issue() just numbered for enqueue()
        caps = engine.capabilities if engine is not None else None
        # An engine that orders its operations itself (NCCL's stream) starts each one at once.
        self.queues = caps is None or caps.queues
        self.tracks = caps is not None and caps.needs_progress
        self.defers = caps is not None and caps.defers
        # A device engine (NCCL): its requests may be device work, which the agent watches until done,
        # and it has use_device() (see Engine).
        self.on_device = engine is not None and engine.device is not None
        self.watched = caps.watched_requests if caps is not None else ()  # the request types the agent watches
        # An engine that compares the members' calls as it moves their data (local: always, at no
        # extra exchange) is handed each call's fingerprint; detail mode's error, in every mode.
        self.fingerprints = caps is not None and caps.checks_calls
        # An engine with more than one way to move data (shared memory or MPI) says which a call took.
        self.paths = caps is not None and caps.reports_path
        # Engines without a native average sum, and the group divides once (as NCCL's AVG does).
        self.divides = engine is not None and not engine.native_avg
        # A barrier compares the members' fingerprints (comm/groups/call_fingerprint.py) where the engine does not
        # compare calls itself and moves host arrays: a MAX all-reduce of 4 integers instead of
        # MPI's barrier, the same round of messages (see barrier()).
        self.checks_barrier = caps is not None and not caps.checks_calls and caps.host_arrays
        self.world = group.world  # its debug level is read at each call (detail)

    @property
    def detail(self) -> bool:
        """Detail mode: every call is fingerprinted and checked first. Read at each call (not
        cached), so that set_debug_level reaches groups that exist."""
        return self.world.debug is _DETAIL

    # ----------------------------------------------------------------- numbering
    def number(self, op: str) -> int:
        """The next operation number; DistError if the group failed before."""
        if self.failures.reason is not None:
            self.failures.unusable(op)
        seq = self.seq
        self.seq = seq + 1
        return seq

    def begin(self, op: str, tensor: np.ndarray | None, reduce_op: ReduceOp | None = None,
              extra: dict[str, Any] | None = None) -> int:
        """Detail mode: number the operation and verify every rank called the same one."""
        seq = self.number(op)
        call = self.call(op, tensor, reduce_op, extra)
        began = time.time()
        try:
            self._verify(call, seq, time.monotonic() + self.timeout)
        except BaseException as exc:
            record = self.flight_entry(seq, self.name, op, () if call.shape is None else (call.shape,), call.dtype,
                                       "started", began)
            raise self.failures.failed(op, seq, record, exc, self.timeout) from None
        return seq

    @staticmethod
    def call(name: str, tensor: np.ndarray | None, reduce_op: ReduceOp | None = None,
             extra: dict[str, Any] | None = None) -> Call:
        """The fingerprint compared across ranks (detail mode; the local engine, always). ``extra``:
        ``dtype`` (where there is no ``tensor``), ``root``, ``counts``."""
        extra = extra or {}
        if tensor is not None:
            return fingerprint(name, tensor.dtype, tensor.shape, reduce_op, extra.get("root"), extra.get("counts"))
        return fingerprint(name, extra.get("dtype"), None, reduce_op, extra.get("root"), extra.get("counts"))

    def _verify(self, call: Call, seq: int, deadline: float) -> None:
        """Detail mode: every rank must have called the same collective (see debug.Call)."""
        self.failures.waiting = seq  # a rank that rejected this very call is named at once (notices)
        if self.fingerprints:  # a rank in another kind of exchange (a monitored barrier) is named too
            cast(ChecksCalls, self.engine).announce((seq, call))
        entries = [e if isinstance(e, tuple) else (-1, None)  # a rank in a monitored barrier sends None
                   for e in self.engine.exchange((seq, call), seq, deadline, watched=True)]
        calls = [c for _, c in entries]
        if all(s == seq for s, _ in entries) and call.agrees(calls):
            return
        raise self.failures.mismatch(seq, entries)

    def reject(self, op: str, exc: BaseException) -> BaseException:
        """``op``'s arguments were rejected on this rank. As in torch the call does not count (it
        gets no number), but the members that did start it are told, so that they fail instead of
        waiting for the timeout (unless this rank starts the call, corrected, soon after)."""
        group, failures = self.group, self.failures
        if group.rank >= 0 and failures.reason is None and not group.world.destroyed:
            seq = self.seq
            failures.rejected.add(seq)
            record = self.flight_entry(seq, self.name, op, (), None, "rejected")
            record[ERROR] = str(exc)
            failures.tell(Notice(REJECTED, group.global_rank, group.ranks, seq, f"{type(exc).__name__}: {exc}"))
        return exc

    # ----------------------------------------------------------------- the path of every collective
    def run(self, op: str, start: Callable[[], Request], async_op: bool, shapes: tuple, ref: np.ndarray | None,
            epilogue: Callable[[], Any] | None, reduce_op: ReduceOp | None = None,
            extra: dict[str, Any] | None = None) -> Work | None:
        """Run an operation whose engine call is ``start()``: the phases below, in the order
        ``ProcessGroup.all_reduce`` takes them with its own engine call."""
        thread = self.thread
        if thread.pending and thread.runner != _get_ident():
            return self.behind_tasks(op, lambda: self.run(op, start, False, shapes, ref, epilogue, reduce_op, extra),
                                     async_op)
        seq, queued = self.issue(op, ref, async_op, reduce_op, extra)
        dtype = ref.dtype if ref is not None else (extra or {}).get("dtype")
        if queued:
            return self.enqueue(seq, op, start, shapes, dtype, epilogue)
        try:
            request = start()
        except BaseException as exc:
            raise self.start_failed(op, seq, shapes, dtype, exc) from None
        return self.started(op, seq, shapes, dtype, request, epilogue, async_op)

    def barrier(self, async_op: bool) -> Work | None:
        """A barrier: on engines that ``checks_barrier``, a ``MAX`` all-reduce of the group's
        fingerprint (:func:`~meshkit.comm.groups.call_fingerprint.stamp`, taken right after the barrier was
        numbered), compared when it completes: every member raises if their calls differed
        since the last comparison (:func:`~meshkit.comm.groups.call_fingerprint.verify`)."""
        if not self.checks_barrier:
            return self.run("barrier", self.engine.barrier, async_op, (), None, None)
        thread = self.thread
        if thread.pending and thread.runner != _get_ident():
            return self.behind_tasks("barrier", lambda: self.barrier(False), async_op)
        seq, queued = self.issue("barrier", None, async_op)
        buf, token = stamp(self.group)
        start = functools.partial(self.engine.all_reduce, buf, ReduceOp.MAX)
        epilogue = functools.partial(verify, self.group, buf, token, "barrier()")
        if queued:
            return self.enqueue(seq, "barrier", start, (), None, epilogue)
        try:
            request = start()
        except BaseException as exc:
            raise self.start_failed("barrier", seq, (), None, exc) from None
        return self.started("barrier", seq, (), None, request, epilogue, async_op)

    def issue(self, op: str, ref: np.ndarray | None, async_op: bool, reduce_op: ReduceOp | None = None,
              extra: dict[str, Any] | None = None) -> tuple[int, bool]:
        """Number the operation (in detail mode, check it across ranks) and make way for its start.

        Returns ``(seq, queued)``: its number, and whether it is an async call behind the
        collective in flight (the caller hands its start to :meth:`enqueue`) rather than one the
        caller starts now (a synchronous call, after the async ones before it completed).
        """
        if self.detail:
            seq = self.begin(op, ref, reduce_op, extra)
        else:
            if self.failures.reason is not None:
                self.failures.unusable(op)
            seq = self.seq
            self.seq = seq + 1
        # The call's digest into the group's fingerprint (comm/groups/call_fingerprint.py): one cached lookup.
        if extra is None:
            digest, call = entry(op, None if ref is None else ref.dtype, None if ref is None else ref.shape, reduce_op,
                                 None, None)
        elif ref is not None:
            digest, call = entry(op, ref.dtype, ref.shape, reduce_op, extra.get("root"), extra.get("counts"))
        else:
            digest, call = entry(op, extra.get("dtype"), None, reduce_op, extra.get("root"), extra.get("counts"))
        self.sequence.add(seq, digest, call)
        tag = (seq, call) if self.fingerprints else None
        if async_op:
            if self.inflight and self.queues:  # behind an earlier collective: started when it completes
                self._next_tag = tag
                return seq, True
        elif self.inflight:
            self.drain()
        if tag is not None:  # the engine call made right after is this one (see Engine.announce)
            cast(ChecksCalls, self.engine).announce(tag)
        return seq, False

    def enqueue(self, seq: int, op: str, start: Callable[[], Request], shapes: tuple, dtype: Any,
                epilogue: Callable[[], Any] | None) -> RequestWork:
        """Async call ``seq`` waits behind the collective in flight; ``start()`` posts it then."""
        record = self.flight_entry(seq, self.name, op, shapes, dtype, "scheduled")
        work = RequestWork(self, op, seq, record, None, epilogue, self.timeout, start)
        tag, self._next_tag = self._next_tag, None
        with self.lock:
            if tag is not None:
                self.tags[work] = tag
            work.queued = True
            self.inflight.append(work)
            alone = self.inflight[0] is work
        if alone:  # the one ahead completed meanwhile, before this one was in the queue: start it
            self.advance(None)
        return self.track(work, True)

    def start_failed(self, op: str, seq: int, shapes: tuple, dtype: Any, exc: BaseException) -> BaseException:
        """The engine call of call ``seq`` raised: record it; the error to raise (a RankFailedError
        breaks the group)."""
        record = self.flight_entry(seq, self.name, op, shapes, dtype, "started")
        return self.failures.failed(op, seq, record, exc, self.timeout)

    def started(self, op: str, seq: int, shapes: tuple, dtype: Any, request: Request,
                epilogue: Callable[[], Any] | None, async_op: bool) -> Work | None:
        """Call ``seq`` was posted (``request``): its flight record (written after the post, so
        that the data moves meanwhile), then its wait under the group's timeout, or its Work."""
        record = self.flight_entry(seq, self.name, op, shapes, dtype, "started")
        if self.paths:
            record[PATH] = cast(ReportsPath, self.engine).path(request)
        if async_op:
            work = RequestWork(self, op, seq, record, request, epilogue, self.timeout)
            work.queued = True
            with self.lock:
                self.inflight.append(work)
            return self.track(work, False)
        try:
            # A few polls before the wait's machinery (block: the notices' bookkeeping, the engine's wait,
            # the poller), which costs more than a small collective's last microseconds: a 4 KB call at
            # 2 ranks took 1.0-1.3 us (12-15%) less, interleaved A/B (docs/collectives.md). Not where the
            # engine orders a device stream instead of waiting (a CUDA event query a poll).
            test = request.Test
            if not (test() or (not self.defers and (test() or test() or test()))):
                self.block(request, time.monotonic() + self.timeout, seq)
            if epilogue is not None:
                epilogue()
        except BaseException as exc:
            raise self.failures.failed(op, seq, record, exc, self.timeout) from None
        record[STATE], record[T_END] = "completed", time.time()
        return None

    def block(self, request: Request, deadline: float, seq: int) -> None:
        """Block on ``request`` (call #``seq``) until it completes: the engine's wait, which reads
        notices for call ``seq`` while it stalls; the progress agent stands back meanwhile (this
        caller drives MPI)."""
        self.failures.waiting = seq
        waiting, me = self.agent.waiting, _get_ident()
        waiting.add(me)
        try:
            self.engine.wait(request, deadline)
        finally:
            waiting.discard(me)

    def blocking(self, op: str, step: Callable[[int, float], Any], timeout: float,
                 what: tuple[int, str] | None = None) -> Any:
        """Run a blocking engine step ``step(seq, deadline)`` as operation ``op`` (split, monitored
        barrier): numbered, recorded and ordered like every other operation. ``what``: the
        ``(digest, description)`` it adds to the group's fingerprint (a split's partition), else
        its name alone."""
        thread = self.thread
        if thread.pending and thread.runner != _get_ident():
            return thread.run_in_order(lambda: self.blocking(op, step, timeout, what), op)
        seq = self.begin(op, None) if self.detail and op == "split" else self.number(op)
        self.sequence.add(seq, *(what or entry(op, None, None, None, None, None)))
        if self.inflight:
            self.drain()
        record = self.flight_entry(seq, self.name, op, (), None, "started")
        self.failures.waiting = seq  # a wait in the step that reads notices reads them for this call
        try:
            if self.fingerprints:
                cast(ChecksCalls, self.engine).announce((seq, Call(op)))
            result = step(seq, time.monotonic() + timeout)
        except BaseException as exc:
            raise self.failures.failed(op, seq, record, exc, timeout) from None
        record[STATE], record[T_END] = "completed", time.time()
        return result

    def behind_tasks(self, op: str, call: Callable[[], Any], async_op: bool) -> Work | None:
        """A call made while ``run_async`` tasks are queued: it runs after them, in order."""
        if async_op:
            return self.thread.submit(call, Work(f"{op} on group {self.name}"))
        self.thread.run_in_order(call, op)
        return None

    # ----------------------------------------------------------------- the in-flight queue
    def track(self, work: RequestWork, waits: bool) -> RequestWork:
        """An async collective just in the queue (``waits``: behind an earlier one): keep it moving
        (the agent), and test the one ahead of it once (which starts it if that one has completed)."""
        if self.tracks:
            self.agent.track(work)
        if self.on_device and work.watched():  # device work: watched until done (see RequestWork.watchdog)
            self.agent.watchdog(work)
        if waits and work.unstarted():
            head = self.inflight[0] if self.inflight else None
            if head is not None and head is not work:
                head.poll(block=False)
        return work

    def advance(self, done: RequestWork | None) -> None:
        """``done`` finished: start the next queued collective (failing queued ones the group can
        no longer run). Called by whichever thread finished it (a waiter or the progress agent)."""
        with self.lock:
            queue = self.inflight
            if queue and queue[0] is done:
                queue.popleft()
            elif done in queue:
                queue.remove(done)
            while queue and queue[0].unstarted():
                nxt = queue[0]
                try:
                    if self.failures.reason is not None:
                        self.failures.unusable(nxt.op)
                    if self.tags:
                        tag = self.tags.pop(nxt, None)
                        if tag is not None:
                            cast(ChecksCalls, self.engine).announce(tag)
                    nxt.start()
                    return
                except BaseException as exc:  # it cannot start: it fails, and the next one is tried
                    self.tags.pop(nxt, None)
                    queue.popleft()
                    nxt.fail_to_start(exc)

    def wait_before(self, work: RequestWork, deadline: float | None) -> bool:
        """Wait for the collectives queued ahead of ``work`` until it has started (or failed);
        False if ``deadline`` passed first."""
        while work.unstarted():
            with self.lock:
                head = self.inflight[0] if self.inflight else None
            if head is None or head is work:
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            try:
                head.wait(left)
            except CollectiveTimeout:
                if deadline is not None and time.monotonic() >= deadline:
                    return False
            except BaseException:  # the earlier one's own error is its waiter's; ours comes from advance
                pass
        return True

    def drain(self) -> None:
        """Before a synchronous collective: every queued one completes first (in program order)."""
        while self.inflight:
            last = self.inflight[-1]
            try:
                last.wait()
            except BaseException:  # that Work's error is raised by its own wait()
                pass

    def progress(self) -> None:
        """Test the oldest outstanding collective once (see ``ProcessGroup.progress``)."""
        inflight = self.inflight
        if inflight:
            inflight[0].poll(block=False)

    def counts(self) -> int:
        """The calls issued, less those from the first asynchronous one not completed on (see
        ``ProcessGroup.counts``)."""
        with self.lock:
            pending = [work.seq for work in self.inflight if not work.finished]
        return min(pending, default=self.seq)

    def finish_inflight(self, deadline: float) -> int:
        """Let the asynchronous collectives complete until ``deadline``; how many are left."""
        while self.failures.reason is None:
            with self.lock:
                last = self.inflight[-1] if self.inflight else None
            left = deadline - time.monotonic()
            if last is None or left <= 0:
                break
            try:
                last.wait(left)
            except BaseException:  # its own error is its waiter's; this rank leaves anyway
                break
        with self.lock:
            return sum(not work.finished for work in self.inflight)

    # ----------------------------------------------------------------- what a RequestWork asks of its owner
    def failed(self, op: str, seq: int, record: CollectiveRecord, exc: BaseException) -> BaseException:
        """A work of this queue failed: record it; the error its waiters raise."""
        return self.failures.failed(op, seq, record, exc, self.timeout)

    def watchdog_failed(self, op: str, seq: int, error: BaseException, exc: BaseException) -> None:
        self.failures.watchdog_failed(op, seq, error, exc)

    def check_notices(self, seq: int) -> None:
        self.failures.check_notices(seq)

    def defer(self, request: Request) -> bool:
        """Whether the engine ordered the caller's device stream after ``request`` (NCCL), so that
        ``Work.wait()`` need not block the host."""
        return self.defers and cast(Defers, self.engine).defer(request)

    def path_of(self, request: Request) -> str | None:
        """The way ``request``'s data goes, where the engine tells ways apart (``shm``, ``mpi``), else None."""
        return cast(ReportsPath, self.engine).path(request) if self.paths else None

    def watches(self, request: Request | None) -> bool:
        """Whether ``request`` is device work the progress agent watches until it completes (NCCL's)."""
        return isinstance(request, self.watched)

    def use_device(self) -> None:
        """Make the group's GPU current on the calling thread (device engines; else nothing)."""
        if self.on_device:
            cast(DeviceEngine, self.engine).use_device()

    def end_job(self, reason: str) -> None:
        """End the whole job (device work failed after its ``Work.wait()`` returned)."""
        job_end.tear_down(self.group.world, reason)

    # ----------------------------------------------------------------- epilogues
    def averaged(self, buf: np.ndarray) -> Callable[[], None]:
        """AVG on an engine without it: the engine sums, then one division by the group size.

        For a power-of-two size and a real floating dtype the division is a multiplication by
        ``1 / size``: bit for bit the same (both are the correctly rounded ``x * 2**-k``) and
        faster (a multiplication is cheaper than a division).
        """
        size = self.group.size
        if size & (size - 1) == 0 and buf.dtype.kind == "f":
            return functools.partial(_scale, buf, 1.0 / size)
        return functools.partial(_divide, buf, size)


def _divide(buf: np.ndarray, n: int) -> None:
    buf /= n


def _scale(buf: np.ndarray, factor: float) -> None:
    buf *= factor
