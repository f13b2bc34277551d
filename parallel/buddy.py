"""Buddy copies: each rank keeps a copy of a neighbour's shards in memory, so sharded state survives a lost rank.

Under ``meshkit-run --survive K`` (``MESHKIT_SURVIVE`` set by the launcher) a sharded strategy
(ZeRO-1/2, FSDP, HSDP) holds, besides its own flat shards, a copy of those of the next rank of
its shard group: shard index ``s`` keeps index ``(s + 1) % n``'s parameter shards and optimizer
state shards (every flat key's), with that rank's optimizer step counts.

**Cadence.** :meth:`BuddyCopy.refresh` renews the copy when the optimizer step count is a
multiple of the cadence K, after the first step, and right after a shrink; between renewals a step
pays nothing for the copy. K is ``MESHKIT_BUDDY_EVERY`` (:data:`EVERY_ENV`) where set; unset, it is
:data:`EVERY_DEFAULT` while the copy measures the step and the renewal, then, at the first renewal
after :data:`MEASURED_STEPS` steps that set nothing up, :func:`choose_every` of the slowest rank's
figures: a renewal at most 1% of a step, a replay at most 0.25 s. After a failure the survivors
roll back to the last renewal (``k0``) when a lost rank's shards are held only there, and the loop
replays the steps since (at most K - 1; the data of a step depends on the step alone, so the
result is still exact). ``MESHKIT_BUDDY_EVERY=1`` renews after every step.

Within a node (the default, ``MESHKIT_BUDDY_SHM``) each rank writes its shards into a shared-memory
segment of its own that index ``s - 1`` mapped once (:mod:`meshkit.parallel.buddy_shared`: one
memcpy, no message; two slots written in turn, so a rank killed mid-write leaves the renewal
before whole; the segment outlives its owner while its buddy maps it). The rank's own segment also
holds its own shards at the last renewals, which a survivor rolls back to: no more memory. Elsewhere
it is one exchange over the shard group (each rank sends its shards to index ``s - 1`` and receives
index ``s + 1``'s, every message posted before any is waited on), and with ``MESHKIT_BUDDY_EVERY``
above 1 the rank also keeps a local snapshot of its own shards at the renewal. Either way two
shards' worth of parameters and optimizer state per rank are held (``memory_report()["buddy"]``;
one on the message path at ``MESHKIT_BUDDY_EVERY=1``). A plain run builds no copy and pays nothing.

When ranks die, :func:`contribution` is what a survivor still holds (its own live shards, its own
copies at the last renewals, and its copies of its neighbour's, read locally: no communication)
and :func:`assemble` makes one full state dict (``{"model", "optim"}``,
:mod:`~meshkit.parallel.data_parallelism.full_state`'s shape, loadable at any world size) at the
newest step at which every shard is held, or says which shards are lost (a rank and the rank
holding its copy both dead, with no other replica of that shard, as HSDP's replicate dimension
has). :func:`meshkit.parallel.survive.shrink` does the exchange between the two.

A failure inside a renewal by message invalidates the receiving rank's copy (a half-received
message is never used); within a node a torn slot is skipped and the other slot (one renewal
older) used. A failure after some ranks renewed and before others did leaves copies of different
steps: :func:`assemble` takes the newest step at which every shard is held, and refuses (the job
ends, or restarts under ``--max-restarts``) where there is none (docs/elastic.md "Surviving
failures", limits).
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..comm import DistError, DistValueError, ProcessGroup, ReduceOp
from ..comm._seams import SEGMENT_NAME_BYTES as NAME_BYTES, agree
from . import buddy_shared
from .arrays import array_namespace, to_host
from .buddy_shared import Mailbox

if TYPE_CHECKING:  # the strategies import this module: nothing of theirs at run time
    from .data_parallelism.flat import FlatLayout
    from .optim.optimizers import Optimizer

__all__ = ["BuddyCopy", "Held", "Contribution", "ShardsLostError", "contribution", "assemble", "choose", "join",
           "every", "choose_every", "BUDDY_TAG", "EVERY_ENV", "EVERY_DEFAULT"]

#: The tag of the exchange's messages, apart from a user's point-to-point traffic on the same group
#: (tag 0 by default). Below 32767, the least upper bound MPI guarantees for tags.
BUDDY_TAG = 25205


#: The variable of the copy's cadence: renewed when the optimizer step count is a multiple of it.
EVERY_ENV = "MESHKIT_BUDDY_EVERY"
#: The cadence while it is measured, unset: renewals after the first step and at multiples of 8 (the
#: measured step and renewal then choose the cadence: :func:`choose_every`).
EVERY_DEFAULT = 8
#: The largest value accepted (a failure replays up to that many steps less one).
EVERY_MAX = 10_000
#: Chosen cadences keep one renewal's share of a step at most this (1%), ...
RENEWAL_SHARE = 0.01
#: ... and the replay after a failure (up to K - 1 steps) at most this many seconds, which wins where
#: both cannot hold; within 1..:data:`CHOSEN_MAX`.
REPLAY_SECONDS = 0.25
CHOSEN_MAX = 64
#: Step intervals measured before the cadence is chosen (at the next renewal due at :data:`EVERY_DEFAULT`).
MEASURED_STEPS = 4
#: Renewals whose step counts :attr:`BuddyCopy.renewed` keeps.
RENEWALS_KEPT = 1024


def every() -> int | None:
    """``MESHKIT_BUDDY_EVERY``: renew the buddy copy every this many optimizer steps; None when unset
    (the copy chooses: :func:`choose_every`).

    Raises:
        DistValueError: not an integer in 1..:data:`EVERY_MAX`, naming the variable and the valid values.
    """
    text = os.environ.get(EVERY_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or not 1 <= int(text) <= EVERY_MAX:
        raise DistValueError(f"meshkit.parallel.buddy: {EVERY_ENV}={text!r} is not valid; valid values are integers "
                             f"from 1 (renew the buddy copy after every optimizer step) to {EVERY_MAX} (unset: chosen "
                             "from the measured step and renewal; a failure replays up to that many steps less one)")
    return int(text)


def choose_every(renewal_s: float, step_s: float) -> int:
    """The cadence for a renewal of ``renewal_s`` seconds and a step of ``step_s``: the smallest power of
    two whose renewal share is at most :data:`RENEWAL_SHARE`, lowered (by halving) until the longest
    replay, ``K - 1`` steps, fits :data:`REPLAY_SECONDS`; between 1 and :data:`CHOSEN_MAX`.

    Measured at 2-4 ranks on 2 cores (docs/elastic.md, "Surviving failures", the cadence): zero1's
    2.5 ms step with its 0.2-0.5 ms renewal got 16, 32 or 64 (a renewal every 8 steps had cost it
    1-3.5% of a step); a 1 s step gets 1 (nothing replayed; the renewal is 0.1% of it)."""
    k = 1
    while k < CHOSEN_MAX and renewal_s > RENEWAL_SHARE * k * step_s:
        k *= 2
    while k > 1 and (k - 1) * step_s > REPLAY_SECONDS:
        k //= 2
    return k


class ShardsLostError(DistError):
    """Some shard is held by no survivor at a step where every other shard is held: the sharded
    state cannot be rebuilt in memory (the job ends, or restarts under ``--max-restarts``)."""


def _count(optimizer: Optimizer) -> int:
    """The optimizer steps taken (the same on every flat key after a complete step; 0 before the first)."""
    return max((int(c) for c in optimizer.steps.values()), default=0)


def _arrays(layouts: Sequence[FlatLayout], shards: Mapping[str, Any], optimizer: Optimizer) -> dict[str, Any]:
    """This rank's flat shards, by ``key`` (parameters) and ``key:state`` (optimizer state), in a fixed order."""
    out: dict[str, Any] = {}
    for lay in layouts:
        out[lay.key] = shards[lay.key]
        for name, flat in sorted(optimizer.state.get(lay.key, {}).items()):
            out[f"{lay.key}:{name}"] = flat
    return out


