"""Basic indexing of a DTensor (``d[2]``, ``d[:, 1:4]``, ``d[..., None]``): arithmetic, no communication.

Integers, slices, ``...`` and ``None`` apply to each rank's block along dims no mesh dim shards
(a Partial stays: selecting elements commutes with the reduction of the terms), and Shard dims
are renumbered past the dims integers remove and ``None`` adds. A sharded dim takes only ``:``
locally; any other index there is :mod:`.selection`'s (it moves data where it must, and says so
at DEBUG), as are one integer array (``np.take``'s rule) and boolean masks (a data-dependent
length every rank learns), and writes ``x[key] = value``, each rank its own part.

Example (2 ranks, ``A`` of shape ``(4, 6)``, ``[Shard(1)]``): ``d[1:3]`` gives rank 0
``A[1:3, 0:3]`` and rank 1 ``A[1:3, 3:6]``, placements ``[Shard(1)]``, shape ``(2, 6)``;
``d[2]`` gives ``A[2, 0:3]`` / ``A[2, 3:6]``, placements ``[Shard(0)]``; ``d[:, 2]`` raises.
"""

from __future__ import annotations

import numbers
from typing import Any, Sequence

from . import errors
from .placements import Placement, Shard

__all__ = ["index_plan", "expand"]

def expand(op: str, key: Any, ndim: int) -> list[Any]:
    """``key`` as one entry per dim plus the ``None`` entries, ``...`` filled with full slices."""
    key = list(key) if isinstance(key, tuple) else [key]
    for k in key:
        if not (k is None or k is Ellipsis or isinstance(k, (slice, numbers.Integral))) or isinstance(k, bool):
            raise NotImplementedError(errors.prefix(op) + f"index {k!r} ({type(k).__name__}) is not supported on a "
                                      "DTensor; integers, slices, ... and None are (index full_tensor() or "
                                      "to_local() for the others)")
    if key.count(Ellipsis) > 1:
        raise IndexError(f"{errors.prefix(op)}an index can only have a single ellipsis ('...')")
    used = sum(k is not None and k is not Ellipsis for k in key)
    if used > ndim:
        raise IndexError(f"{errors.prefix(op)}too many indices for a DTensor of {ndim} dimensions: {used} were indexed")
    if Ellipsis in key:
        at = key.index(Ellipsis)
        key[at:at + 1] = [slice(None)] * (ndim - used)
    else:
        key += [slice(None)] * (ndim - used)
    return key


def index_plan(key: Any, shape: Sequence[int], placements: Sequence[Placement]
               ) -> tuple[tuple[Any, ...], tuple[int, ...], tuple[Placement, ...]]:
    """``(the key for each rank's block, the result's global shape, its placements)`` for ``d[key]``.

    Raises:
        NotImplementedError: an index other than ``:`` on a sharded dim, or an unsupported kind
            of index (naming it).
        IndexError: an integer out of range, too many indices, two ellipses (as NumPy).
    """
    op = "DTensor.__getitem__"
    key = expand(op, key, len(shape))
    sharded = {p.dim for p in placements if isinstance(p, Shard)}
    new_dim: dict[int, int] = {}  # old dim -> new dim (dims an integer removes are absent)
    out_shape: list[int] = []
    local_key: list[Any] = []
    d = 0
    for k in key:
        if k is None:
            out_shape.append(1)
            local_key.append(None)
            continue
        n = shape[d]
        if d in sharded and not (isinstance(k, slice) and range(*k.indices(n)) == range(n)):
            raise NotImplementedError(errors.prefix(op) + f"index {k!r} on dim {d}, which placements "
                                      f"{tuple(placements)!r} shard: only ':' is supported there (the chunks would "
                                      "move between ranks); redistribute that dim to Replicate first")
        if isinstance(k, slice):
            new_dim[d] = len(out_shape)
            out_shape.append(len(range(*k.indices(n))))
            local_key.append(slice(None) if d in sharded else k)
        else:
            if not -n <= k < n:
                raise IndexError(f"{errors.prefix(op)}index {k} is out of bounds for dim {d} with size {n}")
            local_key.append(int(k))
        d += 1
    out = tuple(Shard(new_dim[p.dim]) if isinstance(p, Shard) else p for p in placements)
    return tuple(local_key), tuple(out_shape), out

