"""The hierarchical collectives of a group that spans nodes: shared memory within each node, MPI
between one leader per node (the node's first rank).

A collective of a NumPy array of at least ``MESHKIT_SHM_MIN_BYTES`` on such a group is a few
steps, each a request of an engine (so the group waits for and progresses it as any other):

all_reduce
    reduce to the node's leader (the node's engine: shared memory, comm/engines/shm.py), an
    all-reduce among the leaders over MPI, a broadcast from the leader within the node.
reduce
    the same reduce in each node, a reduce among the leaders to the root's node's leader, and on
    the root's node, where the root is not its leader, a broadcast from the leader within it
    (ranks whose array must stay unchanged, the leaders and the root's node-mates, work on a copy).
broadcast
    within the root's node from the root, among the leaders from its leader, then within every
    other node from its leader.
all_gather
    within each node into a block of the node's ranks, among the leaders (blocks padded to the
    largest node), the leader places every rank's part at its group rank, then a broadcast from
    the leader within the node.
reduce_scatter
    the all_reduce's steps on a copy of the input (every node rank ends with the whole reduction),
    then each rank takes its block: the bytes of an all_reduce of the input, moved simply.

Every rank ends with bytes that one leader computed, so every rank holds bitwise the same result
(the order within a node is the shared-memory path's fixed one; between nodes, MPI's). Nodes may
hold different numbers of the group's ranks, in any order of group ranks.

**Who did not arrive.** Before each step among the leaders, each leader sends every other one a
small arrival message and starts the step only once every leader's has come (on the leaders'
own communicator, which nothing else uses). A timeout there names the leaders whose arrival never
came, as the MPI path's arrival check does; one in a step within a node names the node's ranks
whose flags never came (the shared-memory path's own). A leader that timed out has started no MPI
collective, so nothing of it is left pending.

Every other call goes to the group's MPI engine as before. Where every node holds a single rank
of the group there is nothing to share, and the group stays on MPI.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Generator

import numpy as np

from ..reduce_op import ReduceOp
from .engine import DeadlineExceeded
from .shm_collectives import ShmRequest, Stepped
from .shm_host import OverHost

#: The group's MPI engines (comm/engines/mpi.py), handed in: this module imports nothing of MPI.
MPIEngine = Any

__all__ = ["HierarchicalEngine", "HierarchicalRequest", "NodeLayout"]

_NDARRAY = np.ndarray
_LEADERS_STEP = "the leaders' mpi step (every leader arrived)"
Steps = Generator[None, None, None]


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """Where a group's ranks lie: ``node_of[g]`` (the index of group rank g's node among the leaders,
    ordered by the leaders' group ranks), ``local_of[g]`` (its rank within its node, ordered by group
    rank), ``members[i]`` (node i's group ranks, in node order) and ``node`` (this rank's node).

    Example (ranks 0 and 2 on one node, 1 and 3 on another)::

        NodeLayout.of([0, 1, 0, 1], 1) == NodeLayout((0, 1, 0, 1), (0, 0, 1, 1), ((0, 2), (1, 3)), 1)
    """

    node_of: tuple[int, ...]
    local_of: tuple[int, ...]
    members: tuple[tuple[int, ...], ...]
    node: int

    @classmethod
    def of(cls, leader_of: list[int], rank: int) -> NodeLayout:
        """From each group rank's leader's group rank (``leader_of``) and this rank's group rank."""
        leaders = sorted(set(leader_of))
        node_of = tuple(leaders.index(leader) for leader in leader_of)
        members = tuple(tuple(g for g in range(len(leader_of)) if node_of[g] == i) for i in range(len(leaders)))
        local_of = tuple(members[node_of[g]].index(g) for g in range(len(leader_of)))
        return cls(node_of, local_of, members, node_of[rank])

    @property
    def widest(self) -> int:
        return max(len(m) for m in self.members)


