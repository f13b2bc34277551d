"""Process groups and collective engines (MPI, NCCL, in-process); knows nothing of meshes.

``__all__`` is the user API (torch.distributed's names). What the other meshkit packages need of
comm beyond it (the world, group resolution, prepared collectives, the NumPy/CuPy rule) is in
:mod:`meshkit.comm._seams`.
"""

from ._seams import moved_names
from .backends import Backend, BackendOptions, register_backend
from .available import is_available, is_mpi_available, is_nccl_available
from .collectives import (P2POp, all_gather, all_gather_into_tensor, all_reduce, all_to_all, all_to_all_single,
                  barrier, batch_isend_irecv, broadcast, gather, irecv, isend, monitored_barrier, recv, reduce,
                  reduce_scatter, reduce_scatter_tensor, scatter, send)
from .breakpoints import breakpoint
from .debug import DebugLevel
from .errors import (CollectiveMismatchError, CollectiveTimeout, DistBackendError, DistError, DistStoreError,
                     DistTypeError, DistValueError, RankFailedError)
from .group import ProcessGroup
from .objects import (ObjectCollectiveError, all_gather_object, broadcast_object_list, gather_object,
                      scatter_object_list)
from .reduce_op import ReduceOp
from .stores import FileStore, HashStore, PrefixStore, Store, TCPStore
from .work import Work
from .levels import get_debug_level, set_debug_level, set_debug_level_from_env
from .lifecycle import destroy_process_group, init_process_group
from .registry import (get_backend, get_global_rank, get_group_rank, get_process_group_ranks, get_rank,
                       get_world_size, new_group)
from .world import flight_record, format_flight_record, is_initialized

__all__ = [
    "init_process_group", "destroy_process_group", "is_initialized", "Backend", "BackendOptions", "register_backend", "is_available", "is_mpi_available",
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
__getattr__ = moved_names(__name__, _MOVED)
