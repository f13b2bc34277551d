"""One ``meshkit-run`` job: ``mpiexec`` as a child, what the ranks report, and how the job ends.

The ranks on this host report through the status directory (see :mod:`meshkit.launch.bootstrap`):
when each started, when one failed (an uncaught exception, a non-zero ``sys.exit``, Ctrl-C) and,
from each rank's watcher, how its process ended (exit status or signal). Watchers keep their
place in the job until the launcher writes ``release``, so ``mpiexec`` never ends the job on
its own while a rank on this host is still printing.

Why: hydra (MPICH's mpiexec) SIGKILLs every rank as soon as one exits with a non-zero status, or
with 0 but without MPI_Finalize. So ranks failing a moment after the first lost their
tracebacks, a rank between its last barrier and its own ``os._exit(0)`` was killed (and hydra
then reported exit 9 or 0 at random), and which rank had died, and how, was not known. The rules:

* **A rank fails** (it reports a failure, or its process ends with a non-zero status or a
  signal without reporting one): the job ends :data:`FAILURE_SETTLE_S` later, or as soon as every
  rank has ended. So every rank that fails at about the same time prints its whole traceback.
  Ending means: kill (SIGKILL) the ranks still running, then release the watchers; ``mpiexec``
  then ends the ranks on other hosts.
* **Every rank on this host ended** (cleanly or not): release at once.
* **A rank left without finishing its script** (``os._exit(0)``: no MPI_Finalize, which MPI
  counts as an abnormal exit) while others still run :data:`SHUTDOWN_GRACE_S` later: a failure
  (status 1), since the others may be waiting for it. **Ranks stuck in MPI_Finalize** once every
  rank's script is over (waiting for such a rank) are ended after the same grace, as a success.
* **A signal** (SIGINT, SIGTERM, SIGHUP) is passed to ``mpiexec``, which passes it to every rank;
  the job ends once every rank has ended, :data:`FAILURE_SETTLE_S` after the first rank reported
  it, or :data:`KILL_GRACE_S` after the signal. A second signal ends the job at once.
* **--timeout**: as SIGINT, with each rank printing where it was.
* Still running :data:`KILL_GRACE_S` after the release of a job being ended (a process manager
  that does not end the job when its ranks exit), or at a second signal, ``mpiexec`` is killed.
* **The launcher dies** (SIGKILL included): the watchers here end their ranks at once
  (:mod:`meshkit.launch.bootstrap`), and ``mpiexec``, started through :mod:`meshkit.launch.deathsig`,
  gets SIGTERM, which it passes to the ranks on other hosts.

**What a dead attempt leaves**: MPICH's shared-memory files in ``/dev/shm`` (2-4 MB each; MPI_Finalize
removes them, a rank that dies does not). While the attempt runs the launcher records the files
its ranks hold open (:func:`meshkit.launch.bootstrap.shm_files`: those and no other job's) and
removes them once every rank here is gone, before a restart and at the end of the job; the
record is kept in the status directory too, for the watchers to remove them if the launcher
itself dies (:mod:`meshkit.launch.bootstrap`).

The launcher's exit code: 124 after ``--timeout``; 128 + N after signal N (130 for Ctrl-C);
else the status of the first rank to fail, by the time it failed (128 + N for a rank killed by
signal N); else 0 when every rank of the job ran on this host and exited 0; else ``mpiexec``'s.

A rank that ended without a traceback (``os._exit(3)``, a signal, a non-zero ``sys.exit``) is
named on stderr: ``meshkit-run: rank 2 exited with status 3``, ``meshkit-run: rank 1 was
killed by signal 9 (SIGKILL)``; on a job whose ranks all run on this host, so is a rank whose
process died before its bootstrap reported a start (``rank 1 died before it started``).
"""

from __future__ import annotations

import logging
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from typing import Callable

from . import deathsig
from ..launch_protocol import milestone_file
from .bootstrap import (ENDED, FAILED, FINISHED, MILESTONE, RELEASE, SHM_RECORD, START, TIMED_OUT,
                        format_shm_record, read_small, remove_shm, replace_whole, shm_files, write_exclusive)
from .output import OutputFilter, RankTails, start_pump

__all__ = ["Job", "JobFailure", "LaunchError", "LaunchConfigError", "FAILURE_SETTLE_S", "KILL_GRACE_S",
           "TIMEOUT_EXIT_CODE", "VANISHED_GRACE_S", "SHM_RESCAN_S"]

logger = logging.getLogger("meshkit.launch")

#: How long the job goes on after the first rank failed, so that ranks failing at about the same
#: time print their errors too, before the ranks still running are killed. 4 ranks raising right
#: after a barrier report close together even on a loaded 2-core machine; 1 s leaves
#: room for ranks that fail a little later on their own, and a rank still running then is taken
#: to be waiting for the failed ones.
FAILURE_SETTLE_S = 1.0

