"""Each group's calls as a running fingerprint, compared where the ranks already exchange something.

Under MPI a rank whose collective differs from the others' (4 float64 against 8, float32 against
float64, a call skipped after a caught error) gets garbage, or a later call meets the wrong one
and fails naming nothing. Checking every call (``MESHKIT_DEBUG=detail``) costs an
exchange per call: 1.2-3.7x at small sizes (docs/hangs.md). Instead each group keeps a
:class:`CallSequence`: a 62-bit running hash of its calls (operation, shape, dtype, reduce op,
root; not the all_to_all counts, which differ between ranks by design), updated as each call is
numbered, and the last :data:`RING` calls. The fingerprint is compared where the ranks exchange
something anyway, with no extra message where they do:

* the data-parallel strategies' per-step agreement (one all-reduce of a few integers per step):
  :func:`stamp` writes the fingerprint into :data:`SLOTS` more integers of it, and
  :func:`verify` reads them back; the step raises on every rank before anything is applied;
* ``barrier()`` (on engines that do not compare calls themselves): a ``MAX`` all-reduce of those
  integers instead of a barrier, the same one message round;
* group creation (``new_group``, ``split``, meshes), whatever the debug level: an exchange of
  what each rank is creating, before the blocking split (comm/groups/group.py);
* the object collectives (checkpoint agreement, ``all_gather_object``...): their sizes carry the
  fingerprint (comm/objects.py).

A ``MAX`` all-reduce of ``(hi, lo, -hi, -lo)`` (the fingerprint in two 31-bit halves, so that
int32 arrays carry it too) gives every rank the largest and the smallest fingerprint at once:
they are equal only if every rank's is. When they differ, every rank that found it exchanges its
last calls (:func:`explain`, the failure path only), so that all raise the same
:class:`~meshkit.comm.errors.CollectiveMismatchError` naming the first call number where the
members differ, the ranks and what each called; the group is then broken (later calls raise,
the other members are told).

Cost of keeping it: a cached lookup of the call's digest and an integer multiply-add a call
(``python -c "from meshkit.comm.groups import call_fingerprint; call_fingerprint.timings()"``).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
import time
from typing import Any

import numpy as np

from ..naming import name_ranks
from ..debug import Call, fingerprint
from ..engines.engine import DeadlineExceeded
from ..errors import CollectiveMismatchError, DistError

__all__ = ["CallSequence", "RING", "SLOTS", "EXPLAIN_SECONDS", "MISMATCH_NOTICE", "entry", "creation", "stamp",
           "verify", "compare", "same_creation", "explain"]

logger = logging.getLogger("meshkit")

#: Calls each group remembers (its number, the fingerprint after it, the call), to name the
#: first one where the members differ: as many as the flight recorder keeps (torch's 64).
RING = 64
#: Integers of an agreement array that carry the fingerprint (see the module docstring).
SLOTS = 4
_MASK = (1 << 62) - 1
#: An odd multiplier (2**64 / golden ratio, masked): the fingerprint after a call is
#: ``(before * _MUL + digest) mod 2**62``, so the order of calls counts, not only the set.
_MUL = (0x9E3779B97F4A7C15 & _MASK) | 1
_HALF = 31
_LOW = (1 << _HALF) - 1
#: Seconds the ranks that found a mismatch wait for each other's last calls. Every member that
#: took part in the same comparison finds it in the same moment (they all hold the same result),
#: so they meet within milliseconds; the bound is for a member that was in another call (whose
#: data the comparison then read): it learns of the mismatch from this rank's notice instead.
EXPLAIN_SECONDS = 5.0
#: The exchange number of :func:`explain` (other unnumbered exchanges use -1 to -6).
_EXPLAIN_SEQ = -7


def _digest(text: str) -> int:
    """A 62-bit digest of ``text``, the same in every process (``hash()`` of a str is not)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & _MASK


@functools.lru_cache(maxsize=4096)
def entry(op: str, dtype: Any, shape: tuple[int, ...] | None, reduce_op: Any, root: int | None,
          counts: tuple[tuple[int, ...], tuple[int, ...]] | None) -> tuple[int, Call]:
    """``(digest, call)`` of a collective's arguments: the :class:`~meshkit.comm.debug.Call`
    (detail mode's fingerprint, kept in the ring to name it) and the digest that goes into the
    sequence. The counts are part of the call, not of the digest (they differ between ranks)."""
    call = fingerprint(op, dtype, shape, reduce_op, root, counts)
    return _digest(f"{call.op}|{call.dtype}|{call.shape}|{call.reduce_op}|{call.root}"), call


def creation(partition: Any) -> tuple[int, str]:
    """``(digest, description)`` of a group-creating split of ``partition`` (lists of global ranks;
    None: a split whose groups are not known here, described as such)."""
    if partition is None:
        return _digest("split|?"), "split()"
    parts = sorted(sorted(int(r) for r in part) for part in partition)
    shown = parts if len(parts) <= 4 else [*parts[:4], "..."]
    return _digest(f"split|{parts}"), f"split(groups={shown}{'' if len(parts) <= 4 else f' ({len(parts)} groups)'})"


