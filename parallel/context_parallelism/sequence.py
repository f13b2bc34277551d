"""Which tokens of the sequence each rank of a context-parallel group holds; sharding and unsharding.

The rule (:class:`SequenceSharding`): the sequence of ``length`` tokens is cut into ``n`` chunks as
``numpy.array_split`` cuts it: the first ``length % n`` chunks are one token longer, so chunk sizes
differ by at most one and none is empty (``length >= n`` is required). Without balancing ``n = cp`` and
rank i holds chunk i. With balancing (head-tail, for causal attention) ``n = 2 * cp`` and rank i holds
chunks ``i`` and ``2 * cp - 1 - i``, in that order: one early and one late block, so every rank's
causal attention computes the same number of scores (exactly when ``length`` divides by ``2 * cp``;
otherwise chunks differ by a token and so does the work). A rank's tokens are its chunks concatenated; :meth:`positions` are
their global positions, which causal masks and position embeddings use.

Example, 10 tokens over cp = 2 balanced (chunks of 3, 3, 2, 2)::

    rank 0: chunks 0 and 3 -> positions [0, 1, 2, 8, 9]
    rank 1: chunks 1 and 2 -> positions [3, 4, 5, 6, 7]
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ...comm import DistValueError, ProcessGroup
from ...comm._seams import resolve_group
from ...mesh import DeviceMesh
from ..arrays import array_namespace
from ..checks import where

__all__ = ["SequenceSharding", "cp_group", "shard_sequence", "unshard_sequence", "sequence_positions"]


@dataclasses.dataclass(frozen=True)
class SequenceSharding:
    """How ``length`` tokens are spread over ``cp`` ranks (see the module's rule)."""

    length: int
    cp: int
    balanced: bool = False

    def __post_init__(self) -> None:
        chunks = 2 * self.cp if self.balanced else self.cp
        if self.cp < 1 or self.length < chunks:
            how = f"2 * cp = {chunks} chunks (balanced)" if self.balanced else f"cp = {self.cp} chunks"
            raise DistValueError(f"{where('SequenceSharding')}: a sequence of length={self.length} tokens "
                                 f"cannot be split into {how}; it needs at least one token per chunk")

    @property
    def chunks(self) -> list[tuple[int, int]]:
        """``(start, stop)`` of every chunk, in sequence order."""
        n = 2 * self.cp if self.balanced else self.cp
        base, extra = divmod(self.length, n)
        bounds, start = [], 0
        for i in range(n):
            stop = start + base + (i < extra)
            bounds.append((start, stop))
            start = stop
        return bounds

    def pieces(self, rank: int) -> list[tuple[int, int]]:
        """``(start, stop)`` of rank ``rank``'s chunks, in the order its local array holds them."""
        chunks = self.chunks
        return [chunks[rank], chunks[2 * self.cp - 1 - rank]] if self.balanced else [chunks[rank]]

    def local_length(self, rank: int) -> int:
        return sum(b - a for a, b in self.pieces(rank))

    def positions(self, rank: int) -> np.ndarray:
        """Global positions (int64) of rank ``rank``'s tokens, in local order."""
        return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in self.pieces(rank)])

    def shard(self, x: Any, rank: int, axis: int = -2) -> Any:
        """Rank ``rank``'s tokens of the full sequence ``x`` (a new array)."""
        xp = array_namespace(x)
        return xp.concatenate([_take(x, a, b, axis) for a, b in self.pieces(rank)], axis=axis)

    def unshard(self, shards: list[Any], axis: int = -2) -> Any:
        """The full sequence from every rank's shard (``shards[r]`` is rank r's)."""
        xp = array_namespace(shards[0])
        by_chunk: dict[tuple[int, int], Any] = {}
        for rank, shard in enumerate(shards):
            offset = 0
            for a, b in self.pieces(rank):
                by_chunk[(a, b)] = _take(shard, offset, offset + b - a, axis)
                offset += b - a
        return xp.concatenate([by_chunk[c] for c in self.chunks], axis=axis)


def _take(x: Any, start: int, stop: int, axis: int) -> Any:
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, stop)
    return x[tuple(index)]


def cp_group(who: str, group: ProcessGroup | DeviceMesh | None) -> ProcessGroup:
    """The context-parallel group: a ProcessGroup, a 1-D mesh (``mesh["cp"]``) or None (the world)."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise DistValueError(f"{where(who)}: group must be a ProcessGroup or a 1-D mesh (e.g. mesh['cp']), got "
                                 f"a {group.ndim}-D mesh with dims {group.mesh_dim_names}")
        group = group.get_group()
    return resolve_group(group)


def shard_sequence(x: Any, group: ProcessGroup | DeviceMesh | None = None, *, balanced: bool = False,
                   axis: int = -2) -> Any:
    """This rank's tokens of the full sequence ``x`` (every rank passes the same ``x``); no communication.

    Example (cp = 2, ``x`` of 10 tokens along ``axis``, balanced): rank 0 gets tokens
    ``[0, 1, 2, 8, 9]``, rank 1 tokens ``[3, 4, 5, 6, 7]``.
    """
    g = cp_group("shard_sequence", group)
    return SequenceSharding(x.shape[axis], g.size, balanced).shard(x, g.rank, axis)


def sequence_positions(length: int, group: ProcessGroup | DeviceMesh | None = None, *,
                       balanced: bool = False) -> np.ndarray:
    """Global positions of this rank's tokens of a ``length``-token sequence (for masks, position embeddings)."""
    g = cp_group("sequence_positions", group)
    return SequenceSharding(length, g.size, balanced).positions(g.rank)


def unshard_sequence(local: Any, length: int, group: ProcessGroup | DeviceMesh | None = None, *,
                     balanced: bool = False, axis: int = -2) -> Any:
    """The full sequence on every rank, from each rank's shard ``local`` (collective: one all-gather).

    Shards of uneven length travel padded to the longest and are cut back, so the result is exact.
    """
    g = cp_group("unshard_sequence", group)
    sharding = SequenceSharding(length, g.size, balanced)
    axis = axis % local.ndim
    if local.shape[axis] != sharding.local_length(g.rank):
        raise DistValueError(f"{where('unshard_sequence', g)}: local has {local.shape[axis]} tokens along axis {axis} "
                             f"but length={length} over cp = {g.size} ranks (balanced={balanced}) gives this rank "
                             f"{sharding.local_length(g.rank)}")
    xp = array_namespace(local)
    longest = max(sharding.local_length(r) for r in range(g.size))
    moved = xp.moveaxis(local, axis, 0)
    padded = xp.zeros((longest,) + moved.shape[1:], dtype=local.dtype)
    padded[:moved.shape[0]] = moved
    gathered = xp.empty((g.size * longest,) + moved.shape[1:], dtype=local.dtype)
    g.all_gather_into_tensor(gathered, padded)
    shards = [xp.moveaxis(gathered[r * longest:r * longest + sharding.local_length(r)], 0, axis)
              for r in range(g.size)]
    return sharding.unshard(shards, axis)
