"""The progress agent: keeps engines' outstanding requests moving while nobody waits on them,
and watches device work until it completes.

MPI moves the data of a nonblocking collective only inside MPI calls (MPICH has no progress
thread by default). A caller that posts an ``async_op=True`` all-reduce and then computes
would find it untouched when it finally waits, so one daemon thread per world tests the
outstanding requests of engines that need it, and completes those that did. It never
tests a request a caller is waiting on (that caller polls it itself), and between rounds it
sleeps rather than yields: on a machine with a core per rank, a yielding poller would take
half of the core from the rank's own computation.

Every work is touched with its group's GPU current (``RequestWork.use_device``, the engine's):
the agent is a thread of its own, and CUDA starts every thread on device 0 (an event, a copy or a
kernel of a rank on GPU k made there would land on GPU 0).

It is also the watchdog of device work (NCCL), as torch's ProcessGroupNCCL watchdog thread:
``Work.wait()`` of a device collective returns once the caller's stream is ordered after it,
so nothing else would see it fail or never complete. Every :data:`WATCHDOG_INTERVAL` the agent
runs :meth:`RequestWork.watchdog` on each such work until its done event fired.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from .work import RequestWork

__all__ = ["ProgressAgent", "WATCHDOG_INTERVAL"]

logger = logging.getLogger("meshkit")

#: Seconds a request must have been outstanding before the agent tests it. Most async
#: requests are waited for within microseconds (two all_reduces then two waits): the caller
#: finishes them, and the agent stays asleep instead of taking a core from the peer ranks
#: (waking it for every request made two async 4 KB all-reduces 2-4x slower at 2 ranks).
_GRACE = 0.001
#: Seconds between rounds of tests while requests are outstanding: a rendezvous transfer needs
#: a test per protocol step, and each round costs a thread wake-up.
_ROUND_NAP = 0.0002


#: Seconds an idle agent sleeps between looks for requests. It is never woken: waking it on a
#: post cost the poster more than a small collective (the agent takes the interpreter lock as
#: MPI's call releases it), and it acts only on requests older than _GRACE anyway.
_IDLE_NAP = 0.005
#: Seconds between watchdog rounds over device work: torch's NCCL watchdog looks every 100 ms;
#: a rank whose device work waits in a call another member abandoned must answer that member's
#: notice well within its listening time (failures._ARRIVAL_GRACE, 0.5 s), so 10x more often. A
#: round costs an event query, an NCCL error check and a look for notices per work.
WATCHDOG_INTERVAL = 0.01


class ProgressAgent:
    """Tests tracked :class:`RequestWork` objects in the background until each completes.

    MPI's progress engine is global: testing one request moves every outstanding one. So the
    agent tests only the oldest unfinished work (in posting order), which keeps its cost
    constant however many works are outstanding; the others are completed by their waiters.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._works: collections.deque[RequestWork] = collections.deque()  # append/popleft need no lock
        self._watched: collections.deque[RequestWork] = collections.deque()  # device work (watchdog)
        self._next_watch = 0.0
        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._closed = False
        #: threads now waiting on a request of this world: each such wait drives MPI's progress
        #: engine, which moves every outstanding request, so the agent stands back meanwhile
        #: (two threads testing at once contend for MPI's lock: 1 MB async pairs took 1.25x)
        self.waiting: set[int] = set()

    def track(self, work: RequestWork) -> None:
        """Keep ``work`` moving until it completes (or the agent closes); the agent is not woken."""
        self._works.append(work)
        self._start()

    def watchdog(self, work: RequestWork) -> None:
        """Watch device ``work`` until it completes or fails (see :meth:`RequestWork.watchdog`)."""
        self._watched.append(work)
        self._start()

    def _start(self) -> None:
        if self._thread is None:
            with self._cond:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                    self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _loop(self) -> None:
        works = self._works
        nap, last = _GRACE, None
        while not self._closed:
            if self._watched and time.monotonic() >= self._next_watch:
                self._watch()
            while works and works[0].finished:
                works.popleft()
            if not works:
                with self._cond:
                    if not self._closed:
                        self._cond.wait(_IDLE_NAP)
                last = None
                continue
            oldest = works[0]
            wait = oldest.posted + _GRACE - time.monotonic()
            if wait > 0:  # fresh: its caller may well finish it
                # A caller that keeps finishing its works itself (the oldest is another one than
                # at the last look) is left alone for longer, up to _IDLE_NAP: every wake-up
                # takes the interpreter lock from it (two async 64-byte all-reduces cost 1.2-1.5x
                # with a look every millisecond).
                nap = min(2 * nap, _IDLE_NAP) if last is not None and oldest is not last else _GRACE
                last = oldest
                time.sleep(max(wait, nap))
                continue
            nap, last = _GRACE, oldest
            if not self.waiting:
                oldest.use_device()  # its epilogue may copy device arrays (all_gather's list)
                oldest.poll(block=False)
            time.sleep(_ROUND_NAP)

    def _watch(self) -> None:
        """One watchdog round: every watched work is looked at once; those done are dropped."""
        watched = self._watched
        for _ in range(len(watched)):  # others may append meanwhile: they wait for the next round
            work = watched.popleft()
            try:
                work.use_device()
                finished = work.watchdog()
            except Exception:  # the watchdog must outlive anything one work does
                logger.exception("meshkit: the watchdog failed on %r", work)
                finished = True
            if not finished:
                watched.append(work)
        self._next_watch = time.monotonic() + WATCHDOG_INTERVAL
