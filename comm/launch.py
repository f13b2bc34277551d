"""``meshkit-run``: start N ranks of a script under ``mpiexec``, with rank-tagged output.

Usage::

    meshkit-run -n 4 train.py --lr 0.1          # a script, like `python train.py`
    meshkit-run -n 4 -m mypkg.train --lr 0.1    # a module, like `python -m mypkg.train`
    python -m meshkit.comm.launch -n 4 train.py  # the same without the console script

The launcher finds ``mpiexec`` (``$MESHKIT_MPIEXEC``, else the one next to ``sys.executable``
that the ``mpich`` wheel installs, else ``PATH``) and runs it as a child in its own session.
Every rank runs this module again in *rank mode*, which

* prefixes each line the rank writes to ``sys.stdout``/``sys.stderr`` with ``[rank{r}]: ``
  (as torchrun does), writing whole lines so that ranks never interleave within a line;
* turns an uncaught exception into the end of the job: the rank prints its traceback and
  exits at once without finalizing MPI, and ``mpiexec`` ends the other ranks. A crashed rank
  never leaves the others waiting in a collective.

The launcher forwards SIGINT/SIGTERM/SIGHUP to the whole job, and SIGKILLs it if it is still
running 5 s after the first signal, after the first rank failure, or after ``--timeout``.
Its exit status is the job's: the script's own exit code (``sys.exit(3)`` on every rank gives
3), 130 after Ctrl-C, 124 after ``--timeout``.

Ranks see ``MESHKIT_LAUNCHED=1`` and ``MESHKIT_WORLD_SIZE=N`` in their environment. Only output
written through Python's ``sys.stdout``/``sys.stderr`` is prefixed; output of C libraries and
subprocesses that write to the file descriptors directly passes through untouched.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import re
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import NoReturn, TextIO

__all__ = ["main"]

logger = logging.getLogger("meshkit.launch")

#: The rank is read from the first of these that is set: MPICH/hydra, Open MPI, PMIx, Slurm.
#: Reading the environment keeps the bootstrap from importing mpi4py (and initializing MPI)
#: in ranks that never use it.
RANK_ENV_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")

#: How long the job may keep running after the first Ctrl-C/SIGTERM, rank failure or timeout
#: before the launcher SIGKILLs its process group. MPICH's hydra ends a job within ~0.1 s of
#: a rank's MPI_Abort or unclean exit (measured with the mpich 5.0 wheel), gforker within
#: ~3 s; 5 s only matters for a process manager that does not tear the job down itself.
KILL_GRACE_S = 5.0

#: Exit status after --timeout, as coreutils' `timeout`.
TIMEOUT_EXIT_CODE = 124

_RANK_MAIN_FLAG = "--_rank-main"  # internal: how the launcher starts each rank; not in --help
_STATUS_DIR_ENV = "MESHKIT_LAUNCH_STATUS_DIR"  # internal: where ranks report a failure
_POLL_S = 0.05
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Launcher options that take a value; the first other bare word is the script.
_VALUE_OPTIONS = ("-n", "--nproc", "--mpiexec-args", "--timeout")
# Frames of the rank bootstrap, hidden from the user's tracebacks (runpy is frozen in 3.11+).
_BOOTSTRAP_FILES = frozenset({__file__, runpy.__file__, "<frozen runpy>"})
# A line ends at "\n", "\r\n" or a lone "\r" (progress bars redraw a line with "\r").
_LINE_END = re.compile(r"\r\n|\r(?!$)|\n")


class LaunchError(RuntimeError):
    """The launcher cannot start the job (no mpiexec, or it failed to start)."""


# --------------------------------------------------------------------------------------------
# Rank side
# --------------------------------------------------------------------------------------------


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
                out.append(self._prefix + data[start : match.end()])
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


def _report_failure(rank: int, status: int) -> None:
    """Tell a launcher on this host that this rank failed, so that it can end the job."""
    status_dir = os.environ.get(_STATUS_DIR_ENV)
    if not status_dir or not os.path.isdir(status_dir):  # absent on other hosts: fine
        return
    path = os.path.join(status_dir, f"rank{rank}")
    try:
        with open(f"{path}.tmp", "w", encoding="ascii") as f:
            f.write(str(status))
        os.replace(f"{path}.tmp", path)  # the launcher never reads a half-written file
    except OSError:
        pass


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


def _end_rank(status: int, streams: list[_PrefixedStream]) -> NoReturn:
    """Exit this rank at once with ``status``, without MPI_Finalize, so the job ends.

    Not MPI_Abort: hydra tears the job down on an abort before its proxy has forwarded the
    rank's last output, and a traceback lost its final lines that way under load. An exit
    without MPI_Finalize ends the job as fast (~0.1 s, measured with the mpich 5.0 wheel; Open
    MPI's mpirun and Slurm's srun --kill-on-bad-exit do the same), and the proxy reads the
    rank's pipes to the end first. Skipping MPI_Finalize matters: it waits for the other ranks,
    which may never arrive. The launcher kills a job still running 5 s later regardless.
    """
    _finish_lines(streams)
    os._exit(status)


def _ignore_interrupts() -> None:
    """Ignore further SIGINTs while this rank reports its failure and exits.

    A Ctrl-C reaches a rank twice (the launcher signals the job's process group and
    mpiexec forwards it too); a second KeyboardInterrupt must not cut the exit path short
    and leave the rank in MPI_Finalize.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_target(target: list[str]) -> None:
    if target[0] == "-m":
        module, args = target[1], target[2:]
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, args = target[0], target[1:]
        sys.argv = [script, *args]
        # As `python script.py`: the script's directory comes first on sys.path.
        sys.path[0] = os.path.dirname(os.path.realpath(script))
        runpy.run_path(script, run_name="__main__")


