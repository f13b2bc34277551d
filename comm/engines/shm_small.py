"""The one-meeting path for small and middle ordinary buffers over a group's shared-memory segment.

Below ``MESHKIT_SHM_MIN_BYTES`` (512 KiB with cross-memory attach) an ordinary buffer would go to
MPI, whose own cost at 2 ranks is a few microseconds but whose all_reduce of 64 KB-1 MB runs far
below the memory system (docs/collectives.md). Here an ``all_reduce`` (up to half of
``MESHKIT_SHM_SMALL_BYTES``: :attr:`SmallPath.most_reduced`), ``reduce_scatter`` (of an input up
to ``MESHKIT_SHM_SMALL_BYTES``) or ``all_gather`` (of an output up to a quarter of it:
:attr:`SmallPath.most_gathered`) of a NumPy array of at least ``MESHKIT_SHM_SMALL_MIN_BYTES`` bytes,
and at most one chunk, meets the other ranks once, DeepSpeed's small-message algorithm (csrc/cpu/comm/shm.cpp):

all_reduce
    copy the array into this rank's buffer ``step % 2`` of the segment, write the call's header and
    post ``step``; once every rank posted, compare the headers and reduce **the whole** array from
    every rank's buffer, in rank order, straight into the array.
reduce_scatter
    copy in every block but this rank's own (read from the input, unless the output overlaps it);
    once every rank posted, reduce block ``rank`` of every rank's buffer, in rank order, into the
    output.
all_gather (of an output from ``MESHKIT_SHM_SMALL_MIN_BYTES`` up to a quarter of ``MESHKIT_SHM_SMALL_BYTES``)
    copy the input into this rank's buffer; once every rank posted, copy every rank's buffer into
    its block of the output (this rank's too: the input may be that block).

No barrier: it is one step of the :class:`~meshkit.comm.engines.shm_collectives.Channel`'s step
counter, with the same buffers, flags and headers as the channel's other calls, so the argument
there (a rank writes buffer ``s % 2`` again only after every rank posted ``s + 1``, that is, after
every rank finished reading step ``s``) covers it, and a call here and one of the channel's other
calls meet at the same step and compare the same headers: a mismatch raises
:class:`~meshkit.comm.engines.engine.CallsDiffer` on every rank. Every rank reduces the same bytes
in the same order, so every rank holds bitwise the same result, run after run.

What it saves over the channel's generators is Python, not bytes: no generator, no header built
per call (:class:`SmallPath` keeps each call's header and the segment views per ``(dtype, count)``),
the flags tested by a loop over word indices; a call is a copy, a few word stores and the
reduction. A wait is the channel's (:meth:`Channel._check_alive` every :data:`_POLLS_PER_LOOK`
failed polls: a dead peer raises :class:`~meshkit.comm.errors.RankFailedError`, the ``abandoned``
hook runs) and a timeout names :attr:`SmallRequest.missing_ranks`, as the channel's requests do
(:class:`SmallRequest` is a :class:`~meshkit.comm.engines.shm_collectives.ShmRequest`).
"""

from __future__ import annotations

import time
from array import array
from typing import Any

import numpy as np

from ..reduce_op import ReduceOp
from .shm_collectives import Channel, ShmRequest, _reduce_into
from .shm_layout import CONTROL_WORDS, HEADER, HEADER_WORDS, POST

__all__ = ["SmallPath", "SmallRequest", "SmallGather", "CACHED_SHAPES"]

#: Distinct ``(dtype, count, op)`` views and headers kept before the caches start over: a program calls
#: a handful of sizes (DDP's bucket, FSDP's shards); a sweep over sizes only rebuilds views (a few
#: microseconds each), never holds more than this many.
CACHED_SHAPES = 256
#: Failed polls between looks at whether the missing ranks live (the channel's check itself is also
#: bounded by ``LIVENESS_INTERVAL`` in seconds): the same rhythm as the channel's waits.
_POLLS_PER_LOOK = 64

