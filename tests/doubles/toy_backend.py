"""Third-party engines for the backend registry's tests, written against
meshkit.comm.engines.engine's declared interface only.

``Relay`` is a thin wrapper around one of meshkit's engines (the local one inside local.run, MPI's
in a process) that counts the calls reaching it; ``Solo`` is a world-of-one engine written from
scratch, with no meshkit engine under it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from meshkit.comm.engines.engine import EngineCapabilities


class Relay:
    """``inner``'s operations under another backend name; ``calls`` counts each one by name."""

    def __init__(self, inner: Any, backend: str, calls: Counter) -> None:
        self.inner, self.backend, self.calls = inner, backend, calls
        self.rank, self.size, self.max_tag = inner.rank, inner.size, inner.max_tag
        self.native_avg, self.capabilities, self.device = inner.native_avg, inner.capabilities, inner.device

    @property
    def watch(self) -> Any:
        return self.inner.watch

    @watch.setter
    def watch(self, fn: Any) -> None:  # set by the group; the inner engine calls it while it waits
        self.inner.watch = fn

    def __getattr__(self, name: str) -> Any:  # every other method of the protocol: the inner engine's
        method = getattr(self.inner, name)
        if not callable(method):
            return method

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return method(*args, **kwargs)
        return counted

    def split(self, color: int | None, ranks: tuple[int, ...], deadline: float) -> Relay | None:
        self.calls["split"] += 1
        engine = self.inner.split(color, ranks, deadline)
        return None if engine is None else Relay(engine, self.backend, self.calls)


class _Done:
    """A request that completed when it was made (a world of one waits for nobody)."""

    def __init__(self, source: int = 0, count: int = 0) -> None:
        self.source, self.count = source, count

    def Test(self) -> bool:  # noqa: N802 (the Request protocol's name)
        return True


class Solo:
    """A world of one: every collective's result is this rank's own contribution."""

    rank, size, max_tag, native_avg, device, watch = 0, 1, 2**20, True, None, None
    capabilities = EngineCapabilities()

    def __init__(self, backend: str = "solo") -> None:
        self.backend = backend
        self.calls: Counter = Counter()
        self.mail: dict[int, list[np.ndarray]] = {}

    def _done(self, name: str) -> _Done:
        self.calls[name] += 1
        return _Done()

    def all_reduce(self, buf: Any, op: Any) -> _Done:
        return self._done("all_reduce")

    def reduce(self, buf: Any, op: Any, root: int) -> _Done:
        return self._done("reduce")

    def broadcast(self, buf: Any, root: int) -> _Done:
        return self._done("broadcast")

    def all_gather(self, out: Any, inp: Any) -> _Done:
        out.reshape(-1)[...] = inp.reshape(-1)
        return self._done("all_gather")

    def reduce_scatter(self, out: Any, inp: Any, op: Any) -> _Done:
        out.reshape(-1)[...] = inp.reshape(-1)
        return self._done("reduce_scatter")

    def gather(self, out: Any | None, inp: Any, root: int) -> _Done:
        out.reshape(-1)[...] = inp.reshape(-1)
        return self._done("gather")

    def scatter(self, out: Any, inp: Any | None, root: int) -> _Done:
        out.reshape(-1)[...] = inp.reshape(-1)
        return self._done("scatter")

    def all_to_all(self, out: Any, recv_counts: list[int], inp: Any, send_counts: list[int]) -> _Done:
        out.reshape(-1)[...] = inp.reshape(-1)
        return self._done("all_to_all")

    def barrier(self) -> _Done:
        return self._done("barrier")

    def send(self, buf: Any, dst: int, tag: int) -> _Done:
        self.mail.setdefault(tag, []).append(buf.copy())
        return self._done("send")

    def recv(self, buf: Any, src: int | None, tag: int) -> _Done:
        data = self.mail[tag].pop(0)
        buf.reshape(-1)[:data.size] = data.reshape(-1)
        self.calls["recv"] += 1
        return _Done(0, data.size)

    def wait(self, request: Any, deadline: float) -> None:
        pass

    def exchange(self, payload: Any, seq: int, deadline: float, *, watched: bool = False) -> list[Any]:
        return [payload]

    def split(self, color: int | None, ranks: tuple[int, ...], deadline: float) -> Solo | None:
        return None if color is None else Solo(self.backend)

    def notify(self, ranks: list[int], notice: Any) -> None:
        pass

    def notices(self) -> list[Any]:
        return []

    def host_name(self) -> str:
        return "solo-host"

    def flush(self, timeout: float) -> None:
        pass

    def free(self) -> None:
        pass
