"""``clip_grad_norm_``: torch's gradient clipping, correct for gradients sharded over a group.

With ``group=``, each rank of the group holds a disjoint shard of the gradients (ZeRO, FSDP): the
partial sums are all-reduced so every rank gets the norm of the whole, and clips its shard with
the same coefficient. DTensor gradients (tensor parallelism) carry their own layout: their
partial sums are all-reduced over each mesh dim they are sharded on, and counted once over each
mesh dim they are replicated on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...comm import DistTypeError, DistValueError, ProcessGroup, ReduceOp, all_reduce
from ...tensor import DTensor
from ..arrays import array_namespace, check_same_library, is_array, to_host
from ..checks import real, where

__all__ = ["clip_grad_norm_", "clip_grad_norm_parts"]

#: Elements per float64 chunk when clip_grad_norm_ accumulates a norm: bounds the float64 copy of
#: a float32/float16 gradient to 32 MB while keeping kernel launches few on GPU.
_NORM_CHUNK = 1 << 22


def _norm_order(norm_type: Any) -> float:
    if isinstance(norm_type, str) and norm_type.lower() == "inf":
        return math.inf
    p = real("clip_grad_norm_", "norm_type", norm_type)
    if not (p > 0):
        raise DistValueError(f"{where('clip_grad_norm_')}: norm_type={p!r} must be > 0 (or inf)")
    return p


def _partial_norm(a: Any, p: float) -> list[Any]:
    """``max |a|`` (p = inf) or ``sum |a|^p`` of each chunk of ``a``, as 0-d float64 arrays of
    ``a``'s library: on a device they stay there (no transfer per chunk)."""
    flat = a.reshape(-1)
    parts = []
    for start in range(0, flat.size, _NORM_CHUNK):
        chunk = flat[start:start + _NORM_CHUNK]
        if chunk.dtype != np.float64:
            chunk = chunk.astype(np.float64)
        if p == math.inf:
            parts.append(abs(chunk).max())  # max propagates nan, as the total must
        elif p == 2.0:
            parts.append(chunk.dot(chunk))
        elif p == 1.0:
            parts.append(abs(chunk).sum())
        else:
            parts.append((abs(chunk) ** p).sum())
    return parts


