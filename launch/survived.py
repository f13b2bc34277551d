"""The report of each failure a ``meshkit-run --survive K`` job survived: the time back to training, by phase.

A restart's report (:mod:`meshkit.launch.restarts`) times a job that started again; under
``--survive`` nobody starts again: the survivors rebuild their world and state in memory
(:func:`meshkit.parallel.survive.shrink`) and redo the step. Each survivor tells the launcher when
it passed each point of its recovery (``survived-{n}.{rank}`` in the status directory, written by
:func:`meshkit.comm.milestones.survived`); the launcher knows when the rank died (its watcher's
record). Once every survivor has completed a step after the failure, it prints one line
(``--survive-report FILE`` also writes them all as JSON, a list, rewritten whole at each)::

    survived failure 1 (rank 3, signal 9; 4 -> 3 ranks, redo from step 7): failure -> next step 0.071 s =
    detection 0.012 + agreement 0.004 + shrink 0.001 + state rebuild 0.035 + redo 0.019

Each phase ends when the last survivor passes its point, as a restart's do:

* detection: the rank's death (its watcher's clock, or the first survivor's ``RankFailedError`` where
  that came first: the watcher learns of it by a wait that may end later) to the last survivor's;
* agreement: to the last survivor out of the revoke and ULFM's Shrink, which agrees on who is dead
  and makes the survivors' communicator;
* shrink: to the last survivor's new world installed (its engine and default group);
* state rebuild: to the last survivor's strategy rebuilt on the new world with the state that
  survived (a replicated copy, or the shards and buddy copies);
* redo: to the last survivor's next optimizer step done (the step the failure interrupted, again).

A failure whose survivors did not all get that far (the job ended, or another failure came first)
is printed when the job ends, with the phases it passed. Imports only the standard library.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ..launch_protocol import SURVIVED
from .bootstrap import read_small, replace_whole

__all__ = ["SurvivedReport", "SurvivedReports", "parse_recovery"]

logger = logging.getLogger("meshkit.launch")

#: ``survived-{n}.{rank}``: a rank's recovery from the n-th survived failure (:mod:`meshkit.launch_protocol`).
_FILE = re.compile(rf"{SURVIVED}-([0-9]{{1,9}})\.([0-9]{{1,9}})")
#: One recovery's line: five times in ns, the step redone, the ranks lost (comma-separated, or -), and
#: the spares that took their places (``--spares``; comma-separated, or -; absent in older records).
_RANKS = r"([0-9]{1,9}(?:,[0-9]{1,9})*|-)"
_LINE = re.compile(r"([0-9]{1,20}) ([0-9]{1,20}) ([0-9]{1,20}) ([0-9]{1,20}) ([0-9]{1,20}) ([0-9]{1,12}) "
                   rf"{_RANKS}(?: {_RANKS})?")
#: The phases, in order: (the report's field, its name in the line).
PHASES = (("detection_s", "detection"), ("agreement_s", "agreement"), ("shrink_s", "shrink"),
          ("state_rebuild_s", "state rebuild"), ("redo_s", "redo"))


@dataclass(frozen=True)
class Recovery:
    """One survivor's recovery from one failure (wall-clock ns; ``redone`` 0 until its next step)."""

    detected: int
    agreed: int
    shrunk: int
    rebuilt: int
    redone: int
    step: int
    lost: tuple[int, ...]
    joined: tuple[int, ...] = ()  # the spares (as launched) that took the lost ranks' places


def parse_recovery(text: str) -> Recovery:
    """A ``survived-{n}.{rank}`` file's line. Raises ValueError if it is not one."""
    match = _LINE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not a recovery record: {text[:80]!r}")
    times = [int(g) for g in match.groups()[:6]]
    lost, joined = (() if g in (None, "-") else tuple(int(r) for r in g.split(",")) for g in match.group(7, 8))
    return Recovery(*times, lost=lost, joined=joined)


@dataclass
class SurvivedReport:
    """One survived failure and the time back to training, by phase (seconds; None where not every
    survivor passed that point)."""

    survived: int  # 1 for the attempt's first survived failure, ...
    ranks: list[int]  # the ranks lost, as launched
    failure: str  # how they ended ("signal 9", "exit 9")
    ranks_before: int
    ranks_after: int
    redo_step: int | None = None
    failed_at_ns: int = 0  # wall clock: the death (the first, where several died together)
    detection_s: float | None = None
    agreement_s: float | None = None
    shrink_s: float | None = None
    state_rebuild_s: float | None = None
    redo_s: float | None = None
    total_s: float | None = None  # the failure to the last point every survivor passed
    complete: bool = False  # every survivor completed a step after it
    survivors: list[int] = field(default_factory=list)  # the ranks (as launched) that reported it
    attempt: int = 0  # under --max-restarts too: the attempt (0 before any restart)
    spares: list[int] = field(default_factory=list)  # under --spares: those (as launched) that took lost ranks' places

    def line(self) -> str:
        lost = ", ".join(map(str, self.ranks))
        of = f" of attempt {self.attempt}" if self.attempt else ""
        head = (f"survived failure {self.survived}{of} (rank{'s' if len(self.ranks) > 1 else ''} {lost}, {self.failure}; "
                f"{self.ranks_before} -> {self.ranks_after} ranks"
                + (f", spare{'s' if len(self.spares) > 1 else ''} {', '.join(map(str, self.spares))} joined"
                   if self.spares else "")
                + ("" if self.redo_step is None else f", redo from step {self.redo_step}") + ")")
        parts = " + ".join(f"{name} {getattr(self, key):.3f}" for key, name in PHASES
                           if getattr(self, key) is not None)
        until = "next step" if self.complete else "last point passed"
        total = "?" if self.total_s is None else f"{self.total_s:.3f}"
        return f"{head}: failure -> {until} {total} s = {parts or 'no phase timed'}"


