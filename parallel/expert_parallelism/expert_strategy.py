"""``ExpertStrategy``: the strategy of parameters whose gradients come out of their layer reduced.

A mixture-of-experts layer (:class:`~meshkit.parallel.expert_parallelism.moe.MoE`) reduces its
router's and its experts' gradients itself, over the ranks that share them (``dp``, and ``ep``
for the router), so no data-parallel strategy may average them again. Each rank holds blocks of
the global arrays (``ep``: which experts; ``tp``: which hidden units), described as
:class:`~meshkit.state.ShardedArray` boxes; this strategy steps them with its optimizer and gives
the checkpoint those boxes, so a model of experts trains, saves and reshards through the same
:class:`~meshkit.parallel.strategy.Strategy` as the rest (a :class:`~meshkit.parallel.Composite`
puts it beside a DDP of the dense parameters)::

    boxes = {"w1": ShardedArray(w1_block, w1.shape, (first_expert, 0, first_hidden)), ...}
    experts = ExpertStrategy(boxes, optimizer=AdamW(lr=1e-3), group=stage_group)
    moe = MoE(experts.params["router"], experts.params["w1"], experts.params["w2"], ...)

The gradient side is a :class:`~meshkit.parallel.LocalStrategy`'s (held, not inherited): the
gradients are used as they are marked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator

import contextlib

import numpy as np

from ...comm import DistTypeError, DistValueError, ProcessGroup, all_gather_object
from ...state import ShardedArray, StepCount
from ...state._seams import load_pieces
from ..arrays import to_host
from ..checks import where
from ..data_parallelism.full_state import (FullStateDict, agree_on_load, current_shape, state_dict_digest)
from ..data_parallelism.protocol import split_state_dict
from ..local_strategy import LocalStrategy
from ..optim.optimizers import Optimizer

__all__ = ["ExpertStrategy"]


class ExpertStrategy:
    """This rank's blocks of parameters reduced by their own layer, stepped locally.

    Args:
        boxes: ``{name: ShardedArray}``: each parameter's block on this rank (its ``local`` is
            the array trained in place), the global shape, the block's offsets, and ``replica``
            where another rank holds the same block and saves it.
        optimizer: the :class:`~meshkit.parallel.optim.optimizers.Optimizer` ``step()`` runs on the blocks.
        group: the ranks whose blocks together cover every global array (``full_state_dict``
            gathers over it, ``load_full_state_dict`` agrees over it).

    Raises:
        DistTypeError: a box is not a ``ShardedArray``.
    """

    _strategy = "ExpertStrategy"

    def __init__(self, boxes: Mapping[str, ShardedArray], *, optimizer: Optimizer, group: ProcessGroup) -> None:
        bad = [n for n, b in boxes.items() if not isinstance(b, ShardedArray)] if isinstance(boxes, Mapping) else None
        if bad is None or bad:
            raise DistTypeError(f"{where(self._strategy, group)}: boxes must map each name to a ShardedArray, got "
                                f"{type(boxes).__name__ if bad is None else {n: type(boxes[n]).__name__ for n in bad}}")
        self._boxes = dict(boxes)
        self.group = group
        self._local = LocalStrategy({n: b.local for n, b in boxes.items()}, optimizer=optimizer)
        self.optimizer = optimizer
        self.params: dict[str, Any] = self._local.params
        self.units: list[list[str]] = self._local.units

    # ------------------------------------------------------------------ the loop: the held LocalStrategy's
    def zero_grad(self) -> None:
        self._local.zero_grad()

    def prefetch(self, unit: int) -> None:
        self._local.prefetch(unit)

    def unshard(self, unit: int) -> contextlib.AbstractContextManager[dict[str, Any]]:
        """This rank's blocks (nothing is gathered: the layer works on blocks)."""
        return self._local.unshard(unit)

    def mark_grad_ready(self, name: str, grad: Any = None) -> None:
        """Take ``name``'s gradient, already reduced by its layer over the ranks sharing the block."""
        self._local.mark_grad_ready(name, grad)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self._local.no_sync():
            yield

    def step(self) -> None:
        self._local.step()

    def memory_report(self) -> dict[str, int]:
        return self._local.memory_report()

    # ------------------------------------------------------------------ state: boxes of the global arrays
    def _box(self, name: str, local: Any) -> list[ShardedArray]:
        b = self._boxes[name]
        return [ShardedArray(local, b.global_shape, b.offsets, replica=b.replica)]

    def state_dict(self) -> dict[str, Any]:
        """``{"model", "optim": {"state", "step"}}``: every array as this rank's box of the global one (views)."""
        opt = self.optimizer
        model = {n: self._box(n, p) for n, p in self.params.items()}
        state = {n: {k: self._box(n, v.reshape(p.shape)) for k, v in opt.materialize(n, p.reshape(-1)).items()}
                 for n, p in self.params.items()}
        return {"model": model, "optim": {"state": state, "step": {n: StepCount(opt, n) for n in self.params}}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        who = f"{self._strategy}.load_state_dict"
        model, optim = split_state_dict(who, state_dict, self.group)
        mine = self.state_dict()
        load_pieces(who, "model", mine["model"], dict(model))
        load_pieces(who, "optim.state", mine["optim"]["state"], optim.get("state"))
        steps = optim.get("step")
        if not isinstance(steps, Mapping) or set(steps) != set(self.params):
            raise DistValueError(f"{where(who, self.group)}: optim step must map every parameter "
                                 f"{list(self.params)} to its count")
        self.optimizer.steps.update({n: int(c) for n, c in steps.items()})

    def _slices(self, name: str) -> tuple[slice, ...]:
        b = self._boxes[name]
        return tuple(slice(o, o + n) for o, n in zip(b.offsets, self.params[name].shape))

    def full_state_dict(self, *, rank0_only: bool = False) -> FullStateDict | None:
        """The global arrays and their optimizer state on every rank of ``group`` (an all-gather
        of the blocks), as NumPy arrays."""
        opt = self.optimizer
        mine = {n: (to_host(p), {k: to_host(v.reshape(p.shape)) for k, v in opt.state.get(n, {}).items()})
                for n, p in self.params.items()}
        parts: list[Any] = [None] * self.group.size
        all_gather_object(parts, {n: (self._boxes[n].offsets, v) for n, v in mine.items()}, group=self.group)
        model = {n: np.zeros(b.global_shape, dtype=self.params[n].dtype) for n, b in self._boxes.items()}
        state: dict[str, dict[str, np.ndarray]] = {}
        for part in parts:
            for n, (offsets, (block, st)) in part.items():
                where_ = tuple(slice(o, o + s) for o, s in zip(offsets, block.shape))
                model[n][where_] = block
                for k, v in st.items():
                    state.setdefault(n, {}).setdefault(k, np.zeros(model[n].shape, dtype=v.dtype))[where_] = v
        steps = {n: opt.steps[n] for n in self.params if n in opt.steps}
        sd = FullStateDict(model=model, optim={"state": state, "step": steps, "hyper": opt.hyper})
        return None if rank0_only and self.group.rank != 0 else sd

    def load_full_state_dict(self, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
        """Cut this rank's blocks out of a full state dict (any strategy's, at any world size;
        collective over ``group``: all ranks load or none)."""
        who = f"{self._strategy}.load_full_state_dict"
        state_dict = current_shape(state_dict)
        problem = self._problem(state_dict, strict)
        agree_on_load(self.group, who, problem, None if problem else state_dict_digest(state_dict, strict))
        opt = self.optimizer
        optim = state_dict.get("optim", {})
        for n, p in self.params.items():
            if n in state_dict["model"]:
                p[...] = state_dict["model"][n][self._slices(n)]
            given = optim.get("state", {}).get(n)
            if given:
                for k, arr in opt.materialize(n, p.reshape(-1)).items():
                    if k in given:
                        arr[...] = np.asarray(given[k]).reshape(self._boxes[n].global_shape)[self._slices(n)].reshape(-1)
            if n in optim.get("step", {}):
                opt.steps[n] = int(optim["step"][n])

    def _problem(self, sd: Any, strict: bool) -> str | None:
        """What is wrong with full state dict ``sd`` for these blocks, or None."""
        try:
            model, optim = split_state_dict("", sd)
        except DistValueError as exc:
            return str(exc).split(": state_dict ", 1)[-1]
        missing = sorted(set(self.params) - set(model))
        if strict and missing:
            return f"state_dict['model'] misses parameters {missing} (strict=True)"
        for n, value in model.items():
            if n in self._boxes and tuple(getattr(value, "shape", ())) != self._boxes[n].global_shape:
                return (f"state_dict['model'][{n!r}] has shape {tuple(getattr(value, 'shape', ()))}, expected the "
                        f"global shape {self._boxes[n].global_shape}")
        for n, st in optim.get("state", {}).items():
            for k, v in (st.items() if n in self._boxes else ()):
                if int(np.size(v)) != int(np.prod(self._boxes[n].global_shape)):
                    return f"state_dict['optim']['state'][{n!r}][{k!r}] has {np.size(v)} elements, expected the parameter's"
        return None
