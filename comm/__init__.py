"""Process groups and collective engines (MPI, NCCL, in-process); knows nothing of meshes.

``__all__`` is the user API (torch.distributed's names). What the other meshkit packages need of
comm beyond it (the world, group resolution, prepared collectives, the NumPy/CuPy rule) is in
:mod:`meshkit.comm._seams`.

comm lives in rooms, one per layer, so that a reader finds a module by what it is part of and
tests/test_structure.py can hold the layers apart: an engine (``engines/``) knows nothing of the
process group that drives it, a group (``groups/``) nothing of how the world was started
(``setup/``), and the stores (``stores/``) nothing of either. What every room shares (errors,
settings, the debug vocabulary, notices, control messages, the job's end) and what users call
(the module-level functions, ``local.run``) stay at the top: the shared leaves import no room,
the user-facing modules import any. The watchdog is an engine module, not a group one: it
guards the engine calls that have no deadline, and the engines use it. ``world.py`` is in the
group room: it holds the groups and the progress agent that the group's parts use; set-up makes
and ends it. The old flat paths (``meshkit.comm.mpi``) import for one more release, with a
``DeprecationWarning`` (:func:`~meshkit.comm._seams.moved_modules`).

The map, one line a module:

``engines/`` (what a group drives; imports only the shared leaves and ``stores/``)
    engine.py          the interface every engine implements, ``EngineCapabilities``, ``Request``
    mpi.py             the MPI engine (mpi4py): buffers in place, one request per call
    mpi_polling.py     how the MPI engine waits: poll, spin, yield, nap
    mpi_datatypes.py   NumPy dtypes and ReduceOps as MPI datatypes and ops, cached
    mpi_staging.py     device arrays through MPI: pinned host buffers, or CUDA-aware MPI
    mpi_cuda_aware.py  whether the MPI library reads device memory, asked once
    mpi_mailbox.py     the MPI world's notice channel
    mpi_ulfm.py        MPI's fault tolerance (ULFM): a dead rank as RankFailedError, Revoke, Shrink
    mpi_spares.py      meshkit-run --spares: idle processes that take a lost rank's place
    shm.py             the shared-memory path under MPI: a group on one node, through one segment
    shm_collectives.py its collectives: flags instead of barriers, a fixed reduction order
    shm_small.py       small and middle ordinary all_reduce/reduce_scatter in one meeting, no generator
    shm_segment.py     its segment: POSIX shared memory, created exclusively, unlinked once mapped
    shm_layout.py      its arithmetic: flags, headers and buffers in the segment, chunks, slices
    shm_cma.py         cross-memory attach: copies between ranks' own arrays (process_vm_readv/writev)
    shm_hierarchy.py   a group across nodes: all_reduce through each node's segment and MPI between leaders
    shm_host.py        what those two leave to the group's MPI engine, passed on
    shm_settings.py    its settings (MESHKIT_SHM_*), read without MPI
    nccl.py            the NCCL engine: device arrays over NCCL, the rest over its host engine
    nccl_requests.py   its requests: device work (watched until done), AVG of host arrays
    nccl_coalescing.py its ``batch_isend_irecv``: one NCCL group, done events at the outermost end
    nccl_abort.py      the guard of its communicator's handle, and its abort (also at exit)
    nccl_creation.py   the world's communicator: each rank's GPU, the unique id, NCCL's init
    local_engine.py    the in-process engine: ranks as threads of one process
    store_engine.py    a host engine over a key-value store, where no MPI launcher started the job
    cuda_runtime.py    the one door to CUDA (CuPy, NCCL): every GPU call goes through it
    watchdog.py        engine calls with no deadline: past the timeout, the process ends
``groups/`` (a process group and its parts; may import ``engines/``)
    group.py           ``ProcessGroup``: checks a call, numbers it, one call to its engine
    execution.py       ``CollectiveQueue``: numbering, starting, waiting, the in-flight queue
    failures.py        ``FailureState``: the failed call, the group broken, the others told
    work.py            ``Work`` and the per-group task thread
    p2p.py             ``isend``/``irecv`` and their Work
    progress.py        the progress agent: unwaited requests kept moving, the NCCL watchdog
    prepared.py        ``PreparedCollective``: checks done once per shape and dtype
    call_fingerprint.py  each group's calls as a fingerprint, compared at syncs
    world.py           one rank's state (groups, flight recorder), and the flight record's readers
``setup/`` (how a world starts and ends; may import both rooms above)
    lifecycle.py       ``init_process_group``/``destroy_process_group``
    survivors.py       ``shrink_world``: the world rebuilt over the survivors (``meshkit-run --survive``)
    init_methods.py    ``env://``, ``tcp://``, ``file://``, ``store=``: finding the other ranks
    backends.py        the backends' registry, ``Backend``, ``register_backend``
    registry.py        ``new_group``, the world's groups by rank set, rank translation
``stores/`` (torch's ``Store``: hash, file, TCP (server, wire, auth, limits), prefix)
the top, shared leaves (import no room)
    errors.py          meshkit's ``Dist*Error`` types
    env.py             every ``MESHKIT_*`` setting, read and validated
    debug.py           the debug level, call fingerprints, the flight recorder
    level_state.py     the level the next init uses, and a level switch's message
    reduce_op.py       ``ReduceOp``, the dtypes each accepts, their NumPy reference
    arrays.py          host or device, NumPy or CuPy: the rule every layer asks
    checks.py          argument checks shared by every engine
    notices.py         how a rank tells the others a call will never complete
    control.py         typed control messages between ranks (no pickle)
    job_end.py         ending the whole job
    milestones.py      the (re)start's milestones that ``meshkit-run`` times
    files.py           bounded reads of files the job wrote
    timeouts.py        the default timeout and how a user sets it
    naming.py          how every message names ranks (``rank 3``, ``ranks [0, 2]``)
the top, user-facing (may import any room)
    collectives.py     torch's module-level collectives
    objects.py         object collectives over the buffer ones
    local.py           ``local.run``: N ranks as threads of one process
    levels.py          ``set_debug_level`` and friends
    breakpoints.py     ``breakpoint(rank)``
    available.py       ``is_*_available()``
    agree.py           ``agree()``: every rank's arguments, or the same error on every rank
    _seams.py          what other meshkit packages need of comm; moved names and modules
"""

