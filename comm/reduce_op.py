"""Reduction operations, which dtypes each accepts, and their NumPy reference.

The dtype rules follow torch.distributed: ``AVG`` needs a floating-point or complex dtype,
complex numbers only sum or average (torch: "MAX, MIN and PRODUCT are not supported for complex
tensors"; NCCL has no complex type, meshkit reduces complex numbers as pairs of floats),
booleans reduce with MIN/MAX/BAND/BOR/BXOR (MIN is a logical and, MAX a logical or), and the
bitwise ops need integers or booleans. ``PREMUL_SUM`` is torch's name for NCCL's sum of inputs
each scaled by a factor (``_make_nccl_premul_sum(factor)``); meshkit refuses it, naming the way:
scale the input, then ``SUM``.
"""

from __future__ import annotations

import enum
from typing import Callable

import numpy as np

from .errors import DistTypeError

__all__ = ["ReduceOp", "check_op_dtype", "combine_into", "combine"]


class ReduceOp(enum.Enum):
    """How a reducing collective combines the ranks' arrays."""

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"
    #: torch's premultiplied sum: refused on use (see the module docstring), never valid
    PREMUL_SUM = "premul_sum"

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"

    # Members are singletons, so identity hashing is exact; Enum's own __hash__ runs in Python
    # (hash of the name), and ops are looked up in dicts on every collective call.
    __hash__ = object.__hash__


_BOOL_OPS = frozenset({ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})
_INT_OPS = frozenset(ReduceOp) - {ReduceOp.AVG, ReduceOp.PREMUL_SUM}
_FLOAT_OPS = frozenset({ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX})
_COMPLEX_OPS = frozenset({ReduceOp.SUM, ReduceOp.AVG})


def _valid_ops(dtype: np.dtype) -> frozenset[ReduceOp]:
    kind = dtype.kind
    if kind == "b":
        return _BOOL_OPS
    if kind in "iu":
        return _INT_OPS
    if kind == "f" or dtype.name == "bfloat16":
        return _FLOAT_OPS
    if kind == "c":
        return _COMPLEX_OPS
    return frozenset()


#: (op, dtype) pairs already found valid (only ReduceOp members: a string op is never in it)
valid_op_dtypes: set[tuple[ReduceOp, np.dtype]] = set()


def check_op_dtype(op: object, dtype: np.dtype, where: Callable[[], str]) -> ReduceOp:
    """Return ``op`` as a ReduceOp, or raise naming the op, the dtype and what is valid.

    Args:
        op: a ReduceOp (its name as a string is accepted too, e.g. ``"sum"``).
        dtype: the dtype the reduction runs on.
        where: builds the message prefix, e.g. ``"meshkit.comm: rank 0: all_reduce"`` (called
            only on failure, to keep the success path cheap).
    """
    if op.__class__ is ReduceOp and (op, dtype) in valid_op_dtypes:  # checked on every call: remember valid pairs
        return op  # type: ignore[return-value]
    if op.__class__ is not ReduceOp:
        try:
            op = ReduceOp[str(op).upper()]
        except KeyError:
            valid = [o.name for o in ReduceOp]
            raise DistTypeError(f"{where()}: op={op!r} is not a ReduceOp; valid ops are {valid}") from None
    if op is ReduceOp.PREMUL_SUM:
        raise DistTypeError(f"{where()}: ReduceOp.PREMUL_SUM (torch's _make_nccl_premul_sum(factor), NCCL's sum of "
                            "inputs each multiplied by factor) is not supported; the same result: multiply the input "
                            "by factor in place (x *= factor), then reduce with ReduceOp.SUM")
    valid_ops = _valid_ops(dtype)
    if op not in valid_ops:
        names = sorted(o.name for o in valid_ops)
        raise DistTypeError(
            f"{where()}: ReduceOp.{op.name} is not defined for dtype {dtype}; "
            f"valid ops for this dtype are {names}")
    valid_op_dtypes.add((op, dtype))
    return op


def combine_into(op: ReduceOp, acc: np.ndarray, other: np.ndarray) -> None:
    """``acc = acc (op) other`` in place; AVG combines as SUM (the caller divides)."""
    combine(op, acc, other, acc)


def combine(op: ReduceOp, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out = a (op) b`` (``out`` may be ``a``); AVG combines as SUM (the caller divides). One pass
    where a copy then :func:`combine_into` would take two (the shared-memory path's reductions)."""
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        if a.dtype.kind == "b":
            np.logical_or(a, b, out=out)
        else:
            np.add(a, b, out=out)
    elif op is ReduceOp.PRODUCT:
        np.multiply(a, b, out=out)
    elif op is ReduceOp.MIN:
        np.minimum(a, b, out=out)
    elif op is ReduceOp.MAX:
        np.maximum(a, b, out=out)
    elif op is ReduceOp.BAND:
        np.bitwise_and(a, b, out=out)
    elif op is ReduceOp.BOR:
        np.bitwise_or(a, b, out=out)
    else:
        np.bitwise_xor(a, b, out=out)
