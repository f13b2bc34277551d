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
  launcher alone decides when the job ends (see :mod:`meshkit.launch.job`);
* on the launcher's host, ends with the launcher, however it dies (SIGKILL included): the
  watcher holds a pidfd of the launcher (checked against its start time,
  :data:`LAUNCHER_START_ENV`, so a reused pid is never taken for it) and, the moment it dies,
  SIGKILLs its rank's process group (the rank and its children), removes the MPICH
  shared-memory files of the job (:func:`shm_files`) and, the last of the watchers, the status
  directory, then exits; ``mpiexec`` and its proxy end with their processes. A rank that found
  no launcher (it died while ``mpiexec`` was starting the ranks) never runs its script, and a
  rank without a watcher (no fork) watches the launcher from a thread of its own.

The ranks and the launcher talk through a status directory (``$MESHKIT_LAUNCH_STATUS_DIR``),
one small file per event, each written whole (``os.replace``):

=================  ======================================  ====================
file               contents                                written by
=================  ======================================  ====================
``start.{r}``      the rank's pid, time in ns, the         rank, at start
                   watcher's pid (its own without one)
``failed.{r}``     status, how (exception, exit,           rank, before it exits
                   interrupt, timeout, hung), time in      (``hung``: its watchdog,
                   ns; a timeout's ranks not arrived       meshkit.comm.watchdog)
``ended.{r}``      exit code (negative: killed by that     watcher, when the rank
                   signal), time in ns                     process has ended
``milestone-{m}.{r}`` time in ns                            rank, when it passed
                                                           milestone ``m`` (rendezvous,
                                                           restored, first_step: see
                                                           :mod:`meshkit.comm.milestones`)
``release``        (empty)                                 launcher: watchers may exit
``timed-out``      (empty)                                 launcher, before ending a
                                                           job at ``--timeout``
``shm``            ``NAME DEV INODE`` per line: MPICH      launcher, as it finds them
                   files the ranks hold (:func:`shm_files`)
``gone.{r}``       (empty)                                 watcher, after the launcher
                                                           died and its rank was killed
=================  ======================================  ====================

These names, and the environment variables, are :mod:`meshkit.launch_protocol`'s, loaded by path
(the one module besides the standard library the bootstrap reads). The directory is the
launcher's ``mkdtemp`` (mode 0700); every file in it is created
exclusively (``O_EXCL | O_NOFOLLOW``, mode 0600) and the launcher parses them as integers and
known words only.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import os
import re
import runpy
import select
import shutil
import signal
import stat
import sys
import threading
import time
from types import ModuleType, TracebackType
from typing import NoReturn, TextIO

__all__ = [
    "RANK_ENV_VARS", "TORCHRUN_ENV_VARS", "STATUS_DIR_ENV", "LAUNCHER_ENV", "LAUNCHER_START_ENV", "START", "FAILED",
    "ENDED", "RELEASE", "TIMED_OUT", "FINISHED", "MILESTONE", "SHM_RECORD", "GONE", "SIMULATED_NODES_ENV",
    "HOST_NAME_ENV", "SHM_DIR", "DEPART_WAIT_S",
    "launcher_host", "process_start_time", "shm_files", "remove_shm", "format_shm_record", "read_shm_record",
    "write_exclusive", "replace_whole", "read_small", "not_private",
    "set_torchrun_env", "set_simulated_node", "simulated_host", "main",
]


def _load_protocol() -> ModuleType:
    """:mod:`meshkit.launch_protocol`, the names the launcher and the ranks share.

    Imported as ``meshkit.launch.bootstrap`` (the launcher's side), the package's module. Run by
    path (a rank), the same file, loaded by path under a private name: importing ``meshkit``
    would import NumPy before the user's script. It imports only the standard library.
    """
    if __package__:
        return importlib.import_module("..launch_protocol", __package__)
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch_protocol", "__init__.py")
    spec = importlib.util.spec_from_file_location("_meshkit_launch_protocol", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"meshkit-run: the launch protocol module {path!r} cannot be loaded")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PROTOCOL = _load_protocol()
# The protocol's names this module and the launcher use (meshkit.launch_protocol documents each).
STATUS_DIR_ENV, LAUNCHER_ENV, LAUNCHER_START_ENV = (PROTOCOL.STATUS_DIR_ENV, PROTOCOL.LAUNCHER_ENV,
                                                    PROTOCOL.LAUNCHER_START_ENV)
SIMULATED_NODES_ENV, HOST_NAME_ENV, SURVIVE_ENV = (PROTOCOL.SIMULATED_NODES_ENV, PROTOCOL.HOST_NAME_ENV,
                                                   PROTOCOL.SURVIVE_ENV)
START, FAILED, ENDED, RELEASE, TIMED_OUT = PROTOCOL.START, PROTOCOL.FAILED, PROTOCOL.ENDED, PROTOCOL.RELEASE, \
    PROTOCOL.TIMED_OUT
FINISHED, MILESTONE, SHM_RECORD, GONE = PROTOCOL.FINISHED, PROTOCOL.MILESTONE, PROTOCOL.SHM_RECORD, PROTOCOL.GONE

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
    "WORLD_SIZE": ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", PROTOCOL.WORLD_SIZE_ENV),
    "LOCAL_RANK": ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"),
    "LOCAL_WORLD_SIZE": ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"),
}

