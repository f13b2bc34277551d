"""Recovery in one call: a data-parallel strategy rebuilt on the survivors of a rank failure.

Under ``meshkit-run --survive K`` a rank's death raises :class:`~meshkit.comm.RankFailedError` in
every survivor's current call (docs/elastic.md "Surviving failures"). The loop then calls
:func:`shrink` and redoes the step it returns, whose data depends on the step alone, so the
result still equals uninterrupted single-process training::

    step = 0
    while step < steps:
        try:
            train_step(model, step)          # zero_grad, forward, backward, model.step()
            step += 1
        except RankFailedError:
            model, step = survive.shrink(model, build)   # build(): the strategy over the new world

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
from ..comm._seams import survived
from . import buddy
from .data_parallelism import DistributedDataParallel
from .data_parallelism.sharded import Shards

__all__ = ["shrink", "Recovery", "last_recovery"]

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
        # the source of the losses: the lowest survivor whose own live shards are at that step or past it
        # (every survivor's are: a survivor's own index is held at no step past its own, so the step
        # rolled back to, a renewal's, is at most every survivor's; each took every step before it)
        source = next((r for r, c in enumerate(everyone) if c.held[0].count >= steps_done), 0)
        box: list[Any] = [state]
        steps = [steps_done]
    else:
        counts = [np.zeros(1, np.int64) for _ in range(get_world_size())]
        all_gather(counts, np.array([_steps_done(mine)], np.int64))
        steps = [int(c[0]) for c in counts]
        source = steps.index(max(steps))  # the most advanced survivor (the lowest rank among equals)
        box = [mine if get_rank() == source else None]
        broadcast_object_list(box, src=source)
    rebuilt = build()
    rebuilt.load_full_state_dict(box[0])
    if isinstance(getattr(rebuilt, "shards", None), Shards):
        rebuilt.shards.after_step(force=True)  # the new buddy copies at once, whatever the step count: a failure in the step redone is survived too
    recovery = Recovery(shrink=shrunk_at - started, state=time.perf_counter() - shrunk_at, step=max(steps),
                        source=source, world=shrunk)
    _last.append(recovery)
    survived(failed=shrunk.failed, old_size=shrunk.old_size, detected_ns=detected_ns,
             agreed_ns=shrunk.agreed_ns or shrunk_ns, shrunk_ns=shrunk_ns, rebuilt_ns=time.time_ns(),
             step=recovery.step)  # meshkit-run's report of the failure, by phase
    logger.warning("meshkit: rank %d: %s rebuilt on %d ranks in %.3f s = shrink %.3f + state %.3f; redoing step %d "
                   "(the state of rank %d)", get_rank(), type(model).__name__, get_world_size(),
                   recovery.shrink + recovery.state, recovery.shrink, recovery.state, recovery.step, source)
    return rebuilt, recovery.step
