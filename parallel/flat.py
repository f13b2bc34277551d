"""Flat parameters: arrays of one dtype in one buffer, padded to split into equal shards.

Sharded data parallel keeps each dtype's parameters (per unit, for FSDP) in one flat buffer whose
length is padded up to a multiple of the number of shards N; rank r owns elements
``[r * S, (r + 1) * S)`` with ``S = padded / N``. A :class:`FlatLayout` is that arithmetic:
where each parameter lies, which shard holds which piece, and the conversions between per-
parameter arrays and shards that state dicts need (so a state saved at one world size loads
at another). Padding is zero and stays zero under every elementwise optimizer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator, Sequence

from ..comm import ProcessGroup
from .optim import array_namespace

__all__ = ["FlatLayout", "make_layouts", "gather_state_dict", "load_state_dict_into"]


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Where parameters of one dtype lie in a flat buffer split into ``shards`` equal shards.

    Example (two parameters of 3 and 2 elements, 2 shards)::

        layout.offsets == (0, 3); layout.numel == 5; layout.padded == 6; layout.shard_size == 3
        layout.shard_range(1) == (3, 6)      # the second parameter and one padding element
    """

    key: str
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    dtype: Any
    numel: int
    shards: int

    @property
    def padded(self) -> int:
        return -(-self.numel // self.shards) * self.shards

    @property
    def shard_size(self) -> int:
        return self.padded // self.shards

    def size_of(self, index: int) -> int:
        return math.prod(self.shapes[index])

    def shard_range(self, shard: int) -> tuple[int, int]:
        return shard * self.shard_size, (shard + 1) * self.shard_size

    def views(self, buffer: Any) -> dict[str, Any]:
        """``name -> view`` of each parameter inside a full flat ``buffer``."""
        return {name: buffer[off:off + self.size_of(i)].reshape(shape)
                for i, (name, shape, off) in enumerate(zip(self.names, self.shapes, self.offsets))}

    def pack(self, arrays: dict[str, Any], like: Any, dtype: Any = None) -> Any:
        """A new padded flat buffer holding ``arrays`` (missing names and padding are zero)."""
        xp = array_namespace(like)
        flat = xp.zeros(self.padded, dtype=dtype or self.dtype)
        for i, (name, off) in enumerate(zip(self.names, self.offsets)):
            if name in arrays:
                flat[off:off + self.size_of(i)] = xp.asarray(arrays[name]).reshape(-1)
        return flat

    def owners(self, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """``(shard, lo, hi)``: flat elements ``lo:hi`` (within [start, stop)) belong to ``shard``."""
        for shard in range(self.shards):
            s, e = self.shard_range(shard)
            lo, hi = max(start, s), min(stop, e)
            if lo < hi:
                yield shard, lo, hi

    def gather_full(self, shard: Any, group: ProcessGroup) -> Any:
        """The full padded buffer from every rank's ``shard`` (collective over ``group``)."""
        full = array_namespace(shard).empty(self.padded, dtype=shard.dtype)
        group.all_gather_into_tensor(full, shard)
        return full

    def split(self, full: Any) -> dict[str, Any]:
        """Copies of each parameter out of a full flat buffer."""
        return {name: view.copy() for name, view in self.views(full).items()}


def make_layouts(params: dict[str, Any], order: Sequence[str], shards: int, prefix: str = "") -> list[FlatLayout]:
    """One layout per dtype over ``order`` (dtypes in order of first appearance).

    Keys are ``prefix + dtype name`` (e.g. ``"float32"``, ``"unit0.float64"``): they name the
    flat shard in the optimizer's state.
    """
    by_dtype: dict[Any, list[str]] = {}
    for name in order:
        by_dtype.setdefault(params[name].dtype, []).append(name)
    layouts = []
    for dtype, names in by_dtype.items():
        offsets, total = [], 0
        for name in names:
            offsets.append(total)
            total += int(params[name].size)
        layouts.append(FlatLayout(f"{prefix}{dtype.name}", tuple(names), tuple(tuple(params[n].shape) for n in names),
                                  tuple(offsets), dtype, total, shards))
    return layouts


def gather_state_dict(layouts: Sequence[FlatLayout], shards: dict[str, Any], optimizer: Any,
                      group: ProcessGroup) -> dict[str, Any]:
    """Full per-parameter state from every rank's flat shards; collective over ``group``.

    Returns ``{"params": {name: array}, "optimizer": {"steps": {name: int}, "state": {name:
    {key: array}}, "hyper": {...}}}``: nothing in it depends on the world size.
    """
    params: dict[str, Any] = {}
    steps: dict[str, int] = {}
    state: dict[str, dict[str, Any]] = {}
    for layout in layouts:
        params.update(layout.split(layout.gather_full(shards[layout.key], group)))
        for key, flat in sorted(optimizer.state.get(layout.key, {}).items()):
            for name, value in layout.split(layout.gather_full(flat, group)).items():
                state.setdefault(name, {})[key] = value.reshape(-1)
        if layout.key in optimizer.steps:
            steps.update({name: optimizer.steps[layout.key] for name in layout.names})
    return {"params": params, "optimizer": {"steps": steps, "state": state, "hyper": optimizer.hyper}}


def load_state_dict_into(layouts: Sequence[FlatLayout], state_dict: dict[str, Any], shards: dict[str, Any],
                         optimizer: Any, shard: int, who: str) -> None:
    """Copy this rank's shard of a full state dict (from any world size) into ``shards`` and
    the optimizer's per-key state."""
    params = state_dict.get("params", {})
    expected = [n for layout in layouts for n in layout.names]
    missing, extra = [n for n in expected if n not in params], sorted(set(params) - set(expected))
    if missing or extra:
        raise ValueError(f"meshkit.parallel: {who}.load_full_state_dict: parameters differ from the model's: "
                         f"missing {missing}, unexpected {extra}")
    for layout in layouts:
        for i, name in enumerate(layout.names):
            if tuple(params[name].shape) != layout.shapes[i]:
                raise ValueError(f"meshkit.parallel: {who}.load_full_state_dict: parameter {name!r} has shape "
                                 f"{tuple(params[name].shape)}, the model's is {layout.shapes[i]}")
    opt = state_dict.get("optimizer", {})
    for key, value in opt.get("hyper", {}).items():
        setattr(optimizer, key, value)
    for layout in layouts:
        lo, hi = layout.shard_range(shard)
        target = shards[layout.key]
        target[...] = layout.pack(params, target)[lo:hi]
        per_param = {n: opt.get("state", {}).get(n, {}) for n in layout.names}
        keys = sorted({k for s in per_param.values() for k in s})
        optimizer.state.pop(layout.key, None)
        optimizer.steps.pop(layout.key, None)
        if keys:
            optimizer.state[layout.key] = {
                k: layout.pack({n: s[k] for n, s in per_param.items() if k in s}, target)[lo:hi].copy() for k in keys}
        counts = {opt.get("steps", {}).get(n) for n in layout.names} - {None}
        if counts:
            optimizer.steps[layout.key] = max(counts)
