"""Redistribution: one collective per changing mesh dimension, never a full copy on one rank.

On mesh dimension ``i`` (its group ``mesh.get_group(i)``), with ``n`` ranks:

=====================  =============================================================
Shard(d) -> Replicate  ``all_gather_into_tensor`` (blocks padded to the chunk size, stripped)
Partial  -> Replicate  ``all_reduce`` with the Partial's op
Partial  -> Shard(d)   ``reduce_scatter_tensor`` (padded to ``n`` chunks, stripped)
Shard(d) -> Shard(e)   ``all_to_all_single`` (padded pieces, stripped)
Replicate -> Shard(d)  local slice, no communication
Replicate -> Partial   local: for sum, coordinate 0 keeps the value and the others hold -0.0
                       (the additive identity, so the sum is bit-exact); avg/max/min keep it
                       (avg, as torch: completing it computes (x + ... + x) / n, which may
                       round, one ulp off at n = 3; every other pair is bit-exact)
Shard -> Partial       all-gather, then as Replicate -> Partial
=====================  =============================================================

Nested shards (several mesh dims sharding one array dim) are undone innermost (rightmost mesh
dim) first and built outermost first, so every collective works on whole chunks of its parent
block, as torch does. Works on NumPy and CuPy blocks alike (``xp`` is the block's library).

The steps of a redistribution depend only on the mesh, the global shape and the two placements,
so they are worked out once (the plan, every chunk size and padding, axis orders, index tuples,
the groups) into a :func:`program` kept in a small table; a call looks it up and runs it. Copies
are the fewest the layout allows: the collectives write straight into the result's memory, an
all-to-all packs its send buffer with one copy (none when the target dim is the first axis) and
unpacks with none when the source dim is the first axis (else one, into the result).
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from typing import Any, Callable, Sequence

import numpy as np

from ..comm._seams import PreparedCollective, all_reduce_owned, array_namespace, positive_setting, prepare_collective
from ..mesh import DeviceMesh
from .chunks import chunk_range, chunk_size, local_shape_and_offset
from .placements import Partial, Placement, Replicate, Shard

__all__ = ["redistribute_local", "plan", "program", "cached", "remember", "run", "partition_value", "PROGRAMS_MAX",
           "PROGRAMS_ENV"]

logger = logging.getLogger("meshkit.tensor")


def _parent_size(shape: Sequence[int], mesh: DeviceMesh, coordinate: Sequence[int],
                 placements: Sequence[Placement], i: int, dim: int) -> int:
    """Size along ``dim`` of the block mesh dims ``< i`` leave this rank (what dim ``i`` cuts)."""
    outer = list(placements[:i]) + [Replicate()] * (len(placements) - i)
    return local_shape_and_offset(shape, mesh.shape, coordinate, outer)[0][dim]


def plan(src: Sequence[Placement], dst: Sequence[Placement]) -> list[tuple[int, Placement, Placement]]:
    """The steps ``(mesh dim, from, to)`` that take ``src`` to ``dst``, in order (see :func:`_plan`)."""
    return list(_plan(tuple(src), tuple(dst)))


@functools.lru_cache(maxsize=1024)
def _plan(src: tuple[Placement, ...], dst: tuple[Placement, ...]) -> tuple[tuple[int, Placement, Placement], ...]:
    """The steps ``(mesh dim, from, to)`` that take ``src`` to ``dst``, in order.

    Pure (cached; the tests read it). First (right to left) every Shard that changes, or that
    sits inside (to the right of) such a Shard or a new Shard of the same array dim, is undone:
    all-to-all straight to its target Shard where no other mesh dim shards either array dim
    (before or after), else all-gather to Replicate. Then (left to right) every remaining
    difference is applied.
    """
    cur = list(src)
    n = len(cur)
    undo = {i for i in range(n) if cur[i].is_shard() and cur[i] != dst[i]}
    for i in range(n):
        if cur[i] != dst[i]:
            dims = {p.dim for p in (cur[i], dst[i]) if isinstance(p, Shard)}
            undo |= {j for j in range(i + 1, n) if isinstance(cur[j], Shard) and cur[j].dim in dims}
    steps = []
    for i in sorted(undo, reverse=True):
        p, q = cur[i], dst[i]
        others = {x.dim for k in range(n) if k != i for x in (cur[k], dst[k]) if isinstance(x, Shard)}
        if isinstance(q, Shard) and q.dim != p.dim and p.dim not in others and q.dim not in others:
            steps.append((i, p, q))
            cur[i] = q
        else:
            steps.append((i, p, Replicate()))
            cur[i] = Replicate()
    for i in range(n):
        if cur[i] != dst[i]:
            steps.append((i, cur[i], dst[i]))
            cur[i] = dst[i]
    return tuple(steps)


# ---- compiled programs: the plan with every size, group and index worked out once ---------------
#
# Planning on every call cost about as much as the collective it planned, on small blocks (a
# world of one; moveaxis alone costs microseconds). A program is the plan compiled into closures
# (each step's sizes, indexes and prepared collective bound in), looked up by the placements the
# caller passed, so that a call on a known layout is: one dict lookup, the steps, the wrapping
# (benchmarks/dtensor.py shows the current cost beside the collective).

#: Programs kept; the oldest is dropped beyond this (a model has a few dozen distinct layouts).
PROGRAMS_MAX = 1024
#: The variable that changes it (a positive integer), read where a new program is kept.
PROGRAMS_ENV = "MESHKIT_DTENSOR_PROGRAMS"

_programs: dict[tuple[Any, ...], _Program] = {}
_programs_lock = threading.Lock()

Step = Callable[[Any], Any]  # block -> block


class _Program:
    """The steps of one redistribution on one mesh, run in order on the block (``program(block)``)."""

    __slots__ = ("mesh", "steps", "fresh", "moves", "target", "same", "_only")

    def __init__(self, mesh: DeviceMesh, steps: list[Step], fresh: bool,
                 moves: tuple[tuple[int, Placement, Placement], ...], target: tuple[Placement, ...],
                 same: bool) -> None:
        self.mesh = weakref.ref(mesh)  # keyed by id(mesh): the entry is this mesh's only while it lives
        self.steps = tuple(steps)
        self.fresh = fresh  # the last step leaves the block in memory of its own (a collective's output)
        self.moves = moves
        self.target = target  # the placements after it, normalized
        self.same = same  # nothing changes: the source is the result
        self._only = steps[0] if len(steps) == 1 and fresh else None  # the one-collective case, inlined

    def __call__(self, local: Any, copy: bool = True) -> Any:
        """This rank's block under the target placements, given its block under the source ones."""
        if _logs(DEBUG):
            for i, p, q in self.moves:
                logger.debug("redistribute on mesh dim %d: %r -> %r (block %s)", i, p, q, tuple(local.shape))
        only = self._only
        if only is not None:
            return only(local)
        for step in self.steps:
            local = step(local)
        return local if self.fresh or not copy else local.copy()


