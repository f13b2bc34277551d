"""Statistics over axes of a DTensor: ``var``, ``std``, ``average``, ``count_nonzero``, ``any``,
``all``, ``prod``, ``argmax``, ``argmin``, ``median``.

Per mesh dimension, with ``axes`` the reduced axes (every axis for ``axis=None``):

* a Shard on a kept axis stays a Shard (renumbered past the removed axes): no communication;
* Replicate stays Replicate;
* a Shard on a reduced axis is combined by the op's collective, named in each rule's docstring
  (``var``: one all-gather of every rank's ``(mean, M2)`` in one buffer, the counts being
  arithmetic, merged by Chan et al.'s
  parallel formula; ``prod``: one all-reduce PRODUCT; ``argmax``: one all-gather of every
  rank's ``(value, global index)``); ``count_nonzero``, ``any``, ``all`` and ``average`` leave a
  Partial (sum, max, min, sum) that the next op that needs the value all-reduces, as ``np.sum``;
  ``median`` moves the sharded axis away first (see :func:`.propagation.off_axes`);
* a Partial is all-reduced first, except where the op is linear in the terms (``average``
  keeps a Partial(sum|avg)).

Dtypes and NaN are NumPy's: ints and bools give float64 statistics, float32 stays float32, a
NaN anywhere in a line gives NaN (``argmax``: the first NaN's index, as NumPy). Complex ``var``
and ``std`` are real (``mean(|x - mean|^2)``, the merge with ``|m_k - m|^2``); complex
``argmax``/``argmin`` order by real then imaginary part, as NumPy's.

The layout facts each rule needs (placements, groups, counts, offsets) come from
:func:`.reduction_plan.reduction_plan`, worked out once per layout.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np

from ..comm import ReduceOp
from ..comm._seams import all_reduce_owned, array_namespace
from . import errors
from .dispatch import implements
from .dtensor import DTensor, _wrap
from .placements import Replicate
from .propagation import moved, no_out, norm_axes, off_axes, renumbered, \
    uniform_finite, unsupported, wrap
from . import reduction_plan as _plans
from .reduction_plan import gatherer, keep_compiled, reduction_plan

try:  # NumPy's count in C, without np.count_nonzero's Python wrapper (0.16 us against 0.6 on an 8x8 block)
    from numpy._core.multiarray import count_nonzero as _c_count
except ImportError:  # NumPy 1.x
    from numpy.core.multiarray import count_nonzero as _c_count

__all__ = ["var", "std", "average", "count_nonzero", "any_", "all_", "prod", "argmax", "argmin", "median"]

_F64 = np.dtype(np.float64)


def _stats_dtype(op: str, dtype: np.dtype) -> np.dtype:
    if dtype.kind not in "biufc":
        raise errors.type_error(op, f"dtype {dtype} has no variance")
    return dtype if dtype.kind in "fc" else np.dtype(np.float64)


@implements(np.var)
def var(a: Any, axis: Any = None, dtype: Any = None, out: Any = None, ddof: Any = 0, keepdims: Any = False,
        *, where: Any = True, mean: Any = None, correction: Any = None) -> DTensor:
    """``np.var``: local ``(count, mean, M2)`` per block, merged over a sharded reduced axis by
    Chan, Golub and LeVeque's parallel formula for all blocks at once (the global mean ``m`` from
    the counts and means, then ``M2 = sum M2_k + sum n_k (m_k - m)^2``, non-negative terms),
    never a sum of squares, so it is as accurate as NumPy's two passes. Cost: one all-gather per
    mesh dim sharding a reduced axis of ``2 x`` the output block, ``(mean, M2)`` packed in one
    buffer (the counts are arithmetic, kept in the reduction plan); the merge runs in mesh order
    on every rank, so the result is Replicate there, the same on all ranks. A Partial input is
    all-reduced first. Complex values give a real variance, ``mean(|x - mean|^2)``, as NumPy's."""
    return _moments("np.var", a, axis, dtype, out, ddof, keepdims, where, mean, correction, root=False)


