"""A group's shared-memory segment: a POSIX shared-memory file, created exclusively, mapped by
every rank of the group, unlinked as soon as all have mapped it.

Why POSIX shared memory (a file under ``/dev/shm`` opened with ``os.open``) and not MPI-3 shared
windows (``Win.Allocate_shared``) or :mod:`multiprocessing.shared_memory`:

- **Another local user is an attacker.** The file is created with ``O_CREAT | O_EXCL |
  O_NOFOLLOW`` and mode ``0o600`` under a name with 128 random bits
  (:func:`secrets.token_hex`): nobody else can open it (the mode), pre-create it (``O_EXCL``
  fails, the group falls back to MPI, naming the path) or plant a link there (``O_NOFOLLOW``).
  The ranks that attach check that what they opened is a regular file of this user, mode 0600, of
  the expected size (``fstat`` of the opened file, not of the name). MPICH's shared windows use
  files MPICH names and creates; their mode and names are MPICH's business, not ours to check.
- **Nothing left behind.** Rank 0 unlinks the name once every rank of the group has mapped it
  (one all-reduce after the attach), so from then on the memory lives only in the mappings: a
  rank SIGKILLed later leaves nothing in ``/dev/shm``, and the memory is freed when the last
  mapping goes. Between creation and unlink (milliseconds, at group creation) a killed job would
  leave the file: its name starts with :data:`PREFIX`, and ``meshkit-run`` removes the files its
  ranks hold open when a rank dies (:func:`meshkit.launch.bootstrap.shm_files`). An MPI window is
  freed only by ``MPI_Win_free``; :mod:`multiprocessing`'s resource tracker unlinks a segment
  when the process that created it exits, and warns about the others' (a process that attaches
  registers it too).
- **Speed**: both are the same pages of memory; the difference is only in who creates them.

Every blocking step here is MPI's (a broadcast of the name, an all-reduce of the verdicts):
the caller runs them under the group's watchdog.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import stat
from typing import Any

__all__ = ["Segment", "PREFIX", "SHM_DIR", "create", "attach", "NAME_BYTES"]

logger = logging.getLogger("meshkit")

#: Where POSIX shared memory lives on Linux (what ``shm_open`` uses).
SHM_DIR = "/dev/shm"
#: Every segment's name: this prefix, then 32 hex digits (128 random bits). The launcher matches
#: the same pattern (meshkit/launch/bootstrap.py) to remove a dead job's files.
PREFIX = "meshkit-shm-"
#: Bytes of the name as rank 0 broadcasts it (padded with NUL).
NAME_BYTES = 64


class Segment:
    """One mapped segment: ``memory`` (the mmap), ``size`` and ``path`` (unlinked once attached)."""

    __slots__ = ("memory", "size", "path", "_fd")

    def __init__(self, memory: mmap.mmap, size: int, path: str, fd: int) -> None:
        self.memory, self.size, self.path, self._fd = memory, size, path, fd

    def close_fd(self) -> None:
        """Close the file (the mapping stays): once unlinked, nothing needs the descriptor."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def unlink(self) -> None:
        """Remove the name (rank 0, once every rank mapped it); the memory stays mapped."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmap; where NumPy views of it still live (a buffer handed out), the mapping stays until
        they are gone (``mmap.close`` refuses while views exist)."""
        self.close_fd()
        try:
            self.memory.close()
        except BufferError:
            pass


def create(size: int, directory: str = SHM_DIR) -> Segment:
    """A new segment of ``size`` bytes, zeroed, mode 0600, under an unguessable name.

    Raises:
        OSError: the file could not be created (``FileExistsError`` if someone made the name
            first: never opened then), sized or mapped.
    """
    path = os.path.join(directory, PREFIX + secrets.token_hex(16))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask may have removed bits, never added: make it exact
        os.ftruncate(fd, size)
        memory = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
    return Segment(memory, size, path, fd)


def attach(path: str, size: int) -> Segment:
    """Map the segment rank 0 created at ``path``, after checking what was opened.

    Raises:
        OSError: it cannot be opened (``O_NOFOLLOW``: a link), or it is not a regular file of
            this user with mode 0600 and ``size`` bytes (``PermissionError`` naming the path).
    """
    if not os.path.basename(path).startswith(PREFIX):
        raise PermissionError(f"{path!r} is not a meshkit segment (its name does not start with {PREFIX!r})")
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        problem = _problem(info, size)
        if problem:
            raise PermissionError(f"{path}: {problem}; refusing to map it")
        memory = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return Segment(memory, size, path, fd)


def _problem(info: Any, size: int) -> str:
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if info.st_uid != os.geteuid():
        return f"owned by uid {info.st_uid}, not this user's ({os.geteuid()})"
    if stat.S_IMODE(info.st_mode) != 0o600:
        return f"mode {stat.S_IMODE(info.st_mode):o}, not 600"
    if info.st_size != size:
        return f"{info.st_size} bytes, not {size}"
    return ""
