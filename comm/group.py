"""The process group's public operations: argument checks, then the engine, in order.

A :class:`ProcessGroup` is a set of global ranks (ascending; a rank's *group rank* is its
position in that tuple) with a timeout and one communication thread. Its public methods take
group ranks for roots and peers (the module-level functions in :mod:`meshkit.comm.api`
translate torch-style global ranks), check every argument, and hand a step to the machinery
of :class:`~meshkit.comm.engine.GroupBase`, which numbers, records, times and orders it. Engines
(``local``, ``mpi``) subclass ProcessGroup and implement the ``_e_*`` methods declared there.
"""

from __future__ import annotations

import math
import socket
import time
from typing import Sequence

import numpy as np

from .checks import check_array, check_like, check_list, check_root, check_split_sizes, where
from .debug import STATE, T_END, Call, CollectiveRecord
from .engine import GroupBase, P2PHandle
from .errors import CollectiveTimeout, DistError, DistValueError
from .reduce_op import ReduceOp, check_op_dtype, valid_op_dtypes
from .work import Work

__all__ = ["ProcessGroup"]


def _divide(buf: np.ndarray, n: int) -> None:
    """AVG is a SUM followed by one division by the group size (as NCCL's avg computes it)."""
    buf /= n


class _P2PWork(Work):
    """Work of a send or receive: waits on the engine's handle under the group's timeout."""

    __slots__ = ("_group", "_handle", "_record", "_peer")

    def __init__(self, group: ProcessGroup, what: str, handle: P2PHandle, record: CollectiveRecord,
                 peer: int | None) -> None:
        super().__init__(what)
        self._group, self._handle, self._record, self._peer = group, handle, record, peer

    def is_completed(self) -> bool:
        if not self._done.is_set() and self._handle.test():
            self._complete()
        return self._done.is_set()

    def _complete(self) -> None:
        self._record[STATE], self._record[T_END] = "completed", time.time()
        source = self._handle.source
        self._finish(self._group.ranks[source] if source >= 0 else None)

    def wait(self, timeout: float | None = None) -> bool:
        if not self._done.is_set():
            limit = self._group.timeout if timeout is None else timeout
            if not self._handle.wait(time.monotonic() + limit):
                self._record[STATE] = "timed_out"
                g = self._group
                peer = "any rank" if self._peer is None else f"rank {g.ranks[self._peer]}"
                side = "post a matching send" if self._what.startswith("recv") else "receive it"
                raise CollectiveTimeout(
                    f"meshkit.comm: rank {g.global_rank}: {self._what} on group {g.name} did not complete "
                    f"within {limit:.1f} s: {peer} did not {side}",
                    op=self._what.split()[0], group=g.name,
                    missing=None if self._peer is None else [g.ranks[self._peer]])
            self._complete()
        return super().wait()


