"""ProcessGroup: a set of ranks that communicate together, over the engine it holds.

A :class:`ProcessGroup` is a set of global ranks (ascending; a rank's *group rank* is its
position in that tuple), a timeout and an engine (:mod:`meshkit.comm.engines.engine`). Its public
methods take group ranks for roots and peers (the module-level functions in
:mod:`meshkit.comm.collectives` translate torch-style global ranks) and run every operation the same
way, synchronous or not:

1. check the arguments (:mod:`~meshkit.comm.checks`), on this rank, before anything starts;
2. number the operation (``seq``, the same on every rank since every rank issues the group's
   operations in program order) and, with ``MESHKIT_DEBUG=detail``, verify that every rank
   called the same operation (:mod:`~meshkit.comm.debug`);
3. start it with one engine call, which returns a request at once;
4. wait for it under the group's timeout, or return a :class:`~meshkit.comm.groups.work.RequestWork`.

While a task of :meth:`ProcessGroup.run_async` is queued, later calls join the queue behind
it, so that the group's operations still start in program order.

This module holds the class: its identity, public collectives (step 1, then the path every
collective shares) and lifecycle. The group holds its other parts, each an object with its state
declared in its own class (the engine is held the same way, never inherited):
:class:`~meshkit.comm.groups.execution.CollectiveQueue` (``queue``: steps 2-4, the numbering and the
queue of in-flight collectives; the owner of the works it hands out) and
:class:`~meshkit.comm.groups.failures.FailureState` (``failures``: a failed call recorded, the group
broken, the other ranks told, their notices read); :mod:`~meshkit.comm.groups.p2p` holds
``isend``/``irecv``.
"""

from __future__ import annotations

import datetime
import functools
import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import numpy as np

from .. import env
from . import p2p
from ..checks import check_array, check_like, check_list, check_member, check_root, check_split_sizes, where
from ..engines.cuda_runtime import keep_current_device
from ..engines.engine import DeadlineExceeded, DeviceEngine, Engine, ReportsPath, SharesMemory
from ..errors import DistTypeError, DistValueError, RankFailedError
from .execution import CollectiveQueue
from .failures import FailureState
from ..reduce_op import ReduceOp, check_op_dtype, valid_op_dtypes
from ..timeouts import resolve_timeout
from .call_fingerprint import creation, same_creation
from ..engines.watchdog import watched
from .work import Work

if TYPE_CHECKING:
    from .world import World

__all__ = ["ProcessGroup"]

logger = logging.getLogger("meshkit")

_get_ident = threading.get_ident
#: Bound once: an Enum member read from its class costs an Enum lookup, on the
#: hottest call of all.
_AVG = ReduceOp.AVG


