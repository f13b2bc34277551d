"""The ``MESHKIT_*`` environment variables the library reads: each one read and validated here.

A value that is not valid raises :class:`~meshkit.comm.errors.DistValueError` naming the
variable, its value and the valid values, where it is read and, for every variable, at
``init_process_group`` (:func:`check_all`): a typo in a setting that only matters on a failure
(``MESHKIT_ASYNC_ERROR_HANDLING``) is reported when the job starts, not ignored then.

The launcher's own variable ``MESHKIT_MPICH_TUNING`` is read by :mod:`meshkit.launch.mpich_tuning`
(the launcher imports nothing of ``comm``), with the same message.
"""

from __future__ import annotations

import os
import socket
import stat

from .debug import DebugLevel
from .errors import DistValueError

__all__ = ["DEBUG", "TIMEOUT", "ASYNC_ERROR_HANDLING", "CUDA_AWARE_MPI", "LAUNCHED", "DEVICE_ID", "TRACE_DIR",
           "HOST_NAME", "debug_level", "timeout", "async_error_handling", "cuda_aware_mpi", "launched", "device_id",
           "trace_dir", "host_name", "this_host", "check_all", "invalid"]

DEBUG = "MESHKIT_DEBUG"
TIMEOUT = "MESHKIT_TIMEOUT"
ASYNC_ERROR_HANDLING = "MESHKIT_ASYNC_ERROR_HANDLING"
CUDA_AWARE_MPI = "MESHKIT_CUDA_AWARE_MPI"
#: Set to 1 by ``meshkit-run`` for its ranks.
LAUNCHED = "MESHKIT_LAUNCHED"
#: This rank's GPU (nccl backend), when ``init_process_group(device_id=...)`` does not name it.
DEVICE_ID = "MESHKIT_DEVICE_ID"
#: A folder where each rank writes its flight record when a collective fails (``meshkit.debug``).
TRACE_DIR = "MESHKIT_TRACE_DIR"
#: The host name this rank reports in place of the machine's: set per rank by ``meshkit-run
#: --simulate-nodes`` (:data:`meshkit.launch.bootstrap.HOST_NAME_ENV`, repeated here because
#: ``comm`` imports nothing of ``launch``; a test checks they agree), so that ranks of one machine
#: group into simulated nodes wherever meshkit follows host boundaries (docs/clusters.md).
HOST_NAME = "MESHKIT_HOST_NAME"

_ASYNC_CHOICES = ("abort", "log")


def invalid(name: str, raw: str, valid: str, rank: int | None = None) -> DistValueError:
    """The error for ``name=raw``: ``meshkit.comm: [rank R: ]NAME='raw' is not valid; valid values are ...``."""
    where = "" if rank is None else f"rank {rank}: "
    return DistValueError(f"meshkit.comm: {where}{name}={raw!r} is not valid; valid values are {valid}")


def _get(name: str) -> str | None:
    return os.environ.get(name)


def debug_level() -> DebugLevel:
    """``MESHKIT_DEBUG``: off (default), info or detail, case-insensitive."""
    raw = _get(DEBUG)
    key = (raw or "off").strip().upper() or "OFF"
    try:
        return DebugLevel[key]
    except KeyError:
        raise invalid(DEBUG, raw, str([level.name.lower() for level in DebugLevel])) from None


def timeout() -> float | None:
    """``MESHKIT_TIMEOUT``: seconds, a positive number; None where it is not set."""
    raw = _get(TIMEOUT)
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:  # NaN too; inf is a valid "no timeout"
        raise invalid(TIMEOUT, raw, "a positive number of seconds (e.g. 300)")
    return seconds


def async_error_handling() -> str:
    """``MESHKIT_ASYNC_ERROR_HANDLING``: ``abort`` (default: end the job) or ``log``."""
    raw = _get(ASYNC_ERROR_HANDLING)
    value = (raw or "abort").strip().lower()
    if value not in _ASYNC_CHOICES:
        raise invalid(ASYNC_ERROR_HANDLING, raw, "'abort' (end the job when asynchronous device work fails after "
                      "its Work.wait() returned) and 'log' (keep the error on the Work and log it)")
    return value


