"""Process groups and collective engines (MPI, NCCL, in-process); knows nothing of meshes."""

from .arrays import array_namespace, is_device_array
from .api import (P2POp, all_gather, all_gather_into_tensor, all_reduce, all_to_all, all_to_all_single,
                  barrier, batch_isend_irecv, broadcast, gather, irecv, isend, monitored_barrier, recv, reduce,
                  reduce_scatter, reduce_scatter_tensor, scatter, send)
from .debug import DebugLevel
from .errors import (CollectiveMismatchError, CollectiveTimeout, DistBackendError, DistError, DistTypeError,
                     DistValueError, RankFailedError)
from .group import ProcessGroup
from .objects import (ObjectCollectiveError, all_gather_object, broadcast_object_list, gather_object,
                      scatter_object_list)
from .reduce_op import ReduceOp
from .work import Work
from .prepared import PREPARED_OPS, PreparedCollective, prepare_collective
from .lifecycle import destroy_process_group, init_process_group
from .registry import (create_groups, get_backend, get_global_rank, get_group_rank, get_process_group_ranks,
                       get_rank, get_world_size, new_group, resolve_group)
from .world import current_world, flight_record, format_flight_record, is_initialized

__all__ = [
    "init_process_group", "destroy_process_group", "is_initialized", "get_rank", "get_world_size",
    "get_backend", "new_group", "get_group_rank", "get_global_rank", "get_process_group_ranks",
    "create_groups", "current_world", "resolve_group",
    "ProcessGroup", "ReduceOp", "Work", "P2POp", "PreparedCollective", "prepare_collective", "PREPARED_OPS",
    "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "gather", "scatter",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
    "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
    "DebugLevel", "flight_record", "format_flight_record", "is_device_array", "array_namespace",
    "DistError", "DistValueError", "DistTypeError", "DistBackendError", "CollectiveTimeout",
    "CollectiveMismatchError", "RankFailedError", "ObjectCollectiveError",
]
