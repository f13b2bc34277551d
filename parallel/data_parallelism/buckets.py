"""Gradient buckets: parameters grouped into flat buffers that are reduced as one message.

A :class:`Bucket` is one flat buffer of one dtype, the set of its gradients marked ready, the
handle of its asynchronous reduction, and what it reduces with (a :class:`CommHook`: the group,
the hook and its state). A complete bucket launches itself (:meth:`Bucket.launch`), strictly in
index order: collectives must be issued in the same order on every rank, so a bucket that is
ready early waits for its predecessors and is launched by the last of them (as torch's reducer).
A :class:`BucketManager` assigns parameters to buckets, maps each parameter to its bucket and
hands out views.

Assignment follows torch's DDP: one dtype per bucket, parameters taken in the given order
(reverse registration order by default, roughly the order a backward pass produces them), the
first bucket of each dtype capped at ``first_bucket_cap_mb`` (1 MB: small, so communication
starts early in the backward pass) and the others at ``bucket_cap_mb`` (25 MB). A parameter
larger than the cap gets a bucket of its own.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from ...comm import ProcessGroup, Work
from ..arrays import array_namespace

if TYPE_CHECKING:
    from .pool import BufferPool

__all__ = ["Bucket", "BucketManager", "CommHook", "GradBucket", "assign_buckets"]

MB = 1 << 20


class CommHook:
    """What buckets reduce with: ``hook(state, GradBucket) -> Work`` over ``group``.

    One object shared by every bucket of a manager, so that ``register_comm_hook`` reaches all
    of them, also after the buckets are rebuilt.
    """

    __slots__ = ("group", "hook", "state")

    def __init__(self, group: ProcessGroup, hook: Callable[[Any, GradBucket], Work | None], state: Any) -> None:
        self.group, self.hook, self.state = group, hook, state


class GradBucket:
    """What a hook sees of a bucket (torch's ``GradBucket``)."""

    def __init__(self, bucket: Bucket, group: ProcessGroup) -> None:
        self._bucket, self.group = bucket, group

    def buffer(self) -> Any:
        """The flat gradient buffer; the hook leaves the average here."""
        return self._bucket.buffer

    def index(self) -> int:
        return self._bucket.index

    def is_last(self) -> bool:
        """True for the last bucket of the iteration (hooks count iterations on it)."""
        return self._bucket.next is None

    def parameters(self) -> list[str]:
        """Names of the parameters whose gradients are in the bucket, in buffer order."""
        return list(self._bucket.names)

    def gradients(self) -> list[Any]:
        """Views of the gradients in the buffer, shaped like their parameters."""
        return [self._bucket.view(n) for n in self._bucket.names]


class Bucket:
    """A flat buffer holding the gradients of some parameters of one dtype.

    Attributes:
        index: position in launch order; ``prev``/``next``: the neighbouring buckets (or None).
        buffer: the flat array (None while a pooled bucket holds none); ``view(name)`` is a
            parameter's gradient inside it.
        names: the parameters, in buffer order; ``count`` of them; ``dtype`` theirs.
        views: ``name -> view`` made so far for the current buffer (see ``view``).
        slots: ``name -> (start, stop, shape)`` in elements.
        ready: names marked ready in this iteration.
        comm: the :class:`CommHook` it reduces with; ``pool``: where its buffer comes from, or None.
        work: the pending reduction, or None; ``launched``: whether it started in this iteration.
    """

    def __init__(self, index: int, buffer: Any, names: list[str], slots: dict[str, tuple[int, int, tuple[int, ...]]],
                 dtype: Any, comm: CommHook, pool: BufferPool | None = None) -> None:
        self.index, self.names, self.slots, self.dtype = index, names, slots, dtype
        self.count = len(names)
        self.comm, self.pool = comm, pool
        self.prev: Bucket | None = None
        self.next: Bucket | None = None
        self.ready: set[str] = set()
        self.work: Work | None = None
        self.launched = False
        self.buffer = buffer

    @property
    def buffer(self) -> Any:
        return self._buffer

    @buffer.setter
    def buffer(self, value: Any) -> None:
        self._buffer = value
        # Views are made once per buffer: the same object every time, so a caller can tell
        # "the bucket's own view" from an array of its own by identity.
        self.views: dict[str, Any] = {}

    @property
    def size(self) -> int:
        """Elements the bucket holds (its buffer's length once it has one)."""
        return self.slots[self.names[-1]][1]

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else int(self._buffer.nbytes)

    def view(self, name: str) -> Any:
        """``name``'s gradient inside the buffer (a pooled bucket takes a buffer first)."""
        view = self.views.get(name)
        if view is None:
            if self._buffer is None:
                self.pool.attach(self)  # type: ignore[union-attr]
            start, stop, shape = self.slots[name]
            view = self.views[name] = self._buffer[start:stop].reshape(shape)
        return view

    def is_ready(self) -> bool:
        return len(self.ready) == self.count

    def launch(self) -> None:
        """Start this bucket's reduction if it is complete and its predecessor has started, then
        those of the complete buckets after it: launches go strictly in index order."""
        bucket: Bucket | None = self
        while (bucket is not None and not bucket.launched and len(bucket.ready) == bucket.count
               and (bucket.prev is None or bucket.prev.launched)):
            comm = bucket.comm
            bucket.work = comm.hook(comm.state, GradBucket(bucket, comm.group))
            bucket.launched = True
            bucket = bucket.next

    def wait(self) -> None:
        """Wait for the reduction; a pooled bucket then gives its buffer back."""
        if self.work is not None:
            self.work.wait()
            self.work = None
            if self.pool is not None:
                self.pool.release(self)

    def reset(self) -> None:
        self.ready.clear()
        self.work = None
        self.launched = False


def assign_buckets(specs: Sequence[tuple[str, tuple[int, ...], Any]], *, bucket_cap_bytes: int,
                   first_bucket_cap_bytes: int) -> list[list[str]]:
    """Group ``(name, shape, dtype)`` specs, in the given order, into buckets of names.

    One dtype per bucket; each dtype's first bucket is capped at ``first_bucket_cap_bytes``,
    the rest at ``bucket_cap_bytes``; a bucket is closed when the next parameter would overflow
    it (an oversized parameter gets its own bucket). Buckets come in the order they were opened.

    Example (float32, caps 8 and 16 bytes)::

        assign_buckets([("a", (2,), f32), ("b", (2,), f32), ("c", (3,), f32)], ...)
        # [["a"], ["b", "c"]]: "b" would overflow the 8-byte first bucket
    """
    buckets: list[list[str]] = []
    open_: dict[Any, tuple[int, int, int]] = {}  # dtype -> (bucket index, bytes used, cap)
    for name, shape, dtype in specs:
        nbytes = math.prod(int(s) for s in shape) * dtype.itemsize
        entry = open_.get(dtype)
        if entry is None or (entry[1] and entry[1] + nbytes > entry[2]):
            buckets.append([])
            entry = (len(buckets) - 1, 0, first_bucket_cap_bytes if entry is None else bucket_cap_bytes)
        index, used, cap = entry
        buckets[index].append(name)
        open_[dtype] = (index, used + nbytes, cap)
    return buckets


class BucketManager:
    """Buckets for a set of parameters: flat buffers, the name -> bucket map, views.

    Args:
        params: ``name -> array``; gradients take each parameter's shape and dtype (a snapshot
            of them is taken: later changes to ``params`` do not reach the buckets).
        order: parameter names in bucket-filling order.
        bucket_cap_bytes, first_bucket_cap_bytes: see :func:`assign_buckets`.
        comm: what every bucket reduces with.
        flat: ``dtype -> flat array``: buckets are consecutive views into it, in bucket order
            (ZeRO-1's flat gradients); default: each bucket a zeroed array of its own.
        pool: buckets start without a buffer and take one from ``pool`` when a gradient is
            first used, giving it back once reduced (ZeRO-2).
    """

    def __init__(self, params: Mapping[str, Any], order: Sequence[str], *, bucket_cap_bytes: int,
                 first_bucket_cap_bytes: int, comm: CommHook, flat: Mapping[Any, Any] | None = None,
                 pool: BufferPool | None = None) -> None:
        self._specs = {name: (tuple(p.shape), p.dtype, int(p.size)) for name, p in params.items()}
        self._xp = array_namespace(next(iter(params.values())))
        self._caps = (bucket_cap_bytes, first_bucket_cap_bytes)
        self.comm, self._flat, self._pool = comm, flat, pool
        self.buckets: list[Bucket] = []
        #: name -> bucket; updated in place on rebuilds, so a reference to it stays valid
        self.location: dict[str, Bucket] = {}
        self.build(order)

    def build(self, order: Sequence[str], keep_values: bool = False) -> None:
        """(Re)assign buckets in ``order``; with ``keep_values`` the gradients are carried over."""
        old = {name: self.view(name) for name in self.location} if keep_values else {}
        specs = [(n, self._specs[n][0], self._specs[n][1]) for n in order]
        groups = assign_buckets(specs, bucket_cap_bytes=self._caps[0], first_bucket_cap_bytes=self._caps[1])
        self.buckets = []
        self.location.clear()
        used: dict[Any, int] = {}  # dtype -> elements of its flat array taken so far
        for index, names in enumerate(groups):
            slots, start = {}, 0
            for name in names:
                shape, _, size = self._specs[name]
                slots[name] = (start, start + size, shape)
                start += size
            dtype = self._specs[names[0]][1]
            if self._pool is not None:
                buffer = None
            elif self._flat is not None:
                offset = used.get(dtype, 0)
                buffer, used[dtype] = self._flat[dtype][offset:offset + start], offset + start
            elif self._xp is np:  # in the group's shared memory where it has some: reduced in place
                buffer = self.comm.group.shared_buffer(start * np.dtype(dtype).itemsize).view(dtype)
            else:
                buffer = self._xp.zeros(start, dtype=dtype)
            bucket = Bucket(index, buffer, names, slots, dtype, self.comm, self._pool)
            if self.buckets:
                bucket.prev, self.buckets[-1].next = self.buckets[-1], bucket
            self.buckets.append(bucket)
            for name in names:
                self.location[name] = bucket
                if name in old:
                    bucket.view(name)[...] = old[name]

    def view(self, name: str) -> Any:
        return self.location[name].view(name)

    def views(self) -> dict[str, Any]:
        """``name -> gradient view`` in the parameters' own order."""
        return {name: self.view(name) for name in self._specs}

    def launch_ready(self) -> None:
        """Launch the first bucket not launched yet, if it is complete (and those after it)."""
        for bucket in self.buckets:
            if not bucket.launched:
                bucket.launch()
                return

    def unready(self) -> list[str]:
        """Names not yet marked ready in this iteration, in parameter order."""
        if all(b.is_ready() for b in self.buckets):
            return []
        return [n for n in self._specs if n not in self.location[n].ready]

    def wait_all(self) -> None:
        """Wait for every launched bucket; then raise the first error, if one failed.

        Every bucket is waited for even after one failed (a hook that raised, a timeout): a
        reduction left running would write its average into the buffer after ``zero_grad()``
        zeroed it, into the next pass's gradients.
        """
        # The last one first: a waiter runs the group's queued operations itself, in order, up to
        # the one it waits for (comm.work), so buckets no thread has started yet all run here
        # without handing each to the communication thread and being woken by it.
        error: BaseException | None = None
        for bucket in reversed(self.buckets):
            try:
                bucket.wait()
            except BaseException as exc:
                bucket.work = None  # failed: nothing left to wait for
                error = error or exc
        if error is not None:
            raise error

    def reset(self) -> None:
        for bucket in self.buckets:
            bucket.reset()

    def zero(self) -> None:
        for bucket in self.buckets:
            if bucket.buffer is not None:
                bucket.buffer[...] = 0

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)
