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

The package is arranged by family: :mod:`.data_parallelism` (the strategies and their machinery),
:mod:`.pipelining` (pipeline stages and schedules), :mod:`.context_parallelism` (ring and all-to-all
attention over a sequence sharded on a ``cp`` group), :mod:`.expert_parallelism` (a mixture-of-experts
layer over ``ep``), :mod:`.optim` (optimizers, clipping); what
they share is here (:mod:`.arrays`, :mod:`.checks`). ``ShardedArray``/``StepCount``, what a
strategy's state dict holds, are :mod:`meshkit.state`'s, re-exported.

``__all__`` is the user API (every name importable from here, re-exported from its family); what
``checkpoint`` needs of the strategies beyond it is in :mod:`meshkit.parallel._seams`, the rest of
the machinery in the families' modules (``data_parallelism.buckets``, ``data_parallelism.flat``...).

Modules: by family, a subpackage each: ``data_parallelism/`` (DDP, ZeRO, FSDP/HSDP),
``pipelining/``, ``context_parallelism/``, ``expert_parallelism/``, ``optim/`` (optimizers, clipping);
shared by the families: ``arrays.py`` (NumPy and CuPy conversions), ``checks.py``, ``_seams.py``,
``forwarding.py`` (``forward_to``: a strategy's member that is a part's own, as DDP's ``mark_grad_ready`` is
its reducer's);
the one type every strategy implements, ``strategy.py`` (``Strategy``), and the library's own:
``local_strategy.py`` (``LocalStrategy``, the single-process reference) and ``composite.py``
(``Composite``: several strategies over disjoint parameters as one); ``recipe.py``
(``parallelize_model``: tensor, then context, then data parallelism on a named mesh, one Strategy);
``survive.py`` (``survive.shrink``: a strategy rebuilt on the survivors of a rank failure,
``meshkit-run --survive``) and ``buddy.py`` (``BuddyCopy``: each rank's copy of its neighbour's
shards, from which ``shrink`` rebuilds sharded state), kept within a node in the neighbour's
shared-memory segment by ``buddy_shared.py``.
"""

from ..comm._seams import moved_names
from ..state import ShardedArray, StepCount
from .arrays import array_namespace, to_host
from .data_parallelism import (STRATEGIES, CommHook, DistributedDataParallel, FullyShardedDataParallel, GradBucket,
                            PowerSGDState, ZeroRedundancyOptimizer, allreduce_hook, data_parallel, fp16_compress_hook,
                            powersgd_hook)
from .expert_parallelism import ExpertStrategy, MoE, MoEContext, expert_capacity, shard_experts
from .context_parallelism import (RingAttentionContext, SequenceSharding, UlyssesContext, ring_attention,
                                  ring_attention_backward, sequence_positions, shard_sequence, ulysses_attention,
                                  ulysses_attention_backward, unshard_sequence)
from .optim import SGD, AdamW, Optimizer, clip_grad_norm_
from .strategy import Strategy
from .composite import Composite
from .recipe import parallelize_model
from .local_strategy import LocalStrategy
from .pipelining import (PipelineError, PipelineSchedule, PipelineStage, Schedule1F1B, ScheduleGPipe,
                         ScheduleInterleaved1F1B, ScheduleZBH1, ScheduleZBVZeroBubble, bubble_fraction)

__all__ = [
    "Strategy", "LocalStrategy", "Composite", "parallelize_model", "ExpertStrategy", "DistributedDataParallel", "ZeroRedundancyOptimizer", "FullyShardedDataParallel", "data_parallel", "STRATEGIES",
    "CommHook", "GradBucket", "allreduce_hook", "fp16_compress_hook", "PowerSGDState", "powersgd_hook",
    "PipelineStage", "PipelineSchedule", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
    "ScheduleZBH1", "ScheduleZBVZeroBubble", "PipelineError", "bubble_fraction",
    "ring_attention", "ring_attention_backward", "RingAttentionContext", "ulysses_attention",
    "ulysses_attention_backward", "UlyssesContext", "SequenceSharding", "shard_sequence", "unshard_sequence",
    "sequence_positions",
    "SGD", "AdamW", "Optimizer", "clip_grad_norm_", "array_namespace", "to_host",
    "ShardedArray", "StepCount", "MoE", "MoEContext", "shard_experts", "expert_capacity",
]

#: In ``__all__`` in 0.1, not user API: importable here one more release, with a warning naming the new place
#: (``_seams`` for what ``checkpoint`` uses, else the defining module).
__getattr__ = moved_names(__name__, {
    "GradientReducer": "meshkit.parallel.data_parallelism.reducer",
    "Bucket": "meshkit.parallel.data_parallelism.buckets", "BucketManager": "meshkit.parallel.data_parallelism.buckets",
    "assign_buckets": "meshkit.parallel.data_parallelism.buckets",
    "BufferPool": "meshkit.parallel.data_parallelism.pool",
    "FlatLayout": "meshkit.parallel.data_parallelism.flat",
    "flat_range_boxes": "meshkit.state._seams", "ShardedStrategy": "meshkit.parallel._seams",
    "load_pieces": "meshkit.parallel._seams", "optimizer_state_views": "meshkit.parallel._seams",
    "is_array": "meshkit.parallel._seams"})
