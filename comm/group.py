"""ProcessGroup: a set of ranks that communicate together, over the engine it holds.

A :class:`ProcessGroup` is a set of global ranks (ascending; a rank's *group rank* is its
position in that tuple), a timeout and an engine (:mod:`meshkit.comm.engine`). Its public
methods take group ranks for roots and peers (the module-level functions in
:mod:`meshkit.comm.api` translate torch-style global ranks) and run every operation the same
way, synchronous or not:

1. check the arguments (:mod:`~meshkit.comm.checks`), on this rank, before anything starts;
2. number the operation (``seq``, the same on every rank since every rank issues the group's
   operations in program order) and, with ``MESHKIT_DEBUG=detail``, verify that every rank
   called the same operation (:mod:`~meshkit.comm.debug`);
3. start it with one engine call, which returns a request at once;
4. wait for it under the group's timeout, or return a :class:`~meshkit.comm.work.RequestWork`.

While a task of :meth:`ProcessGroup.run_async` is queued, later calls join the queue behind
it, so that the group's operations still start in program order.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from .arrays import is_device_array
from .checks import check_array, check_like, check_list, check_root, check_split_sizes, where
from .debug import ERROR, STATE, T_END, Call, CollectiveRecord, DebugLevel
from .engine import DeadlineExceeded, Engine, Request
from .errors import (CollectiveMismatchError, CollectiveTimeout, DistBackendError, DistError, DistTypeError,
                     DistValueError, RankFailedError)
from .notices import BROKEN, LEFT, REJECTED, WATCH_INTERVAL, Notice
from .reduce_op import ReduceOp, check_op_dtype, valid_op_dtypes
from .work import CommThread, RequestWork, Work

if TYPE_CHECKING:
    from .world import World

__all__ = ["ProcessGroup"]

logger = logging.getLogger("meshkit")

_get_ident = threading.get_ident
#: Notices are read by the waiting caller and by the progress agent's watchdog: one at a time
#: (MPI's mailbox is an iprobe then a receive, which two threads must not interleave).
_notice_lock = threading.Lock()
#: Seconds a rank whose call timed out on an engine that aborts (NCCL) listens for the members
#: that had reached the call: they were waiting in it (or their watchdog was), read its BROKEN
#: notice within WATCH_INTERVAL (10 ms) and answer with theirs; 50x that leaves room for a
#: loaded machine. It is waited in full only when some member never reached the call.
_ARRIVAL_GRACE = 0.5


class ProcessGroup:
    """A group of ranks that communicate together (torch's ``ProcessGroup``).

    Attributes:
        ranks: the global ranks of the group, ascending.
        rank: this process's rank within the group, or -1 if it is not a member.
        size: number of ranks.
        name: a readable name (``"world"``, ``"dp"``, ``"group[0, 2]"``).
        timeout: seconds every blocking call waits at most.
        engine: the engine that moves the data (None on a handle of a group this rank is not in).
    """

    def __init__(self, engine: Engine | None, *, world: World, ranks: Sequence[int], group_rank: int, name: str,
                 timeout: float) -> None:
        self.engine = engine
        self.world = world
        self.ranks: tuple[int, ...] = tuple(int(r) for r in ranks)
        self.rank = group_rank
        self.size = len(self.ranks)
        self.name = name
        self.timeout = float(timeout)
        self._seq = 0
        self._failure: str | None = None
        self._thread = CommThread(f"meshkit-comm[{name}]")
        self._flight_entry = world.recorder.record  # bound once: called on every operation
        self._group_rank_of = {g: i for i, g in enumerate(self.ranks)}
        # Decided once: in detail mode every call is fingerprinted, otherwise nothing is built.
        self._detail = world.debug >= DebugLevel.DETAIL
        # Detail mode: point-to-point messages carry a header, where the engine does not already
        # report the sender's dtype (MPI moves bytes; the local engine hands over the array).
        self._headers = self._detail and engine is not None and not getattr(engine, "reports_dtype", False)
        # Engines without a native average sum, and the group divides once (as NCCL's AVG does).
        self._divides = engine is not None and not engine.native_avg
        self._tracks = engine is not None and getattr(engine, "needs_progress", False)
        # An engine with ``abandon`` (NCCL) aborts its communicator when the group breaks: nothing
        # it started can complete afterwards, on this rank or for the other members.
        self._abandons = engine is not None and hasattr(engine, "abandon")
        # At most one collective of the group is in the engine at a time; later async calls wait in
        # this queue, in order, and start as the one before completes (see _advance). MPICH runs two
        # concurrent Iallreduce of 256 KB-4 MB 1.8-2.6x slower than the same two one after the other
        # (2 ranks, raw mpi4py; benchmarks/collectives.py --mode async), and DDP's buckets are such.
        self._inflight: collections.deque[RequestWork] = collections.deque()
        # An engine that orders its operations itself (NCCL's stream) starts each one at once.
        self._queues = engine is None or getattr(engine, "queues", True)
        self._qlock = threading.Lock()
        self._rejected: set[int] = set()  # numbers of calls this rank rejected (they did not count)
        self._waiting = 0  # the call a wait on this group is for (read by _stalled)
        if engine is not None:
            engine.watch = self._stalled

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
        return getattr(self.engine, "device", None)

    def host_name(self) -> str:
        """The name of the host this rank runs on (MPI's processor name on the mpi engine)."""
        return self.engine.host_name() if self.engine is not None else socket.gethostname()

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
            self._member("all_reduce")
        try:
            check_array(self, "all_reduce", "tensor", tensor)
            if op.__class__ is not ReduceOp or (op, tensor.dtype) not in valid_op_dtypes:  # checked once per pair
                op = check_op_dtype(op, tensor.dtype, lambda: where(self, "all_reduce"))
        except (DistValueError, DistTypeError) as exc:
            raise self._reject("all_reduce", exc)
        thread = self._thread
        if thread._pending and thread._runner != _get_ident():
            return self._behind_tasks("all_reduce", lambda: self.all_reduce(tensor, op), async_op)
        if self._detail:
            seq = self._begin("all_reduce", tensor, reduce_op=op)
        else:  # _number, inlined: this is the hottest call of all
            if self._failure is not None:
                self._unusable("all_reduce")
            seq = self._seq
            self._seq = seq + 1
        settle = self._averaged(tensor) if op is ReduceOp.AVG and self._divides else None
        if async_op:
            with self._qlock:
                if self._inflight and self._queues:  # behind an earlier collective: started when it completes
                    request, start = None, functools.partial(self.engine.all_reduce, tensor, op)
                else:
                    try:
                        request, start = self.engine.all_reduce(tensor, op), None
                    except BaseException as exc:
                        raise self._start_failed(seq, tensor, exc) from None
                record = self._flight_entry(seq, self.name, "all_reduce", (tensor.shape,), tensor.dtype,
                                            "scheduled" if request is None else "started")
                work = RequestWork(self, "all_reduce", seq, record, request, settle, self.timeout, start)
                work.queued = True
                self._inflight.append(work)
            return self._queued(work)
        if self._inflight:
            self._drain()
        try:  # posted before the flight record is written: the data moves meanwhile
            request = self.engine.all_reduce(tensor, op)
        except BaseException as exc:
            raise self._start_failed(seq, tensor, exc) from None
        record = self._flight_entry(seq, self.name, "all_reduce", (tensor.shape,), tensor.dtype, "started")
        return self._complete("all_reduce", seq, record, request, settle)

    def _start_failed(self, seq: int, tensor: np.ndarray, exc: BaseException) -> BaseException:
        """all_reduce's engine call raised before its record existed: record it and fail as
        :meth:`_run` does for every other operation (a RankFailedError breaks the group)."""
        record = self._flight_entry(seq, self.name, "all_reduce", (tensor.shape,), tensor.dtype, "started")
        return self._failed("all_reduce", seq, record, exc, self.timeout)

    def reduce(self, tensor: np.ndarray, root: int, op: ReduceOp = ReduceOp.SUM, *,
               async_op: bool = False) -> Work | None:
        """Reduce ``tensor`` over the group into group rank ``root``'s ``tensor``.

        The other ranks' ``tensor`` keeps its contents.
        """
        self._member("reduce")
        try:
            check_array(self, "reduce", "tensor", tensor)
            root = check_root(self, "reduce", "dst", root)
            op = check_op_dtype(op, tensor.dtype, lambda: where(self, "reduce"))
        except (DistValueError, DistTypeError) as exc:
            raise self._reject("reduce", exc)
        settle = self._averaged(tensor) if op is ReduceOp.AVG and self._divides and self.rank == root else None
        return self._run("reduce", lambda: self.engine.reduce(tensor, op, root), async_op, (tensor.shape,),
                         tensor, settle, reduce_op=op, root=root)

    def broadcast(self, tensor: np.ndarray, root: int, *, async_op: bool = False) -> Work | None:
        """Copy group rank ``root``'s ``tensor`` into every rank's ``tensor``."""
        self._member("broadcast")
        try:
            check_array(self, "broadcast", "tensor", tensor)
            root = check_root(self, "broadcast", "src", root)
        except (DistValueError, DistTypeError) as exc:
            raise self._reject("broadcast", exc)
        return self._run("broadcast", lambda: self.engine.broadcast(tensor, root), async_op, (tensor.shape,),
                         tensor, None, root=root)

    def all_gather_into_tensor(self, output: np.ndarray, input: np.ndarray, *,
                               async_op: bool = False) -> Work | None:
        """Concatenate every rank's ``input`` into ``output`` (``size`` times as many elements).

        ``input`` may be the rank's own chunk of ``output`` (a view), which gathers in place.
        """
        name = "all_gather_into_tensor"
        self._member(name)
        try:
            check_array(self, name, "input", input, writable=False)
            check_array(self, name, "output", output)
            check_like(self, name, "output", output, input, "input", size=input.size * self.size)
        except (DistValueError, DistTypeError) as exc:
            raise self._reject(name, exc)
        return self._run(name, lambda: self.engine.all_gather(output, input), async_op,
                         (input.shape, output.shape), input, None)

    def all_gather(self, tensor_list: list[np.ndarray], tensor: np.ndarray, *,
                   async_op: bool = False) -> Work | None:
        """Gather every rank's ``tensor`` into ``tensor_list[rank]`` on every rank."""
        self._member("all_gather")
        try:
            check_array(self, "all_gather", "tensor", tensor, writable=False)
            outs = check_list(self, "all_gather", "tensor_list", tensor_list, tensor, "tensor", writable=True)
        except (DistValueError, DistTypeError) as exc:
            raise self._reject("all_gather", exc)
        flat = np.empty_like(tensor, shape=(self.size,) + tensor.shape)  # on the tensor's device
        return self._run("all_gather", lambda: self.engine.all_gather(flat, tensor), async_op, (tensor.shape,),
                         tensor, _copy_rows(flat, outs))

    def reduce_scatter_tensor(self, output: np.ndarray, input: np.ndarray, op: ReduceOp = ReduceOp.SUM,
                              *, async_op: bool = False) -> Work | None:
        """Reduce ``input`` (``size`` chunks) over the group; rank r receives reduced chunk r."""
        name = "reduce_scatter_tensor"
        self._member(name)
        try:
            check_array(self, name, "input", input, writable=False)
            check_array(self, name, "output", output)
            check_like(self, name, "input", input, output, "output", size=output.size * self.size)
            op = check_op_dtype(op, input.dtype, lambda: where(self, name))
        except (DistValueError, DistTypeError) as exc:
            raise self._reject(name, exc)
        settle = self._averaged(output) if op is ReduceOp.AVG and self._divides else None
        return self._run(name, lambda: self.engine.reduce_scatter(output, input, op), async_op,
                         (input.shape, output.shape), input, settle, reduce_op=op)

    def reduce_scatter(self, output: np.ndarray, input_list: list[np.ndarray], op: ReduceOp = ReduceOp.SUM,
                       *, async_op: bool = False) -> Work | None:
        """Reduce ``input_list[r]`` over the group into rank r's ``output``."""
        self._member("reduce_scatter")
        try:
            check_array(self, "reduce_scatter", "output", output)
            ins = check_list(self, "reduce_scatter", "input_list", input_list, output, "output", writable=False)
            op = check_op_dtype(op, output.dtype, lambda: where(self, "reduce_scatter"))
        except (DistValueError, DistTypeError) as exc:
            raise self._reject("reduce_scatter", exc)
        settle = self._averaged(output) if op is ReduceOp.AVG and self._divides else None
        stacked = np.stack(ins)
        return self._run("reduce_scatter", lambda: self.engine.reduce_scatter(output, stacked, op), async_op,
                         (output.shape,), output, settle, reduce_op=op)

    def gather(self, tensor: np.ndarray, gather_list: list[np.ndarray] | None, root: int, *,
               async_op: bool = False) -> Work | None:
        """Gather every rank's ``tensor`` into ``gather_list`` on group rank ``root``."""
        self._member("gather")
        try:
            check_array(self, "gather", "tensor", tensor, writable=False)
            root = check_root(self, "gather", "dst", root)
            outs = self._root_list("gather", "gather_list", gather_list, tensor, root, writable=True)
        except (DistValueError, DistTypeError) as exc:
            raise self._reject("gather", exc)
        flat = np.empty_like(tensor, shape=(self.size,) + tensor.shape) if outs is not None else None
        return self._run("gather", lambda: self.engine.gather(flat, tensor, root), async_op, (tensor.shape,),
                         tensor, None if outs is None else _copy_rows(flat, outs), root=root)

    def scatter(self, tensor: np.ndarray, scatter_list: list[np.ndarray] | None, root: int, *,
                async_op: bool = False) -> Work | None:
        """Send ``scatter_list[r]`` from group rank ``root`` into rank r's ``tensor``."""
        self._member("scatter")
        try:
            check_array(self, "scatter", "tensor", tensor)
            root = check_root(self, "scatter", "src", root)
            ins = self._root_list("scatter", "scatter_list", scatter_list, tensor, root, writable=False)
        except (DistValueError, DistTypeError) as exc:
            raise self._reject("scatter", exc)
        stacked = np.stack(ins) if ins is not None else None
        return self._run("scatter", lambda: self.engine.scatter(tensor, stacked, root), async_op, (tensor.shape,),
                         tensor, None, root=root)

    def all_to_all_single(self, output: np.ndarray, input: np.ndarray,
                          output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None, *,
                          async_op: bool = False) -> Work | None:
        """Split ``input`` along dim 0, send part j to rank j; receive into ``output`` in rank order.

        Split sizes count rows of dim 0; None means equal parts. No copies are made.
        """
        name = "all_to_all_single"
        self._member(name)
        try:
            check_array(self, name, "input", input, writable=False)
            check_array(self, name, "output", output)
            check_like(self, name, "output", output, input, "input")
            if input.ndim == 0 or output.ndim == 0 or input.shape[1:] != output.shape[1:]:
                raise DistValueError(f"{where(self, name)}: input {input.shape} and output {output.shape} must be "
                                     "at least 1-D with the same shape after dim 0")
            row = input.size // input.shape[0] if input.shape[0] else math.prod(input.shape[1:])
            send = [s * row for s in check_split_sizes(self, name, "input_split_sizes", input_split_sizes,
                                                       input.shape[0])]
            recv = [s * row for s in check_split_sizes(self, name, "output_split_sizes", output_split_sizes,
                                                       output.shape[0])]
        except (DistValueError, DistTypeError) as exc:
            raise self._reject(name, exc)
        return self._run(name, lambda: self.engine.all_to_all(output, recv, input, send), async_op,
                         (input.shape, output.shape), None, None, dtype=input.dtype, counts=(tuple(send), tuple(recv)))

    def all_to_all(self, output_list: list[np.ndarray], input_list: list[np.ndarray], *,
                   async_op: bool = False) -> Work | None:
        """Send ``input_list[j]`` to rank j; receive rank j's array into ``output_list[j]``."""
        self._member("all_to_all")
        try:
            if not isinstance(input_list, (list, tuple)) or not input_list:
                raise DistValueError(f"{where(self, 'all_to_all')}: input_list must be a list of {self.size} arrays")
            check_array(self, "all_to_all", "input_list[0]", input_list[0], writable=False)
            ref = input_list[0]
            ins = check_list(self, "all_to_all", "input_list", input_list, ref, "input_list[0]", writable=False,
                             same_shape=False)
            outs = check_list(self, "all_to_all", "output_list", output_list, ref, "input_list[0]", writable=True,
                              same_shape=False)
        except (DistValueError, DistTypeError) as exc:
            raise self._reject("all_to_all", exc)
        send = [x.size for x in ins]
        recv = [x.size for x in outs]
        flat_in = np.concatenate([x.ravel() for x in ins])
        flat_out = np.empty_like(ref, shape=(sum(recv),))

        def settle() -> None:
            start = 0
            for out, n in zip(outs, recv):
                out.reshape(-1)[...] = flat_out[start:start + n]
                start += n

        return self._run("all_to_all", lambda: self.engine.all_to_all(flat_out, recv, flat_in, send), async_op,
                         tuple(x.shape for x in ins), None, settle, dtype=ref.dtype,
                         counts=(tuple(send), tuple(recv)))

    def barrier(self, *, async_op: bool = False) -> Work | None:
        """Block until every rank of the group has reached the barrier."""
        self._member("barrier")
        return self._run("barrier", self.engine.barrier, async_op, (), None, None)

    def monitored_barrier(self, timeout: float | None = None) -> None:
        """A barrier that names every rank that did not arrive within ``timeout`` seconds.

        Group rank 0 collects an arrival message from each rank and answers all of them, so a
        rank that never arrives is known and reported (torch's gloo ``monitored_barrier``, but
        naming all missing ranks, not only the first).
        """
        self._member("monitored_barrier")
        limit = self.timeout if timeout is None else float(timeout)
        self._blocking("monitored_barrier", lambda seq, d: self.engine.exchange(None, seq, d), limit)

    def split(self, color: int | None, *, ranks: Sequence[int], name: str) -> ProcessGroup | None:
        """Collective over this group: ranks passing the same ``color`` form a new group.

        Args:
            color: this rank's new group id, or None to take part without joining any.
            ranks: the global ranks of this rank's new group (ascending), known to the caller
                from the layout; the engine checks that it agrees.
            name: name of the new group.

        Returns:
            The new group, or None where ``color`` is None.
        """
        self._member("split")
        self.world.split_count += 1
        members = tuple(int(r) for r in ranks)
        engine = self._blocking("split", lambda seq, d: self.engine.split(color, members, d), self.timeout)
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
        inflight = self._inflight
        if inflight:
            head = inflight[0]
            if not head._finished:
                head.poll(block=False)

    def run_async(self, fn: Callable[[], Any], what: str) -> Work:
        """Run ``fn`` on this group's communication thread, after every task queued before it.

        Collectives ``fn`` calls on this group run inline there, in order; the group's calls
        from other threads wait behind it. Used by communication hooks that chain several
        collectives with computation in between.
        """
        self._member(what)
        use_device = getattr(self.engine, "use_device", None)
        if use_device is not None:  # the task may allocate device memory: on this rank's GPU, not device 0
            fn = functools.partial(_on_device, use_device, fn)
        return self._thread.submit(functools.partial(self._task, what, fn), Work(f"{what} on group {self.name}"))

    def _task(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run a ``run_async`` task. One that raises may have issued only some of its collectives,
        so this rank's calls on the group no longer pair with the other ranks': the group is
        broken here (later calls raise) and the other members are told (their waits fail at once
        instead of pairing with the wrong call, or hanging)."""
        try:
            return fn()
        except BaseException as exc:
            if self._failure is None:
                self._broken(f"{what} raised {type(exc).__name__}: {exc}", self._seq)
            raise

    def abort(self, reason: str) -> None:
        """Stop using this group on this rank because of ``reason``, and tell the other members.

        For code that drives a protocol of several calls (a pipeline schedule) and fails halfway
        on one rank: the others' pending and later calls on the group fail at once with an error
        naming this rank and ``reason``, instead of waiting for the timeout for calls that will
        never come. Later calls on this rank raise too. Idempotent.
        """
        self._member("abort")
        if self._failure is None:
            self._broken(str(reason), self._seq)

    # ----------------------------------------------------------------- point to point
    def isend(self, tensor: np.ndarray, dst: int, tag: int = 0) -> Work:
        """Start sending ``tensor`` to group rank ``dst``; the Work completes when it may be reused."""
        self._member("isend")
        if self._failure is not None:  # a broken group's traffic fails on every member
            self._unusable("isend")
        check_array(self, "isend", "tensor", tensor, writable=False)
        dst = check_root(self, "isend", "dst", dst)
        self._check_tag("isend", tag)
        what = f"send to rank {self.ranks[dst]} tag {tag}"
        record = self._flight_entry(-1, self.name, "send", (tensor.shape,), tensor.dtype, "started")
        if self._headers and not is_device_array(tensor):
            # A host message carries its dtype and size, checked by the receiver (device messages
            # go over NCCL, which checks counts itself).
            staged = _with_header(tensor)
            keep = functools.partial(_keep_alive, staged)  # the Work holds the staged buffer until sent
            return self._p2p_work(what, self.engine.send(staged, dst, tag), record, dst, keep)
        request = self.engine.send(tensor, dst, tag)
        return self._p2p_work(what, request, record, dst, None)

    def irecv(self, tensor: np.ndarray, src: int | None = None, tag: int = 0) -> Work:
        """Start receiving into ``tensor`` from group rank ``src`` (None: any rank).

        ``Work.result()`` is the sender's global rank once the Work completed. A message of
        another size (or, on the local engine, dtype) than ``tensor`` is an error raised by ``wait``
        (on MPI a shorter message has been written into the start of ``tensor`` by then).
        """
        self._member("irecv")
        if self._failure is not None:  # a broken group's traffic fails on every member
            self._unusable("irecv")
        check_array(self, "irecv", "tensor", tensor)
        if src is not None:
            src = check_root(self, "irecv", "src", src)
        self._check_tag("irecv", tag)
        peer = "any rank" if src is None else f"rank {self.ranks[src]}"
        record = self._flight_entry(-1, self.name, "recv", (tensor.shape,), tensor.dtype, "started")
        staged = (np.empty(_HEADER + tensor.nbytes, np.uint8)
                  if self._headers and not is_device_array(tensor) else None)
        request = self.engine.recv(tensor if staged is None else staged, src, tag)

        def settle() -> int:
            count, source = request.count, request.source
            dtype = getattr(request, "dtype", None)  # engines that know the sender's dtype check it
            if staged is not None:
                dtype, count = _read_header(staged, count)
                if dtype == tensor.dtype and count == tensor.size:
                    tensor.reshape(-1).view(np.uint8)[...] = staged[_HEADER:]
            if dtype is not None and dtype != tensor.dtype:
                raise DistTypeError(f"{where(self, 'recv')}: recv buffer has dtype {tensor.dtype} but the message "
                                    f"from group rank {source} has dtype {dtype}; receive into a buffer of the "
                                    "dtype that was sent")
            if count != tensor.size:
                got = ("more elements than fit" if count < 0 else f"{count}" if isinstance(count, int) else
                       f"{count:g} (its bytes do not divide into {tensor.dtype} elements)")
                raise DistValueError(f"{where(self, 'recv')}: recv buffer has {tensor.size} elements but the "
                                     f"message from group rank {source} has {got}; receive into a buffer of the "
                                     "size that was sent")
            return self.ranks[source]

        return self._p2p_work(f"recv from {peer} tag {tag}", request, record, src, settle)

    def _p2p_work(self, what: str, request: Request, record: CollectiveRecord, peer: int | None,
                  settle: Callable[[], Any] | None) -> Work:
        work = _P2PWork(self, what, -1, record, request, settle, self.timeout)
        work.peer = peer
        if self._tracks:
            self.world.progress.track(work)
        if getattr(request, "watchdog", False):
            self.world.progress.watchdog(work)
        return work

    def _check_tag(self, op: str, tag: int) -> None:
        if not isinstance(tag, (int, np.integer)) or not 0 <= tag <= self.max_tag:
            raise DistValueError(f"{where(self, op)}: tag={tag!r} is out of range (valid: 0..{self.max_tag})")

    # ----------------------------------------------------------------- execution
    def _number(self, op: str) -> int:
        """The next operation number; DistError if the group failed before."""
        if self._failure is not None:
            self._unusable(op)
        seq = self._seq
        self._seq = seq + 1
        return seq

    def _begin(self, op: str, tensor: np.ndarray | None, **fingerprint: Any) -> int:
        """Detail mode: number the operation and verify every rank called the same one."""
        seq = self._number(op)
        call = self._call(op, tensor, **fingerprint)
        try:
            self._verify(call, seq, time.monotonic() + self.timeout)
        except BaseException as exc:
            record = self._flight_entry(seq, self.name, op, (), call.dtype, "started")
            raise self._failed(op, seq, record, exc, self.timeout) from None
        return seq

    def _run(self, op: str, start: Callable[[], Request], async_op: bool, shapes: tuple, ref: np.ndarray | None,
             settle: Callable[[], Any] | None, **fingerprint: Any) -> Work | None:
        """Start an operation by ``start()`` (one engine call) and complete it (see the module docstring)."""
        thread = self._thread
        if thread._pending and thread._runner != _get_ident():
            return self._behind_tasks(op, lambda: self._run(op, start, False, shapes, ref, settle, **fingerprint),
                                      async_op)
        seq = self._begin(op, ref, **fingerprint) if self._detail else self._number(op)
        dtype = ref.dtype if ref is not None else fingerprint.get("dtype")
        if async_op:
            with self._qlock:
                queued = self._queues and bool(self._inflight)
                record = self._flight_entry(seq, self.name, op, shapes, dtype, "scheduled" if queued else "started")
                try:
                    request = None if queued else start()
                except BaseException as exc:
                    raise self._failed(op, seq, record, exc, self.timeout) from None
                work = RequestWork(self, op, seq, record, request, settle, self.timeout, start if queued else None)
                work.queued = True
                self._inflight.append(work)
            return self._queued(work)
        if self._inflight:
            self._drain()
        record = self._flight_entry(seq, self.name, op, shapes, dtype, "started")
        try:
            request = start()
        except BaseException as exc:
            raise self._failed(op, seq, record, exc, self.timeout) from None
        return self._complete(op, seq, record, request, settle)

    def _complete(self, op: str, seq: int, record: CollectiveRecord, request: Request,
                  settle: Callable[[], Any] | None) -> None:
        """Wait for a started synchronous operation under the group's timeout."""
        try:
            if not request.Test():
                self._block(request, time.monotonic() + self.timeout, seq)
            if settle is not None:
                settle()
        except BaseException as exc:
            raise self._failed(op, seq, record, exc, self.timeout) from None
        record[STATE], record[T_END] = "completed", time.time()
        return None

    def _block(self, request: Request, deadline: float, seq: int) -> None:
        """Block on ``request`` (call #``seq``) until it completes: the engine's wait, which reads
        notices for call ``seq`` while it stalls; the progress agent stands back meanwhile (this
        caller drives MPI)."""
        self._waiting = seq
        waiting, me = self.world.progress.waiting, _get_ident()
        waiting.add(me)
        try:
            self.engine.wait(request, deadline)
        finally:
            waiting.discard(me)

    def _queued(self, work: RequestWork) -> RequestWork:
        """An async collective just queued: keep it moving (the agent), and test the one ahead of
        it once (which starts it if that one has completed)."""
        if self._tracks:
            self.world.progress.track(work)
        if getattr(work._request, "watchdog", False):  # device work: watched until done (see RequestWork.watchdog)
            self.world.progress.watchdog(work)
        if work._request is None:
            head = self._inflight[0] if self._inflight else None
            if head is not None and head is not work:
                head.poll(block=False)
        return work

    def _advance(self, done: RequestWork) -> None:
        """``done`` finished: start the next queued collective (failing queued ones the group can
        no longer run). Called by whichever thread finished it (a waiter or the progress agent)."""
        with self._qlock:
            queue = self._inflight
            if queue and queue[0] is done:
                queue.popleft()
            elif done in queue:
                queue.remove(done)
            while queue and queue[0]._request is None and not queue[0]._finished:
                nxt = queue[0]
                try:
                    if self._failure is not None:
                        self._unusable(nxt._op)
                    nxt.start()
                    return
                except BaseException as exc:  # it cannot start: it fails, and the next one is tried
                    queue.popleft()
                    nxt._result, nxt._error = None, self._work_failed(nxt, exc)
                    nxt._finished = True

    def _wait_before(self, work: RequestWork, deadline: float | None) -> None:
        """Wait for the collectives queued ahead of ``work`` until it has started (or failed)."""
        while work._request is None and not work._finished:
            with self._qlock:
                head = self._inflight[0] if self._inflight else None
            if head is None or head is work:
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise CollectiveTimeout(f"meshkit.comm: {work._what} did not start within Work.wait(timeout=...): "
                                        "the collectives of its group issued before it are still running",
                                        op=work._op)
            try:
                head.wait(left)
            except CollectiveTimeout as exc:
                if deadline is not None and time.monotonic() >= deadline:
                    raise CollectiveTimeout(f"meshkit.comm: {work._what} did not start within Work.wait(timeout="
                                            "...): the collectives of its group issued before it are still "
                                            "running", op=work._op) from exc
            except BaseException:  # the earlier one's own error is its waiter's; ours comes from _advance
                pass

    def _drain(self) -> None:
        """Before a synchronous collective: every queued one completes first (in program order)."""
        while self._inflight:
            last = self._inflight[-1]
            try:
                last.wait()
            except BaseException:  # that Work's error is raised by its own wait()
                pass

    def _work_failed(self, work: RequestWork, exc: BaseException) -> BaseException:
        """A Work of this group failed: record it; the error its waiters raise."""
        if isinstance(work, _P2PWork):
            return work.error(exc)
        return self._failed(work._op, work._seq, work._record, exc, self.timeout)

    def _watchdog_failed(self, work: RequestWork, exc: BaseException) -> BaseException:
        """The watchdog found ``work``'s device operation failed or past its deadline, possibly
        after its ``Work.wait()`` returned (which only ordered the caller's stream): it fails as
        a waiter's would, the group breaks (the communicator is aborted, the others are told; the
        next call raises), and the error is logged with the flight record, since no caller may
        be there to raise it."""
        error = self._work_failed(work, exc)
        if self._failure is None:
            self._broken(f"{work._op} #{work._seq} failed: {error}", work._seq)
        if not (isinstance(exc, DeadlineExceeded) and work._seq >= 0):  # _failed logged a collective's timeout
            logger.error("%s\n%s", error, self.world.recorder.format(self.global_rank))
        return error

    def _blocking(self, op: str, step: Callable[[int, float], Any], timeout: float) -> Any:
        """Run a blocking engine step ``step(seq, deadline)`` as operation ``op`` (split, monitored
        barrier): numbered, recorded and ordered like every other operation."""
        thread = self._thread
        if thread._pending and thread._runner != _get_ident():
            return thread.run_in_order(lambda: self._blocking(op, step, timeout), op)
        seq = self._begin(op, None) if self._detail and op == "split" else self._number(op)
        if self._inflight:
            self._drain()
        record = self._flight_entry(seq, self.name, op, (), None, "started")
        try:
            result = step(seq, time.monotonic() + timeout)
        except BaseException as exc:
            raise self._failed(op, seq, record, exc, timeout) from None
        record[STATE], record[T_END] = "completed", time.time()
        return result

    def _behind_tasks(self, op: str, call: Callable[[], Any], async_op: bool) -> Work | None:
        """A call made while ``run_async`` tasks are queued: it runs after them, in order."""
        if async_op:
            return self._thread.submit(call, Work(f"{op} on group {self.name}"))
        self._thread.run_in_order(call, op)
        return None

    def _averaged(self, buf: np.ndarray) -> Callable[[], None]:
        """AVG on an engine without it: the engine sums, then one division by the group size.

        For a power-of-two size and a real floating dtype the division is a multiplication by
        ``1 / size``: bit for bit the same (both are the correctly rounded ``x * 2**-k``) and
        1.6-1.7x faster (1 MB float32: 28 -> 16 us, 3 MB: 82 -> 51 us, timeit on this VM).
        """
        size = self.size
        if size & (size - 1) == 0 and buf.dtype.kind == "f":
            return functools.partial(_scale, buf, 1.0 / size)
        return functools.partial(_divide, buf, size)

    def _failed(self, op: str, seq: int, record: CollectiveRecord, exc: BaseException,
                timeout: float) -> BaseException:
        """Record how operation ``seq`` failed; return the error to raise (a timeout becomes a
        :class:`CollectiveTimeout` and makes the group unusable; anything else is re-raised)."""
        record[T_END] = time.time()
        if isinstance(exc, DeadlineExceeded):
            record[STATE] = "timed_out"
            self._broken(f"{op} #{seq} timed out", seq, timed_out=True)
            if self._abandons:
                exc.detail = f"{exc.detail}; the communicator was aborted" if exc.detail else \
                    "the communicator was aborted"
                if exc.missing is None and seq >= 0:
                    exc.missing = self._not_arrived(seq)
            error = self._timeout_error(op, seq, timeout, exc)
            record[ERROR] = str(error)
            logger.error("%s\n%s", error, self.world.recorder.format(self.global_rank))
            return error
        record[STATE], record[ERROR] = "failed", repr(exc)
        # A peer's failure breaks the group; on an engine that aborts (NCCL), so does its own
        # failure (an asynchronous NCCL error aborted the communicator): the others are told.
        if self._failure is None and (isinstance(exc, RankFailedError)
                                      or (self._abandons and isinstance(exc, DistBackendError))):
            self._broken(f"{op} #{seq} failed: {exc}", seq)
        if isinstance(exc, CollectiveMismatchError):
            logger.error("%s\n%s", exc, self.world.recorder.format(self.global_rank))
        return exc

    def _broken(self, why: str, seq: int, *, timed_out: bool = False) -> None:
        """This rank stops using the group at call ``seq``; the other members are told (after the
        engine, if it can, aborted what it had started: an NCCL kernel would otherwise wait for
        the missing ranks forever)."""
        self._failure = why
        if self._abandons:
            self.engine.abandon(why)
        self._tell(Notice(BROKEN, self.global_rank, self.ranks, seq, why, timed_out=timed_out))

    def _tell(self, notice: Notice) -> None:
        others = [r for r in self.ranks if r != self.global_rank]
        if others and self.engine is not None:
            try:
                self.engine.notify(others, notice)
            except Exception:  # telling is best effort: the caller's own error matters more
                logger.debug("meshkit: rank %d could not send %s", self.global_rank, notice, exc_info=True)

    def _reject(self, op: str, exc: BaseException) -> BaseException:
        """``op``'s arguments were rejected on this rank. As in torch the call does not count, but
        the members that did start it are told, so that they fail instead of waiting for the
        timeout (unless this rank starts the call, corrected, soon after)."""
        if self.rank >= 0 and self._failure is None and not self.world.destroyed:
            seq = self._seq
            self._rejected.add(seq)
            record = self._flight_entry(seq, self.name, op, (), None, "rejected")
            record[ERROR] = str(exc)
            self._tell(Notice(REJECTED, self.global_rank, self.ranks, seq, f"{type(exc).__name__}: {exc}"))
        return exc

    def _stalled(self) -> None:
        """Called while a wait on this group lasts: raise if a notice shows it is in vain."""
        self._check_notices(self._waiting)

    def _read_notices(self) -> list[Notice]:
        """Every notice this rank received so far (new ones read from the engine)."""
        world = self.world
        with _notice_lock:
            world.notices.extend(self.engine.notices())
        return world.notices

    def _check_notices(self, seq: int) -> None:
        """RankFailedError if a notice shows that call #``seq`` (-1: a send or receive) cannot complete."""
        for notice in self._read_notices():
            if notice.blocks(self.ranks, seq, self._rejected, aborts=self._abandons):
                what = f"call #{seq}" if seq >= 0 else "a send or receive"
                raise RankFailedError(f"meshkit.comm: rank {self.global_rank}: {what} on group "
                                      f"{self.name} (ranks {list(self.ranks)}) cannot complete: "
                                      f"{notice.describe(self.name, p2p=self._waiting < 0)}")

    def _not_arrived(self, seq: int) -> list[int]:
        """The members that never reached call #``seq``, which timed out here (engines that abort).

        This rank has told the others (a BROKEN notice) and aborted its communicator, so every
        member waiting in call ``seq`` or a later one fails at once and tells the others in turn
        (see :meth:`Notice.blocks`); a member that never issued the call is not waiting in it and
        stays silent. So the members not heard from within ``_ARRIVAL_GRACE`` did not arrive.
        """
        others = set(self.ranks) - {self.global_rank}
        deadline = time.monotonic() + _ARRIVAL_GRACE
        while True:
            missing = others - {n.sender for n in self._read_notices() if n.reached(self.ranks, seq)}
            if not missing or time.monotonic() >= deadline:
                return sorted(missing)
            time.sleep(WATCH_INTERVAL)

    def counts(self) -> tuple[tuple[int, ...], int]:
        """``(ranks, calls issued)``: what a LEFT notice says of this group."""
        return self.ranks, self._seq

    def _timeout_error(self, op: str, seq: int, timeout: float, exc: DeadlineExceeded) -> CollectiveTimeout:
        head = (f"meshkit.comm: rank {self.global_rank}: {op} #{seq} on group {self.name} "
                f"(ranks {list(self.ranks)}) timed out after {timeout:.1f} s")
        if exc.missing:
            who = f"ranks that did not arrive: {sorted(exc.missing)}"
        elif exc.missing is not None:
            who = ("every rank reached the call; they may have called different collectives or "
                   "counts (run with MESHKIT_DEBUG=detail to check every call)")
        else:
            who = (f"the {self.backend} engine cannot tell which ranks did not arrive; run with "
                   "MESHKIT_DEBUG=detail to check arrivals before every collective, or use monitored_barrier")
        detail = f" ({exc.detail})" if exc.detail else ""
        return CollectiveTimeout(f"{head}; {who}{detail}", op=op, group=self.name, seq=seq, missing=exc.missing)

    def _verify(self, call: Call, seq: int, deadline: float) -> None:
        """Detail mode: every rank must have called the same collective (see debug.Call)."""
        self._waiting = seq  # a rank that rejected this very call is named at once (notices)
        entries = self.engine.exchange((seq, call), seq, deadline, watched=True)
        calls = [c for _, c in entries]
        if all(s == seq for s, _ in entries) and call.agrees(calls):
            return
        described = {self.ranks[i]: f"{c} #{s}" for i, (s, c) in enumerate(entries)}
        lines = "; ".join(f"rank {r}: {d}" for r, d in described.items())
        raise CollectiveMismatchError(
            f"meshkit.comm: rank {self.global_rank}: collective mismatch on group {self.name} at #{seq}: "
            f"{lines}", calls=described)

    def shutdown(self) -> None:
        """Finish queued tasks and device work (within the timeout), stop the thread, release the
        engine (not one that failed: destroying an NCCL communicator waits for its kernels, which
        may wait for a missing rank forever; the group aborted it instead)."""
        drained = self._thread.drain(self.timeout)
        self._thread.close()
        if not drained:
            self._failure = self._failure or "destroyed with asynchronous work still running"
            logger.warning("meshkit: group %s destroyed with asynchronous work still queued after %.0f s",
                           self.name, self.timeout)
        drain = getattr(self.engine, "drain", None)
        if drain is not None and self._failure is None:
            self._waiting = self._seq - 1  # notices about any call issued so far end the wait
            try:
                drain("destroy_process_group", time.monotonic() + self.timeout)
            except BaseException as exc:  # the group's device work cannot complete: abort, do not hang
                what = (f"its device work did not complete within {self.timeout:.1f} s" if isinstance(
                        exc, DeadlineExceeded) else f"its device work failed: {exc}")
                self._broken(f"destroy_process_group: {what}", self._seq)
                logger.error("meshkit: rank %d: destroying group %s (ranks %s): %s; the communicator was aborted\n%s",
                             self.global_rank, self.name, list(self.ranks), what,
                             self.world.recorder.format(self.global_rank))
        if self.engine is not None and self._failure is None:
            self.engine.free()

    # ----------------------------------------------------------------- argument helpers
    def _member(self, op: str) -> None:
        if self.rank < 0:
            raise DistValueError(
                f"{where(self, op)}: this rank is not a member of group {self.name} "
                f"(ranks {list(self.ranks)}); only members may call collectives on it")
        if self.world.destroyed:
            raise DistError(f"{where(self, op)}: the process group was destroyed; call "
                            "init_process_group() again first")

    def _unusable(self, op: str) -> None:
        raise DistError(f"{where(self, op)}: group {self.name} is unusable after an earlier failure: "
                        f"{self._failure}")

    def _root_list(self, op: str, arg: str, xs: list[np.ndarray] | None, ref: np.ndarray, root: int,
                   *, writable: bool) -> list[np.ndarray] | None:
        if self.rank == root:
            if xs is None:
                raise DistValueError(f"{where(self, op)}: {arg} is required on the root rank "
                                     f"(group rank {root})")
            return check_list(self, op, arg, xs, ref, "tensor", writable=writable)
        if xs:
            raise DistValueError(f"{where(self, op)}: {arg} must be None or empty on non-root ranks "
                                 f"(root is group rank {root}, this is group rank {self.rank})")
        return None

    def _call(self, name: str, tensor: np.ndarray | None, *, dtype: np.dtype | None = None,
              reduce_op: ReduceOp | None = None, root: int | None = None,
              counts: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> Call:
        """The fingerprint compared across ranks in detail mode."""
        if tensor is not None:
            dtype = tensor.dtype
        return Call(name, None if dtype is None else str(dtype), None if tensor is None else tuple(tensor.shape),
                    None if reduce_op is None else reduce_op.name, root, counts)


class _P2PWork(RequestWork):
    """Work of a send or receive; a timeout names the peer that did not take part."""

    __slots__ = ("peer",)

    def error(self, exc: BaseException) -> BaseException:
        group, record = self._owner_group, self._record
        record[T_END] = time.time()
        if not isinstance(exc, DeadlineExceeded):
            record[STATE], record[ERROR] = "failed", repr(exc)
            return exc
        record[STATE] = "timed_out"
        who = "any rank" if self.peer is None else f"rank {group.ranks[self.peer]}"
        side = "post a matching send" if self._op.startswith("recv") else "receive it"
        return CollectiveTimeout(
            f"meshkit.comm: rank {group.global_rank}: {self._op} on group {group.name} did not complete "
            f"within {group.timeout:.1f} s: {who} did not {side}", op=self._op.split()[0], group=group.name,
            missing=None if self.peer is None else [group.ranks[self.peer]])

    @property
    def _what(self) -> str:
        return self._op


#: Bytes before a point-to-point message's data in detail mode: its dtype (numpy's ``dtype.str``,
#: padded) and its element count, so that the receiver checks both (MPI carries neither).
_HEADER = 24


def _with_header(tensor: np.ndarray) -> np.ndarray:
    staged = np.empty(_HEADER + tensor.nbytes, np.uint8)
    staged[:16] = np.frombuffer(tensor.dtype.str.encode().ljust(16), np.uint8)
    staged[16:24] = np.array([tensor.size], np.int64).view(np.uint8)
    staged[_HEADER:] = tensor.reshape(-1).view(np.uint8)
    return staged


def _read_header(staged: np.ndarray, count: Any) -> tuple[np.dtype | None, Any]:
    """``(dtype, elements)`` a detail-mode message announced; its count as received if it did not fit."""
    if not isinstance(count, int) or count < _HEADER:
        return None, -1 if count == -1 else count
    return np.dtype(bytes(staged[:16]).decode().strip()), int(staged[16:24].view(np.int64)[0])


def _on_device(use_device: Callable[[], None], fn: Callable[[], Any]) -> Any:
    """``fn()`` with the group's GPU current (a task of ``run_async`` may run on the communication thread)."""
    use_device()
    return fn()


def _keep_alive(buffer: np.ndarray) -> None:
    """Epilogue that only refers to ``buffer``, so that it outlives the operation reading it."""


def _divide(buf: np.ndarray, n: int) -> None:
    buf /= n


def _scale(buf: np.ndarray, factor: float) -> None:
    buf *= factor


def _copy_rows(flat: np.ndarray, outs: list[np.ndarray]) -> Callable[[], None]:
    """Epilogue of list collectives: row i of the staging array into ``outs[i]``."""
    def copy() -> None:
        for out, row in zip(outs, flat):
            out[...] = row
    return copy
