"""Elementwise ufuncs on DTensors (``+``, ``*``, ``np.tanh``...), ``np.where``, ``np.clip``.

Placements per mesh dimension: the output takes the first input Shard whose array dim is not
broadcast (an input broadcast along that dim, or without it, needs Replicate there); else
Partial where the ufunc is linear in the Partial terms (``a + b`` and ``a - b`` with every
operand Partial, ``-a``, ``a * r`` and ``a / r`` with ``a`` the one Partial operand and ``r`` a
scalar or an all-Replicate DTensor that is finite, and nonzero for a divisor: ``inf`` times a
term 0 would be NaN where the sum is +-inf); else Replicate. Inputs that differ are
redistributed first (logged at DEBUG): a Partial feeding a non-linear ufunc (``tanh(p)``,
``p - t``, ``np.where``, ``np.clip``) is all-reduced, which is where Megatron's forward
all-reduce comes from. In-place operators (``x += y``, ``np.add(x, y, out=x)``) write ``x``'s
block where the result keeps ``x``'s placements, and raise ValueError naming both otherwise;
``x += c`` and ``x -= c`` on a Partial ``x`` with a scalar ``c`` keep the Partial (a Partial(sum)
shifts only the terms of mesh coordinate 0).
A ufunc of two outputs (``np.divmod``, ``np.modf``, ``np.frexp``) gives a tuple of DTensors with
the same placements (none keeps a Partial); generalized ufuncs (``np.vecdot``) have no rule.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import errors
from .dispatch import implements, implements_ufunc
from .dtensor import DTensor, _wrap
from .placements import Partial, Placement, Replicate, Shard
from .propagation import common_mesh, is_scalar, moved, no_out, uniform_finite, unsupported, wrap

__all__ = ["elementwise", "where", "clip"]

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


def _same_layout(inputs: tuple) -> DTensor | None:
    """The first DTensor operand if every DTensor operand has its shape and placements and none is
    Partial (the others being scalars: ``common_mesh`` has checked that), else None."""
    first = None
    for x in inputs:
        if isinstance(x, DTensor):
            if first is None:
                first = x
                if any(p.is_partial() for p in x.placements):
                    return None
            elif x.placements != first.placements or x.shape != first.shape:
                return None
    return first


def _blockwise(op: str, fn: Any, ufunc: Any, inputs: tuple, out: Any = None) -> DTensor:
    """``fn(*blocks)`` after bringing ``inputs`` to compatible placements (``ufunc`` picks the
    Partial rules; None: no input Partial is kept); into ``out``'s block when given.

    The placements are decided, and ``out`` checked against them, before any communication, so a
    refused in-place op raises on every rank alike.
    """
    mesh = common_mesh(op, inputs)
    if out is None and (same := _same_layout(inputs)) is not None:
        # the common case: the operands' placements, none Partial, on equal shapes (or with scalars):
        # every rule above gives those placements back and moves nothing: a third of a small op's time saved
        return _wrap_all(fn(*(x.to_local() if isinstance(x, DTensor) else x for x in inputs)), mesh, same.placements,
                         same.shape)
    out_shape = tuple(np.broadcast_shapes(*(x.shape for x in inputs if isinstance(x, DTensor))))
    targets = tuple(_target(ufunc, inputs, i, out_shape) for i in range(mesh.ndim))
    if out is not None:
        _check_out(op, out, mesh, targets, out_shape)
    locals_ = []
    for k, x in enumerate(inputs):
        if isinstance(x, DTensor):
            need = [_required(x, t, out_shape, i) for i, t in enumerate(targets)]
            x = moved(op, f"argument {k}", x, need).to_local()
        locals_.append(x)
    if out is not None:
        fn(*locals_, out=out.to_local())
        return out
    return _wrap_all(fn(*locals_), mesh, targets, out_shape)


def _wrap_all(result: Any, mesh: Any, placements: Any, shape: tuple[int, ...]) -> Any:
    """The result DTensor, or a tuple of them for a ufunc of two outputs (``np.divmod``, ``np.modf``)."""
    if isinstance(result, tuple):
        return tuple(wrap(r, mesh, placements, shape) for r in result)
    return wrap(result, mesh, placements, shape)


def _check_out(op: str, out: Any, mesh: Any, targets: tuple[Placement, ...], out_shape: tuple[int, ...]) -> None:
    """Refuse an ``out`` (``x += y`` passes ``out=x``) whose block is not the result's block."""
    if not isinstance(out, DTensor):
        raise errors.type_error(op, f"out= must be a DTensor (its block is written in place), got "
                                    f"{type(out).__name__}")
    if out.device_mesh != mesh:
        raise errors.value_error(op, f"out is on mesh {out.device_mesh!r}, the arguments on {mesh!r}")
    if out.placements != targets or out.shape != out_shape:
        raise errors.value_error(op, f"in place (x op= y, or out=x) the result would have placements {targets!r} "
                                     f"and shape {out_shape}, but out has placements {out.placements!r} and shape "
                                     f"{out.shape}; an in-place op writes each rank's block and cannot change "
                                     f"them: write x = x op y, or redistribute first")