@implements(np.std)
def std(a: Any, axis: Any = None, dtype: Any = None, out: Any = None, ddof: Any = 0, keepdims: Any = False,
        *, where: Any = True, mean: Any = None, correction: Any = None) -> DTensor:
    """``np.std``: the square root of :func:`var` (the same placements and cost)."""
    return _moments("np.std", a, axis, dtype, out, ddof, keepdims, where, mean, correction, root=True)


def _moments(op: str, a: Any, axis: Any, dtype: Any, out: Any, ddof: Any, keepdims: Any, where: Any,
             mean: Any, correction: Any, *, root: bool) -> DTensor:
    key = None
    if a.__class__ is DTensor and dtype is None and out is None and where is True and mean is None and \
            correction is None and (axis is None or axis.__class__ is int) and ddof.__class__ is int and \
            keepdims.__class__ is bool:  # an exact key: compiled
        local = a._local
        key = (op, id(a._mesh), a._shape, a._placements, local.dtype, local.__class__, axis, ddof, keepdims)
        found = _plans._compiled.get(key)  # compiled(key, mesh), inlined: the hot path
        if found is not None and found[0]() is a._mesh:
            return found[1](a)
    if not isinstance(a, DTensor):
        raise unsupported(op)
    if out is not None or where is not True or mean is not None:
        no_out(op, {"out": out, "where": where, "mean": mean})
    if correction is not None:
        ddof = correction
    axes = norm_axes(op, a.ndim, axis)
    work = np.dtype(dtype) if dtype is not None else _stats_dtype(op, a.dtype)
    plan = reduction_plan(a.device_mesh, a.shape, a.placements, axes, bool(keepdims))
    local = moved(op, "a", a, plan.need).to_local()
    xp = array_namespace(local)
    block = local.astype(work, copy=False)
    if work.kind == "c":
        return _complex_moments(a, block, plan, axes, keepdims, ddof, root, xp)
    # this rank's (mean, M2) packed in one buffer: the one all-gather below sends it as it is
    packed = xp.empty((2, *plan.reduced_block), dtype=work)
    m, m2 = packed[0], packed[1]
    if plan.n_local:
        if work.kind == "f" and work.itemsize >= 4:  # NumPy's mean: this sum and division (float16: in float32)
            block.sum(axis=axes, keepdims=True, out=m)
            m /= plan.n_local
        else:
            xp.mean(block, axis=axes, keepdims=True, out=m)
        dev = block - m
        xp.multiply(dev, dev, out=dev)  # in place, as NumPy's var: one temporary of the block, not two
        dev.sum(axis=axes, keepdims=True, out=m2)
    else:
        packed[...] = 0
    n_total = plan.total
    if plan.merged:
        both = plan.gather(packed)  # (blocks holding elements, 2, *block): one all-gather per mesh dim
        # Chan et al.'s merge of all blocks at once: the global mean, then M2 = sum M2_k + n_k (m_k - m)^2,
        # a sum of non-negative terms (no cancellation, unlike sum(x^2) - n m^2); summed in mesh order
        weights = None if plan.each else (plan.weights if work == _F64 and xp is np else
                                          xp.asarray(plan.weights.astype(work)))
        m2 = _merged_m2(both, plan.each, weights, n_total)
    denominator = n_total - ddof
    if denominator > 0:
        result = xp.true_divide(m2, denominator, out=m2)  # m2 is this call's own buffer
    else:
        _no_degrees_left()
        with np.errstate(divide="ignore", invalid="ignore"):  # ddof >= count: inf or NaN, as NumPy's
            result = xp.true_divide(m2, max(denominator, 0), out=m2)
    if root:
        result = xp.sqrt(result, out=result)
    if not keepdims:
        result = result.reshape(plan.squeezed_block)
    if result.dtype != work:
        result = result.astype(work)
    if key is not None and work.kind == "f" and work.itemsize >= 4 and work == local.dtype and plan.n_local and \
            plan.valid is None and denominator > 0 and _compilable(a, plan):
        keep_compiled(key, a._mesh, _moments_call(plan, axes, keepdims, denominator, root, work))
    return _wrap(result, a.device_mesh, plan.out, plan.shape)


def _no_degrees_left(frames: int = 0) -> None:
    """NumPy's warning where ``ddof`` is at least the count (the result is inf or NaN, as NumPy's),
    pointed at the caller of ``np.var``/``np.std`` (above _moments, the rule, __array_function__
    and ``frames`` more)."""
    warnings.warn("Degrees of freedom <= 0 for slice", RuntimeWarning, stacklevel=5 + frames)


