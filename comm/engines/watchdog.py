"""A watchdog for engine calls that block without a deadline: past the timeout, the process ends.

Most of a group's waits poll a nonblocking request under the group's timeout. A few calls into
the engine's library have no nonblocking form and cannot be interrupted: MPI's ``Comm.Split``,
``Split_type`` and ``Comm_free``, NCCL's communicator init, ``commSplit`` and destroy. If another
rank is in a different call (a ``barrier()`` where the others create a group), such a call never
returns: no timeout fires, nothing is printed, the job never ends. Each of them runs
inside :func:`watched`: a timer that, once the call has run the group's timeout, reports the call,
the group and this rank's last calls on stderr, tells ``meshkit-run`` that this rank hung (a
failure report in its status directory, so that the launcher names this rank as the cause, not the
rank whose own timeout fired later), and ends the process, as torch's NCCL watchdog does. Ending
it ends the job: ``mpiexec`` kills the other ranks when one exits without finalizing MPI.

Group creation first checks that every rank is making the same call (comm/groups/group.py), so the
watchdog is the last line, for a member that stopped answering between the check and the split.
"""

from __future__ import annotations

import threading
import time
import contextlib
from typing import Any, Iterator

from .. import job_end

__all__ = ["watched"]

@contextlib.contextmanager
def watched(call: str, rank: int, group: str, ranks: Any, limit: float, recorder: Any = None) -> Iterator[None]:
    """Run the body (one blocking call into the engine's library, ``call``, on ``group`` of global
    ``ranks``, on global rank ``rank``) under a watchdog that ends the process if it has not
    returned after ``limit`` seconds (the group's timeout); ``recorder``: the world's flight
    recorder, whose record is printed then. A thread is started per call (more than a collective may
    cost): for the rare calls that create or free a communicator, not for collectives."""
    started = time.monotonic()
    timer = threading.Timer(limit, _expired, (call, rank, group, tuple(ranks), limit, started, recorder))
    timer.daemon = True
    timer.name = f"meshkit-watchdog[{call}]"
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _expired(call: str, rank: int, group: str, ranks: tuple[int, ...], limit: float, started: float,
             recorder: Any) -> None:
    record = "" if recorder is None else "\n" + recorder.format(rank)
    reason = (f"meshkit.comm: rank {rank}: {call} on group {group} (ranks {list(ranks)}) has not returned after "
              f"{time.monotonic() - started:.1f} s (the group's timeout is {limit:.1f} s: MESHKIT_TIMEOUT or "
              f"init_process_group(timeout=)); the call cannot be interrupted, so the watchdog ends this process, as "
              f"torch's NCCL watchdog does. The other ranks of the group are probably in another call (each rank's "
              f"flight record shows its last calls).{record}")
    job_end.end_hung(reason)