class HierarchicalRequest(Stepped):
    """The steps of a hierarchical collective; ``Test()`` moves them on without blocking.

    ``missing()``: the global ranks a stalled step waits for where that is known (a step over shared
    memory: the ranks whose flags never came; the leaders' arrival: the leaders whose message never
    came; ``[]`` once every leader arrived), else None.
    """

    __slots__ = ("kind", "stage", "_step", "_node", "_waiting", "_pending", "_sent")
    path = "shm+mpi"

    def __init__(self, kind: str, steps: Callable[[HierarchicalRequest], Steps], node: Any) -> None:
        self.kind, self._node, self._step, self._done, self._error = kind, node, None, False, None
        #: the step under way, in words (a timeout's message says where the call stalled)
        self.stage = "its first step"
        self._waiting: list[int] | None = None  # the leaders' arrival: global ranks not heard from yet
        self._pending: list[Any] = []  # the arrival's MPI receives, cancelled if the call is abandoned
        self._sent: tuple[Any, ...] = ()  # the arrival's message and its sends, kept until they complete
        self._steps = steps(self)
        self.Test()

    def missing(self) -> list[int] | None:
        step = self._step
        if isinstance(step, ShmRequest):
            ranks = self._node.world_ranks
            return [ranks[r] for r in step.missing_ranks]
        return self._waiting

    def run(self, request: Any) -> Steps:
        """Yield until ``request`` (one step) completes."""
        if self.stage != _LEADERS_STEP:
            self.stage = "a step within this rank's node" + (" over shared memory" if isinstance(request, ShmRequest)
                                                              else "")
        self._step = request
        while not request.Test():
            yield
        self._step = None

    def among_leaders(self, leaders: MPIEngine, number: int, tag: int, start: Callable[[], Any]) -> Steps:
        """A step among the leaders (``leaders``, this rank's MPI engine over them): every leader's
        arrival message first (``number``: the engine's count of such steps, on ``tag`` of the
        leaders' own communicator), so that a timeout names the leaders that never came; then the
        step ``start`` begins, until it completes."""
        comm, me = leaders.comm, leaders.rank
        others = [r for r in range(leaders.size) if r != me]
        token = np.array([number], np.int64)
        heard = np.zeros(leaders.size, np.int64)
        receives = {r: comm.Irecv(heard[r:r + 1], source=r, tag=tag) for r in others}
        sends = [comm.Isend(token, dest=r, tag=tag) for r in others]
        self._pending, self._sent = list(receives.values()), (token, sends)
        self.stage = "the nodes' leaders' arrival before their mpi step"
        while True:
            waiting = [r for r, pending in receives.items() if not pending.Test()]
            if not waiting:
                break
            self._waiting = [leaders.world_ranks[r] for r in waiting]
            yield
        self._waiting, self._pending = [], []
        self.stage = _LEADERS_STEP
        yield from self.run(start())
        self._waiting, self.stage = None, "a step after the leaders'"
        for sent in sends:  # matched by now: every leader received before it started the step
            while not sent.Test():
                yield
        self._sent = ()

    def abandon(self) -> tuple[Any, ...]:
        """The call timed out: cancel the arrival messages this rank still waits for. Returns its own
        arrival message and sends, which may not have left yet (the caller keeps them: MPI reads the
        message until a send completes)."""
        for pending in self._pending:
            if not pending.Test():
                pending.Cancel()
                pending.Wait()
        self._pending = []
        sent, self._sent = self._sent, ()
        return sent