def _merged_m2(both: Any, each: Any, weights: Any, total: int) -> Any:
    """Chan et al.'s merge of every block's ``(mean, M2)`` (``both``: blocks x 2 x ...) into the whole's
    M2, a new array: the global mean, then M2 = sum M2_k + n_k (m_k - m)^2, a sum of non-negative terms
    (no cancellation, unlike sum(x^2) - n m^2), summed in mesh order. ``each``: the count of every block
    where they are even (equal weights), else ``weights`` (n_k / n) and ``total`` (n)."""
    means = both[:, 0]
    if each:
        centre = means.sum(axis=0)
        centre /= len(means)
        delta = means - centre
        delta *= delta
        spread, scale = delta, each
    else:
        delta = means - (weights * means).sum(axis=0)
        spread = weights * delta
        spread *= delta
        scale = total
    m2 = both[:, 1].sum(axis=0)
    m2 += spread.sum(axis=0) * scale
    return m2


def _moments_call(plan: Any, axes: tuple[int, ...], keepdims: bool, denominator: int, root: bool, work: Any) -> Any:
    """:func:`_moments` compiled for one request (a real float block holding elements, every block
    along the merged dim holding some): the same NumPy in the same order, into a buffer packed for
    one prepared all-gather."""
    rb = plan.reduced_block
    packed_shape = (1, 2, *rb)
    gather = gatherer(plan, (2, *rb), work) if plan.groups else None
    n_local, each, total = plan.n_local, plan.each, plan.total
    weights = plan.weights if work == _F64 else plan.weights.astype(work)
    squeezed, placements, shape = plan.squeezed_block, plan.out, plan.shape

    def call(a: DTensor) -> DTensor:
        block = a._local
        packed = np.empty(packed_shape, dtype=work)
        m, m2 = packed[0, 0], packed[0, 1]
        block.sum(axis=axes, keepdims=True, out=m)
        m /= n_local
        dev = block - m
        np.multiply(dev, dev, out=dev)
        dev.sum(axis=axes, keepdims=True, out=m2)
        if gather is not None:
            m2 = _merged_m2(gather(packed), each, weights, total)  # (gathered: blocks, 2, *block)
        np.true_divide(m2, denominator, out=m2)
        if root:
            np.sqrt(m2, out=m2)
        return _wrap(m2 if keepdims else m2.reshape(squeezed), a._mesh, placements, shape)
    return call


def _complex_moments(a: DTensor, block: Any, plan: Any, axes: tuple[int, ...], keepdims: Any, ddof: Any,
                     root: bool, xp: Any) -> DTensor:
    """var/std of complex blocks, as NumPy's: ``mean(|x - mean|^2)``, real (float32 for complex64).
    The same merge with ``|m_k - m|^2``; the buffer is complex, M2 in its real part."""
    packed = xp.zeros((2, *plan.reduced_block), dtype=block.dtype)
    if plan.n_local:
        xp.mean(block, axis=axes, keepdims=True, out=packed[0])
        dev = block - packed[0]
        sq = dev.real * dev.real
        sq += dev.imag * dev.imag
        packed[1].real[...] = sq.sum(axis=axes, keepdims=True)
    m2 = packed[1].real.copy()
    if plan.merged:
        both = plan.gather(packed)
        real = m2.dtype
        weights = xp.asarray(plan.weights.astype(real))
        means = both[:, 0]
        delta = means - (weights * means).sum(axis=0)
        spread = delta.real * delta.real
        spread += delta.imag * delta.imag
        spread *= weights
        m2 = both[:, 1].real.sum(axis=0)
        m2 += spread.sum(axis=0) * plan.total
    if plan.total - ddof <= 0:
        _no_degrees_left(frames=1)  # called from _moments
    with np.errstate(divide="ignore", invalid="ignore"):  # ddof >= count: inf or NaN, as NumPy's
        result = m2 / max(plan.total - ddof, 0)
    if root:
        result = xp.sqrt(result)
    if not keepdims:
        result = result.reshape(plan.squeezed_block)
    return _wrap(xp.asarray(result), a.device_mesh, plan.out, plan.shape)


