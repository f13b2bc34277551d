"""Attempts of a ``meshkit-run`` job: restart the whole job when a rank fails.

``meshkit-run --max-restarts K`` runs the job; when a rank fails (a non-zero exit, an uncaught
exception, a signal, a rank that vanishes) the launcher ends the job as it always does
(:mod:`meshkit.launch.job`), reports the failure with the rank, how it ended and its last lines
of output, waits (see below) and starts the job again, up to K times
(torchrun's ``--max-restarts``). The job is not restarted when it succeeded, when the user
stopped it (Ctrl-C, SIGTERM: 128 + N) or at ``--timeout`` (which bounds all attempts together).
One attempt at a time: every rank process of an attempt is gone before the next starts, and so
is the shared memory MPICH left for it (:mod:`meshkit.launch.job`).

The wait before a restart: ``--restart-delay S`` waits S seconds before every restart. Without
it the launcher backs off: no wait before the first restart (a job that failed once comes back at
once), but while attempts keep failing within :data:`BACKOFF_RESET_S` of their start, it waits
:data:`BACKOFF_BASE_S`, then twice that, and so on up to :data:`BACKOFF_CAP_S` (a job that fails
at once on every attempt, a restart storm, then costs a restart every 30 s rather than every
2-3 s, each starting Python, NumPy and MPI on every rank).

Each attempt starts as many ranks as the slots allow within ``-n MIN:MAX``
(:mod:`meshkit.launch.slots`), so a restart after a host lost slots comes back smaller; with
fewer than MIN slots the job stops, saying so. The ranks read ``MESHKIT_RESTART_COUNT`` (0 on
the first attempt, as torchrun's ``TORCHELASTIC_RESTART_COUNT``), ``MESHKIT_MAX_RESTARTS``,
``MESHKIT_MIN_NPROC`` and ``MESHKIT_MAX_NPROC`` (:mod:`meshkit.elastic` reads them).

After a restart the launcher times the way back, from the failure to the first training step,
from the ranks' milestones (:mod:`meshkit.comm.milestones`) and its own clock, and prints one
line (``--restart-report FILE`` also writes them as JSON)::

    restart 1: failure -> first step 2.41 s = detection 0.04 + teardown 1.02 + delay 0.00 +
    relaunch 0.61 + imports 1.90 + rendezvous 0.41 + checkpoint load 0.15 + first step 0.18

* detection: the rank's death (its watcher's clock) to the launcher noticing it (one poll,
  :data:`~meshkit.launch.job.POLL_S`, not a collective's timeout);
* teardown: noticing it to every process of the job gone (the launcher waits
  :data:`~meshkit.launch.job.FAILURE_SETTLE_S` for other ranks' errors, then kills the rest);
* delay: the wait before the restart (``--restart-delay``, or the backoff);
* relaunch: ``mpiexec`` started to the last rank's bootstrap running;
* imports: to the last rank done importing meshkit (NumPy with it: about 2 s on a loaded 2-core machine);
* rendezvous: to the last rank out of ``init_process_group``;
* checkpoint load: to the last rank done loading its checkpoint;
* first step: to the last rank done with its first optimizer step.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from .. import launch_protocol as PROTOCOL
from .bootstrap import replace_whole, write_exclusive
from .job import Job, JobFailure, TIMEOUT_EXIT_CODE
from .slots import Hosts, NprocRange, available

__all__ = ["ElasticSpec", "RestartReport", "run_attempts", "RESTART_ENV", "restart_delay", "BACKOFF_BASE_S",
           "BACKOFF_CAP_S", "BACKOFF_RESET_S"]

logger = logging.getLogger("meshkit.launch")

#: What every rank of an attempt is told (read by :mod:`meshkit.elastic`).
RESTART_ENV = PROTOCOL.RESTART_ENV
#: The milestones of a restart, in order, with the name of the phase that ends at each.
_PHASES = ((PROTOCOL.IMPORTED, "imports"), (PROTOCOL.RENDEZVOUS, "rendezvous"), (PROTOCOL.RESTORED, "checkpoint load"),
           (PROTOCOL.FIRST_STEP, "first step"))

#: The backoff's first wait (the second restart in a row): a few times what an attempt
#: takes to start its ranks, so a storm of attempts that fail at once halves its rate at once.
BACKOFF_BASE_S = 1.0
#: The longest wait of the backoff (as systemd's and Kubernetes' restart backoffs, capped).
BACKOFF_CAP_S = 30.0
#: An attempt that ran this long before it failed ends the streak: the next restart is at once.
#: Twice the cap: a job whose attempts each run a minute spends at most a third of its time waiting.
BACKOFF_RESET_S = 60.0


def restart_delay(fixed: float | None, streak: int) -> float:
    """Seconds to wait before a restart: ``fixed`` (``--restart-delay``) if given, else the backoff
    after ``streak`` failed attempts in a row, each shorter than :data:`BACKOFF_RESET_S`: 0 after
    one, then :data:`BACKOFF_BASE_S`, twice that, ... at most :data:`BACKOFF_CAP_S`."""
    if fixed is not None:
        return fixed
    if streak <= 1:
        return 0.0
    return min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2.0 ** min(streak - 2, 64))


def next_streak(streak: int, ran_s: float) -> int:
    """The streak of quick failures after an attempt that failed ``ran_s`` seconds after its start."""
    return streak + 1 if ran_s < BACKOFF_RESET_S else 1


@dataclass(frozen=True)
class ElasticSpec:
    """How a job restarts: ``-n MIN:MAX``, ``--max-restarts``, ``--restart-delay``, the slots."""

    nproc: NprocRange
    max_restarts: int = 0
    restart_delay: float | None = None  # None: back off (restart_delay())
    slots: int | None = None
    hostfile: str | None = None
    timeout: float | None = None
    report_path: str | None = None


@dataclass
class RestartReport:
    """One restart: the failure before it and the time back to training, by phase (seconds;
    None where the job did not pass that point, e.g. no checkpoint was loaded)."""

    restart: int
    rank: int | None
    failure: str
    status: int
    ranks_before: int
    ranks_after: int
    tail: list[str] = field(default_factory=list)
    failed_at_ns: int = 0  # wall clock: when the rank failed (the launcher's first sight of a vanished one)
    detected_at_ns: int = 0  # wall clock: when the launcher noticed
    detection_s: float | None = None
    teardown_s: float | None = None
    delay_s: float | None = None
    relaunch_s: float | None = None
    imports_s: float | None = None
    rendezvous_s: float | None = None
    checkpoint_load_s: float | None = None
    first_step_s: float | None = None
    total_s: float | None = None  # the failure to the last milestone passed
    complete: bool = False  # every rank passed first_step

    def line(self) -> str:
        phases = [("detection", self.detection_s), ("teardown", self.teardown_s), ("delay", self.delay_s),
                  ("relaunch", self.relaunch_s), ("imports", self.imports_s), ("rendezvous", self.rendezvous_s),
                  ("checkpoint load", self.checkpoint_load_s), ("first step", self.first_step_s)]
        parts = " + ".join(f"{name} {value:.2f}" for name, value in phases if value is not None)
        until = "first step" if self.complete else "last milestone passed"
        total = "?" if self.total_s is None else f"{self.total_s:.2f}"
        return f"restart {self.restart}: failure -> {until} {total} s = {parts}"


def _seconds(later: int | None, earlier: int | None) -> float | None:
    return None if later is None or earlier is None else max(0.0, (later - earlier) / 1e9)


def _fill(report: RestartReport, failure: JobFailure, failed_job_ended_ns: int, job: Job, delay_s: float) -> None:
    """The phases of ``report`` from the failed attempt's times and ``job``'s (the next attempt's)."""
    report.detection_s = _seconds(failure.detected_ns, failure.failed_ns)
    report.teardown_s = _seconds(failed_job_ended_ns, failure.detected_ns)
    report.delay_s = delay_s
    started = [r.started_ns for r in job.ranks.values() if r.started_ns is not None]
    last = max(started) if len(started) >= job.nproc else None
    report.relaunch_s = _seconds(last, job.popen_ns)
    previous, latest = last, last
    for name, _ in _PHASES:
        times = [r.milestones[name] for r in job.ranks.values() if name in r.milestones]
        passed = max(times) if len(times) >= job.nproc else None
        value = _seconds(passed, previous) if passed is not None else None
        setattr(report, {PROTOCOL.IMPORTED: "imports_s", PROTOCOL.RENDEZVOUS: "rendezvous_s",
                         PROTOCOL.RESTORED: "checkpoint_load_s", PROTOCOL.FIRST_STEP: "first_step_s"}[name], value)
        if passed is not None:
            previous = latest = passed
    report.total_s = _seconds(latest, failure.failed_ns)
    report.complete = report.first_step_s is not None


class _Attempts:
    """The loop of :func:`run_attempts`."""

    def __init__(self, spec: ElasticSpec, start: Callable[..., Job]) -> None:
        self.spec = spec
        self.start = start
        self.reports: list[RestartReport] = []

    def _nproc(self, restart: int) -> tuple[int, str, Hosts | None] | None:
        """The ranks of the next attempt, or None (logged): fewer slots than MIN."""
        spec = self.spec
        try:
            slots, source, hosts = available(spec.nproc, slots=spec.slots, hostfile=spec.hostfile)
        except ValueError as exc:
            logger.error("restart %d: %s; not restarting", restart, exc)
            return None
        if slots < spec.nproc.min:
            logger.error("restart %d: %s gives %d slot%s, fewer than -n %s needs (at least %d); not restarting",
                         restart, source, slots, "" if slots == 1 else "s", spec.nproc, spec.nproc.min)
            return None
        return min(spec.nproc.max, slots), source, hosts

    def _write_reports(self) -> None:
        if self.spec.report_path is None:
            return
        try:  # whole, through an exclusive temporary file (never through a link planted beside it)
            replace_whole(self.spec.report_path,
                          json.dumps([asdict(r) for r in self.reports], indent=1).encode("utf-8"))
        except OSError as exc:
            logger.warning("cannot write --restart-report %s: %s", self.spec.report_path, exc)

    def run(self) -> int:
        spec = self.spec
        deadline = None if spec.timeout is None else time.monotonic() + spec.timeout
        restart, before = 0, None  # before: (failure, ended_ns, ranks) of the attempt that failed
        streak, delay = 0, 0.0  # failed attempts in a row, each quick (see restart_delay); the wait before this one
        while True:
            chosen = self._nproc(restart)
            if chosen is None:
                return before[0].status if before is not None else 1
            nproc, source, hosts = chosen
            report = None
            if before is not None:
                failure, ended_ns, ranks_before = before
                report = RestartReport(restart, failure.rank, failure.description, failure.status, ranks_before,
                                       nproc, list(failure.tail), failure.failed_ns, failure.detected_ns)
                self.reports.append(report)
                logger.warning("restart %d of %d: %d rank%s (%s)", restart, spec.max_restarts, nproc,
                               "" if nproc == 1 else "s", source)
            left = None if deadline is None else spec.timeout if not restart else deadline - time.monotonic()
            if left is not None and left <= 0:
                logger.error("job exceeded --timeout %g s (all attempts together) before restart %d", spec.timeout,
                             restart)
                return TIMEOUT_EXIT_CODE
            on_poll = None
            if report is not None:
                failure, ended_ns, _ = before

                def on_poll(job: Job, report: RestartReport = report, failure: JobFailure = failure,
                            ended_ns: int = ended_ns, delay: float = delay) -> None:
                    if report.complete:
                        return
                    _fill(report, failure, ended_ns, job, delay)
                    if report.complete:
                        logger.warning("%s", report.line())
                        self._write_reports()
            job = self.start(nproc, restart, hosts, left, on_poll)
            code = job.exit_code
            if report is not None and not report.complete:
                _fill(report, failure, before[1], job, delay)
                logger.warning("%s (not every rank reached its first step)", report.line())
                self._write_reports()
            failure = job.failure()
            if code == 0 or failure is None:
                return code
            if spec.max_restarts or failure.rank is None:  # job.py names a rank's failure already
                _log_failure(restart, failure)
            if restart >= spec.max_restarts:
                if spec.max_restarts:
                    logger.error("giving up after %d restart%s: the last attempt failed as above", spec.max_restarts,
                                 "" if spec.max_restarts == 1 else "s")
                return code
            before = (failure, job.ended_ns or time.time_ns(), nproc)
            restart += 1
            streak = next_streak(streak, _seconds(job.ended_ns, job.popen_ns) or 0.0)
            delay = restart_delay(spec.restart_delay, streak)
            if deadline is not None:
                delay = max(0.0, min(delay, deadline - time.monotonic()))
            if delay:
                why = ("--restart-delay" if spec.restart_delay is not None else
                       f"backing off: {streak} attempts in a row failed within {BACKOFF_RESET_S:g} s of their start")
                logger.warning("restart %d in %.3g s (%s)", restart, delay, why)
                time.sleep(delay)


def _log_failure(restart: int, failure: JobFailure) -> None:
    if failure.rank is None:
        logger.error("attempt %d failed: %s", restart, failure.description)
        return
    tail = "".join(f"\n    {line}" for line in failure.tail)
    logger.error("attempt %d failed: rank %d %s%s", restart, failure.rank, failure.description,
                 f"; its last lines:{tail}" if tail else " (it printed nothing)")


def run_attempts(spec: ElasticSpec, start: Callable[[int, int, Hosts | None, float | None, Any], Job]) -> int:
    """Run the job until it succeeds, is stopped, or has failed ``spec.max_restarts + 1`` times;
    the exit code of the last attempt (see :mod:`meshkit.launch.job`).

    Args:
        spec: the restart settings.
        start: ``start(nproc, restart, hosts, timeout, on_poll) -> Job`` runs one attempt to its
            end (the returned Job has ``exit_code`` set).
    """
    try:
        return _Attempts(spec, start).run()
    except KeyboardInterrupt:  # Ctrl-C between attempts (during the wait before a restart)
        logger.error("interrupted between attempts; not restarting")
        return 128 + signal.SIGINT


def attempt_environment(spec: ElasticSpec, restart: int) -> dict[str, str]:
    """The variables of :data:`RESTART_ENV` for attempt ``restart``."""
    return dict(zip(RESTART_ENV, map(str, (restart, spec.max_restarts, spec.nproc.min, spec.nproc.max))))


def hostfile_arguments(hosts: Hosts | None, status_dir: str) -> list[str]:
    """``["-f", file]`` for ``mpiexec`` when ``hosts`` names other hosts (written into
    ``status_dir`` with this attempt's counts), else []."""
    if hosts is None or not hosts.remote():
        return []
    path = os.path.join(status_dir, "hosts")
    write_exclusive(path, hosts.hydra_lines().encode("utf-8"))
    return ["-f", path]
