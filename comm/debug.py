"""Debugging aids: the debug level, call fingerprints and the flight recorder.

``MESHKIT_DEBUG=detail`` makes every collective first check, through a monitored exchange,
that all ranks of the group called the same operation with the same shapes, dtypes, op and
root; a mismatch raises :class:`~meshkit.comm.errors.CollectiveMismatchError` on every rank
instead of hanging or corrupting data, and a rank that never arrives is named.

The flight recorder keeps each rank's last 64 operations (as torch's NCCL flight recorder
does); it is logged on a timeout or a mismatch and readable with :func:`meshkit.comm.flight_record`.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import time
from typing import Any

from .naming import name_ranks
from .errors import CollectiveMismatchError

__all__ = [
    "DebugLevel",
    "Call",
    "fingerprint",
    "mismatch_error",
    "CollectiveRecord",
    "RECORD_FIELDS",
    "record_as_dict",
    "FlightRecorder",
    "RECORDER_SIZE",
]

#: Entries the flight recorder keeps per rank (torch's TORCH_NCCL_TRACE_BUFFER_SIZE analogue).
RECORDER_SIZE = 64


class DebugLevel(enum.IntEnum):
    """``MESHKIT_DEBUG`` (read by :func:`meshkit.comm.env.debug_level`): OFF (default), INFO (log group
    creation), DETAIL (check every call)."""

    OFF = 0
    INFO = 1
    DETAIL = 2


@dataclasses.dataclass(frozen=True)
class Call:
    """What one rank called: compared across the group in detail mode.

    ``shape`` is the part every rank must agree on (None where shapes may differ);
    ``counts`` carries per-peer element counts of all_to_all, checked pairwise.
    """

    op: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    reduce_op: str | None = None
    root: int | None = None
    counts: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def __str__(self) -> str:
        return self.describe(counts=True)

    def describe(self, *, counts: bool) -> str:
        """``op(shape=..., dtype=..., ...)``; the all_to_all counts only if ``counts`` (they are
        one list per peer: a mismatch message names the pairs that disagree instead)."""
        parts = []
        if self.shape is not None:
            parts.append(f"shape={self.shape}")
        if self.dtype is not None:
            parts.append(f"dtype={self.dtype}")
        if self.reduce_op is not None:
            parts.append(f"op={self.reduce_op}")
        if self.root is not None:
            parts.append(f"root={self.root}")
        if counts and self.counts is not None:
            parts.append(f"send_counts={list(self.counts[0])}, recv_counts={list(self.counts[1])}")
        return f"{self.op}({', '.join(parts)})"

    def agrees(self, others: list[Call]) -> bool:
        """True when every rank's call is compatible with this one (``others`` in rank order)."""
        if self.counts is None:  # the common case (every local collective): one object, see fingerprint()
            return all(o is self or o == self for o in others)
        strip = dataclasses.replace(self, counts=None)
        if any(o is None or o.counts is None or dataclasses.replace(o, counts=None) != strip for o in others):
            return False
        return not _count_disagreements(others)


@functools.lru_cache(maxsize=4096)
def fingerprint(op: str, dtype: Any, shape: tuple[int, ...] | None, reduce_op: Any, root: int | None,
                counts: tuple[tuple[int, ...], tuple[int, ...]] | None) -> Call:
    """The :class:`Call` of these arguments; one object per distinct call. The local engine makes
    one per collective and compares every rank's: a new frozen dataclass with ``str(dtype)`` costs
    many times a cache hit, and the ranks' calls, being one object, compare by identity."""
    return Call(op, None if dtype is None else str(dtype), shape, None if reduce_op is None else reduce_op.name,
                root, counts)


def _count_disagreements(calls: list[Call]) -> list[tuple[int, int]]:
    """all_to_all: the pairs ``(i, j)`` of group ranks where what i sends to j is not what j
    expects from i."""
    n = len(calls)
    return [(i, j) for i in range(n) for j in range(n) if calls[i].counts[0][j] != calls[j].counts[1][i]]


#: Pairs of ranks whose all_to_all counts disagree that a mismatch message names (then "and K more").
_PAIRS_SHOWN = 4