@implements(np.average)
def average(a: Any, axis: Any = None, weights: Any = None, returned: bool = False, *, keepdims: Any = False
            ) -> Any:
    """``np.average``: ``sum(a * w) / sum(w)`` with ``w`` a plain array (the same on every rank) or an
    all-Replicate DTensor: each rank weighs its own block (the weights are sliced to it), so a
    sharded reduced axis leaves Partial(sum) as ``np.sum`` does, no communication here; a
    Partial(sum|avg) input stays (the average is linear in it) where the weights are finite.
    Without weights, :func:`np.mean`'s rule."""
    op = "np.average"
    if not isinstance(a, DTensor):
        raise unsupported(op)
    if weights is None:
        result = np.mean(a, axis=axis, keepdims=bool(keepdims))
        if returned:
            count = a.size if axis is None else math.prod(a.shape[d] for d in norm_axes(op, a.ndim, axis))
            return result, float(count)
        return result
    if isinstance(weights, DTensor):
        if not all(p.is_replicate() for p in weights.placements):
            raise unsupported(op, a.placements, weights.placements)
        weights = weights.to_local()
    w = np.asarray(weights.get() if hasattr(weights, "get") else weights)
    axes = norm_axes(op, a.ndim, axis)
    if w.shape != a.shape:
        if axis is None:
            raise TypeError(errors.prefix(op) + "axis must be specified when shapes of a and weights differ")
        if w.ndim != 1 or len(axes) != 1:
            raise TypeError(errors.prefix(op) + "1D weights expected when shapes of a and weights differ")
        if w.shape[0] != a.shape[axes[0]]:
            raise ValueError(errors.prefix(op) + "length of weights differs from that of the specified axis")
        w = w.reshape(tuple(-1 if d == axes[0] else 1 for d in range(a.ndim)))
    full_w = np.broadcast_to(w, a.shape)
    wsum = np.sum(full_w, axis=axes, keepdims=bool(keepdims))
    if np.any(wsum == 0.0):
        raise ZeroDivisionError(errors.prefix(op) + "weights sum to zero, can't be normalized")
    keep = ("sum", "avg") if uniform_finite(w) else ()
    plan = reduction_plan(a.device_mesh, a.shape, a.placements, axes, bool(keepdims), keep)
    need, placements, shape = plan.need, plan.leaving("sum"), plan.shape
    src = moved(op, "a", a, need)
    local = src.to_local()
    xp = array_namespace(local)
    from .chunks import local_slices
    coordinate = a.device_mesh.get_coordinate()
    wl = xp.asarray(np.ascontiguousarray(full_w[local_slices(a.shape, a.device_mesh.shape, coordinate, need)]))
    dt = np.result_type(a.dtype, w.dtype, np.float64 if np.dtype(a.dtype).kind in "biu" else a.dtype)
    num = xp.sum(local * wl, axis=axes, keepdims=bool(keepdims), dtype=dt)
    out_slices = local_slices(shape, a.device_mesh.shape, coordinate, placements)
    den = np.asarray(wsum, dtype=dt)
    den_local = xp.asarray(np.ascontiguousarray(den[out_slices]) if den.ndim else den)
    result = wrap((num / den_local).astype(dt, copy=False), a.device_mesh, placements, shape)
    if returned:
        return result, wrap(xp.asarray(np.broadcast_to(den, shape)[out_slices]).astype(dt), a.device_mesh,
                            [Replicate() if p.is_partial() else p for p in placements], shape)
    return result