def clip_grad_norm_(grads: Mapping[str, Any] | Sequence[Any] | Any, max_norm: float, *, norm_type: float | str = 2.0,
                    group: ProcessGroup | None = None, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> float:
    """Scale gradients in place so that their total norm is at most ``max_norm``; as torch.

    The total norm is taken over all gradients as if concatenated: ``(sum |g|^p)^(1/p)``, or
    ``max |g|`` for ``p = inf``, accumulated in float64. With ``group``, each rank holds a disjoint
    shard of the gradients (ZeRO, FSDP): the partial sums (maxima for inf) are all-reduced over the
    group, so every rank gets the norm of the whole and applies the same coefficient.

    Then, as torch: ``clip_coef = max_norm / (total_norm + 1e-6)``, and every gradient is
    multiplied by ``min(clip_coef, 1)``. Multiplying by exactly 1.0 changes nothing, so the
    multiplication is skipped when ``clip_coef >= 1``; a nan norm still multiplies (torch's clamp
    keeps nan, so the gradients become nan, as in torch).

    Args:
        grads: a dict of arrays, a list of arrays, or one array; None entries are skipped.
            Entries may be DTensors: each is reduced over its own mesh (sums over the groups of
            the mesh dims it is ``Shard`` on; a ``Replicate`` dim counts its copy once); a
            ``Partial`` gradient is refused (reduce it first). ``group`` applies to the plain
            arrays only. Every rank of a DTensor's mesh must call, with the same DTensors.
        max_norm: the largest allowed total norm (>= 0).
        norm_type: the order ``p`` (> 0), or ``inf`` / ``"inf"``.
        group: a process group whose ranks hold disjoint shards of the gradients; a collective:
            every rank of the group must call it, also a rank that holds no gradient.
        error_if_nonfinite: raise when the total norm is nan or inf, before scaling anything.
        foreach: accepted for torch compatibility and ignored (there is one implementation).

    Returns:
        The total norm before clipping, as a Python float (the same on every rank of ``group``).

    Raises:
        TypeError: an entry is not a floating-point array.
        ValueError: ``max_norm`` or ``norm_type`` is out of range, or a DTensor is ``Partial``.
        RuntimeError: the norm is not finite and ``error_if_nonfinite`` is set.

    Example (2 ranks, the gradient ``[3, 4]`` split as ``[3]`` and ``[4]``)::

        norm = clip_grad_norm_([shard], 1.0, group=g)
        # both ranks: norm == 5.0; rank 0's shard becomes [0.6], rank 1's [0.8]
    """
    del foreach
    max_norm, p = _norm_args(max_norm, norm_type)
    if is_array(grads):
        items: list[tuple[str, Any]] = [("grads", grads)]
    elif isinstance(grads, Mapping):
        items = [(f"grads[{k!r}]", g) for k, g in grads.items()]
    elif isinstance(grads, Sequence) and not isinstance(grads, str):
        items = [(f"grads[{i}]", g) for i, g in enumerate(grads)]
    else:
        raise DistTypeError(f"{where('clip_grad_norm_')}: grads must be a dict, a list or an array, "
                            f"got {type(grads).__name__}")
    arrays: list[Any] = []
    first = ""
    dtensors: dict[tuple[Any, tuple[int, ...]], list[Any]] = {}  # (mesh, its Shard dims) -> blocks
    for label, g in items:
        if g is None:
            continue
        if isinstance(g, DTensor):
            if g.dtype.kind != "f":
                raise DistTypeError(f"{where('clip_grad_norm_')}: {label} must be a floating-point DTensor, "
                                    f"got dtype {g.dtype}")
            if any(q.is_partial() for q in g.placements):
                raise DistValueError(f"{where('clip_grad_norm_')}: {label} has placements {g.placements!r}; a "
                                     "Partial gradient holds terms, not values: redistribute it to its "
                                     "parameter's placements first")
            sharded = tuple(i for i, q in enumerate(g.placements) if q.is_shard())
            dtensors.setdefault((g.device_mesh, sharded), []).append(g.to_local())
            continue
        if not is_array(g) or g.dtype.kind != "f":
            kind = f"dtype {g.dtype}" if is_array(g) else type(g).__name__
            raise DistTypeError(f"{where('clip_grad_norm_')}: {label} must be a floating-point array, got {kind}")
        if arrays:
            check_same_library(where("clip_grad_norm_"), label, g, arrays[0], first)
        else:
            first = label
        arrays.append(g)

    parts = [(arrays, [group] if group is not None else [])]
    parts += [(blocks, [mesh.get_group(i) for i in sharded]) for (mesh, sharded), blocks in dtensors.items()]
    return _clip(parts, max_norm, p, norm_type, error_if_nonfinite)


def clip_grad_norm_parts(parts: Sequence[tuple[list[Any], list[ProcessGroup]]], max_norm: float, *,
                         norm_type: float | str = 2.0, error_if_nonfinite: bool = False) -> float:
    """:func:`clip_grad_norm_` of gradients given as ``(arrays, groups)`` parts, for strategies
    whose gradients are cut several ways (ZeRO's flat shards of tensor-parallel blocks).

    The partial norm of each part's ``arrays`` (disjoint pieces of the gradients) is all-reduced
    over each of its ``groups`` in turn; the parts' totals are combined and every array is scaled
    by the one coefficient. Collective: every rank of every group passes the same parts, in the
    same order, whether or not it holds arrays of them.
    """
    max_norm, p = _norm_args(max_norm, norm_type)
    return _clip(parts, max_norm, p, norm_type, error_if_nonfinite)


def _norm_args(max_norm: Any, norm_type: Any) -> tuple[float, float]:
    max_norm = real("clip_grad_norm_", "max_norm", max_norm)
    if not max_norm >= 0:
        raise DistValueError(f"{where('clip_grad_norm_')}: max_norm={max_norm!r} must be >= 0")
    return max_norm, _norm_order(norm_type)


def _clip(parts: Sequence[tuple[list[Any], list[ProcessGroup]]], max_norm: float, p: float, norm_type: Any,
          error_if_nonfinite: bool) -> float:
    partial = 0.0
    for i, (arrays, groups) in enumerate(parts):
        part = _reduced(arrays, p, groups)
        partial = part if i == 0 else math.nan if part != part else max(partial, part) if p == math.inf else \
            partial + part
    if p == math.inf:
        total = partial
    elif p == 2.0:
        total = math.sqrt(partial)
    else:
        total = partial ** (1.0 / p)
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(f"{where('clip_grad_norm_')}: the total norm of order {norm_type} of the gradients is "
                           f"{total}, not finite, so they cannot be clipped; pass error_if_nonfinite=False to "
                           f"scale them by the non-finite norm anyway")
    clip_coef = max_norm / (total + 1e-6)
    if not clip_coef >= 1.0:  # includes nan, which torch's clamp(max=1) keeps
        for arrays, _ in parts:
            for g in arrays:
                g *= clip_coef
    return total


def _reduced(arrays: list[Any], p: float, groups: list[ProcessGroup]) -> float:
    """``sum |g|^p`` (``max |g|`` for inf) over ``arrays``, then over each of ``groups`` in turn.

    The partial norm is reduced where the gradients live and reaches the host through one
    explicit transfer (``to_host``), as ``[value, nan flag]``: MPI's MAX may drop a nan, so nan
    travels as a flag that MAX and SUM keep. A rank without arrays reduces a host buffer.
    """
    xp = array_namespace(arrays[0]) if arrays else np
    parts = [part for g in arrays for part in _partial_norm(g, p)]
    buf = xp.zeros(2, dtype=np.float64)
    if parts:
        stacked = xp.stack(parts)
        partial = stacked.max() if p == math.inf else stacked.sum()
        is_nan = xp.isnan(partial)
        buf[0] = xp.where(is_nan, 0.0, partial)
        buf[1] = is_nan
    for group in groups:
        all_reduce(buf, ReduceOp.MAX if p == math.inf else ReduceOp.SUM, group=group)
    value, nan_flag = (float(v) for v in to_host(buf))
    return math.nan if nan_flag > 0 else value