class BuddyCopy:
    """A copy of the next shard's state (index ``(s + 1) % n`` of the shard group), renewed every K
    optimizer steps (``MESHKIT_BUDDY_EVERY``, or chosen: see the module docstring).

    Args:
        owner: the strategy (a :class:`~meshkit.parallel.data_parallelism.sharded.ShardOwner`):
            its ``_shard_group()``, ``_layouts()``, ``_param_shards()`` and ``optimizer``.

    Raises:
        DistValueError: ``MESHKIT_BUDDY_EVERY`` or ``MESHKIT_BUDDY_SHM`` is not valid.
    """

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        chosen = every()  # read once, at construction: every rank of the job has the same (the launcher's)
        #: unset: the cadence is chosen from what this group measures (:func:`choose_every`), once
        self.auto = chosen is None
        self.every = EVERY_DEFAULT if chosen is None else chosen  # the cadence now
        #: the optimizer step counts of the last renewals (benchmarks read it; bounded for long jobs)
        self.renewed: collections.deque[int] = collections.deque(maxlen=RENEWALS_KEPT)
        self._last_call: float | None = None  # when refresh() was last called: once a step, at its end
        #: the last step intervals (auto only, until the cadence is chosen)
        self._intervals: collections.deque[float] = collections.deque(maxlen=EVERY_DEFAULT)
        buddy_shared.enabled()  # validated here too, not at the first renewal
        #: the message path with every > 1: this rank's own shards at the last renewal, and their step counts
        self.snapshot: dict[str, Any] = {}
        self.snapshot_steps: dict[str, int] = {}
        self.arrays: dict[str, Any] = {}  # the copy, shaped as the neighbour's shards (= this rank's)
        self.steps: dict[str, int] = {}  # the neighbour's optimizer step counts, per flat key
        self.valid = False  # a complete copy is held (False before the first step and after a failed exchange)
        self._counts: Any = None
        #: within a node: this rank's copy in its own segment, its neighbour's mapped (buddy_shared.py);
        #: None where the copies go by message
        self.mailbox: Mailbox | None = None
        self._agreed = False  # every rank of the group checked to have the same ``every`` (at the first renewal)
        self._by_message = False  # a rank of the group could not map its neighbour's segment: messages for good
        #: renewals done; of them, those that set up (agreed, mapped the segments); the wall time of the
        #: others and of those apart (benchmarks/survive.py reports them)
        self.refreshes = 0
        self.setups = 0
        self.seconds = 0.0
        self.setup_seconds = 0.0
        self._last_renewal, self._last_setup = 0.0, True  # the wall time of the last renewal; whether it set up

    @property
    def nbytes(self) -> int:
        """Bytes the copy holds (what ``memory_report()["buddy"]`` says): this rank's segment, which its
        buddy maps, within a node; else the neighbour's copy received and the step counts."""
        if self.mailbox is not None:
            return self.mailbox.nbytes
        snapshot = sum(int(a.nbytes) for a in self.snapshot.values())
        return (sum(int(a.nbytes) for a in self.arrays.values()) + snapshot
                + (0 if self._counts is None else 2 * int(self._counts.nbytes)))

    def held(self) -> list[tuple[dict[str, int], dict[str, np.ndarray]]]:
        """The neighbour's complete copies, on the host, newest first: ``(its step counts, its
        arrays)`` each; none before the first renewal or where a failure tore the copy."""
        if self.mailbox is not None:
            return self.mailbox.read()
        if not self.valid:
            return []
        return [(dict(self.steps), {k: np.array(to_host(a)) for k, a in self.arrays.items()})]

    def own(self) -> list[tuple[dict[str, int], dict[str, np.ndarray]]]:
        """This rank's own shards at the last renewals, on the host, newest first (within a node:
        its segment's slots; by message: the snapshot kept when ``every`` > 1)."""
        if self.mailbox is not None:
            return self.mailbox.read_own()
        if not self.snapshot:
            return []
        return [(dict(self.snapshot_steps), {k: np.array(to_host(a)) for k, a in self.snapshot.items()})]

    def due(self) -> bool:
        """Whether the step just taken renews the copy: its count a multiple of ``every``, or the first step."""
        count = _count(self.owner.optimizer)
        return count % self.every == 0 or count == 1

    def refresh(self, force: bool = False) -> None:
        """Renew the copy where :meth:`due` (or ``force``: right after a shrink), collective over the
        shard group: within a node this rank's shards are written into its own segment, which index
        ``s - 1`` maps; else they are sent to index ``s - 1`` and index ``s + 1``'s received.
        Every rank of the group decides alike (the same step count, the same ``every``)."""
        group: ProcessGroup = self.owner._shard_group()
        if group.size == 1:
            return  # the only shard: no other rank could keep it
        now = time.perf_counter()
        if self.auto and self._last_call is not None:
            self._intervals.append(now - self._last_call)
        self._last_call = now
        if not force and not self.due():
            return
        started = now
        self.renewed.append(_count(self.owner.optimizer))
        self._renew(group, started)
        if self.auto and not force and len(self._intervals) >= MEASURED_STEPS and not self._last_setup:
            self._choose(group, self._last_renewal)

    def _choose(self, group: ProcessGroup, renewal_s: float) -> None:
        """Choose the cadence from this renewal and the step intervals measured (every rank of the group
        here at the same step count, after the same renewals): the slowest rank's figures (one MAX
        all-reduce), so every rank computes the same :func:`choose_every`. Once."""
        figures = np.array([renewal_s, float(np.median(self._intervals))])
        group.all_reduce(figures, ReduceOp.MAX)
        self.every = choose_every(float(figures[0]), float(figures[1]))
        self.auto = False
        self._intervals.clear()
        if self.every == 1:  # nothing to roll back to on the message path: no snapshot kept
            self.snapshot, self.snapshot_steps = {}, {}

    def _renew(self, group: ProcessGroup, started: float) -> None:
        mine = _arrays(self.owner._layouts(), self.owner._param_shards(), self.owner.optimizer)
        xp = array_namespace(next(iter(mine.values())))  # NumPy, or CuPy on the GPU engine (counts too)
        setup = not self._agreed
        if setup:
            self._agree(group)
        keys = sorted(self.owner.optimizer.steps)
        if xp is np and not self._by_message and buddy_shared.enabled():
            if self.mailbox is None or not self.mailbox.layout.same(mine, keys):
                self._open_mailbox(group, mine, keys)
                setup = True
            if self.mailbox is not None:
                self.mailbox.write(mine, [int(self.owner.optimizer.steps[k]) for k in keys])
                self.valid = True  # (this rank's copy, for its buddy to read: held() reads the neighbour's)
                self._timed(started, setup)
                return
        if list(mine) != list(self.arrays) or any(self.arrays[k].shape != a.shape for k, a in mine.items()):
            self.arrays = {k: xp.empty_like(a) for k, a in mine.items()}  # AdamW's state appears at its first step
        # the number of counts first: never an empty message (no step counts before the first step)
        sent = xp.asarray(np.array([len(keys), *(int(self.owner.optimizer.steps[k]) for k in keys)], np.int64))
        received = xp.empty_like(sent)
        if self.every > 1:  # this rank's own shards at this renewal, which a rollback to it needs
            if list(mine) != list(self.snapshot) or any(self.snapshot[k].shape != a.shape for k, a in mine.items()):
                self.snapshot = {k: xp.empty_like(a) for k, a in mine.items()}
            for key, a in mine.items():
                self.snapshot[key][...] = a
            self.snapshot_steps = {k: int(self.owner.optimizer.steps[k]) for k in keys}
        self.valid = False  # until every message has arrived: a half-received copy is never used
        to, of = (group.rank - 1) % group.size, (group.rank + 1) % group.size
        works = [group.irecv(received, of, BUDDY_TAG)] + [group.irecv(a, of, BUDDY_TAG) for a in self.arrays.values()]
        works += [group.isend(sent, to, BUDDY_TAG)] + [group.isend(a, to, BUDDY_TAG) for a in mine.values()]
        for work in works:
            work.wait()
        self.steps = {k: int(c) for k, c in zip(keys, to_host(received)[1:])}
        self._counts = sent
        self.valid = True
        self._timed(started, setup)

    def _timed(self, started: float, setup: bool) -> None:
        self.refreshes += 1
        self._last_renewal, self._last_setup = time.perf_counter() - started, setup
        if setup:
            self.setups += 1
            self.setup_seconds += self._last_renewal
        else:
            self.seconds += self._last_renewal

    def _agree(self, group: ProcessGroup) -> None:
        """At the first renewal: every rank of the group has the same ``every`` (else some would renew
        when others do not: the exchange would wait out its timeout, a rollback would find no common
        step). Through comm's one agreement: every rank raises the same error, or none does."""
        def compare(g: Any, values: list[Any]) -> str | None:
            if len(set(values)) == 1:
                return None
            listed = ", ".join(f"{v} on rank {r}" for r, v in zip(g.ranks, values))
            return (f"meshkit.parallel.buddy: {EVERY_ENV} differs across the shard group ({listed}): set the same "
                    "value on every rank")
        agree(group, "unset" if self.auto else self.every, compare=compare, error=DistValueError)
        self._agreed = True

    def _open_mailbox(self, group: ProcessGroup, mine: dict[str, Any], keys: list[str]) -> None:
        """Collective over the shard group: each rank creates its segment for ``mine``'s layout, the
        names are all-gathered, each maps its neighbour's (index ``s + 1``), and once every rank has
        (an all-reduce of the verdicts) each unlinks its own name. Where any rank could not (the
        group spans nodes, /dev/shm is full), every rank sends its copies by message from then on."""
        if self.mailbox is not None:
            self.mailbox.close()
            self.mailbox = None
        layout = buddy_shared.Layout(mine, keys)
        name = np.zeros(NAME_BYTES, np.uint8)
        box: Mailbox | None = None
        try:
            box = Mailbox.create(layout)
            name[:len(box.mine.path)] = np.frombuffer(box.mine.path.encode(), np.uint8)
        except OSError:
            box = None
        names = np.zeros(group.size * NAME_BYTES, np.uint8)
        group.all_gather_into_tensor(names, name)
        theirs = bytes(names.reshape(group.size, NAME_BYTES)[(group.rank + 1) % group.size]).rstrip(b"\0").decode()
        if box is not None and theirs:
            try:
                box.attach(theirs)
            except OSError:
                box.close()
                box = None
        ok = np.array([box is not None], np.int64)
        group.all_reduce(ok, ReduceOp.MIN)  # every neighbour mapped (so each name may go), or one could not
        if box is not None:
            box.mine.unlink()  # only the mappings hold it now: nothing is left in /dev/shm if a rank dies
            box.mine.close_fd()
            if box.theirs is not None:
                box.theirs.close_fd()
            if not ok[0]:
                box.close()
                box = None
        self.mailbox = box
        self._by_message = box is None


