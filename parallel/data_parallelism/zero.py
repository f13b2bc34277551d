"""ZeRO stages 1 and 2: optimizer state (and, at stage 2, gradients) sharded over the group.

Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models". Parameters live in one flat buffer per dtype, laid out in bucket order (reverse
registration) and padded to a multiple of the group size N; rank r owns the r-th contiguous
shard and keeps optimizer state for it only. It is built of parts it holds: the gradient interface
is DDP's, a :class:`~meshkit.parallel.data_parallelism.reducer.GradientReducer` on the same bucket
machinery (``zero.reducer``), the state dicts, clipping and memory report over the flat shards
FSDP's (``zero.shards``, a :class:`~meshkit.parallel.data_parallelism.sharded.Shards`), the units
DDP's (``zero.replicated``); what it offers of them is forwarded as its own
(:mod:`~meshkit.parallel.forwarding`):

- stage 1: gradients live in a full flat buffer (bucket views into it) and each bucket is
  averaged as soon as it is ready; ``step()`` updates the local shard and all-gathers the
  parameters in place.
- stage 2: a bucket takes a buffer from a :class:`~meshkit.parallel.data_parallelism.pool.BufferPool` when its
  first gradient is written; once complete, its reduction (:func:`reduce_to_owners`, the
  bucket's hook) averages each piece of it on the rank that owns that piece, which adds it to
  its gradient shard, and the buffer returns to the pool. At most two buckets hold buffers at
  once (double buffering, so communication still overlaps the backward pass): full-size
  gradient memory is at most the two largest buckets, not the model (inside ``no_sync()``
  buckets keep their buffers, since the micro-batches' gradients must add up first). A
  parameter larger than the bucket cap gets a bucket of its own, so for a model of few, large
  tensors this saves little: lower ``bucket_cap_mb`` cannot split a tensor.

``step()`` uses only averaged gradients: it raises (on every rank alike) for a synchronized pass
not ended by ``finish_gradient_sync()``, a failed sync, gradients accumulated under
``no_sync()`` only, or no synchronized pass since ``zero_grad()``. Gradients written into
``grads`` but never marked ready cannot be seen, and are not detected.

With AdamW in float32 and Ψ parameters, ``memory_report()`` gives the paper's accounting:
stage 1 holds 4Ψ + 4Ψ + 8Ψ/N bytes, stage 2 4Ψ + 4Ψ/N + 8Ψ/N plus the bucket pool.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Sequence

from ...comm import DistTypeError, ProcessGroup, ReduceOp, Work
from ...mesh import DeviceMesh
from ..arrays import array_namespace
from .buckets import MB, BucketManager, CommHook, GradBucket
from .dtensors import split, wrap_all
from .flat import FlatLayout, flat_buffer, make_layouts
from .hooks import allreduce_hook
from ..optim.optimizers import Optimizer
from ..checks import where
from .pool import BufferPool
from .protocol import ReplicatedUnits, check_units, deprecated
from .reducer import GradientReducer
from ..forwarding import forward_attribute, forward_to
from .construction import Params, caps_problem, check_setup, resolve_data_parallel_group
from .sharded import Shards

__all__ = ["ZeroRedundancyOptimizer", "OwnerShards", "reduce_to_owners"]

#: Buckets of stage 2 that may hold a buffer at once: one being filled, one being reduced.
_BUFFERED_BUCKETS = 2


class OwnerShards:
    """The state of :func:`reduce_to_owners`: where each parameter lies in its flat buffer and
    this rank's gradient shard of each."""

    def __init__(self, group: ProcessGroup, layouts: dict[str, FlatLayout], grad_shards: dict[str, Any]) -> None:
        self.group, self.grad_shards = group, grad_shards
        self.place = {name: (lay, off) for lay in layouts.values() for name, off in zip(lay.names, lay.offsets)}


def reduce_to_owners(state: OwnerShards, bucket: GradBucket) -> Work:
    """ZeRO-2's bucket hook: average each piece of the bucket on the rank that owns it, which
    adds it to its gradient shard (the bucket is a contiguous range of one flat buffer)."""
    group, me = state.group, state.group.rank
    layout, start = state.place[bucket.parameters()[0]]
    buffer = bucket.buffer()
    shard = state.grad_shards[layout.key]
    own_start = layout.shard_range(me)[0]
    pieces = list(layout.owners(start, start + buffer.size))

    def run() -> None:
        for owner, lo, hi in pieces:
            piece = buffer[lo - start:hi - start]
            group.reduce(piece, owner, ReduceOp.AVG)
            if owner == me:
                shard[lo - own_start:hi - own_start] += piece

    return group.run_async(run, "zero2_reduce")


