"""Data-parallel training strategies built on meshes and process groups.

``DistributedDataParallel`` (bucketed, overlapped gradient averaging) and its communication
hooks; ``ZeroRedundancyOptimizer`` (ZeRO-1/2) on the same buckets; ``FullyShardedDataParallel``
(ZeRO-3, and hybrid sharding on a 2-D mesh), all trained by one loop (:mod:`.protocol`) and built
by :func:`data_parallel`; elementwise optimizers that update whole
parameters or any flat shard of them.

Every strategy runs on NumPy (host) or CuPy (device) parameters: the array library is taken from
the parameters' type (:func:`array_namespace`), and buckets, flat buffers, shards and optimizer
state are made with it, so a CuPy model's stay on its GPU. Mixing the two libraries in one call is
a ``TypeError`` naming both types. ``array_namespace`` and ``to_host`` are exported for model code
that runs on both (the examples' models use them).

``__all__`` is the user API; what ``checkpoint`` needs of the strategies beyond it is in
:mod:`meshkit.parallel._seams`, the rest of the machinery in its modules (``buckets``, ``flat``...).
"""

from ..comm._seams import moved_names
from .arrays import array_namespace, to_host
from .buckets import CommHook, GradBucket
from .clip import clip_grad_norm_
from .ddp import DistributedDataParallel
from .fsdp import FullyShardedDataParallel
from .hooks import PowerSGDState, allreduce_hook, fp16_compress_hook, powersgd_hook
from .optim import SGD, AdamW, Optimizer
from .pipeline import (PipelineError, PipelineSchedule, PipelineStage, Schedule1F1B, ScheduleGPipe,
                       ScheduleInterleaved1F1B)
from .schedules import bubble_fraction
from .factory import STRATEGIES, data_parallel
from .sharded_state import ShardedArray, StepCount
from .zero import ZeroRedundancyOptimizer

__all__ = [
    "DistributedDataParallel", "ZeroRedundancyOptimizer", "FullyShardedDataParallel", "data_parallel", "STRATEGIES",
    "CommHook", "GradBucket", "allreduce_hook", "fp16_compress_hook", "PowerSGDState", "powersgd_hook",
    "PipelineStage", "PipelineSchedule", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
    "PipelineError", "bubble_fraction",
    "SGD", "AdamW", "Optimizer", "clip_grad_norm_", "array_namespace", "to_host",
    "ShardedArray", "StepCount",
]

#: In ``__all__`` in 0.1, not user API: importable here one more release, with a warning naming the new place
#: (``_seams`` for what ``checkpoint`` uses, else the defining module).
__getattr__ = moved_names(__name__, {
    "GradientReducer": "meshkit.parallel.reducer", "Bucket": "meshkit.parallel.buckets",
    "BucketManager": "meshkit.parallel.buckets", "assign_buckets": "meshkit.parallel.buckets",
    "BufferPool": "meshkit.parallel.pool", "FlatLayout": "meshkit.parallel.flat",
    "flat_range_boxes": "meshkit.parallel.sharded_state", "ShardedStrategy": "meshkit.parallel._seams",
    "load_pieces": "meshkit.parallel._seams", "optimizer_state_views": "meshkit.parallel._seams",
    "is_array": "meshkit.parallel._seams"})