@implements_ufunc("__call__")
def elementwise(ufunc: Any, *inputs: Any, **kwargs: Any) -> DTensor:
    """Apply ``ufunc`` blockwise after bringing the inputs to compatible placements.

    ``out=x`` (what ``x += y`` passes) writes into ``x``'s block, where the result's placements and
    shape are ``x``'s; otherwise it raises ValueError naming both, on every rank.
    """
    if not kwargs and ufunc.nout == 1 and ufunc.signature is None:
        same = _plain_same_layout(inputs)
        if same is not None:  # what _blockwise's first case does, with nothing to decide or check
            return _wrap(ufunc(*[x._local if x.__class__ is DTensor else x for x in inputs]), same._mesh,
                         same._placements, same._shape)
    op = f"np.{ufunc.__name__}"
    out = kwargs.pop("out", None)
    no_out(op, kwargs)
    if ufunc.signature is not None or (ufunc.nout != 1 and out is not None):
        raise unsupported(op, *(x.placements for x in inputs if isinstance(x, DTensor)))
    if isinstance(out, tuple):
        if len(out) != 1:
            raise errors.value_error(op, f"out= has {len(out)} arrays; {op} has one output")
        out = out[0]

    def fn(*blocks: Any, out: Any = None) -> Any:
        return ufunc(*blocks, **kwargs) if out is None else ufunc(*blocks, out=out, **kwargs)

    if out is not None and ufunc in _ADDITIVE and len(inputs) == 2 and inputs[0] is out and \
            isinstance(out, DTensor) and is_scalar(inputs[1]) and any(p.is_partial() for p in out.placements):
        return _shift_partial(out, fn, inputs[1])
    return _blockwise(op, fn, ufunc, inputs, out)


_PLAIN_SCALARS = (int, float, bool, complex)


def _plain_same_layout(inputs: tuple) -> DTensor | None:
    """The first DTensor operand if every operand is a DTensor of its mesh, shape and placements
    (none Partial) or a Python or NumPy scalar, else None: the hot path of ``a + b``, ``x > 0``,
    ``np.tanh(x)``, whose result is the blocks' result under those placements (about 3 us less
    per op than the general path on 8x8 blocks; benchmarks/dtensor.py's overhead table)."""
    first = None
    for x in inputs:
        kind = x.__class__
        if kind is DTensor:
            if first is None:
                first = x
                for p in x._placements:
                    if p.__class__ is Partial:
                        return None
            elif x._mesh is not first._mesh or x._placements != first._placements or x._shape != first._shape:
                return None
        elif kind not in _PLAIN_SCALARS and not isinstance(x, np.generic):
            return None
    return first


def _shift_partial(out: DTensor, fn: Any, scalar: Any) -> DTensor:
    """``x += c`` / ``x -= c`` on a Partial ``x`` (c a scalar), in place with its placements kept:
    the terms must reduce to the shifted value, so along a Partial(sum) mesh dim only coordinate 0
    adds ``c`` (the others add nothing), and along avg, max and min every term adds it
    (``max(t + c) = max(t) + c``, rounding being monotonic). No communication. torch refuses an
    in-place op that would change a Partial's placement; this keeps it, exactly."""
    coordinate = out.device_mesh.get_coordinate()
    if not any(isinstance(p, Partial) and p.reduce_op == "sum" and c != 0
               for p, c in zip(out.placements, coordinate)):
        fn(out.to_local(), scalar, out=out.to_local())
    return out


@implements(np.where)
def where(condition: Any, x: Any = None, y: Any = None, /) -> DTensor:
    """``np.where(condition, x, y)`` blockwise (a Partial is reduced first: selecting is not linear
    in the terms). The one-argument form (``nonzero``) is not supported."""
    op = "np.where"
    if x is None or y is None:
        raise NotImplementedError(errors.prefix(op) + "the one-argument form (np.nonzero) has no DTensor rule; "
                                  "give condition, x and y")
    return _blockwise(op, np.where, None, (condition, x, y))


_NO_VALUE = object()


@implements(np.clip)
def clip(a: Any, a_min: Any = _NO_VALUE, a_max: Any = _NO_VALUE, out: Any = None, *, min: Any = _NO_VALUE,
         max: Any = _NO_VALUE, **kwargs: Any) -> DTensor:
    """``np.clip`` blockwise; the bounds are scalars, None or DTensors (a Partial is reduced first)."""
    op = "np.clip"
    no_out(op, {"out": out, **kwargs})
    lo = min if a_min is _NO_VALUE else a_min
    hi = max if a_max is _NO_VALUE else a_max
    lo, hi = (None if v is _NO_VALUE else v for v in (lo, hi))
    if lo is None and hi is None:
        raise ValueError(f"{errors.prefix(op)}one of a_min and a_max must be given")
    bounds = [v for v in (lo, hi) if v is not None]

    def fn(block: Any, *given: Any) -> Any:
        it = iter(given)
        return np.clip(block, next(it) if lo is not None else None, next(it) if hi is not None else None)

    return _blockwise(op, fn, None, (a, *bounds))