#: Where POSIX shared memory lives on Linux (``shm_open``).
SHM_DIR = "/dev/shm"
#: MPICH's shared-memory files: ``mpich_shm_{world}_{node}`` (its intranode channel, created in
#: MPI_Init by the first local rank, held open and mapped by every local rank, unlinked by
#: MPI_Finalize; a job that dies leaves it, 2-4 MB for 2-4 ranks with the mpich 5.0.2 wheel) and
#: ``mpich_vci_{world}_{node}`` (with several VCIs). ``world`` hashes the process manager's job
#: name, so a later job may reuse a name: files are matched by device and inode, not by name alone.
#: meshkit's own segments (comm/engines/shm_segment.py): ``meshkit-shm-`` and 32 hex digits, unlinked
#: by the group once every rank mapped it, so only a job killed while creating a group leaves one.
_MPICH_SHM = re.compile(r"mpich_[A-Za-z0-9_]+|meshkit-shm-[0-9a-f]{32}")
#: After the launcher died, how long a watcher waits for the other watchers of this host to kill
#: their ranks before it exits: its exit makes hydra SIGKILL the other watchers (their ranks die
#: with them, by PR_SET_PDEATHSIG, but not the ranks' children), so none exits before all are
#: done. They all see the death at once through their pidfds: a few ms; the bound is for a
#: watcher that was itself killed.
DEPART_WAIT_S = 2.0
#: A status file is a few numbers: more than this is not one of ours.
_STATUS_FILE_MAX = 4096
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
#: How often a watcher looks for its launcher where Linux gives no pidfd (before 5.3).
_LAUNCHER_POLL_S = 0.25
#: How often a watcher reads which MPICH shared-memory files its running rank holds: until it holds
#: some (MPI_Init creates them), then every :data:`_SHM_RESCAN_S`. Read while the rank runs, so that
#: a rank that dies before its watcher learns of the launcher's death (hydra's SIGTERM, forwarded
#: when mpiexec dies with the launcher) still has its files removed: a dead process holds no fds.
#: A look is a listing of ``/proc/PID/fd`` (tens of microseconds); a rank that holds none after
#: :data:`_SHM_FAST_FOR_S` (no MPI, or one rank alone) is looked at every :data:`_SHM_RESCAN_S` only.
_SHM_SCAN_S = 0.05
_SHM_RESCAN_S = 1.0
_SHM_FAST_FOR_S = 10.0
_EXCLUSIVE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def launcher_host() -> str:
    """This host's name as ranks and launcher compare it (``os.uname().nodename``)."""
    return os.uname().nodename


