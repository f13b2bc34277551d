"""Communication hooks for DistributedDataParallel: ``hook(state, bucket) -> Work``.

As in torch (``register_comm_hook``), a hook receives its state and a :class:`GradBucket` and
returns a Work; when the Work completes, the bucket's buffer must hold the *averaged*
gradients. Hooks that chain collectives with computation run as one task on the group's
communication thread (:meth:`ProcessGroup.run_async`), so they overlap the backward pass.

- :func:`allreduce_hook`: average in the bucket's dtype (the default).
- :func:`fp16_compress_hook`: communicate in float16, decompress into the bucket.
- :func:`powersgd_hook` with :class:`PowerSGDState`: rank-r PowerSGD (Vogels et al., 2019,
  "PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization") with error
  feedback and warm start, after ``start_iter`` iterations of plain averaging.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

from ...comm import DistValueError, ProcessGroup, ReduceOp, Work
from ..arrays import array_namespace
from .buckets import GradBucket
from ..checks import where
from .flat import FlatLayout

__all__ = ["GradBucket", "allreduce_hook", "fp16_compress_hook", "PowerSGDState", "powersgd_hook"]


def _group(state: Any, bucket: GradBucket) -> ProcessGroup:
    return state if isinstance(state, ProcessGroup) else getattr(state, "group", None) or bucket.group


def allreduce_hook(state: Any, bucket: GradBucket) -> Work:
    """Average the bucket over the group (``state``: a ProcessGroup, or None for DDP's group)."""
    return _group(state, bucket).all_reduce(bucket.buffer(), ReduceOp.AVG, async_op=True)


def fp16_compress_hook(state: Any, bucket: GradBucket) -> Work:
    """Average in float16: half the bytes on the wire, float16 precision in the result.

    As torch does, the buffer is divided by the group size *before* the float16 sum, so the
    sum cannot overflow where the average would not.
    """
    group = _group(state, bucket)
    buffer = bucket.buffer()

    def run() -> None:
        compressed = buffer.astype("float16")
        compressed /= group.size
        group.all_reduce(compressed, ReduceOp.SUM)
        buffer[...] = compressed

    return group.run_async(run, "fp16_compress_hook")


@dataclasses.dataclass
class PowerSGDState:
    """Settings and memory of :func:`powersgd_hook`: one per rank (it holds that rank's error feedback).

    Args:
        rank: rank r of the approximation (torch's ``matrix_approximation_rank``).
        start_iter: iterations of plain averaging before compression starts (torch's
            ``start_powerSGD_iter``; compression from the first step hurts accuracy).
        min_compression_rate: a matrix n x m is compressed only if n*m / ((n + m) * r) reaches
            this; smaller ones are averaged exactly.
        use_error_feedback: add what compression lost to the next iteration's gradient.
        warm_start: reuse last iteration's Q as the start of the power iteration.
        seed: seed of the initial Q, identical on every rank.
        group: the group to average over (default: DDP's).
    """

    rank: int = 1
    start_iter: int = 10
    min_compression_rate: float = 2.0
    use_error_feedback: bool = True
    warm_start: bool = True
    seed: int = 0
    group: ProcessGroup | None = None
    iter: int = 0
    errors: dict[tuple, Any] = dataclasses.field(default_factory=dict, repr=False)
    qs: dict[tuple, Any] = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise DistValueError(f"{where('PowerSGDState')}: rank must be >= 1, got {self.rank}")
        if self.start_iter < 0:
            raise DistValueError(f"{where('PowerSGDState')}: start_iter must be >= 0, got {self.start_iter}")


def _orthogonalize(xp: Any, p: Any) -> None:
    """Orthonormalize the columns of ``p`` in place (Gram-Schmidt, as torch's PowerSGD)."""
    for i in range(p.shape[1]):
        col = p[:, i]
        col /= xp.sqrt((col * col).sum()) + 1e-8
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1:]
            rest -= xp.outer(col, col @ rest)


def _all_reduce_packed(group: ProcessGroup, arrays: list[Any], op: ReduceOp) -> None:
    """All-reduce arrays of one dtype as one flat message, in place."""
    named = {str(i): a for i, a in enumerate(arrays)}
    layout = FlatLayout.over(named)
    flat = layout.pack(named, arrays[0])
    group.all_reduce(flat, op)
    layout.unpack(flat, named)


def powersgd_hook(state: PowerSGDState, bucket: GradBucket) -> Work:
    """Average the bucket with rank-r PowerSGD compression (plain averaging before ``start_iter``).

    Per bucket: M = gradient (+ error feedback) for every compressible matrix; P = M Q,
    all-reduce P, orthogonalize; Q = Mᵀ P, all-reduce Q and divide by the group size; the
    gradient becomes P Qᵀ. 1-D and small tensors are averaged exactly in the same task.
    """
    group = _group(state, bucket)
    last = bucket.is_last()
    if state.iter < state.start_iter:
        if last:
            state.iter += 1
        return allreduce_hook(group, bucket)
    if last:
        state.iter += 1
    buffer = bucket.buffer()
    key = (bucket.index(), tuple(bucket.parameters()))

    xp = array_namespace(buffer)

    def run() -> None:
        if state.use_error_feedback:
            if key in state.errors:
                xp.add(buffer, state.errors[key], out=buffer)
            before = buffer.copy()
        matrices, exact = [], []
        for view in bucket.gradients():
            rows = view.shape[0] if view.ndim >= 2 else 0
            cols = view.size // rows if rows else 0
            r = min(state.rank, rows, cols) if rows else 0
            if r and rows * cols / ((rows + cols) * r) >= state.min_compression_rate:
                matrices.append((view.reshape(rows, cols), r))
            else:
                exact.append(view)
        if exact:
            _all_reduce_packed(group, exact, ReduceOp.AVG)
        if matrices:
            qs = state.qs.get(key) if state.warm_start else None
            if qs is None:
                rng = xp.random.default_rng(state.seed + zlib.crc32(repr(key).encode()))
                qs = [rng.standard_normal((m.shape[1], r)).astype(buffer.dtype) for m, r in matrices]
            ps = [m @ q for (m, _), q in zip(matrices, qs)]
            _all_reduce_packed(group, ps, ReduceOp.SUM)
            for p in ps:
                _orthogonalize(xp, p)
            qs = [m.T @ p for (m, _), p in zip(matrices, ps)]
            _all_reduce_packed(group, qs, ReduceOp.AVG)
            for (m, _), p, q in zip(matrices, ps, qs):
                m[...] = p @ q.T
            state.qs[key] = qs
        if state.use_error_feedback:
            state.errors[key] = before - buffer

    return group.run_async(run, "powersgd_hook")
