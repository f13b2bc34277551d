"""``meshkit.spawn(fn, args, nprocs)``: torch.multiprocessing.spawn over ``meshkit-run``'s job.

``spawn(fn, args=(a, b), nprocs=4)`` runs ``fn(rank, a, b)`` in 4 new processes started the way
``meshkit-run -n 4`` starts ranks (``mpiexec`` and the rank bootstrap), so the processes are one
MPI world: ``fn`` calls ``init_process_group()`` and gets a world of 4 whose rank is ``rank``.
The job is supervised as ``meshkit-run``'s (:class:`meshkit.launch.job.Job`): output is tagged
``[rank{r}]: ``, and the first rank to fail ends the others within a second
(:data:`meshkit.launch.job.FAILURE_SETTLE_S`) instead of leaving them waiting in a collective.
The parent then raises what that rank did:

* an exception: :class:`ProcessRaisedException`, naming the rank, with the child's traceback
  in its message (the child also prints it, tagged with its rank, as it happens);
* an exit with a non-zero status (``sys.exit(3)``, ``os._exit(3)``) or death by a signal:
  :class:`ProcessExitedException` with ``exit_code`` (negative for a signal, as
  ``multiprocessing`` reports it) and ``signal_name``.

Why ``mpiexec`` rather than ``multiprocessing``: the processes must be one MPI world, which only
the MPI process manager can make (MPI has no way for N independently started processes to
become one ``COMM_WORLD``). As with torch's ``spawn`` start method, ``fn`` and ``args`` reach the
new processes by pickle, so ``fn`` must be importable by name: a function at module level (one
in the script run as ``__main__`` is found by running that script again as ``__mp_main__``, so
it needs the ``if __name__ == "__main__":`` guard, as with torch), never a lambda or a function
defined inside another.

The payload is the parent's own: written exclusively (mode 0600) into a folder of its own (mode
0700), and signed with the job's secret (:mod:`meshkit.launch.secret`): each process checks the
folder and the signature before it unpickles anything (:mod:`meshkit.launch.spawn_rank`).
"""

from __future__ import annotations

import atexit
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from typing import Any, Callable, Sequence

from .bootstrap import write_exclusive
from .cli import all_ranks_here, find_mpiexec, job_command, job_environment
from .job import Job
from .secret import SPAWN_DIGEST_ENV, job_secret, payload_digest

__all__ = ["spawn", "SpawnContext", "ProcessException", "ProcessRaisedException", "ProcessExitedException"]

#: The payload file in the spawn directory, and each failed rank's traceback beside it.
PAYLOAD, ERROR = "payload.pickle", "error"
#: The longest traceback the parent reads back from a process (the rest is cut).
_ERROR_MAX = 1 << 20
#: The module each process runs (through the rank bootstrap, as ``-m``).
RANK_MODULE = "meshkit.launch.spawn_rank"


class ProcessException(Exception):
    """A spawned process failed: ``error_index`` is its rank, ``pid`` its process id (None if unknown)."""

    def __init__(self, msg: str, error_index: int, pid: int | None) -> None:
        super().__init__(msg)
        self.msg, self.error_index, self.pid = msg, error_index, pid

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.msg, self.error_index, self.pid)


class ProcessRaisedException(ProcessException):
    """A spawned process raised an exception; the message holds its traceback (as torch's)."""


class ProcessExitedException(ProcessException):
    """A spawned process exited with a non-zero status or was killed by a signal.

    ``exit_code``: the status, or minus the signal number (as ``multiprocessing.Process.exitcode``);
    ``signal_name``: ``"SIGKILL"`` and the like for a signal, else None.
    """

    def __init__(self, msg: str, error_index: int, pid: int | None, exit_code: int,
                 signal_name: str | None = None) -> None:
        super().__init__(msg, error_index, pid)
        self.exit_code, self.signal_name = exit_code, signal_name

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.msg, self.error_index, self.pid, self.exit_code, self.signal_name)


