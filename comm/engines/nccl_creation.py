"""The world's NCCL communicator: which GPU each rank drives, and the communicator's creation.

Collective over the world's host engine (MPI in a job, the in-process hub inside ``local.run``):
:func:`select_device` picks this rank's GPU and checks, as NCCL does, that no two ranks share one
it cannot share; :func:`create_world_engine` makes the unique id on rank 0, carries it over the host
engine (no rendezvous server) and builds the :class:`~meshkit.comm.engines.nccl.NCCLEngine` that
every sub-group then splits from.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from .. import env
from ..errors import DistBackendError, DistValueError
from .nccl import NCCLEngine, _version_text
from .watchdog import watched

__all__ = ["select_device", "create_world_engine", "DEVICE_ENV", "SHARE_ENV", "BLOCKING_ENV"]


#: Seconds the blocking steps of an NCCL world's creation (the node-local rank's split, NCCL's init)
#: may take at least under their watchdog, whatever is left of the deadline when they start: NCCL's
#: init connects every rank, seconds on a loaded node, and torch gives it the group's whole timeout.
_MIN_INIT_SECONDS = 30.0
#: The environment variable that names this rank's GPU (an index among the GPUs the process
#: sees), when ``init_process_group(device_id=...)`` does not.
DEVICE_ENV = env.DEVICE_ID
#: NCCL lets ranks of one communicator share a GPU from 2.30 on, with this variable set to 1
#: (before, init.cc refuses: "Duplicate GPU detected"). ``get_version()`` codes 2.30.0 as 23000.
SHARE_ENV = "NCCL_MULTI_RANK_GPU_ENABLE"
_SHARE_VERSION = 23000


#: NCCL's switch to nonblocking communicators (user guide, "Environment Variables"). With 0 every
#: NCCL call may return ncclInProgress (7) and be finished later; CuPy 14.2 cannot even report
#: that: ``NcclError(7)`` raises KeyError (its message table in nccl.pyx stops at 6; ncclTimeout,
#: 8 in NCCL 2.32, likewise), and its ``NcclConfig`` makes no nonblocking communicator. So the
#: variable is refused at init, on every rank, naming it.
BLOCKING_ENV = "NCCL_COMM_BLOCKING"
#: Where NCCL reads the boot id that, with the host name, tells hosts apart (NCCL's getHostHash);
#: ``NCCL_HOSTID`` replaces both.
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _blocking_refusal() -> str | None:
    """Why :data:`BLOCKING_ENV` is refused here, or None (unset, empty, or a non-zero integer)."""
    raw = os.environ.get(BLOCKING_ENV)
    if raw is None or not raw.strip():
        return None
    try:
        if int(raw.strip()) != 0:
            return None
    except ValueError:
        pass  # NCCL reads it with strtoll: text that is no number is 0, nonblocking
    return (f"{BLOCKING_ENV}={raw!r} asks NCCL for nonblocking communicators, which CuPy cannot drive (its "
            f"NcclError cannot even report NCCL's ncclInProgress); valid values are unset or 1 (blocking, "
            f"NCCL's default): unset {BLOCKING_ENV}")


def _host_key() -> tuple[str, str]:
    """``(key, name)`` of this machine as NCCL tells hosts apart when it looks for a GPU used twice
    (src/misc/utils.cc getHostHash: ``NCCL_HOSTID``, else the host name and the boot id): the
    machine's own name, not a simulated one (``MESHKIT_HOST_NAME``), since GPUs are the machine's."""
    name = socket.gethostname()
    given = os.environ.get("NCCL_HOSTID")
    if given:
        return given, name
    try:
        with open(_BOOT_ID) as f:
            boot = f.read().strip()
    except OSError:  # no boot id (not Linux): NCCL falls back on the host name alone
        boot = ""
    return f"{name}{boot}", name


def select_device(host: Any, rt: Any, deadline: float, device_id: int | None = None) -> int:
    """This rank's GPU: collective over ``host`` (the world's host engine).

    In order: ``device_id`` (``init_process_group(device_id=...)``), else :data:`DEVICE_ENV`,
    else the node-local rank (the host engine's ``local_rank()``: the launcher's local rank, or
    MPI's shared-memory split) modulo the GPUs this process sees, so that one visible GPU per
    rank (``CUDA_VISIBLE_DEVICES`` per task, Slurm's ``--gpus-per-task=1``) gives every rank its
    device 0. Ranks then compare their GPUs as NCCL does (the PCI bus id on the same host: see
    ``CupyRuntime.pci_bus_id``): two ranks on one physical GPU need NCCL >= 2.30 with
    ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (:data:`SHARE_ENV`); otherwise every rank raises, naming them.
    In the same exchange every rank learns whether any refuses :data:`BLOCKING_ENV`.

    Raises:
        DistValueError: ``device_id`` or :data:`DEVICE_ENV` is not a device this process sees.
        DistBackendError: no usable GPU or driver, ranks would share a GPU that the NCCL in use
            cannot share, or a rank has :data:`BLOCKING_ENV` set to 0.
    """
    me = host.rank
    try:
        count = rt.device_count()
    except Exception as exc:  # CUDARuntimeError: no driver (cudaErrorInsufficientDriver), no device, a broken one
        count, why = 0, f"{type(exc).__name__}: {exc}"
    else:
        why = "CuPy sees no GPU"
    if count < 1:
        raise DistBackendError(f"meshkit.comm: rank {me}: the nccl backend found no usable GPU or driver here "
                               f"({why}); use the mpi backend: init_process_group('mpi'), or backend='auto', "
                               "which takes mpi where no GPU is usable")
    source = "device_id"
    if device_id is None and env.device_id() is not None:
        source, device_id = DEVICE_ENV, env.device_id()
    if device_id is None:
        with watched("the node-local rank (MPI's Split_type)", me, "world", range(host.size),
                     max(deadline - time.monotonic(), _MIN_INIT_SECONDS)):
            device = host.local_rank() % count
    else:
        try:
            device = int(device_id)
            valid = 0 <= device < count and not isinstance(device_id, (bool, float))
        except (TypeError, ValueError):
            valid = False
        if not valid:
            raise DistValueError(f"meshkit.comm: rank {me}: {source}={device_id!r} is not a GPU of this process; "
                                 f"valid devices are 0..{count - 1} ({count} visible)")
    key, name = _host_key()
    seen = host.exchange((key, f"PCI {rt.pci_bus_id(device)} of host {name}", _blocking_refusal()), -4, deadline)
    refused = [r for r, (_, _, refusal) in enumerate(seen) if refusal is not None]
    if refused:
        raise DistBackendError(f"meshkit.comm: rank {me}: ranks {refused} refuse the nccl backend: "
                               f"{seen[refused[0]][2]}")
    gpus = [(k, gpu) for k, gpu, _ in seen]
    shared = {u: [r for r, v in enumerate(gpus) if v == u] for u in gpus}
    crowded = {u: ranks for u, ranks in shared.items() if len(ranks) > 1}
    if crowded:
        version = rt.nccl.get_version()
        if version < _SHARE_VERSION or os.environ.get(SHARE_ENV) != "1":
            ranks = crowded.get(gpus[me]) or next(iter(crowded.values()))
            need = (f"set {SHARE_ENV}=1 (NCCL {_version_text(version)} can share)" if version >= _SHARE_VERSION
                    else f"NCCL >= 2.30 with {SHARE_ENV}=1 (this is NCCL {_version_text(version)})")
            raise DistBackendError(
                f"meshkit.comm: rank {me}: ranks {ranks} would share one GPU ({gpus[ranks[0]][1]}); NCCL refuses "
                f"that (\"Duplicate GPU detected\"). Give each rank its own GPU (CUDA_VISIBLE_DEVICES per rank, "
                f"init_process_group(device_id=...) or {DEVICE_ENV}), start fewer ranks per node, use the mpi "
                f"backend, or {need}")
    return device


def create_world_engine(host: Any, rt: Any, deadline: float, device_id: int | None = None) -> NCCLEngine:
    """The world's NCCL engine over the world's host engine (collective over it).

    The device comes from :func:`select_device`; rank 0 makes the unique id and the host engine
    carries it to the others.
    """
    device = select_device(host, rt, deadline, device_id)
    rt.use_device(device)
    uid = rt.nccl.get_unique_id() if host.rank == 0 else None
    uid = host.exchange(uid, -3, deadline)[0]
    limit = max(deadline - time.monotonic(), _MIN_INIT_SECONDS)
    with watched("NCCL's communicator init (ncclCommInitRank)", host.rank, "world", range(host.size), limit):
        comm = rt.nccl.NcclCommunicator(host.size, uid, host.rank)
    return NCCLEngine(host, comm, rt, device)

