"""``LocalStrategy``: the strategy protocol in one process, with no communication.

The single-process reference every parallel strategy is tested against (float64 to 1e-10) is a
strategy too, so that the same loop, the same checkpoints and the same examples run it::

    model = LocalStrategy(params, optimizer=SGD(lr=0.1), units=[["w0", "b0"], ["w1", "b1"]])
    model.zero_grad(); ...; model.mark_grad_ready("w1", dw1); ...; model.step()

``params`` is the caller's dict, updated in place by ``step()``; ``unshard(i)`` yields unit
``i``'s parameters themselves. Gradients are checked as every strategy checks them (the
parameter's shape, dtype and array library; one mark per pass, adding up under ``no_sync()``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Iterator, Sequence

from ..comm import DistTypeError, DistValueError
from ..state._seams import load_pieces, optimizer_state_views
from .checks import where
from .data_parallelism.flat import FlatLayout
from .data_parallelism.full_state import (FullStateDict, check_state_dict, current_shape, full_array,
                                          load_state_dict_into)
from .data_parallelism.protocol import check_gradient, check_units, marked_twice, split_state_dict
from .optim.optimizers import Optimizer
from .strategy import Steps

__all__ = ["LocalStrategy"]


class LocalStrategy:
    """Every parameter on this process, its gradients used as they are (a world of one).

    Args:
        params: ordered ``dict[str, array]`` (NumPy or CuPy), trained in place.
        optimizer: the :class:`~meshkit.parallel.optim.optimizers.Optimizer` ``step()`` runs (None:
            a forward and backward pass only, e.g. to compute gradients; ``step()`` refuses).
        units: lists of parameter names for ``unshard``; default one unit of everything.

    Raises:
        DistTypeError: ``params`` is not a mapping, or ``optimizer`` not a meshkit Optimizer.
        DistValueError: bad ``units`` (naming the valid names).
    """

    _strategy = "LocalStrategy"

    def __init__(self, params: dict[str, Any], *, optimizer: Optimizer | None = None,
                 units: Sequence[Sequence[str]] | None = None) -> None:
        if not isinstance(params, Mapping) or not params:
            raise DistTypeError(f"{where(self._strategy)}: params must be a non-empty dict of arrays, got "
                                f"{type(params).__name__}")
        if optimizer is not None and not isinstance(optimizer, Optimizer):
            raise DistTypeError(f"{where(self._strategy)}: optimizer must be a meshkit Optimizer (SGD, AdamW), got "
                                f"{type(optimizer).__name__}")
        unit_list, problem = check_units(params, units)
        if problem:
            raise DistValueError(f"{where(self._strategy)}: {problem}")
        self.params: dict[str, Any] = params
        self.optimizer = optimizer
        self.units: list[list[str]] = unit_list  # type: ignore[assignment]
        self.grads: dict[str, Any] = {}
        self._marked: set[str] = set()
        self._sync = True
        self._steps = Steps()

    def _unit(self, unit: Any, op: str) -> int:
        if isinstance(unit, bool) or not isinstance(unit, int) or not 0 <= unit < len(self.units):
            raise DistValueError(f"{where(f'{self._strategy}.{op}')}: unknown unit {unit!r}; valid units are "
                                 f"0..{len(self.units) - 1}")
        return unit

    def zero_grad(self) -> None:
        """Forget the gradients."""
        self.grads.clear()
        self._marked.clear()

    def prefetch(self, unit: int) -> None:
        """Nothing to gather (checks ``unit``)."""
        self._unit(unit, "prefetch")

    @contextlib.contextmanager
    def unshard(self, unit: int) -> Iterator[dict[str, Any]]:
        """Yield ``{name: parameter}`` of ``unit``: the parameters themselves."""
        u = self._unit(unit, "unshard")
        yield {name: self.params[name] for name in self.units[u]}

    def mark_grad_ready(self, name: str, grad: Any = None) -> None:
        """Take ``name``'s gradient of this pass (added to what ``no_sync()`` passes left).

        Raises:
            DistValueError: an unknown name, a wrong shape or dtype, a second mark in a pass.
            DistTypeError: no gradient, or an array of another library than the parameter's.
        """
        head = where(f"{self._strategy}.mark_grad_ready")
        if name not in self.params:
            raise DistValueError(f"{head}: unknown parameter {name!r}; valid names are {list(self.params)}")
        if grad is None:
            raise DistTypeError(f"{head}: gradient {name!r} is None; pass it, mark_grad_ready(name, grad)")
        p = self.params[name]
        check_gradient(head, name, grad, tuple(p.shape), p.dtype, p, "the parameters")
        if self._sync and name in self._marked:
            raise marked_twice(head, name)
        self.grads[name] = self.grads[name] + grad if name in self.grads else grad.copy()
        if self._sync:
            self._marked.add(name)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients marked inside add up (there is nothing to reduce in one process)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def step(self) -> None:
        """Run the optimizer on the gradients marked since ``zero_grad()``; a new pass begins.

        Raises:
            DistValueError: it was built without an optimizer.
        """
        if self.optimizer is None:
            raise DistValueError(f"{where(f'{self._strategy}.step')}: no optimizer; pass optimizer= to LocalStrategy")
        self.optimizer.step(self.params, self.grads)
        self._marked.clear()
        self._steps.taken()

    def state_dict(self) -> dict[str, Any]:
        """``{"model": params, "optim": {"state", "step"}}``: the parameters and the optimizer's state, as views."""
        if self.optimizer is None:
            return {"model": dict(self.params), "optim": {"state": {}, "step": {}}}
        return {"model": dict(self.params), "optim": optimizer_state_views(self.optimizer, self.params)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Take in a state dict of :meth:`state_dict`'s shape (views written in place are not copied)."""
        who = f"{self._strategy}.load_state_dict"
        model, optim = split_state_dict(who, state_dict)
        mine = self.state_dict()
        load_pieces(who, "model", mine["model"], dict(model))
        if self.optimizer is None:
            return
        load_pieces(who, "optim.state", mine["optim"]["state"], optim.get("state"))
        steps = optim.get("step")
        if not isinstance(steps, Mapping) or set(steps) != set(self.params):
            raise DistValueError(f"{where(who)}: optim step must map every parameter {list(self.params)} to its count")
        self.optimizer.steps.update({name: int(count) for name, count in steps.items()})

    def full_state_dict(self, *, rank0_only: bool = False) -> FullStateDict | None:
        """The parameters and optimizer state as NumPy copies (the shape of every strategy's)."""
        opt = self.optimizer
        model = {name: full_array(p) for name, p in self.params.items()}
        if opt is None:
            return FullStateDict(model=model, optim={"state": {}, "step": {}, "hyper": {}})
        state = {name: {key: full_array(arr.reshape(self.params[name].shape)) for key, arr in sorted(st.items())}
                 for name, st in opt.state.items() if name in self.params}
        steps = {name: opt.steps[name] for name in self.params if name in opt.steps}
        return FullStateDict(model=model, optim={"state": state, "step": steps, "hyper": opt.hyper})

    def load_full_state_dict(self, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
        """Load a full state dict of any strategy, at any world size (checked as theirs; all or nothing).

        Raises:
            DistValueError: the state dict is invalid (naming the key); nothing was loaded.
        """
        if self.optimizer is None:
            raise DistValueError(f"{where(f'{self._strategy}.load_full_state_dict')}: it was built without optimizer=")
        state_dict = current_shape(state_dict)
        layouts = [FlatLayout.over({name: p}, 1, key=name) for name, p in self.params.items()]
        problem = check_state_dict(layouts, state_dict, self.optimizer, strict)
        if problem:
            raise DistValueError(f"{where(f'{self._strategy}.load_full_state_dict')}: nothing was loaded; {problem}")
        flat = {name: p.reshape(-1).copy() for name, p in self.params.items()}
        load_state_dict_into(layouts, state_dict, flat, self.optimizer, 0, strict)
        for name, p in self.params.items():
            p[...] = flat[name].reshape(p.shape)

    def memory_report(self) -> dict[str, int]:
        """Bytes held: the parameters, the gradients marked, the optimizer's state; nothing for communication."""
        return {"params": sum(int(p.nbytes) for p in self.params.values()),
                "grads": sum(int(g.nbytes) for g in self.grads.values()),
                "optimizer_state": self.optimizer.state_nbytes() if self.optimizer is not None else 0, "comm_buffers": 0, "peak_transient": 0}