def _seconds(later: int, earlier: int) -> float:
    return max(0.0, (later - earlier) / 1e9)


class SurvivedReports:
    """The reports of one ``--survive`` job, filled from its attempt's status directory at each poll
    (:meth:`begin` before each attempt: under ``--max-restarts`` the file keeps every attempt's).

    Args:
        path: ``--survive-report FILE`` (None: the lines only).
    """

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.reports: list[SurvivedReport] = []  # every attempt's
        self.begin(0, 0)

    def begin(self, nproc: int, attempt: int) -> None:
        """A new attempt of ``nproc`` ranks starts (its status directory is a new one)."""
        self.nproc, self.attempt = nproc, attempt
        self._mine: list[SurvivedReport] = []  # this attempt's, by failure
        self._seen: dict[tuple[int, int], Recovery] = {}  # (n, rank) -> its latest record
        self._listed: int | None = None  # the status directory's mtime when last listed

    def poll(self, job: Any) -> None:
        """Read what the survivors wrote since the last poll; print and record what is complete."""
        self._read(job.status_dir)
        self._update(job, final=False)

    def finish(self, job: Any) -> None:
        """The job ended: read once more, and print every failure not printed yet, as far as it got."""
        self._listed = None
        self._read(job.status_dir)
        self._update(job, final=True)

    def _read(self, folder: str) -> None:
        try:
            listed = os.stat(folder).st_mtime_ns  # a record is written by a rename: the folder changes
            if listed == self._listed:
                return
            self._listed = listed
            names = os.listdir(folder)
        except OSError:
            return
        for name in names:
            match = _FILE.fullmatch(name)
            if match is None:
                continue
            key = (int(match.group(1)), int(match.group(2)))
            if key in self._seen and self._seen[key].redone:
                continue  # final: written again only for the redo
            try:
                self._seen[key] = parse_recovery(read_small(os.path.join(folder, name)))
            except (OSError, ValueError) as exc:
                logger.debug("ignoring status file %s: %s", name, exc)

    def _update(self, job: Any, final: bool) -> None:
        lost_before = 0
        changed = False
        for n in range(1, 1 + max((k[0] for k in self._seen), default=0)):
            records = {r: rec for (m, r), rec in self._seen.items() if m == n}
            if not records:
                break
            lost = sorted({r for rec in records.values() for r in rec.lost})
            joined = sorted({r for rec in records.values() for r in rec.joined})
            if n > len(self._mine):
                if not final and not all(r in job.survived for r in lost):
                    break  # the launcher has not seen the death yet: its time is the report's start
                deaths = [job.survived[r] for r in lost if r in job.survived]
                self._mine.append(SurvivedReport(
                    n, lost, ", ".join(sorted({d.how for d in deaths})) or "?", self.nproc - lost_before,
                    self.nproc - lost_before - len(lost) + len(joined),
                    failed_at_ns=min((d.time_ns for d in deaths), default=0), attempt=self.attempt, spares=joined))
                self.reports.append(self._mine[-1])
            report = self._mine[n - 1]
            lost_before += len(lost) - len(joined)
            if report.complete:
                continue
            self._fill(report, records)
            if report.complete or final:
                logger.warning("%s%s", report.line(), "" if report.complete else
                               " (not every survivor completed a step after it)")
                changed = True
        if changed:
            self._write()

    @staticmethod
    def _fill(report: SurvivedReport, records: dict[int, Recovery]) -> None:
        report.survivors = sorted(records)
        report.redo_step = max(rec.step for rec in records.values())
        every = len(records) >= report.ranks_after - len(report.spares)  # (a spare that joined has no record)
        # the death: the watcher's record of it, or the first survivor's error where that came first
        # (the watcher learns of it by a wait that may end after the survivors' MPI did)
        first = min(rec.detected for rec in records.values())
        previous = min(report.failed_at_ns, first) if report.failed_at_ns else first
        latest = None
        for key, _ in PHASES:
            setattr(report, key, None)
        for (key, _), point in zip(PHASES, ("detected", "agreed", "shrunk", "rebuilt", "redone")):
            times = [getattr(rec, point) for rec in records.values()]
            if not every or not all(times):
                break  # this phase, and every later one, not passed by every survivor
            setattr(report, key, _seconds(max(times), previous))
            previous = latest = max(times)
        report.failed_at_ns = start = min(report.failed_at_ns, first) if report.failed_at_ns else first
        report.total_s = None if latest is None else _seconds(latest, start)
        report.complete = report.redo_s is not None

    def _write(self) -> None:
        if self.path is None:
            return
        try:  # whole, through an exclusive temporary file (never through a link planted beside it)
            replace_whole(self.path, json.dumps([asdict(r) for r in self.reports], indent=1).encode("utf-8"))
        except OSError as exc:
            logger.warning("cannot write --survive-report %s: %s", self.path, exc)