@dataclass
class Held:
    """The shards a survivor holds of one shard index: its own, or its copy of its neighbour's.

    Attributes:
        index: the shard index (the position in the shard group).
        steps: the optimizer step counts of these shards, per flat key.
        arrays: ``key`` / ``key:state`` -> the flat shard (NumPy, copied to the host).
        holder: the old global rank holding them; ``owner``: the old global rank whose shards they are.
    """

    index: int
    steps: dict[str, int]
    arrays: dict[str, np.ndarray]
    holder: int
    owner: int

    @property
    def count(self) -> int:
        return max(self.steps.values(), default=0)


@dataclass
class Contribution:
    """What one survivor brings to :func:`assemble`: its shard group (old global ranks) and what it holds."""

    group: tuple[int, ...]
    held: list[Held] = field(default_factory=list)

    def skeleton(self) -> Contribution:
        """The same without the arrays (what :func:`choose` reads): the recovery's first, small exchange."""
        return Contribution(self.group, [Held(h.index, h.steps, {}, h.holder, h.owner) for h in self.held])

    def arrays_of(self, chosen: Mapping[int, Held]) -> dict[int, dict[str, np.ndarray]]:
        """The arrays of the shards :func:`choose` took from this survivor, by shard index."""
        return {i: h.arrays for i, c in chosen.items() for h in self.held
                if h.index == i and h.holder == c.holder and h.count == c.count}