def _logical(op: str, fn: Any, partial: str, a: Any, axis: Any, keepdims: Any, dtype: Any = None) -> DTensor:
    """A reduction whose per-block results combine by ``partial`` (sum, max, min): that Partial left."""
    key = None
    if a.__class__ is DTensor and (axis is None or axis.__class__ is int) and keepdims.__class__ is bool:
        local = a._local
        key = (op, id(a._mesh), a._shape, a._placements, local.dtype, local.__class__, axis, keepdims)
        found = _plans._compiled.get(key)  # compiled(key, mesh), inlined: the hot path
        if found is not None and found[0]() is a._mesh:
            return found[1](a)
    if not isinstance(a, DTensor):
        raise unsupported(op)
    axes = norm_axes(op, a.ndim, axis)
    keep = bool(keepdims)
    plan = reduction_plan(a.device_mesh, a.shape, a.placements, axes, keep)
    placements = plan.leaving(partial)
    local = moved(op, "a", a, plan.need).to_local()
    # every axis without keepdims: axis=None, NumPy's fast path (count_nonzero counts in C, where a
    # tuple of axes casts the block to bool and sums it: 5 times slower on a 1024x64 block)
    along = None if not keep and len(axes) == local.ndim else axes
    result = fn(local, axis=along, keepdims=keep)
    if dtype is not None:
        result = result.astype(dtype, copy=False)
    if key is not None and dtype is None and _compilable(a, plan):
        shape = plan.shape
        done: list[Any] = [None]  # the program completing its results, once one full_tensor() found it
        if fn is _count and along is None:  # the whole count, NumPy's C count without the keywords' check
            def call(a: DTensor) -> DTensor:
                # np.array of the C count's int: 0.15 us, where np.empty and fill took 0.23 and
                # np.asarray(count, dtype=np.intp) 0.45
                return _wrap(np.array(_c_count(a._local), np.intp), a._mesh, placements, shape, done)
        else:
            def call(a: DTensor) -> DTensor:  # the rule compiled for this request: no communication
                return _wrap(fn(a._local, axis=along, keepdims=keep), a._mesh, placements, shape, done)
        keep_compiled(key, a._mesh, call)
    return _wrap(result, a.device_mesh, placements, plan.shape)


@implements(np.count_nonzero)
def count_nonzero(a: Any, axis: Any = None, *, keepdims: bool = False) -> DTensor:
    """``np.count_nonzero``: each rank counts its block; a sharded reduced axis leaves Partial(sum)
    (int64), no communication here. A Partial input is all-reduced first."""
    if a.__class__ is DTensor and axis is None and keepdims is False:  # the whole count: _logical's lookup, inlined
        found = _plans._compiled.get(("np.count_nonzero", id(a._mesh), a._shape, a._placements, a._local.dtype,
                                      a._local.__class__, None, False))
        if found is not None and found[0]() is a._mesh:
            return found[1](a)
    return _logical("np.count_nonzero", _count, "sum", a, axis, keepdims)


def _count(x: Any, axis: Any, keepdims: bool) -> Any:
    if x.__class__ is np.ndarray:
        # positional, without keywords: NumPy's own count in C (its keywords cost a Python-level check)
        return np.asarray(np.count_nonzero(x) if axis is None else np.count_nonzero(x, axis=axis, keepdims=keepdims),
                          dtype=np.intp)
    xp = array_namespace(x)
    return xp.asarray(xp.count_nonzero(x, axis=axis, keepdims=keepdims), dtype=np.intp)


@implements(np.any)
def any_(a: Any, axis: Any = None, out: Any = None, keepdims: Any = False, *, where: Any = True) -> DTensor:
    """``np.any``: each rank tests its block; a sharded reduced axis leaves Partial(max) of bools
    (an empty block gives False, max's identity), no communication here."""
    no_out("np.any", {"out": out, "where": where})
    return _logical("np.any", np.any, "max", a, axis, keepdims)


@implements(np.all)
def all_(a: Any, axis: Any = None, out: Any = None, keepdims: Any = False, *, where: Any = True) -> DTensor:
    """``np.all``: each rank tests its block; a sharded reduced axis leaves Partial(min) of bools
    (an empty block gives True, min's identity), no communication here."""
    no_out("np.all", {"out": out, "where": where})
    return _logical("np.all", np.all, "min", a, axis, keepdims)