class CallSequence:
    """The running fingerprint of one group's calls on this rank, and its last :data:`RING` calls.

    Attributes:
        value: the fingerprint after the last call (0 before any).
        ring: ``(number, fingerprint after it, call)`` of the last calls, oldest first.
        agreed: ``(calls, fingerprint)`` at the last comparison every member passed.
    """

    __slots__ = ("value", "ring", "agreed")

    def __init__(self) -> None:
        self.value = 0
        self.ring: collections.deque[tuple[int, int, Any]] = collections.deque(maxlen=RING)
        self.agreed = (0, 0)

    def add(self, seq: int, digest: int, what: Any) -> None:
        """Call ``seq`` (``what``: its Call, or a description) was numbered on this rank."""
        value = self.value = (self.value * _MUL + digest) & _MASK
        self.ring.append((seq, value, what))


def _halves(value: int) -> np.ndarray:
    hi, lo = value >> _HALF, value & _LOW
    return np.array([hi, lo, -hi, -lo], np.int64)


def stamp(group: Any) -> tuple[np.ndarray, tuple[int, int]]:
    """This rank's fingerprint of ``group``'s calls so far, as the :data:`SLOTS` integers a ``MAX``
    all-reduce compares (every value fits an int32), and the token :func:`verify` takes back.

    Example (the agreement of a step)::

        values, token = stamp(group)
        flags[-SLOTS:] = values              # beside the step's own flags
        group.all_reduce(flags, ReduceOp.MAX)
        verify(group, to_host(flags)[-SLOTS:], token, "DDP's gradient sync")
    """
    value = group.queue.sequence.value
    return _halves(value), (group.queue.seq, value)


def verify(group: Any, reduced: Any, token: tuple[int, int], where: str) -> None:
    """After the ``MAX`` all-reduce of :func:`stamp`'s integers: return if every member's
    fingerprint was this rank's; else raise the mismatch on every rank (:func:`explain`)."""
    hi, lo, neg_hi, neg_lo = (int(x) for x in reduced)
    if hi == -neg_hi and lo == -neg_lo:
        group.queue.sequence.agreed = token
        return
    raise explain(group, token, where)


def compare(group: Any, values: list[int], token: tuple[int, int], where: str) -> None:
    """Where every member's fingerprint came back (the object collectives' sizes): raise the
    mismatch on every rank unless they are all equal."""
    if all(v == values[0] for v in values):
        group.queue.sequence.agreed = token
        return
    raise explain(group, token, where)


#: The exchange number of group creation's check (:func:`same_creation`): fixed, not the call's
#: number, so that members whose numbers differ (a call skipped on one rank) still meet, and differ.
_CREATION_SEQ = -8


def same_creation(group: Any, description: str, deadline: float) -> None:
    """Before a blocking split of ``group``: check that every member is making this same call
    (``description``, already added to the fingerprint), whatever the debug level (a
    rank in another call would otherwise leave the split waiting forever).

    One exchange of ``(calls, fingerprint, description)``: group creation is rare, and a member
    in another call (a ``barrier()``) would otherwise leave the others in MPI's ``Comm.Split``,
    which has no deadline. A member that does not come is named by the exchange's timeout
    (:class:`~meshkit.comm.engines.engine.DeadlineExceeded`); members making another creation, or whose
    earlier calls differ, raise the mismatch on every member.
    """
    queue = group.queue
    token = (queue.seq, queue.sequence.value)
    mine = (token[0], token[1], description)
    parts = group.engine.exchange(mine, _CREATION_SEQ, deadline, watched=True)
    if all(type(p) is tuple and len(p) == 3 and p[1] == token[1] for p in parts):
        queue.sequence.agreed = token
        return
    texts = [p[2] if type(p) is tuple and len(p) == 3 else None for p in parts]
    if len(set(texts)) == 1:  # the same creation, after different calls: name the first that differs
        raise explain(group, token, f"{description}'s check that every rank makes the same call")
    by_text: dict[str, list[int]] = {}
    for i, (p, text) in enumerate(zip(parts, texts)):
        shown = f"{text} #{p[0] - 1}" if text is not None else "another exchange (a monitored barrier?)"
        by_text.setdefault(shown, []).append(group.ranks[i])
    listing = "; ".join(f"{name_ranks(rs)}: {text}" for text, rs in by_text.items())
    error = CollectiveMismatchError(
        f"meshkit.comm: rank {group.global_rank}: group creation mismatch on group {group.name} (ranks "
        f"{list(group.ranks)}): every member must create the same groups at the same point; {listing}",
        calls={r: text for text, rs in by_text.items() for r in rs})
    if group.failures.reason is None:
        group.failures.broken(f"group creation mismatch: {listing}", token[0])
    raise error


def _text(what: Any) -> str:
    return what if isinstance(what, str) else str(what)


