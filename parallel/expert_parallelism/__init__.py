"""Expert parallelism: a mixture-of-experts layer whose experts are split over an ``ep`` group.

:mod:`.routing` (top-k router, gates), :mod:`.exchange` (tokens to their experts' ranks and back
with ``all_to_all_single``, the capacity cut), :mod:`.experts` (the expert MLPs, row-blocked for
bitwise results), :mod:`.moe` (:class:`MoE`: forward, backward, gradient reduction over dp),
:mod:`.expert_strategy` (:class:`ExpertStrategy`: the experts' blocks as a strategy of the protocol).

Modules: ``routing.py`` (router scores, top-k experts, gates), ``exchange.py`` (token dispatch and
combine over ``ep``), ``experts.py`` (the expert MLPs, forward and backward), ``moe.py`` (the layer),
``expert_strategy.py`` (the experts' blocks as a strategy).
"""

from .exchange import DispatchPlan, expert_capacity
from .experts import ROW_BLOCK, blocked_matmul
from .moe import MoE, MoEContext, shard_experts
from .routing import Routing, route
from .expert_strategy import ExpertStrategy

__all__ = ["ExpertStrategy", "MoE", "MoEContext", "shard_experts", "expert_capacity"]