def process_start_time(pid: int | str = "self") -> str | None:
    """Field 22 of ``/proc/PID/stat``: when the process started, in clock ticks since boot (None
    where there is no /proc). With the pid, it names one process for as long as the host runs."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2:].split()  # the command name may hold spaces and ")"
    return fields[19].decode("ascii", "replace") if len(fields) > 19 else None


def not_private(info: os.stat_result, *, directory: bool) -> str | None:
    """Why what ``os.lstat`` described is not this user's own private file (``directory``: folder),
    or None: a symbolic link, another type, another owner, or open to other users."""
    kind = "directory" if directory else "regular file"
    if stat.S_ISLNK(info.st_mode):
        return "a symbolic link"
    if not (stat.S_ISDIR(info.st_mode) if directory else stat.S_ISREG(info.st_mode)):
        return f"not a {kind}"
    if info.st_uid != os.getuid():
        return f"owned by uid {info.st_uid}, not by this user (uid {os.getuid()})"
    if stat.S_IMODE(info.st_mode) & 0o077:
        return f"mode {stat.S_IMODE(info.st_mode):o}, open to other users"
    return None


def write_exclusive(path: str, data: bytes) -> None:
    """Create ``path`` with ``data``, exclusively (``O_EXCL | O_NOFOLLOW``) and mode 0600.

    Raises:
        OSError: it exists (FileExistsError), is a symbolic link, or cannot be written.
    """
    fd = os.open(path, _EXCLUSIVE, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def replace_whole(path: str, data: bytes) -> None:
    """Write ``path`` whole (a reader never sees half of it): an exclusive temporary, renamed."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        write_exclusive(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_small(path: str) -> str:
    """The text of a status file the job wrote: a regular file, not a link, at most
    :data:`_STATUS_FILE_MAX` bytes of ASCII. Raises OSError or ValueError otherwise."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file")
        data = os.read(fd, _STATUS_FILE_MAX + 1)
    finally:
        os.close(fd)
    if len(data) > _STATUS_FILE_MAX:
        raise ValueError(f"{path} is larger than a status file")
    return data.decode("ascii")


# --------------------------------------------------------------------------------------------
# MPICH's shared memory
# --------------------------------------------------------------------------------------------


def shm_files(pid: int) -> dict[str, tuple[int, int]]:
    """MPICH's shared-memory files that process ``pid`` holds open: ``{name: (st_dev, st_ino)}``.

    Read from ``/proc/PID/fd`` (the same user's processes only). Every local rank of a job holds
    its job's files open from MPI_Init to MPI_Finalize, so the files a rank holds are that job's
    and no other's: a name alone would not do, since another job of the same user may be using
    ``/dev/shm`` too, and names are hashes that a later job may repeat. The caller makes sure
    ``pid`` is still its process (a pidfd not yet readable after the call).
    """
    found: dict[str, tuple[int, int]] = {}
    folder = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(folder)
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"{folder}/{fd}")
        except OSError:
            continue
        where, _, name = target.rpartition("/")
        if where != SHM_DIR or not _MPICH_SHM.fullmatch(name):  # " (deleted)": already unlinked
            continue
        try:
            info = os.stat(f"{folder}/{fd}")
        except OSError:
            continue
        found[name] = (info.st_dev, info.st_ino)
    return found


def remove_shm(files: dict[str, tuple[int, int]]) -> list[str]:
    """Unlink those of ``files`` (from :func:`shm_files`) still in :data:`SHM_DIR` as the same
    file (device and inode), owned by this user; the names removed."""
    removed = []
    for name, (dev, ino) in files.items():
        if not _MPICH_SHM.fullmatch(name):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode) and (info.st_dev, info.st_ino) == (dev, ino) and info.st_uid == os.getuid():
                os.unlink(path)
                removed.append(name)
        except OSError:  # gone already (MPI_Finalize, another watcher), or not ours
            pass
    return removed


def format_shm_record(files: dict[str, tuple[int, int]]) -> bytes:
    """The :data:`SHM_RECORD` file's contents."""
    return "".join(f"{name} {dev} {ino}\n" for name, (dev, ino) in sorted(files.items())).encode("ascii")


def read_shm_record(path: str) -> dict[str, tuple[int, int]]:
    """Parse a :data:`SHM_RECORD` file (lines that are not ``NAME DEV INODE`` are skipped); {} if unreadable."""
    try:
        text = read_small(path)
    except (OSError, ValueError):
        return {}
    files = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and _MPICH_SHM.fullmatch(parts[0]) and parts[1].isdigit() and parts[2].isdigit():
            files[parts[0]] = (int(parts[1]), int(parts[2]))
    return files


# --------------------------------------------------------------------------------------------
# The launcher, as its ranks see it
# --------------------------------------------------------------------------------------------


class _Launcher:
    """The launcher process, watched through a pidfd (Linux 5.3+; else polled).

    Opened once, then checked against the start time the launcher announced: a pidfd names one
    process for good, so a launcher that dies later is seen dead even if its pid is reused.
    """

    def __init__(self, pid: int, start: str | None) -> None:
        self.pid, self.start = pid, start
        self.fd: int | None = None
        self.dead = False
        try:
            self.fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.dead = True
        except (AttributeError, OSError):  # no pidfds: polled by pid and start time
            pass
        # After the pidfd is open: the process it names is the one that had the pid when the
        # start time was read, so a match means the pidfd is the launcher's.
        if not self.dead and start and process_start_time(pid) not in (start, None):
            self.dead = True

    def alive(self) -> bool:
        if self.dead:
            return False
        if self.fd is not None:
            self.dead = bool(select.select([self.fd], [], [], 0)[0])
        else:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.dead = True
            except PermissionError:
                pass
            if not self.dead and self.start and process_start_time(self.pid) not in (self.start, None):
                self.dead = True
        return not self.dead

    def wait(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (None: for ever) for the launcher to die; whether it did."""
        if self.dead:
            return True
        if self.fd is not None:
            select.select([self.fd], [], [], timeout)
        else:
            deadline = None if timeout is None else time.monotonic() + timeout
            while self.alive() and (deadline is None or time.monotonic() < deadline):
                time.sleep(_LAUNCHER_POLL_S if deadline is None else
                           max(0.0, min(_LAUNCHER_POLL_S, deadline - time.monotonic())))
        return not self.alive()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _ranks_with(kind: str, names: list[str]) -> set[str]:
    """The ranks that have a ``{kind}.{rank}`` file among ``names``."""
    return {name[len(kind) + 1:] for name in names if name.startswith(f"{kind}.") and name[len(kind) + 1:].isdigit()}


class _StatusDir:
    """This rank's side of the status directory; None-safe construction via :meth:`from_env`."""

    def __init__(self, path: str, launcher_pid: int, rank: int, launcher_start: str | None = None) -> None:
        self.path = path
        self.launcher_pid = launcher_pid
        self.rank = rank
        self.launcher = _Launcher(launcher_pid, launcher_start)

    @classmethod
    def from_env(cls, rank: int) -> _StatusDir | None:
        """The launcher's status directory, if the launcher runs on this host; else None.

        Raises:
            PermissionError: the directory named is not the launcher's (not a directory of this
                user's, or open to others): a rank reports into nothing it cannot trust.
        """
        path = os.environ.get(STATUS_DIR_ENV, "")
        host, _, pid = os.environ.get(LAUNCHER_ENV, "").rpartition(" ")
        if not path or host != launcher_host() or not pid.isdigit():
            return None
        try:
            info = os.lstat(path)
        except FileNotFoundError:  # the launcher is gone, or ending: see the caller
            info = None
        problem = None if info is None else not_private(info, directory=True)
        if problem is not None:
            raise PermissionError(f"meshkit-run: rank {rank}: {STATUS_DIR_ENV}={path!r} is not the launcher's status "
                                  f"directory: it is {problem}; refusing to start")
        return cls(path, int(pid), rank, os.environ.get(LAUNCHER_START_ENV) or None)

    def write(self, name: str, *fields: object) -> None:
        """Write ``{name}.{rank}`` whole: the launcher never reads a half-written file."""
        try:
            replace_whole(os.path.join(self.path, f"{name}.{self.rank}"),
                           " ".join(str(field) for field in fields).encode("ascii"))
        except OSError:  # the launcher is gone and took its folder along: nobody to tell
            pass

    def report_failure(self, status: int, how: str, *ranks: int) -> None:
        """``failed.{rank}``: the status, how (exception, exit, interrupt, timeout), the time in ns
        and, for a timeout, the ranks it named as not arrived."""
        self.write(FAILED, status, how, time.time_ns(), *ranks)

    def has(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.path, name))

    def launcher_alive(self) -> bool:
        return os.path.isdir(self.path) and self.launcher.alive()  # it removes the folder as it exits

    def wait_for_release(self) -> bool:
        """Return once the launcher has written ``release`` (True), or is gone (False)."""
        polls = 0
        while not self.has(RELEASE):
            polls += 1
            if self.launcher.wait(_RELEASE_POLL_S) or polls % 25 == 0 and not os.path.isdir(self.path):
                return False
        return True

    def depart(self, files: dict[str, tuple[int, int]], *, wait: bool = True) -> None:
        """After the launcher died: remove the shared memory the rank held (``files``) and what the
        launcher recorded, say so (``gone.{rank}``), and let the last of the ranks remove the
        directory. With ``wait`` (a watcher, its rank killed), wait until every rank that started
        is gone (at most :data:`DEPART_WAIT_S`), so that no watcher's exit makes hydra kill
        another mid-way; the last one to arrive removes the directory."""
        remove_shm(files)
        remove_shm(read_shm_record(os.path.join(self.path, SHM_RECORD)))
        self.write(GONE)
        deadline = time.monotonic() + (DEPART_WAIT_S if wait else 0.0)
        while True:
            try:
                names = os.listdir(self.path)
            except OSError:  # another watcher removed it
                return
            if _ranks_with(START, names) <= _ranks_with(GONE, names):
                break
            if time.monotonic() >= deadline:
                if not wait:
                    return  # another rank is still on its way: the last one removes it
                break
            time.sleep(_RELEASE_POLL_S / 2)
        self.remove()

    def remove(self) -> None:
        """Remove the directory (the launcher is gone), if it is still the one this rank checked."""
        try:
            info = os.lstat(self.path)
        except OSError:
            return
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            shutil.rmtree(self.path, ignore_errors=True)


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


#: The class of meshkit's collective timeouts, by module and name: the bootstrap imports nothing of meshkit.
_TIMEOUT_CLASS = ("meshkit.comm.errors", "CollectiveTimeout")
_RANK_FAILED_CLASS = ("meshkit.comm.errors", "RankFailedError")


def _timed_out(exc: BaseException) -> list[int] | None:
    """If ``exc`` is (or was raised from) a collective timeout: the global ranks it named as not
    arrived (empty: the engine could not tell); else None."""
    seen = 0
    while exc is not None and seen < 8:
        if (type(exc).__module__, type(exc).__name__) == _TIMEOUT_CLASS:
            missing = getattr(exc, "missing", None)
            return [int(r) for r in missing if isinstance(r, int)] if isinstance(missing, (list, tuple)) else []
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _peers_failed(exc: BaseException) -> list[int] | None:
    """If ``exc`` is (or was raised from) a :class:`RankFailedError` naming dead ranks: their global
    ranks (a survivor that found a peer dead may report before the launcher sees the death); else None."""
    seen = 0
    while exc is not None and seen < 8:
        if (type(exc).__module__, type(exc).__name__) == _RANK_FAILED_CLASS:
            named = getattr(exc, "failed_ranks", None)
            dead = [int(r) for r in named if isinstance(r, int)] if isinstance(named, (list, tuple)) else []
            return dead or None
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


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
        # once, through the watcher, not twice; and the watcher ends the rank's children with
        # it. Killed with the watcher, whoever kills it. Its own session too (setsid makes both),
        # hence its own scheduling autogroup (Linux's CONFIG_SCHED_AUTOGROUP shares the CPU
        # fairly between sessions), as hydra starts every watcher. Not under --survive: Open
        # MPI's prterun starts all its ranks in its one session, and there sessions of their own
        # cost every step (4 ranks, fsdp, quiet 2-core machine, benchmarks/survive.py, one run
        # each way interleaved: mean step 1.75x the plain run's in their own sessions, 1.04x in
        # prterun's; median 1.19x against 1.07x), while they only helped the start against other
        # jobs' load (`import meshkit` 4.7-7.7 s a rank in prterun's session, 2.0-3.3 s alone).
        try:
            if os.environ.get(SURVIVE_ENV, "").strip() not in ("", "0"):
                raise OSError  # (the process group alone, below)
            os.setsid()
        except OSError:
            try:
                os.setpgid(0, 0)
            except OSError:
                pass
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != watcher:  # the watcher died before prctl took effect
            os._exit(128 + signal.SIGKILL)
        status.launcher.close()  # the watcher's to watch
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
        return True
    # No setpgid(child, child) here: done first, it would make the child a group leader, which
    # setsid refuses; until the child's own call, _orphaned kills the rank alone.
    _watch(child, status)


def _ended(child: int) -> int | None:
    """How ``child`` ended (``os.waitstatus_to_exitcode``'s form), or None while it runs.

    Not reaped (``WNOWAIT``): until the watcher reaps it, the zombie keeps its pid and process
    group id from being reused, so killing that group later can only hit the rank's own.
    """
    info = os.waitid(os.P_PID, child, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _wait_child_or_launcher(child: int, launcher: _Launcher, held: dict[str, tuple[int, int]]) -> int | None:
    """Wait until the rank ends (its code, as :func:`_ended`) or the launcher dies (None); meanwhile
    ``held`` gathers the MPICH shared-memory files the rank holds (:data:`_SHM_SCAN_S`)."""
    try:
        child_fd: int | None = os.pidfd_open(child)
    except (AttributeError, OSError):
        child_fd = None
    started = next_scan = time.monotonic()
    try:
        while True:
            now = time.monotonic()
            if now >= next_scan:
                held.update(shm_files(child))  # the rank is not reaped before the end: the pid is still its own
                fast = not held and now - started < _SHM_FAST_FOR_S
                next_scan = now + (_SHM_SCAN_S if fast else _SHM_RESCAN_S)
            fds = [fd for fd in (child_fd, launcher.fd) if fd is not None]
            wait = max(0.0, next_scan - time.monotonic())
            # Retried by Python when a forwarded signal interrupts it (PEP 475).
            select.select(fds, [], [], wait if len(fds) == 2 else min(wait, _LAUNCHER_POLL_S))
            code = _ended(child)
            if code is not None:
                return code
            if not launcher.alive():
                return None
    finally:
        if child_fd is not None:
            os.close(child_fd)


def _watch(child: int, status: _StatusDir) -> NoReturn:
    """Wait for the rank process, record how it ended, wait for the release, exit the same way;
    end the rank and leave (:func:`_orphaned`) the moment the launcher dies."""
    alive = True

    def forward(signum: int, frame: object) -> None:
        if alive:
            try:
                os.kill(child, signum)  # not reaped before the end: still the rank's pid
            except ProcessLookupError:
                pass

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
    held: dict[str, tuple[int, int]] = {}  # the rank's MPICH shared memory, as last seen while it ran
    code = _wait_child_or_launcher(child, status.launcher, held)
    if code is not None:
        alive = False
        status.write(ENDED, code, time.time_ns())
        if status.wait_for_release():
            os.waitpid(child, 0)
            _exit_like(code)
    alive = False
    _orphaned(child, status, held)


def _orphaned(child: int, status: _StatusDir, held: dict[str, tuple[int, int]]) -> NoReturn:
    """The launcher died: SIGKILL the rank's process group (the rank and its children), remove
    the shared memory it held (``held``, what the watcher saw while it ran, and what it holds
    now), leave the status directory (:meth:`_StatusDir.depart`), exit."""
    files = {**held, **(shm_files(child) if _ended(child) is None else {})}
    try:
        os.killpg(child, signal.SIGKILL) if os.getpgid(child) == child else os.kill(child, signal.SIGKILL)
    except OSError:
        pass
    os.waitpid(child, 0)
    status.depart(files)
    os._exit(128 + signal.SIGKILL)


def _guard_without_watcher(status: _StatusDir) -> None:
    """For a rank that has no watcher (no fork): a thread that ends this process, and its process
    group where it leads one, when the launcher dies. (PR_SET_PDEATHSIG cannot do it: the rank's
    parent is mpiexec's proxy, which outlives the launcher.)"""

    def guard() -> None:
        status.launcher.wait(None)
        status.depart(shm_files(os.getpid()), wait=False)
        if os.getpgid(0) == os.getpid():
            os.killpg(0, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=guard, name="meshkit-launcher-guard", daemon=True).start()


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
    if status is not None and not status.launcher_alive():
        # The launcher died while mpiexec was starting the ranks (its folder may be gone with it).
        why = "has removed its status directory" if status.launcher.alive() else "is gone"
        print(f"meshkit-run: rank {rank}: the launcher (pid {status.launcher_pid}) {why}; not starting",
              file=sys.stderr, flush=True)
        return 128 + signal.SIGKILL
    # Without a watcher, a failed rank waits for the launcher itself (it kills the rank then).
    linger = None
    if status is not None:
        linger = None if _fork_watcher(status) else status
        if linger is not None:
            _guard_without_watcher(status)
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
            missing = _timed_out(exc)
            dead = _peers_failed(exc) if missing is None else None
            if missing is not None:  # the launcher names the ranks it waited for, not this one, as the cause
                status.report_failure(1, "timeout", *missing)
            elif dead:  # ... and the dead peers this rank's error named, where they ended on their own
                status.report_failure(1, "peer_failed", *dead)
            else:
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