_logs, DEBUG = logger.isEnabledFor, logging.DEBUG


def program(mesh: DeviceMesh, shape: tuple[int, ...], src: tuple[Placement, ...],
            dst: tuple[Placement, ...]) -> _Program:
    """The compiled redistribution of a ``shape`` array on ``mesh`` from ``src`` to normalized ``dst`` (cached)."""
    found = cached(mesh, shape, src, dst)
    if found is not None:
        return found
    made = _compile(mesh, shape, src, dst)
    remember(made, mesh, shape, src, dst)
    return made


def cached(mesh: DeviceMesh, shape: tuple[int, ...], src: tuple[Placement, ...], dst: Sequence[Any]
           ) -> _Program | None:
    """The program made earlier for these arguments, ``dst`` as the caller gave it (None if none)."""
    try:
        found = _programs.get((id(mesh), shape, src, dst if dst.__class__ is tuple else tuple(dst)))
    except TypeError:  # unhashable entries: not placements; the caller's checks will say so
        return None
    return found if found is not None and found.mesh() is mesh else None


def remember(prog: _Program, mesh: DeviceMesh, shape: tuple[int, ...], src: tuple[Placement, ...],
             dst: Sequence[Placement]) -> None:
    """Keep ``prog`` for these arguments (``dst`` as the caller gave it, once it checked valid)."""
    limit = int(positive_setting(PROGRAMS_ENV, PROGRAMS_MAX, integer=True, where="meshkit.tensor"))
    key = (id(mesh), shape, src, tuple(dst))
    with _programs_lock:  # ranks of the local engine are threads: one writer at a time
        while key not in _programs and _programs and len(_programs) >= limit:  # the oldest make way
            _programs.pop(next(iter(_programs)), None)
        _programs[key] = prog