@implements(np.prod)
def prod(a: Any, axis: Any = None, dtype: Any = None, out: Any = None, keepdims: Any = False,
         initial: Any = None, where: Any = True) -> DTensor:
    """``np.prod``: each rank multiplies its block (an empty one gives 1); a sharded reduced axis is
    combined by one all-reduce PRODUCT per mesh dim of the output block: Replicate there. A
    Partial input is all-reduced first. Integers wrap as NumPy's."""
    key = None
    if a.__class__ is DTensor and dtype is None and out is None and initial is None and where is True and \
            (axis is None or axis.__class__ is int) and keepdims.__class__ is bool:  # an exact key: compiled
        local = a._local
        key = ("prod", id(a._mesh), a._shape, a._placements, local.dtype, local.__class__, axis, keepdims)
        found = _plans._compiled.get(key)  # compiled(key, mesh), inlined: the hot path
        if found is not None and found[0]() is a._mesh:
            return found[1](a)
    op = "np.prod"
    if not isinstance(a, DTensor):
        raise unsupported(op)
    no_out(op, {"out": out, "where": where, "initial": initial})
    axes = norm_axes(op, a.ndim, axis)
    plan = reduction_plan(a.device_mesh, a.shape, a.placements, axes, bool(keepdims))
    local = moved(op, "a", a, plan.need).to_local()
    xp = array_namespace(local)
    result = xp.asarray(local.prod(axis=axes, dtype=dtype, keepdims=bool(keepdims)))  # a new array: ours
    if plan.merged:
        plan.reduce(result, ReduceOp.PRODUCT)
    if key is not None and _compilable(a, plan):
        keep_compiled(key, a._mesh, _prod_call(plan, axes, keepdims))
    return _wrap(result, a.device_mesh, plan.out, plan.shape)


def _compilable(a: DTensor, plan: Any) -> bool:
    """Whether a compiled call covers this request: NumPy blocks, nothing to move first, at most
    one group to combine over (the common cases; the rest keep the general path)."""
    return a._local.__class__ is np.ndarray and plan.need == a._placements and len(plan.groups) <= 1


def _prod_call(plan: Any, axes: tuple[int, ...], keep: bool) -> Any:
    """:func:`prod` compiled for one request: the block's product, one all-reduce PRODUCT, the wrap."""
    group = plan.groups[0] if plan.groups else None
    placements, shape, product = plan.out, plan.shape, ReduceOp.PRODUCT
    scalar = not shape

    def call(a: DTensor) -> DTensor:
        result = a._local.prod(axis=axes, keepdims=keep)
        if scalar:  # every axis reduced away: NumPy gives a scalar, the collective needs an array
            result = np.asarray(result)
        if group is not None:
            all_reduce_owned(group, result, product)  # a new array of ours: the public checks hold
        return _wrap(result, a._mesh, placements, shape)
    return call


