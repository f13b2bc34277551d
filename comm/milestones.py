"""Milestones of a (re)start that ``meshkit-run`` times: rendezvous, checkpoint restored, first step.

After a restart the launcher reports how long the job took from the failure to its first
training step again, split into detection, relaunch, rendezvous and checkpoint load.
It learns when each rank passed each point from a file the rank writes into the launcher's
status directory (``milestone-{name}.{rank}``, holding the wall-clock time in ns; the names are
:mod:`meshkit.launch_protocol`'s, which the launcher imports too). Each milestone is written once per process; outside ``meshkit-run``, or
on a host other than the launcher's, :func:`milestone` does nothing.

Who calls it: :func:`~meshkit.comm.init_process_group` as it starts (``imported``: the script's imports
are done) and once the world is made (``rendezvous``), checkpoint loads
(``restored``) and the data-parallel strategies' ``step()`` (``first_step``).

Under ``meshkit-run --survive`` the launcher also times each failure the survivors recover from
in memory (:func:`survived`, called by :func:`meshkit.parallel.survive.shrink`): when this rank
learnt of it, agreed with the others on the dead, had its new world, had its state rebuilt, and
(the next ``first_step`` after it) completed its next step.
"""

from __future__ import annotations

import os
import time

from ..launch_protocol import (FAILED, FIRST_STEP, IMPORTED, LAUNCHER_ENV, RENDEZVOUS, RESTORED, STATUS_DIR_ENV,
                               milestone_file, survived_file)

__all__ = ["milestone", "report_failure", "survived", "spare_joined", "recoveries", "IMPORTED", "RENDEZVOUS", "RESTORED", "FIRST_STEP",
           "STATUS_DIR_ENV",
           "LAUNCHER_ENV"]


_passed: set[str] = set()
#: This process's recoveries (:func:`survived`): each one's fields, its ``redone`` time 0 until the step after it.
_recoveries: list[list[int | str]] = []
#: The rank as launched of each rank of the world of now (None: the world is the launched one).
_launched: list[int] | None = None


def milestone(name: str) -> None:
    """Tell the launcher that this process passed ``name`` now (the first time only; cheap after)."""
    if name == FIRST_STEP and _recoveries and not _recoveries[-1][4]:  # the step after a recovery
        _recoveries[-1][4] = time.time_ns()
        _write_recovery()
    if name in _passed:
        return
    _passed.add(name)
    _write(milestone_file(name), str(time.time_ns()))


def survived(*, failed: tuple[int, ...], old_size: int, detected_ns: int, agreed_ns: int, shrunk_ns: int,
             rebuilt_ns: int, step: int, launched_after: list[int] | None = None, joined: tuple[int, ...] = ()) -> None:
    """Tell the launcher that this rank recovered from a survived failure (``meshkit-run --survive``).

    Args:
        failed: the ranks lost, numbered in the world before (:class:`~meshkit.comm.Shrunk`'s ``failed``).
        old_size: that world's size.
        detected_ns, agreed_ns, shrunk_ns, rebuilt_ns: wall-clock times (ns) on this rank: its
            ``RankFailedError``, the survivors' agreement (revoke and ULFM's Shrink) done, the new
            world installed, the strategy rebuilt with its state.
        step: the step the loop redoes. The next ``first_step`` milestone times the redo.
        launched_after: each new world rank's rank as launched, where spares joined (``--spares``:
            else the survivors' in order); ``joined``: the new world ranks the spares took.
    """
    global _launched
    launched = _launched if _launched is not None and len(_launched) == old_size else list(range(old_size))
    lost = [launched[r] for r in failed]
    _launched = [r for i, r in enumerate(launched) if i not in set(failed)] if launched_after is None else \
        list(launched_after)
    spares = [_launched[r] for r in joined]
    _recoveries.append([int(detected_ns), int(agreed_ns), int(shrunk_ns), int(rebuilt_ns), 0, int(step),
                        ",".join(map(str, lost)) or "-", ",".join(map(str, spares)) or "-"])
    _write_recovery()


def spare_joined(*, survived_before: int, launched: list[int]) -> None:
    """A spare of ``meshkit-run --spares`` that took a failed rank's place: it counts the recoveries the
    survivors count (``survived_before`` before this one, and this one: each rank numbers its next
    record alike, and tells a replayed step as they do) and numbers ranks as they do (``launched``:
    each world rank's rank as launched). No record of this recovery is written: it survived nothing."""
    global _launched
    _recoveries[:] = [[0, 0, 0, 0, 1, 0, "-", "-"] for _ in range(survived_before + 1)]  # (redone: no record)
    _launched = list(launched)


def recoveries() -> int:
    """How many failures this process has survived (:func:`survived` calls): what tells a replayed
    step, done again after a rollback, from a step done twice by mistake."""
    return len(_recoveries)


def _write_recovery() -> None:
    _write(survived_file(len(_recoveries)), " ".join(map(str, _recoveries[-1])))


def report_failure(status: int, how: str) -> None:
    """Tell the launcher that this rank fails now, and how (``failed.{rank}``: status, how, time in
    ns, as the rank bootstrap writes it): ``hung``, for a process its watchdog ends because a call
    into the engine's library never returned (comm/engines/watchdog.py), which the launcher names as the
    cause of the job's failure before the ranks whose own timeouts fired while they waited for it."""
    _write(FAILED, f"{int(status)} {how} {time.time_ns()}")


def _write(name: str, text: str) -> None:
    """``{name}.{rank}`` in the launcher's status directory, written whole (outside ``meshkit-run``,
    or on another host than the launcher's: nothing)."""
    folder = os.environ.get(STATUS_DIR_ENV, "")
    host = os.environ.get(LAUNCHER_ENV, "").rpartition(" ")[0]
    rank = os.environ.get("RANK", "")
    if not folder or host != os.uname().nodename or not rank.isdigit():
        return
    path = os.path.join(folder, f"{name}.{rank}")
    try:
        with open(f"{path}.tmp", "w", encoding="ascii") as f:
            f.write(text)
        os.replace(f"{path}.tmp", path)
    except OSError:  # the launcher is gone, or its folder: nobody to tell
        pass
