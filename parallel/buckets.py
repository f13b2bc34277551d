"""Gradient buckets: parameters grouped into flat buffers that are reduced as one message.

A :class:`Bucket` is one flat buffer of one dtype, the set of its gradients marked ready, and
the handle of its asynchronous reduction. A :class:`BucketManager` assigns parameters to
buckets, maps each parameter to ``(bucket, start, stop)`` and hands out views, and launches
buckets strictly in index order: collectives must be issued in the same order on every rank,
so a bucket that is ready early waits for its predecessors (as torch's reducer does).

Assignment follows torch's DDP: one dtype per bucket, parameters taken in the given order
(reverse registration order by default, roughly the order a backward pass produces them), the
first bucket of each dtype capped at ``first_bucket_cap_mb`` (1 MB: small, so communication
starts early in the backward pass) and the others at ``bucket_cap_mb`` (25 MB). A parameter
larger than the cap gets a bucket of its own.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from ..comm import Work
from .optim import array_namespace

__all__ = ["Bucket", "BucketManager", "assign_buckets"]

MB = 1 << 20


class Bucket:
    """A flat buffer holding the gradients of some parameters of one dtype.

    Attributes:
        index: position in launch order.
        buffer: the flat array (None while a lazily provisioned ZeRO-2 bucket holds nothing);
            ``view(name)`` is a parameter's gradient inside it.
        names: the parameters, in buffer order; ``count`` of them.
        views: ``name -> view`` made so far for the current buffer (see ``view``).
        slots: ``name -> (start, stop, shape)`` in elements.
        ready: names marked ready in this iteration.
        work: the pending reduction, or None.
    """

    def __init__(self, index: int, buffer: Any, names: list[str],
                 slots: dict[str, tuple[int, int, tuple[int, ...]]]) -> None:
        self.index, self.names, self.slots = index, names, slots
        self.count = len(names)
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
        view = self.views.get(name)
        if view is None:
            start, stop, shape = self.slots[name]
            view = self.views[name] = self._buffer[start:stop].reshape(shape)
        return view

    def is_ready(self) -> bool:
        return len(self.ready) == self.count

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None

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
    """Buckets for a set of parameters: flat buffers, views, readiness and in-order launch.

    Args:
        params: ``name -> array``; gradients take each parameter's shape and dtype.
        order: parameter names in bucket-filling order.
        bucket_cap_bytes, first_bucket_cap_bytes: see :func:`assign_buckets`.
        launch: called as ``launch(bucket)`` when a bucket may start its reduction; returns its Work.
        allocate: ``allocate(names, size, like) -> buffer or None`` for a new bucket; default: a
            zeroed array of its own. ZeRO-1 returns a view of its flat gradient; ZeRO-2 returns
            None and attaches a pooled buffer when a gradient is first written.
    """

    def __init__(self, params: dict[str, Any], order: Sequence[str], *, bucket_cap_bytes: int,
                 first_bucket_cap_bytes: int, launch: Callable[[Bucket], Work | None],
                 allocate: Callable[[list[str], int, Any], Any] | None = None) -> None:
        self._params = params
        self._caps = (bucket_cap_bytes, first_bucket_cap_bytes)
        self._launch = launch
        self._allocate = allocate or (lambda names, size, like: array_namespace(like).zeros(size, dtype=like.dtype))
        self.buckets: list[Bucket] = []
        self.location: dict[str, Bucket] = {}
        self._next = 0
        self.build(order)

    def build(self, order: Sequence[str], keep_values: bool = False) -> None:
        """(Re)assign buckets in ``order``; with ``keep_values`` the gradients are carried over."""
        old = {name: self.view(name) for name in self.location} if keep_values else {}
        specs = [(n, tuple(self._params[n].shape), self._params[n].dtype) for n in order]
        groups = assign_buckets(specs, bucket_cap_bytes=self._caps[0], first_bucket_cap_bytes=self._caps[1])
        self.buckets, self.location = [], {}
        for index, names in enumerate(groups):
            slots, start = {}, 0
            for name in names:
                p = self._params[name]
                slots[name] = (start, start + int(p.size), tuple(p.shape))
                start += int(p.size)
            bucket = Bucket(index, self._allocate(names, start, self._params[names[0]]), names, slots)
            self.buckets.append(bucket)
            for name in names:
                self.location[name] = bucket
                if name in old:
                    bucket.view(name)[...] = old[name]
        self._next = 0

    def view(self, name: str) -> Any:
        return self.location[name].view(name)

    def views(self) -> dict[str, Any]:
        """``name -> gradient view`` in the parameters' own order."""
        return {name: self.view(name) for name in self._params}

    def mark_ready(self, name: str, *, launch: bool = True) -> None:
        """Record ``name`` ready; launch every bucket that can go, in index order."""
        self.location[name].ready.add(name)
        if launch:
            self.launch_ready()

    def launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].is_ready():
            bucket = self.buckets[self._next]
            bucket.work = self._launch(bucket)
            bucket.launched = True
            self._next += 1

    def unready(self) -> list[str]:
        """Names not yet marked ready in this iteration, in parameter order."""
        if all(b.is_ready() for b in self.buckets):
            return []
        return [n for n in self._params if n not in self.location[n].ready]

    def wait_all(self) -> None:
        # The last one first: a waiter runs the group's queued operations itself, in order, up
        # to the one it waits for (comm.work), so buckets no thread has started yet all run here
        # without handing each to the communication thread and being woken by it.
        for bucket in reversed(self.buckets):
            bucket.wait()

    def reset(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        self._next = 0

    def zero(self) -> None:
        for bucket in self.buckets:
            if bucket.buffer is not None:
                bucket.buffer[...] = 0

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)