def _arg(op: str, kind: str, a: Any, axis: Any, out: Any, keepdims: Any) -> DTensor:
    key = None
    if a.__class__ is DTensor and out is None and (axis is None or axis.__class__ is int) and \
            keepdims.__class__ is bool:  # an exact key: compiled
        local = a._local
        key = (op, id(a._mesh), a._shape, a._placements, local.dtype, local.__class__, axis, keepdims)
        found = _plans._compiled.get(key)  # compiled(key, mesh), inlined: the hot path
        if found is not None and found[0]() is a._mesh:
            return found[1](a)
    if not isinstance(a, DTensor):
        raise unsupported(op)
    if out is not None:
        no_out(op, {"out": out})
    dt = a.dtype
    if 0 in a.shape:
        raise ValueError(errors.prefix(op) + f"attempt to get {op[3:]} of an empty sequence")
    flat = axis is None
    if not flat and (isinstance(axis, bool) or not isinstance(axis, (int, np.integer))):
        raise TypeError(errors.prefix(op) + f"axis must be an int or None, got {axis!r}")  # NumPy's: one axis
    axes = norm_axes(op, a.ndim, axis)
    keep = bool(keepdims)
    mesh = a.device_mesh
    plan = reduction_plan(mesh, a.shape, a.placements, axes, keep)  # flat: every Shard is merged: Replicate
    local = moved(op, "a", a, plan.need).to_local()
    xp = array_namespace(local)
    # (value, global index) packed in one buffer of a dtype that holds both exactly: float64 for
    # float64 and anything of 4 bytes or less, else the values' own (int64, uint64, longdouble)
    # (complex: complex128 or the values' own, the index in the real part)
    pack = (_F64 if dt.itemsize <= 4 or dt == _F64 else dt) if dt.kind != "c" else \
        (np.dtype(np.complex128) if dt.itemsize <= 16 else dt)
    if flat:
        if local.size == 0:
            k, idx, val = 0, 0, 0
        else:
            k = int(local.argmax() if kind == "max" else local.argmin())
            idx = _global_flat(k, local.shape, plan.offset, a.shape)
            val = local.reshape(-1)[k]
        if plan.merged:
            mine = xp.empty(2, dtype=pack)
            mine[0] = val
            mine[1] = idx
            every = plan.gather(mine)  # (blocks holding elements, 2): one all-gather per mesh dim
            if not plan.ordered:  # the blocks put in global order of their candidates' indices
                every = every[xp.argsort(every[:, 1].real, kind="stable")]
            # the first extreme (NumPy's argmax/argmin take the first NaN as one, and order complex
            # numbers by real then imaginary part) among candidates in global order is the first
            j = int(every[:, 0].argmax() if kind == "max" else every[:, 0].argmin())
            idx = int(every[j, 1].real)
        result = xp.asarray(idx, dtype=np.intp)
        if keep:
            result = result.reshape(plan.shape)
        if key is not None and dt.kind in "biuf" and plan.valid is None and _compilable(a, plan):
            keep_compiled(key, mesh, _flat_arg_call(plan, kind, pack, a.shape))
        return _wrap(result, mesh, plan.out, plan.shape)
    ax = axes[0]
    if local.size == 0:
        idx = xp.zeros(plan.squeezed_block, dtype=np.intp)
        val = xp.zeros(plan.squeezed_block, dtype=local.dtype)
    else:
        idx = local.argmax(axis=ax) if kind == "max" else local.argmin(axis=ax)
        if plan.offset[ax]:
            idx += plan.offset[ax]
        # the value at each line's first extreme is the line's extreme (NaN where it has one: both
        # take it), without take_along_axis (several times argmax's own time on small blocks)
        val = (local.max(axis=ax) if kind == "max" else local.min(axis=ax)) if plan.merged else None
    if plan.merged:
        mine = xp.empty((2, *val.shape), dtype=pack)
        mine[0] = val
        mine[1] = idx
        every = plan.gather(mine)  # (blocks holding elements, 2, *rest): one all-gather per mesh dim
        # one reduced axis: the blocks along it come in its order, so the first extreme (NumPy's
        # argmax/argmin take the first NaN as one) among them is the first along the axis
        j = every[:, 0].argmax(axis=0) if kind == "max" else every[:, 0].argmin(axis=0)
        idx = xp.take_along_axis(every[:, 1], j[None], axis=0)[0]
        if dt.kind == "c":
            idx = idx.real
    idx = idx.astype(np.intp, copy=False)
    if keep:
        idx = xp.expand_dims(idx, ax)
    if key is not None and dt.kind in "biuf" and plan.valid is None and local.size and _compilable(a, plan):
        keep_compiled(key, mesh, _axis_arg_call(plan, kind, pack, ax, keep))
    return _wrap(idx, mesh, plan.out, plan.shape)


def _flat_arg_call(plan: Any, kind: str, pack: Any, shape: tuple[int, ...]) -> Any:
    """``argmax``/``argmin`` with ``axis=None`` compiled for one request (real values, every block
    holding some): the block's first extreme, its global flat index (one addition where the block
    is whole past its first axis), one prepared all-gather of both, the pick."""
    block, offset = plan.block, plan.offset
    whole = block[1:] == shape[1:]  # then only the first axis is offset, and flat indexes shift by a constant
    base = offset[0] * math.prod(shape[1:]) if whole and shape else 0
    gather = gatherer(plan, (2,), pack) if plan.groups else None
    ordered, placements, out_shape = plan.ordered, plan.out, plan.shape
    first = "argmax" if kind == "max" else "argmin"

    def call(a: DTensor) -> DTensor:
        local = a._local
        k = int(getattr(local, first)())
        idx = k + base if whole else _global_flat(k, block, offset, shape)
        if gather is not None:
            mine = np.empty((1, 2), dtype=pack)
            mine[0, 0] = local.item(k)
            mine[0, 1] = idx
            every = gather(mine)
            if not ordered:
                every = every[np.argsort(every[:, 1], kind="stable")]
            j = int(getattr(every[:, 0], first)())
            idx = int(every[j, 1])
        result = np.asarray(idx, dtype=np.intp)
        return _wrap(result.reshape(out_shape) if out_shape else result, a._mesh, placements, out_shape)
    return call