from ._seams import moved_modules, moved_names
from .setup.backends import Backend, BackendOptions, register_backend
from .available import is_available, is_mpi_available, is_nccl_available
from .collectives import (P2POp, all_gather, all_gather_into_tensor, all_reduce, all_to_all, all_to_all_single,
                  barrier, batch_isend_irecv, broadcast, gather, irecv, isend, monitored_barrier, recv, reduce,
                  reduce_scatter, reduce_scatter_tensor, scatter, send)
from .breakpoints import breakpoint
from .debug import DebugLevel
from .errors import (CollectiveMismatchError, CollectiveTimeout, DistBackendError, DistError, DistStoreError,
                     DistTypeError, DistValueError, RankFailedError)
from .groups.group import ProcessGroup
from .objects import (ObjectCollectiveError, all_gather_object, broadcast_object_list, gather_object,
                      scatter_object_list)
from .reduce_op import ReduceOp
from .stores import FileStore, HashStore, PrefixStore, Store, TCPStore
from .groups.work import Work
from .levels import get_debug_level, set_debug_level, set_debug_level_from_env
from .setup.lifecycle import destroy_process_group, init_process_group
from .setup.survivors import Shrunk, shrink_world
from .setup.registry import (get_backend, get_global_rank, get_group_rank, get_process_group_ranks, get_rank,
                       get_world_size, new_group)
from .groups.world import flight_record, format_flight_record, is_initialized

__all__ = [
    "init_process_group", "destroy_process_group", "shrink_world", "Shrunk", "is_initialized", "Backend", "BackendOptions", "register_backend", "is_available", "is_mpi_available",
    "is_nccl_available", "get_rank", "get_world_size",
    "get_backend", "new_group", "get_group_rank", "get_global_rank", "get_process_group_ranks",
    "ProcessGroup", "ReduceOp", "Work", "P2POp",
    "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "gather", "scatter",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
    "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
    "breakpoint", "DebugLevel", "set_debug_level", "get_debug_level", "set_debug_level_from_env", "flight_record",
    "format_flight_record",
    "DistError", "DistValueError", "DistTypeError", "DistBackendError", "CollectiveTimeout",
    "CollectiveMismatchError", "RankFailedError", "ObjectCollectiveError",
    "Store", "HashStore", "FileStore", "TCPStore", "PrefixStore", "DistStoreError",
]

#: Seams that were in ``__all__`` in 0.1: importable from here for one more release, with a warning.
_MOVED = {name: "meshkit.comm._seams" for name in (
    "PreparedCollective", "prepare_collective", "PREPARED_OPS", "create_groups", "resolve_group", "current_world",
    "array_namespace", "is_device_array")}
#: Modules that moved into comm's rooms (0.2): their old paths import, with a warning, for one release.
_ROOMS = {
    "engines": ("engine", "mpi", "mpi_polling", "mpi_datatypes", "mpi_staging", "mpi_cuda_aware", "mpi_mailbox",
                "nccl", "local_engine", "store_engine", "cuda_runtime", "watchdog"),
    "groups": ("group", "execution", "failures", "work", "p2p", "progress", "prepared", "call_fingerprint", "world"),
    "setup": ("lifecycle", "init_methods", "backends", "registry"),
}
_MOVED_MODULES = {f"{__name__}.{m}": f"{__name__}.{room}.{m}" for room, ms in _ROOMS.items() for m in ms}
moved_modules(_MOVED_MODULES)
__getattr__ = moved_names(__name__, _MOVED, _MOVED_MODULES)
