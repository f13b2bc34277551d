"""The rank side of ``meshkit-run``: what each rank runs before and around the user's script.

``meshkit-run`` starts every rank as ``python .../meshkit/launch/bootstrap.py SCRIPT ARGS...``
(or ``-m MODULE``): by path, and importing only the standard library, so that the user's
script is the first to import NumPy and can configure it. The bootstrap

* sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` as torchrun does, from
  the process manager's own variables (:data:`TORCHRUN_ENV_VARS`);
* with ``meshkit-run --simulate-nodes K`` (:data:`SIMULATED_NODES_ENV`), places the rank on
  simulated node ``rank // (WORLD_SIZE // K)`` of this machine: ``MESHKIT_HOST_NAME`` (the host
  name meshkit reports, :data:`HOST_NAME_ENV`) is ``{host}-sim{node}``, and ``LOCAL_RANK`` and
  ``LOCAL_WORLD_SIZE`` count that node's ranks (:func:`set_simulated_node`);
* prefixes each line the rank writes to ``sys.stdout``/``sys.stderr`` with ``[rank{r}]: ``
  (as torchrun does), writing whole lines so that ranks never interleave within a line;
* turns an uncaught exception into the end of the job: the rank prints its traceback, reports
  its failure to the launcher, and exits at once without finalizing MPI. A crashed rank never
  leaves the others waiting in a collective;
* on the launcher's host (Linux), forks: the child runs the script, the parent (the process
  ``mpiexec`` started) is its *watcher*. The watcher records how the child ended (exit status
  or signal, which no other process could learn: ``mpiexec``'s proxy reaps it) and then waits
  for the launcher's release before it exits the same way. So the first rank to end never
  makes ``mpiexec`` kill the others before they have printed their own errors, and the
  launcher alone decides when the job ends (see :mod:`meshkit.launch.job`).

The ranks and the launcher talk through a status directory (``$MESHKIT_LAUNCH_STATUS_DIR``),
one small file per event, each written whole (``os.replace``):

=================  ======================================  ====================
file               contents                                written by
=================  ======================================  ====================
``start.{r}``      the rank's pid, time in ns, the         rank, at start
                   watcher's pid (its own without one)
``failed.{r}``     status, how (exception, exit,           rank, before it exits
                   interrupt), time in ns
``ended.{r}``      exit code (negative: killed by that     watcher, when the rank
                   signal), time in ns                     process has ended
``milestone-{m}.{r}`` time in ns                            rank, when it passed
                                                           milestone ``m`` (rendezvous,
                                                           restored, first_step: see
                                                           :mod:`meshkit.comm.milestones`)
``release``        (empty)                                 launcher: watchers may exit
``timed-out``      (empty)                                 launcher, before ending a
                                                           job at ``--timeout``
=================  ======================================  ====================
"""

from __future__ import annotations

import atexit
import os
import re
import runpy
import signal
import sys
import threading
import time
from types import ModuleType, TracebackType
from typing import NoReturn, TextIO

__all__ = [
    "RANK_ENV_VARS", "TORCHRUN_ENV_VARS", "STATUS_DIR_ENV", "LAUNCHER_ENV", "START", "FAILED", "ENDED", "RELEASE", "TIMED_OUT",
    "FINISHED", "MILESTONE", "SIMULATED_NODES_ENV", "HOST_NAME_ENV",
    "launcher_host", "set_torchrun_env", "set_simulated_node", "simulated_host", "main",
]

