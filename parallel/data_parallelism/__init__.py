"""Data parallelism: every rank trains the whole model on its own batch, and gradients are averaged.

The strategies, all trained by one loop (:mod:`.protocol`) and built by :func:`data_parallel`
(:mod:`.factory`): :class:`DistributedDataParallel` (bucketed, overlapped gradient averaging:
:mod:`.reducer`, :mod:`.buckets`, :mod:`.pool`, with the communication hooks of :mod:`.hooks`),
:class:`ZeroRedundancyOptimizer` (ZeRO-1/2, on the same buckets) and
:class:`FullyShardedDataParallel` (ZeRO-3, and hybrid sharding on a 2-D mesh). The sharded two
keep flat shards (:mod:`.flat`) and share their state dicts and clipping (:mod:`.sharded`,
:mod:`.full_state`); :mod:`.construction` checks and broadcasts what every constructor is given,
:mod:`.dtensors` is how DTensor parameters (tensor parallel inside) are split and rewrapped.

Modules: ``protocol.py`` (the loop protocol every strategy shares), ``factory.py``
(``data_parallel``), ``reducer.py`` (``GradientReducer``, the part DDP and ZeRO hold), ``buckets.py``, ``hooks.py``
(communication hooks), ``ddp.py``, ``zero.py``, ``fsdp.py``, ``dtensors.py`` (DTensor parameters in the
strategies), ``flat.py``, ``sharded.py`` and ``full_state.py`` (flat shards, and what ZeRO and FSDP
share), ``construction.py`` (checks and broadcast at construction), ``pool.py`` (reused buffers).
"""

from .buckets import CommHook, GradBucket
from .ddp import DistributedDataParallel
from .factory import STRATEGIES, data_parallel
from .fsdp import FullyShardedDataParallel
from .hooks import PowerSGDState, allreduce_hook, fp16_compress_hook, powersgd_hook
from .zero import ZeroRedundancyOptimizer

__all__ = ["DistributedDataParallel", "ZeroRedundancyOptimizer", "FullyShardedDataParallel", "data_parallel",
           "STRATEGIES", "CommHook", "GradBucket", "allreduce_hook", "fp16_compress_hook", "PowerSGDState",
           "powersgd_hook"]
