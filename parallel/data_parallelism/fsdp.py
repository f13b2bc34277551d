"""Fully sharded data parallel (ZeRO-3), and hybrid sharding on a 2-D mesh.

At rest each rank holds only its shard of every unit's flat buffers: parameters, gradients and
optimizer state all cost 1/N. A unit (e.g. one layer) is all-gathered for the moment it is
used and freed after; its gradients are reduce-scattered straight into the gradient shards. It
implements the training-loop protocol of :mod:`~meshkit.parallel.data_parallelism.protocol`, as DDP and ZeRO do::

    fsdp = FullyShardedDataParallel(params, mesh=mesh, optimizer=AdamW(lr=1e-3),
                                    units=[["w0", "b0"], ["w1", "b1"]])
    for i in range(2):                         # forward
        fsdp.prefetch(i + 1) if i + 1 < 2 else None
        with fsdp.unshard(i) as p:             # full parameters of unit i
            h = layer(h, p)
    for i in reversed(range(2)):               # backward: gather again, reduce gradients
        with fsdp.unshard(i) as p:
            dw, db = layer_backward(p, ...)
        fsdp.mark_grad_ready(f"w{i}", dw)      # once all of unit i's are marked: asynchronous
        fsdp.mark_grad_ready(f"b{i}", db)      # reduce-scatter of the unit
    fsdp.step()                                # wait, then update the shards

Under ``with fsdp.no_sync():`` marked gradients add up locally at full size (as torch's FSDP
keeps unsharded gradients under ``no_sync``); the next synchronized pass adds them to its own
and reduces the sum.

On a 2-D mesh ``(replicate, shard)`` (hybrid sharding, HSDP) parameters are sharded over the
``shard`` dimension and replicated over ``replicate``: gradients are reduce-scattered over the
shard group, then the shard is all-reduced over the replicate group, so gradients are averaged
over every data-parallel rank as DDP does.

Parameters may be DTensors laid out over another mesh dimension (tensor parallelism, e.g.
``mesh["tp"]`` beside ``mesh["dp"]``, or a ``(replicate, shard, tp)`` mesh for HSDP), as DDP's
and ZeRO's (:mod:`~meshkit.parallel.data_parallelism.dtensors`): each rank's block is flat-sharded over the
data-parallel mesh as any array would be, ``unshard`` yields DTensors laid out as the parameters
over the gathered blocks, and ``mark_grad_ready`` takes DTensor gradients laid out alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Iterator, Sequence

import numpy as np

from ...comm import CollectiveMismatchError, DistTypeError, DistValueError, ProcessGroup, ReduceOp, Work
from ...mesh import DeviceMesh
from ...tensor import DTensor
from ..arrays import array_namespace
from .dtensors import block_of, split, wrap_all
from .flat import FlatLayout, flat_buffer, make_layouts
from ..optim.optimizers import Optimizer
from ..checks import where
from .protocol import (DISCARD, USE, PassAgreement, check_gradient, check_units, deprecated, failed_sync,
                       marked_after_complete, marked_twice, refused_after_failure)
from ..strategy import Steps
from .construction import Params, broadcast_params, check_setup, world_mesh
from .sharded import Shards
from ..forwarding import forward_to

__all__ = ["FullyShardedDataParallel"]

#: Gradient slots in the shard group's shared memory (where it has some): one being packed while the
#: previous unit's reduce-scatter runs, as ZeRO-2's two bucket buffers (pool.py).
_GRAD_SLOTS = 2


class FullyShardedDataParallel:
    """Parameters, gradients and optimizer state sharded over a mesh dimension.

    Args:
        params: ordered ``dict[str, array]`` (every rank passes the same names, shapes and
            dtypes; every rank starts from the parameters of the mesh's first rank). Values may
            be DTensors laid out over another mesh dimension than ``mesh``'s (tensor
            parallelism), none ``Partial``: each rank's block is sharded over ``mesh``, and
            every rank of ``mesh`` must pass the same placements, global shape and coordinate
            in the DTensor's mesh, which may hold no other rank of ``mesh`` (checked collectively).
        mesh: 1-D (shard over it) or 2-D ``(replicate, shard)`` for hybrid sharding. Left out
            (deprecated, as for DDP and ZeRO): the world, as a 1-D mesh.
        optimizer: an elementwise :class:`~meshkit.parallel.optim.optimizers.Optimizer`; it sees one flat
            shard per unit and dtype, named ``"unit{i}.{dtype}"``.
        units: ordered list of lists of parameter names, each name in exactly one unit (e.g.
            one unit per layer); default: one unit of everything.
        reshard_after_forward: free a unit's full parameters when ``unshard`` exits (ZeRO-3);
            False keeps them until ``step()`` (more memory, no second gather in backward).
        param_dtype: dtype of the unsharded parameters (e.g. float32 compute on float64
            shards); the shards stay in their own dtype.
        reduce_dtype: dtype gradients are reduced in.

    ``fsdp.params`` maps each name to this rank's piece of the parameter: a 1-D view of its flat
    shard (empty where the rank holds none of it; writing it writes the shard). ``unshard(i)``
    gives the full parameters.

    With DTensor parameters, ``unshard(i)`` yields DTensors (the parameters' mesh, placements and
    global shape) over the gathered blocks, ``reduce_grads`` takes DTensor gradients laid out as
    their parameters (or the blocks), ``clip_grad_norm_`` adds norms over the parameters' meshes
    too, and ``sharded_state_dict`` gives boxes of the global arrays, so checkpoints reshard across
    ``dp x tp`` meshes and strategies; ``full_state_dict`` is refused. Example (4 ranks, mesh
    ``[[0, 1], [2, 3]]`` named ``("dp", "tp")``)::

        params = parallelize(full, mesh["tp"], {"w0": ColwiseParallel(), "w1": RowwiseParallel()})
        fsdp = FullyShardedDataParallel(params, mesh=mesh["dp"], optimizer=SGD(lr=0.1))
        # rank 0 holds half of its block w0[:, :n/2] (the other half on rank 2), rank 1 half of w0[:, n/2:]
        with fsdp.unshard(0) as p:           # p["w0"]: a DTensor Shard(1) over mesh["tp"], block w0[:, :n/2] on rank 0
            ...

    Raises:
        DistValueError: on every rank of ``mesh``, when parameters (names, shapes, dtypes, order;
            a DTensor's placements, global shape and mesh coordinate) or settings differ across
            ranks, or any rank passes a bad argument (a ``Partial`` DTensor, one whose mesh holds
            other ranks of ``mesh``, bad units).
    """

    _strategy = "FullyShardedDataParallel"

    # the flat shards' surface: self.shards' own (fsdp.state_dict is fsdp.shards.state_dict)
    grad_shards = forward_to("shards", Shards.grad_shards)
    state_dict = forward_to("shards", Shards.state_dict)
    load_state_dict = forward_to("shards", Shards.load_state_dict)
    full_state_dict = forward_to("shards", Shards.full_state_dict)
    load_full_state_dict = forward_to("shards", Shards.load_full_state_dict)
    sharded_state_dict = forward_to("shards", Shards.sharded_state_dict)
    load_sharded_state_dict = forward_to("shards", Shards.load_sharded_state_dict)
    memory_report = forward_to("shards", Shards.memory_report)

    def __init__(self, params: dict[str, Any], *, mesh: DeviceMesh | None = None, optimizer: Optimizer,
                 units: Sequence[Sequence[str]] | None = None, reshard_after_forward: bool = True,
                 param_dtype: Any = None, reduce_dtype: Any = None) -> None:
        if mesh is None:  # as DDP and ZeRO take it: one loop may leave it out for every strategy
            deprecated("FullyShardedDataParallel without mesh= (meaning the world)", "pass mesh= (a 1-D DeviceMesh)")
            mesh = world_mesh()
        if not isinstance(mesh, DeviceMesh) or mesh.ndim not in (1, 2):
            dims = getattr(mesh, "mesh_dim_names", None)
            raise DistValueError(f"{where(self._strategy)}: mesh must be a 1-D DeviceMesh (shard) or a 2-D one "
                                 f"(replicate, shard), got {type(mesh).__name__} with dims {dims}")
        self.mesh = mesh
        self.shard_group: ProcessGroup = mesh.get_group(mesh.ndim - 1)
        self.replicate_group: ProcessGroup | None = mesh.get_group(0) if mesh.ndim == 2 else None
        unit_list, problem = check_units(params, units) if isinstance(params, Mapping) else (None, None)
        if not isinstance(optimizer, Optimizer):
            problem = f"optimizer must be a meshkit Optimizer (SGD, AdamW), got {type(optimizer).__name__}"
        config = {"units": unit_list, "reshard_after_forward": reshard_after_forward, "param_dtype": str(param_dtype),
                  "reduce_dtype": str(reduce_dtype), "optimizer": repr(optimizer)}
        # HSDP: every rank of the mesh agrees, through its two groups
        check_setup(params, self.shard_group, self._strategy, problem=problem, config=config, then=self.replicate_group,
                    data_parallel_ranks=None if mesh.ndim == 1 else [int(r) for r in mesh.mesh.reshape(-1)])
        blocks, self._block_layouts = split(params)  # this rank's blocks of DTensor parameters (the same memory)
        for group in (self.shard_group, self.replicate_group):
            if group is not None:
                broadcast_params(blocks, group, 0)
        self.optimizer = optimizer
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.units: list[list[str]] = unit_list  # type: ignore[assignment]
        me, n = self.shard_group.rank, self.shard_group.size
        self.layouts: list[list[FlatLayout]] = [make_layouts(blocks, names, n, prefix=f"unit{i}.")
                                                for i, names in enumerate(self.units)]
        self._shards: dict[str, Any] = {}
        self._grad_shards: dict[str, Any] = {}
        for unit in self.layouts:
            for lay in unit:
                lo, hi = lay.shard_range(me)
                like = blocks[lay.names[0]]
                self._shards[lay.key] = lay.pack(blocks, like)[lo:hi].copy()
                self._grad_shards[lay.key] = array_namespace(like).zeros(lay.shard_size, dtype=lay.dtype)
        # Where the shard group shares memory (one node, the shared-memory path: comm/engines/shm.py),
        # each unit's gradients are packed into one of _GRAD_SLOTS flat buffers inside it, taken in
        # turn, so that the reduce-scatter reads every rank's where it lies (no copy into the segment).
        # The turn is the reductions' order, the same on every rank, and a slot is taken again only
        # after the reduction that held it finished: every rank packs into the same place.
        self._grad_slots: list[Any] = []
        self._slot_work: list[Work | None] = []
        self._slot_turn = 0
        if self.shard_group.shares_memory() and array_namespace(next(iter(blocks.values()))) is np:
            widest = max(lay.padded * np.dtype(self.reduce_dtype or lay.dtype).itemsize
                         for unit in self.layouts for lay in unit)
            self._grad_slots = [flat_buffer(self.shard_group, widest, np.uint8, np.empty(0))
                                for _ in range(_GRAD_SLOTS)]
            self._slot_work = [None] * _GRAD_SLOTS
        self._full: dict[int, tuple[dict[str, Any], list[Any]]] = {}   # unit -> (views, buffers)
        self._prefetching: dict[int, tuple[list[Work], list[Any]]] = {}
        self._active: set[int] = set()
        self._used: set[int] = set()       # unsharded since the last step
        self._pending: list[Work] = []
        self._peak = 0
        # The protocol's gradient side (protocol.py): name -> (unit, shape, dtype the gradient must have,
        # flat key); this pass's marks per unit until the unit is complete; complete units waiting for
        # their turn; units whose reduction was issued in this pass; full-size sums of gradients
        # marked under no_sync().
        self._grad_of = {name: (u, lay.shapes[i], np.dtype(param_dtype) if param_dtype is not None else lay.dtype,
                                lay.key)
                         for u, unit in enumerate(self.layouts) for lay in unit for i, name in enumerate(lay.names)}
        self._order = list(reversed(range(len(self.units))))  # rule 3: last unit first, a backward pass's order
        self._next = 0  # position in _order of the next unit to reduce in this pass
        self._marks: dict[int, dict[str, Any]] = {}
        self._queued: dict[int, dict[str, Any]] = {}
        self._issued: set[int] = set()
        self._pass_marked: set[str] = set()
        self._accumulated: dict[str, Any] = {}
        self._sync = True
        self._ended = False  # the pass was ended for use (clip_grad_norm_) and not stepped yet
        self._failed: str | None = None  # why the last pass failed, until zero_grad()
        self._steps = Steps()  # optimizer steps taken, compared in the agreement
        self._agreement = PassAgreement(self._agreement_groups(), next(iter(self._shards.values())),
                                        f"{self._strategy}'s gradient sync")
        self.params = Params(self._local_pieces(), self._strategy)
        self.shards = Shards(self)  # state dicts, clipping, memory report over the flat shards

    def _local_pieces(self) -> dict[str, Any]:
        """name -> this rank's piece of the parameter: a 1-D view of its flat shard (maybe empty)."""
        me, pieces = self.shard_group.rank, {}
        for unit in self.layouts:
            for lay in unit:
                lo, hi = lay.shard_range(me)
                shard = self._shards[lay.key]
                for i, (name, off) in enumerate(zip(lay.names, lay.offsets)):
                    a, b = min(max(lo, off), hi), min(max(lo, off + lay.size_of(i)), hi)
                    pieces[name] = shard[a - lo:b - lo]
        return {name: pieces[name] for unit in self.units for name in unit}

    def _where(self, op: str) -> str:
        return where(f"{self._strategy}.{op}", self.shard_group)

    def _unit(self, unit: int, op: str) -> int:
        if isinstance(unit, bool) or not isinstance(unit, int) or not 0 <= unit < len(self.units):
            raise DistValueError(f"{self._where(op)}: unknown unit {unit!r}; valid units are "
                                 f"0..{len(self.units) - 1}")
        return unit

    # ------------------------------------------------------------------ parameters
    def _start_gather(self, u: int) -> tuple[list[Work], list[Any]]:
        works, buffers = [], []
        for lay in self.layouts[u]:
            shard = self._shards[lay.key]
            dtype = self.param_dtype or lay.dtype
            send = shard if shard.dtype == dtype else shard.astype(dtype)
            full = array_namespace(shard).empty(lay.padded, dtype=dtype)
            works.append(self.shard_group.all_gather_into_tensor(full, send, async_op=True))
            buffers.append(full)
        return works, buffers

    def prefetch(self, unit: int) -> None:
        """Start all-gathering ``unit`` now, so that the next ``unshard(unit)`` does not wait."""
        u = self._unit(unit, "prefetch")
        if u not in self._full and u not in self._prefetching:
            self._prefetching[u] = self._start_gather(u)
            self._track_peak()

    @contextlib.contextmanager
    def unshard(self, unit: int) -> Iterator[dict[str, Any]]:
        """All-gather ``unit`` and yield ``{name: full parameter}`` (views into the gathered buffer;
        for a DTensor parameter, a DTensor laid out as it over this rank's gathered block).

        On exit the buffer is freed when ``reshard_after_forward``. Entering a unit that is
        already unsharded (nested, without exit) is an error.
        """
        u = self._unit(unit, "unshard")
        if u in self._active:
            raise DistValueError(f"{self._where('unshard')}: unit {u} is already unsharded (unshard({u}) "
                                 "was entered again before its exit)")
        if u not in self._full:
            works, buffers = self._prefetching.pop(u, None) or self._start_gather(u)
            for work in works:
                work.wait()
            views = {}
            for lay, full in zip(self.layouts[u], buffers):
                views.update(lay.views(full))
            self._full[u] = (wrap_all({n: views[n] for n in self.units[u]}, self._block_layouts), buffers)
            self._track_peak()
        self._active.add(u)
        self._used.add(u)
        try:
            yield self._full[u][0]
        finally:
            self._active.discard(u)
            if self.reshard_after_forward:
                self._full.pop(u, None)

    def _track_peak(self) -> None:
        self._peak = max(self._peak, self._comm_bytes())

    def _comm_bytes(self) -> int:
        held = [b for _, buffers in self._full.values() for b in buffers]
        held += [b for _, buffers in self._prefetching.values() for b in buffers]
        # (the gradient slots are not counted: the packed gradients were transient before them, and the
        # planner predicts these bytes on every engine; memory_report's shared_memory_mapped holds them)
        return sum(int(b.nbytes) for b in held)

    # ------------------------------------------------------------------ gradients and step
    def mark_grad_ready(self, name: str, grad: Any = None) -> None:
        """Declare parameter ``name``'s full gradient ``grad`` final for this backward pass.

        Once every gradient of its unit is marked, the unit's gradients are reduce-scattered
        into the gradient shards, asynchronously (averaged over every data-parallel rank and
        added, so micro-batches accumulate until ``zero_grad()``). Units are reduced last unit
        first, whatever order the ranks mark them in: a unit complete early waits for the units
        after it (collectives pair by order; rule 3 of :mod:`~meshkit.parallel.data_parallelism.protocol`).
        Under ``no_sync()`` the gradient is added to a local full-size sum instead, reduced with
        the next synchronized pass. A DTensor parameter's gradient is a DTensor laid out as it, or
        this rank's block.

        Raises:
            DistValueError: an unknown name, a wrong shape or dtype (the unsharded parameter's:
                ``param_dtype`` if set), a gradient marked twice in one pass (nothing changes);
                on every rank, a mark once every gradient of the pass is marked (a second mark or a
                skipped ``step()``: the pass fails on every rank).
            DistTypeError: no gradient (FSDP keeps no gradient arrays to write into), or an array
                of another library than the parameters'.
        """
        head = self._where("mark_grad_ready")
        try:
            u = self._grad_of[name][0]
        except (KeyError, TypeError):
            raise DistValueError(f"{head}: unknown parameter {name!r}; valid names are "
                                 f"{[n for unit in self.units for n in unit]}") from None
        if grad is None:
            raise DistTypeError(f"{head}: gradient {name!r} is None; FullyShardedDataParallel keeps no gradient "
                                "arrays to write into: pass it, mark_grad_ready(name, grad)")
        if self._sync and name in self._pass_marked:  # under no_sync() a second mark is the next micro-batch's
            if len(self._pass_marked) == len(self._grad_of):
                self._end_pass("mark_grad_ready", USE, marked_after_complete(name))  # raises on every rank
            raise marked_twice(head, name)
        if isinstance(grad, DTensor):
            grad = block_of(head, f"gradient {name!r}", name, grad, self._block_layouts.get(name))
        self._check_grad(head, name, grad)
        held = self._accumulated.pop(name, None)
        if held is not None:
            held += grad
        if not self._sync:
            self._accumulated[name] = held if held is not None else grad.copy()
            return
        # held until the unit is complete: a copy, so that the caller may reuse its array
        marks = self._marks.setdefault(u, {})
        marks[name] = held if held is not None else grad.copy()
        self._pass_marked.add(name)
        if len(marks) == len(self.units[u]):
            del self._marks[u]
            self._queued[u] = marks
            self._launch_in_order()

    def _check_grad(self, head: str, name: str, g: Any) -> None:
        _, shape, dtype, key = self._grad_of[name]
        check_gradient(head, name, g, shape, dtype, self._shards[key], "the parameter shards",
                       block=name in self._block_layouts)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate marked gradients locally, at full size: nothing is reduced until the context exits."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def reduce_grads(self, unit: int, grads: dict[str, Any]) -> None:
        """Deprecated: :meth:`mark_grad_ready` each gradient (the unit is reduced once all are marked).

        It reduces the unit at once, in the order of the calls (every rank must call it alike),
        and may reduce a unit several times before ``step()`` (micro-batches add up).
        """
        deprecated("FullyShardedDataParallel.reduce_grads(unit, grads)",
                   "call mark_grad_ready(name, grad) for each gradient; the unit is reduced once all are marked")
        u = self._unit(unit, "reduce_grads")
        names = self.units[u]
        head = self._where("reduce_grads")
        if not isinstance(grads, dict) or sorted(grads) != sorted(names):
            got = sorted(grads) if isinstance(grads, dict) else type(grads).__name__
            raise DistValueError(f"{head}: unit {u} needs gradients for {names}, got {got}")
        grads = {n: block_of(head, f"gradient {n!r}", n, g, self._block_layouts.get(n)) if isinstance(g, DTensor) else g
                 for n, g in grads.items()}
        for name in names:  # check everything before launching anything
            self._check_grad(head, name, grads[name])
        self._reduce_unit(u, grads)

    def _launch_in_order(self) -> None:
        """Reduce the complete units whose turn it is: in ``_order``, each after those before it
        (a unit reduced with ``reduce_grads`` in this pass has had its turn)."""
        order = self._order
        while self._next < len(order):
            u = order[self._next]
            if u in self._queued:
                self._reduce_unit(u, self._queued.pop(u))
            elif u not in self._issued:
                return
            self._next += 1

    def _reduce_unit(self, u: int, grads: dict[str, Any]) -> None:
        """Reduce-scatter unit ``u``'s full gradients (missing ones zero) into the local shards,
        asynchronously: averaged over every data-parallel rank (DDP's semantics) and added to the
        shard, so several micro-batches accumulate until ``zero_grad()``."""
        for lay in self.layouts[u]:
            dtype = self.reduce_dtype or lay.dtype
            if self._grad_slots:
                turn = self._slot_turn % len(self._grad_slots)
                self._slot_turn += 1
                flat = lay.pack_into(grads, self._take_slot(turn)[:lay.padded * np.dtype(dtype).itemsize].view(dtype))
            else:
                flat = lay.pack(grads, self._shards[lay.key], dtype=dtype)
            work = self.shard_group.run_async(self._reduction(lay, flat), "fsdp_reduce_grads")
            self._pending.append(work)
            if self._grad_slots:
                self._slot_work[turn] = work
        self._issued.add(u)

    def _take_slot(self, turn: int) -> Any:
        """Gradient slot ``turn``, once the reduction that last read it finished (its error, if any, is
        raised where every pending reduction is waited for: _wait_pending)."""
        work, self._slot_work[turn] = self._slot_work[turn], None
        if work is not None:
            try:
                work.wait()
            except BaseException:  # noqa: BLE001 (raised again by _wait_pending, which waits for it too)
                pass
        return self._grad_slots[turn]

    def _reduction(self, lay: FlatLayout, flat: Any) -> Any:
        target = self._grad_shards[lay.key]

        def run() -> None:
            out = array_namespace(flat).empty(lay.shard_size, dtype=flat.dtype)
            self.shard_group.reduce_scatter_tensor(out, flat, ReduceOp.AVG)
            if self.replicate_group is not None:
                self.replicate_group.all_reduce(out, ReduceOp.AVG)
            target[...] += out if out.dtype == target.dtype else out.astype(target.dtype)

        return run

    def _wait_pending(self) -> None:
        """Wait for every pending reduction, then raise the first failure, if any (a reduction left
        running would add into the shards after zero_grad() zeroed them)."""
        pending, self._pending = self._pending, []
        error: BaseException | None = None
        for work in pending:
            try:
                work.wait()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error

    def _pass_open(self) -> bool:
        """Whether this synchronized pass has anything to end: marks, or reductions issued or waiting."""
        return bool(self._pass_marked or self._issued or self._queued)

    def _end_pass(self, op: str, code: int, problem: str | None = None) -> None:
        """End this synchronized pass alike on every rank (rules 3-5 of
        :mod:`~meshkit.parallel.data_parallelism.protocol`): reduce every unit not reduced yet, in
        ``_order`` (a complete one with its gradients, others with zeros, as parameters without a
        gradient), wait, and agree. Collective over the mesh.

        Raises:
            DistValueError: on every rank, when a rank had a problem (``problem``; units unsharded
                but never reduced), discarded the pass while others used it, or took another
                number of optimizer steps: the gradient shards are zeroed on every rank.
        """
        if code == USE and problem is None:
            forgotten = sorted(self._used - self._issued - set(self._queued))
            if forgotten:
                problem = (f"units {forgotten} were unsharded since the last step but none of their gradients were "
                           "marked ready (nor reduce_grads called for them); their gradients would be lost")
        for u in self._order[self._next:]:
            if u in self._queued:
                self._reduce_unit(u, self._queued.pop(u))
            elif u not in self._issued:
                self._reduce_unit(u, {})
        self._next = 0
        self._issued.clear()
        self._pass_marked.clear()
        self._used.clear()
        try:
            self._wait_pending()
        except BaseException as exc:
            self._failed = f"the last gradient sync raised {type(exc).__name__}: {exc}"
            raise
        try:
            failure = self._agreement(code, self._steps.count, problem)
        except CollectiveMismatchError as exc:
            self._zero_grads()  # the reduced gradients may be garbage: nothing of this pass is applied
            self._failed = f"the gradient sync found a collective mismatch: {exc}"
            raise
        if failure is not None:
            self._zero_grads()  # a failed pass's gradients are garbage on every rank
            self._failed = failure
            raise failed_sync(self._where(op), failure)

    def _zero_grads(self) -> None:
        self._accumulated.clear()
        for g in self._grad_shards.values():
            g[...] = 0

    def zero_grad(self) -> None:
        """Zero the gradient shards and what ``no_sync()`` passes accumulated.

        A synchronized pass in progress is discarded: collective, as the ``step()`` it replaces
        (its units are reduced, with zeros where nothing was marked), so that a rank which
        skipped ``step()`` meets its peers' (rule 4 of :mod:`~meshkit.parallel.data_parallelism.protocol`).
        Every rank discarding it skips the step alike.

        Raises:
            DistValueError: inside a pass whose units are partly marked (mark the rest of their
                units first; nothing changes); on every rank, when some ranks discarded the pass
                while others stepped on it (naming the ranks that skipped ``step()``): the
                gradients are zeroed on every rank all the same.
        """
        if self._marks:
            raise DistValueError(f"{self._where('zero_grad')}: gradients {self._partly_marked()} were marked ready "
                                 "in a pass that was not finished; mark the rest of their units first")
        try:
            if self._pass_open():
                self._end_pass("zero_grad", DISCARD)
        finally:
            self._wait_pending()
            self._zero_grads()
            self._failed = None
            self._ended = False

    def _partly_marked(self) -> dict[int, list[str]]:
        return {u: [n for n in self.units[u] if n in marks] for u, marks in sorted(self._marks.items())}

    def _end_for_use(self, op: str) -> None:
        """Before the gradient shards are used by ``op`` (``step``, ``clip_grad_norm_``): end the
        synchronized pass (collective), unless ``clip_grad_norm_()`` ended it and nothing was
        marked since. Refused locally (nothing changes) after a failed pass, with units partly
        marked, or with gradients accumulated under ``no_sync()`` only."""
        if self._failed is not None:
            raise refused_after_failure(self._where(op), self._failed)
        if self._marks:
            missing = {u: [n for n in self.units[u] if n not in marks] for u, marks in sorted(self._marks.items())}
            raise DistValueError(f"{self._where(op)}: units {sorted(missing)} are partly marked: gradients "
                                 f"{missing} (unit: names) were not marked ready in this backward pass, so the "
                                 "units were never reduced")
        if self._accumulated:
            raise DistValueError(f"{self._where(op)}: gradients {sorted(self._accumulated)} were accumulated "
                                 "under no_sync() but never synchronized; run the last micro-batch outside no_sync()")
        if not self._ended or self._pass_open():
            self._end_pass(op, USE)
        self._ended = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """End the synchronized pass (as :meth:`step` does), then clip the gradient shards by the
        global norm (see :meth:`Shards.clip_grad_norm_
        <meshkit.parallel.data_parallelism.sharded.Shards.clip_grad_norm_>`); collective,
        before :meth:`step`."""
        self._end_for_use("clip_grad_norm_")
        return self.shards.clip_grad_norm_(max_norm, norm_type)

    def step(self) -> None:
        """End the synchronized pass (every unit reduced, in one order on every rank; the ranks
        agree), then update every shard.

        Raises:
            DistValueError: on every rank, when a rank had a problem with the pass (a unit
                unsharded since the last step whose gradients were never marked), discarded it,
                or skipped a step; locally (nothing changes), after a failed pass (call
                ``zero_grad()``), when a unit's gradients were only partly marked, or when
                gradients accumulated under ``no_sync()`` were never synchronized.
        """
        self._end_for_use("step")
        self._drop_prefetches()  # before the update: an in-flight gather still reads the shards
        for key, shard in self._shards.items():
            self.optimizer.update(key, shard, self._grad_shards[key])
        self._full.clear()  # gathered parameters are stale now
        self._ended = False
        self._steps.taken()
        self.shards.after_step()  # --survive: the buddy copy of the next shard (meshkit.parallel.buddy)

    # ------------------------------------------------------------------ what Shards asks (ShardOwner)
    def _shard_group(self) -> ProcessGroup:
        return self.shard_group

    def _layouts(self) -> list[FlatLayout]:
        return [lay for unit in self.layouts for lay in unit]

    def _param_shards(self) -> dict[str, Any]:
        return self._shards

    def _local_grad_shards(self) -> dict[str, Any]:
        return dict(self._grad_shards)

    def _quiesce(self) -> None:
        self._wait_pending()

    def _settle(self, op: str) -> None:
        if self._failed is not None:
            raise refused_after_failure(self._where(op), self._failed)
        self._wait_pending()

    def _agreement_groups(self) -> list[ProcessGroup]:
        return [self.shard_group] + ([self.replicate_group] if self.replicate_group is not None else [])

    def _loaded(self) -> None:
        self._drop_prefetches()
        self._full.clear()  # gathered parameters are stale now

    def _drop_prefetches(self) -> None:
        """Finish every prefetched gather and forget it: it read the shards as they were, so after
        an update or a load the next ``unshard`` gathers again (every rank drops the same units,
        since prefetches are collective calls made in one order)."""
        prefetching, self._prefetching = self._prefetching, {}
        for works, _ in prefetching.values():
            for work in works:
                work.wait()

    def _footprint(self) -> tuple[int, int, int, int]:
        """``comm_buffers`` are the unsharded units held now, ``peak_transient`` the most ever held."""
        return (sum(int(s.nbytes) for s in self._shards.values()), sum(int(g.nbytes) for g in self._grad_shards.values()),
                self._comm_bytes(), self._peak)
