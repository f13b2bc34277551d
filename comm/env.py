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
import re
import socket
import stat

from ..launch_protocol import HOST_NAME_ENV, JOB_SECRET_ENV, LAUNCHED_ENV
from .debug import DebugLevel
from .errors import DistValueError

__all__ = ["DEBUG", "TORCH_DEBUG", "TIMEOUT", "ASYNC_ERROR_HANDLING", "CUDA_AWARE_MPI", "LAUNCHED", "DEVICE_ID",
           "TRACE_DIR",
           "HOST_NAME", "JOB_SECRET", "MAX_TIMEOUT_S", "debug_level", "timeout", "check_timeout", "async_error_handling",
           "cuda_aware_mpi", "launched", "device_id", "trace_dir", "host_name", "this_host", "job_secret", "job_identity", "secret_identity",
           "positive_number", "control_max_depth", "CONTROL_MAX_DEPTH", "STORE_MAX_BYTES", "STORE_MAX_CONNECTIONS",
           "STORE_IDLE_TIMEOUT", "STORE_HANDSHAKE_TIMEOUT", "STORE_MAX_WAIT_KEYS",
           "SHM", "SHM_MIN_BYTES", "SHM_MOVE_MIN_BYTES", "SHM_CHUNK_BYTES", "SHM_SMALL_BYTES", "SHM_SMALL_MIN_BYTES", "shm_enabled", "shm_bytes",
           "check_all", "invalid"]

DEBUG = "MESHKIT_DEBUG"
#: torch's name for it, read where ``MESHKIT_DEBUG`` is not set
TORCH_DEBUG = "TORCH_DISTRIBUTED_DEBUG"
TIMEOUT = "MESHKIT_TIMEOUT"
ASYNC_ERROR_HANDLING = "MESHKIT_ASYNC_ERROR_HANDLING"
CUDA_AWARE_MPI = "MESHKIT_CUDA_AWARE_MPI"
#: Set to 1 by ``meshkit-run`` for its ranks.
LAUNCHED = LAUNCHED_ENV
#: This rank's GPU (nccl backend), when ``init_process_group(device_id=...)`` does not name it.
DEVICE_ID = "MESHKIT_DEVICE_ID"
#: A folder where each rank writes its flight record when a collective fails (``meshkit.debug``).
TRACE_DIR = "MESHKIT_TRACE_DIR"
#: The host name this rank reports in place of the machine's: set per rank by ``meshkit-run
#: --simulate-nodes`` (:mod:`meshkit.launch_protocol`'s name), so that ranks of one machine
#: group into simulated nodes wherever meshkit follows host boundaries (docs/clusters.md).
HOST_NAME = HOST_NAME_ENV

#: The job's secret (docs/security.md): ``meshkit-run`` and ``meshkit.spawn`` generate one per job
#: (:mod:`meshkit.launch_protocol`'s name); every store meshkit makes authenticates with it, and an
#: outsider without it is refused.
JOB_SECRET = JOB_SECRET_ENV
#: The shortest secret accepted: 32 characters (``secrets.token_hex(16)``, 128 bits, the least a
#: key should have; the launcher makes 64).
MIN_SECRET_CHARS = 32
#: Variables by which other launchers name their job (never secrets): a ``file://`` rendezvous
#: tells two jobs on one path apart by the job's identity (:func:`job_identity`).
_JOB_ID_ENVS = (("SLURM_JOB_ID", "SLURM_STEP_ID"), ("TORCHELASTIC_RUN_ID",), ("PBS_JOBID",), ("LSB_JOBID",))
#: How deeply control messages (and objects on groups whose peers are not authenticated) may nest
#: (comm/control.py): meshkit's own messages nest at most 5 deep (a Notice's counts in a list);
#: the default 100 leaves room for object collectives' data, and decoding a level takes a Python
#: frame, so at most 500 (under CPython's default recursion limit of 1000).
CONTROL_MAX_DEPTH = "MESHKIT_CONTROL_MAX_DEPTH"
_DEFAULT_DEPTH, _MOST_DEPTH = 100, 500
#: The bounds of a TCPStore server (comm/stores/limits.py has their defaults and reasons).
STORE_MAX_BYTES = "MESHKIT_STORE_MAX_BYTES"
STORE_MAX_CONNECTIONS = "MESHKIT_STORE_MAX_CONNECTIONS"
STORE_IDLE_TIMEOUT = "MESHKIT_STORE_IDLE_TIMEOUT"
STORE_HANDSHAKE_TIMEOUT = "MESHKIT_STORE_HANDSHAKE_TIMEOUT"
STORE_MAX_WAIT_KEYS = "MESHKIT_STORE_MAX_WAIT_KEYS"
#: The longest timeout: 1e6 s (11.6 days). Longer ones overflow what the waits underneath take
#: (epoll's C int of milliseconds ends at 24.8 days, ``threading``'s waits at ``TIMEOUT_MAX``), and
#: ``inf``, ``1e10`` and ``2e9`` each failed somewhere else with a message naming nothing.
MAX_TIMEOUT_S = 1e6