def contribution(model: Any, old_rank: int) -> Contribution:
    """What this survivor holds of ``model``'s sharded state (local: no communication): its own live
    shards, its own shards at the last renewals (where their step count differs from the live
    one's: the state a rollback needs), and its copies of the next index's shards.

    Args:
        model: a sharded strategy whose ``shards.buddy`` is a :class:`BuddyCopy`.
        old_rank: this rank's global rank before the failure.
    """
    group = model._shard_group()
    ranks = tuple(int(r) for r in group.ranks)
    index, n = ranks.index(old_rank), len(ranks)
    own = _arrays(model._layouts(), model._param_shards(), model.optimizer)
    held = [Held(index, {k: int(c) for k, c in model.optimizer.steps.items()},
                 {k: np.array(to_host(a)) for k, a in own.items()}, old_rank, old_rank)]
    buddy: BuddyCopy | None = model.shards.buddy
    if buddy is None or n == 1:
        return Contribution(ranks, held)
    counts = {held[0].count}
    for steps, arrays in buddy.own():  # newest first; a step count offered once
        h = Held(index, steps, arrays, old_rank, old_rank)
        if h.count not in counts:
            counts.add(h.count)
            held.append(h)
    nxt, counts = (index + 1) % n, set()
    for steps, arrays in buddy.held():
        h = Held(nxt, steps, arrays, old_rank, ranks[nxt])
        if h.count not in counts:
            counts.add(h.count)
            held.append(h)
    return Contribution(ranks, held)


