"""``meshkit-run``: start N ranks of a script under ``mpiexec``, with rank-tagged output.

Usage::

    meshkit-run -n 4 train.py --lr 0.1          # a script, like `python train.py`
    meshkit-run -n 4 -m mypkg.train --lr 0.1    # a module, like `python -m mypkg.train`
    python -m meshkit.launch -n 4 train.py       # the same without the console script

The launcher finds ``mpiexec`` (``$MESHKIT_MPIEXEC``, else the one next to ``sys.executable``
that the ``mpich`` wheel installs, else ``PATH``) and runs it as a child in its own session.
Every rank runs :mod:`meshkit.launch.bootstrap` (by path, so nothing of meshkit or NumPy is
imported before the script), which prefixes its output with ``[rank{r}]: `` and turns an
uncaught exception into the end of the whole job. Unless already set, ``OMP_NUM_THREADS``,
``OPENBLAS_NUM_THREADS`` and ``MKL_NUM_THREADS`` are set to the cores divided among the ranks,
and an MPICH found beside ``mpiexec`` gets its nonblocking all_reduce selection retuned (see
:mod:`meshkit.launch.mpich_tuning`; ``MESHKIT_MPICH_TUNING=0`` turns that off).

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
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from . import bootstrap
from .bootstrap import STATUS_DIR_ENV
from .mpich_tuning import tuned_environment

__all__ = ["main", "find_mpiexec", "thread_limits", "LaunchError", "KILL_GRACE_S", "TIMEOUT_EXIT_CODE",
           "THREAD_ENV_VARS"]

logger = logging.getLogger("meshkit.launch")


#: How long the job may keep running after the first Ctrl-C/SIGTERM, rank failure or timeout
#: before the launcher SIGKILLs its process group. MPICH's hydra ends a job within ~0.1 s of
#: a rank's MPI_Abort or unclean exit (measured with the mpich 5.0 wheel), gforker within
#: ~3 s; 5 s only matters for a process manager that does not tear the job down itself.
KILL_GRACE_S = 5.0

#: Exit status after --timeout, as coreutils' `timeout`.
TIMEOUT_EXIT_CODE = 124

_POLL_S = 0.05
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Launcher options that take a value; the first other bare word is the script.
_VALUE_OPTIONS = ("-n", "--nproc", "--mpiexec-args", "--timeout")


class LaunchError(RuntimeError):
    """The launcher cannot start the job (no mpiexec, or it failed to start)."""


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


#: Thread-pool variables of the BLAS and OpenMP runtimes NumPy may use.
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def thread_limits(nproc: int, env: dict[str, str]) -> dict[str, str]:
    """Thread counts for the ranks: the cores divided among them, unless the user set them.

    Every rank's BLAS otherwise starts one thread per core: N ranks on C cores then run N x C
    threads, and a matmul became 10-25x slower at 4 ranks on 2 cores (measured on this
    project's CI machines). torchrun likewise sets OMP_NUM_THREADS=1 for several ranks.
    """
    threads = str(max(1, (os.cpu_count() or 1) // nproc))
    return {var: threads for var in THREAD_ENV_VARS if var not in env}


def _launch(opts: argparse.Namespace, target: list[str]) -> int:
    command = [
        *find_mpiexec(),
        "-n", str(opts.nproc),
        *shlex.split(opts.mpiexec_args),
        # By path, not -m: importing the meshkit package would import NumPy before the user's
        # script could configure it (thread counts, devices). The bootstrap needs only stdlib.
        sys.executable, "-u", bootstrap.__file__, *target,
    ]  # fmt: skip
    status_dir = tempfile.mkdtemp(prefix="meshkit-run-")
    env = dict(os.environ)
    env.update(
        MESHKIT_LAUNCHED="1",
        MESHKIT_WORLD_SIZE=str(opts.nproc),
        **{STATUS_DIR_ENV: status_dir},
    )
    env.update(thread_limits(opts.nproc, env))
    env.update(tuned_environment(command[0], status_dir, env))
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
    opts, target = _parse_args(argv)
    _configure_logging(opts.verbose)
    try:
        return _launch(opts, target)
    except LaunchError as exc:
        logger.error("%s", exc)
        return 1