_ASYNC_CHOICES = ("abort", "log")


def invalid(name: str, raw: str, valid: str, rank: int | None = None) -> DistValueError:
    """The error for ``name=raw``: ``meshkit.comm: [rank R: ]NAME='raw' is not valid; valid values are ...``."""
    where = "" if rank is None else f"rank {rank}: "
    return DistValueError(f"meshkit.comm: {where}{name}={raw!r} is not valid; valid values are {valid}")


def _get(name: str) -> str | None:
    return os.environ.get(name)


def debug_level() -> DebugLevel:
    """``MESHKIT_DEBUG``: off (default), info or detail, case-insensitive; where it is not set,
    torch's ``TORCH_DISTRIBUTED_DEBUG`` (``OFF``, ``INFO``, ``DETAIL``), so that a torch job's
    environment gives a ported script the checks it asked for."""
    name = DEBUG if _get(DEBUG) is not None else TORCH_DEBUG
    raw = _get(name)
    key = (raw or "off").strip().upper() or "OFF"
    try:
        return DebugLevel[key]
    except KeyError:
        raise invalid(name, raw, str([level.name.lower() for level in DebugLevel])) from None


def timeout() -> float | None:
    """``MESHKIT_TIMEOUT``: seconds, positive and at most :data:`MAX_TIMEOUT_S`; None where not set."""
    raw = _get(TIMEOUT)
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds <= MAX_TIMEOUT_S:  # NaN and inf too
        raise invalid(TIMEOUT, raw, f"a positive number of seconds (e.g. 300), at most {MAX_TIMEOUT_S:.0e} "
                      "(11.6 days; every blocking call ends by its timeout, so there is no infinite one)")
    return seconds