class _Stage2Views(dict):
    """The gradient arrays at stage 2: never stored; a bucket's view, its buffer taken from the
    pool when one of its gradients is first used."""

    def __init__(self, location: dict[str, Any]) -> None:
        super().__init__()
        self._location = location

    def __missing__(self, name: str) -> Any:
        return self._location[name].view(name)


class ZeroRedundancyOptimizer:
    """ZeRO stage 1 or 2 data parallelism around an elementwise optimizer.

    Args:
        params: ordered ``dict[str, array]``; copied into flat buffers: train with
            ``zero.params`` (views into them, updated in place by ``step()``). Values may be
            DTensors laid out over another mesh dimension (tensor parallelism), as DDP's: each
            rank's block is sharded over the group, ``zero.params`` and ``zero.grads`` are
            DTensors over ZeRO's own arrays, ``clip_grad_norm_`` adds norms over the
            parameters' meshes too; ``full_state_dict`` is refused (use ``sharded_state_dict``).
        optimizer: an :class:`~meshkit.parallel.optim.optimizers.Optimizer` (``SGD``, ``AdamW``); it sees
            one flat shard per dtype, named by the dtype.
            Keyword (passing it second, positionally, is deprecated).
        mesh: a 1-D mesh to shard over, or pass ``group`` (neither, meaning the world, is deprecated).
        units: lists of parameter names for :meth:`unshard` (the protocol of
            :mod:`~meshkit.parallel.data_parallelism.protocol`); default one unit of everything.
        stage: 1 (shard optimizer state) or 2 (also shard gradients).
        bucket_cap_mb, first_bucket_cap_mb: bucket caps, as DDP's.
        find_unused_parameters: as DDP's.

    Example (2 ranks, float32 parameters of 10 elements in all)::

        zero = ZeroRedundancyOptimizer(params, mesh=mesh, optimizer=AdamW(lr=1e-3), stage=2)
        # flat buffer padded to 10 elements: rank 0 owns [0, 5), rank 1 owns [5, 10)
        zero.zero_grad(); ...; zero.mark_grad_ready(name, grad); ...
        zero.step()          # finish the sync; each rank updates its shard; parameters are all-gathered
    """

    # the gradient interface: the reducer's own (zero.mark_grad_ready is zero.reducer.mark_grad_ready)
    zero_grad = forward_to("reducer", GradientReducer.zero_grad)
    mark_grad_ready = forward_to("reducer", GradientReducer.mark_grad_ready)
    no_sync = forward_to("reducer", GradientReducer.no_sync)
    sync_gradients = forward_to("reducer", GradientReducer.sync_gradients)
    finish_gradient_sync = forward_to("reducer", GradientReducer.finish_gradient_sync)
    buckets = forward_attribute("reducer", GradientReducer.buckets)
    grads = forward_attribute("reducer", "grads", doc="``name -> gradient`` (guarded while reduced: see "
                              ":mod:`~meshkit.parallel.data_parallelism.reducer`).")
    iteration = forward_attribute("reducer", "iteration", doc="Synchronized passes completed.")
    find_unused_parameters = forward_attribute("reducer", "find_unused_parameters",
                                               doc="Whether gradients never marked in a pass are reduced as they are.")

    # the flat shards' surface: self.shards' own (zero.state_dict is zero.shards.state_dict)
    grad_shards = forward_to("shards", Shards.grad_shards)
    state_dict = forward_to("shards", Shards.state_dict)
    load_state_dict = forward_to("shards", Shards.load_state_dict)
    full_state_dict = forward_to("shards", Shards.full_state_dict)
    load_full_state_dict = forward_to("shards", Shards.load_full_state_dict)
    sharded_state_dict = forward_to("shards", Shards.sharded_state_dict)
    load_sharded_state_dict = forward_to("shards", Shards.load_sharded_state_dict)
    memory_report = forward_to("shards", Shards.memory_report)

    def __init__(self, params: dict[str, Any], *args: Optimizer, mesh: DeviceMesh | None = None,
                 optimizer: Optimizer | None = None, units: Sequence[Sequence[str]] | None = None,
                 group: ProcessGroup | None = None, stage: int = 1, bucket_cap_mb: float = 25,
                 first_bucket_cap_mb: float = 1, find_unused_parameters: bool = False) -> None:
        self._strategy = f"ZeroRedundancyOptimizer(stage={stage})"
        if args:  # today's spelling: ZeroRedundancyOptimizer(params, optimizer, ...)
            if len(args) > 1 or optimizer is not None:
                raise DistTypeError(f"{where(self._strategy)}: takes params and, deprecated, the optimizer "
                                    f"positionally; got {1 + len(args)} positional arguments"
                                    + (" and optimizer=" if optimizer is not None else ""))
            deprecated("ZeroRedundancyOptimizer(params, optimizer)", "pass optimizer= by keyword")
            optimizer = args[0]
        if mesh is None and group is None:
            deprecated("ZeroRedundancyOptimizer without mesh= (meaning the world)", "pass mesh= (a 1-D DeviceMesh)")
        self.group = resolve_data_parallel_group(mesh, group, "ZeroRedundancyOptimizer")
        problem = caps_problem(bucket_cap_mb, first_bucket_cap_mb)
        unit_list, units_problem = check_units(params, units) if isinstance(params, Mapping) else (None, None)
        problem = problem or units_problem
        if stage not in (1, 2):
            problem = f"stage={stage!r} is not valid; valid stages are 1 and 2 (use FullyShardedDataParallel for stage 3)"
        if not isinstance(optimizer, Optimizer):
            problem = f"optimizer must be a meshkit Optimizer (SGD, AdamW), got {type(optimizer).__name__}"
        check_setup(params, self.group, "ZeroRedundancyOptimizer", problem=problem, config={
            "stage": stage, "bucket_cap_mb": bucket_cap_mb, "first_bucket_cap_mb": first_bucket_cap_mb,
            "find_unused_parameters": find_unused_parameters, "optimizer": repr(optimizer), "units": unit_list})
        self.stage, self.optimizer = stage, optimizer
        self.units: list[list[str]] = unit_list  # type: ignore[assignment]
        blocks, self._block_layouts = split(params)  # this rank's blocks of DTensor parameters
        order = list(reversed(blocks))  # the order buckets fill in: each bucket is a flat range
        self.layouts: dict[str, FlatLayout] = {lay.key: lay for lay in make_layouts(blocks, order, self.group.size)}
        # Parameters and (stage 1) gradients in flat buffers of the group's shared memory where it has
        # some (flat_buffer): the step's all_gather and the buckets' all_reduce run where they lie
        self._flat = {key: lay.pack_into(blocks, flat_buffer(self.group, lay.padded, lay.dtype, blocks[lay.names[0]]))
                      for key, lay in self.layouts.items()}
        for flat in self._flat.values():
            self.group.broadcast(flat, 0)
        views = {name: v for key, lay in self.layouts.items() for name, v in lay.views(self._flat[key]).items()}
        self._blocks = {name: views[name] for name in blocks}
        self.params = Params(wrap_all(self._blocks, self._block_layouts), self._strategy)
        self.replicated = ReplicatedUnits(self.units, self.params, self._where)  # unshard, prefetch
        self.shards = Shards(self)  # state dicts, clipping, memory report over the flat shards
        caps = {"bucket_cap_bytes": int(bucket_cap_mb * MB), "first_bucket_cap_bytes": int(first_bucket_cap_mb * MB)}
        xp = array_namespace(next(iter(self._flat.values())))
        if stage == 1:
            self._flat_grads = {key: flat_buffer(self.group, f.size, f.dtype, f) for key, f in self._flat.items()}
            flat_grads = {self.layouts[key].dtype: g for key, g in self._flat_grads.items()}
            self._buckets = BucketManager(self._blocks, order, comm=CommHook(self.group, allreduce_hook, self.group),
                                          flat=flat_grads, **caps)
            self._grads = self._buckets.views()
        else:
            self._grad_shards = {key: xp.zeros(lay.shard_size, dtype=lay.dtype) for key, lay in self.layouts.items()}
            self._pool = BufferPool(xp, _BUFFERED_BUCKETS)
            owners = OwnerShards(self.group, self.layouts, self._grad_shards)
            self._buckets = BucketManager(self._blocks, order, comm=CommHook(self.group, reduce_to_owners, owners),
                                          pool=self._pool, **caps)
            self._grads = _Stage2Views(self._buckets.location)
        # stage 2: bucket buffers come and go, so views are never kept (restore_views)
        self.reducer = GradientReducer(self, strategy=self._strategy, group=self.group, blocks=self._blocks,
                                       block_layouts=self._block_layouts, buckets=self._buckets, arrays=self._grads,
                                       find_unused_parameters=find_unused_parameters, restore_views=stage == 1)

    def _where(self, op: str) -> str:
        return where(f"{self._strategy}.{op}", self.group)

    # ------------------------------------------------------------------ what the reducer asks (ReducerOwner)
    def _assign_grad(self, name: str, value: Any) -> None:
        if self.stage == 1:  # keep the caller's array: it is checked and copied into its bucket when marked
            self._grads[name] = value
        else:  # stage 2 keeps no arrays of the caller's: copy into the bucket
            self.reducer.check_grad(name, value)
            self._grads[name][...] = value

    def _after_sync(self, ready_order: list[str]) -> None:
        """Nothing to do: the averages are in place (stage 1) or added to the gradient shards (stage 2)."""

    def _zero_grads(self) -> None:
        if self.stage == 1:
            for g in self._flat_grads.values():
                g[...] = 0
        else:
            for g in self._grad_shards.values():
                g[...] = 0
            self._buckets.zero()

    # ------------------------------------------------------------------ shards and step
    def _shard(self, flat: Any, key: str) -> Any:
        lo, hi = self.layouts[key].shard_range(self.group.rank)
        return flat[lo:hi]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Finish the gradient sync (a pass whose every gradient is marked), then clip this rank's
        gradient shards by the global norm (see :meth:`Shards.clip_grad_norm_
        <meshkit.parallel.data_parallelism.sharded.Shards.clip_grad_norm_>`); collective, before
        :meth:`step`."""
        self.reducer.finish_complete_pass("clip_grad_norm_")
        return self.shards.clip_grad_norm_(max_norm, norm_type)

    def step(self) -> None:
        """Update this rank's shard of every flat buffer, then all-gather the parameters in place.

        A synchronized pass whose every gradient is marked (or, with ``find_unused_parameters``,
        any pass in progress) is finished first: ``step()`` is the protocol's one call after the
        backward pass.

        Raises:
            DistValueError: the gradients are not averaged: gradients were marked ready and
                ``finish_gradient_sync()`` was not called since, the last sync failed, gradients
                were accumulated under ``no_sync()`` only, or no synchronized pass ran since
                ``zero_grad()`` (or construction).
        """
        self.reducer.ready_for_step("step")
        shards = self._local_grad_shards()
        works = []
        for key, flat in self._flat.items():
            mine = self._shard(flat, key)
            self.optimizer.update(key, mine, shards[key])
            works.append(self.group.all_gather_into_tensor(flat, mine, async_op=True))
        for work in works:
            work.wait()
        self.reducer.steps.taken()
        self.shards.after_step()  # --survive: the buddy copy of the next shard (meshkit.parallel.buddy)

    # ------------------------------------------------------------------ the units: every rank holds them all
    def prefetch(self, unit: int) -> None:
        """Nothing to gather: every rank holds the full parameters (checks ``unit``)."""
        self.replicated.prefetch(unit)

    def unshard(self, unit: int) -> contextlib.AbstractContextManager[dict[str, Any]]:
        """Yield ``{name: parameter}`` of ``unit``: the parameters themselves (no communication)."""
        return self.replicated.unshard(unit)

    # ------------------------------------------------------------------ what Shards asks (ShardOwner)
    def _shard_group(self) -> ProcessGroup:
        return self.group

    def _quiesce(self) -> None:
        """Nothing runs between the sync and the step: nothing to finish."""

    def _settle(self, op: str) -> None:
        self.reducer.check_averaged(op)

    def _agreement_groups(self) -> list[ProcessGroup]:
        return [self.group]

    def _layouts(self) -> list[FlatLayout]:
        return list(self.layouts.values())

    def _param_shards(self) -> dict[str, Any]:
        return {key: self._shard(flat, key) for key, flat in self._flat.items()}

    def _local_grad_shards(self) -> dict[str, Any]:
        if self.stage == 1:
            return {key: self._shard(g, key) for key, g in self._flat_grads.items()}
        return dict(self._grad_shards)

    def _loaded(self) -> None:
        for key, flat in self._flat.items():
            self.group.all_gather_into_tensor(flat, self._shard(flat, key))

    def _footprint(self) -> tuple[int, int, int, int]:
        """Stage 1 holds 4Ψ + 4Ψ + 8Ψ/N bytes with AdamW in float32, stage 2 4Ψ + 4Ψ/N + 8Ψ/N
        plus the bucket pool (see the module docstring)."""
        params = sum(int(f.nbytes) for f in self._flat.values())
        if self.stage == 1:
            return params, sum(int(g.nbytes) for g in self._flat_grads.values()), 0, 0
        return params, sum(int(g.nbytes) for g in self._grad_shards.values()), self._pool.nbytes, self._pool.peak_live
