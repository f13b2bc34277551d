"""Linux cross-memory attach: copy bytes straight between two ranks' own arrays, one copy, no segment.

``process_vm_readv`` / ``process_vm_writev`` (Linux 3.2+, through ctypes: the os module has
neither) copy between this process's memory and another's inside the kernel. The shared-memory
path uses them, where :func:`probe` found them permitted between every pair of the group's ranks,
to read a peer's slice of an ordinary buffer and write the reduced slice back into the peer's
buffer: at 2 ranks an all_reduce is then about 1.4 passes of one core's copy where copying through
the segment is 2.2 (docs/collectives.md has the figures).

**Who may.** The kernel allows the calls only where the caller may ptrace the target
(``PTRACE_MODE_ATTACH_REALCREDS``): the same real, effective and saved uid and gid, the target
dumpable, and the Linux security modules agreeing (Yama's ``kernel.yama.ptrace_scope`` 1, Ubuntu's
default, allows only a process's ancestors: sibling ranks are refused, so :func:`probe` fails and
the path copies through the segment instead; 2 and 3 refuse everyone but root). So it gives a rank
no power over a peer that it did not already have (ptrace), and another local user none at all: the
kernel checks the caller's credentials against the target's, and a user who is not ours, not root,
is refused (tests/test_shm_segment.py plays one with ``setpriv``). Pids and addresses come from the
group's segment (mode 0600, this user's: tests/test_shm_segment.py) and from MPI: both only ours.

**When.** A rank reads or writes a peer's array only between two meetings of the call, while the
peer is inside the same call and waits for it (see shm_collectives.py): the array is alive, at the
address it posted, and its pid is the peer's (a pid is reused only after the process died and the
kernel's pid counter wrapped around; a peer that dies is found at the next meeting). A failed call
raises :class:`OSError` naming the peer's pid and the errno.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

import numpy as np

__all__ = ["Transfer", "available", "probe"]


#: Bytes per call: the kernel moves at most about 2 GiB per call (MAX_RW_COUNT); below that a call
#: that fails part-way reports an error, not a short count.
_MOST_BYTES = 1 << 30


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _functions() -> tuple[Any, Any] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        read, write = libc.process_vm_readv, libc.process_vm_writev
    except (OSError, AttributeError):
        return None
    for fn in (read, write):
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                       ctypes.c_ulong]
        fn.restype = ctypes.c_ssize_t
    return read, write


_FUNCTIONS = _functions()


def available() -> bool:
    """Whether this platform has the calls at all (Linux with a C library exporting them)."""
    return _FUNCTIONS is not None


class Transfer:
    """Copies between this process and others (one instance per channel; its two iovecs are reused,
    so a copy allocates nothing)."""

    __slots__ = ("_read", "_write", "_local", "_remote", "_local_ref", "_remote_ref")

    def __init__(self) -> None:
        if _FUNCTIONS is None:
            raise OSError("process_vm_readv/process_vm_writev are not available on this platform")
        self._read, self._write = _FUNCTIONS
        self._local, self._remote = _IoVec(), _IoVec()
        self._local_ref, self._remote_ref = ctypes.byref(self._local), ctypes.byref(self._remote)

    def read(self, pid: int, address: int, into: np.ndarray) -> None:
        """Fill ``into`` (C-contiguous) with the ``into.nbytes`` bytes at ``address`` in process ``pid``."""
        self.move(self._read, pid, address, into.ctypes.data, into.nbytes)

    def write(self, pid: int, address: int, data: np.ndarray) -> None:
        """Write ``data``'s bytes (C-contiguous) at ``address`` in process ``pid``."""
        self.move(self._write, pid, address, data.ctypes.data, data.nbytes)

    def move(self, fn: Any, pid: int, address: int, local: int, nbytes: int) -> None:
        """``fn`` (:attr:`reader` or :attr:`writer`) over ``nbytes`` bytes between this process's
        address ``local`` and ``address`` in process ``pid``: the loop's own form, on addresses, for a
        caller that moves many pieces (an array's ``ctypes.data`` costs about a microsecond, as much
        as the rest of the call: a 4 MiB all_reduce moves 16 pieces per rank)."""
        if nbytes > _MOST_BYTES:
            for at in range(0, nbytes, _MOST_BYTES):
                self.move(fn, pid, address + at, local + at, min(_MOST_BYTES, nbytes - at))
            return
        self._local.base, self._local.len = local, nbytes
        self._remote.base, self._remote.len = address, nbytes
        done = fn(pid, self._local_ref, 1, self._remote_ref, 1, 0)
        if done != nbytes:
            errno = ctypes.get_errno() if done < 0 else 0
            what = "read" if fn is self._read else "write"
            raise OSError(errno, f"process_vm_{what}v of {nbytes} bytes at {address:#x} in pid {pid} "
                                 + (f"moved {done} bytes" if done >= 0 else f"failed: {os.strerror(errno)}"))

    @property
    def reader(self) -> Any:
        """``process_vm_readv``, for :meth:`move`."""
        return self._read

    @property
    def writer(self) -> Any:
        """``process_vm_writev``, for :meth:`move`."""
        return self._write


def probe(pids: list[int], addresses: list[int], rank: int, magic: bytes) -> str:
    """Read ``len(magic)`` bytes at each other rank's ``addresses[r]`` in process ``pids[r]`` and
    compare them with ``magic`` (which every rank holds at its address): ``""`` where every read
    worked, else why not (a refused call: ptrace rules, Yama, seccomp; another kernel)."""
    if _FUNCTIONS is None:
        return "process_vm_readv is not available on this platform"
    transfer = Transfer()
    got = np.empty(len(magic), np.uint8)
    for r, (pid, address) in enumerate(zip(pids, addresses)):
        if r == rank:
            continue
        try:
            transfer.read(pid, address, got)
        except OSError as exc:
            return str(exc)
        if got.tobytes() != magic:
            return f"process_vm_readv from pid {pid} read other bytes than that rank's (another process?)"
    return ""