_AR, _AG, _RS = 1, 4, 5  # the header's kinds (shm_collectives.KINDS: "all_reduce", "all_gather", "reduce_scatter")


class SmallRequest(ShmRequest):
    """One small collective over the segment: copied in and posted when made; ``Test()`` polls the
    flags and, once every rank posted, compares the headers and reduces (True), else False."""

    __slots__ = ("channel", "step", "header", "words", "posts", "heads", "dst", "parts", "op", "polls")

    def __init__(self, kind: str, channel: Channel, step: int, header: tuple[int, ...], words: list[int],
                 posts: list[int], heads: list[int], dst: np.ndarray, parts: list[np.ndarray], op: ReduceOp) -> None:
        # (ShmRequest's own __init__ starts a generator: not called)
        self.kind, self.channel, self.step, self.header = kind, channel, step, header
        self.words, self.posts, self.heads = words, posts, heads
        self.dst, self.parts, self.op = dst, parts, op
        self.missing_ranks: list[int] | tuple[()] = ()
        self.looked = 0.0
        self.polls = 0
        self._done = False
        self._error: BaseException | None = None

    def Test(self) -> bool:  # noqa: N802 (the Request protocol's name)
        if self._done:
            return True
        if self._error is not None:
            raise self._error
        channel, step = self.channel, self.step
        words = channel.words
        try:
            for at in self.posts:
                if words[at] < step:
                    self._stalled(words, step)
                    return False
            self.missing_ranks = ()
            mine = self.words
            for at in self.heads:  # the others' headers for this step against this rank's (as a list: one C call)
                if words[at:at + HEADER_WORDS].tolist() != mine:
                    channel._compare(step, self.header)  # raises CallsDiffer, naming every rank's call
            self._finish()
        except BaseException as exc:
            self._error = exc
            raise
        self._done = True
        self.parts = None  # type: ignore[assignment]  # (the segment's views: not kept alive by a finished call)
        return True

    def _finish(self) -> None:
        """Every rank posted and the headers agree: the reduction, in rank order, into the output."""
        _reduce_into(self.op, self.dst, self.parts)

    def _stalled(self, words: Any, step: int) -> None:
        """A poll found a flag missing: note who is missing; every few polls, whether they live."""
        self.missing_ranks = missing = [r for r, at in enumerate(self.posts) if words[at] < step]
        self.polls += 1
        if self.polls == 1:  # the wait begins: the first look comes LIVENESS_INTERVAL from now (no clock read
            self.looked = time.monotonic()  # for a call that never waits)
        elif self.polls % _POLLS_PER_LOOK == 0:
            self.channel._check_alive(self, missing)


class SmallGather(SmallRequest):
    """A one-meeting all_gather: ``dst`` is the output's blocks, ``parts`` every rank's buffer."""

    __slots__ = ()

    def _finish(self) -> None:
        for block, part in zip(self.dst, self.parts):  # type: ignore[call-overload]
            np.copyto(block, part)


