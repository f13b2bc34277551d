"""DistributedDataParallel: bucketed gradient averaging that overlaps the backward pass.

It implements the training-loop protocol of :mod:`~meshkit.parallel.data_parallelism.protocol` (one loop for
every strategy) with parts it holds: its gradient interface (``grads``, ``mark_grad_ready``,
``no_sync``...) is its :class:`~meshkit.parallel.data_parallelism.reducer.GradientReducer`'s
(``ddp.reducer``, ZeRO holds one too), forwarded as its own
(:class:`~meshkit.parallel.forwarding.forward_to`), its units a
:class:`~meshkit.parallel.data_parallelism.protocol.ReplicatedUnits` (``ddp.replicated``)::

    ddp = DistributedDataParallel(params, mesh=mesh["dp"], optimizer=SGD(lr=0.1, momentum=0.9))
    for x, y in batches:
        ddp.zero_grad()
        ...                                    # forward with ddp.params (or ddp.unshard(i))
        for layer in reversed(layers):         # backward, layer by layer
            ddp.mark_grad_ready("w3", dw3)     # its bucket starts averaging once complete
        ddp.step()                             # wait for the averages, run the optimizer

Gradients accumulate like torch's ``.grad``: ``zero_grad()`` zeroes them, a backward pass
writes or adds. Under ``with ddp.no_sync():`` nothing is communicated, so gradients of several
micro-batches add up locally; the next synchronized pass averages the sum.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import numpy as np

from ...comm import DistValueError, ProcessGroup, Work, broadcast_object_list
from ...mesh import DeviceMesh
from ...tensor import DTensor
from ..arrays import array_namespace
from ..checks import where
from .buckets import MB, BucketManager, CommHook, GradBucket
from ..optim.clip import clip_grad_norm_
from .dtensors import block_of, split, wrap_all
from .flat import FlatLayout
from .full_state import (FullStateDict, agree_on_load, check_state_dict, current_shape, full_array,
                         load_state_dict_into, state_dict_digest)
from .hooks import allreduce_hook
from ..optim.optimizers import Optimizer
from .protocol import ReplicatedUnits, check_units, deprecated, old_optimizer_argument, split_state_dict
from .reducer import GradientReducer
from ..forwarding import forward_attribute, forward_to
from ...state._seams import load_pieces, optimizer_state_views
from .construction import Params, broadcast_params, caps_problem, check_setup, resolve_data_parallel_group

__all__ = ["DistributedDataParallel"]

logger = logging.getLogger("meshkit")


class DistributedDataParallel:
    """Average gradients over a data-parallel group in buckets, overlapping the backward pass.

    Args:
        params: ordered ``dict[str, array]``; updated in place by your optimizer. Values may be
            DTensors laid out over another mesh dimension than ``mesh`` (tensor parallelism:
            ``mesh["tp"]`` beside ``mesh["dp"]``), none ``Partial``: each rank's block is averaged
            over the group (see :mod:`~meshkit.parallel.data_parallelism.dtensors`).
        mesh: a 1-D mesh (e.g. ``mesh["dp"]``) to average over; or pass ``group``.
        optimizer: the :class:`~meshkit.parallel.optim.optimizers.Optimizer` :meth:`step` runs on
            ``params`` (leaving it out and stepping an optimizer of your own on ``ddp.grads``
            is deprecated).
        units: lists of parameter names for :meth:`unshard`; default one unit of everything.
        group: a process group; neither ``mesh`` nor ``group`` (the world) is deprecated.
        bucket_cap_mb: cap of every bucket but the first of each dtype (torch's default, 25 MB).
        first_bucket_cap_mb: cap of each dtype's first bucket, small so that communication
            starts early in the backward pass (torch's 1 MB).
        gradient_as_bucket_view: ``grads[name]`` is a view into its bucket (no copies);
            otherwise gradients are separate arrays copied in and out of the buckets.
        broadcast_from: group rank whose parameters every rank starts from.
        comm_hook: ``hook(state, bucket) -> Work`` (see :mod:`meshkit.parallel.data_parallelism.hooks`);
            default :func:`allreduce_hook`.
        comm_state: the state passed to ``comm_hook`` (default: the group).
        find_unused_parameters: allow iterations where some gradients are never marked
            ready; they are reduced as they are (zero since ``zero_grad``).

    ``ddp.params`` is DDP's own read-only mapping of the same arrays (update them in place), and
    DDP keeps a snapshot of their names, shapes and dtypes: changing the caller's dict later does
    not change what is averaged. See :mod:`~meshkit.parallel.data_parallelism.reducer` for what reading
    ``ddp.grads`` during a pass does.

    With DTensor parameters, ``ddp.params[name]`` is a DTensor (the same mesh and placements)
    over the same block, ``ddp.grads[name]`` a DTensor laid out alike over the averaged block
    gradient, and ``mark_grad_ready(name, grad)`` takes a DTensor laid out as the parameter (or
    this rank's block), so that ``SGD``/``AdamW.step(ddp.params, ddp.grads)`` and
    ``clip_grad_norm_(ddp.grads, ...)`` work on them as on any DTensors. Example (4 ranks, mesh
    ``[[0, 1], [2, 3]]`` named ``("dp", "tp")``)::

        params = parallelize(full, mesh["tp"], {"w0": ColwiseParallel(), "w1": RowwiseParallel()})
        ddp = DistributedDataParallel(params, mesh=mesh["dp"])
        # rank 0 averages its block w0[:, :n/2] with rank 2's; rank 1 w0[:, n/2:] with rank 3's

    Raises:
        DistValueError: on every rank, when parameters (names, shapes, dtypes, order; a
            DTensor's placements, global shape and mesh coordinate) or settings differ across
            ranks (naming the parameter and the ranks), or any rank passes a bad argument (a
            ``Partial`` DTensor, one whose mesh holds other ranks of the group).
    """

    _strategy = "DistributedDataParallel"

    # the gradient interface: the reducer's own (ddp.mark_grad_ready is ddp.reducer.mark_grad_ready)
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

    def __init__(self, params: dict[str, Any], *, mesh: DeviceMesh | None = None, optimizer: Optimizer | None = None,
                 units: Sequence[Sequence[str]] | None = None, group: ProcessGroup | None = None,
                 bucket_cap_mb: float = 25, first_bucket_cap_mb: float = 1, gradient_as_bucket_view: bool = True,
                 broadcast_from: int = 0, comm_hook: Callable[[Any, GradBucket], Work] | None = None,
                 comm_state: Any = None, find_unused_parameters: bool = False) -> None:
        if mesh is None and group is None:
            deprecated("DistributedDataParallel without mesh= (meaning the world)", "pass mesh= (a 1-D DeviceMesh)")
        if optimizer is None:
            deprecated("DistributedDataParallel without optimizer= (stepping your own on ddp.grads)",
                       "pass optimizer= and call ddp.step()")
        self.group = resolve_data_parallel_group(mesh, group, self._strategy)
        problem = caps_problem(bucket_cap_mb, first_bucket_cap_mb)
        unit_list, units_problem = check_units(params, units) if isinstance(params, Mapping) else (None, None)
        problem = problem or units_problem
        if optimizer is not None and not isinstance(optimizer, Optimizer):
            problem = f"optimizer must be a meshkit Optimizer (SGD, AdamW), got {type(optimizer).__name__}"
        if not isinstance(broadcast_from, (int, np.integer)) or not 0 <= broadcast_from < self.group.size:
            problem = problem or (f"broadcast_from={broadcast_from!r} is not a rank of the group (valid: "
                                  f"0..{self.group.size - 1})")
        hook = comm_hook or allreduce_hook
        check_setup(params, self.group, self._strategy, problem=problem, config={
            "bucket_cap_mb": bucket_cap_mb, "first_bucket_cap_mb": first_bucket_cap_mb,
            "broadcast_from": broadcast_from, "find_unused_parameters": find_unused_parameters,
            "gradient_as_bucket_view": gradient_as_bucket_view, "comm_hook": getattr(hook, "__qualname__", None),
            "units": unit_list, "optimizer": repr(optimizer)})
        self.optimizer = optimizer
        self.units: list[list[str]] = unit_list  # type: ignore[assignment]
        # our own dict of this rank's blocks: later changes to the caller's do not reach the buckets
        arrays, self._block_layouts = split(params)
        broadcast_params(arrays, self.group, broadcast_from)
        self._blocks = arrays
        self.params = Params(wrap_all(arrays, self._block_layouts), self._strategy)
        self.replicated = ReplicatedUnits(self.units, self.params, self._where)  # unshard, prefetch
        self.gradient_as_bucket_view = gradient_as_bucket_view
        comm = CommHook(self.group, hook, self.group if comm_state is None else comm_state)
        self._buckets = BucketManager(arrays, list(reversed(arrays)),
                                      bucket_cap_bytes=int(bucket_cap_mb * MB),
                                      first_bucket_cap_bytes=int(first_bucket_cap_mb * MB), comm=comm)
        self._grads: dict[str, Any] = {}  # the arrays grads hands out, the reducer's too (see _bind_grads)
        # record_order: until the first synchronized pass's order has rebuilt the buckets (_rebuild)
        self.reducer = GradientReducer(self, strategy=self._strategy, group=self.group, blocks=arrays,
                                       block_layouts=self._block_layouts, buckets=self._buckets, arrays=self._grads,
                                       find_unused_parameters=find_unused_parameters,
                                       restore_views=gradient_as_bucket_view, record_order=True)
        self._bind_grads()

    def _bind_grads(self) -> None:
        """Point ``grads`` at the buckets' views (or, with copies, make the arrays once)."""
        for name, view in self._buckets.views().items():
            if self.gradient_as_bucket_view:
                self._grads[name] = view
            elif name not in self._grads:
                self._grads[name] = array_namespace(view).zeros_like(view)

    def _where(self, op: str) -> str:
        return where(f"{self._strategy}.{op}", self.group)

    def prefetch(self, unit: int) -> None:
        """Nothing to gather: every rank holds the full parameters (checks ``unit``)."""
        self.replicated.prefetch(unit)

    def unshard(self, unit: int) -> contextlib.AbstractContextManager[dict[str, Any]]:
        """Yield ``{name: parameter}`` of ``unit``: the parameters themselves (no communication)."""
        return self.replicated.unshard(unit)

    def register_comm_hook(self, state: Any, hook: Callable[[Any, GradBucket], Work]) -> None:
        """Use ``hook(state, bucket)`` to average buckets (torch's ``register_comm_hook``)."""
        self._buckets.comm.hook, self._buckets.comm.state = hook, state

    # ------------------------------------------------------------------ what the reducer asks (ReducerOwner)
    def _zero_grads(self) -> None:
        self._buckets.zero()
        if not self.gradient_as_bucket_view:
            for g in self._grads.values():
                g[...] = 0

    def _assign_grad(self, name: str, value: Any) -> None:
        """Keep the caller's array: it is checked and copied into its bucket when marked."""
        self._grads[name] = value

    def _after_sync(self, ready_order: list[str]) -> None:
        if not self.gradient_as_bucket_view:
            for name, g in self._grads.items():
                g[...] = self._buckets.view(name)
        if self.reducer.record_order:
            self._rebuild(ready_order)

    def _rebuild(self, ready_order: list[str]) -> None:
        """Once, after the first synchronized pass: rebuild buckets in the order gradients became
        ready (rank 0's order, broadcast so every rank agrees), as torch's reducer does."""
        self.reducer.record_order = False
        order = list(dict.fromkeys(ready_order))
        order += [n for n in reversed(self._blocks) if n not in set(order)]
        shared = [order]
        broadcast_object_list(shared, group_src=0, group=self.group)
        if shared[0] != [n for bucket in self._buckets.buckets for n in bucket.names]:
            self._buckets.build(shared[0], keep_values=True)
            self._bind_grads()
            logger.debug("meshkit: DDP rebuilt %d buckets in gradient-ready order", len(self._buckets.buckets))

    def step(self) -> None:
        """Finish the gradient sync (a pass whose every gradient is marked) and run the optimizer.

        Raises:
            DistValueError: no ``optimizer`` was given; or the gradients are not averaged (the
                pass is incomplete, the last sync failed, gradients were accumulated under
                ``no_sync()`` only, or no synchronized pass ran since ``zero_grad()``).
        """
        if self.optimizer is None:
            raise DistValueError(f"{self._where('step')}: no optimizer; pass optimizer= to DistributedDataParallel")
        self.reducer.ready_for_step("step")
        self.optimizer.step(self.params, self.grads)
        self.reducer.steps.taken()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Finish the gradient sync (a pass whose every gradient is marked), then clip the
        averaged gradients by their global norm, before :meth:`step` (torch's
        ``clip_grad_norm_(model.parameters(), ...)`` between backward and step).

        Collective: every rank of the group calls it. The averages are the same on every rank,
        so the norm needs no communication over the group; DTensor gradients add their norms
        over the mesh dims they are sharded on (:func:`~meshkit.parallel.clip_grad_norm_`).

        Returns:
            The total norm before clipping.

        Raises:
            DistValueError: as :meth:`step` when the gradients are not averaged.
        """
        self.reducer.ready_for_step("clip_grad_norm_")
        return clip_grad_norm_(dict(self.grads), max_norm, norm_type=norm_type)

    def full_state_dict(self, *, rank0_only: bool = False) -> FullStateDict | None:
        """Parameters and optimizer state, full size, as NumPy arrays on every rank.

        The shape of every strategy's (:mod:`~meshkit.parallel.strategy`): ``{"model": {name: array},
        "optim": {"state": {name: {key: array}}, "step": {name: int}, "hyper": ...}}``, copies
        (a CuPy model's on the host). No communication (every rank holds the parameters), except
        with DTensor parameters: their global arrays are gathered over their meshes (collective there).
        With ``rank0_only`` the other ranks get None.
        """
        blocks = self._block_layouts
        params = {name: full_array(p, blocks.get(name)) for name, p in self._blocks.items()}
        opt = self.optimizer
        if opt is None:
            sd = FullStateDict(model=params, optim={"state": {}, "step": {}, "hyper": {}})
        else:
            state = {name: {key: full_array(arr.reshape(self._blocks[name].shape), blocks.get(name))
                            for key, arr in sorted(opt.state[name].items())}
                     for name in self._blocks if name in opt.state}
            steps = {name: opt.steps[name] for name in self._blocks if name in opt.steps}
            sd = FullStateDict(model=params, optim={"state": state, "step": steps, "hyper": opt.hyper})
        return None if rank0_only and self.group.rank != 0 else sd

    def load_full_state_dict(self, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
        """Load a full state dict (any strategy's :meth:`full_state_dict`, at any world size; collective).

        Checked as the sharded strategies check it (names, shapes, the optimizer's keys; ``strict``
        as theirs), and all or nothing: every rank of the group loads the same one or none does.
        ``optim["hyper"]`` may be left out; the keys of earlier releases load with a ``DeprecationWarning``.

        Raises:
            DistValueError: on every rank, before anything is loaded, when some rank's state dict is
                invalid (naming the rank and the key) or the ranks' differ; with DTensor parameters
                (use :meth:`load_state_dict`, whose entries are DTensors), or without an optimizer.
        """
        who = f"{self._strategy}.load_full_state_dict"
        if self._block_layouts or self.optimizer is None:
            why = (f"parameters {list(self._block_layouts)} are DTensors, whose full state dict cannot be loaded "
                   "(a load would have to cut each rank's block out of the global arrays); use state_dict() / "
                   "load_state_dict()") if self._block_layouts else "it was built without optimizer="
            raise DistValueError(f"{self._where('load_full_state_dict')}: {why}")
        state_dict = current_shape(state_dict)
        layouts = [FlatLayout.over({name: block}, 1, key=name) for name, block in self._blocks.items()]
        problem = check_state_dict(layouts, state_dict, self.optimizer, strict)
        digest = None if problem else state_dict_digest(state_dict, strict)
        agree_on_load(self.group, who, problem, digest)
        flat = {name: block.reshape(-1).copy() for name, block in self._blocks.items()}
        load_state_dict_into(layouts, state_dict, flat, self.optimizer, 0, strict)
        for name, block in self._blocks.items():
            block[...] = flat[name].reshape(block.shape)

    def state_dict(self) -> dict[str, Any]:
        """The parameters and the optimizer's state as views (replicated: every rank holds all).

        Returns:
            ``{"model": {name: array}, "optim": {"state": {name: {key: array}}, "step": {name: StepCount}}}``
            with the keys of the sharded strategies (:mod:`~meshkit.state.boxes`); the
            optimizer's state is materialized (zeros at step 0) if it has not stepped yet. A
            DTensor parameter's entries are DTensors laid out as it (over its block and the
            block's state), which a checkpoint saves and loads as any DTensor.
        """
        return self._state_dict(self.optimizer)

    def sharded_state_dict(self, optimizer: Optimizer | None = None) -> dict[str, Any]:
        """Deprecated: :meth:`state_dict` (``optimizer``: pass it to the constructor)."""
        deprecated(f"{self._strategy}.sharded_state_dict()", "call state_dict(); pass the optimizer to the constructor")
        return self._state_dict(optimizer or self.optimizer)

    def _state_dict(self, optimizer: Optimizer | None) -> dict[str, Any]:
        if optimizer is None:
            return {"model": dict(self.params), "optim": {"state": {}, "step": {}}}
        optim = optimizer_state_views(optimizer, self._blocks)
        for name, layout in self._block_layouts.items():
            optim["state"][name] = {key: layout.wrap(arr) for key, arr in optim["state"][name].items()}
        return {"model": dict(self.params), "optim": optim}

    def _own_blocks(self, what: str, state: Any) -> Any:
        """A state dict's entries with DTensors laid out as their parameters replaced by their blocks."""
        if not isinstance(state, dict) or not self._block_layouts:
            return state
        head = self._where("load_state_dict")
        out = {}
        for name, value in state.items():
            if isinstance(value, dict):
                value = {k: block_of(head, f"{what}[{name!r}][{k!r}]", name, v, self._block_layouts.get(name))
                         if isinstance(v, DTensor) else v for k, v in value.items()}
            elif isinstance(value, DTensor):
                value = block_of(head, f"{what}[{name!r}]", name, value, self._block_layouts.get(name))
            out[name] = value
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Take in a state dict of :meth:`state_dict`'s shape, ``{"model": ..., "optim": ...}`` (views
        already written in place are not copied again), the optimizer's step counts included."""
        where_ = f"{self._strategy}.load_state_dict"
        model, optim = split_state_dict(where_, state_dict, self.group)
        self._load(where_, model, optim, self.optimizer)

    def load_sharded_state_dict(self, model_state_dict: dict[str, Any], optim_state_dict: dict[str, Any] | None = None,
                                optimizer: Optimizer | None = None) -> None:
        """Deprecated: :meth:`load_state_dict` of ``{"model": ..., "optim": ...}`` (``optimizer``: pass
        it to the constructor)."""
        deprecated(f"{self._strategy}.load_sharded_state_dict(model, optim)",
                   'call load_state_dict({"model": model, "optim": optim})')
        self._load(f"{self._strategy}.load_sharded_state_dict", model_state_dict, optim_state_dict,
                   optimizer or self.optimizer)

    def _load(self, where_: str, model_state_dict: Any, optim_state_dict: Any, optimizer: Optimizer | None) -> None:
        load_pieces(where_, "model", self._blocks, self._own_blocks("model", model_state_dict))
        if optimizer is not None:
            optim_state_dict = optim_state_dict or {}
            mine = optimizer_state_views(optimizer, self._blocks)
            load_pieces(where_, "optim.state", mine["state"], self._own_blocks("optim.state",
                                                                              optim_state_dict.get("state")))
            steps = optim_state_dict.get("step")
            if not isinstance(steps, dict) or set(steps) != set(self.params):
                raise DistValueError(f"meshkit.parallel: rank {self.group.rank}: {where_}: optim step must map every "
                                     f"parameter {list(self.params)} to its count")
            optimizer.steps.update({name: int(count) for name, count in steps.items()})

    @old_optimizer_argument
    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds: ``params``, ``grads``, ``optimizer_state`` (of the strategy's
        optimizer), ``comm_buffers`` (extra buffers for communication: none, the buckets are the
        gradients when ``gradient_as_bucket_view``) and ``peak_transient``; where the group has a
        shared-memory segment (its ranks share a node: comm/engines/shm.py), ``shared_memory_mapped``
        too: the bytes of it this rank maps (``ProcessGroup.shared_memory_bytes``: the buckets
        among them, which ``grads`` counts too; every rank of the node maps the same pages).
        (``memory_report(optimizer)``, for a DDP built without one, is deprecated.)"""
        params = sum(int(p.nbytes) for p in self._blocks.values())
        grads = self._buckets.nbytes
        comm = 0 if self.gradient_as_bucket_view else sum(int(g.nbytes) for g in self._grads.values())
        state = self.optimizer.state_nbytes() if self.optimizer is not None else 0
        report = {"params": params, "grads": grads, "optimizer_state": state, "comm_buffers": comm,
                  "peak_transient": 0}
        mapped = self.group.shared_memory_bytes()
        if mapped:
            report["shared_memory_mapped"] = mapped
        return report
