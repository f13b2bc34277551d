"""Handles of asynchronous operations, and the per-group thread that runs chained tasks.

A collective started with ``async_op=True`` is posted to the engine by the caller at once and
returned as a :class:`RequestWork`: waiting polls the engine's request, except on an engine that
``defers`` (its capabilities; NCCL), where waiting (without a timeout) for a device collective orders the caller's
stream after it without blocking the host, and the progress agent's watchdog enforces its
deadline (:meth:`RequestWork.watchdog`). While nobody waits, the world's
:class:`~meshkit.comm.groups.progress.ProgressAgent` polls it, so MPI keeps moving the data while the
caller computes.

Tasks that chain several collectives with computation in between (communication hooks, ZeRO-2's
reduce-to-owners, FSDP's reduce-scatter then all-reduce) run with ``run_async`` on the group's
:class:`CommThread`, one after another, in submission order. While a task is queued, the
group's other calls join the queue behind it, so on every rank a group's collectives are
issued in program order.

A caller that waits (``Work.wait()`` without a timeout, or a synchronous call behind queued
work) while no operation is executing runs the queued operations itself, in order, up to the
one it waits for, instead of sleeping until the thread wakes up: handing an operation to a
sleeping thread and being woken by it adds two thread wake-ups to the operation, more than a
small operation itself costs. Exactly one thread executes the group's
operations at any time, so their order is the same on every rank.
"""

from __future__ import annotations

import collections
import concurrent.futures
import datetime
import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

from .. import env
from ..debug import PATH, STATE, T_END, T_START
from ..engines.engine import DeadlineExceeded, thread_role
from ..errors import CollectiveTimeout, DistError, DistTypeError, DistValueError
from ..notices import WATCH_INTERVAL

if TYPE_CHECKING:
    from ..debug import CollectiveRecord
    from ..engines.engine import Request

__all__ = ["Work", "WorkFuture", "RequestWork", "WorkOwner", "CommThread"]

logger = logging.getLogger("meshkit")

#: Guards the completion callbacks of every Work (registered by ``get_future``; rare, so one lock).
_CALLBACKS = threading.Lock()


def wait_seconds(timeout: float | datetime.timedelta | None) -> float | None:
    """``Work.wait``'s timeout in seconds, or None (no bound of the caller's own).

    A ``timedelta`` is torch's form; 0 (either form) is torch's ``kNoTimeout``, torch's default
    for ``Work.wait``: no bound of the caller's, the operation's own timeout still applies (the
    same as None). A negative, NaN or infinite one, or another type, is refused.
    """
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise DistTypeError(f"meshkit.comm: Work.wait(timeout=...) takes seconds (a float), a datetime.timedelta "
                            f"or None, got {type(timeout).__name__} {timeout!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise DistValueError(f"meshkit.comm: Work.wait(timeout={timeout!r}): the timeout must be finite and >= 0 "
                             "seconds (0 and None: the operation's own timeout alone)")
    return seconds or None


