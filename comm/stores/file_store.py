"""``FileStore``: a store in one file that the processes of a job share (a shared filesystem)."""

from __future__ import annotations

import contextlib
import fcntl
import numbers
import os
import threading
import time
from typing import Iterator

from ..errors import DistStoreError, DistTypeError, DistValueError
from . import wire
from .store import KeyTable, Store

__all__ = ["FileStore"]

_MAGIC = b"meshkit FileStore 1\n"
#: Polling interval of a waiting ``get``/``wait``: from 1 ms doubling to 20 ms, so a rendezvous
#: answers within ~20 ms while a long wait costs ~50 reads a second (torch's FileStore polls too).
_POLL_FIRST_S, _POLL_MAX_S = 0.001, 0.02


class _Contents:
    """What the file holds: the user's keys, and the two counters of who uses the file (not keys)."""

    def __init__(self, table: KeyTable, users: int, closed: int) -> None:
        self.table, self.users, self.closed = table, users, closed

    @classmethod
    def parse(cls, raw: bytes, path: str) -> "_Contents":
        if not raw:
            return cls(KeyTable(), 0, 0)
        try:
            if not raw.startswith(_MAGIC):
                raise wire.ProtocolError("it does not start with the FileStore header")
            _, fields = wire.fields_of(b"\0" + raw[len(_MAGIC):])
            if len(fields) < 2 or len(fields) % 2:
                raise wire.ProtocolError(f"{len(fields)} fields")
            data = {fields[i].decode(): fields[i + 1] for i in range(2, len(fields), 2)}
            return cls(KeyTable(data), int(fields[0]), int(fields[1]))
        except (ValueError, UnicodeDecodeError) as exc:
            raise DistStoreError(f"FileStore at {path!r}: the file is not a meshkit FileStore ({exc}); "
                                 f"give each store a file of its own") from None

    def dump(self) -> bytes:
        fields = [str(self.users).encode(), str(self.closed).encode()]
        for key, value in self.table.data.items():
            fields += [key.encode(), value]
        return _MAGIC + wire.request(0, *fields)[5:]  # the fields without the frame header or the code


class FileStore(Store):
    """A store in the file ``file_name``, shared by every process that opens it (torch's ``FileStore``).

    Each operation takes an ``fcntl.flock`` on the file (shared to read, exclusive to change), reads
    it and writes it back whole, so processes and threads may use it at once; the file system must
    support ``flock`` across the machines that share it (local disks do; NFS only where configured
    for it). ``world_size`` is how many users will open the file: as torch does, each store counts
    itself in when made and out when closed, and the last of ``world_size`` users to close it deletes
    the file (``world_size=-1``, the default, never deletes it). A file left by an earlier job keeps
    its keys: use a fresh path per job.
    """

    def __init__(self, file_name: str | os.PathLike, world_size: int = -1) -> None:
        if not isinstance(file_name, (str, os.PathLike)):
            raise DistTypeError(f"FileStore(file_name): file_name must be a path, got "
                                f"{type(file_name).__name__} {file_name!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or \
                not (world_size == -1 or world_size >= 1):
            raise DistValueError(f"FileStore(world_size): world_size must be -1 (unknown) or an int >= 1, "
                                 f"got {world_size!r}")
        super().__init__()
        self._path = os.path.abspath(os.fspath(file_name))
        self._world_size = int(world_size)
        self._close_lock = threading.Lock()
        self._counted = False  # counted in as a user: close counts out only then
        with self._locked(exclusive=True) as contents:
            contents.users += 1
        self._counted = True

    @property
    def path(self) -> str:
        """The file's absolute path."""
        return self._path

    def _where(self) -> str:
        return f" at {self._path!r}"

    def close(self) -> None:
        """Count this user out; the last of ``world_size`` users deletes the file. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            if not self._counted:
                return
            with self._locked(exclusive=True) as contents:
                contents.users -= 1
                contents.closed += 1
                if contents.users <= 0 and 0 <= self._world_size <= contents.closed:
                    os.unlink(self._path)
                    contents.table = None  # deleted: nothing to write back

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if not self._closed:
                self.close()

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[_Contents]:
        """The file's contents under its lock; written back after an exclusive use that changed them."""
        while True:
            try:
                fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise DistStoreError(f"FileStore at {self._path!r}: cannot open the file: {exc}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
                if os.fstat(fd).st_nlink == 0:  # deleted by the last user between our open and lock: reopen
                    os.close(fd)
                    continue
                size = os.fstat(fd).st_size
                raw = os.pread(fd, size, 0) if size else b""
                contents = _Contents.parse(raw, self._path)
                before = raw
                yield contents
                if exclusive and contents.table is not None:
                    out = contents.dump()
                    if out != before:
                        os.pwrite(fd, out, 0)
                        if len(out) < len(before):
                            os.ftruncate(fd, len(out))
                return
            finally:
                with contextlib.suppress(OSError):
                    os.close(fd)  # closing the descriptor releases its flock

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

    def _poll(self, keys: list[str], timeout: float, value_of: str | None) -> tuple[list[str], bytes | None]:
        deadline, delay = time.monotonic() + timeout, _POLL_FIRST_S
        while True:
            with self._locked(False) as c:
                missing = c.table.missing(keys)
                if not missing:
                    return [], (c.table.data[value_of] if value_of is not None else None)
            left = deadline - time.monotonic()
            if left <= 0:
                return missing, None
            time.sleep(min(delay, left))
            delay = min(delay * 2, _POLL_MAX_S)

    def _get(self, key: str, timeout: float) -> bytes | None:
        return self._poll([key], timeout, key)[1]

    def _wait(self, keys: list[str], timeout: float) -> list[str]:
        return self._poll(keys, timeout, None)[0]