def redistribute_local(local: Any, mesh: DeviceMesh, shape: Sequence[int], src: Sequence[Placement],
                       dst: Sequence[Placement], *, copy: bool = True) -> Any:
    """This rank's block of the global array of ``shape`` under ``dst``, given its block under ``src``.

    Collective over the groups of the mesh dims that change. Never writes into ``local``. The
    result has its own memory (``copy``, what ``DTensor.redistribute`` returns: writing into it
    leaves the source DTensor's block alone) or, without ``copy`` (the op rules, which only read
    it), may be a view of ``local`` where no collective ran (Replicate -> Shard slices it).
    """
    return program(mesh, tuple(shape), tuple(src), tuple(dst))(local, copy)


def run(prog: _Program, local: Any, *, copy: bool = True) -> Any:
    """Run a compiled redistribution on this rank's block (see :func:`redistribute_local`)."""
    return prog(local, copy)


def _compile(mesh: DeviceMesh, shape: tuple[int, ...], src: tuple[Placement, ...],
             dst: tuple[Placement, ...]) -> _Program:
    coordinate = mesh.get_coordinate()
    moves = _plan(src, dst)
    cur = list(src)
    steps: list[Step] = []
    fresh = False  # True once a step has put the block into memory of its own
    for i, p, q in moves:
        group = mesh.get_group(i)
        n, r = mesh.shape[i], coordinate[i]
        block = local_shape_and_offset(shape, mesh.shape, coordinate, cur)[0]
        if isinstance(p, Shard) and isinstance(q, Shard):
            parent_p = _parent_size(shape, mesh, coordinate, cur, i, p.dim)
            parent_q = _parent_size(shape, mesh, coordinate, cur, i, q.dim)
            steps.append(_all_to_all_step(group, block, p.dim, q.dim, parent_p, parent_q, n, r))
            fresh = True
        elif isinstance(p, Shard):
            steps.append(_all_gather_step(group, block, p.dim, _parent_size(shape, mesh, coordinate, cur, i, p.dim),
                                          n))
            fresh = True
            if isinstance(q, Partial) and _partitions(q, r):
                steps.append(functools.partial(_partition, q=q, r=r))
        elif isinstance(p, Replicate):
            if isinstance(q, Shard):
                start, stop = chunk_range(block[q.dim], n, r)
                index = [slice(None)] * len(block)
                index[q.dim] = slice(start, stop)
                steps.append(functools.partial(_take, index=tuple(index)))
            elif _partitions(q, r):
                steps.append(functools.partial(_partition, q=q, r=r))
                fresh = True
        else:  # Partial -> Replicate, Shard or another Partial
            fresh = True
            if isinstance(q, Shard):
                steps.append(_reduce_scatter_step(group, block, q.dim, p.op, n, r))
            else:
                steps.append(_all_reduce_step(group, p.op))
                if isinstance(q, Partial) and _partitions(q, r):
                    steps.append(functools.partial(_partition, q=q, r=r))
        cur[i] = q
    return _Program(mesh, steps, fresh, moves, dst, src == dst)


def partition_value(local: Any, q: Partial, r: int) -> Any:
    """Replicate -> Partial on one mesh dim: the terms whose reduction is ``local``."""
    if not _partitions(q, r):
        return local
    return _partition(local, q=q, r=r)


def _partitions(q: Partial, r: int) -> bool:
    """Whether coordinate ``r``'s term differs from the value (a sum keeps it at coordinate 0 only)."""
    return q.reduce_op == "sum" and r != 0