#: How the notice of a group broken by a mismatch begins: a member stalled in another call of the
#: group that reads it joins the exchange that names the calls (comm/groups/failures.py), so that it too
#: raises the mismatch, and the others learn what it called.
MISMATCH_NOTICE = "meshkit: collective mismatch"


def explain(group: Any, token: tuple[int, int], where: str) -> CollectiveMismatchError:
    """The members' fingerprints differ: break the group (later calls raise; the other members are
    told, and one stalled in another call of the group comes to this exchange), exchange the calls
    made since the last comparison that passed (the failure path only), and return the error to
    raise, the same on every member that took part.

    A member that does not come within :data:`EXPLAIN_SECONDS` (busy in its own code) is named as such.
    """
    sequence, me = group.queue.sequence, group.global_rank
    calls, value = token
    since = sequence.agreed[0]
    failures = group.failures
    if failures.reason is None:  # every later call on the group is garbage: the notice blocks waits from `since` on
        failures.broken(f"{MISMATCH_NOTICE} on group {group.name} after call #{since}, found by {where}", since)
    mine = (calls, since, [(s, v, _text(w)) for s, v, w in list(sequence.ring) if s >= since])
    parts: list[Any] = [None] * group.size
    absent: list[int] = []
    try:
        deadline = time.monotonic() + min(group.timeout, EXPLAIN_SECONDS)
        parts = list(group.engine.exchange(mine, _EXPLAIN_SEQ, deadline))
    except DeadlineExceeded as exc:
        absent = sorted(exc.missing or [r for r in group.ranks if r != me])
        parts[group.rank] = mine
    except DistError as exc:  # the exchange itself failed: say what this rank knows
        logger.debug("meshkit: rank %d: the exchange naming a mismatch failed: %s", me, exc)
        parts[group.rank] = mine
    listing, first, calls_by_rank = _describe(group, parts, absent)
    message = (f"meshkit.comm: rank {me}: collective mismatch on group {group.name} (ranks {list(group.ranks)}), "
               f"found by {where}: {listing}. Found by comparing a fingerprint of each group's calls where the ranks "
               f"exchange something anyway; MESHKIT_DEBUG=detail checks every call as it is made")
    error = CollectiveMismatchError(message, calls=calls_by_rank)
    from .world import dump_flight_record  # world imports nothing of this module; kept off the import path
    logger.error("%s\n%s", error, group.world.recorder.format(me))
    dump_flight_record(group.world, error)
    return error


def _describe(group: Any, parts: list[Any], absent: list[int]) -> tuple[str, int, dict[int, str]]:
    """From each member's ``(calls, since, [(seq, value, text)])`` (None: not heard from): the
    listing of what each called at the first call where they differ, that call's number, and
    ``{rank: description}``. The same on every rank that holds the same ``parts``."""
    ranks = group.ranks
    known = {ranks[i]: p for i, p in enumerate(parts) if p is not None}
    logs = {r: {s: (v, t) for s, v, t in p[2]} for r, p in known.items()}
    counts = {r: p[0] for r, p in known.items()}
    start = min((p[1] for p in known.values()), default=0)
    end = max(counts.values(), default=0)
    first = None
    for s in range(start, end):  # a call older than a rank's ring is unknown there, not different
        seen = {logs[r][s][0] if s in logs[r] else None for r in known if s in logs[r] or s >= counts[r]}
        if len(seen) > 1:
            first = s
            break
    if first is None:  # every call known agrees: one rank made more calls than another, or the ring is too short
        first = min(counts.values(), default=start)
    by_text: dict[str, list[int]] = {}
    described: dict[int, str] = {}
    for r in sorted(known):
        if first in logs[r]:
            text = f"{logs[r][first][1]} #{first}"
        elif first >= counts[r]:
            text = f"no call #{first} (it had made {counts[r]} calls on the group)"
        else:
            oldest = min(logs[r], default=counts[r])
            text = f"call #{first} is older than the last {RING} it keeps (it had made {counts[r]}; its oldest kept: #{oldest})"
        described[r] = text
        by_text.setdefault(text, []).append(r)
    listing = "; ".join(f"{name_ranks(rs)}: {text}" for text, rs in by_text.items())
    if absent:
        listing += (f"; {name_ranks(absent)} did not take part in the comparison within {EXPLAIN_SECONDS:g} s "
                    "(in another call)")
        described.update({r: "another call" for r in absent})
    return f"the members' calls differ from #{first} on: {listing}", first, described



def timings() -> None:
    """Print what keeping the sequence costs per call."""
    import timeit

    from ..reduce_op import ReduceOp

    x, op, sequence = np.ones(4), ReduceOp.SUM, CallSequence()

    def one_call() -> None:
        digest, call = entry("all_reduce", x.dtype, x.shape, op, None, None)
        sequence.add(0, digest, call)

    n = 200_000
    base = min(timeit.repeat(lambda: None, number=n, repeat=5)) / n
    cost = min(timeit.repeat(one_call, number=n, repeat=5)) / n
    print(f"sequence update per call: {1e6 * (cost - base):.2f} us")
