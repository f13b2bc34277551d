"""MPI's fault tolerance (ULFM): a dead rank becomes a :class:`RankFailedError`, and the survivors shrink.

Under ``meshkit-run --survive K`` the ranks run on Open MPI's wheel with User-Level Failure
Mitigation (``mpiexec --with-ft ulfm``; docs/elastic.md "Surviving failures" says why this engine).
There a communication call that involves a dead rank returns an error instead of hanging:
``MPI_ERR_PROC_FAILED`` where the call needed the dead rank, ``MPI_ERR_REVOKED`` once a
survivor revoked the communicator, and, measured with Open MPI 5.0.11, ``MPI_ERR_OTHER`` from a
nonblocking collective whose schedule met the failure (``NBC_Progress: an error 75 was found``).
So any MPI error on a communicator whose failed group is not empty is a rank failure.

What this module does with it, and nothing else:

- :func:`rank_failed` turns the MPI error into one :class:`RankFailedError` naming the dead
  global ranks, after *revoking* the communicator: every survivor still waiting in any call on
  it (a peer that was not talking to the dead rank, a p2p between two survivors) fails at once
  instead of waiting for the timeout (ULFM's Revoke, the one call that reaches them all);
- :func:`shrink` builds the survivors' communicator (ULFM's Shrink, collective over the survivors);
- :func:`revoke_watch` lets the shared-memory path (comm/engines/shm.py), whose waits MPI never
  sees, notice that a survivor revoked the group's communicator.

It imports ``mpi4py.MPI``, as every module of the MPI engine does; the launcher's
``MESHKIT_SURVIVE`` says whether the job asked for survival (:func:`enabled`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

from mpi4py import MPI

from ...launch_protocol import SURVIVE_ENV
from .. import env
from ..errors import RankFailedError

__all__ = ["budget", "lost", "add_lost", "keep", "enabled", "supported", "failed_ranks", "revoke", "rank_failed", "shrink",
           "revoke_watch", "world_comm", "set_world_comm"]

logger = logging.getLogger("meshkit")

#: The communicator whose ranks are meshkit's global ranks: MPI_COMM_WORLD until the first
#: shrink, then the survivors' (each shrink replaces it).
_world: MPI.Intracomm = MPI.COMM_WORLD
#: Ranks the job lost so far (every shrink adds its dead): at most ``--survive K``.
_lost = 0


def world_comm() -> MPI.Intracomm:
    """The communicator meshkit's global ranks number (MPI_COMM_WORLD, or the survivors' after a shrink)."""
    return _world


def set_world_comm(comm: MPI.Intracomm, *, lost: int) -> None:
    """Make ``comm`` (the survivors' communicator) the one global ranks number; ``lost`` ranks died."""
    global _world
    _world = comm
    add_lost(lost)


def add_lost(n: int) -> None:
    """Count ``n`` more processes of the job lost (what ``--survive K`` bounds)."""
    global _lost
    _lost += n


def lost() -> int:
    """Ranks the job lost so far (survived by earlier shrinks)."""
    return _lost


def budget() -> int:
    """K of ``meshkit-run --survive K`` (``MESHKIT_SURVIVE``): the rank failures the job survives; 0 without it."""
    text = os.environ.get(SURVIVE_ENV, "").strip()
    return int(text) if text.isdigit() else 0


#: Requests of operations that met a dead peer: kept, never freed. Open MPI ends the process when
#: an error arrives for a request already freed ("An error occurred in Send error after request
#: freed", measured: a 1 MiB send to a rank that died, its request freed by the garbage collector),
#: and a send to the dead never completes. A few per failure.
_kept: list[MPI.Request] = []


def keep(requests: list[MPI.Request]) -> None:
    """Keep ``requests`` (to the dead, or cut off by a revoke) alive for the rest of the process."""
    _kept.extend(requests)


def enabled() -> bool:
    """Whether this job survives rank failures: ``meshkit-run --survive K`` set ``MESHKIT_SURVIVE`` to K > 0."""
    return budget() > 0


def supported() -> bool:
    """Whether the MPI library in use has ULFM's calls (Open MPI 5 built with FT support; not MPICH's wheel)."""
    try:
        return "Open MPI" in MPI.Get_library_version() and hasattr(MPI.Comm, "Revoke")
    except MPI.Exception:  # pragma: no cover - Get_library_version does not fail in practice
        return False


def failed_ranks(comm: MPI.Comm, numbered_in: MPI.Comm | None = None) -> tuple[int, ...]:
    """The ranks of ``comm``'s members this rank knows dead, numbered as in ``numbered_in`` (default
    :func:`world_comm`: the global ranks)."""
    try:
        group = comm.Get_failed()
    except (MPI.Exception, NotImplementedError, AttributeError):
        return ()
    try:
        size = group.Get_size()
        if not size:
            return ()
        ranks = group.Translate_ranks(list(range(size)), (numbered_in or _world).Get_group())
        return tuple(sorted(r for r in ranks if r != MPI.UNDEFINED))
    finally:
        group.Free()


def revoke(comm: MPI.Comm) -> None:
    """Revoke ``comm`` (best effort): every pending and later call on it fails on every survivor."""
    try:
        if comm != MPI.COMM_NULL and not comm.Is_revoked():
            comm.Revoke()
    except (MPI.Exception, NotImplementedError, AttributeError):
        logger.debug("meshkit: could not revoke a communicator", exc_info=True)


def _is_revoked(comm: MPI.Comm) -> bool:
    """Whether a survivor revoked ``comm``: a nonblocking collective cut off by the revoke fails with
    ``MPI_ERR_OTHER``, not ``MPI_ERR_REVOKED`` (measured with Open MPI 5.0.11: hybrid sharding's
    replicate all-reduce between two survivors, after a rank of another shard group died)."""
    try:
        return comm != MPI.COMM_NULL and bool(comm.Is_revoked())
    except (MPI.Exception, NotImplementedError, AttributeError):
        return False


#: Seconds a rank woken by a survivor's revoke waits to learn who died (its own MPI hears of the
#: death a moment after the survivor that revoked: a dead peer's closed socket, read by MPI's progress).
#: Measured: a survivor whose shared-memory wait found the dead rank first (comm/engines/shm.py)
#: revoked before the others' MPI knew; they learnt it within milliseconds. Past this the error
#: names no rank (a survivor that never talked to the dead may never learn it before the shrink).
#: ``MESHKIT_SURVIVE_LEARN_S`` changes it.
LEARN_S = 0.25
LEARN_ENV = env.SURVIVE_LEARN_S


def _learn_dead() -> tuple[int, ...]:
    """The world's dead as this rank's MPI knows them, waiting up to :data:`LEARN_S` (``MESHKIT_SURVIVE_LEARN_S``,
    at most 60 s) for one to be known."""
    deadline = time.monotonic() + env.positive_number(LEARN_ENV, LEARN_S, upper=60.0)
    while True:
        dead = failed_ranks(_world)
        if dead or time.monotonic() >= deadline:
            return dead
        try:
            _world.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)  # MPI's progress: a closed socket is read
        except MPI.Exception:
            pass
        time.sleep(0.001)


