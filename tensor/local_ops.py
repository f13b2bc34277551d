"""Operations each rank does on its own block: copies, casts, the shape queries.

* ``np.copy`` / ``.copy()``: a new block, the same placements.
* ``.astype(dtype)``: Shard and Replicate cast blockwise. A Partial's terms cast to the new
  dtype add up to the cast sum only where the cast is exact and order-keeping, so a Partial
  stays only for NumPy's "safe" casts (sum and avg: not from bool, whose terms 1 + 1 would make
  2); any other cast reduces the Partial first (logged at DEBUG). Example: terms ``0.6`` and
  ``0.6`` of a Partial(sum) cast to int would sum to ``0``, not ``int(1.2) == 1``.
* ``np.shape`` / ``np.ndim`` / ``np.size``: the global array's, no communication.

Indexing is :mod:`.indexing`; ``copy.deepcopy`` is the DTensor's own (it shares the mesh).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .dispatch import implements
from .dtensor import DTensor
from .placements import Partial, Replicate
from .propagation import moved, unsupported, wrap

__all__ = ["copy_", "astype", "shape", "ndim", "size"]


@implements(np.copy)
def copy_(a: Any, order: str = "K", subok: bool = False) -> DTensor:
    """``np.copy``: a copy of this rank's block, the same placements."""
    if not isinstance(a, DTensor):
        raise unsupported("np.copy")
    return wrap(a.to_local().copy(), a.device_mesh, a.placements, a.shape)


def _keeps_partial(p: Partial, src: np.dtype, dst: np.dtype) -> bool:
    """True if casting Partial terms from ``src`` to ``dst`` gives the terms of the cast array."""
    if not np.can_cast(src, dst, "safe"):
        return False
    return p.reduce_op in ("max", "min") or src.kind != "b"


@implements(np.astype)
def astype(a: Any, dtype: Any, /, *, copy: bool = True, device: Any = None) -> DTensor:
    """``np.astype`` / ``.astype(dtype)``: blockwise, a Partial reduced first unless the cast keeps it."""
    if not isinstance(a, DTensor) or device is not None:
        raise unsupported("np.astype")
    dst = np.dtype(dtype)
    need = [Replicate() if isinstance(p, Partial) and not _keeps_partial(p, np.dtype(a.dtype), dst) else p
            for p in a.placements]
    src = moved(f"DTensor.astype({dst})", "self", a, need)
    return wrap(src.to_local().astype(dst, copy=copy), a.device_mesh, src.placements, a.shape)


@implements(np.shape)
def shape(a: Any) -> tuple[int, ...]:
    """``np.shape``: the global shape."""
    return a.shape


@implements(np.ndim)
def ndim(a: Any) -> int:
    """``np.ndim``: the global number of dimensions."""
    return a.ndim


@implements(np.size)
def size(a: Any, axis: int | None = None) -> int:
    """``np.size``: the global number of elements (along ``axis`` when given)."""
    return a.size if axis is None else a.shape[axis]
