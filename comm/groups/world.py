"""The world: the state one rank's job shares, and where it is kept.

Everything torch keeps as scattered globals lives in one :class:`World` object per rank: its
backend, rank, size, timeout, debug level, flight recorder, progress agent and the cache of
groups by rank set. Under MPI there is one world per process; inside
:func:`meshkit.comm.local.run` every thread (rank) has its own, held thread-locally.
This module holds the state (:mod:`~meshkit.comm.setup.lifecycle` creates and destroys it) and the
flight record's readers: as a dict (:func:`flight_document`, which ``meshkit.debug`` gathers;
:func:`inflight_document`, the calls not finished, which its debug server answers), and as a
file in ``MESHKIT_TRACE_DIR`` after a failed collective (:func:`dump_flight_record`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import threading
import time
from typing import Any

from .. import env
from ..debug import DebugLevel, FlightRecorder
from ..errors import CollectiveMismatchError, CollectiveTimeout, DistError, RankFailedError
from .progress import ProgressAgent

__all__ = ["World", "current_world", "is_initialized", "flight_record", "format_flight_record", "flight_document",
           "inflight_document", "dump_flight_record", "RECORD_FORMAT"]

logger = logging.getLogger("meshkit")

#: The ``format`` field of a flight-record file (``MESHKIT_TRACE_DIR``, ``meshkit.debug``).
RECORD_FORMAT = "meshkit-flight-record/1"


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
    ``getattr(..., None)`` would build an exception on every collective call."""

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


def flight_document(world: World, reason: str = "") -> dict[str, Any]:
    """This rank's flight record with what a reader of several ranks' records needs: the rank,
    the world size, its groups (name, global ranks, calls issued) and each entry's group ranks.
    Times are wall-clock seconds (``time.time()``), comparable across ranks as far as the hosts'
    clocks agree."""
    groups, entries = _entries(world)
    return {"format": RECORD_FORMAT, "rank": world.rank, "world_size": world.size, "backend": world.backend,
            "time": time.time(), "reason": reason,
            "groups": [{"name": g.name, "ranks": list(g.ranks), "issued": g.queue.seq} for g in groups],
            "entries": entries}


def _entries(world: World) -> tuple[list[Any], list[dict[str, Any]]]:
    """The groups this rank is a member of, and its flight record's entries as dicts with lists for
    shapes and each entry's group ranks (JSON-ready)."""
    groups = [g for g in list(world.groups.values()) if g.is_member]
    ranks_of = {g.name: list(g.ranks) for g in groups}
    entries = []
    for entry in world.recorder.entries():
        entry["shapes"] = [list(shape) for shape in entry["shapes"]]
        entry["ranks"] = ranks_of.get(entry["group"])
        entries.append(entry)
    return groups, entries


#: Flight-recorder states of a call not finished yet (see :data:`~meshkit.comm.debug.RECORD_FIELDS`).
_UNFINISHED = ("scheduled", "started")


def inflight_document(world: World) -> dict[str, Any]:
    """What this rank waits for now: its calls not finished (flight-recorder entries scheduled or
    started, each with its group's ranks and the seconds since it began) and, for each of its
    groups, the calls issued, the asynchronous collectives still in the group's queue (``posted``:
    in the engine; not: waiting behind an earlier one) and the ident of its communication thread.

    Read by ``meshkit.debug``'s server from its own thread while this rank may be blocked in a
    call: it takes no lock (copies of deques and dicts are atomic under the GIL), so what it
    shows is a snapshot that may be a few microseconds old."""
    now = time.time()
    groups, entries = _entries(world)
    calls = []
    for entry in entries:
        if entry["state"] in _UNFINISHED:
            began = entry["t_start"] or entry["t_scheduled"]
            entry["seconds"] = None if began is None else round(now - began, 6)
            calls.append(entry)
    listed = []
    for g in groups:
        queue = g.queue
        queued = [{"seq": w.seq, "op": w.op, "posted": not w.unstarted()}
                  for w in list(queue.inflight) if not w.finished]
        listed.append({"name": g.name, "ranks": list(g.ranks), "issued": queue.seq, "queued": queued,
                       "comm_thread": queue.thread.ident})
    return {"rank": world.rank, "world_size": world.size, "backend": world.backend, "time": now,
            "collectives": calls, "groups": listed}


#: The failures after which a rank writes its record to ``MESHKIT_TRACE_DIR``.
_DUMPED = (CollectiveTimeout, CollectiveMismatchError, RankFailedError)


def dump_flight_record(world: World, error: BaseException) -> str | None:
    """After a collective failed with ``error``: write this rank's flight record to
    ``MESHKIT_TRACE_DIR/rank<N>.json`` (replacing an earlier one: a later record holds more)
    where that variable is set; the path, or None. Never raises: the caller's error matters more.

    The record is written to a new file of a random name, created exclusively with mode 0600 (a
    name another user planted, a symbolic link to a file of this user's, is never written
    through: another name is drawn), then renamed over ``rank<N>.json`` (which replaces whatever
    is there, a planted link included, without following it): a reader never sees half a file.
    """
    if not isinstance(error, _DUMPED):
        return None
    try:
        folder = env.trace_dir()
        if folder is None:
            return None
        path = os.path.join(folder, f"rank{world.rank}.json")
        data = json.dumps(flight_document(world, f"{type(error).__name__}: {error}"), default=str).encode()
        for _ in range(_TRIES):
            partial = _partial_name(path)
            try:
                fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                break
            except FileExistsError:  # taken: planted, or (at 2**-64) drawn twice
                continue
        else:
            raise FileExistsError(f"{_TRIES} names beside {path} were taken")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.replace(partial, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise
        logger.error("meshkit: rank %d wrote its flight record to %s", world.rank, path)
        return path
    except Exception:  # noqa: BLE001
        logger.warning("meshkit: rank %d could not write its flight record to MESHKIT_TRACE_DIR", world.rank,
                       exc_info=True)
        return None


#: names drawn for a record's temporary file before giving up (each taken one was planted)
_TRIES = 4


def _partial_name(path: str) -> str:
    """A temporary name beside ``path`` that no one can guess (64 random bits)."""
    return f"{path}.{secrets.token_hex(8)}.tmp"