def mismatch_error(rank: int, group: str, ranks: tuple[int, ...], seq: int,
                   entries: list[tuple[int, Call | None]]) -> CollectiveMismatchError:
    """The error every rank raises when the members' calls differ.

    ``entries``: each group rank's ``(operation number, call)``, in group rank order (``(-1,
    None)``: a rank in an exchange without a fingerprint, such as MPI's monitored barrier). Ranks that called the same are listed together, so the
    message grows with the number of different calls, not with the group (6 ranks, one odd::

        ranks [0, 1, 3, 4, 5]: all_reduce(shape=(4,), dtype=float32, op=SUM) #0; rank 2:
        all_reduce(shape=(4,), dtype=float64, op=SUM) #0

    ); for all_to_all, the pairs whose counts disagree are named, a few of them.
    """
    described = {ranks[i]: "another exchange" if c is None else f"{c} #{s}" for i, (s, c) in enumerate(entries)}
    groups: dict[str, list[int]] = {}
    for i, (s, c) in enumerate(entries):
        shown = "another exchange (a monitored barrier?)" if c is None else f"{c.describe(counts=False)} #{s}"
        groups.setdefault(shown, []).append(ranks[i])
    listing = "; ".join(f"{name_ranks(members)}: {text}" for text, members in groups.items())
    calls = [c for _, c in entries]
    if len(groups) == 1 and all(c is not None and c.counts is not None for c in calls):
        pairs = _count_disagreements(calls)
        named = [f"rank {ranks[i]} sends {_elements(calls[i].counts[0][j])} to rank {ranks[j]}, which expects "
                 f"{calls[j].counts[1][i]} from it" for i, j in pairs[:_PAIRS_SHOWN]]
        more = f" and {len(pairs) - _PAIRS_SHOWN} more pairs" if len(pairs) > _PAIRS_SHOWN else ""
        listing += f"; counts disagree: {'; '.join(named)}{more}"
    return CollectiveMismatchError(f"meshkit.comm: rank {rank}: collective mismatch on group {group} at #{seq}: "
                                   f"{listing}", calls=described)


def _elements(n: int) -> str:
    return f"{n} element" if n == 1 else f"{n} elements"



#: The fields of a flight-recorder entry, in order. ``state``: scheduled, started, completed,
#: failed, timed_out.
#: ``path``: the way the data went where the engine tells paths apart (``"shm"`` or ``"mpi"`` on a
#: group whose ranks share a node: comm/engines/shm.py), else None.
RECORD_FIELDS = ("seq", "group", "op", "shapes", "dtype", "state", "t_scheduled", "t_start", "t_end", "error", "path")
SEQ, GROUP, OP, SHAPES, DTYPE, STATE, T_SCHEDULED, T_START, T_END, ERROR, PATH = range(len(RECORD_FIELDS))

#: One flight-recorder entry: a plain list indexed by the constants above. One is made per
#: collective call, and a list is built in C: a class with ``__slots__`` and an ``__init__``
#: runs Python per call and costs more than twice as much. Readers get dicts
#: (:meth:`FlightRecorder.entries`).
CollectiveRecord = list


def record_as_dict(record: CollectiveRecord) -> dict[str, Any]:
    out = dict(zip(RECORD_FIELDS, record))
    out["dtype"] = None if record[DTYPE] is None else str(record[DTYPE])
    return out


class FlightRecorder:
    """The last :data:`RECORDER_SIZE` operations of one rank, oldest first."""

    def __init__(self, size: int = RECORDER_SIZE) -> None:
        self._entries: collections.deque[CollectiveRecord] = collections.deque(maxlen=size)

    def record(self, seq: int, group: str, op: str, shapes: tuple[tuple[int, ...], ...],
               dtype: Any, state: str = "scheduled", at: float | None = None) -> CollectiveRecord:
        now = at or time.time()  # at: when the call began, for an entry made only once it failed
        entry = [seq, group, op, shapes, dtype, state, now, now if state == "started" else None, None, None, None]
        self._entries.append(entry)
        return entry

    def entries(self) -> list[dict[str, Any]]:
        return [record_as_dict(e) for e in list(self._entries)]

    def format(self, rank: int) -> str:
        lines = [f"meshkit flight recorder, rank {rank}, last {len(self._entries)} operations:"]
        for e in map(record_as_dict, list(self._entries)):
            start, end = e["t_start"], e["t_end"]
            took = "" if end is None or start is None else f" {1e3 * (end - start):.3f} ms"
            err = f" error={e['error']}" if e["error"] else ""
            dtype = "" if e["dtype"] is None else f" dtype={e['dtype']}"
            dtype += "" if e["path"] is None else f" path={e['path']}"
            lines.append(f"  #{e['seq']:<6} {e['group']:<24} {e['op']:<22} {e['state']:<10} shapes={list(e['shapes'])}"
                         f"{dtype}{took}{err}")
        return "\n".join(lines)