def rank_failed(exc: MPI.Exception, comm: MPI.Comm, what: str) -> RankFailedError | None:
    """The :class:`RankFailedError` that MPI error ``exc`` on ``comm`` stands for, or None if it
    is not a rank failure (or the job does not survive failures). ``comm`` is revoked first, so
    that every survivor waiting on it fails too."""
    if not enabled():
        return None
    dead = failed_ranks(comm)
    revoked = exc.Get_error_class() == getattr(MPI, "ERR_REVOKED", -1) or _is_revoked(comm)
    if not dead and not revoked:
        # an error of another communicator met while waiting on this one (the world's mailbox, read
        # while a shared-memory wait stalls: its wildcard receive fails once any rank died)
        dead = failed_ranks(_world)
        if not dead:
            return None
    if not dead:  # woken by a survivor's revoke: who died is known job-wide (the world's failed group), soon
        dead = _learn_dead()
    revoke(comm)
    me = _world.Get_rank()
    who = (f"rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} failed" if dead
           else "a survivor revoked the communicator after a rank failed")
    return RankFailedError(f"meshkit.comm: rank {me}: {what} cannot complete: {who} "
                           f"({exc.Get_error_string().strip()}); recover with meshkit.comm.shrink_world() "
                           "or the strategy's survive.shrink (docs/elastic.md \"Surviving failures\")",
                           failed_ranks=dead)


def shrink(comm: MPI.Comm) -> MPI.Intracomm:
    """The survivors' communicator (collective over every survivor of ``comm``, which is revoked first)."""
    revoke(comm)
    return comm.Shrink()


def revoke_watch(comm: MPI.Comm, what: str) -> Callable[[], None]:
    """A check for the shared-memory path's waits on ``comm``'s ranks (its ``Channel.abandoned``):
    it lets MPI progress (a nonblocking probe, which processes a revoke that arrived) and raises
    the :class:`RankFailedError` of :func:`rank_failed` where a survivor revoked ``comm`` (its
    recovery began: ``shrink_world`` revokes every communicator of the old world). Called only while
    a wait misses a flag, every few tens of milliseconds: nothing when nothing fails."""

    def check() -> None:
        try:
            comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
            if not comm.Is_revoked():
                return
            raise MPI.Exception(getattr(MPI, "ERR_REVOKED", MPI.ERR_OTHER))
        except MPI.Exception as exc:  # under --survive any MPI error here stands for a failure
            error = rank_failed(exc, comm, what) or RankFailedError(
                f"meshkit.comm: rank {_world.Get_rank()}: {what} cannot complete: {exc.Get_error_string().strip()}",
                failed_ranks=failed_ranks(_world))
            raise error from None

    return check
