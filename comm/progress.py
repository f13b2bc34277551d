"""The progress agent: keeps engines' outstanding requests moving while nobody waits on them.

MPI moves the data of a nonblocking collective only inside MPI calls (MPICH has no progress
thread by default). A caller that posts an ``async_op=True`` all-reduce and then computes
would find it untouched when it finally waits, so one daemon thread per world tests the
outstanding requests of engines that need it, and settles those that completed. It never
tests a request a caller is waiting on (that caller polls it itself), and between rounds it
sleeps rather than yields: on a machine with a core per rank, a yielding poller would take
half of the core from the rank's own computation.
"""

from __future__ import annotations

import threading
import time

from .work import RequestWork

__all__ = ["ProgressAgent"]

#: Seconds between rounds of tests. Each round costs a few microseconds per request; 100 us
#: keeps a rendezvous transfer moving (it needs a test per protocol step) at ~2% of a core.
_ROUND_NAP = 100e-6


class ProgressAgent:
    """Tests tracked :class:`RequestWork` objects in the background until each completes."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._works: list[RequestWork] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._idle = False
        self._closed = False

    def track(self, work: RequestWork) -> None:
        """Keep ``work`` moving until it completes (or the agent closes)."""
        with self._cond:
            self._works.append(work)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            elif self._idle:
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._works = [w for w in self._works if not w._done.is_set()]
                while not self._works and not self._closed:
                    self._idle = True
                    self._cond.wait()
                    self._idle = False
                if self._closed:
                    return
                works = list(self._works)
            for work in works:
                work.poll(block=False)
            time.sleep(_ROUND_NAP)
