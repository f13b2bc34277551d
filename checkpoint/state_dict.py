"""get_state_dict / set_state_dict: one state dict form for every strategy, as views.

The keys never depend on the strategy or the world size (the shape of every strategy's
``state_dict()``, :mod:`meshkit.parallel.strategy`, as two dicts)::

    model_state_dict = {name: value}
    optim_state_dict = {"state": {name: {"exp_avg": value, ...}}, "step": {name: StepCount}}

where a value is an array (replicated: DDP, one process), a list of
:class:`~meshkit.parallel.ShardedArray` (ZeRO's and FSDP's flat shards, cut into boxes) or a
:class:`~meshkit.tensor.DTensor` (tensor-parallel parameters), always a view of the strategy's
own memory: nothing is gathered, and loading a checkpoint into these dicts writes the model. A
step count is a :class:`~meshkit.parallel.StepCount`, the optimizer's count read through, so a
dict built once is current whenever it is saved, and loading into it sets the optimizer's count.
The optimizer's state is materialized (zeros at step 0) if it has not stepped yet, so a
checkpoint loads into a freshly built strategy before its first step.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Sequence

from ..parallel import Optimizer, StepCount, Strategy
from ..parallel._seams import load_pieces, optimizer_state_views
from ..tensor import DTensor
from ..tensor._seams import block_like
from .errors import CheckpointError

__all__ = ["get_state_dict", "set_state_dict"]


def get_state_dict(strategy: Strategy | Mapping[str, Any], optimizers: Optimizer | Sequence[Optimizer] | None = None
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model_state_dict, optim_state_dict)`` of ``strategy`` as views (torch's name).

    Args:
        strategy: any :class:`~meshkit.parallel.Strategy` (``DistributedDataParallel``,
            ``ZeroRedundancyOptimizer``, ``FullyShardedDataParallel``/HSDP, ``LocalStrategy``,
            ``ExpertStrategy``, a ``Composite`` of them), whose optimizer is its own: its
            ``state_dict()``; or a mapping of parameters (arrays or DTensors: one process, or
            tensor parallelism).
        optimizers: the optimizer a mapping of parameters is stepped with. For a strategy,
            deprecated (the strategy's optimizer is used; a DDP built without one takes it here).
    """
    optimizer = _one_optimizer(strategy, optimizers, "get_state_dict")
    if isinstance(strategy, Mapping):
        params = dict(strategy)
        return params, _params_optim_views(optimizer, params) if optimizer is not None else {"state": {}, "step": {}}
    sd = strategy.state_dict()
    if optimizer is not None:  # a strategy built without an optimizer (deprecated): the one given, as for a dict
        return sd["model"], _params_optim_views(optimizer, dict(sd["model"]))
    return sd["model"], sd["optim"]


def set_state_dict(strategy: Strategy | Mapping[str, Any], optimizers: Optimizer | Sequence[Optimizer] | None = None,
                   *, model_state_dict: dict[str, Any], optim_state_dict: dict[str, Any]) -> None:
    """Take ``model_state_dict`` and ``optim_state_dict`` into ``strategy`` (torch's name).

    Pieces that are already ``strategy``'s own views (a checkpoint loaded in place into
    :func:`get_state_dict`'s dicts) are not copied again; the step counts are set and the
    strategy refreshes what derives from its shards (its ``load_state_dict``). Collective for
    ZeRO and FSDP. ``optimizers`` as :func:`get_state_dict`'s.

    Raises:
        DistValueError: a key, box or step that does not match ``strategy``.
    """
    optimizer = _one_optimizer(strategy, optimizers, "set_state_dict")
    if not isinstance(strategy, Mapping):
        if optimizer is None:
            strategy.load_state_dict({"model": model_state_dict, "optim": optim_state_dict})
            return
        # a strategy built without an optimizer (deprecated): its parameters, then the one given, as for a dict
        strategy.load_state_dict({"model": model_state_dict, "optim": {}})
        _load_optimizer(optimizer, dict(strategy.state_dict()["model"]), optim_state_dict)
        return
    params = dict(strategy)
    load_pieces("set_state_dict", "model", {k: _local(v) for k, v in params.items()},
                {k: _local(v) for k, v in model_state_dict.items()})
    if optimizer is not None:
        _load_optimizer(optimizer, params, optim_state_dict)


