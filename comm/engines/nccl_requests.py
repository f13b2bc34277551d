"""The NCCL engine's requests: device work on the communication stream, and AVG of host arrays.

A :class:`DeviceRequest` is one operation the NCCL engine issued on its communication stream,
complete once its *done* event fired; the engine's capabilities name it as the request type
the progress agent watches until done (``EngineCapabilities.watched_requests``). A
:class:`HostAverage` is ``ReduceOp.AVG`` of host arrays over the host engine, which sums: the
buffer is divided once when the sum completes. Both carry a receive's fields
(:class:`~meshkit.comm.engines.engine.Received`).
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["DeviceRequest", "HostAverage"]


class Issuer(Protocol):
    """What a device request asks of the engine that issued it (an ``NCCLEngine``)."""

    def event_done(self, event: Any, op: str) -> bool:
        """Whether ``event`` fired (a CUDA error raised, named)."""
        ...

    def check_error(self, op: str) -> None:
        """Raise if NCCL reported an asynchronous error, or the communicator was aborted."""
        ...


class DeviceRequest:
    """A collective on the communication stream: complete once its done event fired.

    ``keep`` holds the arrays it reads and writes until then. Receives carry ``source`` and
    ``count`` (NCCL receives exactly the count posted), as the Request protocol asks.
    """

    __slots__ = ("engine", "op", "event", "keep", "source", "count", "dtype", "done")

    def __init__(self, engine: Issuer, op: str, event: Any, keep: tuple) -> None:
        self.engine, self.op, self.event, self.keep = engine, op, event, keep
        self.source, self.count, self.dtype, self.done = -1, -1, None, False

    def Test(self) -> bool:  # noqa: N802 (the Request protocol's name)
        if not self.done:
            # A fired done event is success, whatever happens to the communicator afterwards (a
            # watchdog looking after destroy_process_group must not read the destroyed handle).
            if self.event is not None and self.engine.event_done(self.event, self.op):
                self.done, self.keep = True, ()
            else:
                self.engine.check_error(self.op)
        return self.done


class HostAverage:
    """ReduceOp.AVG of host arrays: the host engine sums, then ``buf`` is divided once (the
    group does not divide on an engine whose AVG is native)."""

    __slots__ = ("inner", "buf", "size", "done", "source", "count", "dtype")

    def __init__(self, inner: Any, buf: Any, size: int) -> None:
        self.inner, self.buf, self.size, self.done = inner, buf, size, False
        self.source, self.count, self.dtype = -1, -1, None

    def Test(self) -> bool:  # noqa: N802 (the Request protocol's name)
        if not self.done and self.inner.Test():
            if self.buf is not None:
                self.buf /= self.size
            self.done = True
        return self.done