def cuda_aware_mpi(rank: int | None = None) -> bool | None:
    """``MESHKIT_CUDA_AWARE_MPI``: 1 (MPI reads device memory) or 0 (stage); None where not set."""
    raw = _get(CUDA_AWARE_MPI)
    if raw is None:
        return None
    if raw.strip() not in ("0", "1"):
        raise invalid(CUDA_AWARE_MPI, raw, "0 (stage device arrays through host memory) and 1 (MPI reads "
                      "device memory)", rank)
    return raw.strip() == "1"


def launched() -> bool:
    """``MESHKIT_LAUNCHED``: 1 in a rank started by ``meshkit-run`` (which sets it), else unset or 0."""
    raw = _get(LAUNCHED)
    if raw is None or raw.strip() in ("", "0"):
        return False
    if raw.strip() != "1":
        raise invalid(LAUNCHED, raw, "1 (set by meshkit-run for its ranks) or 0")
    return True


def device_id() -> int | None:
    """``MESHKIT_DEVICE_ID``: an index of a GPU this process sees (0, 1, ...); None where not set.
    Whether the device exists is checked where the GPU is chosen (``comm/nccl.py``)."""
    raw = _get(DEVICE_ID)
    if raw is None or not raw.strip():
        return None
    if not raw.strip().isdigit():
        raise invalid(DEVICE_ID, raw, "a GPU index of this process (0, 1, ...), as init_process_group(device_id=...)")
    return int(raw.strip())


def trace_dir() -> str | None:
    """``MESHKIT_TRACE_DIR``: a folder for each rank's flight record after a failed collective;
    None where not set.

    Made (mode 0700) where missing. It must then be a folder that this user owns and can write
    in, and not a symbolic link another user owns: the records show every rank's calls, and in
    a folder of another user's (or one they point the name at, in a shared /tmp) that user would
    read them and plant files where the ranks write. Checked at ``init_process_group``, so an
    unusable folder is an error when the job starts, not a warning when a collective fails.
    """
    raw = _get(TRACE_DIR)
    if raw is None or not raw.strip():
        return None

    def unusable(why: str) -> DistValueError:
        return invalid(TRACE_DIR, raw, "a folder this user owns and can write in (made with mode 0700 if missing) "
                       f"where each rank writes its flight record when a collective times out or fails; {why}")

    try:
        os.makedirs(raw, mode=0o700, exist_ok=True)
    except FileExistsError:
        raise unusable("this path exists and is not a folder") from None
    except OSError as exc:
        raise unusable(f"it cannot be made: {exc}") from None
    me = os.geteuid()
    try:
        link, info = os.lstat(raw), os.stat(raw)
    except OSError as exc:
        raise unusable(f"it cannot be read: {exc}") from None
    if stat.S_ISLNK(link.st_mode) and link.st_uid != me:
        raise unusable(f"it is a symbolic link owned by uid {link.st_uid}, not this user (uid {me})")
    if not stat.S_ISDIR(info.st_mode):
        raise unusable("this path exists and is not a folder")
    if info.st_uid != me:
        raise unusable(f"it is owned by uid {info.st_uid}, not this user (uid {me})")
    if not os.access(raw, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        raise unusable("it is not writable by this user")
    return raw


def host_name() -> str | None:
    """``MESHKIT_HOST_NAME``: the (simulated) host name this rank reports; None where unset or empty.

    Followed by the engines' ``host_name()`` and ``local_rank()`` (hence ``DeviceMesh.describe()``
    and the NCCL engine's device choice); not by what needs the real machine (addresses, the
    launcher's status folder, cores)."""
    raw = _get(HOST_NAME)
    if raw is None or not raw.strip():
        return None
    return raw.strip()


def this_host() -> str:
    """The host name this rank reports: :func:`host_name` where set, else the machine's."""
    return host_name() or socket.gethostname()


def check_all() -> None:
    """Read every variable above, so that each one's error comes at ``init_process_group``."""
    debug_level()
    timeout()
    async_error_handling()
    cuda_aware_mpi()
    launched()
    device_id()
    trace_dir()