def assemble(layouts: Sequence[FlatLayout], contributions: Sequence[Contribution], hyper: Mapping[str, Any],
             failed: Sequence[int]) -> tuple[dict[str, Any], int, dict[int, Held]]:
    """The full state dict from the survivors' contributions (local: every survivor computes the same).

    :func:`choose`, then :func:`join`: the newest optimizer step count ``T`` at which every shard
    index of ``layouts`` is held by some survivor (its own shards, live or at a renewal, or a copy),
    and those shards joined. (:func:`meshkit.parallel.survive.shrink` does the two apart, so that
    only the shards chosen travel.)

    Args:
        layouts: the strategy's flat layouts (of the old world: ``layouts[i].shards`` indices).
        contributions: every survivor's :func:`contribution`, in any order.
        hyper: the optimizer's hyperparameters (go into ``optim["hyper"]``).
        failed: the old global ranks that died (for the error's message).

    Returns:
        ``(state, T, chosen)``: the full state dict ``{"model", "optim"}``, the step count ``T``,
        and which :class:`Held` was taken for each shard index.

    Raises:
        ShardsLostError: no step at which every shard is held; naming the shard indices missing,
            the dead ranks whose shards they are and the dead ranks that held their copies.
    """
    step, chosen = choose(layouts[0].shards, contributions, failed)
    return join(layouts, chosen, hyper), step, chosen