class Work:
    """Handle of an asynchronous operation, as torch's ``Work``.

    ``wait()`` blocks until the operation finished and re-raises its error; ``is_completed()``
    never blocks; ``get_future()`` gives a :class:`WorkFuture` of it.
    """

    __slots__ = ("_done", "_error", "_result", "_what", "_queue", "_owner", "_callbacks", "_outputs")

    def __init__(self, what: str) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._result: Any = None
        self._what = what
        self._queue: CommThread | None = None  # set while queued: a waiter may run it itself
        self._owner: CommThread | None = None  # the queue it was submitted to
        self._callbacks: list[Callable[[], None]] | None = None  # run once it finishes (get_future)
        self._outputs: list[Any] | None = None  # its output arrays, as its future's value (collectives.py)

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._done.set()
        if self._callbacks is not None:
            self._run_callbacks()

    def _finished_yet(self) -> bool:
        """Whether it has finished, without testing it."""
        return self._done.is_set()

    def _run_callbacks(self) -> None:
        with _CALLBACKS:
            callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            callback()

    def _when_done(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once it has finished (now, if it has)."""
        with _CALLBACKS:
            if not self._finished_yet():
                self._callbacks = (self._callbacks or []) + [callback]
                return
        callback()

    def _with_outputs(self, outputs: list[Any]) -> "Work":
        """Name the operation's output arrays, its future's value (the module-level collectives)."""
        self._outputs = outputs
        return self

    def get_future(self) -> "WorkFuture":
        """A :class:`concurrent.futures.Future` of the operation, as torch's ``Work.get_future()``.

        It resolves to what torch's does: the list of the operation's output arrays (for
        ``all_reduce(x, async_op=True)``, ``[x]``; a Work that is not a collective's, a
        ``run_async`` task's, to what the task returned), or to the operation's error. Its
        callbacks (``add_done_callback``, torch's ``then``) run once meshkit sees the operation
        complete: on MPI the progress agent does, elsewhere at the latest when the Work or the
        future is waited on or tested (``done()``): so wait on the last future of a chain, as
        torch's DDP does on a hook's.

        Example (2 ranks)::

            x = np.ones(2)
            fut = meshkit.all_reduce(x, async_op=True).get_future()
            doubled = fut.then(lambda f: f.value()[0] * 2)
            doubled.wait()          # array([4., 4.]) on both ranks; x holds [2., 2.]
        """
        future = WorkFuture(self.is_completed, self._drive)

        def resolve() -> None:
            if self._error is not None:
                future.set_exception(self._error)
            else:
                future.set_result(self._outputs if self._outputs is not None else self._result)

        self._when_done(resolve)
        return future

    def _drive(self, timeout: float | None) -> None:
        """Wait for the operation for its future; concurrent.futures.TimeoutError if ``timeout``
        passes first (its own error is the future's, set by ``resolve``)."""
        try:
            self.wait(timeout)
        except CollectiveTimeout:
            if not self._finished_yet():  # the caller's bound passed, the operation goes on
                raise concurrent.futures.TimeoutError(f"{self._what} did not complete within {timeout} s") from None
        except BaseException:
            pass  # the operation's error: its future holds it

    def is_completed(self) -> bool:
        """True once the operation has finished, successfully or not."""
        return self._done.is_set()

    def is_success(self) -> bool:
        """True once the operation has finished without error."""
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        """The operation's error, or None (also None while it runs)."""
        return self._error

    def result(self) -> Any:
        """What the operation returned (e.g. the source rank of a receive), after ``wait``."""
        return self._result

    def wait(self, timeout: float | datetime.timedelta | None = None) -> bool:
        """Block until the operation completes; return True.

        Args:
            timeout: seconds (or, as torch's, a ``timedelta``) to wait at most; None, or 0 (torch's
                default, ``kNoTimeout``), waits until the operation itself finishes or times out
                under its group's timeout.

        Raises:
            CollectiveTimeout: ``timeout`` passed first (the operation keeps running).
            DistError: whatever the operation raised.
            DistTypeError, DistValueError: ``timeout`` is not seconds, a timedelta or None, or is
                negative.
        """
        timeout = wait_seconds(timeout)
        queue = self._queue  # read once: the comm thread clears it when it takes the work
        if timeout is None and queue is not None and not self._done.is_set():
            queue.run_until(self)
        owner = self._owner
        if owner is None or self._done.is_set():
            done = self._done.wait(timeout)
        else:
            with owner._cond:
                owner.waiters += 1
            try:
                done = self._done.wait(timeout)
            finally:
                with owner._cond:
                    owner.waiters -= 1
        if not done:
            raise CollectiveTimeout(
                f"meshkit.comm: {self._what} did not complete within Work.wait(timeout={timeout})",
                op=self._what)
        if self._error is not None:
            raise self._error
        return True

    def __repr__(self) -> str:
        state = "completed" if self.is_completed() else "pending"
        return f"<Work {self._what} {state}>"


class WorkFuture(concurrent.futures.Future):
    """What :meth:`Work.get_future` returns: a :class:`concurrent.futures.Future` with torch's
    ``torch.futures.Future`` methods too (``wait``, ``value``, ``then``).

    Waiting on it (``result``, ``exception``, ``wait``) waits on the operation; ``done()`` tests
    it: a future of meshkit's is never left pending by an operation that completed unseen.
    """

    def __init__(self, poll: Callable[[], Any], drive: Callable[[float | None], None]) -> None:
        super().__init__()
        self._poll, self._drive = poll, drive

    def done(self) -> bool:
        if not super().done():
            self._poll()
        return super().done()

    def result(self, timeout: float | None = None) -> Any:
        if not super().done():
            self._drive(timeout)
        return super().result(0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not super().done():
            self._drive(timeout)
        return super().exception(0)

    def cancel(self) -> bool:
        """False: a collective cannot be cancelled (nor can torch's future of one)."""
        return False

    def wait(self) -> Any:
        """torch's ``Future.wait()``: its value, once the operation completed (its error raised)."""
        return self.result()

    def value(self) -> Any:
        """torch's ``Future.value()``: the value of a completed future (its error raised)."""
        if not self.done():
            raise DistValueError("meshkit.comm: WorkFuture.value() of a future whose operation has not completed "
                                 "(as torch's); call wait(), which waits and returns the value")
        return super().result(0)

    def then(self, callback: Callable[["WorkFuture"], Any]) -> "WorkFuture":
        """torch's ``Future.then``: a future of ``callback(self)``, run once this one completes;
        waiting on it waits on this one (an error of either is its error)."""
        child = WorkFuture(self.done, self._drive_for_child)

        def run(_: concurrent.futures.Future) -> None:
            try:
                child.set_result(callback(self))
            except BaseException as exc:
                child.set_exception(exc)

        self.add_done_callback(run)
        return child

    def _drive_for_child(self, timeout: float | None) -> None:
        if not super().done():
            self._drive(timeout)


class WorkOwner(Protocol):
    """What a :class:`RequestWork` may ask of its owner, the queue of its group's operations
    (:class:`~meshkit.comm.groups.execution.CollectiveQueue`): nothing else, and nothing private."""

    group: Any  # its public identity (name, ranks, global rank), for messages
    name: str            # the group's name
    defers: bool         # the engine may order a device stream after a request (``defer``)

    def advance(self, done: RequestWork | None) -> None:
        """``done`` finished: start the next queued collective."""
        ...

    def wait_before(self, work: RequestWork, deadline: float | None) -> bool:
        """Wait until the collectives queued ahead of ``work`` let it start; False past ``deadline``."""
        ...

    def block(self, request: Request, deadline: float, seq: int) -> None:
        """Block on ``request`` (call ``seq``) until it completes; DeadlineExceeded past ``deadline``."""
        ...

    def failed(self, op: str, seq: int, record: CollectiveRecord, exc: BaseException) -> BaseException:
        """Record that call ``seq`` failed with ``exc``; the error its waiters raise."""
        ...

    def watchdog_failed(self, op: str, seq: int, error: BaseException, exc: BaseException) -> None:
        """The watchdog found call ``seq`` failed (``error``): the group breaks, the error is logged."""
        ...

    def check_notices(self, seq: int) -> None:
        """RankFailedError if a notice shows that call ``seq`` cannot complete."""
        ...

    def defer(self, request: Request) -> bool:
        """Order the caller's device stream after ``request``; False if the host must wait."""
        ...

    def path_of(self, request: Request) -> str | None:
        """The way ``request``'s data goes (``shm``, ``mpi``) where the engine tells ways apart, else None."""
        ...

    def watches(self, request: Request | None) -> bool:
        """Whether ``request`` is device work the progress agent watches until it completes."""
        ...

    def use_device(self) -> None:
        """Make the group's GPU current on the calling thread (device engines)."""
        ...

    def end_job(self, reason: str) -> None:
        """End the whole job (see :mod:`~meshkit.comm.job_end`)."""
        ...


class RequestWork(Work):
    """Work of an operation the engine is running: ``wait`` polls the engine's request.

    Whichever thread sees the request complete (the caller in ``wait``/``is_completed``, or the
    progress agent) completes it, exactly once, through its owner (its group's queue, a
    :class:`WorkOwner`): the operation's
    epilogue runs (AVG's division, copies out of a staging buffer, a receive's size check) and
    the flight-recorder entry is closed. When the engine raises, or the operation's deadline
    passes (:class:`~meshkit.comm.engines.engine.DeadlineExceeded`), the owner records the failure and
    gives the error every waiter raises.

    It holds no ``threading.Event`` (costlier to create than a small all-reduce) and
    no closures: completion is a flag set under the work's lock, which every tester holds.
    """

    __slots__ = ("_request", "_owner_queue", "_op", "_seq", "_record", "_epilogue", "_deadline", "_lock",
                 "_finished", "posted", "_start", "_timeout", "queued")

    def __init__(self, owner: WorkOwner, op: str, seq: int, record: Any, request: Request | None,
                 epilogue: Callable[[], Any] | None, timeout: float,
                 start: Callable[[], Request] | None = None) -> None:
        self._owner_queue, self._op, self._seq, self._record = owner, op, seq, record
        self._request, self._epilogue, self._start, self._timeout = request, epilogue, start, timeout
        self._error: BaseException | None = None
        self._result: Any = None
        self._callbacks: list[Callable[[], None]] | None = None
        self._outputs: list[Any] | None = None
        self._finished = False
        self.queued = False  # in its group's queue of collectives (see CollectiveQueue.advance)
        self._lock = threading.Lock()  # one thread tests the request at a time (MPI requires it)
        self.posted = now = time.monotonic()
        self._deadline = now + timeout

    def start(self) -> None:
        """Post a queued operation now (its predecessor finished); called once, by its group."""
        self._request = request = self._start()  # type: ignore[misc]
        self._record[STATE], self._record[T_START] = "started", time.time()
        self._record[PATH] = self._owner_queue.path_of(request)
        self.posted = now = time.monotonic()
        self._deadline = now + self._timeout

    @property
    def _what(self) -> str:  # only for messages
        return f"{self._op} on group {self._owner_queue.name}"

    # ----------------------------------------------------------------- what its queue reads
    @property
    def op(self) -> str:
        """The operation's name."""
        return self._op

    @property
    def seq(self) -> int:
        """The operation's number in its group (-1: a send or receive)."""
        return self._seq

    @property
    def finished(self) -> bool:
        """True once finished (without testing the request, unlike ``is_completed``)."""
        return self._finished

    def unstarted(self) -> bool:
        """Queued behind an earlier collective, not started and not failed."""
        return self._request is None and not self._finished

    def watched(self) -> bool:
        """Whether its request is device work the progress agent's watchdog watches (NCCL's)."""
        return self._owner_queue.watches(self._request)

    def fail_to_start(self, exc: BaseException) -> None:
        """Its queue could not start it: it fails with ``exc`` (recorded), without advancing the queue."""
        self.queued = False
        self._result, self._error = None, self._fail(exc)
        self._finished = True

    def use_device(self) -> None:
        """Make its group's GPU current on the calling thread (the progress agent's, before it touches it)."""
        self._owner_queue.use_device()

    def _fail(self, exc: BaseException) -> BaseException:
        """Record that the operation failed with ``exc``; the error its waiters raise."""
        return self._owner_queue.failed(self._op, self._seq, self._record, exc)

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._finished = True
        if self.queued:
            self.queued = False
            self._owner_queue.advance(self)
        if self._callbacks is not None:
            self._run_callbacks()

    def _finished_yet(self) -> bool:
        return self._finished

    def _request_completed(self) -> None:
        if self.queued:  # start the next collective before this one's epilogue (AVG's division)
            self.queued = False
            self._owner_queue.advance(self)
        try:
            result = self._epilogue() if self._epilogue is not None else None
        except BaseException as exc:  # handed to every waiter
            self._finish(None, self._fail(exc))
        else:
            self._record[STATE], self._record[T_END] = "completed", time.time()
            self._finish(result)

    def poll(self, *, block: bool = True) -> bool:
        """Test the request once (skipped when another thread is testing it and ``block`` is
        False); True once the operation finished."""
        if self._finished:
            return True
        if self._request is None:  # queued behind an earlier collective of its group
            return False
        if not self._lock.acquire(blocking=block):
            return False
        try:
            if not self._finished:
                try:
                    complete = self._request.Test()
                except BaseException as exc:
                    self._finish(None, self._fail(exc))
                else:
                    if complete:
                        self._request_completed()
                    elif time.monotonic() > self._deadline:
                        self._finish(None, self._fail(DeadlineExceeded()))
        finally:
            self._lock.release()
        return self._finished

    def is_completed(self) -> bool:
        return self._finished or self.poll()

    def watchdog(self) -> bool:
        """One round of the watchdog over a device operation (the progress agent's; torch's NCCL
        watchdog): True once nothing is left to watch.

        ``Work.wait()`` of a device collective only orders the caller's stream after it, and
        nothing else would notice if it never completed: the host would hang later, in a copy or
        at shutdown. So the agent tests it (the done event, NCCL's asynchronous errors), reads
        notices (a member that broke or left) and, past its deadline, fails it; the group then
        breaks (:meth:`FailureState.watchdog_failed`). A caller waiting on it now is left alone.
        """
        if self._error is not None or self._request is None:
            return self._error is not None
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self._error is not None:
                return True
            owner = self._owner_queue
            try:
                if self._request.Test():
                    return True
                now = time.monotonic()
                if now - self.posted > WATCH_INTERVAL:  # as a waiter does: a quick retry of a rejected call counts
                    owner.check_notices(self._seq)
                if now <= self._deadline:
                    return False
                raise DeadlineExceeded(detail="found by the watchdog" + (
                    "; Work.wait() had returned, having ordered only the device stream" if self._finished else ""))
            except BaseException as exc:
                error = self._fail(exc)
                owner.watchdog_failed(self._op, self._seq, error, exc)
                if self._finished:
                    self._error = error  # its wait() returned: exception() and is_success() tell
                    handling = env.async_error_handling()  # validated at init_process_group
                    if handling != "log":  # the caller may have read the buffer: not a silent wrong result
                        owner.end_job(f"{error} (after its Work.wait() had returned: the caller may "
                                      "have used the unreduced buffer)")
                else:
                    self._finish(None, error)
                return True
        finally:
            self._lock.release()

    def is_success(self) -> bool:
        return self._finished and self._error is None

    def wait(self, timeout: float | datetime.timedelta | None = None) -> bool:
        timeout = wait_seconds(timeout)
        if not self._finished and self._request is None:  # its predecessors must finish first
            if not self._owner_queue.wait_before(self, None if timeout is None else time.monotonic() + timeout):
                raise CollectiveTimeout(f"meshkit.comm: {self._what} did not start within Work.wait(timeout="
                                        f"{timeout}): the collectives of its group issued before it are still "
                                        "running", op=self._op)
        if not self._finished:
            limit = self._deadline if timeout is None else min(self._deadline, time.monotonic() + timeout)
            with self._lock:
                if not self._finished:
                    request, owner = self._request, self._owner_queue
                    try:
                        # A device collective: the caller's stream waits for it, the host does not
                        # (the watchdog enforces the deadline); with a timeout the host waits, as torch's.
                        if timeout is None and owner.defers and owner.defer(request):
                            pass
                        elif not request.Test():
                            owner.block(request, limit, self._seq)
                    except DeadlineExceeded as exc:
                        if limit < self._deadline:  # the caller's own bound: the operation goes on
                            raise CollectiveTimeout(f"meshkit.comm: {self._what} did not complete within "
                                                    f"Work.wait(timeout={timeout})", op=self._what) from None
                        self._finish(None, self._fail(exc))
                    except BaseException as exc:
                        self._finish(None, self._fail(exc))
                    else:
                        self._request_completed()
        if self._error is not None:
            raise self._error
        return True


class CommThread:
    """Runs a group's asynchronous operations one at a time, in submission order.

    The operations run on a daemon thread, or in a waiter that finds nothing executing (see the
    module docstring); ``runner`` is the thread executing one now, so that an operation issuing
    further synchronous operations of its group runs them inline.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: collections.deque[tuple[Callable[[], Any], Work]] = collections.deque()
        self._cond = threading.Condition()
        self.pending = 0
        self.runner: int | None = None
        self.waiters = 0  # callers blocked in Work.wait on this queue's operations
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def idle(self) -> bool:
        """True when nothing is queued or running."""
        return self.pending == 0

    @property
    def ident(self) -> int | None:
        """The thread's ident once started (the debug server names it among the rank's stacks)."""
        thread = self._thread
        return None if thread is None else thread.ident

    def submit(self, fn: Callable[[], Any], work: Work) -> Work:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"meshkit.comm: the communication thread of {self._name} is closed")
            self.pending += 1
            work._queue = work._owner = self
            self._queue.append((fn, work))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()
        return work

    def run_in_order(self, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn`` after everything queued so far, in the caller when the queue is empty.

        Called while executing one of this queue's operations (a task issuing collectives), it
        runs inline: it is part of that operation, which precedes everything still queued.
        """
        if self.pending == 0 or self.runner == threading.get_ident():
            return fn()
        work = self.submit(fn, Work(what))
        work.wait()
        return work.result()

    def run_until(self, target: Work) -> None:
        """Run queued operations in the calling thread, in order, until ``target`` has run.

        Stops (leaving the rest to the thread) as soon as another thread is executing one.
        """
        me = threading.get_ident()
        while True:
            with self._cond:
                if target._queue is None or self.runner is not None or not self._queue:
                    if self.runner == me and target._queue is not None:
                        raise DistError(
                            f"meshkit.comm: an operation running on {self._name} waits for {target._what}, "
                            "queued after it on the same group: it can never run; issue it synchronously "
                            "(async_op=False) inside the operation instead")
                    return
                fn, work = self._queue.popleft()
                self.runner = me
            self._run(fn, work)
            if work is target:
                return

    def drain(self, timeout: float) -> bool:
        """Wait until the queue is empty; False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self, fn: Callable[[], Any], work: Work) -> None:
        """Execute one popped operation (the caller holds ``runner``) and complete its Work."""
        work._queue = None
        try:
            result, error = fn(), None
        except BaseException as exc:  # handed to the waiter, never lost
            result, error = None, exc
        with self._cond:
            # Counted down before the Work completes: a caller woken by it finds the queue
            # idle and runs its next synchronous call inline.
            self.runner = None
            self.pending -= 1
            self._cond.notify_all()
        work._finish(result, error)

    def _loop(self) -> None:
        thread_role.queue = self
        me = threading.get_ident()
        while True:
            with self._cond:
                while (not self._queue or self.runner is not None) and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                if self.runner is not None:  # closed while a waiter executes: let it finish
                    self._cond.wait_for(lambda: self.runner is None)
                    continue
                fn, work = self._queue.popleft()
                self.runner = me
            self._run(fn, work)
