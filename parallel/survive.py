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
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..comm import (DistValueError, Shrunk, all_gather, all_gather_object, broadcast_object_list, get_rank,
                    get_world_size, shrink_world)
from ..comm._seams import joined_spare, recoveries, spare_joined, spare_joining, survived
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
    """A spare's side of the survivors' :func:`shrink`, from the exchange on: it holds nothing, and takes the state."""
    started = time.perf_counter()
    spare_joining()  # the world group, held until this call (init_process_group), usable
    first = _first_survivor(taken.joined)
    told: list[Any] = [None, None, None]
    broadcast_object_list(told, src=first)
    kind, counted, launched = told
    spare_joined(survived_before=counted, launched=launched)
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
    world = Shrunk(failed=taken.failed, old_rank=-1, old_size=taken.old_size, rank=taken.rank, size=taken.size,
                   new_ranks={}, seconds=0.0, joined=taken.joined)
    recovery = Recovery(shrink=0.0, state=time.perf_counter() - started, step=steps_done, source=source, world=world)
    _last.append(recovery)
    logger.warning("meshkit: rank %d (a spare): %s loaded with the survivors' state in %.3f s; starting at step %d "
                   "(the state of rank %d)", get_rank(), type(rebuilt).__name__, recovery.state, steps_done, source)
    return rebuilt, steps_done


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
    shrunk = shrink_world()
    shrunk_at, shrunk_ns = time.perf_counter(), time.time_ns()
    first = _first_survivor(shrunk.joined)
    if shrunk.joined:  # spares took dead ranks' places: they learn which exchange follows (survive.start), the
        # recoveries counted so far and each rank as launched (for meshkit-run's report and a replay's check)
        broadcast_object_list([_SHARDED if sharded else _REPLICATED, recoveries(), list(shrunk.launched)], src=first)
    if sharded:  # what every survivor holds (step counts only), to every survivor (by new rank); then the shards chosen
        everyone: list[Any] = [None] * get_world_size()
        all_gather_object(everyone, mine.skeleton())
        layouts = model._layouts()
        steps_done, chosen = buddy.choose(layouts[0].shards, everyone, shrunk.failed)
        pieces: list[Any] = [None] * get_world_size()
        all_gather_object(pieces, mine.arrays_of(chosen))  # each shard once, from the survivor chosen to give it
        for given in pieces:
            for index, arrays in given.items():
                chosen[index].arrays = arrays
        state = buddy.join(layouts, chosen, model.optimizer.hyper)
        if shrunk.joined:  # a spare has no layouts to join the pieces with: the state joined, to it
            broadcast_object_list([state, steps_done], src=first)
        source = _source(everyone, steps_done)
    else:
        state, steps_done, source = _replicated(mine)
    rebuilt = _rebuilt(build, state)
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