def _rank_main(target: list[str]) -> int:
    """Run ``target`` (``[script, *args]`` or ``["-m", module, *args]``) as one rank."""
    if not target or target == ["-m"]:
        raise ValueError(f"meshkit-run: rank bootstrap needs a script or -m MODULE, got {target}")
    rank = _rank_from_env()
    streams = _install_prefixed_streams(f"[rank{rank}]: ")
    # Registered before the user's code runs, so it runs after the user's atexit handlers.
    atexit.register(_finish_lines, streams)
    try:
        _run_target(target)
    except SystemExit as exc:
        status = _exit_status(exc.code)
        if status != 0:
            _report_failure(rank, status)
        raise  # the interpreter exits with the code unchanged (and prints a str code)
    except KeyboardInterrupt as exc:
        _ignore_interrupts()
        _print_exception(exc)
        _report_failure(rank, 130)
        if _mpi_active() is not None:
            _end_rank(130, streams)
        return 130
    except BaseException as exc:
        _ignore_interrupts()
        _print_exception(exc)
        _report_failure(rank, 1)
        _end_rank(1, streams)
    return 0


# --------------------------------------------------------------------------------------------
# Launcher side
# --------------------------------------------------------------------------------------------


def find_mpiexec() -> list[str]:
    """The command that starts MPI jobs, as a list (it may carry extra arguments).

    Looks at ``$MESHKIT_MPIEXEC`` (split like a shell would), then the ``mpiexec`` next to
    ``sys.executable`` (where the ``mpich`` wheel installs it in a virtual environment),
    then ``PATH``.

    Raises:
        LaunchError: no mpiexec was found.
    """
    from_env = os.environ.get("MESHKIT_MPIEXEC", "").strip()
    if from_env:
        return shlex.split(from_env)
    # Not resolved: in a venv sys.executable is a link into the base Python's bin directory.
    beside_python = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.isfile(beside_python) and os.access(beside_python, os.X_OK):
        return [beside_python]
    on_path = shutil.which("mpiexec")
    if on_path:
        return [on_path]
    raise LaunchError(
        "no mpiexec found (looked at $MESHKIT_MPIEXEC, next to "
        f"{sys.executable} and on PATH). Install one with `pip install mpich`, or set "
        "MESHKIT_MPIEXEC to your MPI's launcher, e.g. MESHKIT_MPIEXEC='srun --mpi=pmix'"
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text}")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshkit-run",
        usage="%(prog)s -n N [options] (script.py | -m module) [args ...]",
        description="Start N ranks of a Python script under mpiexec, each line of output "
        "tagged with its rank. An uncaught exception on any rank ends the whole job.",
        epilog="mpiexec is taken from $MESHKIT_MPIEXEC, else next to the Python "
        "interpreter (`pip install mpich`), else PATH.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "-n", "--nproc", type=_positive_int, required=True, metavar="N",
        help="number of ranks to start (>= 1)",
    )  # fmt: skip
    parser.add_argument(
        "--mpiexec-args", default="", metavar="ARGS",
        help='extra arguments for mpiexec, as one shell-quoted string, e.g. "-ppn 2"',
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=_positive_float, metavar="SECONDS",
        help=f"end the whole job after SECONDS and exit {TIMEOUT_EXIT_CODE}",
    )  # fmt: skip
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log the mpiexec command and teardown",
    )  # fmt: skip
    parser.add_argument(
        "-m", dest="module", metavar="MODULE",
        help="run a module as a script, like `python -m` (ends the option list)",
    )  # fmt: skip
    parser.add_argument("script", nargs="?", help="the script each rank runs")
    parser.add_argument("args", nargs="*", help="arguments passed to the script or module")
    return parser


