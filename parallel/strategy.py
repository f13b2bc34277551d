"""``Strategy``: the one type every parallel strategy is, declared as a ``typing.Protocol``.

One training loop serves every strategy (torch's users swap ``DDP(model)`` for ``fully_shard(model)``
and keep their loop), so what a loop, a checkpoint or an example may ask of a strategy is written
here once, as a type a checker and ``isinstance`` understand, rather than in prose::

    model: Strategy = data_parallel(params, mesh["dp"], "fsdp", optimizer=AdamW(lr=1e-3))
    for x, y in batches:
        model.zero_grad()
        for i in range(len(model.units)):            # forward, unit by unit
            with model.unshard(i) as p: ...
        for i in reversed(range(len(model.units))):  # backward, last unit first
            with model.unshard(i) as p: ...
            model.mark_grad_ready("w1", dw1)
        model.step()

Every strategy of the library implements all of it with these signatures:
:class:`~meshkit.parallel.DistributedDataParallel`, :class:`~meshkit.parallel.ZeroRedundancyOptimizer`
(stages 1 and 2), :class:`~meshkit.parallel.FullyShardedDataParallel` (HSDP on a 2-D mesh),
:class:`~meshkit.parallel.LocalStrategy` (the single-process reference), the experts of a
mixture-of-experts layer (:class:`~meshkit.parallel.ExpertStrategy`) and strategies composed of
others (:class:`~meshkit.parallel.Composite`). ``tests/test_strategy_protocol.py`` checks each of
them against this class (``isinstance`` and ``inspect.signature``, annotations aside).

The two state shapes are one (``{"model": ..., "optim": ...}``):

- ``state_dict()``: this rank's pieces, as views of the strategy's own memory (nothing is
  gathered): ``{"model": {name: value}, "optim": {"state": {name: {key: value}}, "step":
  {name: StepCount}}}``, where a value is an array (replicated), a list of
  :class:`~meshkit.state.ShardedArray` (a box of the global array) or a DTensor.
  ``load_state_dict`` takes that shape back; :mod:`meshkit.checkpoint` saves and loads it at any
  world size and across strategies.
- ``full_state_dict()``: the same keys, every array full size and NumPy, the same on every rank
  (collective), plus ``optim["hyper"]``; ``load_full_state_dict`` loads it into any strategy at
  any world size (each rank copies only its pieces). 0.1's shape (``{"params": ...}``) still loads,
  with a ``DeprecationWarning``.

``step()`` counts the optimizer steps in a :class:`Steps`, which tells ``meshkit-run`` when a
process took its first one (the ``FIRST_STEP`` milestone that times a restart), once, here.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

from ..comm._seams import FIRST_STEP, milestone

__all__ = ["Strategy", "Steps", "PROTOCOL_METHODS"]

#: The methods of :class:`Strategy`, in the order a reader meets them (its attributes: ``units``, ``params``).
PROTOCOL_METHODS = ("zero_grad", "prefetch", "unshard", "mark_grad_ready", "no_sync", "step", "state_dict",
                    "load_state_dict", "full_state_dict", "load_full_state_dict", "memory_report")


@runtime_checkable
class Strategy(Protocol):
    """What every parallel strategy answers, whatever it shards or how it communicates.

    Attributes:
        units: lists of parameter names; ``unshard(i)`` gives unit ``i`` (e.g. one layer).
        params: ``{name: parameter}`` as this rank holds it (the full parameters where every rank
            holds them; FSDP: this rank's 1-D pieces).
    """

    units: list[list[str]]
    params: Mapping[str, Any]

    def zero_grad(self) -> None:
        """Zero the gradients (they accumulate otherwise, as torch's ``.grad``)."""

    def prefetch(self, unit: int) -> None:
        """Start gathering ``unit`` early (a no-op where nothing is gathered)."""

    def unshard(self, unit: int) -> AbstractContextManager[dict[str, Any]]:
        """A context yielding ``{name: full parameter}`` of ``unit`` while it runs."""

    def mark_grad_ready(self, name: str, grad: Any = None) -> None:
        """Declare ``name``'s gradient ``grad`` final for this backward pass (its reduction may start)."""

    def no_sync(self) -> AbstractContextManager[None]:
        """A context in which gradients add up locally (gradient accumulation); nothing is reduced."""

    def step(self) -> None:
        """Finish the gradient sync and run the strategy's optimizer (collective)."""

    def state_dict(self) -> dict[str, Any]:
        """``{"model": ..., "optim": {"state", "step"}}``: this rank's pieces, as views (no communication)."""

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Take in a state dict of :meth:`state_dict`'s shape (views written in place are not copied)."""

    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, Any] | None:
        """``{"model": ..., "optim": {"state", "step", "hyper"}}`` full size, NumPy, on every rank
        (collective; with ``rank0_only`` the other ranks get None)."""

    def load_full_state_dict(self, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
        """Load a full state dict saved at any world size by any strategy (collective)."""

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds: ``params``, ``grads``, ``optimizer_state``, ``comm_buffers``, ``peak_transient``."""


class Steps:
    """The optimizer steps a strategy has taken (compared across ranks by the per-pass agreement).

    :meth:`taken` is called by every strategy's ``step()`` once its optimizer ran: the one place
    the ``FIRST_STEP`` milestone is fired (``meshkit-run`` times a restart's first step by it;
    the milestone itself fires once per process).
    """

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def taken(self) -> None:
        """One more step done."""
        self.count += 1
        milestone(FIRST_STEP)
