"""Carrying on without the dead: the world rebuilt over the survivors, in memory, without a restart.

Under ``meshkit-run --survive K`` (MPI's fault tolerance, :mod:`meshkit.comm.engines.mpi_ulfm`) a
rank's death surfaces in every survivor's current call as a :class:`RankFailedError`. Then each
survivor calls :func:`shrink_world`, which

1. revokes every communicator of the old world (a survivor still waiting in any call wakes with
   the same error and comes here too);
2. builds the survivors' communicator (ULFM's Shrink: collective over the survivors, it agrees
   on who is dead) and a new world over it, numbered 0..n-1 in the old order;
3. drops the old world's groups without talking to anyone (their communicators are revoked, and
   freeing one would wait for the dead), unmapping their shared-memory segments (the path of
   comm/engines/shm.py), and gives the new world's groups segments of their own over the survivors.

Groups and meshes are built again afterwards, as at the start (``init_device_mesh``, the
strategy): :func:`meshkit.parallel.survive.shrink` does that for a training strategy, with its state.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..errors import DistBackendError
from ..groups.world import current_world, set_world
from .lifecycle import install_world, launched_ranks, survivors_engine

__all__ = ["Shrunk", "shrink_world"]

logger = logging.getLogger("meshkit")


@dataclass(frozen=True)
class Shrunk:
    """What :func:`shrink_world` did, the same on every survivor.

    Attributes:
        failed: the old world's ranks that are gone.
        old_rank, old_size: this rank and the world's size before.
        rank, size: this rank and the world's size now.
        new_ranks: each survivor's new rank, by its old rank.
        seconds: how long the shrink took on this rank (revoke, Shrink, the new world).
        agreed_ns: when the survivors' communicator existed on this rank (wall clock, ns): the revoke
            and ULFM's Shrink, whose agreement on the dead is most of it, done; the new world after.
        joined: the new world's ranks that spares of ``meshkit-run --spares N`` took (a dead rank's
            number each, while spares last); none without spares.
        launched: where spares joined, each new world rank's rank as launched (the launcher's numbering).
    """

    failed: tuple[int, ...]
    old_rank: int
    old_size: int
    rank: int
    size: int
    new_ranks: dict[int, int]
    seconds: float
    agreed_ns: int = 0
    joined: tuple[int, ...] = ()
    launched: tuple[int, ...] = ()


def shrink_world() -> Shrunk:
    """Rebuild the default world over the ranks still alive (collective over every survivor).

    Call it after a :class:`RankFailedError` under ``meshkit-run --survive K``; every group and
    mesh of the old world is unusable afterwards (build them again). See docs/elastic.md
    "Surviving failures".

    Raises:
        DistError: no world; the job was not started with ``meshkit-run --survive K``; or more
            than K ranks of the job failed.
        DistBackendError: the world's backend is not ``mpi`` (NCCL's path is on paper only).
    """
    started = time.perf_counter()
    world = current_world()
    if world.backend != "mpi":
        raise DistBackendError(f"meshkit.comm: rank {world.rank}: shrink_world needs the mpi backend under "
                               f"meshkit-run --survive, not {world.backend!r} (docs/elastic.md \"Surviving failures\")")
    old_rank, old_size = world.rank, world.size
    engine, new_ranks = survivors_engine(world)
    agreed_ns = time.time_ns()
    failed = tuple(o for o in range(old_size) if o not in new_ranks)
    for group in world.groups.values():  # dropped without a word: every peer is in this call too
        group.queue.thread.close()
    world.progress.close()
    world.destroyed = True
    set_world(None)
    install_world(world.backend, engine, world.timeout, first=False)
    joined = tuple(r for r in range(engine.size) if r not in set(new_ranks.values()))
    launched: tuple[int, ...] = ()
    if joined:
        launched = tuple(launched_ranks())
    shrunk = Shrunk(failed=failed, old_rank=old_rank, old_size=old_size, rank=engine.rank, size=engine.size,
                    new_ranks=new_ranks, seconds=time.perf_counter() - started, agreed_ns=agreed_ns, joined=joined,
                    launched=launched)
    if joined:
        logger.warning("meshkit: rank %d (was %d): the world lost rank(s) %s and spares took rank(s) %s: %d ranks, "
                       "in %.3f s", shrunk.rank, old_rank, list(failed), list(joined), shrunk.size, shrunk.seconds)
    else:
        logger.warning("meshkit: rank %d (was %d): the world shrank from %d to %d ranks without rank(s) %s in %.3f s",
                       shrunk.rank, old_rank, old_size, shrunk.size, list(failed), shrunk.seconds)
    return shrunk

