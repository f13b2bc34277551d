"""Data-parallel training strategies built on meshes and process groups.

``DistributedDataParallel`` (bucketed, overlapped gradient averaging), its communication hooks,
and elementwise optimizers that update whole parameters or any flat shard of them.
"""

from .buckets import Bucket, BucketManager, assign_buckets
from .ddp import DistributedDataParallel
from .hooks import GradBucket, PowerSGDState, allreduce_hook, fp16_compress_hook, powersgd_hook
from .optim import SGD, AdamW, Optimizer, array_namespace, clip_grad_norm_

__all__ = [
    "DistributedDataParallel", "Bucket", "BucketManager", "assign_buckets",
    "GradBucket", "allreduce_hook", "fp16_compress_hook", "PowerSGDState", "powersgd_hook",
    "SGD", "AdamW", "Optimizer", "clip_grad_norm_", "array_namespace",
]
