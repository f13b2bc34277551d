"""Data-parallel training strategies built on meshes and process groups.

``DistributedDataParallel`` (bucketed, overlapped gradient averaging) and its communication
hooks; ``ZeroRedundancyOptimizer`` (ZeRO-1/2) on the same buckets; ``FullyShardedDataParallel``
(ZeRO-3, and hybrid sharding on a 2-D mesh); elementwise optimizers that update whole
parameters or any flat shard of them.
"""

from .arrays import array_namespace
from .buckets import Bucket, BucketManager, CommHook, GradBucket, assign_buckets
from .clip import clip_grad_norm_
from .ddp import DistributedDataParallel
from .flat import FlatLayout
from .fsdp import FullyShardedDataParallel
from .hooks import PowerSGDState, allreduce_hook, fp16_compress_hook, powersgd_hook
from .optim import SGD, AdamW, Optimizer
from .pool import BufferPool
from .reducer import GradientReducer
from .sharded import ShardedStrategy
from .zero import ZeroRedundancyOptimizer

__all__ = [
    "DistributedDataParallel", "ZeroRedundancyOptimizer", "FullyShardedDataParallel",
    "GradientReducer", "ShardedStrategy", "Bucket", "BucketManager", "CommHook", "BufferPool", "assign_buckets",
    "FlatLayout",
    "GradBucket", "allreduce_hook", "fp16_compress_hook", "PowerSGDState", "powersgd_hook",
    "SGD", "AdamW", "Optimizer", "clip_grad_norm_", "array_namespace",
]