#: How long ranks may take to stop after a forwarded signal or ``--timeout`` before they are
#: killed, and ``mpiexec`` after the release: time for a script that catches KeyboardInterrupt
#: to save its state.
KILL_GRACE_S = 5.0

#: Exit status after --timeout, as coreutils' `timeout`.
TIMEOUT_EXIT_CODE = 124

#: How often the launcher reads the status directory and looks at the ranks' processes: a rank
#: that dies is noticed within this (its watcher reports it, or its process is seen gone).
POLL_S = 0.05
_POLL_S = POLL_S
_STATUS_FILE = re.compile(rf"({START}|{FAILED}|{ENDED}|{FINISHED}|{milestone_file('[a-z_]+')})\.(\d+)")
#: A number in a status file: ASCII digits (``int()`` alone would take "1_0" or other scripts' digits).
_INT = re.compile(r"-?[0-9]{1,20}")
#: How a rank reports its failure (``failed.{r}``'s second field): ``timeout`` is an uncaught
#: collective timeout (followed by the ranks it named as not arrived, where known), ``hung`` a rank
#: whose watchdog ended it in a call that never returned (meshkit.comm.watchdog), ``peer_failed``
#: an uncaught RankFailedError (followed by the dead ranks it named).
_HOWS = frozenset({"exception", "exit", "interrupt", "timeout", "hung", "peer_failed"})

#: How often the launcher looks again at the shared-memory files of a rank that holds some
#: (a rank that holds none yet, before its MPI_Init, is looked at every poll): MPICH makes its
#: files in MPI_Init and keeps them, so later looks only catch rare late ones. A look reads
#: ``/proc/PID/fd`` (a few dozen links for a rank with meshkit, NumPy and MPI started): cheap
#: enough at every poll before MPI_Init, and once a second costs next to nothing after.
SHM_RESCAN_S = 1.0

#: A rank's process gone with no word from its watcher this long after: the watcher died with it
#: (both killed, e.g. by a process group kill), so nobody will report how it ended.
VANISHED_GRACE_S = 0.2

#: How long ranks whose script is over may stay in interpreter shutdown once every rank's script
#: is over. MPI_Finalize waits for every rank, so a rank that left without it (``os._exit``,
#: after a caught error) leaves the others there for good; a clean shutdown takes milliseconds.
SHUTDOWN_GRACE_S = 3.0


class LaunchError(RuntimeError):
    """The launcher cannot start the job (no mpiexec, or it failed to start)."""


class LaunchConfigError(LaunchError, ValueError):
    """A launcher setting (an environment variable it reads) is not valid; the message names it."""


@dataclass
class _Rank:
    """What the status directory says about one rank on this host."""

    pid: int | None = None
    pidfd: int | None = None  # held from the start: the pid cannot be reused under us
    failed: tuple[int, str, int] | None = None  # (status, how, time_ns) as the rank reported it
    ended: tuple[int, int] | None = None  # (exit code, negative for a signal; time_ns) from its watcher
    finished: bool = False  # its script is over; it is shutting down
    named: bool = False  # its end was reported to the user
    started_ns: int | None = None  # when its bootstrap started (wall clock)
    watcher: int | None = None  # its watcher's pid (the process mpiexec started)
    gone_ns: int | None = None  # when the launcher first saw its process gone (pidfd), ended or not
    next_shm_scan: float = 0.0  # monotonic: when to look at the shared memory it holds again
    vanished: bool = False  # gone, and its watcher never said how: died with it
    milestones: dict[str, int] = field(default_factory=dict)  # name -> time_ns (meshkit.comm.milestones)
    waited_for: tuple[int, ...] = ()  # a timeout's report: the ranks it named as not arrived (empty: unknown)
    blamed: tuple[int, ...] = ()  # a RankFailedError's report: the dead ranks it named


@dataclass(frozen=True, order=True)
class _Failure:
    time_ns: int
    rank: int
    status: int  # the exit status it stands for (128 + N for signal N)
    how: str = ""  # "exit 3", "signal 9"


@dataclass(frozen=True)
class JobFailure:
    """The failure that ended a job, for a restart's report.

    Attributes:
        rank: the first rank to fail (None: no rank on this host reported one; ``mpiexec`` did).
        status: the exit status it stands for (128 + N for signal N).
        description: ``"exited with status 3"``, ``"was killed by signal 9 (SIGKILL)"``, ...
        failed_ns: when it failed (the rank's or its watcher's clock; the launcher's for a
            vanished rank), wall-clock ns.
        detected_ns: when the launcher noticed it.
        tail: the last lines the rank printed (without its prefix).
    """

    rank: int | None
    status: int
    description: str
    failed_ns: int
    detected_ns: int
    tail: tuple[str, ...] = ()



