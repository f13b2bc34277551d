"""What ZeRO and FSDP share: flat shards on every rank, and the same surface over them.

Both keep each rank's parameters, gradients and optimizer state as flat shards
(:class:`~meshkit.parallel.flat.FlatLayout`), so state dicts, gradient clipping and the memory
report are the same code: :class:`ShardedStrategy`. State dicts (:mod:`~meshkit.parallel.state_dict`)
are per parameter name and independent of the world size, so a state saved at one world size
loads at another.
"""

from __future__ import annotations

from typing import Any

from ..comm import ProcessGroup
from .clip import clip_grad_norm_
from .flat import FlatLayout
from .optim import Optimizer
from .state_dict import agree_on_load, check_state_dict, gather_state_dict, load_state_dict_into, state_dict_digest

__all__ = ["ShardedStrategy"]


class ShardedStrategy:
    """State dicts, gradient shards, clipping and memory report over flat shards.

    Subclasses set ``optimizer`` and define ``_shard_group`` (the group the shards are split
    over), ``_layouts``, ``_param_shards`` (this rank's parameter shard per layout key; writing
    them writes the parameters), ``_local_grad_shards`` and ``_footprint``. Optional:
    ``_quiesce`` (finish what is pending before shards are read or written), ``_settle`` (before
    gradient shards are used as averaged; default ``_quiesce``), ``_loaded`` (after a load wrote
    the parameter shards) and ``_agreement_groups`` (the groups whose ranks must load the same
    state dict; default the shard group).
    """

    optimizer: Optimizer
    _strategy = "ShardedStrategy"

    def _shard_group(self) -> ProcessGroup:
        raise NotImplementedError

    def _layouts(self) -> list[FlatLayout]:
        raise NotImplementedError

    def _param_shards(self) -> dict[str, Any]:
        raise NotImplementedError

    def _local_grad_shards(self) -> dict[str, Any]:
        raise NotImplementedError

    def _footprint(self) -> tuple[int, int, int, int]:
        """Bytes of (parameters, gradients, communication buffers, peak transient buffers)."""
        raise NotImplementedError

    def _quiesce(self) -> None:
        """Before shards are read or written: finish what is pending."""

    def _settle(self, op: str) -> None:
        """Before gradient shards are used as averaged by ``op``."""
        self._quiesce()

    def _agreement_groups(self) -> list[ProcessGroup]:
        return [self._shard_group()]

    def _loaded(self) -> None:
        """After ``load_full_state_dict`` wrote this rank's parameter shards."""

    # ------------------------------------------------------------------ the surface
    def grad_shards(self) -> dict[str, Any]:
        """This rank's averaged gradient shard per flat key."""
        self._settle("grad_shards")
        return self._local_grad_shards()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the gradients by their global norm (the single-process value), before ``step()``."""
        self._settle("clip_grad_norm_")
        return clip_grad_norm_(self._local_grad_shards(), max_norm, norm_type=norm_type, group=self._shard_group())

    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, Any] | None:
        """Parameters and optimizer state gathered to full size, per parameter name (collective).

        The result does not depend on the world size, so :meth:`load_full_state_dict` accepts it
        at any other. With ``rank0_only`` the other ranks get None. Its arrays are of the
        parameters' library: a CuPy model's state dict is on its GPU (``.get()`` each to save it).
        """
        self._quiesce()
        group = self._shard_group()
        sd = gather_state_dict(self._layouts(), self._param_shards(), self.optimizer, group)
        return None if rank0_only and group.rank != 0 else sd

    def load_full_state_dict(self, state_dict: dict[str, Any], *, strict: bool = True) -> None:
        """Load a full state dict (from ``full_state_dict``, at any world size) into the shards (collective).

        Args:
            state_dict: ``{"params": ..., "optimizer": ...}`` as :meth:`full_state_dict` returns.
                Its arrays may be NumPy or CuPy whatever the model's library: this is the one
                documented conversion (a checkpoint read on the host loads into a device model);
                each rank copies only its shard's pieces.
            strict: every parameter, and (once stepped) every parameter's optimizer state and
                step count, must be there with the optimizer's keys, and nothing else. False:
                what is missing keeps its current value, unknown entries are ignored.

        Raises:
            DistValueError: on every rank, and before anything is loaded, when some rank's state
                dict is invalid (naming the rank, the key, expected and got) or the ranks' state
                dicts differ.
        """
        self._quiesce()
        layouts, who = self._layouts(), f"{self._strategy}.load_full_state_dict"
        problem = check_state_dict(layouts, state_dict, self.optimizer, strict)
        digest = None if problem else state_dict_digest(state_dict, strict)
        for group in self._agreement_groups():
            agree_on_load(group, who, problem, digest)
        load_state_dict_into(layouts, state_dict, self._param_shards(), self.optimizer, self._shard_group().rank,
                             strict)
        self._loaded()

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds: ``params``, ``grads``, ``optimizer_state``, ``comm_buffers``
        (buffers held now for communication) and ``peak_transient`` (the most ever held at once)."""
        params, grads, comm, peak = self._footprint()
        return {"params": params, "grads": grads, "optimizer_state": self.optimizer.state_nbytes(),
                "comm_buffers": comm, "peak_transient": peak}
