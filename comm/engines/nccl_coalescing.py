"""``batch_isend_irecv`` on NCCL: the sends and receives of a batch as one NCCL group.

``start_coalescing`` opens an NCCL group (``groupStart``) on each engine of the batch, nested when
the batch spans several groups; NCCL merges them into the outermost and enqueues their operations
only at the outermost ``groupEnd`` (its group depth is per thread: src/group.cc). So a request
issued inside a batch has no done event yet (the engine keeps it in ``coalesced``), and the
events, one per engine, are recorded at the outermost end, for every engine of the batch: an event
recorded at an inner end would cover nothing.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Protocol

from .nccl_requests import DeviceRequest

__all__ = ["start", "end", "Coalescing"]


class _Guard(Protocol):
    def calling(self) -> contextlib.AbstractContextManager[None]: ...


class Coalescing(Protocol):
    """What a batch asks of each engine in it (an ``NCCLEngine``)."""

    rt: Any  # the CUDA runtime (comm/engines/cuda_runtime.py)
    device: int
    guard: _Guard  # comm/engines/nccl_abort.py's CommGuard
    coalesced: list[DeviceRequest] | None  # the requests issued inside the open batch, else None

    def complete_batch(self, requests: list[DeviceRequest]) -> None:
        """Record one done event for ``requests`` after the batch was enqueued."""
        ...


class _Batch(threading.local):
    """This thread's open ``batch_isend_irecv`` groups: their depth, and the engines (with the
    requests each issued) whose done events wait for the outermost end."""

    def __init__(self) -> None:
        self.depth = 0
        self.ended: list[tuple[Coalescing, list[DeviceRequest]]] = []


_batch = _Batch()


def start(engine: Coalescing) -> None:
    """Open an NCCL group on ``engine``: the sends and receives issued until :func:`end` are
    matched together (``batch_isend_irecv``), so their order cannot deadlock. A batch over
    several groups opens one per engine, nested: NCCL merges them into the outermost one."""
    engine.rt.use_device(engine.device)
    with engine.guard.calling():
        engine.rt.nccl.groupStart()
    engine.coalesced = []
    _batch.depth += 1


def end(engine: Coalescing) -> None:
    """Close ``engine``'s group. At the outermost end (NCCL enqueues the batch there) every engine
    of the batch records its done event (``complete_batch``)."""
    requests, engine.coalesced = engine.coalesced or [], None
    ended = _batch.ended
    ended.append((engine, requests))
    _batch.depth -= 1
    with engine.guard.calling():  # the outermost end makes the group's connections (and may block)
        engine.rt.nccl.groupEnd()
    if _batch.depth:
        return
    _batch.ended = []
    for member, issued in ended:
        if issued:
            member.complete_batch(issued)
