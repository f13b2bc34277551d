"""Data-parallel training strategies built on meshes and process groups.

``DistributedDataParallel`` (bucketed, overlapped gradient averaging) and its communication
hooks; ``ZeroRedundancyOptimizer`` (ZeRO-1/2) on the same buckets; ``FullyShardedDataParallel``
(ZeRO-3, and hybrid sharding on a 2-D mesh), all trained by one loop (:mod:`.protocol`) and built
by :func:`data_parallel`; elementwise optimizers that update whole
parameters or any flat shard of them.

Every strategy runs on NumPy (host) or CuPy (device) parameters: the array library is taken from
the parameters' type (:func:`array_namespace`), and buckets, flat buffers, shards and optimizer
state are made with it, so a CuPy model's stay on its GPU. Mixing the two libraries in one call is
a ``TypeError`` naming both types.
"""

from .arrays import array_namespace, is_array, to_host
from .buckets import Bucket, BucketManager, CommHook, GradBucket, assign_buckets
from .clip import clip_grad_norm_
from .ddp import DistributedDataParallel
from .flat import FlatLayout
from .fsdp import FullyShardedDataParallel
from .hooks import PowerSGDState, allreduce_hook, fp16_compress_hook, powersgd_hook
from .optim import SGD, AdamW, Optimizer
from .pipeline import (PipelineError, PipelineSchedule, PipelineStage, Schedule1F1B, ScheduleGPipe,
                       ScheduleInterleaved1F1B)
from .schedules import bubble_fraction
from .pool import BufferPool
from .factory import STRATEGIES, data_parallel
from .reducer import GradientReducer
from .sharded import ShardedStrategy
from .sharded_state import ShardedArray, StepCount, flat_range_boxes, load_pieces, optimizer_state_views
from .zero import ZeroRedundancyOptimizer

__all__ = [
    "DistributedDataParallel", "ZeroRedundancyOptimizer", "FullyShardedDataParallel", "data_parallel", "STRATEGIES",
    "GradientReducer", "ShardedStrategy", "Bucket", "BucketManager", "CommHook", "BufferPool", "assign_buckets",
    "FlatLayout",
    "GradBucket", "allreduce_hook", "fp16_compress_hook", "PowerSGDState", "powersgd_hook",
    "PipelineStage", "PipelineSchedule", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
    "PipelineError", "bubble_fraction",
    "SGD", "AdamW", "Optimizer", "clip_grad_norm_", "array_namespace", "is_array", "to_host",
    "ShardedArray", "StepCount", "flat_range_boxes", "load_pieces", "optimizer_state_views",
]
