"""Elementwise ufuncs on DTensors (``+``, ``*``, ``np.tanh``...): placements per mesh dimension.

On each mesh dim the output takes the first input Shard whose array dim is not broadcast
(an input broadcast along that dim, or without it, needs Replicate there); else Partial where
the ufunc is linear in the Partial terms (``a + b`` and ``a - b`` with every operand Partial,
``-a``, ``a * r`` and ``a / r`` with ``a`` the one Partial operand and ``r`` a scalar or an
all-Replicate DTensor that is finite, and nonzero for a divisor: ``inf`` times a term 0 would
be NaN where the sum is +-inf); else Replicate. Inputs that
differ are redistributed first (logged at DEBUG): a Partial feeding a non-linear ufunc
(``tanh(p)``, ``p - t``) is all-reduced, which is where Megatron's forward all-reduce comes from.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .dispatch import implements_ufunc
from .dtensor import DTensor
from .placements import Partial, Placement, Replicate, Shard
from .propagation import common_mesh, moved, no_out, uniform_finite, unsupported, wrap

__all__ = ["elementwise"]

_ADDITIVE = {np.add, np.subtract}
_UNARY_LINEAR = {np.negative, np.positive}
_DIVIDE = {np.divide, np.true_divide}
_LINEAR_OPS = {"sum", "avg"}


def _target(ufunc: Any, inputs: tuple, i: int, out_shape: tuple[int, ...]) -> Placement:
    """The output placement on mesh dim ``i``."""
    nd = len(out_shape)
    for x in inputs:
        if isinstance(x, DTensor) and isinstance(p := x.placements[i], Shard):
            d = p.dim + nd - x.ndim
            if x.shape[p.dim] == out_shape[d]:
                return Shard(d)
    # by position, not identity: in ``y / y`` the one object is both operands (two Partial terms)
    partial = [k for k, x in enumerate(inputs) if isinstance(x, DTensor) and x.placements[i].is_partial()]
    if partial:
        k = partial[0]
        p = inputs[k].placements[i]
        others = [x for j, x in enumerate(inputs) if j != k]
        plain = len(partial) == 1 and all(not isinstance(x, DTensor) or x.placements[i].is_replicate()
                                          for x in others)
        if p.reduce_op in _LINEAR_OPS and (
                (ufunc in _ADDITIVE and all(isinstance(x, DTensor) and x.placements[i] == p for x in inputs))
                or (ufunc in _UNARY_LINEAR and len(inputs) == 1)
                or (ufunc is np.multiply and plain and uniform_finite(others[0]))
                or (ufunc in _DIVIDE and k == 0 and plain and uniform_finite(others[0], nonzero=True))):
            return p
    return Replicate()


def _required(x: DTensor, target: Placement, out_shape: tuple[int, ...], i: int) -> Placement:
    """What input ``x`` must hold on mesh dim ``i`` for the output to be ``target`` there."""
    if isinstance(target, Shard):
        d = target.dim - (len(out_shape) - x.ndim)
        return Shard(d) if d >= 0 and x.shape[d] == out_shape[target.dim] else Replicate()
    if isinstance(target, Partial):
        return x.placements[i]
    return target


@implements_ufunc("__call__")
def elementwise(ufunc: Any, *inputs: Any, **kwargs: Any) -> DTensor:
    """Apply ``ufunc`` blockwise after bringing the inputs to compatible placements."""
    op = f"np.{ufunc.__name__}"
    no_out(op, kwargs)
    if ufunc.nout != 1 or ufunc.signature is not None:
        raise unsupported(op, *(x.placements for x in inputs if isinstance(x, DTensor)))
    mesh = common_mesh(op, inputs)
    out_shape = tuple(np.broadcast_shapes(*(x.shape for x in inputs if isinstance(x, DTensor))))
    targets = [_target(ufunc, inputs, i, out_shape) for i in range(mesh.ndim)]
    locals_ = []
    for k, x in enumerate(inputs):
        if isinstance(x, DTensor):
            need = [_required(x, t, out_shape, i) for i, t in enumerate(targets)]
            x = moved(op, f"argument {k}", x, need).to_local()
        locals_.append(x)
    return wrap(ufunc(*locals_, **kwargs), mesh, targets, out_shape)
