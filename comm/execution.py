"""How a ProcessGroup runs an operation: number it, start it with one engine call, complete it.

Steps 2-4 of :mod:`meshkit.comm.group`'s docstring: the operation number and, in detail mode,
the check that every rank called the same operation (:meth:`ExecutionMixin._begin`); the start
by one engine call and the wait under the group's timeout (:meth:`~ExecutionMixin._run`, which
``all_reduce`` inlines for speed, :meth:`~ExecutionMixin._complete`,
:meth:`~ExecutionMixin._block`); the queue of the group's in-flight async collectives, at most
one of which is in the engine at a time (:meth:`~ExecutionMixin._queued`, and
:meth:`~ExecutionMixin._advance`, called by whichever thread sees the one ahead complete);
blocking steps (split, monitored barrier); calls made while ``run_async`` tasks are queued; and
the epilogue of ``AVG`` on an engine that only sums.

:class:`ExecutionMixin` is a part of :class:`~meshkit.comm.group.ProcessGroup` (which inherits
it): its methods use the group's state, set in ``ProcessGroup.__init__``, and its other parts'
methods (a failure is recorded by :mod:`~meshkit.comm.failures`).
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any, Callable

import numpy as np

from .debug import STATE, T_END, Call, CollectiveRecord, fingerprint, mismatch_error
from .engine import Request
from .errors import CollectiveMismatchError, CollectiveTimeout
from .reduce_op import ReduceOp
from .work import RequestWork, Work

__all__ = ["ExecutionMixin"]

_get_ident = threading.get_ident


class ExecutionMixin:
    """How :class:`~meshkit.comm.group.ProcessGroup` numbers, starts, queues and completes its operations."""

    # ----------------------------------------------------------------- numbering
    def _number(self, op: str) -> int:
        """The next operation number; DistError if the group failed before."""
        if self._failure is not None:
            self._unusable(op)
        seq = self._seq
        self._seq = seq + 1
        return seq

    def _begin(self, op: str, tensor: np.ndarray | None, **fingerprint: Any) -> int:
        """Detail mode: number the operation and verify every rank called the same one."""
        seq = self._number(op)
        call = self._call(op, tensor, **fingerprint)
        began = time.time()
        try:
            self._verify(call, seq, time.monotonic() + self.timeout)
        except BaseException as exc:
            record = self._flight_entry(seq, self.name, op, () if call.shape is None else (call.shape,), call.dtype,
                                        "started", began)
            raise self._failed(op, seq, record, exc, self.timeout) from None
        return seq

    def _call(self, name: str, tensor: np.ndarray | None, *, dtype: np.dtype | None = None,
              reduce_op: ReduceOp | None = None, root: int | None = None,
              counts: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> Call:
        """The fingerprint compared across ranks (detail mode; the local engine, always)."""
        if tensor is not None:
            return fingerprint(name, tensor.dtype, tensor.shape, reduce_op, root, counts)
        return fingerprint(name, dtype, None, reduce_op, root, counts)

    def _verify(self, call: Call, seq: int, deadline: float) -> None:
        """Detail mode: every rank must have called the same collective (see debug.Call)."""
        self._waiting = seq  # a rank that rejected this very call is named at once (notices)
        if self._fingerprints:  # a rank in another kind of exchange (a monitored barrier) is named too
            self.engine.announce((seq, call))
        entries = [e if isinstance(e, tuple) else (-1, None)  # a rank in a monitored barrier sends None
                   for e in self.engine.exchange((seq, call), seq, deadline, watched=True)]
        calls = [c for _, c in entries]
        if all(s == seq for s, _ in entries) and call.agrees(calls):
            return
        raise self._mismatch(seq, entries)

    def _mismatch(self, seq: int, entries: list[tuple[int, Call | None]]) -> CollectiveMismatchError:
        return mismatch_error(self.global_rank, self.name, self.ranks, seq, entries)

    def _announce(self, tag: tuple[int, Call] | None, work: RequestWork | None = None) -> None:
        """An engine that compares the members' calls (local) is told what the engine call made
        right after is; a queued call's tag waits for its start (:meth:`_advance`)."""
        if work is not None:
            self._tags[work] = tag
        elif tag is not None:
            self.engine.announce(tag)

    # ----------------------------------------------------------------- starting and waiting
    def _run(self, op: str, start: Callable[[], Request], async_op: bool, shapes: tuple, ref: np.ndarray | None,
             settle: Callable[[], Any] | None, **fingerprint: Any) -> Work | None:
        """Start an operation by ``start()`` (one engine call) and complete it (see the module docstring)."""
        thread = self._thread
        if thread._pending and thread._runner != _get_ident():
            return self._behind_tasks(op, lambda: self._run(op, start, False, shapes, ref, settle, **fingerprint),
                                      async_op)
        seq = self._begin(op, ref, **fingerprint) if self._detail else self._number(op)
        tag = (seq, self._call(op, ref, **fingerprint)) if self._fingerprints else None
        dtype = ref.dtype if ref is not None else fingerprint.get("dtype")
        if async_op:
            with self._qlock:
                queued = self._queues and bool(self._inflight)
                record = self._flight_entry(seq, self.name, op, shapes, dtype, "scheduled" if queued else "started")
                try:
                    if not queued:
                        self._announce(tag)
                    request = None if queued else start()
                except BaseException as exc:
                    raise self._failed(op, seq, record, exc, self.timeout) from None
                work = RequestWork(self, op, seq, record, request, settle, self.timeout, start if queued else None)
                if queued and tag is not None:
                    self._announce(tag, work)
                work.queued = True
                self._inflight.append(work)
            return self._queued(work)
        if self._inflight:
            self._drain()
        record = self._flight_entry(seq, self.name, op, shapes, dtype, "started")
        try:
            self._announce(tag)
            request = start()
        except BaseException as exc:
            raise self._failed(op, seq, record, exc, self.timeout) from None
        return self._complete(op, seq, record, request, settle)

    def _complete(self, op: str, seq: int, record: CollectiveRecord, request: Request,
                  settle: Callable[[], Any] | None) -> None:
        """Wait for a started synchronous operation under the group's timeout."""
        try:
            if not request.Test():
                self._block(request, time.monotonic() + self.timeout, seq)
            if settle is not None:
                settle()
        except BaseException as exc:
            raise self._failed(op, seq, record, exc, self.timeout) from None
        record[STATE], record[T_END] = "completed", time.time()
        return None

    def _block(self, request: Request, deadline: float, seq: int) -> None:
        """Block on ``request`` (call #``seq``) until it completes: the engine's wait, which reads
        notices for call ``seq`` while it stalls; the progress agent stands back meanwhile (this
        caller drives MPI)."""
        self._waiting = seq
        waiting, me = self.world.progress.waiting, _get_ident()
        waiting.add(me)
        try:
            self.engine.wait(request, deadline)
        finally:
            waiting.discard(me)

    def _blocking(self, op: str, step: Callable[[int, float], Any], timeout: float) -> Any:
        """Run a blocking engine step ``step(seq, deadline)`` as operation ``op`` (split, monitored
        barrier): numbered, recorded and ordered like every other operation."""
        thread = self._thread
        if thread._pending and thread._runner != _get_ident():
            return thread.run_in_order(lambda: self._blocking(op, step, timeout), op)
        seq = self._begin(op, None) if self._detail and op == "split" else self._number(op)
        if self._inflight:
            self._drain()
        record = self._flight_entry(seq, self.name, op, (), None, "started")
        self._waiting = seq  # a wait in the step that reads notices reads them for this call
        try:
            if self._fingerprints:
                self._announce((seq, Call(op)))
            result = step(seq, time.monotonic() + timeout)
        except BaseException as exc:
            raise self._failed(op, seq, record, exc, timeout) from None
        record[STATE], record[T_END] = "completed", time.time()
        return result

    def _behind_tasks(self, op: str, call: Callable[[], Any], async_op: bool) -> Work | None:
        """A call made while ``run_async`` tasks are queued: it runs after them, in order."""
        if async_op:
            return self._thread.submit(call, Work(f"{op} on group {self.name}"))
        self._thread.run_in_order(call, op)
        return None

    # ----------------------------------------------------------------- the in-flight queue
    def _queued(self, work: RequestWork) -> RequestWork:
        """An async collective just queued: keep it moving (the agent), and test the one ahead of
        it once (which starts it if that one has completed)."""
        if self._tracks:
            self.world.progress.track(work)
        if getattr(work._request, "watchdog", False):  # device work: watched until done (see RequestWork.watchdog)
            self.world.progress.watchdog(work)
        if work._request is None:
            head = self._inflight[0] if self._inflight else None
            if head is not None and head is not work:
                head.poll(block=False)
        return work

    def _advance(self, done: RequestWork) -> None:
        """``done`` finished: start the next queued collective (failing queued ones the group can
        no longer run). Called by whichever thread finished it (a waiter or the progress agent)."""
        with self._qlock:
            queue = self._inflight
            if queue and queue[0] is done:
                queue.popleft()
            elif done in queue:
                queue.remove(done)
            while queue and queue[0]._request is None and not queue[0]._finished:
                nxt = queue[0]
                try:
                    if self._failure is not None:
                        self._unusable(nxt._op)
                    if self._tags:
                        self._announce(self._tags.pop(nxt, None))
                    nxt.start()
                    return
                except BaseException as exc:  # it cannot start: it fails, and the next one is tried
                    self._tags.pop(nxt, None)
                    queue.popleft()
                    nxt._result, nxt._error = None, self._work_failed(nxt, exc)
                    nxt._finished = True

    def _wait_before(self, work: RequestWork, deadline: float | None) -> None:
        """Wait for the collectives queued ahead of ``work`` until it has started (or failed)."""
        while work._request is None and not work._finished:
            with self._qlock:
                head = self._inflight[0] if self._inflight else None
            if head is None or head is work:
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise CollectiveTimeout(f"meshkit.comm: {work._what} did not start within Work.wait(timeout=...): "
                                        "the collectives of its group issued before it are still running",
                                        op=work._op)
            try:
                head.wait(left)
            except CollectiveTimeout as exc:
                if deadline is not None and time.monotonic() >= deadline:
                    raise CollectiveTimeout(f"meshkit.comm: {work._what} did not start within Work.wait(timeout="
                                            "...): the collectives of its group issued before it are still "
                                            "running", op=work._op) from exc
            except BaseException:  # the earlier one's own error is its waiter's; ours comes from _advance
                pass

    def _drain(self) -> None:
        """Before a synchronous collective: every queued one completes first (in program order)."""
        while self._inflight:
            last = self._inflight[-1]
            try:
                last.wait()
            except BaseException:  # that Work's error is raised by its own wait()
                pass

    # ----------------------------------------------------------------- epilogues
    def _averaged(self, buf: np.ndarray) -> Callable[[], None]:
        """AVG on an engine without it: the engine sums, then one division by the group size.

        For a power-of-two size and a real floating dtype the division is a multiplication by
        ``1 / size``: bit for bit the same (both are the correctly rounded ``x * 2**-k``) and
        1.6-1.7x faster (1 MB float32: 28 -> 16 us, 3 MB: 82 -> 51 us, timeit on this VM).
        """
        size = self.size
        if size & (size - 1) == 0 and buf.dtype.kind == "f":
            return functools.partial(_scale, buf, 1.0 / size)
        return functools.partial(_divide, buf, size)


def _divide(buf: np.ndarray, n: int) -> None:
    buf /= n


def _scale(buf: np.ndarray, factor: float) -> None:
    buf *= factor
