"""How the MPI engine waits: poll ``Test``, spin, then yield the core, then nap.

MPI's nonblocking operations progress only inside MPI calls, so a wait is a loop of ``Test``
with a deadline (how a blocking call honours the group's timeout). What the loop does between
polls is a policy of its own, measured rather than guessed (the constants below say where): a
blocked caller spins up to 2 ms when every rank of the host has a core of its own (as MPI's
blocking calls do), but only a few polls when ranks outnumber cores (on 2 cores with 4 ranks a
pure spin loop made an 8-byte all_reduce 200x slower than MPI's blocking call,
spin-then-``sched_yield`` matches it); a communication thread working beside the caller's
computation never spins; a wait over a second naps, so that a rank waiting for a busy peer does
not keep a core busy. Needs no MPI: a request is anything with ``Test()``.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from ..notices import WATCH_INTERVAL
from .engine import in_background

__all__ = ["Poller", "completes", "choose_caller_spin", "CALLER_SPIN_SECONDS"]

#: Polls per ``sched_yield`` (the first after as many). Few: with more ranks than cores, the
#: peer this rank waits for may need this very core; but not one: every yield is a context
#: switch, and MPI progresses only inside ``Test``. Measured with raw ``Iallreduce`` polls at 4
#: ranks on 2 cores against blocking ``Allreduce``: yielding at every 4th poll was the fastest of
#: every poll, every 4th and every 64th at 4 KB, 64 KB and 256 KB alike (and 64 polls before the
#: first yield made small all_reduces markedly slower than raw mpi4py; benchmarks/collectives.py
#: measures it).
_POLLS_PER_YIELD = 4
_BATCH = range(_POLLS_PER_YIELD)
#: Seconds a blocked caller keeps polling without yielding when every rank of this host has a
#: core of its own (set by :func:`choose_caller_spin`; 0 when the host is oversubscribed).
#: Yielding between polls costs a system call per poll and slows MPI's progress, which only
#: happens inside ``Test``: a 64 KB all_reduce polled with ``sched_yield`` was slower than one
#: spinning, and than a blocking ``Allreduce`` (benchmarks/collectives.py). A communication
#: thread spins only while a caller waits for it; otherwise it runs beside the caller's
#: computation (see ``engine.in_background``). Short, though: a core of its own per rank is
#: not a core to itself when other processes run, and where the scheduler puts both ranks on one
#: core (the waker's), a rank that spins keeps the peer it waits for off that core for the whole
#: spin. With 2 ms, 3 of 8 runs of benchmarks/collectives.py at 2 ranks on the loaded 2-core
#: machine (load 3.5-4.5; --stat min, 5 rounds) timed every meshkit call at 1.8-4.2 ms, 4 KB to
#: 1 MB alike, MPI path included, against MPICH's 33-460 us; with 50 us the worst of 6 runs was
#: 111-152 us at 4-64 KB, and the undisturbed runs were as fast as with 2 ms (64 KB over MPI 36-71
#: us against 41-97; docs/collectives.md). A 64 KB all_reduce (30-35 us quiet) still ends within it.
CALLER_SPIN_SECONDS = 0.00005
_caller_spin = 0.0
#: Seconds of yielding before napping. MPI's nonblocking collectives progress only inside
#: ``Test``, so a poller that naps throttles any transfer still running: with naps after 20 ms,
#: a 64 MB all_to_all at 4 ranks took several times as long (benchmarks/collectives.py).
#: Yielding still gives the core to other processes; only a wait longer than this (a peer
#: computing elsewhere, or hung) naps, so that it does not keep a core busy for minutes.
_YIELD_SECONDS = 1.0
#: Nap length once a wait is long.
_NAP_SECONDS = 0.0002


def choose_caller_spin(ranks_on_host: int) -> None:
    """Let blocked callers spin (:data:`CALLER_SPIN_SECONDS`) only when each of the
    ``ranks_on_host`` ranks of this host has a core of its own; called once per world."""
    global _caller_spin
    _caller_spin = CALLER_SPIN_SECONDS if ranks_on_host <= len(os.sched_getaffinity(0)) else 0.0


class Poller:
    """Spin, then yield, then nap: the waiting policy of every MPI wait.

    ``spin``: seconds to keep spinning (no yield between batches) after the first batch, while
    nobody computes beside this wait (see ``engine.in_background``). ``watch``: called every
    :data:`~meshkit.comm.notices.WATCH_INTERVAL` once the wait has lasted that long (it reads
    notices and raises if the wait is in vain).
    """

    __slots__ = ("since", "deadline", "spin", "watch", "watched")

    def __init__(self, deadline: float, spin: float = 0.0, watch: Callable[[], None] | None = None) -> None:
        self.since, self.deadline, self.spin, self.watch, self.watched = 0.0, deadline, spin, watch, 0.0

    def pause(self) -> bool:
        """Between two batches of polls: maybe yield or nap; False once the deadline has passed."""
        now = time.monotonic()
        if now > self.deadline:
            return False
        if not self.since:
            self.since = self.watched = now
        elif self.watch is not None and now - self.watched > WATCH_INTERVAL:
            self.watched = now
            self.watch()
        waited = now - self.since
        if waited < self.spin and not in_background():
            return True
        if waited < _YIELD_SECONDS:
            os.sched_yield()
        else:
            time.sleep(_NAP_SECONDS)
        return True


def completes(request: Any, deadline: float, watch: Callable[[], None] | None = None) -> bool:
    """Poll ``request`` until it completes (True) or the deadline passes (False)."""
    poller = Poller(deadline, _caller_spin, watch)
    test = request.Test
    while True:
        for _ in _BATCH:  # a tight batch: MPI progresses only inside Test, so react fast
            if test():
                return True
        if not poller.pause():
            return False
