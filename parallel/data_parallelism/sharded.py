"""What ZeRO and FSDP share: flat shards on every rank, and the same surface over them, as a part.

Both keep each rank's parameters, gradients and optimizer state as flat shards
(:class:`~meshkit.parallel.data_parallelism.flat.FlatLayout`), so state dicts, gradient clipping and the memory
report are the same code: :class:`Shards`, which each of them holds (``self.shards``) and hands
those calls to, rather than inheriting them. What a ``Shards`` asks of the strategy holding it is
declared, :class:`ShardOwner`, not read from attributes a mixin never defines. State dicts
(:mod:`~meshkit.parallel.data_parallelism.full_state`) are per parameter name and independent of
the world size, so a state saved at one world size loads at another.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from ...comm import DistValueError, ProcessGroup
from ...comm._seams import survive_budget
from ..buddy import BuddyCopy
from ..checks import where
from ..optim.clip import clip_grad_norm_, clip_grad_norm_parts
from .dtensors import BlockLayout
from .flat import FlatLayout
from ..optim.optimizers import Optimizer
from ...state import ShardedArray, StepCount
from ...state._seams import load_pieces
from .flat import flat_shard_pieces
from .full_state import (FullStateDict, agree_on_load, check_state_dict, current_shape, gather_state_dict,
                         load_state_dict_into, state_dict_digest)
from .protocol import deprecated, split_state_dict

__all__ = ["Shards", "ShardOwner", "ShardedStrategy"]


class ShardOwner(Protocol):
    """What :class:`Shards` asks of the strategy that holds it (ZeRO, FSDP).

    ``optimizer`` steps the flat shards; ``_strategy`` names the strategy in messages;
    ``_block_layouts`` maps each DTensor parameter (tensor parallelism) to its layout: the flat
    shards hold pieces of this rank's blocks of them (see :mod:`~meshkit.parallel.data_parallelism.dtensors`).
    """

    optimizer: Optimizer
    _strategy: str
    _block_layouts: dict[str, BlockLayout]

    def _shard_group(self) -> ProcessGroup:
        """The group the shards are split over."""

    def _layouts(self) -> list[FlatLayout]:
        """The flat layouts, in order."""

    def _param_shards(self) -> dict[str, Any]:
        """This rank's parameter shard per layout key (writing them writes the parameters)."""

    def _local_grad_shards(self) -> dict[str, Any]:
        """This rank's gradient shard per layout key."""

    def _footprint(self) -> tuple[int, int, int, int]:
        """Bytes of (parameters, gradients, communication buffers, peak transient buffers)."""

    def _quiesce(self) -> None:
        """Before shards are read or written: finish what is pending."""

    def _settle(self, op: str) -> None:
        """Before gradient shards are used as averaged by ``op``: refuse if they are not."""

    def _agreement_groups(self) -> list[ProcessGroup]:
        """The groups whose ranks must load the same state dict."""

    def _loaded(self) -> None:
        """After a load wrote this rank's parameter shards: refresh what derives from them."""


