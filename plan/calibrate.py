"""Measure this machine: each mesh dimension's alpha-beta per collective kind and the local
matmul rate, fitted into a :class:`~meshkit.plan.machine.Machine`.

Timing follows benchmarks/_common.py: a barrier before each call, a call's time is the MAX over
the group's ranks (a collective is as slow as its slowest rank), the median over ``repeats``
rounds (rejects the noise bursts of a shared machine). ``send_recv`` is half a ping-pong between
the group's ranks 0 and 1. Each timed call follows a pass over 64 MiB of the rank's memory
(``evict_bytes``), as a step's collectives follow its computation: cold caches. The fit
minimizes the *relative* squared error of ``alpha + bus_bytes * beta`` (bus bytes: :func:`~meshkit.plan.machine.bus_bytes`), so the small
sizes, whose times are latency, weigh as much as the large; ``fit_error`` is the mean relative
error of the fit at the measured points.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import numpy as np

from ..comm import DistValueError, ReduceOp
from .. import comm as _c
from ..mesh import DeviceMesh
from ..parallel import SGD, AdamW
from .machine import KINDS, Level, LinkCost, Machine, bus_bytes

__all__ = ["calibrate", "fit_alpha_beta"]

#: Kinds the shared-memory path runs in place on a buffer of the group's shared memory (comm/engines/shm.py),
#: at every size: calibrated as the level's ``"shm"`` path where the group's ranks share a node.
SHARED_KINDS = ("all_reduce", "all_gather", "reduce_scatter")

#: Default message sizes (bytes): latency-bound to bandwidth-bound on a host, and fast (< 1 s
#: per dimension at 2 ranks on the local engine).
SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 20)
#: Collectives per round of the sync-cost measurement (each after two matmuls).
SYNC_CALLS = 20
#: Bytes each rank writes before a timed collective (twice a 32 MiB L3), 0 to time them hot.
EVICT_BYTES = 64 << 20
#: Bytes of the copy-rate measurement: a bucket's or a layer's size, past the 1 MiB L2 of a core.
COPY_BYTES = 1 << 22


def fit_alpha_beta(bus: Sequence[float], seconds: Sequence[float]) -> tuple[LinkCost, float]:
    """Least squares of ``t = alpha + b * beta`` weighted by ``1 / t`` (relative error), both kept
    >= 0; returns the cost and the mean relative error at the points."""
    b, t = np.asarray(bus, float), np.asarray(seconds, float)
    t = np.maximum(t, 1e-9)
    a = np.stack([np.ones_like(b), b], axis=1) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if alpha < 0:  # refit through the origin
        alpha, beta = 0.0, float(np.sum(b / t) / np.sum((b / t) ** 2))
    if beta < 0:
        alpha, beta = float(len(t) / np.sum(1 / t)), 0.0
    pred = alpha + b * beta
    return LinkCost(float(alpha), float(beta)), float(np.mean(np.abs(pred - t) / t))


def _timed(fn: Callable[[], Any], group: Any, repeats: int, warm: bool = True,
           before: Callable[[], Any] | None = None) -> float:
    times = []
    if warm:
        fn()  # warm-up: first-call setup is not the link's cost
    for _ in range(repeats):
        if before is not None:
            before()
        _c.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    worst = np.asarray(times)
    _c.all_reduce(worst, ReduceOp.MAX, group=group)
    return statistics.median(worst.tolist())


def _everywhere(flag: bool, mesh: DeviceMesh) -> bool:
    """Whether ``flag`` holds on every rank of ``mesh`` (a MIN over each dimension in turn)."""
    agreed = np.array([1 if flag else 0], np.int32)
    for dim in range(mesh.ndim):
        _c.all_reduce(agreed, ReduceOp.MIN, group=mesh.get_group(dim))
    return bool(agreed[0])


def _evictor(nbytes: int) -> Callable[[], None]:
    """A pass over ``nbytes`` of this rank's own memory: run before each timed collective, it
    leaves the collective's buffers out of the caches, as a training step's computation leaves
    its buckets and shards (a 3.3 MB all-reduce at 2 ranks here: 0.77 ms when its buffer is hot,
    2.3 ms after a pass of matmuls)."""
    sink = np.empty(max(1, nbytes // 8))

    def evict() -> None:
        sink.fill(1.0)
    return evict


def _ops(kind: str, nbytes: int, group: Any, shared: Any = None) -> tuple[Callable[[], Any], float]:
    """A call of ``kind`` moving ``nbytes`` (the convention of machine.py) and its bus bytes; with
    ``shared`` (float32 of the group's ``shared_buffer``, large enough) the buffer is a view of it,
    as the strategies' buckets and flat buffers are (an all_gather in place, as ZeRO's)."""
    n, me = group.size, group.rank
    per = max(1, nbytes // (4 * n))  # float32 elements per rank's piece
    full = np.ones(per * n, np.float32) if shared is None else shared[:per * n]
    piece = np.ones(per, np.float32) if shared is None or kind != "all_gather" else full[me * per:(me + 1) * per]
    size = full.nbytes
    if kind == "all_reduce":
        fn = lambda: _c.all_reduce(full, group=group)  # noqa: E731
    elif kind == "all_gather":
        fn = lambda: _c.all_gather_into_tensor(full, piece, group=group)  # noqa: E731
    elif kind == "reduce_scatter":
        fn = lambda: _c.reduce_scatter_tensor(piece, full, group=group)  # noqa: E731
    elif kind == "all_to_all":
        out = np.empty_like(full)
        fn = lambda: _c.all_to_all_single(out, full, group=group)  # noqa: E731
    elif kind == "broadcast":
        fn = lambda: _c.broadcast(full, group=group, group_src=0)  # noqa: E731
    elif kind == "reduce":
        fn = lambda: _c.reduce(full, group=group, group_dst=0)  # noqa: E731
    else:  # send_recv: a ping-pong between group ranks 0 and 1, halved below
        def fn() -> None:
            if me == 0:
                _c.send(full, group=group, group_dst=1)
                _c.recv(full, group=group, group_src=1)
            elif me == 1:
                _c.recv(full, group=group, group_src=0)
                _c.send(full, group=group, group_dst=0)
    return fn, bus_bytes(kind, size, n)


def _busy_rate(work: Callable[[], Any], units: float, mesh: DeviceMesh, repeats: int, window: float) -> float:
    """Units per second of ``work`` on this rank while every rank of ``mesh`` runs it too: each
    round starts together (a barrier over each dimension) and repeats ``work`` for ``window``
    seconds; the median over ``repeats`` rounds. Ranks that share cores (4 ranks on 2) share
    them here as they do in a step; a lone short call would see a whole core (calibrated
    alone, 4 ranks on 2 cores predicted half the measured compute)."""
    work()
    rates = []
    for _ in range(repeats):
        for dim in range(mesh.ndim):
            _c.barrier(group=mesh.get_group(dim))
        done, t0 = 0, time.perf_counter()
        while True:
            work()
            done += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= window:
                break
        rates.append(done * units / elapsed)
    return statistics.median(rates)


def _matmul_rate(dtype: str, n: int, mesh: DeviceMesh, repeats: int, window: float) -> float:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n)).astype(dtype), rng.standard_normal((n, n)).astype(dtype)
    return _busy_rate(lambda: a @ b, 2 * n ** 3, mesh, repeats, window)


def _pointwise_rate(dtype: str, n: int, mesh: DeviceMesh, repeats: int, window: float) -> float:
    """Elements per second of an activation's forward (``tanh``) and backward (``g * (1 - h**2)``)
    over ``n`` x ``n`` values: NumPy evaluates them element by element, at a rate of its own."""
    rng = np.random.default_rng(0)
    z, g = rng.standard_normal((n, n)).astype(dtype), rng.standard_normal((n, n)).astype(dtype)

    def activation() -> None:
        h = np.tanh(z)
        g * (1 - h ** 2)

    return _busy_rate(activation, n * n, mesh, repeats, window)


def _copy_rate(nbytes: int, mesh: DeviceMesh, repeats: int, window: float) -> float:
    """Bytes per second of ``array.copy()`` of ``nbytes``: a copy into a newly allocated array, as
    the strategies' packing of a collective's buffer allocates its destination (the allocator
    serves it from memory freed before, as it does in a step under meshkit-run's malloc settings)."""
    src = np.ones(nbytes // 8)
    return _busy_rate(src.copy, src.nbytes, mesh, repeats, window)


def _update_rate(optimizer: str, n: int, mesh: DeviceMesh, repeats: int, window: float) -> float:
    """float64 parameters per second that ``optimizer``'s step updates (one array of ``n``): the
    optimizer step is part of every training step (zero and fsdp update a shard, ddp everything)."""
    opt = AdamW(lr=1e-3) if optimizer == "adamw" else SGD(lr=0.1, momentum=0.9)
    params, grads = {"p": np.ones(n)}, {"p": np.full(n, 1e-3)}
    return _busy_rate(lambda: opt.step(params, grads), n, mesh, repeats, window)


def _overlap(group: Any, repeats: int, matmul_n: int) -> float:
    """How much of a 1 MiB all-reduce hides under a matmul chain of about its length launched
    beside it: ``(t_compute + t_comm - t_both) / min(t_compute, t_comm)``, clipped to [0, 1]."""
    buf = np.ones(1 << 18, np.float32)
    a = np.random.default_rng(0).standard_normal((matmul_n, matmul_n))
    comm = _timed(lambda: _c.all_reduce(buf, group=group), group, repeats)
    one = _timed(lambda: a @ a, group, repeats)
    chain = max(1, round(comm / max(one, 1e-9)))

    def compute() -> None:
        for _ in range(chain):
            a @ a

    def both() -> None:
        work = _c.all_reduce(buf, group=group, async_op=True)
        compute()
        work.wait()

    alone = _timed(compute, group, repeats)
    together = _timed(both, group, repeats)
    return float(np.clip((alone + comm - together) / max(min(alone, comm), 1e-9), 0.0, 1.0))


def _sync_cost(group: Any, repeats: int, matmul_n: int, evict: Callable[[], None] | None = None) -> float:
    """Seconds a small all-reduce costs between two stretches of computation beyond what it costs
    alone: every rank runs ``SYNC_CALLS`` times two ``matmul_n``-square matmuls then an 8-byte
    all-reduce, against the same matmuls without it. On a host with a core per rank it is the
    ranks' uneven arrival; with more ranks than cores, the wait for a peer that shares a core with
    a computing rank (at 4 ranks on 2 cores 1.7 ms a call, against 0.2 ms idle)."""
    a = np.random.default_rng(0).standard_normal((matmul_n, matmul_n))
    flag = np.ones(1, np.float64)

    def chain(sync: bool) -> None:
        for _ in range(SYNC_CALLS):
            a @ a
            a @ a
            if sync:
                _c.all_reduce(flag, group=group)

    # paired rounds, the median of their differences: a slow spell of a shared host hits both
    # halves of a pair (oversubscribed ranks' differences of medians varied several-fold between runs)
    chain(True)  # warm-up, once: both halves of each pair below run the same calls
    extra = [_timed(lambda: chain(True), group, 1, warm=False) - _timed(lambda: chain(False), group, 1, warm=False)
             for _ in range(repeats)]
    # less the call's cost after a pass over memory (the alpha-beta fit's conditions), so that
    # what remains is the uneven arrival alone
    idle = _timed(lambda: _c.all_reduce(flag, group=group), group, repeats, before=evict)
    return max(0.0, statistics.median(extra) / SYNC_CALLS - idle)


def calibrate(mesh: DeviceMesh, *, sizes: Sequence[int] = SIZES, repeats: int = 5, kinds: Sequence[str] = KINDS,
              matmul_n: int = 256, update_n: int = 1 << 18, compute_window: float = 0.05, memory_bytes: int = 0,
              name: str = "calibrated", evict_bytes: int = EVICT_BYTES) -> Machine:
    """Measure every dimension of ``mesh`` (collective: every rank of the mesh calls it, with the
    same arguments) and return the fitted :class:`Machine`, the same on every rank.

    Levels are the mesh's dimensions from the last (innermost) out, each of ``size`` = the ranks it
    spans with the dimensions inside it; a dimension of one rank is skipped. A mesh of several
    dimensions of more than one rank is also timed as one group of all its ranks, kept as the
    outermost level's ``sized`` costs (what flat data parallelism over the whole mesh pays).
    A dimension whose groups' ranks share a node (every group of it: the shared-memory path,
    comm/engines/shm.py) is also timed on buffers of the group's ``shared_buffer`` for all_reduce,
    all_gather and reduce_scatter, which take that path at every size (in place, as the strategies'
    buckets and flat buffers do), kept as the level's ``paths["shm"]`` costs; the ordinary buffers'
    fits time whatever path each size takes (MPI below ``MESHKIT_SHM_SMALL_MIN_BYTES``, the one-meeting
    path, cross-memory attach from ``MESHKIT_SHM_MIN_BYTES``: docs/collectives.md), as a user's call would.
    ``fit_error`` maps ``"dim.kind"`` (``"dim@size.kind"`` for a sized fit, ``"dim.shm.kind"`` for the path) to the fit's mean
    relative error; ``flops`` holds the float32 and float64 rates of an ``matmul_n``-square
    matmul on this rank (the slowest rank's, as agreed by MAX),
    ``pointwise_rate`` the elements per second of an activation's forward and backward (``tanh``)
    over as many values, and ``update_rate`` the float64 parameters per second of AdamW's and SGD's
    (momentum 0.9) step over ``update_n`` parameters and ``copy_rate`` the bytes per second of a
    4 MiB ``copy()``, each measured with every rank of the mesh
    busy at once for ``compute_window`` seconds a round (ranks sharing cores share them, as in a
    step); ``overlap`` how much of an all-reduce over the outermost dimension
    hides under a matmul chain beside it (the least over the ranks; 1 with one rank); ``sync_cost``
    what a collective over every rank costs between stretches of computation beyond its cost
    alone (the most over the ranks; 0 with one rank).

    Each timed collective follows a pass over ``evict_bytes`` of the rank's own memory (twice a
    32 MiB L3 by default; 0 times them hot): in a step, the computation before a collective has
    evicted its buffers and MPI's from the caches, and a hot calibration under-predicted every
    multi-rank step (a 3.3 MB all-reduce at 2 ranks took 0.77 ms hot, 2.3 ms after a
    pass of matmuls).
    """
    if not isinstance(mesh, DeviceMesh):
        raise DistValueError(f"meshkit.plan: calibrate: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    bad = [k for k in kinds if k not in KINDS]
    if bad or not sizes or any(int(s) < 4 for s in sizes) or repeats < 1 or not compute_window > 0:
        # the same arguments on every rank (collective): every rank raises the same error
        raise DistValueError(f"meshkit.plan: rank {mesh.get_rank()}: calibrate: kinds must be among {', '.join(KINDS)}, "
                             f"sizes >= 4 bytes and repeats >= 1; got kinds={list(kinds)}, sizes={list(sizes)}, "
                             f"repeats={repeats}, compute_window={compute_window} (> 0 seconds)")
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    evict = _evictor(evict_bytes) if evict_bytes else None
    # (dim, span, kind, bus bytes per size, group size for Level.sized or None, path or None); seconds in order
    plan, measured, span = [], [], 1
    groups = [(dim, mesh.get_group(dim), None) for dim in reversed(range(mesh.ndim))]
    wide = [dim for dim in range(mesh.ndim) if mesh.size(dim) > 1]
    if len(wide) > 1:
        # the whole mesh as one group (flat data parallelism's): its cost on the outermost level
        # is not that level's own groups' (Level.sized); flatten is collective, on every rank alike
        groups.append((wide[0], mesh.flatten("_".join(names) + "_calibrate").get_group(), mesh.size()))
    for dim, group, sized in groups:
        if sized is None:
            span *= group.size
        if group.size == 1:
            continue
        for kind in kinds:
            bus = []
            for size in sizes:
                fn, b = _ops(kind, int(size), group)
                t = _timed(fn, group, repeats, before=evict)
                bus.append(b)
                measured.append(t / 2 if kind == "send_recv" else t)
            plan.append((dim, span, kind, bus, sized, None))
        # groups whose ranks share a node: their shared buffers' path, too, where every group of the
        # dimension has it (agreed over the whole mesh, so every rank measures the same points)
        if sized is None and _everywhere(group.shares_memory(), mesh):
            largest = max(int(s) for s in sizes)
            shared = group.shared_buffer(-(-largest // (4 * group.size)) * group.size * 4).view(np.float32)
            for kind in (k for k in kinds if k in SHARED_KINDS):
                bus = []
                for size in sizes:
                    fn, b = _ops(kind, int(size), group, shared)
                    measured.append(_timed(fn, group, repeats, before=evict))
                    bus.append(b)
                plan.append((dim, span, kind, bus, None, "shm"))
    dtypes = ("float32", "float64")
    busy = (mesh, repeats, compute_window)
    measured += [-_matmul_rate(d, matmul_n, *busy) for d in dtypes]  # MIN rate as MAX of -rate
    measured += [-_pointwise_rate(d, matmul_n, *busy) for d in dtypes]
    measured += [-_update_rate(o, update_n, *busy) for o in ("adamw", "sgd")]
    measured.append(-_copy_rate(COPY_BYTES, *busy))
    widest = mesh.get_group(0) if mesh.ndim else None  # the outermost dimension: the most ranks per collective
    whole = groups[-1][1] if groups and groups[-1][2] is not None else widest  # every rank of the mesh
    measured.append(_sync_cost(whole, repeats, matmul_n, evict) if plan and whole.size > 1 else 0.0)
    measured.append(-_overlap(widest, repeats, matmul_n) if plan and widest.size > 1 else -1.0)
    # One machine on every rank: each point's MAX over the whole mesh (over each dimension in turn),
    # not just over the group that measured it (another group of the same dimension may be slower).
    agreed = np.asarray(measured)
    for dim in range(mesh.ndim):
        _c.all_reduce(agreed, ReduceOp.MAX, group=mesh.get_group(dim))
    levels: dict[int, Level] = {}
    errors = {}
    for i, (dim, dim_span, kind, bus, sized, path) in enumerate(plan):
        seconds = agreed[i * len(sizes):(i + 1) * len(sizes)]
        level = levels.setdefault(dim, Level(names[dim], dim_span, {}))
        if path is not None:
            level.paths.setdefault(path, {})[kind], errors[f"{names[dim]}.{path}.{kind}"] = fit_alpha_beta(bus, seconds)
        elif sized is None:
            level.costs[kind], errors[f"{names[dim]}.{kind}"] = fit_alpha_beta(bus, seconds)
        else:
            fitted = fit_alpha_beta(bus, seconds)
            level.sized.setdefault(sized, {})[kind], errors[f"{names[dim]}@{sized}.{kind}"] = fitted
    out = list(levels.values()) or [Level("self", 1, {k: LinkCost(0.0, 0.0) for k in kinds})]
    rates = [float(-v) for v in agreed[-9:-2]]
    return Machine(out, memory_bytes, dict(zip(dtypes, rates[0:2])), name, errors,
                   {"adamw": rates[4], "sgd": rates[5]}, float(-agreed[-1]), dict(zip(dtypes, rates[2:4])),
                   float(agreed[-2]), rates[6])
