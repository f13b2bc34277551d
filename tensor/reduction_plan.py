"""The layout facts of one reduction, worked out once per layout and kept: the hot path of
``var``, ``std``, ``prod``, ``argmax``, ``cumsum``, ``norm``, ``count_nonzero`` reads them.

A reduction of a DTensor over some axes needs, per call: the placements its input must hold and
its output gets, the mesh dims whose blocks are merged and their process groups, how many
elements every rank along those dims reduces (Chan's merge weighs the blocks by them; empty
blocks are left out), this rank's position among them and its block's offset. All of it depends
only on the mesh, the global shape, the placements and the axes, so :func:`reduction_plan`
computes it once and keeps it, keyed as :mod:`.redistribute` keeps its programs (by ``id`` of the
mesh, checked alive through a weak reference). Worked out per call, these facts cost several
times the local NumPy work of a reduction of an 8x8 block (issue 40's figures:
``benchmarks/dtensor.py --reduce-shapes``), and up to half of its time on 1024x64 blocks.

The calls compiled from a plan (:func:`compiled`, :func:`keep_compiled`): the rules of ``var``,
``std``, ``prod``, ``argmax``/``argmin``, ``cumsum``/``cumprod``, ``norm`` and ``count_nonzero``/
``any``/``all`` compile, for one exact request (the op, the mesh, the global shape, the
placements, the block's dtype and array type, and every argument that changes the result:
axis, keepdims, ddof...), a closure that does only the call's work: the local NumPy, one
collective on a buffer packed in place (prepared once: :func:`gatherer`), the merge and the
wrapping. The rule looks its request up first and runs the closure on a hit; a miss (or a
request the closures do not cover: CuPy blocks, complex values, empty blocks, inputs that must
move first) takes the rule's general path, which compiles the closure for the next call where it
can. Even with the plans kept, the general path's own Python cost 4-12 us a call on an 8x8 block
(placements, plan lookup, argument checks, the public collective's checks), as much as the
reduction's collective there (issue 40's figures). A key holds only exact values (a Python int
axis, a bool keepdims, an int ddof; anything else is not compiled), so no request can hit
another's closure: a different dtype, shape, axis, keepdims or placement is a different key
(tests/test_tensor_compiled.py). Compiled calls are bounded by the plans' variable, the
oldest dropped beyond it.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any, Callable

import numpy as np

from ..comm._seams import PreparedCollective, positive_setting, prepare_collective
from ..mesh import DeviceMesh
from .chunks import local_shape_and_offset
from .placements import Partial, Placement, Replicate, Shard

__all__ = ["ReductionPlan", "reduction_plan", "compiled", "keep_compiled", "gatherer", "PLANS_MAX", "PLANS_ENV"]

#: Plans kept by default; the oldest is dropped beyond this (as redistribute's PROGRAMS_MAX: a model
#: reduces a few dozen distinct layouts; a plan is a few hundred bytes plus its counts).
PLANS_MAX = 1024
#: The variable that changes it (a positive integer), read where a new plan is kept.
PLANS_ENV = "MESHKIT_DTENSOR_PLANS"

_plans: dict[tuple[Any, ...], "ReductionPlan"] = {}
_plans_lock = threading.Lock()
#: compiled calls: key (whose second entry is ``id(mesh)``) -> ``(weak mesh, closure)``
_compiled: dict[tuple[Any, ...], tuple[Any, Callable[[Any], Any]]] = {}


class ReductionPlan:
    """What a reduction over ``axes`` of a ``shape`` array laid out as ``placements`` needs.

    Attributes:
        need: the placements the input must hold (a Partial not in ``keep_partial`` becomes
            Replicate: the rule reduces it first).
        out: the output's placements; a mesh dim in ``sharding`` is Replicate here (the rule
            combines it, or sets the Partial it leaves).
        shape: the output's global shape.
        sharding: the mesh dims that shard a reduced axis (every one, for the placements).
        merged: those of more than one rank (the ones that communicate), and ``groups`` theirs.
        sizes: the number of ranks along each of ``merged``.
        counts: elements each rank along ``merged`` reduces, flat in mesh order (int64, read-only).
        valid: None if every count is positive, else the mask of the blocks that hold elements.
        total: elements reduced in all (``n_local`` where nothing is merged).
        n_local: elements this rank's block reduces.
        position: this rank's flat index among ``merged`` (mesh order).
        offset: this rank's block offset in the global array, under ``need``.
        block: this rank's block shape under ``need``; ``reduced_block`` it with the reduced axes
            kept as ones, ``squeezed_block`` without them (this rank's output block).
        ordered: the blocks along ``merged``, in mesh order, come in the global order of the
            reduced elements (one reduced axis, or only the first non-trivial axis sharded): the
            first hit among them is the first in the array.
        each: the count every block holds where all are equal (even blocks: Chan's merge needs
            no weights), else 0.
        weights: ``counts / total`` of the valid blocks, float64, shaped ``(k, 1, ...)`` with
            ``ndim`` ones (to broadcast against blocks of the input's rank, kept dims).
    """

    __slots__ = ("mesh", "need", "out", "shape", "sharding", "merged", "groups", "sizes", "counts", "valid",
                 "total", "n_local", "position", "offset", "block", "reduced_block", "squeezed_block", "ordered",
                 "each", "weights", "_leaving", "__weakref__")

    def __init__(self, mesh: DeviceMesh, shape: tuple[int, ...], placements: tuple[Placement, ...],
                 axes: tuple[int, ...], keepdims: bool, keep_partial: tuple[str, ...]) -> None:
        self.mesh = weakref.ref(mesh)
        self._leaving: dict[str, tuple[Placement, ...]] = {}
        need: list[Placement] = []
        out: list[Placement] = []
        sharding: list[int] = []
        for i, p in enumerate(placements):
            if isinstance(p, Shard) and p.dim in axes:
                need.append(p)
                out.append(Replicate())
                sharding.append(i)
            elif isinstance(p, Shard):
                need.append(p)
                out.append(Shard(p.dim if keepdims else p.dim - sum(ax < p.dim for ax in axes)))
            elif isinstance(p, Partial) and p.reduce_op in keep_partial:
                need.append(p)
                out.append(p)
            else:
                need.append(Replicate())
                out.append(Replicate())
        self.need, self.out, self.sharding = tuple(need), tuple(out), tuple(sharding)
        self.shape = tuple(1 if d in axes else s for d, s in enumerate(shape) if keepdims or d not in axes)
        mesh_shape = tuple(mesh.shape)
        me = tuple(mesh.get_coordinate())
        self.merged = tuple(i for i in sharding if mesh_shape[i] > 1)
        self.groups = tuple(mesh.get_group(i) for i in self.merged)
        self.sizes = tuple(mesh_shape[i] for i in self.merged)
        block, self.offset = local_shape_and_offset(shape, mesh_shape, me, self.need)
        self.offset = tuple(self.offset)
        self.block = tuple(block)
        self.reduced_block = tuple(1 if d in axes else s for d, s in enumerate(block))
        self.squeezed_block = tuple(s for d, s in enumerate(block) if d not in axes)
        self.n_local = math.prod(block[ax] for ax in axes)
        counts = np.zeros(self.sizes, dtype=np.int64)
        for idx in np.ndindex(*self.sizes):
            coordinate = list(me)
            for i, c in zip(self.merged, idx):
                coordinate[i] = c
            other = local_shape_and_offset(shape, mesh_shape, coordinate, self.need)[0]
            counts[idx] = math.prod(other[ax] for ax in axes)
        self.counts = counts.reshape(-1)
        self.counts.flags.writeable = False
        self.position = int(np.ravel_multi_index(tuple(me[i] for i in self.merged), self.sizes)) if self.merged else 0
        self.total = int(self.counts.sum()) if self.merged else self.n_local
        positive = self.counts > 0
        self.valid = None if bool(positive.all()) else positive
        self.each = int(self.counts[0]) if self.merged and bool((self.counts == self.counts[0]).all()) else 0
        weights = (self.counts[positive] / max(self.total, 1)).astype(np.float64)
        self.weights = weights.reshape((-1,) + (1,) * len(shape))
        self.weights.flags.writeable = False
        sharded_axes = {placements[i].dim for i in self.merged}
        first = next((d for d in axes if shape[d] > 1), None)
        self.ordered = len(axes) == 1 or (len(sharded_axes) <= 1 and (not sharded_axes or first in sharded_axes))

    def leaving(self, reduce_op: str) -> tuple[Placement, ...]:
        """``out`` with ``Partial(reduce_op)`` on every mesh dim in ``sharding``: the placements of a
        reduction that leaves the combining to the next op (``np.sum``'s Partial(sum))."""
        found = self._leaving.get(reduce_op)
        if found is None:
            found = tuple(Partial(reduce_op) if i in self.sharding else p for i, p in enumerate(self.out))
            self._leaving[reduce_op] = found
        return found

    def gather(self, x: Any, *, empty: bool = False) -> Any:
        """Every rank's ``x`` along ``merged``: ``(k, *x.shape)``, the ranks flat in mesh order, the
        empty blocks left out (``valid``) unless ``empty`` (then ``k`` is every rank, and row
        ``position`` is this rank's). One all-gather per merged mesh dim: the collective the
        merge needs, on a buffer of ``x``'s bytes per rank. Collective over ``groups``."""
        xp = _namespace(x)
        if not x.flags.c_contiguous:
            x = xp.ascontiguousarray(x)
        if len(self.groups) == 1:  # the common case: one group, straight into the result
            into = xp.empty((self.sizes[0], *x.shape), dtype=x.dtype)
            self.groups[0].all_gather_into_tensor(into, x[None])
        else:
            lead: tuple[int, ...] = ()
            into = x
            for group, n in zip(self.groups, self.sizes):
                flat = into.reshape((1, -1)) if into.size else into.reshape((1, 0))
                step = xp.empty((n, flat.shape[1]), dtype=x.dtype)
                group.all_gather_into_tensor(step, flat)
                # this dim's axis goes after the ones gathered before (mesh order kept)
                block = step.reshape((n, *lead, *x.shape))
                into = xp.ascontiguousarray(xp.moveaxis(block, 0, len(lead))) if lead else block
                lead = (*lead, n)
            into = into.reshape((-1, *x.shape))
        return into if self.valid is None or empty else into[self.valid]

    def reduce(self, x: Any, op: Any) -> Any:
        """``x`` all-reduced with ``op`` along ``merged``, in place (one all-reduce per merged mesh
        dim); ``x`` must be an array the caller owns."""
        for group in self.groups:
            group.all_reduce(x, op)
        return x


def _namespace(x: Any) -> Any:
    from ..comm._seams import array_namespace
    return np if x.__class__ is np.ndarray else array_namespace(x)


def reduction_plan(mesh: DeviceMesh, shape: tuple[int, ...], placements: tuple[Placement, ...],
                   axes: tuple[int, ...], keepdims: bool, keep_partial: tuple[str, ...] = ()) -> ReductionPlan:
    """The plan of reducing a ``shape`` array on ``mesh`` laid out as ``placements`` over sorted,
    non-negative ``axes`` (made once per layout and kept: see the module docstring)."""
    key = (id(mesh), shape, placements, axes, keepdims, keep_partial)
    found = _plans.get(key)
    if found is not None and found.mesh() is mesh:
        return found
    made = ReductionPlan(mesh, shape, placements, axes, keepdims, keep_partial)
    limit = int(positive_setting(PLANS_ENV, PLANS_MAX, integer=True, where="meshkit.tensor"))
    with _plans_lock:  # ranks of the local engine are threads: one writer at a time
        while key not in _plans and _plans and len(_plans) >= limit:  # the oldest make way
            _plans.pop(next(iter(_plans)), None)
        _plans[key] = made
    return made


def compiled(key: tuple[Any, ...], mesh: DeviceMesh) -> Callable[[Any], Any] | None:
    """The closure compiled for ``key`` (the op's exact request, ``id(mesh)`` in it) on ``mesh``, or None.

    One dict lookup and a weak reference's check (the entry is ``mesh``'s only while it lives:
    an id can be reused after a mesh dies)."""
    found = _compiled.get(key)
    if found is not None and found[0]() is mesh:
        return found[1]
    return None


def keep_compiled(key: tuple[Any, ...], mesh: DeviceMesh, call: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Keep ``call`` for ``key`` on ``mesh`` (the oldest dropped beyond ``MESHKIT_DTENSOR_PLANS``); returns it."""
    limit = int(positive_setting(PLANS_ENV, PLANS_MAX, integer=True, where="meshkit.tensor"))
    with _plans_lock:  # ranks of the local engine are threads: one writer at a time
        while key not in _compiled and _compiled and len(_compiled) >= limit:  # the oldest make way
            _compiled.pop(next(iter(_compiled)), None)
        _compiled[key] = (weakref.ref(mesh), call)
    return call


def gatherer(plan: ReductionPlan, shape: tuple[int, ...], dtype: Any) -> PreparedCollective:
    """The all-gather of a compiled call: one group (``plan.groups[0]``), inputs ``(1, *shape)`` of
    ``dtype`` to ``(n, *shape)``, checked once here instead of on every call (the public method's
    argument checks cost about a microsecond a call on small buffers)."""
    return prepare_collective(plan.groups[0], "all_gather_into_tensor", (1, *shape), dtype)
