"""Recovery in one call: a data-parallel strategy rebuilt on the survivors of a rank failure.

Under ``meshkit-run --survive K`` a rank's death raises :class:`~meshkit.comm.RankFailedError` in
every survivor's current call (docs/elastic.md "Surviving failures"). The loop then calls
:func:`shrink` and redoes the step it returns, whose data depends on the step alone, so the
result still equals uninterrupted single-process training::

    model, step = survive.start(build)   # build(), 0; a spare (meshkit-run --spares) that joined: the state
    while step < steps:
        try:
            train_step(model, step)          # zero_grad, forward, backward, model.step()
            step += 1
        except RankFailedError:
            model, step = survive.shrink(model, build)   # build(): the strategy over the new world

Under ``meshkit-run --spares N`` an idle spare takes each lost rank's place (its number and mesh
coordinates; comm/engines/mpi_spares.py): the world keeps its size, and the spare's
:func:`start` takes part in the survivors' exchange below, bringing nothing, and loads the state.

What :func:`shrink` does, in order (each phase timed in :class:`Recovery`):

1. **agreement and shrink**: :func:`meshkit.comm.shrink_world` (ULFM's Revoke and Shrink): the
   world over the survivors, numbered 0..n-1;
2. **state**, replicated (DDP: parameters and optimizer state whole on every rank): the survivors
   agree on the most advanced copy (the highest optimizer step count: a rank may have finished the
   step whose all-reduce failed elsewhere) and broadcast it from there;
   sharded (ZeRO-1/2, FSDP, HSDP, built under ``--survive``): every survivor says what it holds,
   its own shards (live, and at the last buddy renewals) and its buddy copies of the next shard
   (:mod:`meshkit.parallel.buddy`), in one small all-gather of step counts; each picks the same
   shards at the newest step where every shard is held, and a second all-gather moves each chosen
   shard once, from the survivor that holds it, so each survivor joins the full state: the last renewal when a lost rank's shards are held
   only there, so the loop replays the steps since (at most the cadence less one, :mod:`~meshkit.parallel.buddy`; a clear
   :class:`~meshkit.parallel.buddy.ShardsLostError` where a rank and its buddy both died);
   then the new strategy (``build()``, collective over the new world: a new mesh and groups)
   loads it with ``load_full_state_dict``, whatever its world size and mesh.

A rank lost during these phases (after the shrink) raises ``RankFailedError`` in them: every
survivor shrinks the world again and starts the exchange over with what it brought; one recovery,
reported once with every rank lost in it.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..comm import (DistValueError, RankFailedError, Shrunk, all_gather, all_gather_object, broadcast_object_list,
                    get_rank, get_world_size, shrink_world)
from ..comm._seams import joined_spare, launched_ranks, recoveries, spare_joined, spare_joining, survived
from . import buddy
from .data_parallelism import DistributedDataParallel
from .data_parallelism.sharded import Shards

__all__ = ["start", "shrink", "Recovery", "last_recovery"]

logger = logging.getLogger("meshkit")


@dataclass(frozen=True)
class Recovery:
    """One recovery on this rank, by phase (seconds), and what it agreed on.

    Attributes:
        shrink: :func:`~meshkit.comm.shrink_world` (revoke, ULFM's Shrink and its agreement, the new world).
        state: the agreement on the source, its broadcast, the new strategy and its load.
        step: the step the loop redoes (the optimizer step count of the state rebuilt: under buddy
            copies renewed every K steps, the last renewal's, so the steps since are replayed).
        source: the new rank whose state every survivor took.
        world: what the shrink did (the dead ranks, the old and new ranks).
    """

    shrink: float
    state: float
    step: int
    source: int
    world: Shrunk


_last: list[Recovery] = []


def last_recovery() -> Recovery | None:
    """This rank's latest :class:`Recovery` (None before any)."""
    return _last[-1] if _last else None


def _steps_done(state: dict[str, Any]) -> int:
    counts = state["optim"]["step"]
    return max((int(c) for c in counts.values()), default=0)


_SHARDED, _REPLICATED = "sharded", "replicated"


def _first_survivor(joined: tuple[int, ...]) -> int:
    """The lowest new rank that is no spare that just joined: it tells the spares what follows."""
    return next(r for r in range(get_world_size()) if r not in joined)


def _source(everyone: list[Any], steps_done: int) -> int:
    """The source of the losses: the lowest survivor whose own live shards are at ``steps_done`` or past
    it (every survivor's are: a survivor's own index is held at no step past its own, so the step
    rolled back to, a renewal's, is at most every survivor's; each took every step before it). A
    spare that joined holds nothing."""
    return next((r for r, c in enumerate(everyone) if c.held and c.held[0].count >= steps_done), 0)


def _replicated(mine: dict[str, Any] | None) -> tuple[dict[str, Any], int, int]:
    """Replicated state (DDP's: whole on every rank): the most advanced copy (the highest optimizer
    step count: a rank may have finished the step whose all-reduce failed elsewhere; the lowest rank
    among equals), broadcast from there. ``mine``: this rank's, None on a spare that joined (it
    holds nothing). Returns the state, its step count and its rank."""
    counts = [np.zeros(1, np.int64) for _ in range(get_world_size())]
    all_gather(counts, np.array([0 if mine is None else _steps_done(mine)], np.int64))
    steps = [int(c[0]) for c in counts]
    source = steps.index(max(steps))
    box: list[Any] = [mine if get_rank() == source else None]
    broadcast_object_list(box, src=source)
    return box[0], max(steps), source


def _exchange(mine: Any, layouts: Any, hyper: Any, shrunk: Shrunk) -> tuple[dict[str, Any], int, int]:
    """The survivors' side of a recovery's state exchange over the new world (a spare that joined takes
    the other side, :func:`_join`): the state, its step count and the rank it came from. ``layouts``
    None: replicated state (``mine`` a full state dict), else ``mine`` a buddy contribution."""
    first = _first_survivor(shrunk.joined)
    if shrunk.joined:  # spares took dead ranks' places: they learn which exchange follows (survive.start), the
        # recoveries counted so far and each rank as launched (for meshkit-run's report and a replay's check)
        broadcast_object_list([_REPLICATED if layouts is None else _SHARDED, recoveries(), list(shrunk.launched)],
                              src=first)
    if layouts is None:
        return _replicated(mine)
    # what every survivor holds (step counts only), to every survivor (by new rank); then the shards chosen
    everyone: list[Any] = [None] * get_world_size()
    all_gather_object(everyone, mine.skeleton())
    steps_done, chosen = buddy.choose(layouts[0].shards, everyone, shrunk.failed)
    pieces: list[Any] = [None] * get_world_size()
    all_gather_object(pieces, mine.arrays_of(chosen))  # each shard once, from the survivor chosen to give it
    for given in pieces:
        for index, arrays in given.items():
            chosen[index].arrays = arrays
    state = buddy.join(layouts, chosen, hyper)
    if shrunk.joined:  # a spare has no layouts to join the pieces with: the state joined, to it
        broadcast_object_list([state, steps_done], src=first)
    return state, steps_done, _source(everyone, steps_done)


def _rebuilt(build: Callable[[], Any], state: dict[str, Any]) -> Any:
    """``build()`` (collective over the new world) loaded with ``state``; a sharded strategy's buddy
    copies made at once, whatever the step count, so that a failure in the step redone is survived too."""
    rebuilt = build()
    rebuilt.load_full_state_dict(state)
    if isinstance(getattr(rebuilt, "shards", None), Shards):
        rebuilt.shards.after_step(force=True)
    return rebuilt


def start(build: Callable[[], Any]) -> tuple[Any, int]:
    """The strategy to train and the step to begin at, right after ``init_process_group``: ``(build(), 0)``;
    on a spare of ``meshkit-run --spares N`` that took a failed rank's place, the strategy ``build()``
    makes loaded with the survivors' state, and the step they redo (collective with their
    :func:`shrink`). The documented loop (docs/elastic.md "Spares") calls it instead of ``build()``;
    the script makes no collective call between ``init_process_group`` and this one.
    """
    taken = joined_spare()
    if taken is None:
        return build(), 0
    return _join(build, taken)


def _join(build: Callable[[], Any], taken: Any) -> tuple[Any, int]:
    """A spare's side of the survivors' :func:`shrink`, from the exchange on: it holds nothing, and takes the
    state (again over a world shrunk once more where another rank dies meanwhile, as they do)."""
    started = time.perf_counter()
    spare_joining()  # the world group, held until this call (init_process_group), usable
    empty = taken.joined  # the ranks that hold nothing: the spares that joined in this recovery, still alive
    while True:
        try:
            first = _first_survivor(empty)
            told: list[Any] = [None, None, None]
            broadcast_object_list(told, src=first)
            kind, counted, launched = told
            spare_joined(survived_before=counted, launched=launched)  # (told again after a retry: the same count)
            if kind == _SHARDED:
                everyone: list[Any] = [None] * get_world_size()
                all_gather_object(everyone, buddy.Contribution(()))
                pieces: list[Any] = [None] * get_world_size()
                all_gather_object(pieces, {})
                got: list[Any] = [None, None]
                broadcast_object_list(got, src=first)
                state, steps_done = got
                source = _source(everyone, steps_done)
            else:
                state, steps_done, source = _replicated(None)
            rebuilt = _rebuilt(build, state)
            break
        except RankFailedError as exc:  # another rank lost during the recovery: shrink again, with the survivors
            _again(exc)
            again = shrink_world()
            empty = _still_empty(empty, again)
    world = Shrunk(failed=taken.failed, old_rank=-1, old_size=taken.old_size, rank=get_rank(), size=get_world_size(),
                   new_ranks={}, seconds=0.0, joined=empty)
    recovery = Recovery(shrink=0.0, state=time.perf_counter() - started, step=steps_done, source=source, world=world)
    _last.append(recovery)
    logger.warning("meshkit: rank %d (a spare): %s loaded with the survivors' state in %.3f s; starting at step %d "
                   "(the state of rank %d)", get_rank(), type(rebuilt).__name__, recovery.state, steps_done, source)
    return rebuilt, steps_done


def _again(exc: BaseException) -> None:
    logger.warning("meshkit: rank %d: a rank was lost during the recovery (%s); shrinking the world again", get_rank(),
                   exc)


def _still_empty(empty: tuple[int, ...], again: Shrunk) -> tuple[int, ...]:
    """The ranks that hold nothing after a further shrink within one recovery: the spares that had joined
    and survived it (renumbered) and those that joined in it."""
    return tuple(sorted({again.new_ranks[r] for r in empty if r in again.new_ranks} | set(again.joined)))


def _composed(first: Shrunk, again: Shrunk) -> Shrunk:
    """One recovery's shrinks as one (a rank lost during the recovery made the survivors shrink again):
    the ranks lost numbered in the world before the first (a spare that joined and was lost within the
    recovery was in neither world, so it is in neither ``failed`` nor ``joined``), the new ranks of
    that world's survivors, the spares that joined and are still alive."""
    before = {mid: old for old, mid in first.new_ranks.items()}  # a survivor's rank after the first -> before it
    failed = tuple(sorted(set(first.failed) | {before[r] for r in again.failed if r in before}))
    new_ranks = {old: again.new_ranks[mid] for old, mid in first.new_ranks.items() if mid in again.new_ranks}
    joined = _still_empty(first.joined, again)
    return Shrunk(failed=failed, old_rank=first.old_rank, old_size=first.old_size, rank=again.rank, size=again.size,
                  new_ranks=new_ranks, seconds=first.seconds + again.seconds, agreed_ns=again.agreed_ns, joined=joined,
                  launched=tuple(launched_ranks()) if joined else ())


def shrink(model: Any, build: Callable[[], Any]) -> tuple[Any, int]:
    """Rebuild ``model`` (a data-parallel strategy) on the survivors; return it and the step to redo.

    Collective over every survivor, each of which caught the same failure. ``build()`` makes the
    strategy over the new world (its mesh and groups), as at the start of the script.

    Raises:
        DistValueError: ``model`` is no data-parallel strategy, has no optimizer, or holds sharded
            state without buddy copies (built outside ``meshkit-run --survive``).
        ShardsLostError: a shard is held by no survivor (a rank and its buddy both lost).
        DistError, DistBackendError: see :func:`~meshkit.comm.shrink_world`.
    """
    sharded = isinstance(getattr(model, "shards", None), Shards)
    if getattr(model, "optimizer", None) is None or not (isinstance(model, DistributedDataParallel) or sharded):
        raise DistValueError(f"meshkit.parallel.survive: rank {get_rank()}: shrink rebuilds a data-parallel strategy "
                             f"with an optimizer (DDP, ZeRO, FSDP, HSDP), not {type(model).__name__}")
    if sharded and model.shards.buddy is None:
        raise DistValueError(f"meshkit.parallel.survive: rank {get_rank()}: {type(model).__name__} holds sharded "
                             "state and no buddy copies of it: build the strategy under meshkit-run --survive K "
                             "(MESHKIT_SURVIVE set), which keeps a copy of the next rank's shards "
                             "(docs/elastic.md \"Surviving failures\")")
    caught = sys.exc_info()[1]  # the loop's RankFailedError, when called in its except clause
    detected_ns = getattr(caught, "raised_ns", None) or time.time_ns()
    started = time.perf_counter()
    old_rank = get_rank()
    mine = buddy.contribution(model, old_rank) if sharded else model.full_state_dict()  # local: no communication
    layouts = model._layouts() if sharded else None
    shrunk = shrink_world()
    while True:
        shrunk_at, shrunk_ns = time.perf_counter(), time.time_ns()
        try:
            state, steps_done, source = _exchange(mine, layouts, model.optimizer.hyper, shrunk)
            rebuilt = _rebuilt(build, state)
            break
        except RankFailedError as exc:
            # another rank lost during the recovery (a failure of --survive's K like any other): the survivors
            # of both shrink again and start the exchange over; one recovery, timed from the first failure
            _again(exc)
            shrunk = _composed(shrunk, shrink_world())
    recovery = Recovery(shrink=shrunk_at - started, state=time.perf_counter() - shrunk_at, step=steps_done,
                        source=source, world=shrunk)
    _last.append(recovery)
    survived(failed=shrunk.failed, old_size=shrunk.old_size, detected_ns=detected_ns,
             agreed_ns=shrunk.agreed_ns or shrunk_ns, shrunk_ns=shrunk_ns, rebuilt_ns=time.time_ns(),
             step=recovery.step, launched_after=list(shrunk.launched) if shrunk.joined else None,
             joined=shrunk.joined)  # meshkit-run's report of the failure, by phase
    logger.warning("meshkit: rank %d: %s rebuilt on %d ranks in %.3f s = shrink %.3f + state %.3f; redoing step %d "
                   "(the state of rank %d)", get_rank(), type(model).__name__, get_world_size(),
                   recovery.shrink + recovery.state, recovery.shrink, recovery.state, recovery.step, source)
    return rebuilt, recovery.step
