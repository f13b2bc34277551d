"""What every process group shares beneath its public methods: identity, execution, engines.

:class:`GroupBase` holds a group's identity (its global ranks, this rank's place, its name and
timeout) and runs its operations: numbered in execution order, recorded in the flight
recorder, given a deadline, verified across ranks in detail mode, queued on the group's
communication thread when asynchronous. Engines (``local``, ``mpi``) implement the ``_e_*``
methods declared here: blocking steps on already-checked arrays that give up at a
``deadline`` (a ``time.monotonic()`` value) by raising :class:`DeadlineExceeded`. The public
collectives, with their argument checks, are :class:`~meshkit.comm.group.ProcessGroup`'s.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from .checks import check_root, where
from .debug import ERROR, SEQ, STATE, T_END, T_START, Call, CollectiveRecord, DebugLevel
from .errors import CollectiveMismatchError, CollectiveTimeout, DistError, DistValueError
from .reduce_op import ReduceOp
from .work import CommThread, Work

if TYPE_CHECKING:
    from .world import World

__all__ = ["GroupBase", "DeadlineExceeded", "P2PHandle"]

logger = logging.getLogger("meshkit")

class DeadlineExceeded(Exception):
    """An engine step passed its deadline. ``missing``: global ranks known not to have arrived."""

    def __init__(self, missing: list[int] | None = None, detail: str = "") -> None:
        super().__init__(detail)
        self.missing = missing
        self.detail = detail


class P2PHandle:
    """An engine's posted send or receive. ``wait`` returns False if the deadline passed."""

    source: int = -1  # group rank the message came from (receives)

    def test(self) -> bool:
        raise NotImplementedError

    def wait(self, deadline: float) -> bool:
        raise NotImplementedError


