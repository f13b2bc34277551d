"""Spares: processes of a ``meshkit-run --survive K --spares N`` job that wait, started and imported,
and take a failed rank's place, so that the world keeps its size (and a mesh its shape).

The launcher starts N processes more than ``-n``; the last N of MPI_COMM_WORLD are the spares. At
``init_process_group`` (:func:`starting_world`) the others split off as the world; a spare stays
inside ``init_process_group``, idle: a wildcard receive on the communicator of every process left,
polled every :data:`POLL_S`. Under ULFM that receive
fails as soon as any process of the job dies, and a survivor's revoke (its recovery has begun)
reaches it even before its own MPI knows who died.

A recovery (:func:`recover`, collective over every process left: the world's survivors in
``shrink_world`` and every idle spare) shrinks that communicator (ULFM's Shrink: the agreement on
who is dead) and gives each dead rank's place, in rank order, to the next idle spare; where spares
run out the world shrinks as without them. Ranks keep their numbers where a spare fills every
hole, so a mesh keeps its coordinates. A promoted spare returns from ``init_process_group`` as that
rank, in the world the survivors rebuilt, and its script's :func:`meshkit.parallel.survive.start`
takes the survivors' state and step (their ``survive.shrink``). The others keep waiting.

When only spares die, nothing of the world changes: the other spares acknowledge the failure
(ULFM's ``Ack_failed``) and wait on. At the end, world rank 0 tells every idle spare to exit
(:func:`release`, from ``destroy_process_group`` or the interpreter's exit), and the spare's script
ends there with status 0.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from ...launch_protocol import SPARES_ENV
from ..errors import DistError
from . import mpi_ulfm

__all__ = ["count", "enabled", "starting_world", "recover", "old_ranks", "launched_ranks", "release", "Joined", "joined", "TAG", "POLL_S"]

logger = logging.getLogger("meshkit")

#: The tag of the spares' messages (a release), apart from meshkit's others; below 32767.
TAG = 25206
#: Seconds between two polls of an idle spare's receive: 200 wakeups a second. An idle spare took 1.5% of a
#: core here, against 2.8% at 1 ms (the job's processes' CPU time over 6 s, /proc/PID/stat, less the same job's
#: without a spare); a recovery waits up to this for a spare to notice it.
POLL_S = 0.005
_RELEASE = 1

#: Every process of the job still alive (the world's ranks and the idle spares): MPI_COMM_WORLD,
#: then each recovery's shrunk one.
_all: MPI.Intracomm = MPI.COMM_WORLD
#: The rank in ``_all`` of each world rank, in world order; and of each idle spare, in order.
_positions: list[int] = []
_idle: list[int] = []
#: After a recovery, on the world's members: each new world rank's old one (None where a spare joined).
_old_of: list[int | None] = []


@dataclass(frozen=True)
class Joined:
    """On a spare that took a failed rank's place: the world rank it took and that recovery's facts.

    Attributes:
        rank: the world rank this process is now.
        failed: the world ranks (old numbering) that died in that recovery.
        old_size, size: the world's size before and after.
        joined: every world rank a spare took in that recovery (this one's among them).
    """

    rank: int
    failed: tuple[int, ...]
    old_size: int
    size: int
    joined: tuple[int, ...]


_joined: Joined | None = None  # (a spare joins once: afterwards it is a rank of the world)


def count() -> int:
    """N of ``meshkit-run --spares N`` (``MESHKIT_SPARES``); 0 without it."""
    text = os.environ.get(SPARES_ENV, "").strip()
    return int(text) if text.isdigit() else 0


def enabled() -> bool:
    """Whether this job has spares: ``--spares N`` with ``--survive K``."""
    return count() > 0 and mpi_ulfm.enabled()


def joined() -> Joined | None:
    """What this process took, where it is a spare that joined the world (None elsewhere)."""
    return _joined


def starting_world() -> MPI.Intracomm:
    """The world's communicator at ``init_process_group`` (collective over every process of the job).

    Without spares, MPI_COMM_WORLD. With N, its first ``size - N`` processes; a spare waits here
    until it takes a failed rank's place (that world's communicator is returned) or the job ends
    (``SystemExit(0)``: its script ends here).

    Raises:
        DistError: N leaves no process to train (every rank raises it alike).
    """
    global _positions, _idle
    n = count()
    if not enabled():
        return MPI.COMM_WORLD
    if _positions:  # a world again after destroy_process_group: the same one (the spares left, or still wait)
        return mpi_ulfm.world_comm()
    size, me = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    if n >= size:
        raise DistError(f"meshkit.comm: rank {me}: --spares {n} leaves none of the job's {size} processes to train")
    active = size - n
    _positions, _idle = list(range(active)), list(range(active, size))
    world = MPI.COMM_WORLD.Split(0 if me < active else 1, me)
    if me < active:
        mpi_ulfm.set_world_comm(world, lost=0)
        return world
    world.Free()  # the idle spares' own communicator: nothing goes over it
    return _wait()


def _wait() -> MPI.Intracomm:
    """An idle spare: wait for a release (exit) or a failure (join the recovery); the world's
    communicator once this process took a rank's place."""
    buf = np.zeros(1, np.int64)
    while True:
        request = _all.Irecv(buf, MPI.ANY_SOURCE, TAG)
        try:
            while not request.Test():
                time.sleep(POLL_S)
        except MPI.Exception:
            mpi_ulfm.keep([request])  # cut off by the failure: never freed (see mpi_ulfm.keep)
            dead = _dead()
            if dead and set(dead) <= set(_idle) and not _revoked():  # only spares died: the world is whole
                _all.Ack_failed()  # the next wildcard receive no longer fails for them
                _idle[:] = [s for s in _idle if s not in dead]
                continue
            world = recover()
            if world is not None:
                return world
            continue
        if int(buf[0]) == _RELEASE:
            logger.debug("meshkit: spare %d released: the job ended without needing it", MPI.COMM_WORLD.Get_rank())
            raise SystemExit(0)


