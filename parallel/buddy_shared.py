"""Buddy copies in shared memory: a rank's copy lives in a segment its buddy maps, so renewing it is one memcpy.

Within a node, a rank of a sharded strategy under ``meshkit-run --survive`` (:mod:`meshkit.parallel.buddy`)
does not send its shards to its buddy every step: it writes them into a POSIX shared-memory
segment of its own (comm/engines/shm_segment.py: created exclusively, mode 0600, an
unguessable name, the attacher checking owner, mode and size) that its buddy (index ``s - 1`` of
the shard group) mapped once. The segment's name is unlinked as soon as the buddy mapped it, so
the memory lives in the two mappings alone: when the owner dies, the buddy's mapping still holds
the last copy written, and the buddy reads it at recovery (:meth:`Mailbox.read`). No message
moves per step; the copy costs one memcpy of the shards (measured in benchmarks/survive.py).

**A torn copy is never used, and never costs the one before it.** The segment holds two slots,
written in turn (double buffering): a write goes into the older slot, so a rank killed while
writing leaves its previous copy whole in the other (the buddy rolls back one renewal further:
:mod:`meshkit.parallel.buddy`). Each slot starts with a sequence word: the owner writes -1, then
the arrays and its optimizer step counts, then the (positive) sequence number; the reader reads
the word, copies, and reads the word again, and takes the copy only where both reads agree and
are positive (a seqlock). x86-64's total store order keeps the writes in that order for the
reader, as for the shared-memory collectives (comm/engines/shm_collectives.py, "Memory
ordering"); elsewhere :func:`supported` is False and the copy goes by message. The second slot
doubles the segment (two shards' worth a rank, ``memory_report()["buddy"]``) and costs no time: a
renewal still writes one slot.

Layout of a slot (bytes; every part 64-aligned): ``[seq, nkeys, count_0 .. count_{nkeys-1}]``
(int64), then each array of the layout in order; slot 1 follows slot 0.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping

import numpy as np

from ..comm import DistValueError
from ..comm._seams import Segment, attach_segment as attach, create_segment as create

__all__ = ["Layout", "Mailbox", "supported", "enabled", "SWITCH_ENV"]


def supported() -> bool:
    """The seqlock's ordering argument holds (x86-64: TSO)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def _up(n: int) -> int:
    return -(-n // 64) * 64


class Layout:
    """Where each array and the step counts lie in a segment (the same on the owner and its buddy).

    Args:
        arrays: the owner's arrays by key (dtype and size; their shapes are flat).
        keys: the optimizer's step-count keys, in order.
    """

    def __init__(self, arrays: Mapping[str, np.ndarray], keys: list[str]) -> None:
        self.keys = list(keys)
        self.specs: list[tuple[str, np.dtype, int, int]] = []  # (key, dtype, count, offset)
        at = _up(8 * (2 + len(self.keys)))
        for key, array in arrays.items():
            self.specs.append((key, array.dtype, int(array.size), at))
            at += _up(int(array.nbytes))
        self.slot = max(at, 64)  # one slot's bytes
        self.size = 2 * self.slot  # the segment: two slots (double buffering)

    def same(self, arrays: Mapping[str, np.ndarray], keys: list[str]) -> bool:
        """Whether ``arrays`` and ``keys`` have this layout."""
        return (self.keys == list(keys) and len(self.specs) == len(arrays)
                and all(k == key and a.dtype == d and a.size == c
                        for (key, d, c, _), (k, a) in zip(self.specs, arrays.items())))


class Mailbox:
    """This rank's segment (written at each renewal) and its neighbour's (read at recovery), one layout.

    Args:
        layout: the arrays' layout.
        mine: this rank's segment (created here).
        theirs: the neighbour's segment (mapped here; None until attached).
    """

    def __init__(self, layout: Layout, mine: Segment, theirs: Segment | None = None) -> None:
        self.layout, self.mine, self.theirs = layout, mine, theirs
        words, slot = 2 + len(layout.keys), layout.slot
        self._words = [np.frombuffer(mine.memory, np.int64, words, s * slot) for s in (0, 1)]
        self._views = [{key: np.frombuffer(mine.memory, dtype, count, s * slot + at)
                        for key, dtype, count, at in layout.specs} for s in (0, 1)]
        self.seq = 0

    @classmethod
    def create(cls, layout: Layout) -> Mailbox:
        """A new mailbox with this rank's segment (``OSError`` where it cannot be created)."""
        return cls(layout, create(layout.size))

    def attach(self, path: str) -> None:
        """Map the neighbour's segment at ``path`` (``OSError``: absent, as on another node, or not ours)."""
        self.theirs = attach(path, self.layout.size)

    def write(self, arrays: Mapping[str, np.ndarray], counts: list[int]) -> None:
        """This rank's arrays and step counts into the older slot of its segment (a seqlock write: -1,
        the data, the new number); the other slot keeps the copy before."""
        self.seq += 1
        slot = self.seq % 2
        words = self._words[slot]
        words[0] = -1
        for key, view in self._views[slot].items():
            np.copyto(view, arrays[key].reshape(-1))
        words[1] = len(counts)
        words[2:2 + len(counts)] = counts
        words[0] = self.seq

    def read(self) -> list[tuple[dict[str, int], dict[str, np.ndarray]]]:
        """The neighbour's complete copies, newest first: ``(steps by key, arrays by key)`` each,
        copied out; none where it never wrote one, and a slot torn (it died while writing it) left out."""
        return [] if self.theirs is None else _slots(self.theirs.memory, self.layout)

    def read_own(self) -> list[tuple[dict[str, int], dict[str, np.ndarray]]]:
        """This rank's own copies in its segment, newest first (what its buddy would read): the shards
        at the last renewals, which a survivor rolls back to when a lost rank's shards are that old."""
        return _slots(self.mine.memory, self.layout)

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's segment, both slots (what it holds for its buddy)."""
        return self.layout.size

    def close(self) -> None:
        """Unmap both segments (their names are unlinked already)."""
        self._views = []
        self._words = []
        self.mine.close()
        if self.theirs is not None:
            self.theirs.close()


def _slots(memory: memoryview, layout: Layout) -> list[tuple[dict[str, int], dict[str, np.ndarray]]]:
    """The complete copies in a segment's two slots, newest (highest sequence number) first."""
    found: list[tuple[int, dict[str, int], dict[str, np.ndarray]]] = []
    n = len(layout.keys)
    for base in (0, layout.slot):
        words = np.frombuffer(memory, np.int64, 2 + n, base)
        before = int(words[0])
        if before <= 0:
            continue  # never written, or torn
        arrays = {key: np.frombuffer(memory, dtype, count, base + at).copy() for key, dtype, count, at in layout.specs}
        counts = [int(c) for c in words[2:2 + n]] if int(words[1]) == n else None
        if int(words[0]) != before or counts is None:
            continue  # overwritten while read
        found.append((before, dict(zip(layout.keys, counts)), arrays))
    return [(steps, arrays) for _, steps, arrays in sorted(found, key=lambda f: -f[0])]


#: ``MESHKIT_BUDDY_SHM=0`` sends the copies by message even within a node (1, the default: shared memory where it can).
SWITCH_ENV = "MESHKIT_BUDDY_SHM"


def enabled() -> bool:
    """``MESHKIT_BUDDY_SHM`` (0 or 1; 1 when unset) and :func:`supported`.

    Raises:
        DistValueError: another value, naming the variable and the valid ones.
    """
    text = os.environ.get(SWITCH_ENV, "").strip()
    if text not in ("", "0", "1"):
        raise DistValueError(f"meshkit.parallel.buddy: {SWITCH_ENV}={text!r} is not valid; valid values are 0 "
                             "(buddy copies by message) and 1 (in shared memory within a node, the default)")
    return text != "0" and supported()