def _load_optimizer(optimizer: Optimizer, params: dict[str, Any], optim_state_dict: dict[str, Any]) -> None:
    mine = _params_optim_views(optimizer, params)
    load_pieces("set_state_dict", "optim.state", _locals(mine["state"]), _locals(optim_state_dict["state"]))
    optimizer.steps.update({k: int(v) for k, v in optim_state_dict["step"].items()})


def _one_optimizer(strategy: Strategy | Mapping[str, Any], optimizers: Any, op: str) -> Optimizer | None:
    """The optimizer to use besides the strategy's state dict: None (the strategy's own) but for a
    mapping of parameters and the deprecated ``get_state_dict(ddp, optimizer)`` of a DDP built without one."""
    if isinstance(optimizers, (list, tuple)):
        if len(optimizers) != 1:
            raise CheckpointError(f"meshkit.checkpoint: {op}: optimizers must be one Optimizer (or a one-element "
                                  f"list), got {len(optimizers)}")
        optimizers = optimizers[0]
    if not isinstance(strategy, (Mapping, Strategy)):
        raise CheckpointError(f"meshkit.checkpoint: {op}: strategy must be a meshkit.parallel.Strategy "
                              "(DistributedDataParallel, ZeroRedundancyOptimizer, FullyShardedDataParallel, ...) or a "
                              f"dict of parameters, got {type(strategy).__name__}")
    if optimizers is not None and not isinstance(optimizers, Optimizer):
        raise CheckpointError(f"meshkit.checkpoint: {op}: optimizers must be a meshkit Optimizer, got "
                              f"{type(optimizers).__name__}")
    if isinstance(strategy, Mapping) or optimizers is None:
        return optimizers
    # the strategy's own optimizers: those its step counts read (StepCount declares its optimizer)
    own = {id(c.optimizer): c.optimizer for c in strategy.state_dict()["optim"]["step"].values()
           if isinstance(c, StepCount)}
    if not own:  # a DDP built without optimizer=: today's spelling
        _deprecated(op, "build the strategy with optimizer= and call {op}(strategy)")
        return optimizers
    if id(optimizers) not in own:
        raise CheckpointError(f"meshkit.checkpoint: {op}: a {type(strategy).__name__} holds its optimizer; pass "
                              "optimizers=None")
    _deprecated(op, "call {op}(strategy): the optimizer is the strategy's")
    return None


def _deprecated(op: str, new: str) -> None:
    """The old spelling ``op(strategy, optimizers)``: warn at the caller of ``op``."""
    warnings.warn(f"meshkit.checkpoint.{op}(strategy, optimizers) is deprecated; {new.format(op=op)}",
                  DeprecationWarning, stacklevel=4)


def _params_optim_views(optimizer: Optimizer, params: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state of a dict of parameters: arrays shaped like them, DTensors for DTensors."""
    plain = {k: v for k, v in params.items() if not isinstance(v, DTensor)}
    out = optimizer_state_views(optimizer, plain)
    for name, p in params.items():
        if isinstance(p, DTensor):
            local = p.to_local()
            st = optimizer.materialize(name, local.reshape(-1))
            out["state"][name] = {key: block_like(arr.reshape(local.shape), p) for key, arr in st.items()}
            out["step"][name] = StepCount(optimizer, name)
    return {"state": {k: out["state"][k] for k in params}, "step": {k: out["step"][k] for k in params}}


def _local(v: Any) -> Any:
    return v.to_local() if isinstance(v, DTensor) else v


def _locals(state: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {k: {key: _local(v) for key, v in st.items()} for k, st in state.items()}
