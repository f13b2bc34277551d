"""Handles of asynchronous operations, and the per-group thread that runs them in order.

Each process group owns one :class:`CommThread`, the CPU analogue of a CUDA stream: operations
submitted with ``async_op=True`` run there one after another, in submission order, while the
caller computes. A synchronous call runs inline when nothing is queued and otherwise joins the
queue and waits, so on every rank a group's collectives run in program order.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable

from .errors import CollectiveTimeout

__all__ = ["Work", "CommThread"]


class Work:
    """Handle of an asynchronous operation, as torch's ``Work``.

    ``wait()`` blocks until the operation finished and re-raises its error; ``is_completed()``
    never blocks.
    """

    __slots__ = ("_done", "_error", "_result", "_what")

    def __init__(self, what: str) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._result: Any = None
        self._what = what

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._done.set()

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

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the operation completes; return True.

        Args:
            timeout: seconds to wait at most; None waits until the operation itself finishes
                or times out under its group's timeout.

        Raises:
            CollectiveTimeout: ``timeout`` passed first (the operation keeps running).
            DistError: whatever the operation raised.
        """
        if not self._done.wait(timeout):
            raise CollectiveTimeout(
                f"meshkit.comm: {self._what} did not complete within Work.wait(timeout={timeout})",
                op=self._what)
        if self._error is not None:
            raise self._error
        return True

    def __repr__(self) -> str:
        state = "completed" if self.is_completed() else "pending"
        return f"<Work {self._what} {state}>"


class CommThread:
    """Runs a group's asynchronous operations one at a time, in submission order."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: collections.deque[tuple[Callable[[], Any], Work]] = collections.deque()
        self._cond = threading.Condition()
        self._pending = 0
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def idle(self) -> bool:
        """True when nothing is queued or running."""
        return self._pending == 0

    def submit(self, fn: Callable[[], Any], work: Work) -> Work:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"meshkit.comm: the communication thread of {self._name} is closed")
            self._pending += 1
            self._queue.append((fn, work))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()
        return work

    def run_in_order(self, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn`` after everything queued so far, in the caller when the queue is empty.

        Called from the communication thread itself (a task issuing collectives), it runs inline.
        """
        if self._pending == 0 or threading.current_thread() is self._thread:
            return fn()
        work = self.submit(fn, Work(what))
        work.wait()
        return work.result()

    def drain(self, timeout: float) -> bool:
        """Wait until the queue is empty; False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                fn, work = self._queue.popleft()
            try:
                result, error = fn(), None
            except BaseException as exc:  # handed to the waiter, never lost
                result, error = None, exc
            with self._cond:
                # Counted down before the Work completes: a caller woken by it finds the queue
                # idle and runs its next synchronous call inline.
                self._pending -= 1
                self._cond.notify_all()
            work._finish(result, error)
