"""``set_debug_level``, ``get_debug_level``, ``set_debug_level_from_env``: the debug level at run time.

torch's functions of these names set a per-process level. meshkit's detail mode is not only a
local setting: before every collective a rank in detail mode exchanges the call's fingerprint
with the other members (:mod:`~meshkit.comm.debug`), so a rank in detail mode and a rank not in
it would wait in different exchanges. Hence the choice made here:

* Before ``init_process_group`` the level is this rank's (a thread's, inside
  :func:`meshkit.comm.local.run`): the next ``init_process_group`` uses it instead of
  ``MESHKIT_DEBUG``. ``init_process_group`` compares the ranks' levels and raises on every rank
  if they differ (comm/setup/lifecycle.py, through :func:`~meshkit.comm.agree.agree`).
* After it, :func:`set_debug_level` is **collective over the world**: every rank calls it at the
  same point of its program, with the same level. It waits for the run_async tasks of every group,
  then exchanges ``(level, calls issued on each group)`` over the world group, and every rank
  checks that the levels agree and that the members of each group have issued the same number
  of calls on it: the level then changes between the same two calls of every group on every rank,
  for the groups that exist already and those made later. A rank that calls it alone meets the
  others' next call: on the local engine every rank raises a mismatch naming both calls at once; on
  MPI the switch waits for the others and times out naming the ranks that never arrived.
"""

from __future__ import annotations

from typing import Any

from . import env, level_state
from .debug import DebugLevel
from .errors import CollectiveMismatchError, DistTypeError, DistValueError
from .groups.world import current_world, is_initialized, local_context
from .level_state import Switch

__all__ = ["set_debug_level", "get_debug_level", "set_debug_level_from_env", "requested_level"]


#: Old names of what lives in the leaf :mod:`.level_state` (the control channel and set-up read it).
_Switch = Switch


def _parse(level: Any, rank: int | None) -> DebugLevel:
    """``level`` as a DebugLevel: a member, or its name as a string in any case."""
    where = "" if rank is None else f"rank {rank}: "
    valid = f"{[m.name for m in DebugLevel]} (meshkit.DebugLevel members or their names, in any case)"
    if isinstance(level, DebugLevel):
        return level
    if isinstance(level, str):
        try:
            return DebugLevel[level.strip().upper()]
        except KeyError:
            raise DistValueError(f"meshkit.comm: {where}set_debug_level: level={level!r} is not a debug level; "
                                 f"valid levels are {valid}") from None
    raise DistTypeError(f"meshkit.comm: {where}set_debug_level: level must be a DebugLevel or its name, got "
                        f"{type(level).__name__} {level!r}; valid levels are {valid}")


def requested_level() -> DebugLevel:
    """The level ``init_process_group`` gives the world: set_debug_level's, else ``MESHKIT_DEBUG``."""
    return level_state.requested_level(local_context())


def _request(level: DebugLevel) -> None:
    level_state.request_level(local_context(), level)


def set_debug_level(level: DebugLevel | str) -> None:
    """Set the debug level: ``OFF``, ``INFO`` (log group creation) or ``DETAIL`` (check every call).

    Before ``init_process_group``: this rank's level for the next ``init_process_group``
    (instead of ``MESHKIT_DEBUG``). After it: **collective over the world**: every rank calls
    it at the same point of its program with the same level, and it applies from the next call
    of every group, those that exist already included (see the module docstring for why it is
    collective, unlike torch's).

    Args:
        level: a :class:`DebugLevel`, or its name as a string in any case (``"detail"``).

    Raises:
        DistValueError: an unknown level name; after ``init_process_group``: the ranks passed
            different levels, or the members of a group had issued different numbers of calls
            on it (set the level where every rank has issued the same calls), raised on every rank.
        DistTypeError: ``level`` is neither a DebugLevel nor a string.
        CollectiveMismatchError: a rank was in another call (it did not call set_debug_level).
        CollectiveTimeout: some ranks never called it within the world's timeout (named).

    Example (2 ranks, groups already made)::

        meshkit.set_debug_level("detail")      # on every rank
        meshkit.all_reduce(np.ones(3))          # rank 0
        meshkit.all_reduce(np.ones(4))          # rank 1: CollectiveMismatchError on both ranks
    """
    if not is_initialized():
        _request(_parse(level, None))
        return
    world = current_world()
    parsed = _parse(level, world.rank)
    group = world.default_group
    members = [g for g in list(world.groups.values()) if g.is_member and g.engine is not None]
    for g in members:  # calls made by queued run_async tasks are issued before the switch, on every rank
        g.queue.thread.drain(g.timeout)
    mine = Switch(parsed, tuple(sorted((g.ranks, g.queue.seq) for g in members)))
    switches = group.queue.blocking("set_debug_level",
                                    lambda seq, deadline: group.engine.exchange(mine, seq, deadline, watched=True),
                                    group.timeout)
    _check_switches(world.rank, switches)
    world.debug = parsed


def _check_switches(me: int, switches: list[Any]) -> None:
    """Every rank's level must be the same, and every group's members must have issued the same
    calls; each rank runs this on the same list, so all raise or none does."""
    other = [r for r, s in enumerate(switches) if not isinstance(s, Switch)]
    if other:
        raise CollectiveMismatchError(
            f"meshkit.comm: rank {me}: set_debug_level is collective over the world, but ranks {other} were in "
            "another exchange (a monitored barrier or a detail-mode check of another call); call it on every "
            "rank at the same point of the program")
    levels = {s.level for s in switches}
    if len(levels) > 1:
        listing = "; ".join(f"rank {r}: {s.level.name}" for r, s in enumerate(switches))
        raise DistValueError(f"meshkit.comm: rank {me}: set_debug_level: the ranks passed different levels "
                             f"({listing}); pass the same level on every rank")
    issued: dict[tuple[int, ...], dict[int, int]] = {}
    for rank, switch in enumerate(switches):
        for ranks, count in switch.counts:
            issued.setdefault(ranks, {})[rank] = count
    for ranks, by_rank in sorted(issued.items()):
        if len(set(by_rank.values())) > 1:
            listing = ", ".join(f"rank {r}: {n}" for r, n in sorted(by_rank.items()))
            raise DistValueError(
                f"meshkit.comm: rank {me}: set_debug_level: the members of group {list(ranks)} had issued different "
                f"numbers of calls on it ({listing}); call set_debug_level where every rank has issued the same "
                "calls on every group (wait for asynchronous collectives first), so that the level changes "
                "between the same two calls everywhere")


def get_debug_level() -> DebugLevel:
    """This rank's debug level: the world's after ``init_process_group``, else the level the next
    one will use (set_debug_level's, else ``MESHKIT_DEBUG``)."""
    if is_initialized():
        return current_world().debug
    return requested_level()


def set_debug_level_from_env() -> None:
    """``set_debug_level`` with ``MESHKIT_DEBUG`` (``TORCH_DISTRIBUTED_DEBUG``'s analogue): OFF where
    it is not set; collective after ``init_process_group``, as :func:`set_debug_level` is.

    Raises:
        DistValueError: ``MESHKIT_DEBUG`` is not a level name (the message names the variable).
    """
    set_debug_level(env.debug_level())

