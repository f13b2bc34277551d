"""ZeRO stages 1 and 2: optimizer state (and, at stage 2, gradients) sharded over the group.

Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models". Parameters live in one flat buffer per dtype, laid out in bucket order (reverse
registration) and padded to a multiple of the group size N; rank r owns the r-th contiguous
shard and keeps optimizer state for it only. The gradient interface is DDP's
(:class:`~meshkit.parallel.reducer.GradientReducer`), on the same bucket machinery:

- stage 1: gradients live in a full flat buffer (bucket views into it) and each bucket is
  averaged as soon as it is ready; ``step()`` updates the local shard and all-gathers the
  parameters in place.
- stage 2: a bucket gets a buffer from a pool when its first gradient is written; once
  complete, each piece of it is reduced (averaged) to the rank that owns that piece, which adds
  it to its gradient shard, and the buffer returns to the pool. At most two buckets hold
  buffers at once (one filling while the previous one is reduced: double buffering, so
  communication still overlaps the backward pass); a third waits for the oldest reduction.
  Full-size gradient memory is at most the two largest buckets, not the model (inside
  ``no_sync()`` buckets keep their buffers, since the micro-batches' gradients must add up
  first). A parameter larger than the bucket cap gets a bucket of its own, so for a model of
  few, large tensors this saves little: lower ``bucket_cap_mb`` cannot split a tensor.

With AdamW in float32 and Ψ parameters, ``memory_report()`` gives the paper's accounting:
stage 1 holds 4Ψ + 4Ψ + 8Ψ/N bytes, stage 2 4Ψ + 4Ψ/N + 8Ψ/N plus the bucket pool.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Iterator, Mapping

from ..comm import DistValueError, ProcessGroup, ReduceOp, Work
from ..mesh import DeviceMesh
from .buckets import MB, Bucket, BucketManager
from .ddp import broadcast_params, check_caps, check_params, resolve_data_parallel_group
from .flat import FlatLayout, gather_state_dict, load_state_dict_into, make_layouts
from .optim import Optimizer, array_namespace, clip_grad_norm_
from .reducer import GradientReducer

__all__ = ["ZeroRedundancyOptimizer"]

#: Buckets of stage 2 that may hold a buffer at once: one being filled, one being reduced.
_BUFFERED_BUCKETS = 2


class _BufferPool:
    """Reusable flat buffers per dtype for stage 2's buckets (released from the comm thread).

    A request takes the smallest free buffer that fits it, else a new one of exactly its size,
    so a small bucket never costs a large buffer.
    """

    def __init__(self) -> None:
        self._free: dict[Any, list[Any]] = {}
        self._lock = threading.Lock()
        self.nbytes = 0        # everything ever allocated (the pool's footprint)
        self.live = 0          # bytes handed out now
        self.peak_live = 0

    def has_fit(self, size: int, dtype: Any) -> bool:
        return any(buf.size >= size for buf in self._free.get(dtype, ()))

    def take(self, size: int, like: Any) -> Any:
        with self._lock:
            free = self._free.setdefault(like.dtype, [])
            fits = [i for i, buf in enumerate(free) if buf.size >= size]
            if fits:
                buf = free.pop(min(fits, key=lambda i: free[i].size))
            else:
                buf = array_namespace(like).empty(size, dtype=like.dtype)
                self.nbytes += int(buf.nbytes)
            self.live += int(buf.nbytes)
            self.peak_live = max(self.peak_live, self.live)
        view = buf[:size]
        view[...] = 0
        return view

    def give(self, view: Any) -> None:
        buf = view.base if view.base is not None else view
        with self._lock:
            self.live -= int(buf.nbytes)
            self._free.setdefault(buf.dtype, []).append(buf)


class _Stage2Grads(Mapping):
    """``grads`` at stage 2: a bucket's buffer is attached when one of its gradients is first used."""

    def __init__(self, owner: ZeroRedundancyOptimizer) -> None:
        self._owner = owner

    def __getitem__(self, name: str) -> Any:
        return self._owner._stage2_view(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self._owner._check_grad(name, value)
        self._owner._stage2_view(name)[...] = value

    def __iter__(self) -> Iterator[str]:
        return iter(self._owner.params)

    def __len__(self) -> int:
        return len(self._owner.params)


class ZeroRedundancyOptimizer(GradientReducer):
    """ZeRO stage 1 or 2 data parallelism around an elementwise optimizer.

    Args:
        params: ordered ``dict[str, array]``; copied into flat buffers: train with
            ``zero.params`` (views into them, updated in place by ``step()``).
        optimizer: an :class:`~meshkit.parallel.optim.Optimizer` (``SGD``, ``AdamW``); it sees
            one flat shard per dtype, named by the dtype.
        mesh: a 1-D mesh to shard over, or pass ``group``; default the world.
        stage: 1 (shard optimizer state) or 2 (also shard gradients).
        bucket_cap_mb, first_bucket_cap_mb: bucket caps, as DDP's.
        find_unused_parameters: as DDP's.

    Example (2 ranks, float32 parameters of 10 elements in all)::

        zero = ZeroRedundancyOptimizer(params, AdamW(lr=1e-3), stage=2)
        # flat buffer padded to 10 elements: rank 0 owns [0, 5), rank 1 owns [5, 10)
        zero.zero_grad(); ...; zero.mark_grad_ready(name, grad); ...; zero.finish_gradient_sync()
        zero.step()          # each rank updates its shard; parameters are all-gathered
    """

    def __init__(self, params: dict[str, Any], optimizer: Optimizer, *, mesh: DeviceMesh | None = None,
                 group: ProcessGroup | None = None, stage: int = 1, bucket_cap_mb: float = 25,
                 first_bucket_cap_mb: float = 1, find_unused_parameters: bool = False) -> None:
        self._strategy = f"ZeroRedundancyOptimizer(stage={stage})"
        if stage not in (1, 2):
            raise DistValueError(f"meshkit.parallel: ZeroRedundancyOptimizer: stage={stage!r} is not valid; "
                                 "valid stages are 1 and 2 (use FullyShardedDataParallel for stage 3)")
        if not isinstance(optimizer, Optimizer):
            raise DistValueError(f"meshkit.parallel: ZeroRedundancyOptimizer: optimizer must be a meshkit "
                                 f"Optimizer (SGD, AdamW), got {type(optimizer).__name__}")
        self.group = resolve_data_parallel_group(mesh, group, "ZeroRedundancyOptimizer")
        check_params(params, self.group, "ZeroRedundancyOptimizer")
        check_caps(bucket_cap_mb, first_bucket_cap_mb, "ZeroRedundancyOptimizer")
        self.stage, self.optimizer = stage, optimizer
        self.find_unused_parameters = find_unused_parameters
        n, me = self.group.size, self.group.rank
        self._me = me
        order = list(reversed(params))  # the order buckets fill in: each bucket is a flat range
        self.layouts: dict[str, FlatLayout] = {lay.key: lay for lay in make_layouts(params, order, n)}
        self._flat = {key: lay.pack(params, params[lay.names[0]]) for key, lay in self.layouts.items()}
        views = {name: v for key, lay in self.layouts.items() for name, v in lay.views(self._flat[key]).items()}
        self.params = {name: views[name] for name in params}
        for key, flat in self._flat.items():
            broadcast_params({key: flat}, self.group, 0)
        self._layout_of = {name: lay for lay in self.layouts.values() for name in lay.names}
        self._offset = {name: off for lay in self.layouts.values() for name, off in zip(lay.names, lay.offsets)}
        if stage == 1:
            self._flat_grads = {key: array_namespace(f).zeros_like(f) for key, f in self._flat.items()}
            allocate = self._stage1_bucket
        else:
            self._grad_shards = {key: array_namespace(f).zeros(lay.shard_size, dtype=lay.dtype)
                                 for (key, lay), f in zip(self.layouts.items(), self._flat.values())}
            allocate = None
        self._buckets = BucketManager(self.params, order, bucket_cap_bytes=int(bucket_cap_mb * MB),
                                      first_bucket_cap_bytes=int(first_bucket_cap_mb * MB), launch=self._launch,
                                      allocate=allocate or (lambda names, size, like: None))
        if stage == 2:
            self._pool = _BufferPool()
            self._in_flight: collections.deque[Bucket] = collections.deque()
        self.grads: Any = self._buckets.views() if stage == 1 else _Stage2Grads(self)
        self._init_reducer()

    # ------------------------------------------------------------------ buckets
    def _stage1_bucket(self, names: list[str], size: int, like: Any) -> Any:
        start = self._offset[names[0]]
        return self._flat_grads[self._layout_of[names[0]].key][start:start + size]

    def _stage2_view(self, name: str) -> Any:
        bucket = self._buckets.location.get(name)
        if bucket is None:
            raise KeyError(name)
        if bucket.buffer is None:
            if bucket.launched:
                raise DistValueError(f"{self._where('grads')}: the gradient of {name!r} was already reduced "
                                     "into its owner's shard in this pass; stage 2 keeps only the local shard")
            like = self.params[name]
            while not self._pool.has_fit(bucket.size, like.dtype) and len(self._in_flight) >= _BUFFERED_BUCKETS:
                self._in_flight.popleft().wait()  # its buffer returns to the pool
            bucket.buffer = self._pool.take(bucket.size, like)
        return bucket.view(name)

    def _launch(self, bucket: Bucket) -> Work:
        if self.stage == 1:
            return self.group.all_reduce(bucket.buffer, ReduceOp.AVG, async_op=True)
        layout = self._layout_of[bucket.names[0]]
        start = self._offset[bucket.names[0]]
        buffer, shard = bucket.buffer, self._grad_shards[layout.key]
        pieces = list(layout.owners(start, start + bucket.size))
        own_start = layout.shard_range(self._me)[0]

        def reduce_to_owners() -> None:
            for owner, lo, hi in pieces:
                piece = buffer[lo - start:hi - start]
                self.group.reduce(piece, owner, ReduceOp.AVG)
                if owner == self._me:
                    shard[lo - own_start:hi - own_start] += piece
            bucket.buffer = None
            self._pool.give(buffer)

        self._in_flight.append(bucket)
        return self.group.run_async(reduce_to_owners, "zero2_reduce")

    def _end_pass(self) -> None:
        super()._end_pass()
        if self.stage == 2:
            self._in_flight.clear()

    def _zero(self) -> None:
        if self.stage == 1:
            for g in self._flat_grads.values():
                g[...] = 0
        else:
            for g in self._grad_shards.values():
                g[...] = 0
            self._buckets.zero()

    # ------------------------------------------------------------------ shards and step
    def _shard(self, flat: Any, key: str) -> Any:
        lo, hi = self.layouts[key].shard_range(self._me)
        return flat[lo:hi]

    def grad_shards(self) -> dict[str, Any]:
        """This rank's averaged gradient shard per dtype key (after ``finish_gradient_sync``)."""
        if self.stage == 1:
            return {key: self._shard(g, key) for key, g in self._flat_grads.items()}
        return dict(self._grad_shards)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the gradients by their global norm (the single-process value), before ``step()``."""
        return clip_grad_norm_(self.grad_shards(), max_norm, norm_type=norm_type, group=self.group)

    def step(self) -> None:
        """Update this rank's shard of every flat buffer, then all-gather the parameters in place."""
        shards = self.grad_shards()
        works = []
        for key, flat in self._flat.items():
            mine = self._shard(flat, key)
            self.optimizer.update(key, mine, shards[key])
            works.append(self.group.all_gather_into_tensor(flat, mine, async_op=True))
        for work in works:
            work.wait()

    # ------------------------------------------------------------------ state dicts
    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, Any] | None:
        """Parameters and optimizer state at full size, per parameter name (collective).

        Independent of the world size: :meth:`load_full_state_dict` accepts it at any other.
        """
        shards = {key: self._shard(flat, key) for key, flat in self._flat.items()}
        sd = gather_state_dict(list(self.layouts.values()), shards, self.optimizer, self.group)
        return None if rank0_only and self._me != 0 else sd

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict (from any world size): this rank's shards, then all-gather."""
        shards = {key: self._shard(flat, key) for key, flat in self._flat.items()}
        load_state_dict_into(list(self.layouts.values()), state_dict, shards, self.optimizer, self._me,
                             "ZeroRedundancyOptimizer")
        for key, flat in self._flat.items():
            self.group.all_gather_into_tensor(flat, shards[key])

    # ------------------------------------------------------------------ introspection
    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds (see the module docstring for the expected figures)."""
        params = sum(int(f.nbytes) for f in self._flat.values())
        state = self.optimizer.state_nbytes()
        if self.stage == 1:
            grads, comm, peak = sum(int(g.nbytes) for g in self._flat_grads.values()), 0, 0
        else:
            grads = sum(int(g.nbytes) for g in self._grad_shards.values())
            comm, peak = self._pool.nbytes, self._pool.peak_live
        return {"params": params, "grads": grads, "optimizer_state": state, "comm_buffers": comm,
                "peak_transient": peak}