class GroupBase:
    """A group's identity and the machinery that runs its operations (see the module docstring).

    Attributes:
        ranks: the global ranks of the group, ascending.
        rank: this process's rank within the group, or -1 if it is not a member.
        size: number of ranks.
        name: a readable name (``"world"``, ``"dp"``, ``"group[0, 2]"``).
        timeout: seconds every blocking call waits at most.
    """

    @property
    def backend(self) -> str:  # engines override with a class attribute ("mpi", "local")
        """The engine; for a handle of a group this rank is not in, the world's engine."""
        return self.world.backend

    def __init__(self, *, world: World, ranks: Sequence[int], group_rank: int, name: str,
                 timeout: float) -> None:
        self.world = world
        self.ranks: tuple[int, ...] = tuple(int(r) for r in ranks)
        self.rank = group_rank
        self.size = len(self.ranks)
        self.name = name
        self.timeout = float(timeout)
        self._seq = 0
        self._failure: str | None = None
        self._thread = CommThread(f"meshkit-comm[{name}]")
        self._flight_entry = world.recorder.record  # bound once: called on every operation
        self._group_rank_of = {g: i for i, g in enumerate(self.ranks)}
        # Decided once: in detail mode every call is fingerprinted, otherwise nothing is built.
        self._detail = world.debug >= DebugLevel.DETAIL

    # ----------------------------------------------------------------- identity
    @property
    def global_rank(self) -> int:
        """This process's rank in the world."""
        return self.world.rank

    @property
    def is_member(self) -> bool:
        return self.rank >= 0

    def group_rank_of(self, global_rank: int) -> int:
        """The group rank of a global rank; ValueError if it is not in the group."""
        try:
            return self._group_rank_of[int(global_rank)]
        except (KeyError, TypeError, ValueError):
            raise DistValueError(f"meshkit.comm: rank {self.global_rank}: global rank {global_rank!r} is not "
                                 f"in group {self.name} (ranks {list(self.ranks)})") from None

    def global_rank_of(self, group_rank: int) -> int:
        """The global rank of a group rank; ValueError if out of range."""
        return self.ranks[check_root(self, "get_global_rank", "group_rank", group_rank)]

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} {self.name!r} ranks={list(self.ranks)} rank={self.rank} "
                f"timeout={self.timeout:g}s>")

    # ----------------------------------------------------------------- execution
    def _launch(self, op: str, fn: Callable[[float], Any], async_op: bool, shapes: tuple, dtype: Any,
                call: Call | None, *, timeout: float | None = None) -> Any:
        limit = self.timeout if timeout is None else timeout
        if not async_op and self._thread._pending == 0:
            # The common case, run inline: numbered and recorded as started at once, no task object.
            seq = self._seq
            record = self._flight_entry(seq, self.name, op, shapes, dtype, "started")
            return self._execute(op, fn, record, call, limit, seq)
        record = self._flight_entry(-1, self.name, op, shapes, dtype)

        def task() -> Any:
            return self._execute(op, fn, record, call, limit)

        if async_op:
            return self._thread.submit(task, Work(f"{op} on group {self.name}"))
        return self._thread.run_in_order(task, op)

    def run_async(self, fn: Callable[[], Any], what: str) -> Work:
        """Run ``fn`` on this group's communication thread, after everything queued before it.

        Collectives ``fn`` calls on this group run inline there, in order. Used by
        communication hooks that chain several collectives with computation in between.
        """
        self._member(what)
        return self._thread.submit(fn, Work(f"{what} on group {self.name}"))

    def _execute(self, op: str, fn: Callable[[float], Any], record: CollectiveRecord, call: Call | None,
                 timeout: float, seq: int | None = None) -> Any:
        """Run ``fn(deadline)`` as operation number ``seq`` of this group, keeping ``record`` current.

        ``seq`` is given when the record was made already started (the inline path); otherwise
        the operation is numbered here, when it runs: execution is serialized per group, so
        every rank agrees on the numbers.
        """
        if seq is None:
            seq = record[SEQ] = self._seq
            record[STATE], record[T_START] = "started", time.time()
        self._seq = seq + 1
        if self._failure is not None:
            record[STATE] = "failed"
            raise DistError(f"{where(self, op)}: group {self.name} is unusable after an earlier failure: "
                            f"{self._failure}")
        deadline = time.monotonic() + timeout
        try:
            if call is not None:
                self._verify(call, seq, deadline)
            result = fn(deadline)
        except BaseException as exc:
            error = self._failed(op, seq, record, exc, timeout)
            if error is exc:
                raise
            raise error from None
        record[STATE], record[T_END] = "completed", time.time()
        return result

    def _failed(self, op: str, seq: int, record: CollectiveRecord, exc: BaseException,
                timeout: float) -> BaseException:
        """Record how operation ``seq`` failed; return the error to raise (a timeout becomes a
        :class:`CollectiveTimeout` and makes the group unusable; anything else is re-raised)."""
        record[T_END] = time.time()
        if isinstance(exc, DeadlineExceeded):
            record[STATE] = "timed_out"
            self._failure = f"{op} #{seq} timed out"
            error = self._timeout_error(op, seq, timeout, exc)
            record[ERROR] = str(error)
            logger.error("%s\n%s", error, self.world.recorder.format(self.global_rank))
            return error
        record[STATE], record[ERROR] = "failed", repr(exc)
        if isinstance(exc, CollectiveMismatchError):
            logger.error("%s\n%s", exc, self.world.recorder.format(self.global_rank))
        return exc

    def _timeout_error(self, op: str, seq: int, timeout: float, exc: DeadlineExceeded) -> CollectiveTimeout:
        head = (f"meshkit.comm: rank {self.global_rank}: {op} #{seq} on group {self.name} "
                f"(ranks {list(self.ranks)}) timed out after {timeout:.1f} s")
        if exc.missing is not None:
            who = f"ranks that did not arrive: {sorted(exc.missing)}"
        else:
            who = (f"the {self.backend} engine cannot tell which ranks did not arrive; run with "
                   "MESHKIT_DEBUG=detail to check arrivals before every collective, or use monitored_barrier")
        detail = f" ({exc.detail})" if exc.detail else ""
        return CollectiveTimeout(f"{head}; {who}{detail}", op=op, group=self.name, seq=seq, missing=exc.missing)

    def _verify(self, call: Call, seq: int, deadline: float) -> None:
        """Detail mode: every rank must have called the same collective (see debug.Call)."""
        entries = self._e_exchange((seq, call), seq, deadline)
        calls = [c for _, c in entries]
        if all(s == seq for s, _ in entries) and call.agrees(calls):
            return
        described = {self.ranks[i]: f"{c} #{s}" for i, (s, c) in enumerate(entries)}
        lines = "; ".join(f"rank {r}: {d}" for r, d in described.items())
        raise CollectiveMismatchError(
            f"meshkit.comm: rank {self.global_rank}: collective mismatch on group {self.name} at #{seq}: "
            f"{lines}", calls=described)

    def _shutdown(self) -> None:
        """Finish queued async work (within the timeout), stop the thread, release the engine."""
        drained = self._thread.drain(self.timeout)
        self._thread.close()
        if not drained:
            self._failure = self._failure or "destroyed with asynchronous work still running"
            logger.warning("meshkit: group %s destroyed with asynchronous work still queued after %.0f s",
                           self.name, self.timeout)
        self._e_free()

    # ----------------------------------------------------------------- engine interface
    def _e_all_reduce(self, buf: np.ndarray, op: ReduceOp, deadline: float) -> None:
        raise NotImplementedError

    #: True for engines that can start an all_reduce and wait for it separately
    #: (``_e_post_all_reduce`` and ``_e_complete``); see :meth:`_all_reduce_now`.
    _posts_all_reduce = False

    def _e_post_all_reduce(self, buf: np.ndarray, op: ReduceOp) -> Any:
        raise NotImplementedError

    def _e_complete(self, handle: Any, deadline: float) -> None:
        raise NotImplementedError

    def _e_reduce(self, buf: np.ndarray, op: ReduceOp, root: int, deadline: float) -> None:
        raise NotImplementedError

    def _e_broadcast(self, buf: np.ndarray, root: int, deadline: float) -> None:
        raise NotImplementedError

    def _e_all_gather(self, out: np.ndarray, inp: np.ndarray, deadline: float) -> None:
        raise NotImplementedError

    def _e_reduce_scatter(self, out: np.ndarray, inp: np.ndarray, op: ReduceOp, deadline: float) -> None:
        raise NotImplementedError

    def _e_gather(self, out: np.ndarray | None, inp: np.ndarray, root: int, deadline: float) -> None:
        raise NotImplementedError

    def _e_scatter(self, out: np.ndarray, inp: np.ndarray | None, root: int, deadline: float) -> None:
        raise NotImplementedError

    def _e_all_to_all(self, out: np.ndarray, recv_counts: list[int], inp: np.ndarray, send_counts: list[int],
                      deadline: float) -> None:
        raise NotImplementedError

    def _e_barrier(self, deadline: float) -> None:
        raise NotImplementedError

    def _e_exchange(self, payload: Any, seq: int, deadline: float) -> list[Any]:
        """Monitored all-gather of a small object; DeadlineExceeded names who did not arrive."""
        raise NotImplementedError

    def _e_split(self, color: int | None, ranks: tuple[int, ...], name: str, deadline: float) -> GroupBase | None:
        raise NotImplementedError

    def _e_isend(self, buf: np.ndarray, dst: int, tag: int) -> P2PHandle:
        raise NotImplementedError

    def _e_irecv(self, buf: np.ndarray, src: int | None, tag: int) -> P2PHandle:
        raise NotImplementedError

    def _e_free(self) -> None:
        """Release engine resources; called once by destroy_process_group."""
