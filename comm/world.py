"""The world: the default process group and the state one rank's job shares.

Everything torch keeps as scattered globals lives in one :class:`World` object per rank: its
backend, rank, size, timeout, debug level, flight recorder and the cache of groups by rank set.
Under MPI there is one world per process; inside :func:`meshkit.comm.local.run` every thread
(rank) has its own, held thread-locally.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import threading
from typing import Any, Sequence

from .debug import DebugLevel, FlightRecorder, debug_level_from_env
from .errors import DistBackendError, DistError, DistTypeError, DistValueError
from .group import ProcessGroup

__all__ = [
    "World",
    "current_world",
    "init_process_group",
    "destroy_process_group",
    "is_initialized",
    "new_group",
    "create_groups",
    "resolve_group",
    "get_rank",
    "get_world_size",
    "get_backend",
    "get_group_rank",
    "get_global_rank",
    "get_process_group_ranks",
    "DEFAULT_TIMEOUT",
    "BACKENDS",
]

logger = logging.getLogger("meshkit")

#: Seconds a blocking call waits by default (torch's default for non-NCCL groups is 30 min;
#: meshkit prefers a hang reported in 5 min). Overridden by ``MESHKIT_TIMEOUT`` or ``timeout=``.
DEFAULT_TIMEOUT = 300.0

BACKENDS = ("auto", "mpi", "local", "nccl")


@dataclasses.dataclass(eq=False)
class World:
    """One rank's view of the job: its default group and the groups it belongs to."""

    backend: str
    timeout: float
    debug: DebugLevel
    recorder: FlightRecorder
    rank: int = -1
    size: int = 0
    default_group: ProcessGroup | None = None
    #: groups by rank set (non-member handles too): the same ranks never get a second communicator
    groups: dict[frozenset[int], ProcessGroup] = dataclasses.field(default_factory=dict)
    #: partitions already split, by the rank set of the group they were split over: every member
    #: of that group took part and recorded the same ones, so all agree to skip such a split again
    partitions: dict[frozenset[int], set[frozenset[frozenset[int]]]] = dataclasses.field(default_factory=dict)
    #: group-creating collective splits so far (tests and benchmarks count construction cost)
    split_count: int = 0
    destroyed: bool = False


class _ThreadState(threading.local):
    """Per-thread rank context of the local engine. Class defaults make the common lookup (no
    local job: a real process) a plain attribute read; a missing attribute raising inside
    ``getattr(..., None)`` cost 0.6 us per collective call."""

    local: Any = None
    world: World | None = None


_thread_state = _ThreadState()
_process_world: World | None = None


def _local_context() -> Any:
    """The in-process job this thread is a rank of (set by ``local.run``), or None."""
    return _thread_state.local


def current_world() -> World:
    """This rank's world; DistError if ``init_process_group`` was not called."""
    world = _process_world if _thread_state.local is None else _thread_state.world
    if world is None:
        raise DistError("meshkit.comm: the default process group is not initialized; "
                        "call meshkit.init_process_group() first")
    return world


def _set_world(world: World | None) -> None:
    global _process_world
    if _local_context() is not None:
        _thread_state.world = world
    else:
        _process_world = world


def is_initialized() -> bool:
    """True between ``init_process_group`` and ``destroy_process_group`` on this rank."""
    try:
        current_world()
    except DistError:
        return False
    return True


def _resolve_timeout(timeout: float | datetime.timedelta | None) -> float:
    if timeout is None:
        raw = os.environ.get("MESHKIT_TIMEOUT")
        if raw is None:
            return DEFAULT_TIMEOUT
        try:
            timeout = float(raw)
        except ValueError:
            raise DistValueError(f"meshkit.comm: MESHKIT_TIMEOUT={raw!r} is not a number of seconds") from None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise DistTypeError(f"meshkit.comm: timeout must be seconds (float) or a timedelta, got {timeout!r}")
    if not timeout > 0:
        raise DistValueError(f"meshkit.comm: timeout must be positive, got {timeout}")
    return float(timeout)


def _resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise DistValueError(f"meshkit.comm: unknown backend {backend!r}; valid backends are {list(BACKENDS)}")
    if backend != "auto":
        return backend
    if _local_context() is not None:
        return "local"
    return "mpi"


def _create_world_group(world: World) -> ProcessGroup:
    if world.backend == "local":
        from .local import create_world_group
        ctx = _local_context()
        if ctx is None:
            raise DistBackendError("meshkit.comm: backend 'local' runs inside meshkit.comm.local.run(fn, "
                                   "world_size); use 'mpi' (or 'auto') in a normal process")
        return create_world_group(world, ctx)
    if world.backend == "mpi":
        from .mpi import create_world_group as create_mpi
        return create_mpi(world)
    raise DistBackendError("meshkit.comm: the 'nccl' backend is not available in this build; "
                           "use 'mpi' or 'auto'")


def init_process_group(backend: str = "auto", *,
                       timeout: float | datetime.timedelta | None = None) -> None:
    """Create the default process group (the world) on this rank.

    Args:
        backend: ``"mpi"`` (mpi4py; under ``meshkit-run``/``mpiexec`` or, with plain ``python``,
            a world of one), ``"local"`` (inside :func:`meshkit.comm.local.run`), or
            ``"auto"``: ``local`` inside ``local.run``, else ``mpi``.
        timeout: seconds (or a timedelta) every blocking call of every group waits at most;
            default ``MESHKIT_TIMEOUT`` or 300 s.

    Raises:
        DistError: already initialized on this rank.
        DistValueError: unknown backend or a bad timeout.
    """
    if is_initialized():
        world = current_world()
        raise DistError(f"meshkit.comm: rank {world.rank}: init_process_group was already called "
                        f"(backend {world.backend!r}); call destroy_process_group() first")
    world = World(backend=_resolve_backend(backend), timeout=_resolve_timeout(timeout),
                  debug=debug_level_from_env(), recorder=FlightRecorder())
    group = _create_world_group(world)
    world.rank, world.size, world.default_group = group.ranks[group.rank], group.size, group
    world.groups[frozenset(group.ranks)] = group
    _set_world(world)
    if world.debug >= DebugLevel.INFO:
        logger.info("meshkit: rank %d/%d initialized backend %s, timeout %.0f s, debug %s",
                    world.rank, world.size, world.backend, world.timeout, world.debug.name)


def destroy_process_group() -> None:
    """Tear down every group of this rank and the world; ``init_process_group`` may follow."""
    world = current_world()
    for group in world.groups.values():
        group._shutdown()
    world.groups.clear()
    world.destroyed = True
    _set_world(None)


def resolve_group(group: ProcessGroup | None) -> ProcessGroup:
    """``group``, or the default group when None."""
    if group is None:
        world = current_world()
        assert world.default_group is not None
        return world.default_group
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
    created = parent.split(color, ranks=mine or (), name=name)
    world.partitions.setdefault(over, set()).add(key)
    if created is not None:
        if timeout is not None:
            created.timeout = float(timeout)
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
    limit = None if timeout is None else _resolve_timeout(timeout)
    assert world.default_group is not None
    group = create_groups(world.default_group, [members], name=label, timeout=limit)
    if group is None:  # a non-member handle, cached like a group so that it is the same object
        group = world.groups.get(frozenset(members))
        if group is None:
            group = ProcessGroup(world=world, ranks=members, group_rank=-1, name=label, timeout=world.timeout)
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