class SpawnContext:
    """The running job of :func:`spawn` (``join=False``), as torch's ``ProcessContext``."""

    def __init__(self, job: Job, folders: list[str]) -> None:
        self._job = job
        self._folders = folders
        self._code: int | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def pids(self) -> list[int]:
        """The process ids of the ranks on this host that have started so far, by rank."""
        return [rank.pid for _, rank in sorted(self._job.ranks.items()) if rank.pid is not None]

    def _run(self) -> None:
        try:
            self._code = self._job.run()
        except BaseException as exc:  # reported by join(), in the caller's thread
            self._error = exc

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="meshkit-spawn", daemon=True)
        self._thread.start()
        # A parent leaving without join(): end the job now and remove its folders. (Without this
        # the job also ended, shortly after the parent, most likely hydra losing
        # its output pipe; but the folders stayed, and nothing promised the end.)
        atexit.register(self._end)

    def _end(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._job._send(signal.SIGKILL)  # mpiexec: its proxy kills the ranks' watchers, whose ranks follow
            self._thread.join(timeout=5)
        for folder in self._folders:
            shutil.rmtree(folder, ignore_errors=True)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the processes; True once every one exited 0, False if ``timeout`` passed first.

        Raises:
            ProcessRaisedException: a rank raised (the first to fail).
            ProcessExitedException: a rank exited non-zero or was killed by a signal.
        """
        if self._thread is None:  # join=True: run in the caller's thread (signals reach the job)
            self._run()
        else:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
        try:
            if self._error is not None:
                raise self._error
            _raise_failure(self._job, self._code, self._folders[0])
        finally:
            atexit.unregister(self._end)
            for folder in self._folders:
                shutil.rmtree(folder, ignore_errors=True)
        return True


def spawn(fn: Callable[..., Any], args: Sequence[Any] = (), nprocs: int = 1, join: bool = True,
          daemon: bool = False, start_method: str = "spawn", *, timeout: float | None = None) -> SpawnContext | None:
    """Run ``fn(rank, *args)`` in ``nprocs`` new processes that form one MPI world.

    As ``torch.multiprocessing.spawn``: with ``join=True`` it returns None once every process
    exited 0, or raises the first failure; with ``join=False`` it returns a
    :class:`SpawnContext` whose ``join()`` does that. Inside ``fn``,
    ``meshkit.init_process_group()`` gives a world of ``nprocs`` ranks, ``rank`` its own; the
    processes see ``RANK``, ``WORLD_SIZE``... as under ``meshkit-run``.

    Args:
        fn: a function importable by name (module level; see the module docstring); pickled by
            reference, with ``args``.
        args: the arguments after the rank (a tuple; picklable).
        nprocs: number of processes (>= 1).
        join: wait for the processes (True) or return a :class:`SpawnContext`.
        daemon: accepted for torch compatibility; the processes never outlive the job.
        start_method: only ``"spawn"`` (fresh interpreters: what this does); ``"fork"`` and
            ``"forkserver"`` would let ``fn`` see the parent's state, which these processes do not.
        timeout: seconds after which the whole job is ended (:class:`TimeoutError`); None: no limit.

    Raises:
        TypeError / ValueError: a bad argument, named (``fn`` not importable, ``args`` not
            picklable, ``nprocs`` not a positive int).
        ProcessRaisedException / ProcessExitedException: a process failed.
        TimeoutError: ``timeout`` passed.
        LaunchError: no ``mpiexec`` (``pip install mpich``); LaunchConfigError (a ValueError too): a
            launcher variable set but not valid (``MESHKIT_JOB_SECRET``, ``MESHKIT_MPIEXEC``).
    """
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"meshkit.spawn: nprocs must be an int >= 1, got {nprocs!r}")
    if start_method != "spawn":
        raise ValueError(f"meshkit.spawn: start_method={start_method!r} is not supported; only 'spawn': the "
                         "processes are new interpreters started by mpiexec, which do not inherit the parent's state")
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"meshkit.spawn: timeout must be seconds > 0 or None, got {timeout!r}")
    if not callable(fn):
        raise TypeError(f"meshkit.spawn: fn must be a function, got {type(fn).__name__} {fn!r}")
    try:
        args = tuple(args)
    except TypeError:
        raise TypeError(f"meshkit.spawn: args must be a tuple of fn's arguments after the rank, got "
                        f"{type(args).__name__} {args!r}") from None
    payload = _payload(fn, args)
    mpiexec = find_mpiexec()
    secret = job_secret(os.environ)
    spawn_dir = tempfile.mkdtemp(prefix="meshkit-spawn-")  # mode 0700
    status_dir = tempfile.mkdtemp(prefix="meshkit-run-")
    try:
        write_exclusive(os.path.join(spawn_dir, PAYLOAD), payload)
        command = job_command(mpiexec, nprocs, ["-m", RANK_MODULE, spawn_dir], [])
        env = job_environment(mpiexec, nprocs, status_dir, [], secret=secret)
        env[SPAWN_DIGEST_ENV] = payload_digest(secret, payload)
    except BaseException:
        shutil.rmtree(spawn_dir, ignore_errors=True)
        shutil.rmtree(status_dir, ignore_errors=True)
        raise
    job = Job(command, env, nproc=nprocs, status_dir=status_dir, timeout=timeout,
              local_only=all_ranks_here(mpiexec, [], env))
    context = SpawnContext(job, [spawn_dir, status_dir])
    if not join:
        context._start()
        return context
    context.join()
    return None


def _payload(fn: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
    """``pickle`` of what the processes need: ``fn``, ``args``, and where to find them."""
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        pickled_fn = pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(f"meshkit.spawn: fn={name!r} cannot be sent to new processes: it must be importable by name "
                        "(a function at module level, as with torch's spawn start method), not a lambda or a "
                        f"function defined inside another ({type(exc).__name__}: {exc})") from None
    try:
        pickled_args = pickle.dumps(args)
    except Exception as exc:
        raise TypeError(f"meshkit.spawn: args cannot be pickled for the new processes ({type(exc).__name__}: "
                        f"{exc})") from None
    main = sys.modules.get("__main__")
    main_name = getattr(getattr(main, "__spec__", None), "name", None)
    main_path = getattr(main, "__file__", None)
    uses_main = b"__main__" in pickled_fn + pickled_args
    if uses_main and main_name is None and main_path is None:
        raise TypeError(f"meshkit.spawn: fn={name!r} (or a type in args) is defined in __main__ of an interactive "
                        "session or `python -c`, where new processes cannot find it; define it in a module or a "
                        "script file")
    return pickle.dumps({
        "fn": pickled_fn, "args": pickled_args, "sys_path": list(sys.path), "argv": list(sys.argv),
        # As multiprocessing's spawn: the main module is run again as __mp_main__ where needed.
        "main_name": main_name if uses_main else None,
        "main_path": os.path.abspath(main_path) if uses_main and main_path else None,
    })


def _raise_failure(job: Job, code: int | None, spawn_dir: str) -> None:
    """Raise what ended the job, if it did not end well."""
    if job.timed_out:
        raise TimeoutError(f"meshkit.spawn: the {job.nproc} processes were still running after timeout="
                           f"{job.timeout:g} s; they were ended")
    if job.received == signal.SIGINT:
        raise KeyboardInterrupt
    failure = min([*job._failures(), *([job.first_failure] if job.first_failure else [])], default=None)
    if failure is None:
        if code:
            raise ProcessException(f"meshkit.spawn: the job ended with status {code} (mpiexec's; no process "
                                   "reported a failure)", -1, None)
        return
    r = failure.rank
    rank = job.ranks.get(r)
    pid = rank.pid if rank is not None else None
    try:
        with os.fdopen(os.open(os.path.join(spawn_dir, f"{ERROR}.{r}"), os.O_RDONLY | os.O_NOFOLLOW),
                       encoding="utf-8", errors="replace") as f:
            trace = f.read(_ERROR_MAX)
    except OSError:
        trace = None
    if trace is not None:
        raise ProcessRaisedException(f"\n\n-- meshkit.spawn: process {r} (rank {r}) terminated with the following "
                                     f"error:\n{trace}", r, pid)
    exit_code = rank.ended[0] if rank is not None and rank.ended is not None else failure.status
    if exit_code < 0:
        name = signal.Signals(-exit_code).name
        raise ProcessExitedException(f"meshkit.spawn: process {r} (rank {r}) terminated with signal {name}", r, pid,
                                     exit_code, name)
    raise ProcessExitedException(f"meshkit.spawn: process {r} (rank {r}) terminated with exit code {exit_code}"
                                 + ("" if failure.how.startswith("exit") else f": {failure.how}"), r, pid, exit_code)


def format_child_error(exc: BaseException, hidden: frozenset[str]) -> str:
    """The traceback of ``exc`` as Python prints it, without frames of the files in ``hidden``."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in hidden:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))