#: The rank is read from the first of these that is set: MPICH/hydra, Open MPI, PMIx, Slurm.
#: Reading the environment keeps the bootstrap from importing mpi4py (and initializing MPI)
#: in ranks that never use it.
RANK_ENV_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
#: The variables torchrun sets for each rank, each taken from the first of its process manager's
#: variables that is set (MPICH/hydra, Open MPI, Slurm), so that ported code reading them sees
#: the rank MPI gives this process (its world rank in meshkit). One that no process manager
#: announced is removed rather than left at a stale value. MASTER_ADDR/MASTER_PORT are the
#: launcher's (:mod:`meshkit.launch.cli`).
TORCHRUN_ENV_VARS = {
    "RANK": RANK_ENV_VARS,
    "WORLD_SIZE": ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", "MESHKIT_WORLD_SIZE"),
    "LOCAL_RANK": ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"),
    "LOCAL_WORLD_SIZE": ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"),
}
#: The status directory (a folder the launcher made; see the module docstring).
STATUS_DIR_ENV = "MESHKIT_LAUNCH_STATUS_DIR"
#: "HOST PID" of the launcher: ranks on another host (which cannot see its folder, or see it
#: through a shared file system) and watchers whose launcher is gone do not wait for it.
LAUNCHER_ENV = "MESHKIT_LAUNCHER"
#: ``K``: the launcher's ``--simulate-nodes K``: ranks form K simulated nodes of this machine.
SIMULATED_NODES_ENV = "MESHKIT_SIMULATED_NODES"
#: The host name a rank reports in place of the machine's (read by ``meshkit.comm.env``).
HOST_NAME_ENV = "MESHKIT_HOST_NAME"
#: Names of the status files (``{name}.{rank}`` for the per-rank ones).
START, FAILED, ENDED, RELEASE, TIMED_OUT = "start", "failed", "ended", "release", "timed-out"
#: The rank's script is over (returned, or sys.exit(0)); the interpreter is shutting down (atexit
#: handlers, MPI_Finalize). Written before shutdown, so the launcher can tell a rank that is still
#: working from one stuck in MPI_Finalize waiting for ranks that left without it.
FINISHED = "finished"
#: ``milestone-{name}.{rank}``: the rank passed a point of a (re)start that the launcher times.
MILESTONE = "milestone"
# Frames of the rank bootstrap (and of meshkit.spawn's rank module, which calls the user's
# function), hidden from the user's tracebacks (runpy is frozen in 3.11+).
_BOOTSTRAP_FILES = frozenset({__file__, runpy.__file__, "<frozen runpy>",
                              os.path.join(os.path.dirname(os.path.abspath(__file__)), "spawn_rank.py")})
# A line ends at "\n", "\r\n" or a lone "\r" (progress bars redraw a line with "\r").
_LINE_END = re.compile(r"\r\n|\r(?!$)|\n")
# Signals a watcher passes on to its rank: those a process manager sends to end or poke a job.
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# Signals whose default action dumps core: a watcher exits 128+N instead of raising them on itself.
_CORE_SIGNALS = frozenset({signal.SIGQUIT, signal.SIGILL, signal.SIGABRT, signal.SIGFPE, signal.SIGSEGV,
                           signal.SIGBUS, signal.SIGSYS, signal.SIGTRAP, signal.SIGXCPU, signal.SIGXFSZ})
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_RELEASE_POLL_S = 0.02


def launcher_host() -> str:
    """This host's name as ranks and launcher compare it (``os.uname().nodename``)."""
    return os.uname().nodename


