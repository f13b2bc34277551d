"""parallel's seams: what ``checkpoint`` needs of the strategies that is not user API.

The strategies' sharded state (:class:`ShardedStrategy`, :func:`load_pieces`,
:func:`optimizer_state_views`) and the array test :func:`is_array` are how ``get_state_dict`` and
``set_state_dict`` read and write a strategy's own memory; users reach them through those two.
(``load_pieces``, ``optimizer_state_views`` and ``is_array`` live below ``parallel`` now, in
``meshkit.state`` and ``meshkit.comm``; they stay importable from here.) ``plan`` reads the
bucket rule (:func:`assign_buckets`, ``MB``) and ZeRO-2's pool limit to predict memory_report exactly,
the per-pass agreement's size (:func:`agreement_size`: int32 elements for a group of n ranks) and the pipeline schedules' orders
of passes to list a step's collectives, sends and receives as they are issued.
"""

from ..comm._seams import is_array
from ..state._seams import load_pieces, optimizer_state_views
from .data_parallelism.buckets import MB, assign_buckets
from .data_parallelism.protocol import agreement_size
from .data_parallelism.sharded import ShardedStrategy
from .data_parallelism.zero import _BUFFERED_BUCKETS as ZERO2_BUFFERED_BUCKETS
from .pipelining.schedules import Action, gpipe_order, interleaved_order, one_f_one_b_order, zb_h1_order, zbv_order

__all__ = ["ShardedStrategy", "load_pieces", "optimizer_state_views", "is_array", "assign_buckets", "MB",
           "ZERO2_BUFFERED_BUCKETS", "agreement_size", "Action", "gpipe_order", "interleaved_order", "one_f_one_b_order", "zb_h1_order",
           "zbv_order"]
