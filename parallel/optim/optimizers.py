"""Elementwise optimizers (SGD, AdamW) that update any flat shard the way they update the whole.

Every update rule here is elementwise: element ``i`` of a parameter after a step depends only on
element ``i`` of the parameter, of its gradient and of its state, and on per-name scalars (the
step count ``t``). So running the optimizer on the flat shards of a parameter, each under its own
name, gives bitwise the same result as running it on the whole parameter. Sharded data parallel
(ZeRO) relies on that: each rank calls ``opt.update("float32", shard, grad_shard)`` on the shard
it owns.

The rules are torch's, restated from the documented definitions of ``torch.optim.SGD`` and
``torch.optim.AdamW`` (the single-tensor, non-fused, non-foreach, ``capturable=False`` path),
including the order of operations where it changes the rounding (AdamW's decoupled decay comes
first; ``eps`` is added after the bias-corrected square root; the first moment is a ``lerp``).

Arrays may be NumPy or CuPy: the update path uses only array methods, in-place operators and
ufuncs of the array's own namespace (:func:`~meshkit.parallel.arrays.array_namespace`).
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...comm import DistTypeError, DistValueError
from ...tensor import DTensor
from ..arrays import array_namespace, check_same_library, convert, is_array
from ..checks import at_least_zero, flag, real, where

__all__ = ["SGD", "AdamW", "Optimizer"]


class _Counts(dict):
    """``Optimizer.steps``: a dict that keeps plain ints, whatever int-like is put in it.

    A state dict's step count is a read-through :class:`~meshkit.parallel.StepCount`; code that
    copies counts back with ``opt.steps.update(optim_sd["step"])`` (as with ints) stores their
    values now, never the read-through objects (one reading its own entry would recurse).
    """

    def __setitem__(self, name: str, count: Any) -> None:
        try:
            value = -1 if isinstance(count, (bool, np.bool_)) else operator.index(count)
        except TypeError:
            value = -1
        if value < 0:
            raise DistValueError(f"{where('Optimizer.steps')}: the step count of {name!r} must be an int >= 0, "
                                 f"got {count!r}")
        super().__setitem__(name, value)

    def update(self, *args: Any, **kw: Any) -> None:
        for name, count in dict(*args, **kw).items():
            self[name] = count

    def setdefault(self, name: str, default: Any = 0) -> int:
        if name not in self:
            self[name] = default
        return self[name]


class Optimizer:
    """Shared machinery of the elementwise optimizers: validation, lazy state, state dicts.

    State is per name: ``state[name]`` maps state keys (``"momentum_buffer"``, ``"exp_avg"``...)
    to 1-D arrays of the parameter's size and dtype, created on the first update of that name;
    ``steps[name]`` counts the updates of that name (AdamW's ``t``). Names are whatever the caller
    passes: a parameter's name, or a flat shard's name under ZeRO.

    Subclasses define ``_HYPER`` (hyperparameter names, each an attribute), ``_validated``
    (normalises and checks hyperparameters), ``_state_keys`` and ``_update``.
    """

    _HYPER: tuple[str, ...] = ()

    def __init__(self, **hyper: Any) -> None:
        for key, value in self._validated(**hyper).items():
            setattr(self, key, value)
        #: per-name state arrays (1-D, the parameter's dtype and array library)
        self.state: dict[str, dict[str, Any]] = {}
        #: per-name update counts (ints: what is put in is converted, see :class:`_Counts`)
        self.steps: dict[str, int] = _Counts()

    # --- what subclasses define ------------------------------------------------------------

    @classmethod
    def _validated(cls, **hyper: Any) -> dict[str, Any]:
        raise NotImplementedError

    @staticmethod
    def _state_keys(hyper: Mapping[str, Any]) -> tuple[str, ...]:
        """The state keys each name gets under the hyperparameters ``hyper``."""
        raise NotImplementedError

    def _update(self, p: Any, g: Any, state: dict[str, Any], t: int) -> None:
        """Apply one step to the 1-D ``p`` in place; ``state`` may be empty (first step)."""
        raise NotImplementedError

    # --- public interface ------------------------------------------------------------------

    @property
    def hyper(self) -> dict[str, Any]:
        """The hyperparameters, as a new dict (``opt.lr = x`` changes the learning rate)."""
        return {key: getattr(self, key) for key in self._HYPER}

    def update(self, name: str, param_flat: Any, grad_flat: Any) -> None:
        """Update one named flat array in place: the primitive that :meth:`step` loops over.

        Args:
            name: the state key; the same name must always come with the same number of elements.
            param_flat: 1-D floating-point array, updated in place.
            grad_flat: its gradient, same shape, dtype and array library; None skips the update
                (as torch skips a parameter without ``.grad``), and the step count stays.

        Raises:
            TypeError: an argument is not an array, not floating point, or dtypes/libraries differ.
            ValueError: not 1-D, shapes differ, or ``name``'s state has another size.
        """
        if grad_flat is None:
            return
        if isinstance(param_flat, DTensor) or isinstance(grad_flat, DTensor):
            raise DistTypeError(f"{self._where('update')}: parameter {name!r}: update() takes this rank's flat "
                                "arrays, not DTensors; use step() for DTensors, or pass to_local().reshape(-1)")
        self._check_pair("update", name, param_flat, grad_flat)
        if param_flat.ndim != 1:
            raise DistValueError(f"{self._where('update')}: parameter {name!r} must be a 1-D flat "
                                 f"array, got shape {tuple(param_flat.shape)}; use step() for arrays of any shape")
        self._check_pair_shape("update", name, param_flat, grad_flat)
        self._check_state_size("update", name, param_flat.size)
        self._update_flat(name, param_flat, grad_flat)

    def step(self, params: Mapping[str, Any], grads: Mapping[str, Any]) -> None:
        """One optimizer step: update every parameter in place from its gradient.

        Everything is checked before anything is updated, so a bad gradient leaves all the
        parameters and the state as they were.

        Args:
            params: ``{name: array}`` of floating-point NumPy or CuPy arrays of any shape, or
                DTensors (tensor parallelism): each rank updates its block in place, which for
                an elementwise rule is the block of the whole update.
            grads: the same keys; each gradient has its parameter's shape and dtype, or is None
                (that parameter is skipped, as torch skips parameters without a gradient). A
                DTensor parameter's gradient is a DTensor on the same mesh with the same
                placements (a ``Partial`` gradient must be reduced first).

        Raises:
            TypeError: not mappings, a value is not an array, or a dtype/library differs.
            ValueError: keys differ, a shape differs, a name's state has another size, or a
                DTensor gradient's mesh or placements differ from its parameter's.

        Example::

            opt = AdamW(lr=1e-3)
            opt.step({"w": w, "b": b}, {"w": dw, "b": db})   # w and b updated in place
        """
        head = self._where("step")
        if not isinstance(params, Mapping) or not isinstance(grads, Mapping):
            raise DistTypeError(f"{head}: params and grads must be dicts of arrays, got "
                                f"{type(params).__name__} and {type(grads).__name__}")
        missing = [k for k in params if k not in grads]
        extra = [k for k in grads if k not in params]
        if missing or extra:
            raise DistValueError(f"{head}: grads must have the keys of params {list(params)}; "
                                 f"missing {missing}, unexpected {extra}")
        todo = []
        for name, p in params.items():
            g = grads[name]
            if g is None:
                continue
            if isinstance(p, DTensor) or isinstance(g, DTensor):
                p, g = self._blocks("step", name, p, g)
            self._check_pair("step", name, p, g)
            self._check_pair_shape("step", name, p, g)
            self._check_state_size("step", name, p.size)
            todo.append((name, p, g))
        for name, p, g in todo:
            if p.flags.c_contiguous:
                self._update_flat(name, p.reshape(-1), g.reshape(-1))
            else:  # reshape(-1) copies a non-contiguous array: update the copy, write it back
                flat = p.reshape(-1)
                self._update_flat(name, flat, g.reshape(-1))
                p[...] = flat.reshape(p.shape)

    def materialize(self, name: str, param_flat: Any) -> dict[str, Any]:
        """The state arrays of ``name``, created (zeros, step 0) if it has none yet; returned, not copied.

        A fresh optimizer's state then already exists (as torch materialises it for checkpoints),
        so a checkpoint can be loaded into it in place before the first step; zero state at
        step 0 behaves exactly as no state (SGD's first step still sets its buffer to the
        gradient).

        Args:
            name: the state key (a parameter's name, or a flat shard's).
            param_flat: the 1-D parameter (or shard) the state belongs to: size, dtype and library.
        """
        self._check_state_size("materialize", name, param_flat.size)
        st = self.state.setdefault(name, {})
        xp = array_namespace(param_flat)
        for key in self._state_keys(self.hyper):
            if key not in st:
                st[key] = xp.zeros(param_flat.shape, dtype=param_flat.dtype)
        self.steps.setdefault(name, 0)
        return st

    def state_nbytes(self) -> int:
        """Bytes held by the state arrays on this rank (what ZeRO divides by the world size)."""
        return sum(int(arr.nbytes) for st in self.state.values() for arr in st.values())

    def state_dict(self) -> dict[str, Any]:
        """A copy of the optimizer's state.

        Returns:
            ``{"step": {name: int}, "state": {name: {key: array}}, "hyper": {...}}``; the arrays
            are copies (same library and dtype), so later steps do not change the result.
        """
        return {
            "step": dict(self.steps),
            "state": {name: {key: arr.copy() for key, arr in st.items()} for name, st in self.state.items()},
            "hyper": self.hyper,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Replace the state and hyperparameters with those of ``state_dict`` (copied).

        The arrays are copied, in the library of the given arrays; where this optimizer already
        holds state for a name, the copy takes that state's dtype, and is made into the held
        array where it has the same library (so a state dict's views of it see the new state). As in torch, state is moved to
        the dtype and library of its parameter when the parameter is next updated.

        Args:
            state_dict: a :meth:`state_dict` of the same optimizer class.

        Raises:
            TypeError: not a mapping of the expected form.
            ValueError: hyperparameters of another optimizer or invalid, names of ``step`` and
                ``state`` differ, state keys or sizes are wrong, or names differ from the state
                this optimizer already holds.
        """
        head = self._where("load_state_dict")
        if not isinstance(state_dict, Mapping) or set(state_dict) != {"step", "state", "hyper"}:
            got = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
            raise DistTypeError(f"{head}: expected a dict with keys ['hyper', 'state', 'step'], got {got}")
        hyper, steps, states = state_dict["hyper"], state_dict["step"], state_dict["state"]
        if not isinstance(hyper, Mapping) or set(hyper) != set(self._HYPER):
            got = sorted(hyper) if isinstance(hyper, Mapping) else type(hyper).__name__
            raise DistValueError(f"{head}: hyper must have the keys {sorted(self._HYPER)} of "
                                 f"{type(self).__name__}, got {got}")
        hyper = self._validated(**hyper)
        if not isinstance(steps, Mapping) or not isinstance(states, Mapping):
            raise DistTypeError(f"{head}: step and state must be dicts keyed by name")
        if set(steps) != set(states):
            raise DistValueError(f"{head}: step has names {sorted(steps)} but state has {sorted(states)}")
        if self.state and states and set(states) != set(self.state):
            raise DistValueError(f"{head}: state has names {sorted(states)}, this optimizer holds "
                                 f"{sorted(self.state)}")
        keys = set(self._state_keys(hyper))
        new_state: dict[str, dict[str, Any]] = {}
        new_steps: dict[str, int] = {}
        for name, st in states.items():
            count = steps[name]
            if isinstance(count, (bool, np.bool_)) or not isinstance(count, numbers.Integral) or count < 0:
                raise DistValueError(f"{head}: step[{name!r}]={count!r} must be an int >= 0")
            if not isinstance(st, Mapping) or set(st) != keys:
                got = sorted(st) if isinstance(st, Mapping) else type(st).__name__
                raise DistValueError(f"{head}: state[{name!r}] must have the keys {sorted(keys)}, got {got}")
            sizes = set()
            for key, arr in st.items():
                if not is_array(arr) or arr.ndim != 1 or arr.dtype.kind != "f":
                    raise DistValueError(f"{head}: state[{name!r}][{key!r}] must be a 1-D array of floating point, "
                                         f"got {type(arr).__name__} of shape {getattr(arr, 'shape', None)} and dtype "
                                         f"{getattr(arr, 'dtype', None)}")
                sizes.add(arr.size)
            held = self.state.get(name)
            if held:
                sizes.add(next(iter(held.values())).size)
            if len(sizes) > 1:
                raise DistValueError(f"{head}: state[{name!r}] arrays have sizes {sorted(sizes)}, "
                                     f"expected one size" + (" (the size of the state held for it)" if held else ""))
            dtype = next(iter(held.values())).dtype if held else None
            new_state[name] = {key: arr.copy() if dtype is None else arr.astype(dtype) for key, arr in st.items()}
            new_steps[name] = int(count)
        for key, value in hyper.items():
            setattr(self, key, value)
        for name, st in new_state.items():  # into the arrays held already: views of them (a state dict) see it
            held = self.state.get(name, {})
            for key, arr in st.items():
                mine = held.get(key)
                if mine is not None and mine.shape == arr.shape and array_namespace(mine) is array_namespace(arr):
                    mine[...] = arr
                    st[key] = mine
        self.state = new_state
        self.steps.clear()  # the same dict: it converts what is put in it
        self.steps.update(new_steps)

    def __repr__(self) -> str:
        args = ", ".join(f"{key}={getattr(self, key)!r}" for key in self._HYPER)
        return f"{type(self).__name__}({args})"

    # --- internals -------------------------------------------------------------------------

    def _where(self, op: str) -> str:
        return where(f"{type(self).__name__}.{op}")

    def _check_pair(self, op: str, name: str, p: Any, g: Any) -> None:
        head = self._where(op)
        if not is_array(p):
            raise DistTypeError(f"{head}: parameter {name!r} must be a NumPy or CuPy array, got {type(p).__name__}")
        if not is_array(g):
            raise DistTypeError(f"{head}: grad of parameter {name!r} must be an array or None, got {type(g).__name__}")
        if p.dtype.kind != "f":
            raise DistTypeError(f"{head}: parameter {name!r} has dtype {p.dtype}; only floating-point "
                                f"parameters can be optimized")
        if g.dtype != p.dtype:
            raise DistTypeError(f"{head}: grad of parameter {name!r} has dtype {g.dtype}, the parameter has {p.dtype}")
        check_same_library(head, f"grad of parameter {name!r}", g, p, "the parameter")

    def _blocks(self, op: str, name: str, p: Any, g: Any) -> tuple[Any, Any]:
        """This rank's blocks of a DTensor parameter and its gradient, once they are laid out alike."""
        head = self._where(op)
        if not isinstance(p, DTensor) or not isinstance(g, DTensor):
            raise DistTypeError(f"{head}: parameter {name!r} is a {type(p).__name__} but its grad a "
                                f"{type(g).__name__}; a DTensor parameter needs a DTensor gradient and vice versa")
        if g.device_mesh != p.device_mesh:
            raise DistValueError(f"{head}: grad of parameter {name!r} is on mesh {g.device_mesh!r}, the parameter on "
                                 f"{p.device_mesh!r}")
        if g.placements != p.placements or g.shape != p.shape:
            raise DistValueError(f"{head}: grad of parameter {name!r} has placements {g.placements!r} and shape "
                                 f"{g.shape}, the parameter {p.placements!r} and {p.shape}; redistribute the "
                                 "gradient to the parameter's placements first")
        return p.to_local(), g.to_local()

    def _check_pair_shape(self, op: str, name: str, p: Any, g: Any) -> None:
        if tuple(g.shape) != tuple(p.shape):
            raise DistValueError(f"{self._where(op)}: grad of parameter {name!r} has shape "
                                 f"{tuple(g.shape)}, the parameter has shape {tuple(p.shape)}")

    def _check_state_size(self, op: str, name: str, size: int) -> None:
        st = self.state.get(name)
        if st:
            held = next(iter(st.values())).size
            if held != size:
                raise DistValueError(f"{self._where(op)}: state for {name!r} has {held} "
                                     f"elements but the parameter has {size}")

    def _update_flat(self, name: str, p: Any, g: Any) -> None:
        st = self.state.setdefault(name, {})
        for key, arr in st.items():  # torch's policy: state follows its parameter's dtype and device
            if arr.dtype != p.dtype or array_namespace(arr) is not array_namespace(p):
                st[key] = convert(arr, p)
        t = self.steps.get(name, 0) + 1
        self._update(p, g, st, t)
        self.steps[name] = t


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum, Nesterov momentum and L2 decay.

    Exactly ``torch.optim.SGD``: with ``g`` the gradient (negated first if ``maximize``)::

        g = g + weight_decay * p                       # if weight_decay
        b = g (first step) | momentum * b + (1 - dampening) * g   # if momentum
        g = g + momentum * b (nesterov) | b
        p = p - lr * g

    Args:
        lr: learning rate (>= 0).
        momentum: momentum factor (>= 0); state ``momentum_buffer`` only when it is non-zero.
        nesterov: Nesterov momentum; needs ``momentum > 0`` and ``dampening == 0``.
        weight_decay: L2 penalty added to the gradient (>= 0).
        dampening: dampening of the gradient in the momentum buffer.
        maximize: maximize the objective instead of minimizing it.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: an argument out of range, e.g. ``lr=-1.0 must be >= 0``.
    """

    _HYPER = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")

    def __init__(self, lr: float, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0,
                 dampening: float = 0.0, maximize: bool = False) -> None:
        super().__init__(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                         dampening=dampening, maximize=maximize)

    @classmethod
    def _validated(cls, *, lr: Any, momentum: Any, dampening: Any, weight_decay: Any, nesterov: Any,
                   maximize: Any) -> dict[str, Any]:
        out = {"lr": at_least_zero("SGD", "lr", lr),
               "momentum": at_least_zero("SGD", "momentum", momentum),
               "dampening": real("SGD", "dampening", dampening),  # torch puts no bound on dampening
               "weight_decay": at_least_zero("SGD", "weight_decay", weight_decay),
               "nesterov": flag("SGD", "nesterov", nesterov),
               "maximize": flag("SGD", "maximize", maximize)}
        if out["nesterov"] and (out["momentum"] <= 0 or out["dampening"] != 0):
            raise DistValueError(f"{where('SGD')}: nesterov=True requires momentum > 0 and dampening == 0, got "
                                 f"momentum={out['momentum']!r}, dampening={out['dampening']!r}")
        return out

    @staticmethod
    def _state_keys(hyper: Mapping[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if hyper["momentum"] != 0 else ()

    def _update(self, p: Any, g: Any, state: dict[str, Any], t: int) -> None:
        if self.maximize:
            g = -g
        if self.weight_decay != 0:
            g = g + self.weight_decay * p
        if self.momentum != 0:
            buf = state.get("momentum_buffer")
            if buf is None:  # torch: buf = clone(g) on the first step
                buf = state["momentum_buffer"] = g.copy()
            elif t == 1:  # first step into materialized (zero) state: the same, in place
                buf[...] = g
            else:
                buf *= self.momentum
                if self.dampening != 0:
                    buf += (1 - self.dampening) * g
                else:  # 1.0 * g == g exactly: skip the temporary
                    buf += g
            g = g + self.momentum * buf if self.nesterov else buf
        p -= self.lr * g


class AdamW(Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter, arXiv:1711.05101), as torch's AdamW.

    Exactly ``torch.optim.AdamW`` (single-tensor path, ``capturable=False``): at step ``t`` of a
    name, with ``g`` the gradient (negated first if ``maximize``)::

        p = p * (1 - lr * weight_decay)               # decoupled decay, before the moments
        m = lerp(m, g, 1 - beta1)                     # = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        vmax = max(vmax, v)                           # if amsgrad; then vmax replaces v below
        denom = sqrt(v) / sqrt(1 - beta2 ** t) + eps  # eps after the bias-corrected sqrt
        p = p - (lr / (1 - beta1 ** t)) * (m / denom)

    The bias corrections are Python (float64) scalars. ``lerp`` is computed as torch computes it
    (``m + w * (g - m)`` for ``w < 0.5``, else ``g - (g - m) * (1 - w)``). State ``exp_avg``,
    ``exp_avg_sq`` (and ``max_exp_avg_sq``) is kept in the parameter's dtype.

    Args:
        lr: learning rate (>= 0).
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator (>= 0).
        weight_decay: decoupled weight decay coefficient (>= 0).
        amsgrad: use the maximum of past second moments (Reddi et al., ICLR 2018).
        maximize: maximize the objective instead of minimizing it.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: an argument out of range, e.g. ``betas[0]=1.0 must be in [0, 1)``.
    """

    _HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, amsgrad: bool = False, maximize: bool = False) -> None:
        super().__init__(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)

    @classmethod
    def _validated(cls, *, lr: Any, betas: Any, eps: Any, weight_decay: Any, amsgrad: Any,
                   maximize: Any) -> dict[str, Any]:
        if not isinstance(betas, Sequence) or isinstance(betas, str) or len(betas) != 2:
            raise DistValueError(f"{where('AdamW')}: betas={betas!r} must be a pair (beta1, beta2)")
        pair = tuple(real("AdamW", f"betas[{i}]", b) for i, b in enumerate(betas))
        for i, b in enumerate(pair):
            if not 0.0 <= b < 1.0:
                raise DistValueError(f"{where('AdamW')}: betas[{i}]={b!r} must be in [0, 1)")
        return {"lr": at_least_zero("AdamW", "lr", lr),
                "betas": pair,
                "eps": at_least_zero("AdamW", "eps", eps),
                "weight_decay": at_least_zero("AdamW", "weight_decay", weight_decay),
                "amsgrad": flag("AdamW", "amsgrad", amsgrad),
                "maximize": flag("AdamW", "maximize", maximize)}

    @staticmethod
    def _state_keys(hyper: Mapping[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if hyper["amsgrad"] else ("exp_avg", "exp_avg_sq")

    def _update(self, p: Any, g: Any, state: dict[str, Any], t: int) -> None:
        xp = array_namespace(p)
        beta1, beta2 = self.betas
        for key in self._state_keys(self.hyper):
            if key not in state:  # first step (or amsgrad switched on later): zeros, as torch
                state[key] = xp.zeros_like(p)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if self.maximize:
            g = -g
        if self.weight_decay != 0:
            p *= 1 - self.lr * self.weight_decay
        tmp = g - m
        w = 1 - beta1  # m.lerp_(g, w), in torch's two-branch form (it keeps the result exact at w = 1)
        if w < 0.5:
            tmp *= w
            m += tmp
        else:
            tmp *= 1 - w
            xp.subtract(g, tmp, out=m)
        v *= beta2  # torch: v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        xp.multiply(g, 1 - beta2, out=tmp)
        tmp *= g
        v += tmp
        bias_correction1 = 1 - beta1 ** t
        bias_correction2 = 1 - beta2 ** t
        step_size = self.lr / bias_correction1
        if self.amsgrad:
            vmax = state["max_exp_avg_sq"]
            xp.maximum(vmax, v, out=vmax)
            v = vmax
        denom = xp.sqrt(v, out=tmp)
        denom /= bias_correction2 ** 0.5
        denom += self.eps
        ratio = xp.divide(m, denom, out=tmp)  # torch: p.addcdiv_(m, denom, value=-step_size)
        ratio *= step_size
        p -= ratio