class _StatusDir:
    """This rank's side of the status directory; None-safe construction via :meth:`from_env`."""

    def __init__(self, path: str, launcher_pid: int, rank: int) -> None:
        self.path = path
        self.launcher_pid = launcher_pid
        self.rank = rank

    @classmethod
    def from_env(cls, rank: int) -> _StatusDir | None:
        """The launcher's status directory, if the launcher runs on this host; else None."""
        path = os.environ.get(STATUS_DIR_ENV, "")
        host, _, pid = os.environ.get(LAUNCHER_ENV, "").rpartition(" ")
        if not path or host != launcher_host() or not pid.isdigit() or not os.path.isdir(path):
            return None
        return cls(path, int(pid), rank)

    def write(self, name: str, *fields: object) -> None:
        """Write ``{name}.{rank}`` whole: the launcher never reads a half-written file."""
        path = os.path.join(self.path, f"{name}.{self.rank}")
        try:
            with open(f"{path}.tmp", "w", encoding="ascii") as f:
                f.write(" ".join(str(field) for field in fields))
            os.replace(f"{path}.tmp", path)
        except OSError:  # the launcher is gone and took its folder along: nobody to tell
            pass

    def report_failure(self, status: int, how: str) -> None:
        self.write(FAILED, status, how, time.time_ns())

    def has(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.path, name))

    def launcher_alive(self) -> bool:
        if not os.path.isdir(self.path):  # it removes the folder as it exits
            return False
        try:
            os.kill(self.launcher_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def wait_for_release(self) -> None:
        """Return once the launcher has written ``release``, or is gone."""
        polls = 0
        while not self.has(RELEASE):
            polls += 1
            if polls % 25 == 0 and not self.launcher_alive():  # every 0.5 s
                return
            time.sleep(_RELEASE_POLL_S)


class _PrefixedStream:
    """Text stream that writes whole lines to ``stream``, each starting with ``prefix``.

    Text is held until a line ends ("\\n", "\\r\\n" or "\\r"), then the finished lines go out
    in one write followed by a flush, so lines of different ranks never mix. A partial line
    is written (with a newline added) by :meth:`finish_line`, which runs at exit.
    Other attributes (``fileno``, ``encoding``, ``buffer``...) are those of ``stream``.
    """

    def __init__(self, stream: TextIO, prefix: str) -> None:
        self._stream = stream
        self._prefix = prefix
        self._pending = ""
        # Reentrant: a signal handler that prints may interrupt a write in the same thread.
        self._lock = threading.RLock()

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        with self._lock:
            data = self._pending + text
            out = []
            start = 0
            for match in _LINE_END.finditer(data):
                line = data[start : match.end()]
                # A bare "\r" (a progress bar about to redraw) gets no prefix of its own.
                out.append(line if line == "\r" else self._prefix + line)
                start = match.end()
            self._pending = data[start:]
            if out:
                self._stream.write("".join(out))
                self._stream.flush()
        return len(text)

    def writelines(self, lines: list[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        # A partial line stays pending: writing it now would split the line between ranks.
        self._stream.flush()

    def finish_line(self) -> None:
        """Write a pending partial line, ending it with a newline, and flush."""
        with self._lock:
            pending, self._pending = self._pending, ""
            if pending:
                self._stream.write(self._prefix + pending + "\n")
            self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


def _rank_from_env() -> int:
    """This process's rank as the process manager announced it; 0 when none did."""
    for name in RANK_ENV_VARS:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 0


def set_torchrun_env(environ: dict[str, str] | None = None) -> None:
    """Set :data:`TORCHRUN_ENV_VARS` in ``environ`` (``os.environ``) from the process manager's, then the
    simulated node's (:func:`set_simulated_node`)."""
    environ = os.environ if environ is None else environ
    for name, sources in TORCHRUN_ENV_VARS.items():
        value = next((environ[s].strip() for s in sources if environ.get(s, "").strip().isdigit()), None)
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    set_simulated_node(environ)


def simulated_host(host: str, node: int) -> str:
    """The name of simulated node ``node`` of ``host``."""
    return f"{host}-sim{node}"


def set_simulated_node(environ: dict[str, str] | None = None) -> None:
    """Under :data:`SIMULATED_NODES_ENV` (``K``), put this rank on its simulated node, in blocks
    of ``WORLD_SIZE // K`` consecutive ranks (ranks 0, 1 on node 0 and 2, 3 on node 1 for 4 ranks
    on 2 nodes, as hydra fills real hosts): sets :data:`HOST_NAME_ENV`, ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE``. Does nothing where the variable is unset.

    Raises:
        ValueError: ``K`` is not a positive integer dividing ``WORLD_SIZE``, or no rank is known.
    """
    environ = os.environ if environ is None else environ
    raw = environ.get(SIMULATED_NODES_ENV, "").strip()
    if not raw:
        return
    rank, size = environ.get("RANK", ""), environ.get("WORLD_SIZE", "")
    if not raw.isdigit() or int(raw) < 1 or not size.isdigit() or int(size) % int(raw) or not rank.isdigit():
        raise ValueError(f"meshkit-run: rank {rank or '?'}: {SIMULATED_NODES_ENV}={raw!r} is not valid for "
                         f"WORLD_SIZE={size or '(unset)'}: it must be a number of nodes >= 1 that divides the "
                         "number of ranks (meshkit-run --simulate-nodes)")
    per_node = int(size) // int(raw)
    environ[HOST_NAME_ENV] = simulated_host(launcher_host(), int(rank) // per_node)
    environ["LOCAL_RANK"] = str(int(rank) % per_node)
    environ["LOCAL_WORLD_SIZE"] = str(per_node)


def _install_prefixed_streams(prefix: str) -> list[_PrefixedStream]:
    streams = []
    for name in ("stdout", "stderr"):
        current = getattr(sys, name)
        if current is not None and not isinstance(current, _PrefixedStream):
            wrapped = _PrefixedStream(current, prefix)
            setattr(sys, name, wrapped)
            streams.append(wrapped)
    return streams


def _finish_lines(streams: list[_PrefixedStream]) -> None:
    for stream in streams:
        try:
            stream.finish_line()
        except (OSError, ValueError):  # a closed pipe at exit is not worth a second traceback
            pass


def _exit_status(code: object) -> int:
    """The process exit status that ``SystemExit(code)`` produces."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1  # Python prints a non-integer code to stderr and exits 1


def _print_exception(exc: BaseException) -> None:
    """Print ``exc`` as Python would for an uncaught exception, without bootstrap frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in _BOOTSTRAP_FILES:
        tb = tb.tb_next
    # The default excepthook prints exc.__traceback__ and ignores its tb argument.
    exc.__traceback__ = tb
    try:
        sys.excepthook(type(exc), exc, tb)
    except Exception:  # a broken user excepthook must not hide the original error
        import traceback

        traceback.print_exception(type(exc), exc, tb)


def _mpi_active() -> ModuleType | None:
    """The ``mpi4py.MPI`` module if this process initialized MPI and has not finalized it."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return None
    try:
        return mpi if mpi.Is_initialized() and not mpi.Is_finalized() else None
    except Exception:
        return None


def _end_rank(code: int, streams: list[_PrefixedStream], linger: _StatusDir | None = None) -> NoReturn:
    """Exit this rank with ``code``, without MPI_Finalize (after the launcher's release if ``linger``).

    Skipping MPI_Finalize matters: it waits for the other ranks, which may never arrive. Not
    MPI_Abort either: hydra tears the job down on an abort before its proxy has forwarded the
    rank's last output (a traceback lost its final lines that way under load). On the
    launcher's host the watcher holds the rank's place in the job until the launcher ends it
    (or, without a watcher, the rank lingers itself: ``linger``); elsewhere the exit ends the
    job (hydra, Open MPI's mpirun and Slurm's srun --kill-on-bad-exit all end a job whose rank
    exits without finalizing).
    """
    _finish_lines(streams)
    if linger is not None:
        linger.wait_for_release()
    os._exit(code)


def _ignore_interrupts() -> None:
    """Ignore further SIGINTs while this rank reports its failure and exits.

    A second Ctrl-C (or the launcher's SIGINT at ``--timeout`` after a Ctrl-C) must not cut
    the exit path short and leave the rank in MPI_Finalize.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _print_interrupt(exc: KeyboardInterrupt) -> None:
    """One line for a Ctrl-C: where the script was, and where it was waiting if elsewhere."""
    frames = []
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename not in _BOOTSTRAP_FILES:
            frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_code.co_name))
        tb = tb.tb_next
    where = ""
    if frames:
        outer, inner = frames[0], frames[-1]
        where = f" at {outer[0]}:{outer[1]}"
        if inner != outer:
            where += f" (in {inner[2]}, {inner[0]}:{inner[1]})"
    print(f"KeyboardInterrupt{where}", file=sys.stderr, flush=True)


def _run_target(target: list[str]) -> None:
    if target[0] == "-m":
        module, args = target[1], target[2:]
        sys.argv = [module, *args]
        # As `python -m module`: the working directory comes first on sys.path (not this file's
        # folder, launch/, whose cli.py, job.py and output.py would shadow a user module of the name).
        sys.path[0] = os.getcwd()
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, args = target[0], target[1:]
        sys.argv = [script, *args]
        # As `python script.py`: the script's directory comes first on sys.path.
        sys.path[0] = os.path.dirname(os.path.realpath(script))
        runpy.run_path(script, run_name="__main__")


# --------------------------------------------------------------------------------------------
# The watcher
# --------------------------------------------------------------------------------------------


def _fork_watcher(status: _StatusDir) -> bool:
    """Fork; return True in the child, which goes on to run the script as the rank.

    The parent never returns: it becomes the rank's watcher (:func:`_watch`). Returns False
    (no fork) where the child cannot be tied to the watcher's life: without Linux's
    ``PR_SET_PDEATHSIG`` a rank whose watcher ``mpiexec`` killed would run on unsupervised.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    watcher = os.getpid()
    # Blocked across the fork: a signal for the watcher arriving before its handlers are in
    # place is delivered (and forwarded) once they are, rather than killing it.
    signal.pthread_sigmask(signal.SIG_BLOCK, _FORWARDED)
    try:
        child = os.fork()
    except OSError:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
        return False
    if child == 0:
        # Its own process group: a signal hydra sends to the rank's group reaches the rank
        # once, through the watcher, not twice. Killed with the watcher, whoever kills it.
        try:
            os.setpgid(0, 0)
        except OSError:
            pass
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != watcher:  # the watcher died before prctl took effect
            os._exit(128 + signal.SIGKILL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
        return True
    try:
        os.setpgid(child, child)  # as the child does: whichever runs first
    except OSError:
        pass
    _watch(child, status)


def _watch(child: int, status: _StatusDir) -> NoReturn:
    """Wait for the rank process, record how it ended, wait for the release, exit the same way."""
    alive = True

    def forward(signum: int, frame: object) -> None:
        if alive:
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
    _, wait_status = os.waitpid(child, 0)  # retried by Python when a forwarded signal interrupts it
    alive = False
    code = os.waitstatus_to_exitcode(wait_status)
    status.write(ENDED, code, time.time_ns())
    status.wait_for_release()
    _exit_like(code)


def _exit_like(code: int) -> NoReturn:
    """Exit with ``code`` as ``os.waitstatus_to_exitcode`` gives it (negative: a signal)."""
    if code < 0 and -code not in _CORE_SIGNALS:
        try:
            if -code not in (signal.SIGKILL, signal.SIGSTOP):  # these have no handler to reset
                signal.signal(-code, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
            os.kill(os.getpid(), -code)
        except (OSError, ValueError):
            pass
    os._exit(code if code >= 0 else 128 - code)


# --------------------------------------------------------------------------------------------
# The rank
# --------------------------------------------------------------------------------------------


def _rank_main(target: list[str]) -> int:
    """Run ``target`` (``[script, *args]`` or ``["-m", module, *args]``) as one rank."""
    if not target or target == ["-m"]:
        raise ValueError(f"meshkit-run: rank bootstrap needs a script or -m MODULE, got {target}")
    rank = _rank_from_env()
    set_torchrun_env()
    status = _StatusDir.from_env(rank)
    # Without a watcher, a failed rank waits for the launcher itself (it kills the rank then).
    linger = None
    if status is not None:
        linger = None if _fork_watcher(status) else status
        status.write(START, os.getpid(), time.time_ns(), os.getppid() if linger is None else os.getpid())
    streams = _install_prefixed_streams(f"[rank{rank}]: ")
    # Registered before the user's code runs, so it runs after the user's atexit handlers.
    atexit.register(_finish_lines, streams)
    try:
        _run_target(target)
    except SystemExit as exc:
        code = _exit_status(exc.code)
        if code != 0 and status is not None:
            _finish_lines(streams)
            status.report_failure(code, "exit")
        elif status is not None:
            status.write(FINISHED, time.time_ns())
        raise  # the interpreter exits with the code unchanged (and prints a str code)
    except KeyboardInterrupt as exc:
        _ignore_interrupts()
        if status is not None and status.has(TIMED_OUT):
            _print_exception(exc)  # where each rank was when the job ran out of time
        else:
            _print_interrupt(exc)
        if status is not None:
            _finish_lines(streams)
            status.report_failure(130, "interrupt")
        if _mpi_active() is not None:
            _end_rank(130, streams, linger)
        return 130
    except BaseException as exc:
        _ignore_interrupts()
        _print_exception(exc)
        if status is not None:
            _finish_lines(streams)
            status.report_failure(1, "exception")
        _end_rank(1, streams, linger)
    if status is not None:
        status.write(FINISHED, time.time_ns())
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python bootstrap.py SCRIPT ARGS...`` (or ``-m MODULE ARGS...``)."""
    return _rank_main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    raise SystemExit(main())
