"""``FileStore``: a store in one file that the processes of a job share (a shared filesystem).

The file is the job's own: created exclusively (``O_EXCL | O_NOFOLLOW``) with mode 0600, and an
existing one is used only if it is a regular file (not a symlink, a FIFO or a device), owned by this
user, with no permission for anyone else, and carries this job's identity
(:func:`meshkit.comm.env.job_identity`: a digest of the job's secret, or a launcher's job id): a file
another user planted in a shared folder, or one of another job on the same path, is refused naming
the path and why, so two jobs on one path never form one world.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import numbers
import os
import pwd
import stat
import threading
import time
from typing import Any, Callable, Iterator

from .. import env
from ..errors import DistStoreError, DistTypeError, DistValueError
from . import wire
from .store import KeyTable, Store

__all__ = ["FileStore"]

_MAGIC = b"meshkit FileStore 2\n"
_LEGACY_MAGIC = b"meshkit FileStore 1\n"
#: What a file written by a job with no identity says in place of one.
_NO_IDENTITY = b"-"
#: The first byte of a queue's name field (a queue's values are one field, framed as the file's
#: own fields): 0xFF never starts the UTF-8 encoding of a key, so a queue never reads as a key,
#: and files without queues are as before.
_QUEUE = b"\xff"
#: Polling interval of a waiting ``get``/``wait``: from 1 ms doubling to 20 ms, so a rendezvous
#: answers within ~20 ms while a long wait costs ~50 reads a second (torch's FileStore polls too).
_POLL_FIRST_S, _POLL_MAX_S = 0.001, 0.02
#: How long an opener waits for the creator of a new file to write its header (it does so right
#: after creating it, under the lock: microseconds, unless the creator died in between).
_HEADER_WAIT_S = 5.0


class _Contents:
    """What the file holds: the job's identity, the user's keys, and the two counters of who uses
    the file (not keys)."""

    def __init__(self, identity: bytes, table: KeyTable, users: int, closed: int) -> None:
        self.identity, self.table, self.users, self.closed = identity, table, users, closed

    @classmethod
    def parse(cls, raw: bytes, path: str) -> "_Contents":
        try:
            if raw.startswith(_LEGACY_MAGIC):
                raise wire.ProtocolError("it was written by an earlier meshkit (FileStore 1, which carried no job "
                                         "identity); delete it or use a fresh path")
            if not raw.startswith(_MAGIC):
                raise wire.ProtocolError("it does not start with the FileStore header")
            _, fields = wire.fields_of(b"\0" + raw[len(_MAGIC):])
            if len(fields) < 3 or len(fields) % 2 == 0:
                raise wire.ProtocolError(f"{len(fields)} fields")
            data, queues = {}, {}
            for i in range(3, len(fields), 2):
                if fields[i][:1] == _QUEUE:
                    queues[fields[i][1:].decode()] = collections.deque(wire.fields_of(b"\0" + fields[i + 1])[1])
                else:
                    data[fields[i].decode()] = fields[i + 1]
            return cls(fields[0], KeyTable(data, queues), int(fields[1]), int(fields[2]))
        except (ValueError, UnicodeDecodeError) as exc:
            raise DistStoreError(f"FileStore at {path!r}: the file is not a meshkit FileStore ({exc}); "
                                 f"give each store a file of its own") from None

    def dump(self) -> bytes:
        fields = [self.identity, str(self.users).encode(), str(self.closed).encode()]
        for key, value in self.table.data.items():
            fields += [key.encode(), value]
        for key, queue in self.table.queues.items():
            fields += [_QUEUE + key.encode(), wire.request(0, *queue)[5:]]
        return _MAGIC + wire.request(0, *fields)[5:]  # the fields without the frame header or the code


def _owner(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


class FileStore(Store):
    """A store in the file ``file_name``, shared by every process that opens it (torch's ``FileStore``).

    Each operation takes an ``fcntl.flock`` on the file, reads it and writes it back whole, so
    processes and threads may use it at once; the file system must support ``flock`` across the
    machines that share it (local disks do; NFS only where configured for it). ``world_size`` is how
    many users will open the file: as torch does, each store counts itself in when made and out when
    closed, and the last of ``world_size`` users to close it deletes the file (``world_size=-1``, the
    default, never deletes it). A file left by an earlier job of this identity keeps its keys: use a
    fresh path per job.

    The file is private (module docstring): made with mode 0600 and never followed through a
    symlink; one that is not this user's own, that others may read or write, or that another job
    made (``secret``, default the job's ``MESHKIT_JOB_SECRET``, else the launcher's job id, tells
    jobs apart) is refused with :class:`DistStoreError` naming the path and why.
    """

    def __init__(self, file_name: str | os.PathLike, world_size: int = -1, *,
                 secret: str | bytes | None = None) -> None:
        if not isinstance(file_name, (str, os.PathLike)):
            raise DistTypeError(f"FileStore(file_name): file_name must be a path, got "
                                f"{type(file_name).__name__} {file_name!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or \
                not (world_size == -1 or world_size >= 1):
            raise DistValueError(f"FileStore(world_size): world_size must be -1 (unknown) or an int >= 1, "
                                 f"got {world_size!r}")
        super().__init__()
        self._attach(os.path.abspath(os.fspath(file_name)), int(world_size), _identity(secret), clone=False)

    def _attach(self, path: str, world_size: int, identity: bytes, *, clone: bool) -> None:
        """Open the file and count this store in as a user (a clone only as one that holds it
        open: its close does not count towards ``world_size``)."""
        self._path = path
        self._world_size = world_size
        self._identity = identity
        self._is_clone = clone
        self._lock = threading.Lock()  # flock does not exclude the threads of one open file description
        self._close_lock = threading.Lock()
        self._fd = -1
        self._counted = False  # counted in as a user: close counts out only then
        self._fd = self._open()
        try:
            with self._locked(exclusive=True) as contents:
                contents.users += 1
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise
        self._counted = True

    @property
    def path(self) -> str:
        """The file's absolute path."""
        return self._path

    @property
    def authenticated(self) -> bool:
        """True: only this user can read or write the file, and it is this job's (checked when opened)."""
        return True

    def _where(self) -> str:
        return f" at {self._path!r}"

    def _refuse(self, why: str) -> DistStoreError:
        return DistStoreError(f"FileStore at {self._path!r}: {why}; refusing it (a store's file must be this job's "
                              "own: delete it if it is a stale one of yours, or use a fresh path)")

    # ------------------------------------------------------------------ the file
    def _open(self) -> int:
        """A descriptor of the job's file: made here (exclusively, 0600, with the header), or an
        existing one that passes every check (module docstring)."""
        deadline = time.monotonic() + _HEADER_WAIT_S
        while True:
            try:
                fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                fd = self._existing()
                if fd is None:  # removed between our two opens (its last user closed it): make it anew
                    continue
            except OSError as exc:
                raise DistStoreError(f"FileStore at {self._path!r}: cannot open the file: {exc}") from None
            else:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)  # the header goes in before anyone else reads the file
                    os.fchmod(fd, 0o600)  # whatever the umask did to the mode
                    os.pwrite(fd, _Contents(self._identity, KeyTable(), 0, 0).dump(), 0)
                    fcntl.flock(fd, fcntl.LOCK_UN)
                except OSError as exc:
                    os.close(fd)
                    raise DistStoreError(f"FileStore at {self._path!r}: cannot write the new file: {exc}") from None
                return fd
            st = os.fstat(fd)
            if st.st_nlink == 0 or (st.st_size == 0 and time.monotonic() < deadline):
                os.close(fd)  # deleted by its last user meanwhile, or its creator has not written the header yet
                time.sleep(_POLL_FIRST_S)
                continue
            return fd

    def _existing(self) -> int | None:
        """The existing file, opened after checking what it is and whose (None: gone meanwhile)."""
        try:
            fd = os.open(self._path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if os.path.islink(self._path):
                raise self._refuse(f"it is a symbolic link (to {os.readlink(self._path)!r})") from None
            raise DistStoreError(f"FileStore at {self._path!r}: cannot open the file: {exc}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise self._refuse("it is not a regular file (a FIFO, a device or a folder)")
            if st.st_uid != os.geteuid():
                raise self._refuse(f"it belongs to {_owner(st.st_uid)}, not to this user ({_owner(os.geteuid())})")
            if st.st_mode & 0o077:
                raise self._refuse(f"its mode is {stat.S_IMODE(st.st_mode):04o}: others may read or write it (a "
                                   "store's file is 0600)")
            os.set_blocking(fd, True)
            return fd
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        """Count this user out; the last of ``world_size`` users deletes the file. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._counted:
                    with self._locked(exclusive=True) as contents:
                        contents.users -= 1
                        contents.closed += 0 if self._is_clone else 1
                        if contents.users <= 0 and 0 <= self._world_size <= contents.closed:
                            with contextlib.suppress(FileNotFoundError):
                                os.unlink(self._path)
                            contents.table = None  # deleted: nothing to write back
            finally:
                if self._fd >= 0:
                    os.close(self._fd)
                    self._fd = -1

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if not self._closed:
                self.close()

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[_Contents]:
        """The file's contents under its lock; written back after an exclusive use that changed them."""
        fd = self._fd
        with self._lock:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                size = os.fstat(fd).st_size
                raw = os.pread(fd, size, 0) if size else b""
                contents = _Contents.parse(raw, self._path)
                if contents.identity != self._identity:
                    raise self._refuse(_foreign(contents.identity, self._identity))
                yield contents
                if exclusive and contents.table is not None:
                    out = contents.dump()
                    if out != raw:
                        os.pwrite(fd, out, 0)
                        if len(out) < len(raw):
                            os.ftruncate(fd, len(out))
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    # ------------------------------------------------------------------ the primitives
    def _set(self, key: str, value: bytes) -> None:
        with self._locked(True) as c:
            c.table.set(key, value)

    def _add(self, key: str, amount: int) -> int:
        with self._locked(True) as c:
            return c.table.add(key, amount)

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._locked(True) as c:
            return c.table.compare_set(key, expected, desired)

    def _missing(self, keys: list[str]) -> list[str]:
        with self._locked(False) as c:
            return c.table.missing(keys)

    def _delete(self, key: str) -> bool:
        with self._locked(True) as c:
            return c.table.delete(key)

    def _count(self, prefix: str) -> int:
        with self._locked(False) as c:
            return c.table.count(prefix)

    def _poll(self, ready: Callable[[KeyTable], tuple[list[str], Any]], timeout: float,
              exclusive: bool = False) -> tuple[list[str], Any]:
        """``ready(table)`` (``(missing, result)``) under the lock until nothing is missing or
        ``timeout`` passes; ``exclusive`` where it changes the table (a pop)."""
        deadline, delay = time.monotonic() + timeout, _POLL_FIRST_S
        while True:
            with self._locked(exclusive) as c:
                missing, result = ready(c.table)
                if not missing:
                    return [], result
            left = deadline - time.monotonic()
            if left <= 0:
                return missing, None
            time.sleep(min(delay, left))
            delay = min(delay * 2, _POLL_MAX_S)

    def _get(self, key: str, timeout: float) -> bytes | None:
        return self._poll(lambda t: (t.absent([key]), t.data.get(key)), timeout)[1]

    def _wait(self, keys: list[str], timeout: float) -> list[str]:
        return self._poll(lambda t: (t.missing(keys), None), timeout)[0]

    def _multi_get(self, keys: list[str], timeout: float) -> tuple[list[bytes] | None, list[str]]:
        missing, values = self._poll(lambda t: (t.absent(keys), [t.data.get(k) for k in keys]), timeout)
        return values, missing

    def _multi_set(self, pairs: list[tuple[str, bytes]]) -> None:
        with self._locked(True) as c:
            for key, value in pairs:
                c.table.set(key, value)

    def _append(self, key: str, value: bytes) -> None:
        with self._locked(True) as c:
            c.table.append(key, value)

    def _push(self, key: str, value: bytes) -> None:
        with self._locked(True) as c:
            c.table.push(key, value)

    def _pop(self, key: str, timeout: float) -> bytes | None:
        def ready(t: KeyTable) -> tuple[list[str], bytes | None]:
            value = t.pop(key)
            return ([key] if value is None else []), value
        return self._poll(ready, timeout, exclusive=True)[1]

    def _queue_len(self, key: str) -> int:
        with self._locked(False) as c:
            return c.table.queue_len(key)

    def _list(self, prefix: str) -> list[str]:
        with self._locked(False) as c:
            return c.table.keys(prefix)

    def _clone(self) -> "FileStore":
        """The same file opened again, by this job (its identity): a user while open, whose close
        does not count towards ``world_size`` (a clone is not one of the job's users)."""
        other = FileStore.__new__(FileStore)
        Store.__init__(other)
        other._attach(self._path, self._world_size, self._identity, clone=True)
        return other


def _identity(secret: str | bytes | None) -> bytes:
    """What the file says of the job: ``secret``'s digest where given, else the job's identity."""
    if secret is None:
        identity = env.job_identity()
        return _NO_IDENTITY if identity is None else identity.encode()
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
        raise DistValueError("FileStore(secret): secret must be str or bytes of at least 16 bytes (or None: the "
                             f"job's, {env.JOB_SECRET}); its value is not shown")
    return env.secret_identity(bytes(secret)).encode()


def _foreign(theirs: bytes, ours: bytes) -> str:
    if theirs == _NO_IDENTITY:
        return ("another job made it without a job identity, while this one has one; two jobs on one path never "
                "form one world")
    if ours == _NO_IDENTITY:
        return (f"a job with an identity made it, and this process has none (set {env.JOB_SECRET} as that job's "
                "ranks have it, or run under its launcher)")
    return ("another job made it (its job identity differs from this process's); two jobs on one path never form "
            "one world")
