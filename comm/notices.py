"""Notices: how one rank tells the others that a collective they wait in will never complete.

Without them, a rank that never takes part in a collective leaves the others waiting the full
timeout (300 s by default). A rank sends a notice to the members of a group when

* it **rejected** a call's arguments (say, a bad ``scatter_list`` that only the root checks):
  as in torch the call does not count (a corrected retry is the same call ``seq``), but the
  others, which did start call ``seq``, fail if they are still waiting for it
  :data:`WATCH_INTERVAL` later, instead of waiting for the timeout;
* it found the group **broken** (a timeout, or a peer's failure): it will not take part in
  anything after ``seq`` either;
* it **left**: it destroyed the world or its script ended, after ``counts[group]`` calls on
  each of its groups.

Notices travel on a channel of their own (for MPI, a duplicate of ``MPI_COMM_WORLD``). A rank
reads them only while stalled in a wait (every :data:`WATCH_INTERVAL` seconds, after waiting
that long), so they cost nothing on the fast path, and a rank stalled on a call that a notice
shows can never complete raises :class:`~meshkit.comm.errors.RankFailedError` within tens of
milliseconds, naming the rank and what it did.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Notice", "WATCH_INTERVAL", "REJECTED", "BROKEN", "LEFT"]

#: Seconds of waiting before a stalled rank first reads its notices, and between reads.
WATCH_INTERVAL = 0.01

REJECTED, BROKEN, LEFT = "rejected", "broken", "left"


@dataclasses.dataclass(frozen=True)
class Notice:
    """What a rank tells the others.

    Attributes:
        kind: REJECTED, BROKEN or LEFT.
        sender: the sender's global rank.
        group: the group's global ranks (REJECTED, BROKEN), or None (LEFT).
        seq: the call number on that group (REJECTED, BROKEN).
        detail: a readable description (the error, or how the rank left).
        counts: LEFT: the number of calls the sender issued on each of its groups.
        timed_out: BROKEN: the sender's call ``seq`` timed out (rather than failing).
        failed: BROKEN: the global ranks the sender knows dead (a rank failure broke the group,
            ``meshkit-run --survive``), so that a rank its notice wakes names them too.
    """

    kind: str
    sender: int
    group: tuple[int, ...] | None = None
    seq: int = -1
    detail: str = ""
    counts: tuple[tuple[tuple[int, ...], int], ...] = ()
    timed_out: bool = False
    failed: tuple[int, ...] = ()

    def blocks(self, ranks: tuple[int, ...], waiting: int, own_rejections: set[int], *,
               aborts: bool = False) -> bool:
        """True if a member of ``ranks`` stalled in call #``waiting`` waits in vain.

        ``aborts``: the group's engine aborts its communicator when the group breaks (NCCL), so a
        member that timed out in this very call has left it for good.
        """
        if self.sender not in ranks:
            return False
        if self.kind == LEFT:
            return dict(self.counts).get(ranks, 0) <= waiting
        if self.group != ranks:
            return False
        if self.kind == BROKEN:
            if waiting < 0:  # a send or receive (numbered -1): the group is broken, so is its traffic
                return True
            # A rank that timed out in this very call reports what every waiter will see at its
            # own timeout (and they name the missing ranks): only an earlier call counts then,
            # unless the timed-out rank aborted its communicator (NCCL): then the call can never
            # complete, and the waiters fail at once, which tells it they had arrived.
            return self.seq < waiting or (self.seq == waiting and (aborts or not self.timed_out))
        # REJECTED: only the call itself (a quick retry may still complete it); a call this rank
        # rejected as well was a mistake of every rank, not a rank left behind.
        return self.seq == waiting and waiting not in own_rejections

    def reached(self, ranks: tuple[int, ...], seq: int) -> bool:
        """True if this notice shows that its sender had issued call #``seq`` on group ``ranks``:
        it broke in that call or a later one (a rank that was waiting in it when the group broke
        says so), rejected a later call, or left after issuing it."""
        if self.sender not in ranks:
            return False
        if self.kind == LEFT:
            return dict(self.counts).get(ranks, 0) > seq
        if self.group != ranks:
            return False
        return self.seq >= seq if self.kind == BROKEN else self.seq > seq

    def describe(self, group_name: str, *, p2p: bool = False) -> str:
        """The notice in words; ``p2p``: for a waiting send or receive, which has no call number."""
        if self.kind == LEFT:
            return f"rank {self.sender} left the job ({self.detail})"
        if self.kind == REJECTED:
            return f"rank {self.sender} did not start call #{self.seq} on group {group_name}: {self.detail}"
        if p2p:
            return f"rank {self.sender} stopped using group {group_name}, sends and receives included: {self.detail}"
        return f"rank {self.sender} stopped using group {group_name} at call #{self.seq}: {self.detail}"
