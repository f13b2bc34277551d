"""How a ProcessGroup fails: the failed call recorded, the group broken, the other ranks told.

A call that fails or times out is recorded in the flight recorder and turned into the error its
caller raises (a timeout names the ranks that did not arrive, where that can be known). A
timeout, a peer's failure, or a ``run_async`` task that raised *breaks* the group on this rank:
later calls raise, the engine aborts what it started (NCCL), and the other members are sent a
notice (:mod:`~meshkit.comm.notices`), as they are when this rank rejects a call's arguments.
A rank stalled in a wait reads the notices it received, and fails at once when one shows that
the call it waits in can never complete.

:class:`FailureMixin` is a part of :class:`~meshkit.comm.group.ProcessGroup` (which inherits
it): its methods use the group's state, set in ``ProcessGroup.__init__``.
"""

from __future__ import annotations

import logging
import threading
import time

from .checks import where
from .debug import ERROR, STATE, T_END, CollectiveRecord
from .engine import CallsDiffer, DeadlineExceeded
from .errors import CollectiveMismatchError, CollectiveTimeout, DistBackendError, DistError, RankFailedError
from .notices import BROKEN, REJECTED, WATCH_INTERVAL, Notice
from .p2p import P2PWork
from .work import RequestWork
from .world import dump_flight_record

__all__ = ["FailureMixin"]

logger = logging.getLogger("meshkit")

#: Notices are read by the waiting caller and by the progress agent's watchdog: one at a time
#: (MPI's mailbox is an iprobe then a receive, which two threads must not interleave).
_notice_lock = threading.Lock()
#: Seconds a rank whose call timed out on an engine that aborts (NCCL) listens for the members
#: that had reached the call: they were waiting in it (or their watchdog was), read its BROKEN
#: notice within WATCH_INTERVAL (10 ms) and answer with theirs; 50x that leaves room for a
#: loaded machine. It is waited in full only when some member never reached the call.
_ARRIVAL_GRACE = 0.5


