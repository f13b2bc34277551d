"""``Composite``: several strategies over disjoint parameters, trained as one.

A model's parameters need not all be parallelized alike: a transformer's attention weights are
tensor-parallel DTensors averaged by DDP over the ranks holding other tokens, while its experts
(:class:`~meshkit.parallel.expert_parallelism.expert_strategy.ExpertStrategy`) come out of the
mixture-of-experts layer already reduced over the ranks that share them. A recipe builds each
part in order, as torchtitan's ``parallelize`` applies tensor, context and then data parallelism,
and ``Composite`` gives the loop, the checkpoint and the example one strategy of them::

    dense = data_parallel(parallelize_module(attn, mesh["tp"], plan), mesh["tokens"], "ddp", optimizer=...)
    model = Composite([dense, ExpertStrategy(expert_boxes, optimizer=..., group=stage_group)])
    loop.train(model, ...)                      # any Strategy: nothing dispatches on a class

A name's calls go to the part holding it; units are the parts' units in order; every collective
call (``zero_grad``, ``step``, the state dicts) goes to every part in order, so every rank must
compose the same parts in the same order (a pipeline stage's ranks: the same stage's parts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Iterator, Sequence

from ..comm import DistTypeError, DistValueError
from .checks import where
from .data_parallelism.full_state import FullStateDict, current_shape
from .data_parallelism.protocol import split_state_dict
from .strategy import Strategy

__all__ = ["Composite"]


class Composite:
    """Strategies over disjoint parameters as one :class:`~meshkit.parallel.strategy.Strategy`.

    Args:
        strategies: the parts, in order (each a ``Strategy``; None entries, a part this rank does
            not hold, are left out).

    Raises:
        DistTypeError: a part is not a ``Strategy`` (naming its type).
        DistValueError: no part, or a parameter name held by two parts (naming it).
    """

    _strategy = "Composite"

    def __init__(self, strategies: Sequence[Strategy | None]) -> None:
        parts = [s for s in strategies if s is not None]
        for s in parts:
            if not isinstance(s, Strategy):
                raise DistTypeError(f"{where(self._strategy)}: every part must be a meshkit.parallel.Strategy, got "
                                    f"{type(s).__name__}")
        if not parts:
            raise DistValueError(f"{where(self._strategy)}: needs at least one strategy")
        self.strategies: list[Strategy] = parts
        self._owner: dict[str, Strategy] = {}
        for s in parts:
            for name in s.params:
                if name in self._owner:
                    raise DistValueError(f"{where(self._strategy)}: parameter {name!r} is held by two parts "
                                         f"({type(self._owner[name]).__name__} and {type(s).__name__})")
                self._owner[name] = s
        self._units = [(s, u) for s in parts for u in range(len(s.units))]
        self.units: list[list[str]] = [list(s.units[u]) for s, u in self._units]

    @property
    def params(self) -> Mapping[str, Any]:
        """``{name: parameter}`` of every part, read-only (each part's own entries)."""
        return MappingProxyType({name: s.params[name] for name, s in self._owner.items()})

    def _part(self, unit: Any, op: str) -> tuple[Strategy, int]:
        if isinstance(unit, bool) or not isinstance(unit, int) or not 0 <= unit < len(self._units):
            raise DistValueError(f"{where(f'{self._strategy}.{op}')}: unknown unit {unit!r}; valid units are "
                                 f"0..{len(self._units) - 1}")
        return self._units[unit]

    def zero_grad(self) -> None:
        for s in self.strategies:
            s.zero_grad()

    def prefetch(self, unit: int) -> None:
        strategy, inner = self._part(unit, "prefetch")
        strategy.prefetch(inner)

    def unshard(self, unit: int) -> contextlib.AbstractContextManager[dict[str, Any]]:
        strategy, inner = self._part(unit, "unshard")
        return strategy.unshard(inner)

    def mark_grad_ready(self, name: str, grad: Any = None) -> None:
        try:
            owner = self._owner[name]
        except (KeyError, TypeError):
            raise DistValueError(f"{where(f'{self._strategy}.mark_grad_ready')}: unknown parameter {name!r}; valid "
                                 f"names are {list(self._owner)}") from None
        owner.mark_grad_ready(name, grad)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for s in self.strategies:
                stack.enter_context(s.no_sync())
            yield

    def step(self) -> None:
        for s in self.strategies:
            s.step()

    def state_dict(self) -> dict[str, Any]:
        """The parts' state dicts merged (their names are disjoint): ``{"model", "optim": {"state", "step"}}``."""
        merged: dict[str, Any] = {"model": {}, "optim": {"state": {}, "step": {}}}
        for s in self.strategies:
            sd = s.state_dict()
            merged["model"].update(sd["model"])
            for key in ("state", "step"):
                merged["optim"][key].update(sd["optim"][key])
        return merged

    def _split(self, sd: Mapping[str, Any], s: Strategy, keys: Sequence[str]) -> dict[str, Any]:
        """The entries of state dict ``sd`` of part ``s``'s parameters."""
        names = set(s.params)
        optim = sd.get("optim", {})
        return {"model": {n: v for n, v in sd["model"].items() if n in names},
                "optim": {k: {n: v for n, v in optim.get(k, {}).items() if n in names} for k in keys if k in optim}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Each part takes its parameters' entries."""
        model, _ = split_state_dict(f"{self._strategy}.load_state_dict", state_dict)
        unknown = sorted(set(model) - set(self._owner))
        if unknown:
            raise DistValueError(f"{where(f'{self._strategy}.load_state_dict')}: unknown parameters {unknown}; valid "
                                 f"names are {list(self._owner)}")
        for s in self.strategies:
            s.load_state_dict(self._split(state_dict, s, ("state", "step")))

    def full_state_dict(self, *, rank0_only: bool = False) -> FullStateDict | None:
        """The parts' full state dicts merged (collective over each part's ranks); ``optim["hyper"]``
        is left out, the parts' optimizers being their own."""
        merged = FullStateDict(model={}, optim={"state": {}, "step": {}})
        parts = [s.full_state_dict(rank0_only=rank0_only) for s in self.strategies]
        for sd in parts:
            if sd is not None:
                merged["model"].update(sd["model"])
                for key in ("state", "step"):
                    merged["optim"][key].update(sd["optim"][key])
        return None if all(sd is None for sd in parts) else merged

    def load_full_state_dict(self, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
        """Each part loads its parameters' entries (collective over each part's ranks)."""
        state_dict = current_shape(state_dict)
        model, _ = split_state_dict(f"{self._strategy}.load_full_state_dict", state_dict)
        unknown = sorted(set(model) - set(self._owner))
        if strict and unknown:
            raise DistValueError(f"{where(f'{self._strategy}.load_full_state_dict')}: unknown parameters {unknown} "
                                 f"(strict=True); valid names are {list(self._owner)}")
        for s in self.strategies:
            s.load_full_state_dict(self._split(state_dict, s, ("state", "step")), strict=strict)

    def memory_report(self) -> dict[str, int]:
        """Every part's bytes added up, key by key."""
        total: dict[str, int] = {}
        for s in self.strategies:
            for key, value in s.memory_report().items():
                total[key] = total.get(key, 0) + value
        return total
