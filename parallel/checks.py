"""Error prefixes and scalar checks shared by every module of ``meshkit.parallel``.

Every error names the rank it happened on (``meshkit.parallel: rank 1: SGD.step: ...``): in a job
of many processes, a message without its rank cannot be traced back.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from ..comm import DistTypeError, DistValueError, ProcessGroup, get_rank, is_initialized
from ..comm._seams import by_ranks

__all__ = ["where", "on_ranks", "real", "flag", "at_least_zero"]

#: ``"rank 1: A; ranks [0, 2]: B"`` from ``(rank, problem)`` pairs, None problems left out: comm's
#: one formatter (:func:`meshkit.comm.naming.by_ranks`), under the name parallel's modules call.
on_ranks = by_ranks


def where(who: str, group: ProcessGroup | None = None) -> str:
    """``"meshkit.parallel: rank R: who"``: R is the global rank (0 outside a job)."""
    if group is not None:
        rank = group.global_rank
    else:
        rank = get_rank() if is_initialized() else 0
    return f"meshkit.parallel: rank {rank}: {who}"


def real(who: str, name: str, value: Any) -> float:
    """``value`` as a float; TypeError unless it is a real number (bools are not)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise DistTypeError(f"{where(who)}: {name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def flag(who: str, name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise DistTypeError(f"{where(who)}: {name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def at_least_zero(who: str, name: str, value: Any) -> float:
    v = real(who, name, value)
    if not v >= 0.0:  # also rejects nan
        raise DistValueError(f"{where(who)}: {name}={v!r} must be >= 0")
    return v
