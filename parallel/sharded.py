"""What ZeRO and FSDP share: flat shards on every rank, and the same surface over them.

Both keep each rank's parameters, gradients and optimizer state as flat shards
(:class:`~meshkit.parallel.flat.FlatLayout`), so state dicts, gradient clipping and the memory
report are the same code: :class:`ShardedStrategy`. State dicts are per parameter name and
independent of the world size, so a state saved at one world size loads at another.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..comm import ProcessGroup
from .clip import clip_grad_norm_
from .flat import FlatLayout
from .optim import Optimizer

__all__ = ["ShardedStrategy", "gather_state_dict", "load_state_dict_into"]


class ShardedStrategy:
    """State dicts, gradient shards, clipping and memory report over flat shards.

    Subclasses set ``optimizer`` and define ``_shard_group`` (the group the shards are split
    over), ``_layouts``, ``_param_shards`` (this rank's parameter shard per layout key; writing
    them writes the parameters), ``_local_grad_shards`` and ``_footprint``; ``_settle`` (finish
    what is pending before shards are read) and ``_loaded`` (after a load wrote the parameter
    shards) are optional.
    """

    optimizer: Optimizer
    _strategy = "ShardedStrategy"

    def _shard_group(self) -> ProcessGroup:
        raise NotImplementedError

    def _layouts(self) -> list[FlatLayout]:
        raise NotImplementedError

    def _param_shards(self) -> dict[str, Any]:
        raise NotImplementedError

    def _local_grad_shards(self) -> dict[str, Any]:
        raise NotImplementedError

    def _footprint(self) -> tuple[int, int, int, int]:
        """Bytes of (parameters, gradients, communication buffers, peak transient buffers)."""
        raise NotImplementedError

    def _settle(self, op: str) -> None:
        """Before shards are read by ``op``: finish what is pending."""

    def _loaded(self) -> None:
        """After ``load_full_state_dict`` wrote this rank's parameter shards."""

    # ------------------------------------------------------------------ the surface
    def grad_shards(self) -> dict[str, Any]:
        """This rank's averaged gradient shard per flat key."""
        self._settle("grad_shards")
        return self._local_grad_shards()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the gradients by their global norm (the single-process value), before ``step()``."""
        self._settle("clip_grad_norm_")
        return clip_grad_norm_(self._local_grad_shards(), max_norm, norm_type=norm_type, group=self._shard_group())

    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, Any] | None:
        """Parameters and optimizer state gathered to full size, per parameter name (collective).

        The result does not depend on the world size, so :meth:`load_full_state_dict` accepts it
        at any other. With ``rank0_only`` the other ranks get None.
        """
        self._settle("full_state_dict")
        group = self._shard_group()
        sd = gather_state_dict(self._layouts(), self._param_shards(), self.optimizer, group)
        return None if rank0_only and group.rank != 0 else sd

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict (from ``full_state_dict``, at any world size) into the shards."""
        self._settle("load_full_state_dict")
        load_state_dict_into(self._layouts(), state_dict, self._param_shards(), self.optimizer,
                             self._shard_group().rank, self._strategy)
        self._loaded()

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds: ``params``, ``grads``, ``optimizer_state``, ``comm_buffers``
        (buffers held now for communication) and ``peak_transient`` (the most ever held at once)."""
        params, grads, comm, peak = self._footprint()
        return {"params": params, "grads": grads, "optimizer_state": self.optimizer.state_nbytes(),
                "comm_buffers": comm, "peak_transient": peak}


def gather_state_dict(layouts: Sequence[FlatLayout], shards: dict[str, Any], optimizer: Any,
                      group: ProcessGroup) -> dict[str, Any]:
    """Full per-parameter state from every rank's flat shards; collective over ``group``.

    Returns ``{"params": {name: array}, "optimizer": {"steps": {name: int}, "state": {name:
    {key: array}}, "hyper": {...}}}``: nothing in it depends on the world size.
    """
    params: dict[str, Any] = {}
    steps: dict[str, int] = {}
    state: dict[str, dict[str, Any]] = {}
    for layout in layouts:
        params.update(layout.split(layout.gather_full(shards[layout.key], group)))
        for key, flat in sorted(optimizer.state.get(layout.key, {}).items()):
            for name, value in layout.split(layout.gather_full(flat, group)).items():
                state.setdefault(name, {})[key] = value.reshape(-1)
        if layout.key in optimizer.steps:
            steps.update({name: optimizer.steps[layout.key] for name in layout.names})
    return {"params": params, "optimizer": {"steps": steps, "state": state, "hyper": optimizer.hyper}}


def load_state_dict_into(layouts: Sequence[FlatLayout], state_dict: dict[str, Any], shards: dict[str, Any],
                         optimizer: Any, shard: int, who: str) -> None:
    """Copy this rank's shard of a full state dict (from any world size) into ``shards`` and
    the optimizer's per-key state."""
    params = state_dict.get("params", {})
    expected = [n for layout in layouts for n in layout.names]
    missing, extra = [n for n in expected if n not in params], sorted(set(params) - set(expected))
    if missing or extra:
        raise ValueError(f"meshkit.parallel: {who}.load_full_state_dict: parameters differ from the model's: "
                         f"missing {missing}, unexpected {extra}")
    for layout in layouts:
        for i, name in enumerate(layout.names):
            if tuple(params[name].shape) != layout.shapes[i]:
                raise ValueError(f"meshkit.parallel: {who}.load_full_state_dict: parameter {name!r} has shape "
                                 f"{tuple(params[name].shape)}, the model's is {layout.shapes[i]}")
    opt = state_dict.get("optimizer", {})
    for key, value in opt.get("hyper", {}).items():
        setattr(optimizer, key, value)
    for layout in layouts:
        lo, hi = layout.shard_range(shard)
        target = shards[layout.key]
        target[...] = layout.pack(params, target)[lo:hi]
        per_param = {n: opt.get("state", {}).get(n, {}) for n in layout.names}
        keys = sorted({k for s in per_param.values() for k in s})
        optimizer.state.pop(layout.key, None)
        optimizer.steps.pop(layout.key, None)
        if keys:
            optimizer.state[layout.key] = {
                k: layout.pack({n: s[k] for n, s in per_param.items() if k in s}, target)[lo:hi].copy() for k in keys}
        counts = {opt.get("steps", {}).get(n) for n in layout.names} - {None}
        if counts:
            optimizer.steps[layout.key] = max(counts)