class FailureMixin:
    """How :class:`~meshkit.comm.group.ProcessGroup` records a failure, breaks, and hears of its peers'."""

    # ----------------------------------------------------------------- failed calls
    def _failed(self, op: str, seq: int, record: CollectiveRecord, exc: BaseException,
                timeout: float) -> BaseException:
        """Record how operation ``seq`` failed; return the error to raise (a timeout becomes a
        :class:`CollectiveTimeout` and makes the group unusable; anything else is re-raised)."""
        record[T_END] = time.time()
        if isinstance(exc, CallsDiffer):  # the engine compared the members' calls (local)
            exc = self._mismatch(seq, exc.entries)
        if isinstance(exc, DeadlineExceeded):
            record[STATE] = "timed_out"
            self._broken(f"{op} #{seq} timed out", seq, timed_out=True)
            if self._abandons:
                exc.detail = f"{exc.detail}; the communicator was aborted" if exc.detail else \
                    "the communicator was aborted"
                if exc.missing is None and seq >= 0:
                    exc.missing = self._not_arrived(seq)
            error = self._timeout_error(op, seq, timeout, exc)
            record[ERROR] = str(error)
            logger.error("%s\n%s", error, self.world.recorder.format(self.global_rank))
            dump_flight_record(self.world, error)  # MESHKIT_TRACE_DIR, for python -m meshkit.debug analyze
            return error
        record[STATE], record[ERROR] = "failed", repr(exc)
        # A peer's failure breaks the group; on an engine that aborts (NCCL), so does its own
        # failure (an asynchronous NCCL error aborted the communicator): the others are told.
        if self._failure is None and (isinstance(exc, RankFailedError)
                                      or (self._abandons and isinstance(exc, DistBackendError))):
            self._broken(f"{op} #{seq} failed: {exc}", seq)
        if isinstance(exc, CollectiveMismatchError):
            logger.error("%s\n%s", exc, self.world.recorder.format(self.global_rank))
        dump_flight_record(self.world, exc)
        return exc

    def _work_failed(self, work: RequestWork, exc: BaseException) -> BaseException:
        """A Work of this group failed: record it; the error its waiters raise."""
        if isinstance(work, P2PWork):
            return work.error(exc)
        return self._failed(work._op, work._seq, work._record, exc, self.timeout)

    def _watchdog_failed(self, work: RequestWork, exc: BaseException) -> BaseException:
        """The watchdog found ``work``'s device operation failed or past its deadline, possibly
        after its ``Work.wait()`` returned (which only ordered the caller's stream): it fails as
        a waiter's would, the group breaks (the communicator is aborted, the others are told; the
        next call raises), and the error is logged with the flight record, since no caller may
        be there to raise it."""
        error = self._work_failed(work, exc)
        if self._failure is None:
            self._broken(f"{work._op} #{work._seq} failed: {error}", work._seq)
        if not (isinstance(exc, DeadlineExceeded) and work._seq >= 0):  # _failed logged a collective's timeout
            logger.error("%s\n%s", error, self.world.recorder.format(self.global_rank))
        return error

    def _timeout_error(self, op: str, seq: int, timeout: float, exc: DeadlineExceeded) -> CollectiveTimeout:
        head = (f"meshkit.comm: rank {self.global_rank}: {op} #{seq} on group {self.name} "
                f"(ranks {list(self.ranks)}) timed out after {timeout:.1f} s")
        if exc.missing:
            who = f"ranks that did not arrive: {sorted(exc.missing)}"
        elif exc.missing is not None:
            who = ("every rank reached the call; they may have called different collectives or "
                   "counts (run with MESHKIT_DEBUG=detail to check every call)")
        else:
            who = (f"the {self.backend} engine cannot tell which ranks did not arrive; run with "
                   "MESHKIT_DEBUG=detail to check arrivals before every collective, or use monitored_barrier")
        detail = f" ({exc.detail})" if exc.detail else ""
        return CollectiveTimeout(f"{head}; {who}{detail}", op=op, group=self.name, seq=seq, missing=exc.missing)

    # ----------------------------------------------------------------- a broken group, and telling the others
    def _broken(self, why: str, seq: int, *, timed_out: bool = False) -> None:
        """This rank stops using the group at call ``seq``; the other members are told (after the
        engine, if it can, aborted what it had started: an NCCL kernel would otherwise wait for
        the missing ranks forever)."""
        self._failure = why
        if self._abandons:
            self.engine.abandon(why)
        self._tell(Notice(BROKEN, self.global_rank, self.ranks, seq, why, timed_out=timed_out))

    def _unusable(self, op: str) -> None:
        raise DistError(f"{where(self, op)}: group {self.name} is unusable after an earlier failure: "
                        f"{self._failure}")

    def _tell(self, notice: Notice) -> None:
        others = [r for r in self.ranks if r != self.global_rank]
        if others and self.engine is not None:
            try:
                self.engine.notify(others, notice)
            except Exception:  # telling is best effort: the caller's own error matters more
                logger.debug("meshkit: rank %d could not send %s", self.global_rank, notice, exc_info=True)

    def _reject(self, op: str, exc: BaseException) -> BaseException:
        """``op``'s arguments were rejected on this rank. As in torch the call does not count, but
        the members that did start it are told, so that they fail instead of waiting for the
        timeout (unless this rank starts the call, corrected, soon after)."""
        if self.rank >= 0 and self._failure is None and not self.world.destroyed:
            seq = self._seq
            self._rejected.add(seq)
            record = self._flight_entry(seq, self.name, op, (), None, "rejected")
            record[ERROR] = str(exc)
            self._tell(Notice(REJECTED, self.global_rank, self.ranks, seq, f"{type(exc).__name__}: {exc}"))
        return exc

    # ----------------------------------------------------------------- notices from the others
    def _stalled(self) -> None:
        """Called while a wait on this group lasts: raise if a notice shows it is in vain."""
        self._check_notices(self._waiting)

    def _read_notices(self) -> list[Notice]:
        """Every notice this rank received so far (new ones read from the engine)."""
        world = self.world
        with _notice_lock:
            world.notices.extend(self.engine.notices())
        return world.notices

    def _check_notices(self, seq: int) -> None:
        """RankFailedError if a notice shows that call #``seq`` (-1: a send or receive) cannot complete."""
        for notice in self._read_notices():
            if notice.blocks(self.ranks, seq, self._rejected, aborts=self._abandons):
                what = f"call #{seq}" if seq >= 0 else "a send or receive"
                raise RankFailedError(f"meshkit.comm: rank {self.global_rank}: {what} on group "
                                      f"{self.name} (ranks {list(self.ranks)}) cannot complete: "
                                      f"{notice.describe(self.name, p2p=self._waiting < 0)}")

    def _not_arrived(self, seq: int) -> list[int]:
        """The members that never reached call #``seq``, which timed out here (engines that abort).

        This rank has told the others (a BROKEN notice) and aborted its communicator, so every
        member waiting in call ``seq`` or a later one fails at once and tells the others in turn
        (see :meth:`Notice.blocks`); a member that never issued the call is not waiting in it and
        stays silent. So the members not heard from within ``_ARRIVAL_GRACE`` did not arrive.
        """
        others = set(self.ranks) - {self.global_rank}
        deadline = time.monotonic() + _ARRIVAL_GRACE
        while True:
            missing = others - {n.sender for n in self._read_notices() if n.reached(self.ranks, seq)}
            if not missing or time.monotonic() >= deadline:
                return sorted(missing)
            time.sleep(WATCH_INTERVAL)