def _split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split ``argv`` into the launcher's options and the target (script or -m and its args).

    As with ``python``, everything after the script or ``-m MODULE`` belongs to the target,
    even words that look like launcher options. Long options and their values are joined
    (``--timeout=5``) so that argparse accepts values starting with "-".
    """
    options: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return options, argv[i + 1 :]
        if word == "-m":
            return options, argv[i:]
        if word.startswith("-m"):  # -mpkg.mod
            return options, ["-m", word[2:], *argv[i + 1 :]]
        if word in _VALUE_OPTIONS and i + 1 < len(argv):
            value = argv[i + 1]
            options += [f"{word}={value}"] if word.startswith("--") else [word, value]
            i += 2
            continue
        if word.startswith("-"):
            options.append(word)
            i += 1
            continue
        return options, argv[i:]
    return options, []


def _parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = _build_parser()
    options, target = _split_argv(argv)
    if target[:1] == ["-m"]:
        if len(target) < 2:
            parser.error("argument -m: expected a module name")
        opts = parser.parse_args([*options, "-m", target[1]])
    elif target:
        opts = parser.parse_args([*options, "--", target[0]])
    else:
        opts = parser.parse_args(options)
        parser.error("no script given: pass a script path or -m MODULE")
    if opts.module is None and not os.path.exists(target[0]):
        parser.error(f"script not found: {target[0]!r} (relative to {os.getcwd()})")
    return opts, target


@dataclass
class _Job:
    """The running mpiexec child and what the launcher has done to it so far."""

    timeout: float | None
    status_dir: str
    proc: subprocess.Popen[bytes] | None = None
    started: float = field(default_factory=time.monotonic)
    received: int | None = None  # first SIGINT/SIGTERM/SIGHUP the launcher received
    timed_out: bool = False
    failure: tuple[int, int] | None = None  # (rank, exit status) of the first failed rank
    kill_at: float = float("inf")
    killed: bool = False

    def send(self, sig: int) -> None:
        """Send ``sig`` to mpiexec's process group (mpiexec and the ranks it forked)."""
        if self.proc is None or self.proc.returncode is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def on_signal(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signum
            self.kill_at = min(self.kill_at, time.monotonic() + KILL_GRACE_S)
            logger.debug("received %s; forwarding it to the job", signal.Signals(signum).name)
        self.send(signum)

    def read_failure(self) -> tuple[int, int] | None:
        """The first rank failure reported in the status directory, if any."""
        try:
            names = [n for n in os.listdir(self.status_dir) if re.fullmatch(r"rank\d+", n)]
        except OSError:
            return None
        reports = []
        for name in names:
            path = os.path.join(self.status_dir, name)
            try:
                with open(path, encoding="ascii") as f:
                    status = int(f.read())
                reports.append((os.stat(path).st_mtime_ns, int(name[4:]), status))
            except (OSError, ValueError):
                continue
        return min(reports)[1:] if reports else None

    def supervise(self) -> int:
        """Wait for mpiexec, enforcing the timeout and the kill grace; its return code."""
        assert self.proc is not None
        deadline = self.started + self.timeout if self.timeout is not None else float("inf")
        while True:
            try:
                return self.proc.wait(timeout=_POLL_S)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if self.failure is None:
                self.failure = self.read_failure()
                if self.failure is not None:
                    logger.debug("rank %d failed with exit status %d", *self.failure)
                    self.kill_at = min(self.kill_at, now + KILL_GRACE_S)
            if now >= deadline and not self.timed_out:
                self.timed_out = True
                logger.error("job exceeded --timeout %g s", self.timeout)
                # SIGINT rather than SIGTERM: ranks in Python code print where they were.
                self.send(signal.SIGINT)
                self.kill_at = min(self.kill_at, now + KILL_GRACE_S)
            if now >= self.kill_at and not self.killed:
                self.killed = True
                logger.error("%s; killing the job", self._kill_reason())
                self.send(signal.SIGKILL)

    def _kill_reason(self) -> str:
        if self.timed_out:
            return f"job still running {KILL_GRACE_S:g} s after --timeout"
        if self.received is not None:
            name = signal.Signals(self.received).name
            return f"job still running {KILL_GRACE_S:g} s after {name}"
        assert self.failure is not None
        rank, status = self.failure
        return f"job still running {KILL_GRACE_S:g} s after rank {rank} failed (exit {status})"

    def exit_code(self, returncode: int) -> int:
        """The launcher's exit code for mpiexec's ``returncode``."""
        if self.timed_out:
            return TIMEOUT_EXIT_CODE
        if self.received is not None:
            return 128 + self.received  # 130 for Ctrl-C, as a shell reports it
        if self.failure is None:
            self.failure = self.read_failure()
        if self.failure is not None and (self.killed or returncode == 0):
            return self.failure[1] or 1
        if returncode < 0:  # mpiexec itself died of a signal
            return 128 - returncode
        return returncode


def _launch(opts: argparse.Namespace, target: list[str]) -> int:
    command = [
        *find_mpiexec(),
        "-n", str(opts.nproc),
        *shlex.split(opts.mpiexec_args),
        sys.executable, "-u", "-m", "meshkit.comm.launch", _RANK_MAIN_FLAG, *target,
    ]  # fmt: skip
    status_dir = tempfile.mkdtemp(prefix="meshkit-run-")
    env = dict(os.environ)
    env.update(
        MESHKIT_LAUNCHED="1",
        MESHKIT_WORLD_SIZE=str(opts.nproc),
        **{_STATUS_DIR_ENV: status_dir},
    )
    job = _Job(timeout=opts.timeout, status_dir=status_dir)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in _FORWARDED_SIGNALS:
            previous[sig] = signal.signal(sig, job.on_signal)
    try:
        logger.debug("running %s", shlex.join(command))
        try:
            job.proc = subprocess.Popen(command, env=env, start_new_session=True)
        except OSError as exc:
            raise LaunchError(f"could not start {command[0]!r}: {exc}") from exc
        if job.received is not None:  # arrived while the child was being started
            job.send(job.received)
        return job.exit_code(job.supervise())
    finally:
        if job.proc is not None and job.proc.poll() is None:  # e.g. an error in the launcher
            job.send(signal.SIGKILL)
            job.proc.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(status_dir, ignore_errors=True)


def _configure_logging(verbose: bool) -> None:
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("meshkit-run: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``meshkit-run``; returns the exit code.

    Args:
        argv: the command line without the program name; ``sys.argv[1:]`` when None.

    Returns:
        The job's exit code: the script's own (as mpiexec reports it), 128 + the signal
        number after a forwarded signal (130 for Ctrl-C), 124 after ``--timeout``, 1 when
        mpiexec cannot be started, 2 for a bad command line.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [_RANK_MAIN_FLAG]:
        return _rank_main(argv[1:])
    opts, target = _parse_args(argv)
    _configure_logging(opts.verbose)
    try:
        return _launch(opts, target)
    except LaunchError as exc:
        logger.error("%s", exc)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