class ProcessGroup:
    """A group of ranks that communicate together (torch's ``ProcessGroup``).

    Attributes:
        ranks: the global ranks of the group, ascending.
        rank: this process's rank within the group, or -1 if it is not a member.
        size: number of ranks.
        name: a readable name (``"world"``, ``"dp"``, ``"group[0, 2]"``).
        timeout: seconds every blocking call waits at most.
        engine: the engine that moves the data (None on a handle of a group this rank is not in).
        world: the world the group belongs to.
        failures: its failure state (a part it holds; not user API).
        queue: how it numbers, starts, queues and completes its operations (a part it holds; not user API).
    """

    __slots__ = ("engine", "world", "ranks", "rank", "size", "name", "timeout", "failures", "queue",
                 "_group_rank_of", "__weakref__")

    def __init__(self, engine: Engine | None, *, world: World, ranks: Sequence[int], group_rank: int, name: str,
                 timeout: float) -> None:
        self.engine = engine
        self.world = world
        self.ranks: tuple[int, ...] = tuple(int(r) for r in ranks)
        self.rank = group_rank
        self.size = len(self.ranks)
        self.name = name
        self.timeout = float(timeout)
        self._group_rank_of = {g: i for i, g in enumerate(self.ranks)}
        # An engine that aborts its communicator when the group breaks (NCCL's abandon): nothing it
        # started can complete afterwards, on this rank or for the other members.
        self.failures = FailureState(self, abandons=engine is not None and engine.capabilities.abandons)
        self.queue = CollectiveQueue(self, engine, self.failures)
        if engine is not None:
            engine.watch = self.failures.stalled

    # ----------------------------------------------------------------- identity
    @property
    def backend(self) -> str:
        """The engine's name; for a handle of a group this rank is not in, the world's."""
        return self.engine.backend if self.engine is not None else self.world.backend

    @property
    def global_rank(self) -> int:
        """This process's rank in the world."""
        return self.world.rank

    @property
    def is_member(self) -> bool:
        return self.rank >= 0

    @property
    def max_tag(self) -> int:
        """The largest tag ``send``/``recv`` accept."""
        return self.engine.max_tag if self.engine is not None else 0

    def group_rank_of(self, global_rank: int) -> int:
        """The group rank of a global rank; ValueError if it is not in the group."""
        try:
            return self._group_rank_of[int(global_rank)]
        except (KeyError, TypeError, ValueError):
            raise DistValueError(f"meshkit.comm: rank {self.global_rank}: global rank {global_rank!r} is not "
                                 f"in group {self.name} (ranks {list(self.ranks)})") from None

    def global_rank_of(self, group_rank: int) -> int:
        """The global rank of a group rank; ValueError if out of range."""
        return self.ranks[check_root(self, "get_global_rank", "group_rank", group_rank)]

    @property
    def device(self) -> int | None:
        """The index of the GPU this rank's collectives run on (NCCL engine), or None (host engines)."""
        return self.engine.device if self.engine is not None else None

    def host_name(self) -> str:
        """The name of the host this rank runs on (MPI's processor name on the mpi engine), or the
        simulated one that ``MESHKIT_HOST_NAME`` names (``meshkit-run --simulate-nodes``)."""
        return self.engine.host_name() if self.engine is not None else env.this_host()

    def shared_buffer(self, nbytes: int) -> np.ndarray:
        """``nbytes`` zeroed bytes (a uint8 array) for a buffer this group reduces without copies.

        Collective over the group: every member calls it with the same ``nbytes``, in the same
        order among the group's calls. On a group whose ranks share memory (one node, the
        shared-memory path: comm/engines/shm.py) the buffer lies in a segment every member maps,
        and an ``all_reduce`` of a view of it (the same place on every rank, any size) reduces in
        place: no copy in or out. Elsewhere it is ordinary memory and the call costs nothing.

        Example (2 ranks on one node)::

            buf = group.shared_buffer(8 * 1000).view(np.float64)
            buf[:] = rank + 1
            group.all_reduce(buf)          # both ranks: buf == 3.0, reduced where it lies
        """
        check_member(self, "shared_buffer")
        if nbytes.__class__ is not int or nbytes < 0:
            raise self.queue.reject("shared_buffer", DistValueError(
                f"{where('shared_buffer', self)}: nbytes must be a non-negative int, got {nbytes!r}"))
        engine = self.engine
        if engine is None or not engine.capabilities.shares_memory:
            return np.zeros(nbytes, np.uint8)
        sharing = cast(SharesMemory, engine)
        return self.queue.blocking("shared_buffer", lambda seq, deadline: sharing.shared_buffer(nbytes, deadline),
                                   self.timeout)

    def shares_memory(self) -> bool:
        """Whether :meth:`shared_buffer` hands out memory every member maps (the group's ranks share a
        node and the shared-memory path is on: comm/engines/shm.py), so that collectives of its
        buffers run in place; False elsewhere (its buffers are ordinary memory). The same on every rank."""
        engine = self.engine
        return engine is not None and engine.capabilities.shares_memory

    def shared_memory_bytes(self) -> int:
        """Bytes of shared memory this rank maps for the group: its shared-memory segment and every
        :meth:`shared_buffer` handed out on it (each maps every member's region), or within its node
        where the group spans nodes; 0 where it has none. Every member of a node maps the same pages,
        so the node's memory holds them once, not once per rank (``memory_report``'s
        ``shared_memory_mapped``)."""
        engine = self.engine
        if engine is None or not engine.capabilities.reports_path:
            return 0
        return cast(ReportsPath, engine).mapped_bytes()

    def paths(self) -> str | None:
        """Which of its calls take which path, where the engine has more than one (a group on one
        node under MPI: shared memory or MPI, comm/engines/shm.py); None otherwise."""
        engine = self.engine
        if engine is None or not engine.capabilities.reports_path:
            return None
        return cast(ReportsPath, engine).paths()

    def __repr__(self) -> str:
        return (f"<ProcessGroup {self.name!r} backend={self.backend} ranks={list(self.ranks)} rank={self.rank} "
                f"timeout={self.timeout:g}s>")

    # ----------------------------------------------------------------- collectives
    def all_reduce(self, tensor: np.ndarray, op: ReduceOp = ReduceOp.SUM, *,
                   async_op: bool = False) -> Work | None:
        """Reduce ``tensor`` over the group, in place on every rank.

        Example (3 ranks): rank r holds ``[r, 1]``; afterwards every rank holds ``[3, 3]``.
        """
        if self.rank < 0 or self.world.destroyed:
            check_member(self, "all_reduce")
        try:
            check_array(self, "all_reduce", "tensor", tensor)
            if op.__class__ is not ReduceOp or (op, tensor.dtype) not in valid_op_dtypes:  # checked once per pair
                op = check_op_dtype(op, tensor.dtype, lambda: where("all_reduce", self))
        except (DistValueError, DistTypeError) as exc:
            raise self.queue.reject("all_reduce", exc)
        # The path of every collective (CollectiveQueue.run's phases), with the engine call made here:
        # DDP's bucket reaches the engine in five calls (README, tests/test_structure.py).
        queue = self.queue
        thread = queue.thread
        if thread.pending and thread.runner != _get_ident():
            return queue.behind_tasks("all_reduce", lambda: self.all_reduce(tensor, op), async_op)
        seq, queued = queue.issue("all_reduce", tensor, async_op, op)
        epilogue = queue.averaged(tensor) if op is _AVG and queue.divides else None
        if queued:  # async, behind the collective in flight: started when that one completes
            return queue.enqueue(seq, "all_reduce", functools.partial(self.engine.all_reduce, tensor, op),
                                 (tensor.shape,), tensor.dtype, epilogue)
        try:
            request = self.engine.all_reduce(tensor, op)
        except BaseException as exc:
            raise queue.start_failed("all_reduce", seq, (tensor.shape,), tensor.dtype, exc) from None
        return queue.started("all_reduce", seq, (tensor.shape,), tensor.dtype, request, epilogue, async_op)

    def reduce(self, tensor: np.ndarray, root: int, op: ReduceOp = ReduceOp.SUM, *,
               async_op: bool = False) -> Work | None:
        """Reduce ``tensor`` over the group into group rank ``root``'s ``tensor``.

        The other ranks' ``tensor`` keeps its contents.
        """
        check_member(self, "reduce")
        try:
            check_array(self, "reduce", "tensor", tensor)
            root = check_root(self, "reduce", "dst", root)
            op = check_op_dtype(op, tensor.dtype, lambda: where("reduce", self))
        except (DistValueError, DistTypeError) as exc:
            raise self.queue.reject("reduce", exc)
        queue = self.queue
        epilogue = queue.averaged(tensor) if op is _AVG and queue.divides and self.rank == root else None
        return queue.run("reduce", lambda: self.engine.reduce(tensor, op, root), async_op, (tensor.shape,),
                         tensor, epilogue, op, {"root": root})

    def broadcast(self, tensor: np.ndarray, root: int, *, async_op: bool = False) -> Work | None:
        """Copy group rank ``root``'s ``tensor`` into every rank's ``tensor``."""
        check_member(self, "broadcast")
        try:
            check_array(self, "broadcast", "tensor", tensor)
            root = check_root(self, "broadcast", "src", root)
        except (DistValueError, DistTypeError) as exc:
            raise self.queue.reject("broadcast", exc)
        return self.queue.run("broadcast", lambda: self.engine.broadcast(tensor, root), async_op, (tensor.shape,),
                              tensor, None, None, {"root": root})

    def all_gather_into_tensor(self, output: np.ndarray, input: np.ndarray, *,
                               async_op: bool = False) -> Work | None:
        """Concatenate every rank's ``input`` into ``output`` (``size`` times as many elements).

        ``input`` may be the rank's own chunk of ``output`` (a view), which gathers in place.
        """
        name = "all_gather_into_tensor"
        check_member(self, name)
        try:
            check_array(self, name, "input", input, writable=False)
            check_array(self, name, "output", output)
            check_like(self, name, "output", output, input, "input", size=input.size * self.size)
        except (DistValueError, DistTypeError) as exc:
            raise self.queue.reject(name, exc)
        return self.queue.run(name, lambda: self.engine.all_gather(output, input), async_op,
                              (input.shape, output.shape), input, None)

    def all_gather(self, tensor_list: list[np.ndarray], tensor: np.ndarray, *,
                   async_op: bool = False) -> Work | None:
        """Gather every rank's ``tensor`` into ``tensor_list[rank]`` on every rank."""
        check_member(self, "all_gather")
        try:
            check_array(self, "all_gather", "tensor", tensor, writable=False)
            outs = check_list(self, "all_gather", "tensor_list", tensor_list, tensor, "tensor", writable=True)
        except (DistValueError, DistTypeError) as exc:
            raise self.queue.reject("all_gather", exc)
        flat = np.empty_like(tensor, shape=(self.size,) + tensor.shape)  # on the tensor's device
        return self.queue.run("all_gather", lambda: self.engine.all_gather(flat, tensor), async_op,
                              (tensor.shape,), tensor, _copy_rows(flat, outs))

    def reduce_scatter_tensor(self, output: np.ndarray, input: np.ndarray, op: ReduceOp = ReduceOp.SUM,
                              *, async_op: bool = False) -> Work | None:
        """Reduce ``input`` (``size`` chunks) over the group; rank r receives reduced chunk r."""
        name = "reduce_scatter_tensor"
        check_member(self, name)
        try:
            check_array(self, name, "input", input, writable=False)
            check_array(self, name, "output", output)
            check_like(self, name, "input", input, output, "output", size=output.size * self.size)
            op = check_op_dtype(op, input.dtype, lambda: where(name, self))
        except (DistValueError, DistTypeError) as exc:
            raise self.queue.reject(name, exc)
        epilogue = self.queue.averaged(output) if op is _AVG and self.queue.divides else None
        return self.queue.run(name, lambda: self.engine.reduce_scatter(output, input, op), async_op,
                              (input.shape, output.shape), input, epilogue, op)

    def reduce_scatter(self, output: np.ndarray, input_list: list[np.ndarray], op: ReduceOp = ReduceOp.SUM,
                       *, async_op: bool = False) -> Work | None:
        """Reduce ``input_list[r]`` over the group into rank r's ``output``."""
        check_member(self, "reduce_scatter")
        try:
            check_array(self, "reduce_scatter", "output", output)
            ins = check_list(self, "reduce_scatter", "input_list", input_list, output, "output", writable=False)
            op = check_op_dtype(op, output.dtype, lambda: where("reduce_scatter", self))
        except (DistValueError, DistTypeError) as exc:
            raise self.queue.reject("reduce_scatter", exc)
        epilogue = self.queue.averaged(output) if op is _AVG and self.queue.divides else None
        stacked = np.stack(ins)
        return self.queue.run("reduce_scatter", lambda: self.engine.reduce_scatter(output, stacked, op), async_op,
                              (output.shape,), output, epilogue, op)

    def gather(self, tensor: np.ndarray, gather_list: list[np.ndarray] | None, root: int, *,
               async_op: bool = False) -> Work | None:
        """Gather every rank's ``tensor`` into ``gather_list`` on group rank ``root``."""
        check_member(self, "gather")
        try:
            check_array(self, "gather", "tensor", tensor, writable=False)
            root = check_root(self, "gather", "dst", root)
            outs = self._root_list("gather", "gather_list", gather_list, tensor, root, writable=True)
        except (DistValueError, DistTypeError) as exc:
            raise self.queue.reject("gather", exc)
        flat = np.empty_like(tensor, shape=(self.size,) + tensor.shape) if outs is not None else None
        return self.queue.run("gather", lambda: self.engine.gather(flat, tensor, root), async_op, (tensor.shape,),
                              tensor, None if outs is None else _copy_rows(flat, outs), None, {"root": root})

    def scatter(self, tensor: np.ndarray, scatter_list: list[np.ndarray] | None, root: int, *,
                async_op: bool = False) -> Work | None:
        """Send ``scatter_list[r]`` from group rank ``root`` into rank r's ``tensor``."""
        check_member(self, "scatter")
        try:
            check_array(self, "scatter", "tensor", tensor)
            root = check_root(self, "scatter", "src", root)
            ins = self._root_list("scatter", "scatter_list", scatter_list, tensor, root, writable=False)
        except (DistValueError, DistTypeError) as exc:
            raise self.queue.reject("scatter", exc)
        stacked = np.stack(ins) if ins is not None else None
        return self.queue.run("scatter", lambda: self.engine.scatter(tensor, stacked, root), async_op, (tensor.shape,),
                              tensor, None, None, {"root": root})

    def all_to_all_single(self, output: np.ndarray, input: np.ndarray,
                          output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None, *,
                          async_op: bool = False) -> Work | None:
        """Split ``input`` along dim 0, send part j to rank j; receive into ``output`` in rank order.

        Split sizes count rows of dim 0; None means equal parts. No copies are made.
        """
        name = "all_to_all_single"
        check_member(self, name)
        try:
            check_array(self, name, "input", input, writable=False)
            check_array(self, name, "output", output)
            check_like(self, name, "output", output, input, "input")
            if input.ndim == 0 or output.ndim == 0 or input.shape[1:] != output.shape[1:]:
                raise DistValueError(f"{where(name, self)}: input {input.shape} and output {output.shape} must be "
                                     "at least 1-D with the same shape after dim 0")
            row = input.size // input.shape[0] if input.shape[0] else math.prod(input.shape[1:])
            send = [s * row for s in check_split_sizes(self, name, "input_split_sizes", input_split_sizes,
                                                       input.shape[0])]
            recv = [s * row for s in check_split_sizes(self, name, "output_split_sizes", output_split_sizes,
                                                       output.shape[0])]
        except (DistValueError, DistTypeError) as exc:
            raise self.queue.reject(name, exc)
        return self.queue.run(name, lambda: self.engine.all_to_all(output, recv, input, send), async_op,
                              (input.shape, output.shape), None, None, None,
                              {"dtype": input.dtype, "counts": (tuple(send), tuple(recv))})

    def all_to_all(self, output_list: list[np.ndarray], input_list: list[np.ndarray], *,
                   async_op: bool = False) -> Work | None:
        """Send ``input_list[j]`` to rank j; receive rank j's array into ``output_list[j]``."""
        check_member(self, "all_to_all")
        try:
            if not isinstance(input_list, (list, tuple)) or not input_list:
                raise DistValueError(f"{where('all_to_all', self)}: input_list must be a list of {self.size} arrays")
            check_array(self, "all_to_all", "input_list[0]", input_list[0], writable=False)
            ref = input_list[0]
            ins = check_list(self, "all_to_all", "input_list", input_list, ref, "input_list[0]", writable=False,
                             same_shape=False)
            outs = check_list(self, "all_to_all", "output_list", output_list, ref, "input_list[0]", writable=True,
                              same_shape=False)
        except (DistValueError, DistTypeError) as exc:
            raise self.queue.reject("all_to_all", exc)
        send = [x.size for x in ins]
        recv = [x.size for x in outs]
        flat_in = np.concatenate([x.ravel() for x in ins])
        flat_out = np.empty_like(ref, shape=(sum(recv),))

        def epilogue() -> None:
            start = 0
            for out, n in zip(outs, recv):
                out.reshape(-1)[...] = flat_out[start:start + n]
                start += n

        return self.queue.run("all_to_all", lambda: self.engine.all_to_all(flat_out, recv, flat_in, send), async_op,
                              tuple(x.shape for x in ins), None, epilogue, None,
                              {"dtype": ref.dtype, "counts": (tuple(send), tuple(recv))})

    def barrier(self, *, async_op: bool = False) -> Work | None:
        """Block until every rank of the group has reached the barrier.

        Where the engine does not compare calls itself (MPI), the barrier also compares the
        fingerprint of the members' calls since the last comparison (comm/groups/call_fingerprint.py), in the
        same round of messages: if they differ, every member raises
        :class:`~meshkit.comm.errors.CollectiveMismatchError` naming the first call that
        differs, the ranks and what each called.
        """
        check_member(self, "barrier")
        return self.queue.barrier(async_op)

    def isend(self, tensor: np.ndarray, dst: int, tag: int = 0) -> Work:
        """Start sending ``tensor`` to group rank ``dst``; the Work completes when it may be reused."""
        return p2p.isend(self, tensor, dst, tag)

    def irecv(self, tensor: np.ndarray, src: int | None = None, tag: int = 0) -> Work:
        """Start receiving into ``tensor`` from group rank ``src`` (None: any rank).

        ``Work.result()`` is the sender's global rank once the Work completed. A message of
        another size (or, on the local engine, dtype) than ``tensor`` is an error raised by ``wait``
        (on MPI a shorter message has been written into the start of ``tensor`` by then).
        """
        return p2p.irecv(self, tensor, src, tag)

    def monitored_barrier(self, timeout: float | datetime.timedelta | None = None) -> None:
        """A barrier that names every rank that did not arrive within ``timeout`` (seconds, or a
        ``timedelta`` as torch's; None: the group's timeout).

        Group rank 0 collects an arrival message from each rank and answers all of them, so a
        rank that never arrives is known and reported (torch's gloo ``monitored_barrier``, but
        naming all missing ranks, not only the first).
        """
        check_member(self, "monitored_barrier")
        limit = self.timeout if timeout is None else resolve_timeout(timeout)
        self.queue.blocking("monitored_barrier", lambda seq, d: self.engine.exchange(None, seq, d), limit)

    def split(self, color: int | None, *, ranks: Sequence[int], name: str,
              partition: Sequence[Sequence[int]] | None = None) -> ProcessGroup | None:
        """Collective over this group: ranks passing the same ``color`` form a new group.

        Whatever the debug level, every member first checks that all are making this call (the
        same ``partition``) before the engine's split, which cannot be interrupted (MPI's
        ``Comm.Split``); the split itself runs under a watchdog (comm/engines/watchdog.py).

        Args:
            color: this rank's new group id, or None to take part without joining any.
            ranks: the global ranks of this rank's new group (ascending), known to the caller
                from the layout; the engine checks that it agrees.
            name: name of the new group.
            partition: every new group's global ranks, the same on every member (compared); None:
                only that every member splits is checked.

        Returns:
            The new group, or None where ``color`` is None.

        Raises:
            CollectiveMismatchError: members make another call, or another split (every member).
            CollectiveTimeout: a member did not come within the group's timeout (named).
        """
        check_member(self, "split")
        self.world.split_count += 1
        members = tuple(int(r) for r in ranks)
        digest, description = creation(partition)

        def step(seq: int, deadline: float) -> Engine | None:
            same_creation(self, description, deadline)
            with watched(f"split ({self.backend} engine)", self.global_rank, self.name, self.ranks, self.timeout,
                         self.world.recorder):
                return self.engine.split(color, members, time.monotonic() + self.timeout)

        engine = self.queue.blocking("split", step, self.timeout, (digest, description))
        if engine is None:
            return None
        return ProcessGroup(engine, world=self.world, ranks=members, group_rank=engine.rank, name=name,
                            timeout=self.world.timeout)

    def progress(self) -> None:
        """Let the engine move the group's oldest outstanding collective (one cheap test).

        MPI moves a nonblocking collective's data only inside MPI calls; a caller with much
        Python work between its collectives (a backward pass marking gradients) calls this now
        and then, so that an earlier bucket's reduction goes on meanwhile.
        """
        self.queue.progress()

    def run_async(self, fn: Callable[[], Any], what: str) -> Work:
        """Run ``fn`` on this group's communication thread, after every task queued before it.

        Collectives ``fn`` calls on this group run inline there, in order; the group's calls
        from other threads wait behind it. Used by communication hooks that chain several
        collectives with computation in between.
        """
        check_member(self, what)
        # The task may allocate device memory: on this rank's GPU (the engine's, else the caller's
        # current one), not on device 0, where CUDA starts the communication thread.
        use_device = self.engine.use_device if self.engine.device is not None else keep_current_device()
        if use_device is not None:
            fn = functools.partial(_on_device, use_device, fn)
        return self.queue.thread.submit(functools.partial(self._task, what, fn), Work(f"{what} on group {self.name}"))

    def _task(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run a ``run_async`` task. One that raises may have issued only some of its collectives,
        so this rank's calls on the group no longer pair with the other ranks': the group is
        broken here (later calls raise) and the other members are told (their waits fail at once
        instead of pairing with the wrong call, or hanging)."""
        try:
            return fn()
        except BaseException as exc:
            if isinstance(exc, RankFailedError) and self.failures.failed_ranks is None:
                self.failures.failed_ranks = exc.failed_ranks  # later calls raise RankFailedError too (--survive)
            if self.failures.reason is None:
                self.failures.broken(f"{what} raised {type(exc).__name__}: {exc}", self.queue.seq)
            raise

    def abort(self, reason: str) -> None:
        """Stop using this group on this rank because of ``reason``, and tell the other members.

        For code that drives a protocol of several calls (a pipeline schedule) and fails halfway
        on one rank: the others' pending and later calls on the group fail at once with an error
        naming this rank and ``reason``, instead of waiting for the timeout for calls that will
        never come. Later calls on this rank raise too. Idempotent.
        """
        check_member(self, "abort")
        if self.failures.reason is None:
            self.failures.broken(str(reason), self.queue.seq)

    # ----------------------------------------------------------------- lifecycle
    def counts(self) -> tuple[tuple[int, ...], int]:
        """``(ranks, calls)``: what a LEFT notice says of this group: the calls issued, less those
        from the first asynchronous one not completed on (started or queued): a rank that leaves
        never completes them, so the members waiting in them must not wait for it."""
        return self.ranks, self.queue.counts()

    def finish_inflight(self, deadline: float) -> int:
        """Before this rank leaves: let its asynchronous collectives complete until ``deadline``
        (members already in them complete them within milliseconds). Returns how many are left."""
        return self.queue.finish_inflight(deadline)

    def shutdown(self) -> None:
        """Finish queued tasks and device work (within the timeout), stop the thread, release the
        engine. A group that failed was broken through :meth:`FailureState.broken`, which made an
        engine that ``abandons`` abort its communicator first (destroying an NCCL communicator
        waits for its kernels, which may wait for a missing rank forever), so its release waits
        for no one; it still frees what the engine holds of this process (the rendezvous store's
        server, whose port a next world of the same processes takes)."""
        failures, thread = self.failures, self.queue.thread
        drained = thread.drain(self.timeout)
        thread.close()
        if not drained:
            if failures.reason is None:
                failures.broken("destroyed with asynchronous work still running", self.queue.seq)
            logger.warning("meshkit: group %s destroyed with asynchronous work still queued after %.0f s",
                           self.name, self.timeout)
        if self.engine is not None and self.engine.device is not None and failures.reason is None:  # device work
            failures.waiting = self.queue.seq - 1  # notices about any call issued so far end the wait
            try:
                cast(DeviceEngine, self.engine).drain("destroy_process_group", time.monotonic() + self.timeout)
            except BaseException as exc:  # the group's device work cannot complete: abort, do not hang
                what = (f"its device work did not complete within {self.timeout:.1f} s" if isinstance(
                        exc, DeadlineExceeded) else f"its device work failed: {exc}")
                failures.broken(f"destroy_process_group: {what}", self.queue.seq)
                logger.error("meshkit: rank %d: destroying group %s (ranks %s): %s; the communicator was aborted\n%s",
                             self.global_rank, self.name, list(self.ranks), what,
                             self.world.recorder.format(self.global_rank))
        if self.engine is not None:
            with watched(f"freeing the communicator ({self.backend} engine)", self.global_rank, self.name,
                         self.ranks, self.timeout, self.world.recorder):
                self.engine.free()

    # ----------------------------------------------------------------- argument helpers
    def _root_list(self, op: str, arg: str, xs: list[np.ndarray] | None, ref: np.ndarray, root: int,
                   *, writable: bool) -> list[np.ndarray] | None:
        if self.rank == root:
            if xs is None:
                raise DistValueError(f"{where(op, self)}: {arg} is required on the root rank "
                                     f"(group rank {root})")
            return check_list(self, op, arg, xs, ref, "tensor", writable=writable)
        if xs:
            raise DistValueError(f"{where(op, self)}: {arg} must be None or empty on non-root ranks "
                                 f"(root is group rank {root}, this is group rank {self.rank})")
        return None


def _on_device(use_device: Callable[[], None], fn: Callable[[], Any]) -> Any:
    """``fn()`` with the group's GPU current (a task of ``run_async`` may run on the communication thread)."""
    use_device()
    return fn()


def _copy_rows(flat: np.ndarray, outs: list[np.ndarray]) -> Callable[[], None]:
    """Epilogue of list collectives: row i of the staging array into ``outs[i]``."""
    def copy() -> None:
        for out, row in zip(outs, flat):
            out[...] = row
    return copy
