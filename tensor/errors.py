"""DTensor errors: every message reads ``meshkit.tensor: rank R: op: what was wrong``.

The classes are comm's: a bad value is a ``DistValueError`` (a ``ValueError``), a bad type a
``DistTypeError`` (a ``TypeError``), a Shard dim out of range a ``ShardDimError`` (an
``IndexError`` too, as torch raises).
"""

from __future__ import annotations

from ..comm import DistTypeError, DistValueError, is_initialized
from ..comm._seams import current_world

__all__ = ["ShardDimError", "prefix", "value_error", "type_error"]


class ShardDimError(DistValueError, IndexError):
    """A ``Shard(dim)`` out of range for the array's number of dimensions."""


def prefix(op: str) -> str:
    """``"meshkit.tensor: rank R: op: "`` (no rank outside a job)."""
    rank = f"rank {current_world().rank}: " if is_initialized() else ""
    return f"meshkit.tensor: {rank}{op}: "


def value_error(op: str, text: str) -> DistValueError:
    """A DistValueError with the prefix."""
    return DistValueError(prefix(op) + text)


def type_error(op: str, text: str) -> DistTypeError:
    """A DistTypeError with the prefix."""
    return DistTypeError(prefix(op) + text)
