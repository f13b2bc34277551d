"""The shared-memory path under MPI: a group whose ranks share a node reduces through one segment.

:class:`ShmEngine` holds a group's MPI engine (composition, as the group holds its engine) and a
:class:`~meshkit.comm.engines.shm_collectives.Channel` over the group's segment. ``all_reduce``,
``reduce``, ``broadcast``, ``all_gather`` and ``reduce_scatter`` of NumPy arrays of at least
:func:`min_bytes` bytes go through shared memory (:mod:`~meshkit.comm.engines.shm_collectives`:
the algorithm, its memory ordering and how it waits); every other call, device (CuPy) arrays,
and the calls below the threshold go to MPI as before. Both paths are driven the same way
(``Test``, :meth:`ShmEngine.wait`), so sync and ``async_op`` calls, the group's timeout, the
flight recorder and the progress agent treat them alike; ``path(request)`` says which path a
call took (``"shm"`` or ``"mpi"``: the flight recorder's ``path`` field).

:func:`over` decides, once per group (collectively over its ranks), whether the path applies:
``MESHKIT_SHM`` not ``0``, x86-64 (the memory-ordering argument is x86-TSO's), more than one rank,
every rank on one node (MPI's ``COMM_TYPE_SHARED`` split holds them all; with simulated nodes,
``meshkit-run --simulate-nodes``, their simulated host names agree too), and the segment created
and attached on every rank (:mod:`~meshkit.comm.engines.shm_segment`: why POSIX shared memory,
how it is secured and cleaned up). Where any rank cannot, every rank stays on MPI, with a
warning naming why. A group that spans nodes gets the hierarchical all-reduce
(:mod:`~meshkit.comm.engines.shm_hierarchy`: shared memory within each node, MPI between one
leader per node), its other calls over MPI.

``shared_buffer(nbytes, deadline)`` (``ProcessGroup.shared_buffer``) hands out a buffer inside a
segment of its own that every member maps; an ``all_reduce`` of a view of it at the same place on
every rank reduces in place (no copy in or out) from ``MESHKIT_SHM_SHARED_MIN_BYTES`` (64 KiB; below,
MPI on the same memory is faster): DDP's buckets live there. So do
``all_gather`` into one and ``reduce_scatter`` of one (each block read from its owner's array).

Mismatches: a call's header names its kind, count, dtype, reduce op and root, so ranks that call
different collectives *through the path* all raise ``CollectiveMismatchError`` at once. Ranks whose
calls differ in size across ``MESHKIT_SHM_MIN_BYTES`` (one on the path, one on MPI) meet nowhere:
both wait until the group's timeout, which names the ranks that did not arrive, as on MPI.

Cross-memory attach (:mod:`~meshkit.comm.engines.shm_cma`): where ``process_vm_readv`` works
between every pair of the group's ranks (a probe at creation, collectively; ``MESHKIT_SHM_CMA=0``
turns it off), an all_reduce (reduce, reduce_scatter) of an ordinary buffer above
``MESHKIT_SHM_SMALL_BYTES`` reads (and writes) the peers' own arrays instead of copying through the
segment, and ordinary buffers take the path from 4 MiB instead of 32 MiB (shm_settings.py has the
measurements).

Bounds and settings (docs/security.md): ``MESHKIT_SHM`` (0/1), ``MESHKIT_SHM_MIN_BYTES``,
``MESHKIT_SHM_CHUNK_BYTES`` (a segment is ``n x (256 + 2 x chunk)`` bytes),
``MESHKIT_SHM_SMALL_BYTES``, ``MESHKIT_SHM_SHARED_MIN_BYTES``, ``MESHKIT_SHM_CMA`` (0/1; a
rank's scratch for it is ``n x 256 KiB``, at most 8 MiB); every wait is bounded by the group's timeout.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, cast

import numpy as np
from mpi4py import MPI

from .. import env
from ..errors import DistBackendError, DistValueError
from ..reduce_op import ReduceOp
from .engine import DeadlineExceeded
from .mpi import MPIEngine, _allgather_text, _own_chunk
from .mpi_polling import completes
from .shm_collectives import Channel, ShmRequest
from .shm_hierarchy import HierarchicalEngine
from .shm_host import OverHost
from . import mpi_ulfm
from .shm_cma import probe
from .shm_settings import (ATTACH_DEARER, ATTACH_LARGE_BYTES, applies, chunk_bytes, direct, direct_bytes,
                           direct_measured, min_bytes, move_min_bytes, shared_min_bytes, small_bytes, small_min_bytes,
                           surviving)
from .shm_small import SmallPath
from .shm_layout import data_offset, segment_bytes
from .shm_segment import NAME_BYTES, Segment, attach, create
from .watchdog import watched

__all__ = ["ShmEngine", "over", "parts", "drop_shared"]

logger = logging.getLogger("meshkit")

_NDARRAY = np.ndarray


class ShmEngine(OverHost):
    """A group's MPI engine with the shared-memory path for the collectives it can run."""

    def __init__(self, host: MPIEngine, segment: Segment, channel: Channel, least: int, least_moved: int) -> None:
        super().__init__(host, shares_memory=True)
        self.segment, self.channel, self.min_bytes, self.move_min_bytes = segment, channel, least, least_moved
        #: a buffer of ``shared_buffer`` below this goes to MPI like any (``MESHKIT_SHM_SHARED_MIN_BYTES``)
        self.shared_min_bytes = shared_min_bytes()
        #: buffers handed out by shared_buffer: (this rank's region's address, its bytes, every rank's region)
        self.regions: list[tuple[int, int, list[np.ndarray]]] = []
        #: id of this rank's region array (what a view's ``base`` is) -> its index in ``regions``; the
        #: arrays stay alive in ``regions``, so an id is never reused while it is here
        self._owners: dict[int, int] = {}
        self._pools: list[Segment] = []
        #: ordinary all_reduce and reduce_scatter of MESHKIT_SHM_SMALL_MIN_BYTES..MESHKIT_SHM_SMALL_BYTES:
        #: one meeting (shm_small.py)
        self.small = SmallPath(channel, small_min_bytes(), channel.small_bytes)

    # ----------------------------------------------------------------- the path
    def all_reduce(self, buf: Any, op: ReduceOp) -> Any:
        if buf.__class__ is _NDARRAY and self.regions and buf.nbytes >= self.shared_min_bytes:
            place = self._in_region(buf)
            if place is not None:  # a buffer of shared_buffer: reduced in place, at any size
                channel, (views, offset) = self.channel, place
                return ShmRequest("all_reduce", lambda request: channel.all_reduce_in_place(request, views, op, offset))
        if buf.__class__ is _NDARRAY:
            nbytes, small = buf.nbytes, self.small
            if small.least <= nbytes <= small.most_reduced and not self._shared_below(buf):
                return small.all_reduce(buf, op)
            if nbytes >= self.min_bytes:
                channel = self.channel
                return ShmRequest("all_reduce", lambda request: channel.all_reduce(request, buf, op))
        return self.host.all_reduce(buf, op)

    def shared_buffer(self, nbytes: int, deadline: float) -> np.ndarray:
        """Collective over the group: ``nbytes`` zeroed bytes of this rank inside a new segment every
        member maps (each rank's region at the same place), as a uint8 array; an ``all_reduce`` of a
        view of it (C-contiguous, at the same place on every rank) reduces in place, with no copy in
        or out. Freed with the group (when its views are gone).

        Raises:
            DistBackendError: a rank could not create or map the segment (every rank raises).
        """
        region = -(-max(nbytes, 1) // 64) * 64
        me = self.host.world_ranks[self.host.rank]
        with watched("creating a shared buffer (MPI's Bcast, Allreduce)", me, f"ranks {self.host.world_ranks}",
                     self.host.world_ranks, max(deadline - time.monotonic(), 1.0)):
            segment, problem = _shared_segment(self.host, region * self.size)
        if segment is None:
            raise DistBackendError(f"meshkit.comm: rank {me}: shared_buffer({nbytes}): "
                                   f"{problem or 'a rank could not create or map the segment'}")
        self._pools.append(segment)
        regions = [np.frombuffer(segment.memory, np.uint8, region, r * region) for r in range(self.size)]
        mine = regions[self.rank]
        self._owners[id(mine)] = len(self.regions)
        self.regions.append((mine.ctypes.data, region, regions))
        return mine[:nbytes]

    def _in_region(self, buf: np.ndarray) -> tuple[list[np.ndarray], int] | None:
        """Every rank's array at ``buf``'s place and that place (bytes from the region's start),
        where ``buf`` lies in a region of this rank; else None.

        A view's ``base`` is the array that holds its memory (NumPy collapses chains of views), which
        for a view of a shared buffer is this rank's region array: one dictionary look-up decides,
        and only a hit pays for the address (``__array_interface__``, about 2 us: a blocking 4 KB
        all_reduce costs about 18). An array made otherwise over a region's memory (``np.frombuffer``
        of a view) is not recognised and takes the ordinary path: the same result, with copies."""
        index = self._owners.get(id(buf.base))
        if index is None:
            return None
        base, size, regions = self.regions[index]
        start = buf.__array_interface__["data"][0]
        if not (base <= start and start + buf.nbytes <= base + size):
            return None
        offset = start - base
        # the place names the buffer too: two shared buffers never compare equal
        return [np.frombuffer(region, buf.dtype, buf.size, offset) for region in regions], offset + (index << 40)

    def _shared_below(self, buf: np.ndarray) -> bool:
        """Whether ``buf`` is a view of a ``shared_buffer`` (asked once the in-place path declined it:
        below ``MESHKIT_SHM_SHARED_MIN_BYTES``). Such a buffer stays on MPI, on the same memory, as that
        threshold says, rather than take the one-meeting path of ordinary arrays: DDP's, ZeRO's and
        FSDP's small buffers keep the path they had."""
        return bool(self.regions) and id(buf.base) in self._owners

    def reduce(self, buf: Any, op: ReduceOp, root: int) -> Any:
        if buf.__class__ is _NDARRAY and buf.nbytes >= self.min_bytes:
            channel = self.channel
            return ShmRequest("reduce", lambda request: channel.all_reduce(request, buf, op, root))
        return self.host.reduce(buf, op, root)

    def broadcast(self, buf: Any, root: int) -> Any:
        if buf.__class__ is _NDARRAY and buf.nbytes >= self.move_min_bytes:
            channel = self.channel
            return ShmRequest("broadcast", lambda request: channel.broadcast(request, buf, root))
        return self.host.broadcast(buf, root)

    def all_gather(self, out: Any, inp: Any) -> Any:
        if out.__class__ is _NDARRAY and inp.__class__ is _NDARRAY and self.regions and \
                out.nbytes >= self.shared_min_bytes:
            place = self._in_region(out)
            if place is not None:  # into a shared buffer: every block read from its owner's, at any size
                channel, (outs, offset) = self.channel, place
                return ShmRequest("all_gather", lambda request: channel.all_gather_in_place(request, outs, inp, offset))
        if out.__class__ is _NDARRAY and inp.__class__ is _NDARRAY and self.small.gathers(out.nbytes) and \
                not self._shared_below(out):
            return self.small.all_gather(out, inp)
        if out.__class__ is _NDARRAY and inp.__class__ is _NDARRAY and out.nbytes >= self.move_min_bytes:
            channel, own = self.channel, _own_chunk(out, inp, self.rank)
            return ShmRequest("all_gather", lambda request: channel.all_gather(request, out, inp, own))
        return self.host.all_gather(out, inp)

    def reduce_scatter(self, out: Any, inp: Any, op: ReduceOp) -> Any:
        if out.__class__ is _NDARRAY and inp.__class__ is _NDARRAY and self.regions and \
                inp.nbytes >= self.shared_min_bytes:
            place = self._in_region(inp)
            if place is not None:  # of a shared buffer: every block reduced from its owners', no copy in
                channel, (ins, offset) = self.channel, place
                return ShmRequest("reduce_scatter",
                                  lambda request: channel.reduce_scatter_in_place(request, out, ins, op, offset))
        if out.__class__ is _NDARRAY and inp.__class__ is _NDARRAY and self.small.takes(inp.nbytes) and \
                not self._shared_below(inp):
            return self.small.reduce_scatter(out, inp, op)
        if out.__class__ is _NDARRAY and inp.__class__ is _NDARRAY and inp.nbytes >= self.min_bytes:
            channel = self.channel
            return ShmRequest("reduce_scatter", lambda request: channel.reduce_scatter(request, out, inp, op))
        return self.host.reduce_scatter(out, inp, op)

    def path(self, request: Any) -> str:
        """The path ``request`` takes: ``"shm"`` (this engine's segment) or ``"mpi"``."""
        return "shm" if isinstance(request, ShmRequest) else "mpi"

    def paths(self) -> str:
        """Which calls go through shared memory (``DeviceMesh.describe`` shows it)."""
        moved = ("" if self.move_min_bytes >= 1 << 30 else
                 f", all_gather and broadcast of >= {self.move_min_bytes} bytes")
        channel = self.channel
        direct = ("" if channel.direct is None else
                  f" (all_reduce and reduce above {max(channel.small_bytes // 2, channel.attach_above)} bytes and "
                  f"reduce_scatter above {max(channel.small_bytes, channel.attach_above)} bytes by cross-memory attach"
                  + ("" if channel.attach_ratio is None else
                     f"; its copy measured {channel.attach_ratio:.1f}x a user-space copy here") + ")")
        return (f"all_reduce, reduce and reduce_scatter of NumPy arrays of >= {self.min_bytes} "
                f"bytes{direct}{moved}{self.small.describe()} and "
                f"all_reduce, all_gather and reduce_scatter on a shared buffer of >= {self.shared_min_bytes} bytes "
                "through shared memory, the rest over mpi")

    def mapped_bytes(self) -> int:
        """Bytes this rank maps: the group's segment and every shared buffer's (each holds every rank's region)."""
        return self.segment.size + sum(pool.size for pool in self._pools)

    def wait(self, request: Any, deadline: float) -> None:
        if not isinstance(request, ShmRequest):
            self.host.wait(request, deadline)
        elif not completes(request, deadline, self.host.watch):
            ranks = self.host.world_ranks
            raise DeadlineExceeded([ranks[r] for r in request.missing_ranks],
                                   f"{request.kind} over shared memory: their flags never came")

    def split(self, color: int | None, ranks: tuple[int, ...], deadline: float) -> Any:
        child = self.host.split(color, ranks, deadline)
        return None if child is None else over(child, deadline)

    def drop_shared(self) -> None:
        """Unmap this group's segments without a word to anyone (a survivor's old world, after a
        rank died under ``meshkit-run --survive``: its MPI communicator is revoked, not freed; a
        buffer handed out stays mapped until its views are gone)."""
        self.small.close()
        self.channel.close()
        self.segment.close()
        self.regions.clear()
        self._owners.clear()
        for pool in self._pools:
            pool.close()

    def free(self) -> None:
        self.drop_shared()
        self.host.free()


def _node_of(host: MPIEngine) -> MPI.Intracomm | None:
    """The ranks of ``host``'s communicator on this rank's node, as a communicator (collective over
    it): MPI's shared-memory split, or with simulated nodes (``MESHKIT_HOST_NAME`` on every rank)
    the ranks of the same simulated host. None where some ranks simulate nodes and others do not
    (no telling what shares a node), on every rank."""
    simulated = env.host_name()
    flags = np.array([simulated is not None, simulated is None], np.int8)
    host.comm.Allreduce(MPI.IN_PLACE, flags, MPI.MIN)
    if not flags[0] and not flags[1]:
        return None
    if simulated is None:
        return host.comm.Split_type(MPI.COMM_TYPE_SHARED, key=host.rank)
    names = _allgather_text(host.comm, simulated)
    return host.comm.Split(sorted(set(names)).index(simulated), host.rank)


def _hierarchical(host: MPIEngine, node: MPI.Intracomm, least: int, deadline: float) -> MPIEngine | HierarchicalEngine:
    """A group across nodes: its nodes' engines and one leader per node (collective over ``host``)."""
    sizes = np.array([node.Get_size()], np.int64)
    host.comm.Allreduce(MPI.IN_PLACE, sizes, MPI.MAX)
    leaders = host.comm.Split(0 if node.Get_rank() == 0 else MPI.UNDEFINED, host.rank)
    if sizes[0] < 2:  # one rank per node: nothing to share
        node.Free()
        if leaders != MPI.COMM_NULL:
            leaders.Free()
        return host
    node_engine = over(MPIEngine(node, host.mailbox), deadline)
    leaders_engine = None if leaders == MPI.COMM_NULL else MPIEngine(leaders, host.mailbox)
    return HierarchicalEngine(host, node_engine, leaders_engine, least, over)


def _shared_segment(host: MPIEngine, size: int) -> tuple[Segment | None, str]:
    """A segment of ``size`` bytes mapped by every rank of ``host`` (collective over it; the caller
    bounds it with a watchdog): rank 0 creates it, broadcasts its name, the others attach, and once
    all have (an all-reduce of the verdicts) rank 0 unlinks it. ``(None, why)`` on every rank where
    any rank could not."""
    me = host.world_ranks[host.rank]
    segment, problem = None, ""
    name = bytearray(NAME_BYTES)
    if host.rank == 0:
        try:
            segment = create(size)
            name[:len(segment.path)] = segment.path.encode()
        except OSError as exc:
            problem = f"rank {me} could not create it: {exc}"
    host.comm.Bcast([name, MPI.BYTE], 0)
    path = bytes(name).rstrip(b"\0").decode()
    if host.rank != 0 and path:
        try:
            segment = attach(path, size)
        except OSError as exc:
            problem = f"rank {me} could not map {path}: {exc}"
    ok = np.array([segment is not None], np.int8)
    host.comm.Allreduce(MPI.IN_PLACE, ok, MPI.MIN)  # every rank mapped it (or one could not)
    if host.rank == 0 and segment is not None:
        segment.unlink()  # from now on only the mappings hold it: nothing is left if a rank dies
    if segment is not None:
        segment.close_fd()
        if not ok[0]:
            segment.close()
            segment = None
    return segment, problem


def over(host: MPIEngine, deadline: float) -> MPIEngine | ShmEngine | HierarchicalEngine:
    """``host``'s engine with the shared-memory path where it applies, else ``host`` itself
    (collective over ``host``'s ranks: every rank gets the same kind). ``deadline``: the group's
    creation's; its blocking MPI steps run under a watchdog that ends the process past it."""
    if not applies(host.size):
        return host
    least, chunk, small = min_bytes(), chunk_bytes(host.size), small_bytes()
    size = segment_bytes(host.size, chunk)
    me = host.world_ranks[host.rank]
    limit = max(deadline - time.monotonic(), 1.0)
    with watched("creating the group's shared-memory segment (MPI's Split_type, Bcast, Allreduce)", me,
                 f"ranks {host.world_ranks}", host.world_ranks, limit):
        _check_same_settings(host, chunk)
        node = _node_of(host)
        if node is None:
            return host
        if node.Get_size() != host.size:  # collective over host: every rank sees the group span nodes
            return _hierarchical(host, node, least, deadline)
        node.Free()
        segment, problem = _shared_segment(host, size)
    if segment is None:
        if problem or host.rank == 0:
            logger.warning("meshkit: the shared-memory path is off for ranks %s (collectives go to MPI): %s",
                           host.world_ranks, problem or "a rank could not create or map the segment")
        return host
    channel = Channel(segment.memory, host.size, host.rank, chunk, small, host.world_ranks)
    channel.reuse = env.shm_reuse()
    if direct():
        with watched("checking cross-memory attach between the group's ranks (MPI's Allgather, Allreduce)", me,
                     f"ranks {host.world_ranks}", host.world_ranks, max(deadline - time.monotonic(), 1.0)):
            problem = _direct_problem(host, channel, segment.path.encode())
        if not problem:
            pids = _pids(host)
            channel.attach_directly(pids, direct_bytes(host.size))
            if direct_measured():
                with watched("timing cross-memory attach against a copy (MPI's Allgather, Allreduce)", me,
                             f"ranks {host.world_ranks}", host.world_ranks, max(deadline - time.monotonic(), 1.0)):
                    _choose_attach(host, channel, segment.memory, pids, chunk)
        elif host.rank == 0:
            logger.info("meshkit: ranks %s copy ordinary buffers through the shared segment (no cross-memory "
                        "attach: %s)", host.world_ranks, problem)
    if surviving():  # a survivor's revoke (its recovery began) wakes a wait for it (mpi_ulfm.revoke_watch)
        channel.abandoned = mpi_ulfm.revoke_watch(host.comm, "a collective over shared memory")
    # (the threshold depends on the probe, whose verdict every rank shares)
    return ShmEngine(host, segment, channel, min_bytes(channel.direct is not None), move_min_bytes())


def _check_same_settings(host: MPIEngine, chunk: int) -> None:
    """Raise on every rank where the path's settings differ between ``host``'s ranks (collective: one
    Allreduce). Each size picks a protocol (MPI, one meeting, chunks through the segment, cross-memory
    attach) and the protocols share the segment's flags, so ranks that picked differently would meet
    and read one another's buffers wrongly; a header names the call, not the protocol."""
    names = (env.SHM_MIN_BYTES, env.SHM_CHUNK_BYTES, env.SHM_SMALL_BYTES, env.SHM_SMALL_MIN_BYTES,
             env.SHM_SHARED_MIN_BYTES, env.SHM_MOVE_MIN_BYTES, env.SHM_CMA, env.SHM_REUSE)
    mine = np.array([min_bytes(), chunk, small_bytes(), small_min_bytes(), shared_min_bytes(), move_min_bytes(),
                     env.shm_cma(), env.shm_reuse()], np.int64)
    both = np.concatenate([mine, -mine])
    host.comm.Allreduce(MPI.IN_PLACE, both, op=MPI.MAX)
    most, least = both[:len(names)], -both[len(names):]
    differ = [f"{name} (from {int(least[i])} to {int(most[i])})" for i, name in enumerate(names) if most[i] != least[i]]
    if differ:
        raise DistValueError(f"meshkit.comm: rank {host.world_ranks[host.rank]}: the shared-memory path's settings "
                             f"differ between ranks {host.world_ranks}: {', '.join(differ)}; each size's protocol "
                             "depends on them, so every rank must have the same (set them alike in every rank's "
                             "environment, or MESHKIT_SHM=0)")


def _choose_attach(host: MPIEngine, channel: Channel, memory: Any, pids: list[int], chunk: int) -> None:
    """Where the kernel's copy measured over :data:`ATTACH_DEARER` times a user-space copy (the ranks'
    mean: every rank decides alike), ordinary buffers up to :data:`ATTACH_LARGE_BYTES` copy through
    the segment; the ratio is kept for ``describe()`` (collective over ``host``)."""
    dearer = channel.attach_ratio = _attach_dearer(host, channel, memory, pids, chunk)
    if dearer > ATTACH_DEARER:
        channel.attach_above = ATTACH_LARGE_BYTES
    if host.rank == 0:
        logger.info("meshkit: ranks %s: the kernel's copy between processes took %.1fx a user-space copy here, so "
                    "ordinary buffers %s", host.world_ranks, dearer,
                    f"up to {ATTACH_LARGE_BYTES} bytes copy through the segment" if channel.attach_above
                    else "move by cross-memory attach")


def _attach_dearer(host: MPIEngine, channel: Channel, memory: Any, pids: list[int], chunk: int) -> float:
    """How many times a user-space copy the kernel's copy between processes takes here: each rank
    reads up to 1 MiB of the next rank's first buffer in the segment by ``process_vm_readv`` (in the
    pieces the direct path uses) and copies the same bytes through its own mapping, best of three
    after a warm-up; the ratio, averaged over the ranks (collective: two MPI calls, under 1 ms)."""
    peer = (host.rank + 1) % host.size
    bases = np.zeros(host.size, np.int64)
    host.comm.Allgather(np.array([np.frombuffer(memory, np.uint8).ctypes.data], np.int64), bases)
    piece = min(direct_bytes(host.size), chunk)
    count = max(1, min(1 << 20, chunk) // piece)
    address = int(bases[peer]) + data_offset(host.size, chunk, peer, 0)
    theirs = channel.buffer(peer, 0, np.dtype(np.uint8), count * piece)
    scratch = np.empty(piece, np.uint8)
    transfer = cast(Any, channel.direct)
    kernel = user = float("inf")
    try:
        for attempt in range(4):  # the first maps and faults the pages in: not timed
            began = time.perf_counter()
            for k in range(count):
                transfer.read(pids[peer], address + k * piece, scratch)
            middle = time.perf_counter()
            for k in range(count):
                np.copyto(scratch, theirs[k * piece:(k + 1) * piece])
            ended = time.perf_counter()
            if attempt:
                kernel, user = min(kernel, middle - began), min(user, ended - middle)
    except OSError as exc:  # (the probe read the same peer: not expected) counted as dear, still collective
        logger.debug("meshkit: rank %d: timing cross-memory attach failed: %s", host.world_ranks[host.rank], exc)
        kernel, user = 1e9, 1.0
    ratio = np.array([kernel / max(user, 1e-9)])
    host.comm.Allreduce(MPI.IN_PLACE, ratio, op=MPI.SUM)
    return float(ratio[0]) / host.size


def _pids(host: MPIEngine) -> list[int]:
    """Every rank's pid (collective over ``host``)."""
    pids = np.zeros(host.size, np.int64)
    host.comm.Allgather(np.array([os.getpid()], np.int64), pids)
    return [int(p) for p in pids]


def _direct_problem(host: MPIEngine, channel: Channel, magic: bytes) -> str:
    """Why cross-memory attach cannot be used between ``host``'s ranks ("" where it can; collective:
    every rank gets the same verdict, a problem seen by any rank is named by it in the log).

    Every rank holds ``magic`` (the segment's random name: only this job's ranks know it) at an
    address it sends to the others, with its pid and its pid namespace; each reads every other's
    and compares (shm_cma.probe), and the verdicts are all-reduced."""
    mine = np.frombuffer(bytearray(magic), np.uint8)
    row = np.array([os.getpid(), mine.ctypes.data, channel.pidns], np.int64)
    rows = np.zeros((host.size, 3), np.int64)
    host.comm.Allgather(row, rows)
    if len(set(rows[:, 2].tolist())) != 1 or not rows[0, 2]:
        problem = "the ranks' pid namespaces differ or are unknown"
    else:
        problem = probe([int(p) for p in rows[:, 0]], [int(a) for a in rows[:, 1]], host.rank, magic)
    ok = np.array([not problem], np.int8)
    host.comm.Allreduce(MPI.IN_PLACE, ok, MPI.MIN)
    del mine
    if problem:
        logger.debug("meshkit: rank %d: no cross-memory attach: %s", host.world_ranks[host.rank], problem)
    return problem if not ok[0] and problem else ("" if ok[0] else "another rank could not read its peers")


def parts(engine: Any) -> list[Any]:
    """``engine`` and the engines it is made of (a shared-memory engine's MPI host, a hierarchical
    one's host, node and leaders), outermost first: what a survivor's shrink revokes."""
    if isinstance(engine, ShmEngine):
        return [engine, *parts(engine.host)]
    if isinstance(engine, HierarchicalEngine):
        inner = [engine.host, engine.node] + ([] if engine.leaders is None else [engine.leaders])
        return [engine, *(p for e in inner for p in parts(e))]
    return [engine]


def drop_shared(engine: Any) -> None:
    """Unmap the segments of ``engine`` and of the engines it is made of, without a word to anyone
    (:meth:`ShmEngine.drop_shared`: the old world's groups of a survivor under ``--survive``)."""
    for part in parts(engine):
        if isinstance(part, ShmEngine):
            part.drop_shared()