def choose(n: int, contributions: Sequence[Contribution], failed: Sequence[int]) -> tuple[int, dict[int, Held]]:
    """The newest step count at which each of the ``n`` shard indices is held, and which :class:`Held`
    to take for each (its owner's own where it survived, else the lowest holder's); the arrays are
    not read, so :meth:`Contribution.skeleton` serves as well.

    Raises:
        ShardsLostError: no such step (see :func:`assemble`).
    """
    by_index: dict[int, list[Held]] = {i: [] for i in range(n)}
    for c in contributions:
        for h in c.held:
            by_index[h.index].append(h)
    counts = [{h.count for h in by_index[i]} for i in range(n)]
    common = set.intersection(*counts) if counts else set()
    if not common:
        newest = max((c for cs in counts for c in cs), default=0)
        missing = [i for i in range(n) if newest not in counts[i]]
        raise ShardsLostError(_lost_message(missing, contributions, failed, counts))
    step = max(common)
    return step, {i: min((h for h in by_index[i] if h.count == step), key=lambda h: (h.holder != h.owner, h.holder))
                  for i in range(n)}


def join(layouts: Sequence[FlatLayout], chosen: Mapping[int, Held], hyper: Mapping[str, Any]) -> dict[str, Any]:
    """The full state dict ``{"model", "optim"}`` from one :class:`Held` (with its arrays) per shard index."""
    n = layouts[0].shards
    params: dict[str, np.ndarray] = {}
    state: dict[str, dict[str, np.ndarray]] = {}
    steps: dict[str, int] = {}
    for lay in layouts:
        flat = np.concatenate([chosen[i].arrays[lay.key] for i in range(n)])
        params.update(lay.split(flat))
        names = sorted({k.split(":", 1)[1] for k in chosen[0].arrays if k.startswith(f"{lay.key}:")})
        for key in names:
            full = np.concatenate([chosen[i].arrays[f"{lay.key}:{key}"] for i in range(n)])
            for name, value in lay.split(full).items():
                state.setdefault(name, {})[key] = value
        if lay.key in chosen[0].steps:
            steps.update({name: chosen[0].steps[lay.key] for name in lay.names})
    return {"model": params, "optim": {"state": state, "step": steps, "hyper": dict(hyper)}}


def _lost_message(missing: list[int], contributions: Sequence[Contribution], failed: Sequence[int],
                  counts: list[set[int]]) -> str:
    groups = {c.group for c in contributions if c.group}  # (a spare that joined holds nothing: no group)
    parts = []
    for i in missing:
        owners = sorted({g[i] for g in groups})
        holders = sorted({g[(i - 1) % len(g)] for g in groups})
        held = f" (held at step counts {sorted(counts[i])} only)" if counts[i] else ""
        parts.append(f"shard {i} of ranks {owners}, whose copies were on ranks {holders}{held}")
    return (f"meshkit.parallel.buddy: the sharded state cannot be rebuilt in memory after the loss of ranks "
            f"{sorted(failed)}: no survivor holds {'; '.join(parts)} at the step the other shards are at (a rank and "
            "the rank keeping its buddy copy both lost, or a failure between an optimizer step and its copy): the "
            "job ends, or restarts under meshkit-run --max-restarts (docs/elastic.md \"Surviving failures\")")