def _dead() -> tuple[int, ...]:
    """The ranks of ``_all`` this process knows dead."""
    return mpi_ulfm.failed_ranks(_all, _all)


def _revoked() -> bool:
    try:
        return bool(_all.Is_revoked())
    except MPI.Exception:
        return False


def recover() -> MPI.Intracomm | None:
    """Collective over every process left (the world's survivors, in ``shrink_world``, and every
    idle spare): revoke and shrink the communicator of them all, give each dead world rank's place
    to the next idle spare (in rank order; the world shrinks where none is left), and return the
    new world's communicator (None on a spare still idle). The world's ranks keep their order.

    Raises:
        DistError: more processes of the job died than ``--survive K`` allows (on every process).
    """
    global _all, _positions, _idle, _old_of, _joined
    old_world_size = len(_positions)
    mpi_ulfm.revoke(_all)
    survivors = _all.Shrink()
    before, after = _all.Get_group(), survivors.Get_group()
    try:
        alive = before.Translate_ranks(None, after)
    finally:
        before.Free()
        after.Free()
    dead = {a for a, n in enumerate(alive) if n < 0}
    lost = mpi_ulfm.lost() + len(dead)
    if lost > mpi_ulfm.budget():  # the launcher ends the job too
        raise DistError(f"meshkit.comm: rank {MPI.COMM_WORLD.Get_rank()}: {lost} processes of the job failed, more "
                        f"than meshkit-run --survive {mpi_ulfm.budget()}: the job ends (or restarts, under --max-restarts)")
    idle = [s for s in _idle if s not in dead]
    failed = tuple(w for w, a in enumerate(_positions) if a in dead)
    places: list[int] = []
    taken: list[int] = []
    old_of: list[int | None] = []
    for w, a in enumerate(_positions):
        if a not in dead:
            places.append(a)
            old_of.append(w)
        elif idle:
            taken.append(len(places))
            places.append(idle.pop(0))
            old_of.append(None)
    me = _all.Get_rank()
    member = me in places
    world = survivors.Split(0 if member else 1, places.index(me) if member else idle.index(me))
    was_idle = me in _idle
    _all, _positions, _idle = survivors, [alive[a] for a in places], [alive[a] for a in idle]
    if not member:
        world.Free()
        mpi_ulfm.add_lost(len(dead))  # the budget, counted alike on every process
        return None
    mpi_ulfm.set_world_comm(world, lost=len(dead))
    _old_of = old_of
    if was_idle:
        _joined = Joined(rank=world.Get_rank(), failed=failed, old_size=old_world_size, size=world.Get_size(),
                         joined=tuple(taken))
        logger.warning("meshkit: spare %d took rank %d, lost with rank(s) %s", MPI.COMM_WORLD.Get_rank(),
                       world.Get_rank(), list(failed))
    return world


def old_ranks() -> list[int | None]:
    """On a world member after :func:`recover`: each world rank's number before it (None: a spare joined there)."""
    return list(_old_of)


def launched_ranks() -> list[int]:
    """Each world rank's rank in MPI_COMM_WORLD (as launched: the launcher's numbering, a spare's among them)."""
    world, launched = mpi_ulfm.world_comm().Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return [int(r) for r in world.Translate_ranks(None, launched)]
    finally:
        world.Free()
        launched.Free()


def release() -> None:
    """World rank 0, at the end of the job: tell every idle spare to exit (a message each; a spare
    that died meanwhile is skipped)."""
    if not enabled() or not _idle or mpi_ulfm.world_comm().Get_rank() != 0:
        return
    for spare in _idle:
        try:
            _all.Send(np.array([_RELEASE], np.int64), spare, TAG)
        except MPI.Exception:
            pass
    _idle.clear()
