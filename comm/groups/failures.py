"""How a ProcessGroup fails: the failed call recorded, the group broken, the other ranks told.

A call that fails or times out is recorded in the flight recorder and turned into the error its
caller raises (a timeout names the ranks that did not arrive, where that can be known). A
timeout, a peer's failure, or a ``run_async`` task that raised *breaks* the group on this rank:
later calls raise, the engine aborts what it started (NCCL), and the other members are sent a
notice (:mod:`~meshkit.comm.notices`), as they are when this rank rejects a call's arguments.
A rank stalled in a wait reads the notices it received, and fails at once when one shows that
the call it waits in can never complete.

A :class:`FailureState` is a part a :class:`~meshkit.comm.groups.group.ProcessGroup` holds (its
``failures``): it keeps the group's failure state (the reason it broke, the calls this rank
rejected, the call a wait is for) and reads the group's identity and engine through the group.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, cast

from .call_fingerprint import MISMATCH_NOTICE, explain
from ..checks import where
from ..debug import ERROR, STATE, T_END, CollectiveRecord, mismatch_error
from ..engines.engine import Abandons, CallsDiffer, DeadlineExceeded, Survives
from ..errors import CollectiveMismatchError, CollectiveTimeout, DistBackendError, DistError, RankFailedError
from ..notices import BROKEN, WATCH_INTERVAL, Notice
from .world import dump_flight_record

__all__ = ["FailureState"]

logger = logging.getLogger("meshkit")

#: Notices are read by the waiting caller and by the progress agent's watchdog: one at a time
#: (MPI's mailbox is an iprobe then a receive, which two threads must not interleave).
_notice_lock = threading.Lock()
#: Seconds a rank whose call timed out on an engine that aborts (NCCL) listens for the members
#: that had reached the call: they were waiting in it (or their watchdog was), read its BROKEN
#: notice within WATCH_INTERVAL (10 ms) and answer with theirs; 50x that leaves room for a
#: loaded machine. It is waited in full only when some member never reached the call.
_ARRIVAL_GRACE = 0.5


class FailureState:
    """How a :class:`~meshkit.comm.groups.group.ProcessGroup` records a failure, breaks, and hears of its peers'.

    Attributes:
        reason: why the group broke on this rank (later calls raise), or None while it is usable.
        rejected: the numbers of calls this rank rejected (they did not count; see ``Notice.blocks``).
        waiting: the number of the call a wait on this group is for (-1: a send or receive).
        abandons: the engine aborts its communicator when the group breaks (``capabilities.abandons``).
    """

    __slots__ = ("group", "reason", "rejected", "waiting", "abandons", "failed_ranks")

    def __init__(self, group: Any, *, abandons: bool) -> None:
        self.group = group
        self.reason: str | None = None
        self.rejected: set[int] = set()
        self.waiting = 0
        self.abandons = abandons
        self.failed_ranks: tuple[int, ...] | None = None  # set when a rank failure broke the group

    # ----------------------------------------------------------------- failed calls
    def failed(self, op: str, seq: int, record: CollectiveRecord, exc: BaseException,
               timeout: float) -> BaseException:
        """Record how operation ``seq`` failed; return the error to raise (a timeout becomes a
        :class:`CollectiveTimeout` and makes the group unusable; anything else is re-raised)."""
        group = self.group
        record[T_END] = time.time()
        exc = self.engine_error(exc, f"{op} #{seq} on group {group.name}")
        if isinstance(exc, CallsDiffer):  # the engine compared the members' calls (local)
            # (an engine that does not know the group's numbering leaves it None: this call's)
            exc = self.mismatch(seq, [(seq if s is None else s, c) for s, c in exc.entries])
        if isinstance(exc, DeadlineExceeded):
            record[STATE] = "timed_out"
            self.broken(f"{op} #{seq} timed out", seq, timed_out=True)
            if self.abandons:
                exc.detail = f"{exc.detail}; the communicator was aborted" if exc.detail else \
                    "the communicator was aborted"
                if exc.missing is None and seq >= 0:
                    exc.missing = self.not_arrived(seq)
            error = self._timeout_error(op, seq, timeout, exc)
            record[ERROR] = str(error)
            logger.error("%s\n%s", error, group.world.recorder.format(group.global_rank))
            dump_flight_record(group.world, error)  # MESHKIT_TRACE_DIR, for python -m meshkit.debug analyze
            return error
        record[STATE], record[ERROR] = "failed", repr(exc)
        # A peer's failure breaks the group; on an engine that aborts (NCCL), so does its own
        # failure (an asynchronous NCCL error aborted the communicator): the others are told.
        if isinstance(exc, RankFailedError) and self.failed_ranks is None:
            self.failed_ranks = exc.failed_ranks
        if self.reason is None and (isinstance(exc, RankFailedError)
                                    or (self.abandons and isinstance(exc, DistBackendError))):
            self.broken(f"{op} #{seq} failed: {exc}", seq)
        if isinstance(exc, CollectiveMismatchError) and self.reason is None:  # (a fingerprint's, logged already)
            logger.error("%s\n%s", exc, group.world.recorder.format(group.global_rank))
        dump_flight_record(group.world, exc)
        return exc

    def engine_error(self, exc: BaseException, what: str, request: Any = None) -> BaseException:
        """``exc`` as the caller sees it: an engine on a fault-tolerant MPI (``meshkit-run --survive``)
        names a dead peer's error as one RankFailedError, whichever call (``what``) met it
        (comm/engines/mpi_ulfm.py; ``request``: the call's, which the engine may have to keep);
        the group then breaks as for any peer's failure."""
        group = self.group
        if group.engine is None or not group.engine.capabilities.survives:
            return exc
        error = cast(Survives, group.engine).rank_failure(exc, what, request)
        if error is None:
            return exc
        if isinstance(error, RankFailedError) and self.failed_ranks is None:
            self.failed_ranks = error.failed_ranks
        if self.reason is None:
            self.broken(f"{what} failed: {error}", -1)
        return error

    def watchdog_failed(self, op: str, seq: int, error: BaseException, exc: BaseException) -> None:
        """The watchdog found call ``seq``'s device operation failed (``exc``, recorded as ``error``),
        possibly after its ``Work.wait()`` returned (which only ordered the caller's stream): the
        group breaks (the communicator is aborted, the others are told; the next call raises), and
        the error is logged with the flight record, since no caller may be there to raise it."""
        if self.reason is None:
            self.broken(f"{op} #{seq} failed: {error}", seq)
        if not (isinstance(exc, DeadlineExceeded) and seq >= 0):  # failed() logged a collective's timeout
            group = self.group
            logger.error("%s\n%s", error, group.world.recorder.format(group.global_rank))

    def mismatch(self, seq: int, entries: list) -> CollectiveMismatchError:
        group = self.group
        return mismatch_error(group.global_rank, group.name, group.ranks, seq, entries)

    def _timeout_error(self, op: str, seq: int, timeout: float, exc: DeadlineExceeded) -> CollectiveTimeout:
        group = self.group
        head = (f"meshkit.comm: rank {group.global_rank}: {op} #{seq} on group {group.name} "
                f"(ranks {list(group.ranks)}) timed out after {timeout:.1f} s")
        if exc.missing:
            who = f"ranks that did not arrive: {sorted(exc.missing)}"
        elif exc.missing is not None:
            who = ("every rank reached the call; they may have called different collectives or "
                   "counts (run with MESHKIT_DEBUG=detail to check every call)")
        else:
            who = (f"the {group.backend} engine cannot tell which ranks did not arrive; run with "
                   "MESHKIT_DEBUG=detail to check arrivals before every collective, or use monitored_barrier")
        detail = f" ({exc.detail})" if exc.detail else ""
        return CollectiveTimeout(f"{head}; {who}{detail}", op=op, group=group.name, seq=seq, missing=exc.missing)

    # ----------------------------------------------------------------- a broken group, and telling the others
    def broken(self, why: str, seq: int, *, timed_out: bool = False) -> None:
        """This rank stops using the group at call ``seq``; the other members are told (after the
        engine, if it can, aborted what it had started: an NCCL kernel would otherwise wait for
        the missing ranks forever)."""
        group = self.group
        self.reason = why
        if self.abandons:
            cast(Abandons, group.engine).abandon(why)
        self.tell(Notice(BROKEN, group.global_rank, group.ranks, seq, why, timed_out=timed_out,
                         failed=tuple(self.failed_ranks or ())))

    def unusable(self, op: str) -> None:
        """Raise: the group broke earlier (a RankFailedError naming the dead if a rank failure broke it)."""
        group = self.group
        text = f"{where(op, group)}: group {group.name} is unusable after an earlier failure: {self.reason}"
        if self.failed_ranks is not None:  # a rank failure: the same error type, for the caller's except
            raise RankFailedError(text, failed_ranks=self.failed_ranks)
        raise DistError(text)

    def tell(self, notice: Notice) -> None:
        """Send ``notice`` to the group's other members (best effort)."""
        group = self.group
        others = [r for r in group.ranks if r != group.global_rank]
        if others and group.engine is not None:
            try:
                group.engine.notify(others, notice)
            except Exception:  # telling is best effort: the caller's own error matters more
                logger.debug("meshkit: rank %d could not send %s", group.global_rank, notice, exc_info=True)

    # ----------------------------------------------------------------- notices from the others
    def stalled(self) -> None:
        """Called while a wait on this group lasts (the engine's ``watch``): raise if a notice shows it is in vain."""
        self.check_notices(self.waiting)

    def read_notices(self) -> list[Notice]:
        """Every notice this rank received so far (new ones read from the engine)."""
        world = self.group.world
        with _notice_lock:
            world.notices.extend(self.group.engine.notices())
        return world.notices

    def check_notices(self, seq: int) -> None:
        """RankFailedError if a notice shows that call #``seq`` (-1: a send or receive) cannot complete."""
        group = self.group
        for notice in self.read_notices():
            if notice.blocks(group.ranks, seq, self.rejected, aborts=self.abandons):
                if notice.kind == BROKEN and notice.detail.startswith(MISMATCH_NOTICE) and self.reason is None:
                    # the member found the group's calls differ: this rank, stalled in one of them, joins
                    # the exchange that names them, and raises the same mismatch
                    queue = group.queue
                    raise explain(group, (queue.seq, queue.sequence.value), f"rank {notice.sender}'s notice")
                what = f"call #{seq}" if seq >= 0 else "a send or receive"
                raise RankFailedError(f"meshkit.comm: rank {group.global_rank}: {what} on group "
                                      f"{group.name} (ranks {list(group.ranks)}) cannot complete: "
                                      f"{notice.describe(group.name, p2p=self.waiting < 0)}",
                                      failed_ranks=notice.failed)

    def not_arrived(self, seq: int) -> list[int]:
        """The members that never reached call #``seq``, which timed out here (engines that abort).

        This rank has told the others (a BROKEN notice) and aborted its communicator, so every
        member waiting in call ``seq`` or a later one fails at once and tells the others in turn
        (see :meth:`Notice.blocks`); a member that never issued the call is not waiting in it and
        stays silent. So the members not heard from within ``_ARRIVAL_GRACE`` did not arrive.
        """
        group = self.group
        others = set(group.ranks) - {group.global_rank}
        deadline = time.monotonic() + _ARRIVAL_GRACE
        while True:
            missing = others - {n.sender for n in self.read_notices() if n.reached(group.ranks, seq)}
            if not missing or time.monotonic() >= deadline:
                return sorted(missing)
            time.sleep(WATCH_INTERVAL)
