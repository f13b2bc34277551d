"""What the shared-memory engines (comm/engines/shm.py, shm_hierarchy.py) leave to the group's MPI
engine: every call they do not take over, passed on unchanged.

:class:`OverHost` holds the group's MPI engine as ``host`` (composition: the engines are never
subclasses of it) and forwards the :class:`~meshkit.comm.engines.engine.Engine` protocol to it; the
engines above override the collectives they run themselves, ``path``/``paths``, ``wait``, ``split``
and ``free``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ..reduce_op import ReduceOp

__all__ = ["OverHost"]


class OverHost:
    """An engine over a group's MPI engine ``host``, reporting which path each call takes."""

    backend = "mpi"
    native_avg = False
    device = None

    def __init__(self, host: Any, **capabilities: bool) -> None:
        self.host = host
        # survives as the host: under --survive the calls passed to MPI meet its fault tolerance
        # (rank_failure below); the path's own waits raise RankFailedError themselves
        self.capabilities = dataclasses.replace(host.capabilities, reports_path=True, **capabilities)
        self.rank, self.size, self.max_tag = host.rank, host.size, host.max_tag

    @property
    def watch(self) -> Callable[[], None] | None:
        return self.host.watch

    @watch.setter
    def watch(self, value: Callable[[], None] | None) -> None:
        self.host.watch = value

    @property
    def world_ranks(self) -> list[int]:
        return self.host.world_ranks

    def all_reduce(self, buf: Any, op: ReduceOp) -> Any:
        return self.host.all_reduce(buf, op)

    def reduce(self, buf: Any, op: ReduceOp, root: int) -> Any:
        return self.host.reduce(buf, op, root)

    def broadcast(self, buf: Any, root: int) -> Any:
        return self.host.broadcast(buf, root)

    def all_gather(self, out: Any, inp: Any) -> Any:
        return self.host.all_gather(out, inp)

    def reduce_scatter(self, out: Any, inp: Any, op: ReduceOp) -> Any:
        return self.host.reduce_scatter(out, inp, op)

    def gather(self, out: Any, inp: Any, root: int) -> Any:
        return self.host.gather(out, inp, root)

    def scatter(self, out: Any, inp: Any, root: int) -> Any:
        return self.host.scatter(out, inp, root)

    def all_to_all(self, out: Any, recv_counts: list[int], inp: Any, send_counts: list[int]) -> Any:
        return self.host.all_to_all(out, recv_counts, inp, send_counts)

    def barrier(self) -> Any:
        return self.host.barrier()

    def send(self, buf: Any, dst: int, tag: int) -> Any:
        return self.host.send(buf, dst, tag)

    def recv(self, buf: Any, src: int | None, tag: int) -> Any:
        return self.host.recv(buf, src, tag)

    def exchange(self, payload: Any, seq: int, deadline: float, *, watched: bool = False) -> list[Any]:
        return self.host.exchange(payload, seq, deadline, watched=watched)

    def local_rank(self) -> int:
        return self.host.local_rank()

    def host_name(self) -> str:
        return self.host.host_name()

    def mapped_bytes(self) -> int:
        """Bytes of shared memory this rank maps for the group: none here (the engines above say theirs)."""
        return 0

    def notify(self, ranks: list[int], notice: Any) -> None:
        self.host.notify(ranks, notice)

    def notices(self) -> list[Any]:
        return self.host.notices()

    def flush(self, timeout: float) -> None:
        self.host.flush(timeout)

    def abort(self, code: int) -> None:
        self.host.abort(code)

    def rank_failure(self, exc: BaseException, what: str, request: Any = None) -> BaseException | None:
        return self.host.rank_failure(exc, what, request)