class HierarchicalEngine(OverHost):
    """A group's MPI engine with the hierarchical collectives (see the module docstring).

    Args:
        host: the group's MPI engine (every call but the hierarchical ones).
        node: the engine of this rank's node (a ShmEngine, or an MPIEngine where the node has one rank
            or its segment could not be made).
        leaders: an MPI engine over the first rank of each node, on those ranks; None elsewhere.
        least: ``MESHKIT_SHM_MIN_BYTES``.
        over: how a child group's engine is made (``shm.over``: the path where it applies).

    Construction is collective over ``host`` (one all-gather of each rank's node leader).
    """

    def __init__(self, host: MPIEngine, node: Any, leaders: MPIEngine | None, least: int,
                 over: Callable[[MPIEngine, float], Any]) -> None:
        super().__init__(host)
        self.node, self.leaders, self.min_bytes, self._over = node, leaders, least, over
        leader = np.array([host.world_ranks.index(node.world_ranks[0])], np.int64)
        every = np.empty(host.size, np.int64)
        host.comm.Allgather(leader, every)
        self.layout = NodeLayout.of([int(g) for g in every], host.rank)
        self._arrivals = 0  # steps among the leaders so far (each arrival message carries its number)
        self._loose: list[tuple[Any, ...]] = []  # arrival messages of timed-out calls, kept while they may be sent
        # the leaders' communicator is this engine's alone; a tag below the MPI engine's reserved ones
        self._tag = leaders.max_tag + 8 if leaders is not None else 0

    # ----------------------------------------------------------------- the collectives
    def all_reduce(self, buf: Any, op: ReduceOp) -> Any:
        if buf.__class__ is not _NDARRAY or buf.nbytes < self.min_bytes:
            return self.host.all_reduce(buf, op)
        node, leaders = self.node, self.leaders

        def steps(request: HierarchicalRequest) -> Steps:
            yield from request.run(node.reduce(buf, op, 0))
            if leaders is not None:
                yield from self._among_leaders(request, lambda: leaders.all_reduce(buf, op))
            yield from request.run(node.broadcast(buf, 0))

        return HierarchicalRequest("all_reduce", steps, node)

    def reduce(self, buf: Any, op: ReduceOp, root: int) -> Any:
        if buf.__class__ is not _NDARRAY or buf.nbytes < self.min_bytes:
            return self.host.reduce(buf, op, root)
        node, leaders, layout = self.node, self.leaders, self.layout
        root_node, root_local = layout.node_of[root], layout.local_of[root]
        relay = layout.node == root_node and root_local != 0  # the root's leader hands it the result
        mine = self.rank == root
        work = buf if mine or not (leaders is not None or relay) else buf.copy()

        def steps(request: HierarchicalRequest) -> Steps:
            yield from request.run(node.reduce(work, op, 0))
            if leaders is not None:
                yield from self._among_leaders(request, lambda: leaders.reduce(work, op, root_node))
            if relay:
                yield from request.run(node.broadcast(work, 0))

        return HierarchicalRequest("reduce", steps, node)

    def broadcast(self, buf: Any, root: int) -> Any:
        if buf.__class__ is not _NDARRAY or buf.nbytes < self.min_bytes:
            return self.host.broadcast(buf, root)
        node, leaders, layout = self.node, self.leaders, self.layout
        root_node, root_local = layout.node_of[root], layout.local_of[root]

        def steps(request: HierarchicalRequest) -> Steps:
            if layout.node == root_node:
                yield from request.run(node.broadcast(buf, root_local))
            if leaders is not None:
                yield from self._among_leaders(request, lambda: leaders.broadcast(buf, root_node))
            if layout.node != root_node:
                yield from request.run(node.broadcast(buf, 0))

        return HierarchicalRequest("broadcast", steps, node)

    def all_gather(self, out: Any, inp: Any) -> Any:
        if out.__class__ is not _NDARRAY or inp.__class__ is not _NDARRAY or out.nbytes < self.min_bytes:
            return self.host.all_gather(out, inp)
        node, leaders, layout = self.node, self.leaders, self.layout
        here = len(layout.members[layout.node])
        block = np.zeros((layout.widest, inp.size), inp.dtype)  # this node's parts, padded to the widest node

        def steps(request: HierarchicalRequest) -> Steps:
            yield from request.run(node.all_gather(block[:here].reshape(-1), inp.reshape(-1)))
            if leaders is not None:
                every = np.empty((len(layout.members), layout.widest, inp.size), inp.dtype)
                yield from self._among_leaders(request, lambda: leaders.all_gather(every.reshape(-1), block.reshape(-1)))
                dst = out.reshape(self.size, -1)
                for g in range(self.size):
                    dst[g] = every[layout.node_of[g], layout.local_of[g]]
            yield from request.run(node.broadcast(out, 0))

        return HierarchicalRequest("all_gather", steps, node)

    def reduce_scatter(self, out: Any, inp: Any, op: ReduceOp) -> Any:
        if out.__class__ is not _NDARRAY or inp.__class__ is not _NDARRAY or inp.nbytes < self.min_bytes:
            return self.host.reduce_scatter(out, inp, op)
        node, leaders = self.node, self.leaders
        work = inp.reshape(-1).copy()  # the input stays unchanged

        def steps(request: HierarchicalRequest) -> Steps:
            yield from request.run(node.reduce(work, op, 0))
            if leaders is not None:
                yield from self._among_leaders(request, lambda: leaders.all_reduce(work, op))
            yield from request.run(node.broadcast(work, 0))
            out.reshape(-1)[...] = work.reshape(self.size, -1)[self.rank]

        return HierarchicalRequest("reduce_scatter", steps, node)

    def _among_leaders(self, request: HierarchicalRequest, start: Callable[[], Any]) -> Steps:
        """A step among the leaders, each leader's arrival first (:meth:`HierarchicalRequest.among_leaders`)."""
        self._arrivals += 1
        return request.among_leaders(self.leaders, self._arrivals, self._tag, start)

    # ----------------------------------------------------------------- what the group asks
    def path(self, request: Any) -> str:
        return "shm+mpi" if request.__class__ is HierarchicalRequest else "mpi"

    def paths(self) -> str:
        return (f"all_reduce, reduce, broadcast, all_gather and reduce_scatter of NumPy arrays of >= {self.min_bytes} "
                "bytes through shared memory within each node and mpi between one leader per node, the rest over mpi")

    def mapped_bytes(self) -> int:
        """Bytes of shared memory this rank maps: its node's engine's."""
        node = self.node
        return node.mapped_bytes() if node.capabilities.reports_path else 0

    def wait(self, request: Any, deadline: float) -> None:
        if request.__class__ is not HierarchicalRequest:
            self.host.wait(request, deadline)
            return
        try:
            self.host.wait(request, deadline)  # MPI's wait polls Test(): each step moves on
        except DeadlineExceeded:
            missing = request.missing()
            sent = request.abandon()
            if sent:
                self._loose.append(sent)
            raise DeadlineExceeded(missing, f"{request.kind} through shared memory within each node and mpi among "
                                   f"the nodes' leaders, stalled in {request.stage}") from None

    def split(self, color: int | None, ranks: tuple[int, ...], deadline: float) -> Any:
        child = self.host.split(color, ranks, deadline)
        return None if child is None else self._over(child, deadline)

    def free(self) -> None:
        self.node.free()
        if self.leaders is not None:
            self.leaders.free()
        self.host.free()
