"""Flat parameters: arrays of one dtype in one buffer, padded to split into equal shards.

Sharded data parallel keeps each dtype's parameters (per unit, for FSDP) in one flat buffer whose
length is padded up to a multiple of the number of shards N; rank r owns elements
``[r * S, (r + 1) * S)`` with ``S = padded / N``. A :class:`FlatLayout` is that arithmetic:
where each parameter lies, which shard holds which piece, and the conversions between per-
parameter arrays and flat buffers (packing for one message, and the state dicts of
:mod:`~meshkit.parallel.data_parallelism.sharded`). Padding is zero and stays zero under every elementwise optimizer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator, Sequence

import numpy as np

from ...comm import ProcessGroup
from ...state._seams import box_view, flat_range_boxes
from ...state import ShardedArray
from ..arrays import array_namespace, convert

__all__ = ["FlatLayout", "make_layouts", "flat_shard_pieces", "flat_buffer"]


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Where parameters of one dtype lie in a flat buffer split into ``shards`` equal shards.

    Example (two parameters of 3 and 2 elements, 2 shards)::

        layout.offsets == (0, 3); layout.numel == 5; layout.padded == 6; layout.shard_size == 3
        layout.shard_range(1) == (3, 6)      # the second parameter and one padding element
    """

    key: str
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    dtype: Any
    numel: int
    shards: int

    @property
    def padded(self) -> int:
        return -(-self.numel // self.shards) * self.shards

    @property
    def shard_size(self) -> int:
        return self.padded // self.shards

    def size_of(self, index: int) -> int:
        return math.prod(self.shapes[index])

    def shard_range(self, shard: int) -> tuple[int, int]:
        return shard * self.shard_size, (shard + 1) * self.shard_size

    def views(self, buffer: Any) -> dict[str, Any]:
        """``name -> view`` of each parameter inside a full flat ``buffer``."""
        return {name: buffer[off:off + self.size_of(i)].reshape(shape)
                for i, (name, shape, off) in enumerate(zip(self.names, self.shapes, self.offsets))}

    @classmethod
    def over(cls, arrays: dict[str, Any], shards: int = 1, key: str = "") -> FlatLayout:
        """The layout of ``arrays`` (one dtype), in their order, split into ``shards``."""
        offsets, total = [], 0
        for a in arrays.values():
            offsets.append(total)
            total += int(a.size)
        first = next(iter(arrays.values()))
        return cls(key or first.dtype.name, tuple(arrays), tuple(tuple(a.shape) for a in arrays.values()),
                   tuple(offsets), first.dtype, total, shards)

    def pack(self, arrays: dict[str, Any], like: Any, dtype: Any = None) -> Any:
        """A new padded flat buffer of ``like``'s array library holding ``arrays`` (missing names and
        padding are zero); ``arrays`` must be of that library (no implicit host<->device copy)."""
        return self._fill(arrays, array_namespace(like).zeros(self.padded, dtype=dtype or self.dtype))

    def pack_into(self, arrays: dict[str, Any], flat: Any) -> Any:
        """:meth:`pack` into ``flat`` (``padded`` elements, e.g. a :func:`flat_buffer`) rather than a new
        buffer: missing names and padding are zeroed. Returns ``flat``."""
        flat[...] = 0
        return self._fill(arrays, flat)

    def _fill(self, arrays: dict[str, Any], flat: Any) -> Any:
        for i, (name, off) in enumerate(zip(self.names, self.offsets)):
            if name in arrays:
                flat[off:off + self.size_of(i)] = arrays[name].reshape(-1)
        return flat

    def unpack(self, full: Any, into: dict[str, Any]) -> None:
        """Copy each parameter out of a full flat buffer into the arrays of ``into``, in place."""
        for name, view in self.views(full).items():
            into[name][...] = view

    def write_shard(self, target: Any, shard: int, arrays: dict[str, Any]) -> None:
        """Copy the pieces of ``arrays`` (per-parameter, any shape of the right size) that fall in
        ``shard`` into ``target``, that shard's flat array; parameters not in ``arrays`` keep theirs."""
        lo, hi = self.shard_range(shard)
        for i, (name, off) in enumerate(zip(self.names, self.offsets)):
            a, b = max(lo, off), min(hi, off + self.size_of(i))
            if name in arrays and a < b:
                target[a - lo:b - lo] = convert(arrays[name].reshape(-1)[a - off:b - off], target)

    def owners(self, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """``(shard, lo, hi)``: flat elements ``lo:hi`` (within [start, stop)) belong to ``shard``."""
        for shard in range(self.shards):
            s, e = self.shard_range(shard)
            lo, hi = max(start, s), min(stop, e)
            if lo < hi:
                yield shard, lo, hi

    def gather_full(self, shard: Any, group: ProcessGroup) -> Any:
        """The full padded buffer from every rank's ``shard`` (collective over ``group``)."""
        full = array_namespace(shard).empty(self.padded, dtype=shard.dtype)
        group.all_gather_into_tensor(full, shard)
        return full

    def split(self, full: Any) -> dict[str, Any]:
        """Copies of each parameter out of a full flat buffer."""
        return {name: view.copy() for name, view in self.views(full).items()}


def flat_buffer(group: ProcessGroup, size: int, dtype: Any, like: Any) -> Any:
    """A zeroed flat buffer of ``size`` elements of ``dtype`` that ``group``'s collectives run on in place.

    For NumPy arrays it is :meth:`ProcessGroup.shared_buffer <meshkit.comm.ProcessGroup.shared_buffer>`'s:
    inside the group's shared-memory segment where its ranks share a node and the path is on
    (comm/engines/shm.py), so an all_reduce, reduce_scatter or all_gather of it (or of a view of
    it at the same place on every rank) reads every rank's copy where it lies, with no copy in or
    out, at any size; elsewhere ordinary memory. Collective over ``group`` (every rank, in the same
    order among its calls). Other array libraries (CuPy) get a zeroed array of theirs.
    """
    xp = array_namespace(like)
    if xp is not np:
        return xp.zeros(size, dtype=dtype)
    return group.shared_buffer(size * np.dtype(dtype).itemsize).view(dtype)


def make_layouts(params: dict[str, Any], order: Sequence[str], shards: int, prefix: str = "") -> list[FlatLayout]:
    """One layout per dtype over ``order`` (dtypes in order of first appearance).

    Keys are ``prefix + dtype name`` (e.g. ``"float32"``, ``"unit0.float64"``): they name the
    flat shard in the optimizer's state.
    """
    by_dtype: dict[Any, list[str]] = {}
    for name in order:
        by_dtype.setdefault(params[name].dtype, []).append(name)
    return [FlatLayout.over({n: params[n] for n in names}, shards, f"{prefix}{dtype.name}")
            for dtype, names in by_dtype.items()]


def flat_shard_pieces(layout: FlatLayout, shard: Any, index: int) -> dict[str, list[ShardedArray]]:
    """Each parameter's boxes inside shard ``index`` of ``layout``, as views into ``shard``.

    Args:
        layout: the flat layout (parameters concatenated in order, padded to equal shards).
        shard: this rank's 1-D shard of the flat buffer (``layout.shard_size`` elements).
        index: which shard it is.

    Returns:
        ``{name: [ShardedArray, ...]}`` for every parameter of the layout (an empty list where
        the shard holds none of it).
    """
    lo, hi = layout.shard_range(index)
    out: dict[str, list[ShardedArray]] = {}
    for i, (name, shape, off) in enumerate(zip(layout.names, layout.shapes, layout.offsets)):
        a, b = max(lo, off), min(hi, off + layout.size_of(i))
        pieces = []
        if a < b:
            local = shard[a - lo:b - lo]
            for offsets, lengths in flat_range_boxes(shape, a - off, b - off):
                pieces.append(ShardedArray(box_view(local, shape, a - off, offsets, lengths), shape, offsets))
        out[name] = pieces
    return out