class ProcessGroup(GroupBase):
    """A group of ranks that communicate together (torch's ``ProcessGroup``).

    Its attributes (``ranks``, ``rank``, ``size``, ``name``, ``timeout``) are described on
    :class:`~meshkit.comm.engine.GroupBase`.
    """

    # ----------------------------------------------------------------- collectives
    def all_reduce(self, tensor: np.ndarray, op: ReduceOp = ReduceOp.SUM, *,
                   async_op: bool = False) -> Work | None:
        """Reduce ``tensor`` over the group, in place on every rank."""
        if self.rank < 0 or self.world.destroyed:
            self._member("all_reduce")
        check_array(self, "all_reduce", "tensor", tensor)
        if op.__class__ is not ReduceOp or (op, tensor.dtype) not in valid_op_dtypes:  # checked once per pair
            op = check_op_dtype(op, tensor.dtype, lambda: where(self, "all_reduce"))
        if (self._posts_all_reduce and not async_op and self._thread._pending == 0 and not self._detail
                and self._failure is None):
            return self._all_reduce_now(tensor, op)
        call = self._call("all_reduce", tensor, reduce_op=op) if self._detail else None

        def run(deadline: float) -> None:
            self._e_all_reduce(tensor, op, deadline)
            if op is ReduceOp.AVG:
                _divide(tensor, self.size)

        return self._launch("all_reduce", run, async_op, (tensor.shape,), tensor.dtype, call)

    def _all_reduce_now(self, tensor: np.ndarray, op: ReduceOp) -> None:
        """A synchronous all_reduce with nothing queued: posted first, then numbered, recorded and
        given its deadline while the data moves, then waited for. The most common call, and the
        one whose per-call cost shows: this takes the bookkeeping off its critical path."""
        seq = self._seq
        self._seq = seq + 1
        request = self._e_post_all_reduce(tensor, op)
        record = self._flight_entry(seq, self.name, "all_reduce", (tensor.shape,), tensor.dtype, "started")
        try:
            self._e_complete(request, time.monotonic() + self.timeout)
            if op is ReduceOp.AVG:
                _divide(tensor, self.size)
        except BaseException as exc:
            raise self._failed("all_reduce", seq, record, exc, self.timeout) from None
        record[STATE], record[T_END] = "completed", time.time()

    def reduce(self, tensor: np.ndarray, root: int, op: ReduceOp = ReduceOp.SUM, *,
               async_op: bool = False) -> Work | None:
        """Reduce ``tensor`` over the group into group rank ``root``'s ``tensor``.

        The other ranks' ``tensor`` keeps its contents.
        """
        self._member("reduce")
        check_array(self, "reduce", "tensor", tensor)
        root = check_root(self, "reduce", "dst", root)
        op = check_op_dtype(op, tensor.dtype, lambda: where(self, "reduce"))
        call = self._call("reduce", tensor, reduce_op=op, root=root)

        def run(deadline: float) -> None:
            self._e_reduce(tensor, op, root, deadline)
            if op is ReduceOp.AVG and self.rank == root:
                _divide(tensor, self.size)

        return self._launch("reduce", run, async_op, (tensor.shape,), tensor.dtype, call)

    def broadcast(self, tensor: np.ndarray, root: int, *, async_op: bool = False) -> Work | None:
        """Copy group rank ``root``'s ``tensor`` into every rank's ``tensor``."""
        self._member("broadcast")
        check_array(self, "broadcast", "tensor", tensor)
        root = check_root(self, "broadcast", "src", root)
        call = self._call("broadcast", tensor, root=root)
        return self._launch("broadcast", lambda d: self._e_broadcast(tensor, root, d), async_op,
                            (tensor.shape,), tensor.dtype, call)

    def all_gather_into_tensor(self, output: np.ndarray, input: np.ndarray, *,
                               async_op: bool = False) -> Work | None:
        """Concatenate every rank's ``input`` into ``output`` (``size`` times as many elements).

        ``input`` may be the rank's own chunk of ``output`` (a view), which gathers in place.
        """
        self._member("all_gather_into_tensor")
        check_array(self, "all_gather_into_tensor", "input", input, writable=False)
        check_array(self, "all_gather_into_tensor", "output", output)
        check_like(self, "all_gather_into_tensor", "output", output, input, "input", size=input.size * self.size)
        call = self._call("all_gather_into_tensor", input)
        return self._launch("all_gather_into_tensor", lambda d: self._e_all_gather(output, input, d),
                            async_op, (input.shape, output.shape), input.dtype, call)

    def all_gather(self, tensor_list: list[np.ndarray], tensor: np.ndarray, *,
                   async_op: bool = False) -> Work | None:
        """Gather every rank's ``tensor`` into ``tensor_list[rank]`` on every rank."""
        self._member("all_gather")
        check_array(self, "all_gather", "tensor", tensor, writable=False)
        outs = check_list(self, "all_gather", "tensor_list", tensor_list, tensor, "tensor", writable=True)
        call = self._call("all_gather", tensor)

        def run(deadline: float) -> None:
            flat = np.empty((self.size,) + tensor.shape, tensor.dtype)
            self._e_all_gather(flat, tensor, deadline)
            for out, chunk in zip(outs, flat):
                out[...] = chunk

        return self._launch("all_gather", run, async_op, (tensor.shape,), tensor.dtype, call)

    def reduce_scatter_tensor(self, output: np.ndarray, input: np.ndarray, op: ReduceOp = ReduceOp.SUM,
                              *, async_op: bool = False) -> Work | None:
        """Reduce ``input`` (``size`` chunks) over the group; rank r receives reduced chunk r."""
        self._member("reduce_scatter_tensor")
        check_array(self, "reduce_scatter_tensor", "input", input, writable=False)
        check_array(self, "reduce_scatter_tensor", "output", output)
        check_like(self, "reduce_scatter_tensor", "input", input, output, "output",
                   size=output.size * self.size)
        op = check_op_dtype(op, input.dtype, lambda: where(self, "reduce_scatter_tensor"))
        call = self._call("reduce_scatter_tensor", input, reduce_op=op)

        def run(deadline: float) -> None:
            self._e_reduce_scatter(output, input, op, deadline)
            if op is ReduceOp.AVG:
                _divide(output, self.size)

        return self._launch("reduce_scatter_tensor", run, async_op, (input.shape, output.shape),
                            input.dtype, call)

    def reduce_scatter(self, output: np.ndarray, input_list: list[np.ndarray], op: ReduceOp = ReduceOp.SUM,
                       *, async_op: bool = False) -> Work | None:
        """Reduce ``input_list[r]`` over the group into rank r's ``output``."""
        self._member("reduce_scatter")
        check_array(self, "reduce_scatter", "output", output)
        ins = check_list(self, "reduce_scatter", "input_list", input_list, output, "output", writable=False)
        op = check_op_dtype(op, output.dtype, lambda: where(self, "reduce_scatter"))
        call = self._call("reduce_scatter", output, reduce_op=op)

        def run(deadline: float) -> None:
            self._e_reduce_scatter(output, np.stack(ins), op, deadline)
            if op is ReduceOp.AVG:
                _divide(output, self.size)

        return self._launch("reduce_scatter", run, async_op, (output.shape,), output.dtype, call)

    def gather(self, tensor: np.ndarray, gather_list: list[np.ndarray] | None, root: int, *,
               async_op: bool = False) -> Work | None:
        """Gather every rank's ``tensor`` into ``gather_list`` on group rank ``root``."""
        self._member("gather")
        check_array(self, "gather", "tensor", tensor, writable=False)
        root = check_root(self, "gather", "dst", root)
        outs = self._root_list("gather", "gather_list", gather_list, tensor, root, writable=True)
        call = self._call("gather", tensor, root=root)

        def run(deadline: float) -> None:
            flat = np.empty((self.size,) + tensor.shape, tensor.dtype) if outs is not None else None
            self._e_gather(flat, tensor, root, deadline)
            if outs is not None:
                for out, chunk in zip(outs, flat):
                    out[...] = chunk

        return self._launch("gather", run, async_op, (tensor.shape,), tensor.dtype, call)

    def scatter(self, tensor: np.ndarray, scatter_list: list[np.ndarray] | None, root: int, *,
                async_op: bool = False) -> Work | None:
        """Send ``scatter_list[r]`` from group rank ``root`` into rank r's ``tensor``."""
        self._member("scatter")
        check_array(self, "scatter", "tensor", tensor)
        root = check_root(self, "scatter", "src", root)
        ins = self._root_list("scatter", "scatter_list", scatter_list, tensor, root, writable=False)
        call = self._call("scatter", tensor, root=root)

        def run(deadline: float) -> None:
            self._e_scatter(tensor, np.stack(ins) if ins is not None else None, root, deadline)

        return self._launch("scatter", run, async_op, (tensor.shape,), tensor.dtype, call)

    def all_to_all_single(self, output: np.ndarray, input: np.ndarray,
                          output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None, *,
                          async_op: bool = False) -> Work | None:
        """Split ``input`` along dim 0, send part j to rank j; receive into ``output`` in rank order.

        Split sizes count rows of dim 0; None means equal parts. No copies are made.
        """
        name = "all_to_all_single"
        self._member(name)
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
        call = self._call(name, None, dtype=input.dtype, counts=(tuple(send), tuple(recv)))
        return self._launch(name, lambda d: self._e_all_to_all(output, recv, input, send, d), async_op,
                            (input.shape, output.shape), input.dtype, call)

    def all_to_all(self, output_list: list[np.ndarray], input_list: list[np.ndarray], *,
                   async_op: bool = False) -> Work | None:
        """Send ``input_list[j]`` to rank j; receive rank j's array into ``output_list[j]``."""
        self._member("all_to_all")
        if not isinstance(input_list, (list, tuple)) or not input_list:
            raise DistValueError(f"{where(self, 'all_to_all')}: input_list must be a list of {self.size} arrays")
        check_array(self, "all_to_all", "input_list[0]", input_list[0], writable=False)
        ref = input_list[0]
        ins = check_list(self, "all_to_all", "input_list", input_list, ref, "input_list[0]", writable=False,
                         same_shape=False)
        outs = check_list(self, "all_to_all", "output_list", output_list, ref, "input_list[0]", writable=True,
                          same_shape=False)
        send = [x.size for x in ins]
        recv = [x.size for x in outs]
        call = self._call("all_to_all", None, dtype=ref.dtype, counts=(tuple(send), tuple(recv)))

        def run(deadline: float) -> None:
            flat_out = np.empty(sum(recv), ref.dtype)
            self._e_all_to_all(flat_out, recv, np.concatenate([x.ravel() for x in ins]), send, deadline)
            start = 0
            for out, n in zip(outs, recv):
                out.reshape(-1)[...] = flat_out[start:start + n]
                start += n

        return self._launch("all_to_all", run, async_op, tuple(x.shape for x in ins), ref.dtype, call)

    def barrier(self, *, async_op: bool = False) -> Work | None:
        """Wait until every rank of the group has reached the barrier."""
        self._member("barrier")
        return self._launch("barrier", self._e_barrier, async_op, (), None, self._call("barrier", None))

    def monitored_barrier(self, timeout: float | None = None) -> None:
        """A barrier that names every rank that did not arrive within ``timeout`` seconds.

        Group rank 0 collects an arrival message from each rank and answers all of them, so a
        rank that never arrives is known and reported (torch's gloo ``monitored_barrier``, but
        naming all missing ranks, not only the first).
        """
        self._member("monitored_barrier")
        limit = self.timeout if timeout is None else float(timeout)
        self._launch("monitored_barrier", lambda d: self._e_exchange(None, self._seq - 1, d), False, (), None,
                     None, timeout=limit)

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
        return self._launch("split", lambda d: self._e_split(color, tuple(ranks), name, d), False, (), None,
                            self._call("split", None))

    def host_name(self) -> str:
        """The name of the host this rank runs on (MPI's processor name on the mpi engine)."""
        return socket.gethostname()

    # ----------------------------------------------------------------- point to point
    def isend(self, tensor: np.ndarray, dst: int, tag: int = 0) -> Work:
        """Start sending ``tensor`` to group rank ``dst``; the Work completes when it may be reused."""
        self._member("isend")
        check_array(self, "isend", "tensor", tensor, writable=False)
        dst = check_root(self, "isend", "dst", dst)
        self._check_tag("isend", tag)
        record = self._flight_entry(-1, self.name, "send", (tensor.shape,), tensor.dtype)
        handle = self._e_isend(tensor, dst, tag)
        return _P2PWork(self, f"send to rank {self.ranks[dst]} tag {tag}", handle, record, dst)

    def irecv(self, tensor: np.ndarray, src: int | None = None, tag: int = 0) -> Work:
        """Start receiving into ``tensor`` from group rank ``src`` (None: any rank).

        ``Work.result()`` is the sender's global rank once the Work completed.
        """
        self._member("irecv")
        check_array(self, "irecv", "tensor", tensor)
        if src is not None:
            src = check_root(self, "irecv", "src", src)
        self._check_tag("irecv", tag)
        record = self._flight_entry(-1, self.name, "recv", (tensor.shape,), tensor.dtype)
        handle = self._e_irecv(tensor, src, tag)
        peer = "any rank" if src is None else f"rank {self.ranks[src]}"
        return _P2PWork(self, f"recv from {peer} tag {tag}", handle, record, src)

    def _check_tag(self, op: str, tag: int) -> None:
        if not isinstance(tag, (int, np.integer)) or not 0 <= tag <= self.max_tag:
            raise DistValueError(f"{where(self, op)}: tag={tag!r} is out of range (valid: 0..{self.max_tag})")

    max_tag: int = 2**20

    # ----------------------------------------------------------------- argument helpers
    def _member(self, op: str) -> None:
        if self.rank < 0:
            raise DistValueError(
                f"{where(self, op)}: this rank is not a member of group {self.name} "
                f"(ranks {list(self.ranks)}); only members may call collectives on it")
        if self.world.destroyed:
            raise DistError(f"{where(self, op)}: the process group was destroyed; call "
                            "init_process_group() again first")

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
              counts: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> Call | None:
        """The fingerprint compared across ranks in detail mode (None otherwise: no cost)."""
        if not self._detail:
            return None
        if tensor is not None:
            dtype = tensor.dtype
        return Call(name, None if dtype is None else str(dtype), None if tensor is None else tuple(tensor.shape),
                    None if reduce_op is None else reduce_op.name, root, counts)