class SmallPath:
    """A channel's one-meeting calls, with what they need kept per ``(dtype, count)``.

    Args:
        channel: the group's channel (its segment, flags, headers and step counter).
        least, most: the ordinary buffers it takes, in bytes (``MESHKIT_SHM_SMALL_MIN_BYTES`` and
            ``MESHKIT_SHM_SMALL_BYTES``, the latter held to the channel's chunk): a reduce_scatter's
            input, an all_reduce's buffer up to half of ``most`` (:attr:`most_reduced`).
    """

    def __init__(self, channel: Channel, least: int, most: int) -> None:
        self.channel = channel
        self.least, self.most = least, min(most, channel.chunk_bytes)
        #: The largest all_reduce it takes: half of ``most``. Per byte of its buffer a one-meeting
        #: all_reduce moves n + 2 (a copy in, n buffers read, the result written), a reduce_scatter
        #: about 2, and at 2 ranks (loaded machine, benchmarks/collectives.py --stat min, 5 rounds,
        #: two runs; docs/collectives.md) the all_reduce lost to meshkit's MPI path at 1 MB (1171 and
        #: 1230 us against 924 and 936) and won at 512 KB (678 and 377 against 797 and 717) while
        #: the reduce_scatter of 1 MB won (911 and 1009 against 1132 and 1807).
        self.most_reduced = self.most // 2
        #: The largest all_gather (its output) it takes: a quarter of ``most``. Against meshkit's MPI path
        #: (2026-11-29, quiet, 2 ranks, benchmarks/collectives.py --stat min, 9 rounds, two runs) it won by
        #: 1.5-2.5 us at 16-64 KB, tied at 256 KB (42-47 us against 38-51) and lost at 1 MB (195-201
        #: against 144-161: the output copied out of memory the other core wrote); MPICH beat both.
        #: Under ``--survive`` (Open MPI over TCP) it is the fastest path there is at these sizes.
        self.most_gathered = self.most // 4
        #: each rank's post flag, and its header's words by the step's parity (shm_layout.py)
        self._posts = [r * CONTROL_WORDS + POST for r in range(channel.n)]
        self._heads = [[r * CONTROL_WORDS + HEADER + parity * HEADER_WORDS for r in range(channel.n)]
                       for parity in (0, 1)]
        #: the others' header words by parity: what a call compares with its own
        self._others = [[at for r, at in enumerate(heads) if r != channel.rank] for heads in self._heads]
        #: this rank's header slot by parity, as a memoryview to assign a header's words in one copy
        self._mine = [channel.words[heads[channel.rank]:heads[channel.rank] + HEADER_WORDS] for heads in self._heads]
        #: (kind, dtype, count, op) -> (header, its words as a list and as int64 bytes, every rank's buffers of
        #: ``count`` by parity): an all_reduce's and an all_gather's (:meth:`_flat`)
        self._reduced: dict[tuple[Any, ...], tuple[tuple[int, ...], list[int], memoryview,
                                                   list[list[np.ndarray]]]] = {}
        #: (dtype, count, op) -> (header, its words, its bytes, every rank's buffers as n blocks, block ``rank`` of each)
        self._scattered: dict[tuple[Any, ...], tuple[tuple[int, ...], list[int], memoryview, list[list[np.ndarray]],
                                                     list[list[np.ndarray]]]] = {}

    def takes(self, nbytes: int) -> bool:
        """Whether a reduce_scatter of an ordinary input of ``nbytes`` takes this path (the same on
        every rank; an all_reduce: up to :attr:`most_reduced`)."""
        return self.least <= nbytes <= self.most

    def gathers(self, nbytes: int) -> bool:
        """Whether an all_gather into an ordinary output of ``nbytes`` takes this path (the same on every
        rank: up to :attr:`most_gathered`)."""
        return self.least <= nbytes <= self.most_gathered

    def close(self) -> None:
        """Drop the views of the segment (so that unmapping it is not refused while they live); the
        path is not used afterwards."""
        self._reduced.clear()
        self._scattered.clear()
        for slot in self._mine:
            slot.release()

    def describe(self) -> str:
        """Which calls take this path, in words (``ShmEngine.paths``)."""
        if self.least > self.most:
            return ""
        return (f", all_reduce of NumPy arrays of {self.least}-{self.most_reduced} bytes, reduce_scatter of "
                f"{self.least}-{self.most} and all_gather of {self.least}-{self.most_gathered} in one meeting")

    def _header(self, kind: int, count: int, op: ReduceOp | None, dtype: np.dtype) -> tuple[int, ...]:
        return self.channel._header(kind, count, op, -1, dtype)

    def _post(self, step: int, header: memoryview) -> None:
        """This rank's header (its words) in the slot of ``step``'s parity, then its post flag (in that
        order: x86-TSO shows the peers the header before the flag; shm_collectives.py's argument)."""
        self._mine[step & 1][:] = header
        self.channel.words[self._posts[self.channel.rank]] = step

    def _views(self, dtype: np.dtype, count: int) -> list[list[np.ndarray]]:
        """Every rank's two buffers (by parity) as ``count`` elements of ``dtype``."""
        channel = self.channel
        return [[channel.buffer(r, parity, dtype, count) for r in range(channel.n)] for parity in (0, 1)]

    def _flat(self, kind: int, dtype: np.dtype, count: int, op: ReduceOp | None) -> tuple[
            tuple[int, ...], list[int], memoryview, list[list[np.ndarray]]]:
        """A call's header (as a tuple, a list of words and int64 bytes) and every rank's two buffers of
        ``count`` elements, kept per ``(kind, dtype, count, op)`` (at most :data:`CACHED_SHAPES`)."""
        key = (kind, dtype, count, op)
        kept = self._reduced.get(key)
        if kept is None:
            if len(self._reduced) >= CACHED_SHAPES:
                self._reduced.clear()
            header = self._header(kind, count, op, dtype)
            kept = self._reduced[key] = (header, list(header), memoryview(array("q", header)),
                                         self._views(dtype, count))
        return kept

    def all_reduce(self, buf: np.ndarray, op: ReduceOp) -> SmallRequest:
        """Start the all_reduce of ``buf`` (C-contiguous, ``least <= buf.nbytes <= most_reduced``) in place."""
        header, words, raw, views = self._flat(_AR, buf.dtype, buf.size, op)
        channel = self.channel
        step = channel.step = channel.step + 1
        bufs = views[step & 1]
        flat = buf if buf.ndim == 1 else buf.reshape(-1)
        np.copyto(bufs[channel.rank], flat)
        self._post(step, raw)
        return SmallRequest("all_reduce", channel, step, header, words, self._posts, self._others[step & 1], flat, bufs,
                            op)

    def reduce_scatter(self, out: np.ndarray, inp: np.ndarray, op: ReduceOp) -> SmallRequest:
        """Start the reduce_scatter of ``inp`` (n blocks of ``out.size``; ``takes(inp.nbytes)``) into ``out``."""
        channel = self.channel
        n, me = channel.n, channel.rank
        m = out.size
        key = (out.dtype, m, op)
        kept = self._scattered.get(key)
        if kept is None:
            if len(self._scattered) >= CACHED_SHAPES:
                self._scattered.clear()
            views = [[v.reshape(n, m) for v in per] for per in self._views(out.dtype, n * m)]
            header = self._header(_RS, m, op, out.dtype)
            kept = self._scattered[key] = (header, list(header), memoryview(array("q", header)), views,
                                           [[v[me] for v in per] for per in views])
        header, words, raw, views, blocks = kept
        step = channel.step = channel.step + 1
        parity = step & 1
        mine = views[parity][me]
        src, dst = inp.reshape(n, m), out.reshape(-1)
        # this rank's own block is read straight from its input, unless the output overlaps the input
        # (a reduction in rank order could then overwrite it before reading it: copied in as the others)
        if np.may_share_memory(dst, src):
            np.copyto(mine, src)
            parts = blocks[parity]
        else:
            if me:
                np.copyto(mine[:me], src[:me])
            if me + 1 < n:
                np.copyto(mine[me + 1:], src[me + 1:])
            parts = list(blocks[parity])
            parts[me] = src[me]
        self._post(step, raw)
        return SmallRequest("reduce_scatter", channel, step, header, words, self._posts, self._others[parity], dst, parts,
                            op)

    def all_gather(self, out: np.ndarray, inp: np.ndarray) -> SmallGather:
        """Start the all_gather of ``inp`` (m elements) into ``out`` (n blocks of m; ``gathers(out.nbytes)``)."""
        channel = self.channel
        n, me = channel.n, channel.rank
        src = inp.reshape(-1)
        m = src.size
        header, words, raw, views = self._flat(_AG, src.dtype, m, None)
        step = channel.step = channel.step + 1
        parity = step & 1
        bufs = views[parity]
        np.copyto(bufs[me], src)
        self._post(step, raw)
        return SmallGather("all_gather", channel, step, header, words, self._posts, self._others[parity],
                           out.reshape(n, m), bufs, None)  # type: ignore[arg-type]