class Shards:
    """State dicts, gradient shards, clipping and memory report over a strategy's flat shards.

    Args:
        owner: the strategy holding this part (a :class:`ShardOwner`).
    """

    def __init__(self, owner: ShardOwner) -> None:
        self.owner = owner
        #: under ``meshkit-run --survive K``: a copy of the next shard's state (:mod:`meshkit.parallel.buddy`)
        self.buddy: BuddyCopy | None = BuddyCopy(owner) if survive_budget() > 0 else None

    def after_step(self, force: bool = False) -> None:
        """The strategy's ``step()`` ends here: the buddy copy renewed, under ``--survive`` only, when
        the step count is a multiple of ``MESHKIT_BUDDY_EVERY`` (or ``force``: right after a shrink;
        one memcpy into this rank's segment within a node, else an exchange over the shard group:
        :mod:`meshkit.parallel.buddy`)."""
        if self.buddy is not None:
            self.buddy.refresh(force)

    # ------------------------------------------------------------------ the surface
    def grad_shards(self) -> dict[str, Any]:
        """This rank's averaged gradient shard per flat key."""
        self.owner._settle("grad_shards")
        return self.owner._local_grad_shards()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the gradients by their global norm (the single-process value), before ``step()``.

        The shards' partial sums are added over the shard group. With DTensor parameters the
        flat shards hold pieces of tensor-parallel blocks: each piece's partial sum is added over
        the shard group and over the mesh dims its parameter is ``Shard`` on (a ``Replicate``
        dim counts its copy once), as :func:`clip_grad_norm_` does for DTensors. Collective over
        the shard group and the parameters' meshes.
        """
        self.owner._settle("clip_grad_norm_")
        shards, group = self.owner._local_grad_shards(), self.owner._shard_group()
        if not self.owner._block_layouts:
            return clip_grad_norm_(shards, max_norm, norm_type=norm_type, group=group)
        parts: dict[Any, list[Any]] = {}  # (mesh, sharded dims) or None (plain) -> pieces in this rank's shards
        for lay in self.owner._layouts():
            lo, hi = lay.shard_range(group.rank)
            for i, (name, off) in enumerate(zip(lay.names, lay.offsets)):
                block = self.owner._block_layouts.get(name)
                pieces = parts.setdefault(None if block is None else (block.mesh, block.sharded_dims), [])
                a, b = max(lo, off), min(hi, off + lay.size_of(i))
                if a < b:
                    pieces.append(shards[lay.key][a - lo:b - lo])
        # Every rank has every part (its parameters' layouts agree), empty or not, so the collectives
        # match; an empty part reduces an empty slice of a shard, so that its buffer is of the
        # shards' library (a host buffer on one rank and a device one on another would meet two engines).
        empty = next(iter(shards.values()))[:0]
        return clip_grad_norm_parts([(pieces or [empty], [group] + ([] if key is None else
                                                                    [key[0].get_group(d) for d in key[1]]))
                                     for key, pieces in parts.items()], max_norm, norm_type=norm_type)

    def _refuse_full(self, op: str) -> None:
        if self.owner._block_layouts:
            raise DistValueError(f"{where(f'{self.owner._strategy}.{op}', self.owner._shard_group())}: parameters "
                                 f"{list(self.owner._block_layouts)} are DTensors, whose full state dict cannot be "
                                 "loaded (full_state_dict() gives their global arrays, but a load would have to cut "
                                 "each rank's block out of them); use state_dict() / "
                                 "meshkit.checkpoint.get_state_dict(), whose boxes are of the global arrays")

    def full_state_dict(self, *, rank0_only: bool = False) -> FullStateDict | None:
        """Parameters and optimizer state gathered to full size, per parameter name (collective).

        Returns:
            ``{"model": {name: array}, "optim": {"state": {name: {key: array}}, "step": {name: int},
            "hyper": {...}}}`` (the shape of :meth:`state_dict`, full size; optimizer state arrays
            shaped as their parameters) of NumPy arrays on every rank (a CuPy model's copied to
            the host; a DTensor parameter's global array, gathered over its mesh too). It does not
            depend on the world size, so :meth:`load_full_state_dict` accepts it at any other.
            With ``rank0_only`` the other ranks get None. ``["params"]`` and ``["optimizer"]``,
            earlier releases' keys, still read ``["model"]`` and ``["optim"]`` with a ``DeprecationWarning``.
        """
        self.owner._quiesce()
        group = self.owner._shard_group()
        sd = gather_state_dict(self.owner._layouts(), self.owner._param_shards(), self.owner.optimizer, group, self.owner._block_layouts)
        return None if rank0_only and group.rank != 0 else sd

    def load_full_state_dict(self, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
        """Load a full state dict (from ``full_state_dict``, at any world size) into the shards (collective).

        Args:
            state_dict: ``{"model": ..., "optim": ...}`` as :meth:`full_state_dict` returns
                (``optim["hyper"]`` may be left out: the optimizer keeps its own; the keys of earlier
                releases, ``"params"`` and ``"optimizer"``, load too, with a ``DeprecationWarning``).
                Its arrays may be NumPy or CuPy whatever the model's library: this is the one
                documented conversion (a checkpoint read on the host loads into a device model);
                each rank copies only its shard's pieces.
            strict: every parameter, and (once stepped) every parameter's optimizer state and
                step count, must be there with the optimizer's keys, and nothing else. False:
                what is missing keeps its current value, unknown entries are ignored.

        Raises:
            DistValueError: on every rank, and before anything is loaded, when some rank's state
                dict is invalid (naming the rank, the key, expected and got) or the ranks' state
                dicts differ; with DTensor parameters (use :meth:`load_sharded_state_dict`).
        """
        self._refuse_full("load_full_state_dict")
        state_dict = current_shape(state_dict)
        self.owner._quiesce()
        layouts, who = self.owner._layouts(), f"{self.owner._strategy}.load_full_state_dict"
        problem = check_state_dict(layouts, state_dict, self.owner.optimizer, strict)
        digest = None if problem else state_dict_digest(state_dict, strict)
        for group in self.owner._agreement_groups():
            agree_on_load(group, who, problem, digest)
        load_state_dict_into(layouts, state_dict, self.owner._param_shards(), self.owner.optimizer, self.owner._shard_group().rank,
                             strict)
        self.owner._loaded()

    def state_dict(self) -> dict[str, Any]:
        """This rank's pieces of the parameters and optimizer state, as views: nothing is gathered.

        Returns:
            ``{"model": {name: [ShardedArray]}, "optim": {"state": {name: {key: [ShardedArray]}},
            "step": {name: StepCount}}}`` (see :mod:`~meshkit.state.boxes`): the same keys at
            any world size and for any strategy. The optimizer state is materialized (zeros at step
            0) if the optimizer has not stepped yet, so a checkpoint can be loaded in place into a
            fresh strategy; write the views, then call :meth:`load_state_dict`. A DTensor
            parameter's boxes (and its optimizer state's) are boxes of its global array: its flat
            shard's pieces of this rank's block, placed at the block's offset, so that a checkpoint
            reshards across tensor-parallel meshes and strategies.
        """
        self.owner._quiesce()
        rank, shards = self.owner._shard_group().rank, self.owner._param_shards()
        model: dict[str, list[ShardedArray]] = {}
        state: dict[str, dict[str, list[ShardedArray]]] = {}
        step: dict[str, StepCount] = {}
        for lay in self.owner._layouts():
            model.update(flat_shard_pieces(lay, shards[lay.key], rank))
            for key, flat in self.owner.optimizer.materialize(lay.key, shards[lay.key]).items():
                for name, pieces in flat_shard_pieces(lay, flat, rank).items():
                    state.setdefault(name, {})[key] = pieces
            step.update({name: StepCount(self.owner.optimizer, lay.key) for name in lay.names})
        for name, block in self.owner._block_layouts.items():
            model[name] = block.place(model[name])
            if name in state:  # an optimizer without state (SGD without momentum) has none
                state[name] = {k: block.place(v) for k, v in state[name].items()}
        return {"model": model, "optim": {"state": state, "step": step}}

    def sharded_state_dict(self) -> dict[str, Any]:
        """Deprecated: :meth:`state_dict` (the protocol's name)."""
        deprecated(f"{self.owner._strategy}.sharded_state_dict()", "call state_dict()")
        return self.state_dict()

    def load_sharded_state_dict(self, model_state_dict: dict[str, Any], optim_state_dict: dict[str, Any]) -> None:
        """Deprecated: :meth:`load_state_dict` of ``{"model": ..., "optim": ...}``."""
        deprecated(f"{self.owner._strategy}.load_sharded_state_dict(model, optim)",
                   'call load_state_dict({"model": model, "optim": optim})')
        self.load_state_dict({"model": model_state_dict, "optim": optim_state_dict})

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Take in a state dict of :meth:`state_dict`'s shape, ``{"model": ..., "optim": ...}`` (collective).

        Pieces that are this strategy's own views (a checkpoint loaded in place into
        :meth:`state_dict`) need no copy; others are copied in box by box. Then the
        optimizer's step counts are set and the strategy refreshes what derives from its shards
        (ZeRO all-gathers the parameters, FSDP drops gathered units).

        Raises:
            DistValueError: a key, box or step does not match this strategy (naming it).
        """
        where_ = f"{self.owner._strategy}.load_state_dict"
        model_state_dict, optim_state_dict = split_state_dict(where_, state_dict, self.owner._shard_group())
        mine = self.state_dict()
        load_pieces(where_, "model", mine["model"], model_state_dict)
        load_pieces(where_, "optim.state", mine["optim"]["state"], optim_state_dict.get("state"))
        steps = optim_state_dict.get("step")
        for lay in self.owner._layouts():
            counts = {int(steps[n]) for n in lay.names if isinstance(steps, dict) and n in steps}
            if len(counts) != 1:
                raise DistValueError(f"meshkit.parallel: rank {self.owner._shard_group().rank}: {where_}: the step counts of "
                                     f"parameters {list(lay.names)} (one flat shard, one count) must be given and "
                                     f"equal, got {sorted(counts)}")
            self.owner.optimizer.steps[lay.key] = counts.pop()
        self.owner._loaded()

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds: ``params``, ``grads``, ``optimizer_state``, ``comm_buffers``
        (buffers held now for communication) and ``peak_transient`` (the most ever held at once);
        under ``meshkit-run --survive``, ``buddy`` too (the copy of the next shard's parameters and
        optimizer state, :mod:`meshkit.parallel.buddy`; not within ``comm_buffers``); where the
        strategy's groups have shared-memory segments (their ranks share a node: comm/engines/shm.py),
        ``shared_memory_mapped``: the bytes of them this rank maps (``ProcessGroup.shared_memory_bytes``:
        ZeRO's flat buffers inside them among them, which ``params`` and ``grads`` count too, and FSDP's
        two gradient slots, which nothing else counts; every rank of the node maps the same pages)."""
        params, grads, comm, peak = self.owner._footprint()
        report = {"params": params, "grads": grads, "optimizer_state": self.owner.optimizer.state_nbytes(),
                  "comm_buffers": comm, "peak_transient": peak}
        if self.buddy is not None:
            report["buddy"] = self.buddy.nbytes
        mapped = sum(group.shared_memory_bytes() for group in self.owner._agreement_groups())
        if mapped:
            report["shared_memory_mapped"] = mapped
        return report


#: 0.2's name: the flat shards' surface was a base class of ZeRO and FSDP; it is the part they hold now.
ShardedStrategy = Shards
