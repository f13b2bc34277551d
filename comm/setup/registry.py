"""The world's groups: creating them, finding them, and translating ranks.

Groups are cached by rank set in the :class:`~meshkit.comm.groups.world.World`, so the same ranks never
get a second communicator, whichever way they are asked for (``new_group``, a mesh dimension).
"""

from __future__ import annotations

import datetime
import logging
from typing import Sequence

from ..debug import DebugLevel
from ..errors import DistTypeError, DistValueError
from ..groups.group import ProcessGroup
from ..timeouts import resolve_timeout
from ..groups.world import current_world

__all__ = ["resolve_group", "create_groups", "new_group", "get_rank", "get_world_size", "get_backend",
           "get_group_rank", "get_global_rank", "get_process_group_ranks"]

logger = logging.getLogger("meshkit")


def resolve_group(group: ProcessGroup | None) -> ProcessGroup:
    """``group``, or the default group when None."""
    if group is None:
        return current_world().default_group
    if not isinstance(group, ProcessGroup):
        raise DistTypeError(f"meshkit.comm: group must be a ProcessGroup or None, got {type(group).__name__}")
    return group


def create_groups(parent: ProcessGroup, partition: Sequence[Sequence[int]], *, name: str,
                  timeout: float | None = None) -> ProcessGroup | None:
    """Create the groups of a partition of (part of) ``parent``'s ranks with one collective split.

    Collective over ``parent``. Every rank passes the same partition (lists of global ranks);
    a rank gets the group it is in, or None if it is in none. A rank set that already has a
    group is reused: its members take part in the split without joining a new communicator.
    No split happens for a partition of one part, ``parent``'s own ranks (``parent`` is the
    group), nor for a partition already split over a group holding all of ``parent``'s ranks:
    every member of ``parent`` took part in that split and recorded it, so all agree to skip it.
    """
    world = parent.world
    me = world.rank
    key = frozenset(frozenset(int(r) for r in part) for part in partition)
    over = frozenset(parent.ranks)
    if key == {over}:
        return parent
    if any(over <= ranks and key in known for ranks, known in world.partitions.items()):
        mine_set = next((p for p in key if me in p), None)
        return None if mine_set is None else world.groups[mine_set]
    mine: tuple[int, ...] | None = None
    color = None
    for index, part in enumerate(partition):
        if me in part:
            mine = tuple(sorted(int(r) for r in part))
            color = index
            break
    existing = world.groups.get(frozenset(mine)) if mine is not None else None
    if existing is not None:
        color = None
    created = parent.split(color, ranks=mine or (), name=name, partition=partition)
    world.partitions.setdefault(over, set()).add(key)
    if created is not None:
        if timeout is not None:  # the group's, and its queue's (which waits for its calls)
            created.timeout = created.queue.timeout = float(timeout)
        world.groups[frozenset(created.ranks)] = created
        if world.debug >= DebugLevel.INFO:
            logger.info("meshkit: rank %d created group %s ranks %s", me, name, list(created.ranks))
    return existing if existing is not None else created


def new_group(ranks: Sequence[int] | None = None, *, timeout: float | datetime.timedelta | None = None,
              name: str | None = None) -> ProcessGroup:
    """Create a group of the given global ranks; collective over the whole world.

    As in torch, every rank of the world calls it with the same ``ranks``. Groups are cached by
    rank set, so asking again for the same ranks returns the existing group. A rank outside
    ``ranks`` gets a handle on which every collective raises a clear error.

    Example (world of 4)::

        g = new_group([0, 2])   # rank 0: group rank 0; rank 2: group rank 1
                                # ranks 1 and 3: a non-member handle (get_rank(g) == -1)
    """
    world = current_world()
    if ranks is None:
        members = list(range(world.size))
    else:
        try:
            members = [int(r) for r in ranks]
        except (TypeError, ValueError):
            raise DistTypeError(f"meshkit.comm: rank {world.rank}: new_group: ranks must be a list of ints, "
                                f"got {ranks!r}") from None
    bad = [r for r in members if not 0 <= r < world.size]
    if bad:
        raise DistValueError(f"meshkit.comm: rank {world.rank}: new_group: ranks {bad} are out of range "
                             f"for a world of size {world.size} (valid: 0..{world.size - 1})")
    dups = sorted({r for r in members if members.count(r) > 1})
    if dups:
        raise DistValueError(f"meshkit.comm: rank {world.rank}: new_group: ranks {dups} appear more than once")
    if not members:
        raise DistValueError(f"meshkit.comm: rank {world.rank}: new_group: ranks must not be empty")
    members.sort()
    label = name or f"group{members}"
    limit = None if timeout is None else resolve_timeout(timeout)
    group = create_groups(world.default_group, [members], name=label, timeout=limit)
    if group is None:  # a non-member handle, cached like a group so that it is the same object
        group = world.groups.get(frozenset(members))
        if group is None:
            group = ProcessGroup(None, world=world, ranks=members, group_rank=-1, name=label,
                                 timeout=world.timeout)
            world.groups[frozenset(members)] = group
    return group


def get_rank(group: ProcessGroup | None = None) -> int:
    """This rank's rank in ``group`` (default: the world); -1 if it is not a member."""
    return resolve_group(group).rank


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (default: the world)."""
    return resolve_group(group).size


def get_backend(group: ProcessGroup | None = None) -> str:
    """The engine of ``group``: ``"mpi"``, ``"local"`` or ``"nccl"``."""
    return resolve_group(group).backend if group is not None else current_world().backend


def get_group_rank(group: ProcessGroup, global_rank: int) -> int:
    """Translate a global rank to its rank in ``group``."""
    return resolve_group(group).group_rank_of(global_rank)


def get_global_rank(group: ProcessGroup, group_rank: int) -> int:
    """Translate a rank in ``group`` to its global rank."""
    return resolve_group(group).global_rank_of(group_rank)


def get_process_group_ranks(group: ProcessGroup | None) -> list[int]:
    """The global ranks of ``group``, in group-rank order."""
    return list(resolve_group(group).ranks)
