"""Who may touch an NCCL communicator's handle, and aborting it (``ncclCommAbort``).

The handle is queried (``check_async_error``) by waiters and the watchdog, and destroyed or aborted
by the group: never at once (NCCL would read freed memory), and not after it was released (CuPy's
handle is then NULL: NCCL_ERROR_INVALID_ARGUMENT). A :class:`CommGuard`, one per engine, holds
that lock and the threads inside a blocking NCCL call on the communicator: an abort asked while
another thread is inside one (blocked in a runtime connection, a split, a destroy) is left to that
thread as it leaves the call, since ``ncclCommAbort`` must not run beside it on a blocking
communicator (CuPy 14.2 makes no other kind). A process exiting without
``destroy_process_group`` aborts every communicator still live (:func:`_abort_at_exit`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
from typing import Any, Iterator

__all__ = ["CommGuard"]

logger = logging.getLogger("meshkit")


class CommGuard:
    """The lock on one communicator's handle, the threads inside NCCL calls on it, and its abort.

    Attributes:
        handle_lock: held around every query of the handle and around releasing it.
        aborted: why the communicator was aborted, or None.
        released: destroyed or aborted: nothing may query the handle any more.
        exited: aborted at interpreter exit (the watchdog must not end a job that finished).
    """

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.handle_lock = threading.Lock()
        self.aborted: str | None = None
        self.released = False
        self.exited = False
        # Threads inside an NCCL call on this communicator, and an abort that waits for them to leave.
        self._inside: dict[int, int] = {}
        self._inside_lock = threading.Lock()
        self._abort_pending = False
        _live.add(self)

    def abort(self, why: str) -> None:
        """Abort the communicator (idempotent); left to a thread inside an NCCL call on it, if any."""
        with self.handle_lock:
            if self.aborted is not None or self.released:
                return
            self.aborted = why
            me = threading.get_ident()
            with self._inside_lock:
                if any(t != me for t in self._inside):
                    # Another thread is inside an NCCL call on this communicator (blocked in a
                    # runtime connection, a split, a destroy): ncclCommAbort must not run beside
                    # it on a blocking communicator (CuPy 14.2 makes no other kind). That thread
                    # aborts as it leaves the call (see calling); until then nothing can unblock it.
                    self._abort_pending = True
                    return
            self._abort_now()

    def _abort_now(self) -> None:
        """``ncclCommAbort``, once; the caller holds ``handle_lock`` (nothing queries it after)."""
        self.released = True
        _live.discard(self)
        try:
            self.comm.abort()
        except Exception:  # aborting is the last resort: its own failure changes nothing
            pass

    @contextlib.contextmanager
    def calling(self) -> Iterator[None]:
        """The calling thread is inside an NCCL call on this communicator for the block (calls
        that may block the host: enqueues that connect at first use, groupEnd, commSplit,
        destroy); an abort asked meanwhile by another thread runs as the last thread leaves."""
        me = threading.get_ident()
        with self._inside_lock:
            self._inside[me] = self._inside.get(me, 0) + 1
        try:
            yield
        finally:
            with self._inside_lock:
                self._inside[me] -= 1
                if not self._inside[me]:
                    del self._inside[me]
                pending = self._abort_pending and not self._inside
                if pending:
                    self._abort_pending = False
            if pending:
                with self.handle_lock:
                    if not self.released:
                        self._abort_now()

    def release(self) -> bool:
        """At ``free``: whether the caller must destroy the communicator (``ncclCommDestroy``); from
        here on nothing queries it. An abort left to a thread that has since left is done now."""
        with self.handle_lock:  # a query in flight on another thread finishes first
            destroy = self.aborted is None and not self.released
            if self.aborted is not None and not self.released:  # an abort left to a thread inside NCCL
                with self._inside_lock:
                    busy = bool(self._inside)
                if not busy:  # that thread has left: abort now rather than leave the communicator live
                    self._abort_now()
            else:
                self.released = True
                _live.discard(self)
        return destroy


#: Guards whose communicator is neither destroyed nor aborted (see :func:`_abort_at_exit`).
_live: set[CommGuard] = set()


def _abort_at_exit() -> None:
    """The interpreter exits with communicators never destroyed (no ``destroy_process_group``):
    abort them (torch's ProcessGroupNCCL likewise warns when it is destructed without
    destroy_process_group).

    Otherwise CuPy's ``NcclCommunicator.__dealloc__`` calls ``ncclCommDestroy`` during interpreter
    teardown: a collective, blocking call that waits for the other ranks to destroy the same
    communicator, which they may never do (exited, crashed, or freeing theirs in another order):
    the process hangs at exit. ``ncclCommAbort`` is local, and leaves CuPy a NULL handle.
    """
    guards = list(_live)
    if guards:
        logger.warning("meshkit: the process exits without destroy_process_group(): aborting %d NCCL "
                       "communicator(s) instead of destroying them (a destroy is collective and could hang)",
                       len(guards))
    for guard in guards:
        guard.exited = True
        guard.abort("the process exited without destroy_process_group()")


atexit.register(_abort_at_exit)
