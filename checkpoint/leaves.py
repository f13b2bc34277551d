"""A state dict as flat keys and leaves: arrays as this rank's boxes of global arrays, the rest as values.

A state dict is a nested ``dict`` whose leaves are

* a NumPy or CuPy array: replicated, this rank holds all of it (DDP's parameters, a step counter
  as a 0-d array);
* a list of :class:`~meshkit.parallel.ShardedArray`: this rank's boxes of a global array (ZeRO,
  FSDP; possibly an empty list);
* a :class:`~meshkit.tensor.DTensor`: its local block (``Shard`` placements cut it; ``Replicate``
  copies hold the same box, written once);
* a JSON value (``int``, ``float``, ``str``, ``bool``, ``None``, lists of them): kept in the
  metadata file and replaced in the dict on load (like DCP's non-tensor values).

Nested keys are joined with ``.``: ``{"optim": {"step": {"w0": 3}}}`` is ``optim.step.w0``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator

import numpy as np

from ..parallel import ShardedArray, is_array
from ..tensor import DTensor, Partial, local_shape_and_offset
from .errors import CheckpointError

__all__ = ["Piece", "ArrayLeaf", "flatten", "array_leaf", "check_dtype", "is_value", "json_value"]


@dataclasses.dataclass(frozen=True)
class Piece:
    """One box of a global array on this rank: ``data`` (a view into the owner) at ``offsets``;
    a ``replica`` box is saved by another rank (see :class:`~meshkit.parallel.ShardedArray`)."""

    offsets: tuple[int, ...]
    data: Any
    replica: bool = False

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.offsets, self.lengths


@dataclasses.dataclass(frozen=True)
class ArrayLeaf:
    """An array leaf: its global shape and dtype (None where this rank holds no piece) and pieces."""

    shape: tuple[int, ...] | None
    dtype: Any
    pieces: tuple[Piece, ...]


def is_value(x: Any) -> bool:
    """Whether ``x`` is stored as a JSON value (not as array data); NumPy scalars count (as their
    Python value)."""
    if x is None or isinstance(x, (bool, int, float, str, np.bool_, np.integer, np.floating)):
        return True
    return isinstance(x, (list, tuple)) and not any(isinstance(v, ShardedArray) for v in x) and all(
        is_value(v) for v in x)


def json_value(x: Any) -> Any:
    """``x`` (a value, see :func:`is_value`) as plain JSON types: lists for tuples, Python scalars."""
    if isinstance(x, (list, tuple)):
        return [json_value(v) for v in x]
    return x.item() if isinstance(x, np.generic) else x


def flatten(state_dict: Any, where: str, rank: int) -> Iterator[tuple[str, Any, Any, Any]]:
    """``(key, leaf, parent dict, parent key)`` for every leaf of ``state_dict``, in order."""
    if not isinstance(state_dict, dict):
        raise CheckpointError(f"meshkit.checkpoint: rank {rank}: {where}: state_dict must be a dict, "
                              f"got {type(state_dict).__name__}")
    seen: set[str] = set()
    yield from _walk(state_dict, "", where, rank, seen)


def _walk(d: dict, prefix: str, where: str, rank: int, seen: set[str]) -> Iterator[tuple[str, Any, Any, Any]]:
    for k, v in d.items():
        if not isinstance(k, str):
            raise CheckpointError(f"meshkit.checkpoint: rank {rank}: {where}: key {k!r} under {prefix or 'the top'!r}"
                                  f" is a {type(k).__name__}; state dict keys must be strings")
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _walk(v, key + ".", where, rank, seen)
            continue
        if key in seen:
            raise CheckpointError(f"meshkit.checkpoint: rank {rank}: {where}: two entries flatten to the key "
                                  f"{key!r} (a key containing '.' collides with a nested one)")
        seen.add(key)
        yield key, v, d, k


def array_leaf(key: str, value: Any, where: str, rank: int) -> ArrayLeaf | None:
    """``value`` as an :class:`ArrayLeaf`, or None if it is a JSON value.

    Raises:
        CheckpointError: a leaf of another type, a DTensor with a ``Partial`` placement, or an
            array whose dtype cannot be stored (:func:`check_dtype`).
    """
    leaf = _array_leaf(key, value, where, rank)
    if leaf is not None and leaf.dtype is not None:
        check_dtype(key, leaf.dtype, where, rank)
    return leaf


def check_dtype(key: str, dtype: Any, where: str, rank: int) -> None:
    """Refuse dtypes whose bytes are not their values: object arrays (their bytes are pointers
    into this process) and structured dtypes (``dtype.str``, what metadata.json records, is
    ``|V<n>`` and loses the fields, so the checkpoint could not be loaded back).

    Raises:
        CheckpointError: naming ``key`` and the dtype.
    """
    dt = np.dtype(dtype)
    if dt.hasobject and dt.fields is None:
        raise CheckpointError(f"meshkit.checkpoint: rank {rank}: {where}: {key!r} has dtype object: an object array "
                              "holds pointers to Python objects, not their values, and cannot be checkpointed; "
                              "convert it to a numeric or fixed-width string dtype, or keep it as a JSON value")
    if dt.fields is not None or dt.subdtype is not None:
        raise CheckpointError(f"meshkit.checkpoint: rank {rank}: {where}: {key!r} has the structured dtype {dt}: "
                              f"a checkpoint records a dtype as its dtype.str ({dt.str!r}), which loses the fields; "
                              "save each field as its own array")


def _array_leaf(key: str, value: Any, where: str, rank: int) -> ArrayLeaf | None:
    if isinstance(value, DTensor):
        if any(isinstance(p, Partial) for p in value.placements):
            raise CheckpointError(f"meshkit.checkpoint: rank {rank}: {where}: {key!r} is a DTensor with placements "
                                  f"{value.placements!r}; a Partial value is not an array yet: redistribute it to "
                                  "Replicate or Shard before saving or loading")
        mesh = value.device_mesh
        shape, offsets = local_shape_and_offset(value.shape, mesh.shape, mesh.get_coordinate(), value.placements)
        local = value.to_local()
        if tuple(local.shape) != tuple(shape):
            raise CheckpointError(f"meshkit.checkpoint: rank {rank}: {where}: {key!r}: DTensor local block has shape "
                                  f"{tuple(local.shape)}, its placements give {shape}")
        pieces = (Piece(offsets, local),) if math.prod(shape) else ()
        return ArrayLeaf(tuple(value.shape), local.dtype, pieces)
    if isinstance(value, np.generic):  # a NumPy scalar: a value, like the Python number it holds
        return None
    if is_array(value):
        return ArrayLeaf(tuple(value.shape), value.dtype, (Piece((0,) * value.ndim, value),))
    if isinstance(value, list) and all(isinstance(p, ShardedArray) for p in value) and value:
        shapes = {p.global_shape for p in value}
        dtypes = {str(p.dtype) for p in value}
        if len(shapes) > 1 or len(dtypes) > 1:
            raise CheckpointError(f"meshkit.checkpoint: rank {rank}: {where}: {key!r}: pieces disagree on the global "
                                  f"shape {sorted(shapes)} or dtype {sorted(dtypes)}")
        pieces = tuple(Piece(p.offsets, p.local, p.replica) for p in value if math.prod(p.lengths))
        return ArrayLeaf(value[0].global_shape, value[0].dtype, pieces)
    if isinstance(value, list) and not value:
        return ArrayLeaf(None, None, ())  # no pieces here; ambiguous with an empty JSON list, see the planner
    if is_value(value):
        return None
    raise CheckpointError(f"meshkit.checkpoint: rank {rank}: {where}: {key!r} is a {type(value).__name__}; a state "
                          "dict leaf must be an array, a list of ShardedArray, a DTensor or a JSON value "
                          "(int, float, str, bool, None, or a list of them)")