def check_timeout(seconds: float, what: str = "timeout") -> float:
    """``seconds`` if in (0, :data:`MAX_TIMEOUT_S`], else the error naming ``what``."""
    if not seconds > 0:
        raise DistValueError(f"meshkit.comm: {what} must be positive, got {seconds}")
    if not seconds <= MAX_TIMEOUT_S:
        raise DistValueError(f"meshkit.comm: {what} must be at most {MAX_TIMEOUT_S:.0e} seconds (11.6 days; every "
                             f"blocking call ends by its timeout), got {seconds}")
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
    Whether the device exists is checked where the GPU is chosen (``comm/engines/nccl_creation.py``)."""
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


def positive_number(name: str, default: float, *, integer: bool = False, upper: float | None = None,
                    where: str = "meshkit.comm", valid: str | None = None) -> float:
    """The positive number in variable ``name`` (an integer where ``integer``; at most ``upper``),
    ``default`` where unset or empty: the bounds of meshkit's servers and readers (stores/limits.py,
    the debug server's, the checkpoint and trace readers'). A bad value raises
    ``where: NAME='raw' is not valid; valid values are ...`` (``valid``: how to say what is)."""
    raw = _get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value: float = int(raw.strip()) if integer else float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or (upper is not None and not value <= upper) or value == float("inf"):
        if valid is None:
            kind = "a positive integer" if integer else "a positive number"
            valid = f"{kind}{'' if upper is None else f' at most {upper:g}'} (default {default:g})"
        raise DistValueError(f"{where}: {name}={raw!r} is not valid; valid values are {valid}")
    return value


def control_max_depth() -> int:
    """``MESHKIT_CONTROL_MAX_DEPTH``: levels of nesting, 1..500 (default 100)."""
    raw = _get(CONTROL_MAX_DEPTH)
    if raw is None or not raw.strip():
        return _DEFAULT_DEPTH
    value = raw.strip()
    if not value.isdigit() or not 1 <= int(value) <= _MOST_DEPTH:
        raise invalid(CONTROL_MAX_DEPTH, raw, f"integers 1..{_MOST_DEPTH} (levels of nesting; default {_DEFAULT_DEPTH})")
    return int(value)


def job_secret() -> bytes | None:
    """``MESHKIT_JOB_SECRET``: the job's secret as bytes (at least :data:`MIN_SECRET_CHARS` printable
    ASCII characters, no whitespace); None where not set (or empty).

    The value is a key: it is never logged, and errors name the variable, not the value."""
    raw = _get(JOB_SECRET)
    if raw is None or raw == "":
        return None
    if len(raw) < MIN_SECRET_CHARS or not all("!" <= c <= "~" for c in raw):
        problem = (f"{len(raw)} characters" if len(raw) < MIN_SECRET_CHARS
                   else "it holds whitespace or characters that are not printable ASCII")
        raise DistValueError(f"meshkit.comm: {JOB_SECRET} is not valid ({problem}; its value is not shown): valid "
                             f"values are at least {MIN_SECRET_CHARS} printable ASCII characters without whitespace, "
                             "the same on every rank, e.g. from `python -c 'import secrets; "
                             "print(secrets.token_hex(32))'` (meshkit-run and meshkit.spawn make one per job)")
    return raw.encode("ascii")


def secret_identity(secret: bytes) -> str:
    """A digest that names the job of ``secret`` without revealing it (an HMAC of a fixed label)."""
    import hmac

    return "s:" + hmac.digest(secret, b"meshkit job identity", "sha256")[:16].hex()


def job_identity() -> str | None:
    """What tells this job apart from another of the same user: a digest of the job's secret, else
    the job id of the launcher that started it (Slurm's job and step, torchrun's run id unless
    ``none``, PBS's, LSF's); None where there is neither."""
    import hashlib

    secret = job_secret()
    if secret is not None:
        return secret_identity(secret)
    for names in _JOB_ID_ENVS:
        values = [(_get(n) or "").strip() for n in names]
        if values[0] and values[0] != "none":
            return "l:" + hashlib.sha256(" ".join(f"{n}={v}" for n, v in zip(names, values)).encode()).hexdigest()[:32]
    return None


#: ``0`` turns the shared-memory path off (collectives of groups on one node go to MPI); ``1`` (the
#: default) uses it where it applies (docs/collectives.md).
SHM = "MESHKIT_SHM"
#: Collectives of fewer bytes than this go to MPI, not through shared memory.
SHM_MIN_BYTES = "MESHKIT_SHM_MIN_BYTES"
#: all_gather and broadcast (no reduction) of fewer bytes than this go to MPI.
SHM_MOVE_MIN_BYTES = "MESHKIT_SHM_MOVE_MIN_BYTES"
#: Bytes of each of a rank's two buffers in a group's segment (a multiple of 64).
SHM_CHUNK_BYTES = "MESHKIT_SHM_CHUNK_BYTES"
#: A reduction chunk of at most this many bytes meets once (every rank reduces all of it).
SHM_SMALL_BYTES = "MESHKIT_SHM_SMALL_BYTES"
#: all_reduce and reduce_scatter of an ordinary buffer from this many bytes up to
#: ``MESHKIT_SHM_SMALL_BYTES`` meet once through the segment (comm/engines/shm_small.py).
SHM_SMALL_MIN_BYTES = "MESHKIT_SHM_SMALL_MIN_BYTES"
#: A buffer of ``shared_buffer`` below this many bytes goes to MPI on the same memory.
SHM_SHARED_MIN_BYTES = "MESHKIT_SHM_SHARED_MIN_BYTES"
#: ``0`` copies ordinary buffers through the segment; ``1`` (the default) moves them between the
#: ranks' own arrays by cross-memory attach where the kernel permits it.
SHM_CMA = "MESHKIT_SHM_CMA"
#: ``1`` (the default): an all_reduce, reduce_scatter or all_gather through the segment right after
#: one of those takes the buffers that one used, once every rank read them; ``0``: the other
#: buffers, as the step's parity gives them.
SHM_REUSE = "MESHKIT_SHM_REUSE"
#: Seconds a rank woken by a survivor's revoke waits to learn who died (``meshkit-run --survive``).
SURVIVE_LEARN_S = "MESHKIT_SURVIVE_LEARN_S"
#: The most any of the byte sizes above may be (1 GiB: a group's segment is n x 2 x the chunk).
_SHM_MOST_BYTES = 1 << 30
#: A size: digits, then K, M, G or T (binary multiples) and an optional B or iB, any case: the grammar
#: of the benchmarks' ``--sizes`` (benchmarks/_common.py's ``parse_size``, which imports nothing of
#: meshkit and so keeps its own copy); T only ever names a size above the limit.
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def shm_enabled() -> bool:
    """``MESHKIT_SHM``: 1 (default: the shared-memory path where it applies) or 0 (MPI only)."""
    raw = _get(SHM)
    value = (raw or "1").strip() or "1"
    if value not in ("0", "1"):
        raise invalid(SHM, raw or "", "0 (collectives over MPI only) or 1 (shared memory within a node; the default)")
    return value == "1"


def shm_cma() -> int:
    """``MESHKIT_SHM_CMA``: how ordinary buffers move between the ranks: 0 copied through the
    segment; 1 (the default) by cross-memory attach where the kernel permits it and, on this host,
    it measured cheaper than the segment's copies (comm/engines/shm.py); 2 by cross-memory attach
    wherever the kernel permits it."""
    raw = _get(SHM_CMA)
    value = (raw or "1").strip() or "1"
    if value not in ("0", "1", "2"):
        raise invalid(SHM_CMA, raw or "", "0 (copy through the segment), 1 (cross-memory attach where the "
                                          "kernel permits it and it measured cheaper here; the default) or 2 "
                                          "(cross-memory attach wherever the kernel permits it)")
    return int(value)


def shm_reuse() -> bool:
    """``MESHKIT_SHM_REUSE``: 1 (the default) or 0; see :data:`SHM_REUSE` and docs/collectives.md."""
    raw = _get(SHM_REUSE)
    value = (raw or "1").strip() or "1"
    if value not in ("0", "1"):
        raise invalid(SHM_REUSE, raw or "", "0 (each call through the segment takes the other buffers) or 1 (one "
                                            "right after another takes the same ones, in the cache; the default)")
    return value == "1"


def shm_bytes(name: str, default: int, *, multiple: int = 1, zero: bool = False, said: str | None = None) -> int:
    """One of the ``MESHKIT_SHM_*_BYTES`` settings: bytes, written as an integer or with a K, M or G
    suffix (binary multiples, an optional ``B``/``iB``, any case: ``512K``, ``4MiB``, as the benchmarks'
    ``--sizes``), at most 1 GiB, a multiple of ``multiple``, 0 allowed where ``zero``; ``default`` where
    unset or empty. ``said`` words the default in the error where it depends on more than this call
    knows (comm/engines/shm_settings.py)."""
    raw = _get(name)
    if raw is None or not raw.strip():
        return default
    least = 0 if zero else multiple
    match = _SIZE.match(raw)
    value = int(match.group(1)) * _SIZE_UNITS[match.group(2).upper()] if match else None
    if value is None or not least <= value <= _SHM_MOST_BYTES or value % multiple:
        also = f", a multiple of {multiple}" if multiple > 1 else ""
        raise invalid(name, raw, f"integers {least}..{_SHM_MOST_BYTES} (bytes, or with a K, M or G suffix: 512K, 4M{also}; "
                                 f"{said or f'default {default}'})")
    return value


def check_all() -> None:
    """Read every variable above, so that each one's error comes at ``init_process_group``."""
    debug_level()
    timeout()
    async_error_handling()
    cuda_aware_mpi()
    launched()
    device_id()
    trace_dir()
    job_secret()
    control_max_depth()
    shm_enabled()
    # (the MESHKIT_SHM_*_BYTES settings: comm/engines/shm_settings.check_all, which knows their defaults)
    shm_cma()
    positive_number(SURVIVE_LEARN_S, 0.25, upper=60.0)
    for name in (STORE_MAX_BYTES, STORE_MAX_CONNECTIONS, STORE_MAX_WAIT_KEYS):
        positive_number(name, 1, integer=True)
    for name in (STORE_IDLE_TIMEOUT, STORE_HANDSHAKE_TIMEOUT):
        positive_number(name, 1, upper=MAX_TIMEOUT_S)
