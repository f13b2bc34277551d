"""The world: the state one rank's job shares, and where it is kept.

Everything torch keeps as scattered globals lives in one :class:`World` object per rank: its
backend, rank, size, timeout, debug level, flight recorder, progress agent and the cache of
groups by rank set. Under MPI there is one world per process; inside
:func:`meshkit.comm.local.run` every thread (rank) has its own, held thread-locally.
This module holds the state only: :mod:`~meshkit.comm.lifecycle` creates and destroys it.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from .debug import DebugLevel, FlightRecorder
from .errors import DistError
from .progress import ProgressAgent

__all__ = ["World", "current_world", "is_initialized", "flight_record", "format_flight_record"]


@dataclasses.dataclass(eq=False)
class World:
    """One rank's view of the job: its default group and the groups it belongs to."""

    backend: str
    timeout: float
    debug: DebugLevel
    recorder: FlightRecorder
    progress: ProgressAgent
    rank: int = -1
    size: int = 0
    #: the default group (a ProcessGroup; typed loosely so that this module imports no group)
    default_group: Any = None
    #: groups by rank set (non-member handles too): the same ranks never get a second communicator
    groups: dict[frozenset[int], Any] = dataclasses.field(default_factory=dict)
    #: partitions already split, by the rank set of the group they were split over: every member
    #: of that group took part and recorded the same ones, so all agree to skip such a split again
    partitions: dict[frozenset[int], set[frozenset[frozenset[int]]]] = dataclasses.field(default_factory=dict)
    #: group-creating collective splits so far (tests and benchmarks count construction cost)
    split_count: int = 0
    #: notices from other ranks (see :mod:`~meshkit.comm.notices`), read while a wait stalls
    notices: list[Any] = dataclasses.field(default_factory=list)
    destroyed: bool = False


class _ThreadState(threading.local):
    """Per-thread rank context of the local engine. Class defaults make the common lookup (no
    local job: a real process) a plain attribute read; a missing attribute raising inside
    ``getattr(..., None)`` cost 0.6 us per collective call."""

    local: Any = None
    world: World | None = None


_thread_state = _ThreadState()
_process_world: World | None = None


def local_context() -> Any:
    """The in-process job this thread is a rank of (set by ``local.run``), or None."""
    return _thread_state.local


def set_local_context(context: Any) -> None:
    """Make this thread a rank of an in-process job (``context``), or a plain thread (None)."""
    _thread_state.local = context
    _thread_state.world = None


def current_world() -> World:
    """This rank's world; DistError if ``init_process_group`` was not called."""
    world = _process_world if _thread_state.local is None else _thread_state.world
    if world is None:
        raise DistError("meshkit.comm: the default process group is not initialized; "
                        "call meshkit.init_process_group() first")
    return world


def set_world(world: World | None) -> None:
    """Install (or, with None, remove) this rank's world."""
    global _process_world
    if _thread_state.local is not None:
        _thread_state.world = world
    else:
        _process_world = world


def is_initialized() -> bool:
    """True between ``init_process_group`` and ``destroy_process_group`` on this rank."""
    world = _process_world if _thread_state.local is None else _thread_state.world
    return world is not None


def flight_record() -> list[dict[str, Any]]:
    """This rank's last operations as dicts (seq, group, op, shapes, dtype, state, times, error)."""
    return current_world().recorder.entries()


def format_flight_record() -> str:
    """This rank's flight record as readable text (what is logged on a timeout or mismatch)."""
    world = current_world()
    return world.recorder.format(world.rank)