def _partition(local: Any, *, q: Partial, r: int) -> Any:
    xp = array_namespace(local)
    if local.dtype.kind in "fc":
        return xp.full_like(local, -0.0)  # x + (-0.0) == x for every x, +0.0 included
    return xp.zeros_like(local)


def _take(local: Any, *, index: tuple[slice, ...]) -> Any:
    return local[index]


def _front(ndim: int, dim: int) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """Axis orders that bring ``dim`` first and put it back (None: it is first already)."""
    if dim == 0:
        return None, None
    front = (dim, *range(dim), *range(dim + 1, ndim))
    back = (*range(1, dim + 1), 0, *range(dim + 1, ndim))
    return front, back


def _pad0(xp: Any, block: Any, size: int) -> Any:
    """``block`` zero-padded along its first axis to ``size`` rows, C-contiguous."""
    out = xp.zeros((size,) + tuple(block.shape[1:]), dtype=block.dtype)
    out[:block.shape[0]] = block
    return out


def _all_gather_step(group: Any, block: tuple[int, ...], dim: int, parent: int, n: int) -> Step:
    """Shard(dim) -> Replicate: gather the padded chunks straight into the result, keep ``parent`` rows."""
    c = chunk_size(parent, n)
    front, back = _front(len(block), dim)
    pad = block[dim] != c
    send_shape = (c, *block[:dim], *block[dim + 1:])
    gather = prepare_collective(group, "all_gather_into_tensor", send_shape)
    if front is None and not pad and parent == n * c:  # the common case: the gathered buffer is the result
        return gather

    def step(local: Any) -> Any:
        send = local if front is None else local.transpose(front)
        out = gather(_pad0(array_namespace(local), send, c) if pad else send)
        if parent != n * c:
            out = out[:parent]
        return out if back is None else out.transpose(back)
    return step


def _reduce_scatter_step(group: Any, block: tuple[int, ...], dim: int, op: Any, n: int, r: int) -> Step:
    """Partial -> Shard(dim): reduce the padded array, keep this rank's chunk."""
    parent = block[dim]
    c = chunk_size(parent, n)
    start, stop = chunk_range(parent, n, r)
    keep = stop - start
    front, back = _front(len(block), dim)
    pad = parent != n * c
    scatter = prepare_collective(group, "reduce_scatter_tensor", (n * c, *block[:dim], *block[dim + 1:]),
                                 reduce_op=op)
    if front is None and not pad:  # the common case: the scattered chunk is the result
        return scatter

    def step(local: Any) -> Any:
        send = local if front is None else local.transpose(front)
        out = scatter(_pad0(array_namespace(local), send, n * c) if pad else send)
        if keep != c:
            out = out[:keep]
        return out if back is None else out.transpose(back)
    return step


def _all_reduce_step(group: Any, op: Any) -> Step:
    """Partial -> Replicate: all-reduce a copy (the source block stays this rank's term)."""
    all_reduce, ndarray = group.all_reduce, np.ndarray

    def step(local: Any) -> Any:
        if local.__class__ is ndarray:
            out = local.copy()  # C order, ours: the checks the public method makes hold by construction
            all_reduce_owned(group, out, op)
        else:  # a device array, or a 0-d NumPy scalar (an ndarray from it)
            out = array_namespace(local).array(local, copy=True, order="C")
            all_reduce(out, op)
        return out
    return step