def _axis_arg_call(plan: Any, kind: str, pack: Any, ax: int, keep: bool) -> Any:
    """``argmax``/``argmin`` along one axis compiled for one request (real values, every block holding
    some): each line's first extreme and its global index, packed for one prepared all-gather, the
    pick of the first extreme in global order (by indexing where the lines form one axis)."""
    rest = plan.squeezed_block
    off = plan.offset[ax]
    gather = gatherer(plan, (2, *rest), pack) if plan.groups else None
    lines = np.arange(rest[0]) if len(rest) == 1 else None
    placements, shape = plan.out, plan.shape
    first, extreme = ("argmax", "max") if kind == "max" else ("argmin", "min")

    def call(a: DTensor) -> DTensor:
        local = a._local
        idx = getattr(local, first)(axis=ax)
        if off:
            idx += off
        if gather is not None:
            mine = np.empty((1, 2, *rest), dtype=pack)
            mine[0, 0] = getattr(local, extreme)(axis=ax)
            mine[0, 1] = idx
            every = gather(mine)
            j = getattr(every[:, 0], first)(axis=0)
            idx = every[j, 1, lines] if lines is not None else np.take_along_axis(every[:, 1], j[None], axis=0)[0]
            idx = idx.astype(np.intp, copy=False)
        if keep:
            idx = np.expand_dims(idx, ax)
        return _wrap(idx, a._mesh, placements, shape)
    return call


def _global_flat(k: int, local_shape: tuple[int, ...], offset: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """The global flat (C order) index of the block's flat index ``k``."""
    flat, stride = 0, 1
    for size, block, off in zip(reversed(shape), reversed(local_shape), reversed(offset)):
        k, within = divmod(k, block)
        flat += (within + off) * stride
        stride *= size
    return flat


@implements(np.argmax)
def argmax(a: Any, axis: Any = None, out: Any = None, *, keepdims: Any = False) -> DTensor:
    """``np.argmax``: each rank's ``(max, its global index)`` per line; over a sharded reduced axis
    one all-gather per mesh dim of both packed in one buffer (2 x the output block; float64, or
    the values' own dtype for 64-bit integers, which float64 does not hold exactly; complex128
    for complex values, the index in the real part) picks the first maximum in global order (the
    first NaN, as NumPy; complex ordered as NumPy orders it): Replicate there. ``axis=None``:
    global flat indices."""
    return _arg("np.argmax", "max", a, axis, out, keepdims)


@implements(np.argmin)
def argmin(a: Any, axis: Any = None, out: Any = None, *, keepdims: Any = False) -> DTensor:
    """``np.argmin``: as :func:`argmax`, the first minimum."""
    return _arg("np.argmin", "min", a, axis, out, keepdims)


@implements(np.median)
def median(a: Any, axis: Any = None, out: Any = None, overwrite_input: bool = False, keepdims: bool = False
           ) -> DTensor:
    """``np.median``: the reduced axes moved off the mesh first (:func:`.propagation.off_axes`: a
    Shard there goes by one all-to-all to a kept axis, else one all-gather; a Partial is
    all-reduced), then each rank's lines are whole and NumPy's median runs on them; kept Shards
    stay. ``axis=None`` gathers the whole array (every rank sorts it: for large arrays,
    redistribute to a layout with a kept axis and give ``axis``)."""
    op = "np.median"
    if not isinstance(a, DTensor):
        raise unsupported(op)
    no_out(op, {"out": out})
    axes = norm_axes(op, a.ndim, axis)
    src = off_axes(op, "a", a, axes)
    result = np.median(src.to_local(), axis=axes if axis is not None else None, keepdims=keepdims)
    keep = bool(keepdims)
    shape = tuple(1 if d in axes else s for d, s in enumerate(a.shape) if keep or d not in axes)
    placements = list(src.placements) if keep else renumbered(src.placements, axes)
    return wrap(array_namespace(src.to_local()).asarray(result), a.device_mesh, placements, shape)