def _who(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _ranks_text(ranks: list[int]) -> str:
    return f"{_who(ranks)} {'is' if len(ranks) == 1 else 'are'}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class Job:
    """Runs ``command`` (mpiexec and its arguments) to the end; :meth:`run` gives the exit code.

    Args:
        command: the mpiexec command line.
        env: the environment of the job (with the status directory's variables set).
        nproc: the number of ranks.
        status_dir: the status directory (made and removed by the caller).
        timeout: seconds before the job is ended with :data:`TIMEOUT_EXIT_CODE`, or None.
        on_poll: called at every poll (a restart's report reads the milestones).
        timeout_text: how the timeout is named in its message (default: ``"{timeout} s"``).
        local_only: every rank runs on this host, so a rank that never reported a start is one
            that died before it started (named), not one on another host.
        survive: ``--survive K``: the first K ranks to fail do not end the job (the survivors
            carry on without them, docs/elastic.md "Surviving failures"); the next one does.
    """

    def __init__(self, command: list[str], env: dict[str, str], *, nproc: int, status_dir: str,
                 timeout: float | None, on_poll: Callable[["Job"], None] | None = None,
                 timeout_text: str | None = None, local_only: bool = False, survive: int = 0) -> None:
        self.command = command
        self.env = env
        self.nproc = nproc
        self.status_dir = status_dir
        self.timeout = timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.ranks: dict[int, _Rank] = {}
        self.received: int | None = None  # the first SIGINT/SIGTERM/SIGHUP the launcher received
        self.end_now = False  # a second signal
        self.timed_out = False
        self.end_by = float("inf")  # when the ranks still running are killed
        self.ending = False  # the job is being ended: MPICH's complaints about it are dropped
        self.killed: set[int] = set()  # ranks the launcher killed: not failures of their own
        self.released_at: float | None = None
        self.mpiexec_killed = False
        self.first_failure: _Failure | None = None
        self.shutdown_since: float | None = None  # when only ranks shutting down were left
        self.timeout_text = timeout_text or (f"{timeout:g} s" if timeout is not None else "")  # for the message
        self.on_poll = on_poll  # called at every poll (a restart's report reads the milestones)
        self.tails = RankTails()  # each rank's last lines of output
        self.popen_ns: int | None = None  # when mpiexec was started
        self.detected_ns: int | None = None  # when the launcher noticed the first failure
        self.ended_ns: int | None = None  # when the job was over: mpiexec and every rank here gone
        self.exit_code: int | None = None  # what run() returned
        self.local_only = local_only
        self.shm: dict[str, tuple[int, int]] = {}  # MPICH's files the ranks here hold: name -> (dev, inode)
        self.survive = survive
        self.survived: dict[int, _Failure] = {}  # rank -> its failure, which the others survived

    # --- running --------------------------------------------------------------------------

    def run(self) -> int:
        """Start mpiexec, forward signals to it, supervise the ranks; the launcher's exit code."""
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                previous[sig] = signal.signal(sig, self._on_signal)
        pumps: list[threading.Thread] = []
        try:
            if shutil.which(self.command[0]) is None:
                raise LaunchError(f"could not start {self.command[0]!r}: not found, or not an executable file")
            command = self.command
            if sys.platform.startswith("linux") and sys.executable:  # SIGTERM to mpiexec when the launcher dies
                command = [sys.executable, "-I", "-S", deathsig.__file__, str(os.getpid()), *command]
            try:
                self.popen_ns = time.time_ns()
                self.proc = subprocess.Popen(command, env=self.env, start_new_session=True,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            except OSError as exc:
                raise LaunchError(f"could not start {self.command[0]!r}: {exc}") from exc
            assert self.proc.stdout is not None and self.proc.stderr is not None
            for source, target in ((self.proc.stdout, 1), (self.proc.stderr, 2)):
                pumps.append(start_pump(source.fileno(), target, OutputFilter(lambda: self.ending, self.tails)))
            if self.received is not None:  # arrived while the child was being started
                self._send(self.received)
            returncode = self._supervise()
            self._refresh()
            self._name_ends()
            unstarted = self._unstarted_failure(returncode)
            if unstarted is not None and unstarted.rank is not None:
                logger.error("rank %d %s", unstarted.rank, unstarted.description)
            self.exit_code = self._exit_code(returncode)
            return self.exit_code
        finally:
            if self.proc is not None and self.proc.poll() is None:  # e.g. an error in the launcher
                self._send(signal.SIGKILL)
                self.proc.wait()
            self._reap_ranks()  # never two attempts of a restarted job at once
            removed = remove_shm(self.shm)  # what the ranks' MPI_Finalize did not remove
            if removed:
                logger.debug("removed the shared memory the ranks left: %s", ", ".join(removed))
            self.ended_ns = time.time_ns()
            for pump in pumps:  # the last of the output; a rank's orphan holding the pipe: not ours
                pump.join(timeout=5)
            if self.proc is not None:
                for pipe in (self.proc.stdout, self.proc.stderr):
                    if pipe is not None:
                        pipe.close()
            for rank in self.ranks.values():
                if rank.pidfd is not None:
                    os.close(rank.pidfd)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _supervise(self) -> int:
        assert self.proc is not None
        started = time.monotonic()
        deadline = started + self.timeout if self.timeout is not None else float("inf")
        while True:
            try:
                return self.proc.wait(timeout=_POLL_S)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            self._refresh()
            self._scan_shm(now)
            failure = self._first_failure()
            if failure is not None and self.first_failure is None:
                self.first_failure = failure
                self.detected_ns = time.time_ns()
                self._begin_ending(now + FAILURE_SETTLE_S)
            if self.on_poll is not None:
                self.on_poll(self)
            if now >= deadline and not self.timed_out:
                self.timed_out = True
                logger.error("job exceeded --timeout %s", self.timeout_text)
                self._touch(TIMED_OUT)  # ranks print a whole traceback, not one line
                # SIGINT rather than SIGTERM: ranks in Python code print where they were.
                self._send(signal.SIGINT)
                self._begin_ending(now + KILL_GRACE_S)
            if self.released_at is None:
                stuck = self._only_shutting_down()
                if not stuck:
                    self.shutdown_since = None
                elif self.shutdown_since is None:
                    self.shutdown_since = now
                elif now - self.shutdown_since > SHUTDOWN_GRACE_S:
                    logger.warning("every rank's script is over, but %s still in MPI_Finalize %g s later, waiting "
                                   "for ranks that left without it (os._exit); ending %s", _ranks_text(stuck),
                                   SHUTDOWN_GRACE_S, "it" if len(stuck) == 1 else "them")
                    self._kill_running()
                    self._release(now)
                    continue
                if self._all_ended():
                    self._release(now)
                elif self.end_now or now >= self.end_by:
                    self._kill_running()
                    self._release(now)
            elif self.ending and not self.mpiexec_killed and (self.end_now or now >= self.released_at + KILL_GRACE_S):
                # (Without `ending`, the ranks here ended well and those on other hosts go on.)
                self.mpiexec_killed = True
                if not self.end_now:
                    logger.error("mpiexec still running %g s after the job was ended; killing it", KILL_GRACE_S)
                self._send(signal.SIGKILL)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.received is not None:
            self.end_now = True
            return
        self.received = signum
        self._begin_ending(time.monotonic() + KILL_GRACE_S)
        logger.debug("received %s; forwarding it to the job", _signal_name(signum))
        self._send(signum)

    def _begin_ending(self, end_by: float) -> None:
        self.ending = True
        self.end_by = min(self.end_by, end_by)

    def _send(self, sig: int) -> None:
        """Send ``sig`` to mpiexec's process group (hydra passes SIGINT/SIGTERM on to the ranks)."""
        if self.proc is None or self.proc.returncode is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _touch(self, name: str) -> None:
        try:
            write_exclusive(os.path.join(self.status_dir, name), b"")
        except OSError:  # there already (FileExistsError), or the folder is gone
            pass

    def _release(self, now: float) -> None:
        logger.debug("releasing the ranks' watchers")
        self.released_at = now
        self._touch(RELEASE)

    def _kill_running(self) -> None:
        """SIGKILL the ranks on this host that have not ended (only the user's processes)."""
        self._name_ends()  # those that ended on their own first, before the ones killed now
        running = sorted(r for r, rank in self.ranks.items() if rank.ended is None and rank.pid is not None)
        healthy = [r for r in running if self.ranks[r].failed is None]
        if healthy and self.first_failure is not None and self.received is None and not self.timed_out:
            failed = self._cause(self.first_failure)
            # A rank whose script is over but whose process lives on is stuck in its exit (in
            # MPI_Finalize, waiting for the others), not working.
            working = [r for r in healthy if not self.ranks[r].finished]
            exiting = [r for r in healthy if self.ranks[r].finished]
            states = [f"{_who(working)} still running"] if working else []
            if exiting:
                one = len(exiting) == 1
                states.append(f"{_who(exiting)} finished {'its script' if one else 'their scripts'} but "
                              f"{'has' if one else 'have'} not exited: stuck in MPI_Finalize or an atexit handler")
            logger.error("rank %d failed (%s); killing the job (%s)", failed.rank, failed.how, "; ".join(states))
        self._scan_shm(time.monotonic(), every=True)  # the last look before they go
        for r in running:
            rank = self.ranks[r]
            try:
                if rank.pidfd is not None:
                    signal.pidfd_send_signal(rank.pidfd, signal.SIGKILL)
                else:
                    os.kill(rank.pid, signal.SIGKILL)  # type: ignore[arg-type]
            except (ProcessLookupError, PermissionError):
                continue
            self.killed.add(r)

    # --- what the ranks say ---------------------------------------------------------------

    def _refresh(self) -> None:
        """Read the status files not read yet."""
        try:
            names = os.listdir(self.status_dir)
        except OSError:
            return
        for name in names:
            match = _STATUS_FILE.fullmatch(name)
            if match is None:
                continue
            kind, r = match.group(1), int(match.group(2))
            rank = self.ranks.setdefault(r, _Rank())
            if kind.startswith(MILESTONE):
                name = kind[len(MILESTONE) + 1:]
                if name not in rank.milestones:
                    try:
                        text = read_small(os.path.join(self.status_dir, name_of(kind, r)))
                        rank.milestones[name] = _number(text.split()[0])
                    except (OSError, ValueError, IndexError):
                        pass
                continue
            if (kind == START and rank.pid is not None or kind == FAILED and rank.failed is not None
                    or kind == ENDED and rank.ended is not None or kind == FINISHED and rank.finished):
                continue
            if kind == FINISHED:
                rank.finished = True
                continue
            try:
                fields = read_small(os.path.join(self.status_dir, name)).split()
                if kind == START:
                    pid = _number(fields[0])
                    if pid <= 0:
                        continue
                    rank.pid = pid
                    rank.started_ns = _number(fields[1]) if len(fields) > 1 else None
                    rank.watcher = _number(fields[2]) if len(fields) > 2 else None
                    rank.pidfd = _open_pidfd(rank.pid)
                    logger.debug("rank %d started: pid %d (its watcher: pid %s)", r, rank.pid, rank.watcher)
                elif kind == FAILED:
                    if fields[1] not in _HOWS:
                        continue
                    rank.failed = (_number(fields[0]), fields[1], _number(fields[2]))
                    if fields[1] in ("timeout", "peer_failed"):  # the ranks it did not see arrive / found dead
                        named = {_number(f) for f in fields[3:3 + self.nproc]}
                        ranks = tuple(sorted(x for x in named if 0 <= x < self.nproc and x != r))
                        if fields[1] == "timeout":
                            rank.waited_for = ranks
                        else:
                            rank.blamed = ranks
                else:
                    rank.ended = (_number(fields[0]), _number(fields[1]))
            except (OSError, ValueError, IndexError):
                continue
        self._look_for_vanished()

    def _look_for_vanished(self) -> None:
        """Ranks whose process is gone (their pidfd is readable) and whose watcher has not said how
        :data:`VANISHED_GRACE_S` later: it died with them, so nobody will (a rank that vanishes is
        noticed within a poll, not at a collective's timeout)."""
        now_ns = time.time_ns()
        for rank in self.ranks.values():
            if rank.pidfd is None or rank.ended is not None or rank.vanished:
                continue
            if rank.gone_ns is None:
                if select.select([rank.pidfd], [], [], 0)[0]:
                    rank.gone_ns = now_ns
            elif now_ns - rank.gone_ns > VANISHED_GRACE_S * 1e9:
                rank.vanished = True

    def _scan_shm(self, now: float, *, every: bool = False) -> None:
        """Record the MPICH shared-memory files the ranks here hold (see the module docstring): each
        rank that holds none yet at every call, the others every :data:`SHM_RESCAN_S` (``every``:
        all now, before they are killed). New files go into the status directory's record too."""
        found: dict[str, tuple[int, int]] = {}
        for rank in self.ranks.values():
            if rank.pidfd is None or rank.gone_ns is not None or not every and now < rank.next_shm_scan:
                continue
            files = shm_files(rank.pid)  # type: ignore[arg-type]
            if select.select([rank.pidfd], [], [], 0)[0]:  # it ended meanwhile: /proc/PID may be another's
                continue
            rank.next_shm_scan = now + SHM_RESCAN_S if files else 0.0
            found.update(files)
        new = {name: key for name, key in found.items() if self.shm.get(name) != key}
        if new:
            self.shm.update(new)
            try:
                replace_whole(os.path.join(self.status_dir, SHM_RECORD), format_shm_record(self.shm))
            except OSError:
                pass

    def _reap_ranks(self) -> None:
        """Make sure no rank process of this job is left (SIGKILL, then wait up to
        :data:`KILL_GRACE_S`): a restart's next attempt never runs beside this one."""
        self._scan_shm(time.monotonic(), every=True)
        now_ns = time.time_ns()
        alive = []
        for r, rank in self.ranks.items():
            if rank.pidfd is None:
                continue
            if select.select([rank.pidfd], [], [], 0)[0]:
                rank.gone_ns = rank.gone_ns or now_ns  # seen gone, at the latest now
            else:
                alive.append(rank)
                self.killed.add(r)
        for rank in alive:
            try:
                signal.pidfd_send_signal(rank.pidfd, signal.SIGKILL)
            except (ProcessLookupError, PermissionError, OSError):
                pass
        deadline = time.monotonic() + KILL_GRACE_S
        for rank in alive:
            select.select([rank.pidfd], [], [], max(0.0, deadline - time.monotonic()))

    def failure(self) -> JobFailure | None:
        """The failure that ended the job (after :meth:`run`), or None: it did not fail, or it was
        ended by a signal or ``--timeout`` (not failures a restart is for)."""
        if self.timed_out or self.received is not None:
            return None
        unstarted = self._unstarted_failure(None if self.proc is None else self.proc.returncode)
        if unstarted is not None:
            return unstarted
        failure = self.first_failure or min(self._failures(), default=None)
        failure = None if failure is None else self._cause(failure)
        detected = self.detected_ns or self.ended_ns or time.time_ns()
        if failure is None:
            code = None if self.proc is None else self.proc.returncode
            if code in (0, None) or self._exit_code(code) == 0:
                return None
            status = 128 - code if code < 0 else code
            how = f"was killed by signal {-code} ({_signal_name(-code)})" if code < 0 else f"exited with status {code}"
            gone = sorted(r for r, rank in self.ranks.items() if rank.ended is None and rank.gone_ns is not None
                          and r not in self.killed)
            if len(gone) == 1:  # the one rank that vanished: the others ended as they should
                return JobFailure(gone[0], status, f"vanished: its process and its watcher ended without a report, "
                                  f"and mpiexec {how}", detected, detected, self.tails.last(gone[0]))
            if gone:  # hydra ends the job at once when a watcher dies: one of them vanished, it killed the rest
                return JobFailure(None, status, f"mpiexec {how}: {_who(gone)} vanished together, their processes "
                                  "and watchers ended without a report (mpiexec kills every rank as soon as one "
                                  "process ends; which one died first is not known)", detected, detected)
            return JobFailure(None, status, f"mpiexec {how} and no rank here reported a failure (a rank on another "
                              "host, or the process manager)", detected, detected)
        hung = self._hung(failure, detected)
        if hung is not None:
            return hung
        rank = self.ranks.get(failure.rank)
        if rank is not None and rank.vanished:
            description = "vanished: its process and its watcher ended without a report (killed together?)"
        elif failure.how.startswith("signal "):
            number = int(failure.how.split()[1])
            description = f"was killed by signal {number} ({_signal_name(number)})"
        elif failure.how.startswith("exit "):
            description = f"exited with status {failure.status}"
            if rank is not None and rank.failed is not None and rank.failed[1] == "exception":
                description = f"raised an exception (exit {failure.status})"
            elif rank is not None and rank.failed is not None and rank.failed[1] == "peer_failed":
                description = (f"raised a RankFailedError naming {_who(list(rank.blamed))} as failed (exit "
                               f"{failure.status}); no such end was seen here")
        else:
            description = failure.how
        return JobFailure(failure.rank, failure.status, description, failure.time_ns, detected,
                          self.tails.last(failure.rank))

    def _cause(self, failure: _Failure) -> _Failure:
        """``failure``, or where its rank raised a RankFailedError naming peers that failed on their own
        (a signal, an exit, vanished: not a RankFailedError of their own), the earliest of theirs. A
        survivor that finds a dead peer (its pid gone, in the shared-memory path's wait) may report
        before the launcher's watcher says how the peer ended, so the earliest report is not always
        the cause; the rank it names is."""
        rank = self.ranks.get(failure.rank)
        if rank is None or rank.failed is None or rank.failed[1] != "peer_failed":
            return failure
        named = [f for f in self._failures() if f.rank in rank.blamed
                 and (self.ranks[f.rank].failed is None or self.ranks[f.rank].failed[1] != "peer_failed")]
        return min(named, default=failure)

    def _hung(self, first: _Failure, detected: int) -> JobFailure | None:
        """The rank that hung, named as the job's cause rather than the ranks whose timeouts fired
        while they waited for it, or None.

        A rank whose watchdog ended it (``hung``: a call into the engine's library never returned)
        is the cause, the earliest such. Else, when the first failure is a collective's timeout:
        the ranks the timeouts named as not arrived (where the engine knows), or else the ranks
        here that reported no failure and were still running, their script not over, when the
        job was ended: they never reached the collective the others timed out in."""
        hung = sorted((rank.failed[2], r) for r, rank in self.ranks.items()
                      if rank.failed is not None and rank.failed[1] == "hung")
        if hung:
            time_ns, r = hung[0]
            return JobFailure(r, self.ranks[r].failed[0], "hung: a call into the engine's library (creating or freeing "
                              "a communicator) did not return within the group's timeout, and its watchdog ended "
                              "it (its output names the call)", time_ns, detected, self.tails.last(r))
        timed_out = self.ranks.get(first.rank)
        if timed_out is None or timed_out.failed is None or timed_out.failed[1] != "timeout":
            return None
        waiting = sorted(r for r, rank in self.ranks.items() if rank.failed is not None and rank.failed[1] == "timeout")
        named = sorted({r for w in waiting for r in self.ranks[w].waited_for})
        if named:
            suspects, how = named, "named by their timeouts as not arrived"
        else:
            suspects = sorted(r for r, rank in self.ranks.items() if r in self.killed and rank.failed is None
                              and not rank.finished)
            how = "still running, without reporting a failure, when the job was ended"
        if not suspects:
            return None
        others = f" (with {_who(suspects[1:])})" if len(suspects) > 1 else ""
        waited = [r for r in waiting if r not in suspects]
        return JobFailure(suspects[0], first.status,
                          f"hung{others}: {_who(waited or waiting)} timed out in a collective waiting for it ({how}): "
                          "it was stuck in its own code or in another call", first.time_ns, detected,
                          self.tails.last(suspects[0]))

    def _unstarted_failure(self, code: int | None) -> JobFailure | None:
        """On a job whose ranks all run here, that failed (``code``: mpiexec's) with no rank reporting
        a failure: the ranks that never reported a start, whose processes died before their
        bootstrap did (killed at start). None when every rank started, or some may run elsewhere."""
        # Ranks that vanished do not count: mpiexec kills every rank here when one process dies.
        if not self.local_only or code is None or code == 0 or any(f.how != "vanished" for f in self._failures()):
            return None
        unstarted = [r for r in range(self.nproc) if r not in self.ranks or self.ranks[r].pid is None]
        if not unstarted:
            return None
        status = 128 - code if code < 0 else code
        how = f"was killed by signal {-code} ({_signal_name(-code)})" if code < 0 else f"exited with status {code}"
        one = len(unstarted) == 1
        description = (f"died before it started: its process ended before the rank bootstrap reported a start, and "
                       f"mpiexec {how}" if one else
                       f"mpiexec {how}: {_who(unstarted)} died before they started (their processes ended before the "
                       "rank bootstrap reported a start; mpiexec ends every rank as soon as one process ends, so which "
                       "one died first is not known)")
        now = self.detected_ns or self.ended_ns or time.time_ns()
        return JobFailure(unstarted[0] if one else None, status, description, now, now,
                          self.tails.last(unstarted[0]) if one else ())

    def _only_shutting_down(self) -> list[int]:
        """Ranks still alive though their script is over, when every rank's script is over (and no
        rank failed): stuck in MPI_Finalize for a rank that left without it. Else []."""
        started = {r: rank for r, rank in self.ranks.items() if rank.pid is not None}
        if len(started) < self.nproc or self.first_failure is not None:
            return []
        if not all(rank.ended is not None or rank.finished for rank in started.values()):
            return []
        return sorted(r for r, rank in started.items() if rank.ended is None)

    def _all_ended(self) -> bool:
        """Every rank that started on this host has ended (and one did)."""
        started = [rank for rank in self.ranks.values() if rank.pid is not None]
        return bool(started) and all(rank.ended is not None or rank.vanished for rank in started)

    def _abandoned(self) -> list[_Failure]:
        """Ranks that left (status 0) without finishing their script, so without MPI_Finalize
        (``os._exit(0)``), while others still run :data:`SHUTDOWN_GRACE_S` later: MPI counts that
        exit as abnormal (hydra ends the job at once), and the others may be waiting for them."""
        running = any(rank.pid is not None and rank.ended is None and not rank.finished
                      for rank in self.ranks.values())
        if not running:
            return []
        grace_ns = int(SHUTDOWN_GRACE_S * 1e9)
        now_ns = time.time_ns()
        return [_Failure(rank.ended[1], r, 1, "left without finishing its script (os._exit(0)?)")
                for r, rank in self.ranks.items()
                if rank.ended is not None and rank.ended[0] == 0 and not rank.finished and rank.failed is None
                and r not in self.killed and now_ns - rank.ended[1] > grace_ns]

    def _failures(self) -> list[_Failure]:
        """The failures that end the job (not those survived under ``--survive``)."""
        if self.survive:
            self._survive()
        return [f for f in self._all_failures() if f.rank not in self.survived]

    def _all_failures(self) -> list[_Failure]:
        failures = self._abandoned()
        for r, rank in self.ranks.items():
            if rank.failed is not None:
                status, _, time_ns = rank.failed
                failures.append(_Failure(time_ns, r, status, f"exit {status}"))
            elif rank.ended is not None and rank.ended[0] != 0 and r not in self.killed:
                code, time_ns = rank.ended
                how = f"exit {code}" if code > 0 else f"signal {-code}"
                failures.append(_Failure(time_ns, r, code if code > 0 else 128 - code, how))
            elif rank.vanished and r not in self.killed:
                failures.append(_Failure(rank.gone_ns or 0, r, 128 + signal.SIGKILL, "vanished"))
        return failures

    def _first_failure(self) -> _Failure | None:
        return min(self._failures(), default=None)

    def _survive(self) -> None:
        """Under ``--survive K``: the first K ranks lost are survived (logged, not the job's end). A lost
        rank is one whose process ended without reporting a failure (a signal, ``os._exit``); one that
        raised reported it, and its error is the script's: it ends the job as without ``--survive``."""
        for failure in sorted(f for f in self._all_failures() if f.rank not in self.survived
                              and self.ranks[f.rank].failed is None):
            if len(self.survived) >= self.survive:
                return
            self.survived[failure.rank] = failure
            logger.warning("rank %d failed (%s); the survivors carry on without it (%d of --survive %d)",
                           failure.rank, failure.how, len(self.survived), self.survive)

    def _name_ends(self) -> None:
        """Say how the ranks ended that left no traceback (``os._exit(3)``, a signal, ``sys.exit``),
        one line for all the ranks that ended the same way (a usage error on 64 ranks is one line)."""
        ends: dict[str, list[int]] = {}
        for r in sorted(self.ranks):
            rank = self.ranks[r]
            if rank.named or r in self.killed:
                continue
            if rank.failed is not None:
                status, how, _ = rank.failed
                if how == "exit":
                    ends.setdefault(f"exited with status {status}", []).append(r)
                rank.named = True
            elif rank.ended is not None:
                code = rank.ended[0]
                if code > 0:
                    ends.setdefault(f"exited with status {code}", []).append(r)
                elif code < 0 and -code != self.received:  # not the Ctrl-C the user pressed
                    ends.setdefault(f"was killed by signal {-code} ({_signal_name(-code)})", []).append(r)
                rank.named = True
            elif rank.vanished:
                ends.setdefault("vanished: its process ended and its watcher with it, without a report", []).append(r)
                rank.named = True
        for how, ranks in ends.items():
            who = _who(ranks)
            logger.error("%s %s", who, how.replace("was killed", "were killed") if len(ranks) > 1 else how)

    def _exit_code(self, returncode: int) -> int:
        if self.timed_out:
            return TIMEOUT_EXIT_CODE
        if self.received is not None:
            return 128 + self.received  # 130 for Ctrl-C, as a shell reports it
        unstarted = self._unstarted_failure(returncode)
        if unstarted is not None:
            return unstarted.status
        failure = min([*self._failures(), *([self.first_failure] if self.first_failure else [])], default=None)
        if failure is not None:
            return failure.status or 1
        local = {r: rank for r, rank in self.ranks.items() if rank.pid is not None}
        # A rank ended in MPI_Finalize after its script was over (see SHUTDOWN_GRACE_S) exited well.
        if len(local) == self.nproc and all(rank.ended is not None and rank.ended[0] == 0 or r in self.survived
                                            or r in self.killed and rank.finished for r, rank in local.items()):
            # hydra may report a rank it killed after its watcher was released: the ranks know better
            return 0
        if returncode < 0:  # mpiexec itself died of a signal
            return 128 - returncode
        return returncode


def name_of(kind: str, rank: int) -> str:
    """The status file of ``kind`` for ``rank``."""
    return f"{kind}.{rank}"


def _number(text: str) -> int:
    """An integer of a status file: ASCII digits, an optional minus. Raises ValueError otherwise."""
    if not _INT.fullmatch(text):
        raise ValueError(f"not a number: {text!r}")
    return int(text)


def _open_pidfd(pid: int) -> int | None:
    """A pidfd for ``pid`` (Linux 5.3+), so that a later kill cannot hit a reused pid."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