def _all_to_all_step(group: Any, block: tuple[int, ...], d: int, e: int, parent_d: int, parent_e: int, n: int,
                     r: int) -> Step:
    """:func:`_all_to_all` with everything it needs for a block of shape ``block`` (``block[e] == parent_e``)."""
    ndim = len(block)
    cd, ce = chunk_size(parent_d, n), chunk_size(parent_e, n)
    piece = list(block)  # what goes to (and comes from) each rank, padded: d-chunk of mine x e-chunk of its
    piece[d], piece[e] = cd, ce
    piece_shape = (n, *piece)
    # the pack: None (e first, no padding: the block is the send buffer), a split shape and axis
    # order (one copy from a view), or the per-rank (destination, source) indexes of a padded copy
    if block[d] == cd and block[e] == n * ce:
        split = block[:e] + (n, ce) + block[e + 1:]
        order = None if e == 0 else (e, *range(e), *range(e + 1, ndim + 1))
        pack = (split, order, None)
    else:
        pieces = []
        for j in range(n):
            start, stop = chunk_range(parent_e, n, j)
            if stop > start:
                to = [slice(None)] * ndim
                to[d], to[e] = slice(0, block[d]), slice(0, stop - start)
                frm = [slice(None)] * ndim
                frm[e] = slice(start, stop)
                pieces.append((j, tuple(to), tuple(frm)))
        pack = (None, None, tuple(pieces))
    # the unpack: recv[i] is rank i's d-chunk of my e-chunk; joined along d they are my block
    start, stop = chunk_range(parent_e, n, r)
    mine_e = stop - start
    order = (*range(1, d + 1), 0, *range(d + 1, ndim + 1))  # n next to d: (..., n, cd, ...)
    at_e = e if e < d else e + 1  # axis e after that move
    final = list(piece)
    final[d], final[e] = parent_d, mine_e
    if d == 0:  # the received buffer is the result (a view of it when padding is stripped)
        index = [slice(None)] * ndim
        index[0], index[e] = slice(0, parent_d), slice(0, mine_e)
        unpack = ("view", (n * cd, *piece[1:]), None if (parent_d == n * cd and mine_e == ce) else tuple(index))
    elif parent_d == n * cd:  # one copy, straight into the result
        index = [slice(None)] * (ndim + 1)
        index[at_e] = slice(0, mine_e)
        split_final = (*final[:d], n, cd, *final[d + 1:])
        unpack = ("copy", (tuple(final), split_final, order), None if mine_e == ce else tuple(index))
    else:  # padded along d: join (a copy) then strip
        index = [slice(None)] * ndim
        index[d], index[e] = slice(0, parent_d), slice(0, mine_e)
        unpack = ("join", ((*piece[:d], n * cd, *piece[d + 1:]), order), tuple(index))
    exchange = prepare_collective(group, "all_to_all_single", piece_shape)
    return functools.partial(_all_to_all, exchange=exchange, piece_shape=piece_shape, pack=pack, unpack=unpack)


def _all_to_all(local: Any, *, exchange: PreparedCollective, piece_shape: tuple[int, ...], pack: tuple[Any, ...],
                unpack: tuple[Any, ...]) -> Any:
    """Shard(d) -> Shard(e): send each rank its e-chunk of my d-chunk; join the d-chunks received.

    One copy at most on each side. The pack: none when ``e`` is the first axis and nothing is
    padded (the block is the send buffer); else one ``copyto`` from the block viewed with axis
    ``e`` split into ``(n, ce)`` and ``n`` brought first (per rank, into a zeroed buffer, when
    padded). The unpack: none when ``d`` is the first axis (the received buffer is the result, or
    a view of it without the padding); else one ``copyto`` into the result viewed as
    ``(..., n, cd, ...)``.
    """
    xp = array_namespace(local)
    split, order, pieces = pack
    if pieces is not None:
        send = xp.zeros(piece_shape, dtype=local.dtype)
        for j, to, frm in pieces:
            send[j][to] = local[frm]
    elif order is None:
        send = xp.ascontiguousarray(local.reshape(split))
    else:
        send = xp.empty(piece_shape, dtype=local.dtype)
        xp.copyto(send, local.reshape(split).transpose(order))
    recv = exchange(send)
    how, shapes, index = unpack
    if how == "view":
        out = recv.reshape(shapes)
        return out if index is None else out[index]
    if how == "copy":
        final, split_final, order = shapes
        out = xp.empty(final, dtype=local.dtype)
        xp.copyto(out.reshape(split_final), recv.transpose(order) if index is None else recv.transpose(order)[index])
        return out
    joined_shape, order = shapes
    return recv.transpose(order).reshape(joined_shape)[index]
