"""The hierarchical all-reduce of a group that spans nodes: shared memory within each node, MPI
between one leader per node.

An ``all_reduce`` of a NumPy array of at least ``MESHKIT_SHM_MIN_BYTES`` on such a group is three
steps, each a request of an engine (so the group waits for and progresses it as any other):

1. a reduce to the node's first rank, over the node's engine (shared memory: comm/engines/shm.py);
2. on each node's first rank, an all-reduce over MPI among the leaders;
3. a broadcast from the node's first rank, over the node's engine.

Every rank ends with the leader's bytes, so every rank holds bitwise the same result (the order
within a node is the shared-memory path's fixed one; between nodes, MPI's). Every other call
goes to the group's MPI engine as before. Where every node holds a single rank of the group
there is nothing to share, and the group stays on MPI.
"""

from __future__ import annotations

from typing import Any, Callable, Generator

import numpy as np

from ..reduce_op import ReduceOp
from .engine import DeadlineExceeded
from .shm_collectives import ShmRequest, Stepped
from .shm_host import OverHost

#: The group's MPI engines (comm/engines/mpi.py), handed in: this module imports nothing of MPI.
MPIEngine = Any

__all__ = ["HierarchicalEngine", "HierarchicalRequest"]

_NDARRAY = np.ndarray


class HierarchicalRequest(Stepped):
    """The three steps of a hierarchical all-reduce; ``Test()`` moves them on without blocking.

    ``missing()``: the global ranks a stalled step waits for where that is known (a step over shared
    memory), else None (MPI's step cannot tell).
    """

    __slots__ = ("_step", "_node")
    path = "shm+mpi"

    def __init__(self, steps: Callable[[HierarchicalRequest], Generator[None, None, None]], node: Any) -> None:
        self._node, self._step, self._done, self._error = node, None, False, None
        self._steps = steps(self)
        self.Test()

    def missing(self) -> list[int] | None:
        step = self._step
        if isinstance(step, ShmRequest):
            ranks = self._node.world_ranks
            return [ranks[r] for r in step.missing_ranks]
        return None

    def run(self, request: Any) -> Generator[None, None, None]:
        """Yield until ``request`` (one step) completes."""
        self._step = request
        while not request.Test():
            yield
        self._step = None


class HierarchicalEngine(OverHost):
    """A group's MPI engine with the hierarchical all-reduce (see the module docstring).

    Args:
        host: the group's MPI engine (every call but the hierarchical ones).
        node: the engine of this rank's node (a ShmEngine, or an MPIEngine where the node has one rank
            or its segment could not be made).
        leaders: an MPI engine over the first rank of each node, on those ranks; None elsewhere.
        least: ``MESHKIT_SHM_MIN_BYTES``.
        over: how a child group's engine is made (``shm.over``: the path where it applies).
    """

    def __init__(self, host: MPIEngine, node: Any, leaders: MPIEngine | None, least: int,
                 over: Callable[[MPIEngine, float], Any]) -> None:
        super().__init__(host)
        self.node, self.leaders, self.min_bytes, self._over = node, leaders, least, over

    def all_reduce(self, buf: Any, op: ReduceOp) -> Any:
        if buf.__class__ is not _NDARRAY or buf.nbytes < self.min_bytes:
            return self.host.all_reduce(buf, op)
        node, leaders = self.node, self.leaders

        def steps(request: HierarchicalRequest) -> Generator[None, None, None]:
            yield from request.run(node.reduce(buf, op, 0))
            if leaders is not None:
                yield from request.run(leaders.all_reduce(buf, op))
            yield from request.run(node.broadcast(buf, 0))

        return HierarchicalRequest(steps, node)

    def path(self, request: Any) -> str:
        return "shm+mpi" if request.__class__ is HierarchicalRequest else "mpi"

    def paths(self) -> str:
        return (f"all_reduce of NumPy arrays of >= {self.min_bytes} bytes through shared memory within each node "
                "and mpi between one leader per node, the rest over mpi")

    def wait(self, request: Any, deadline: float) -> None:
        if request.__class__ is not HierarchicalRequest:
            self.host.wait(request, deadline)
            return
        try:
            self.host.wait(request, deadline)  # MPI's wait polls Test(): each step moves on
        except DeadlineExceeded:
            raise DeadlineExceeded(request.missing(), "all_reduce through shared memory and the nodes' leaders") \
                from None

    def split(self, color: int | None, ranks: tuple[int, ...], deadline: float) -> Any:
        child = self.host.split(color, ranks, deadline)
        return None if child is None else self._over(child, deadline)

    def free(self) -> None:
        self.node.free()
        if self.leaders is not None:
            self.leaders.free()
        self.host.free()
