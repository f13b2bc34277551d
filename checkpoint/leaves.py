"""A state dict as flat keys and leaves: arrays as this rank's boxes of global arrays, the rest as values.

A state dict is a nested ``dict`` whose leaves are

* a NumPy or CuPy array: replicated, this rank holds all of it (DDP's parameters, a step counter
  as a 0-d array);
* a list of :class:`~meshkit.parallel.ShardedArray`: this rank's boxes of a global array (ZeRO,
  FSDP; possibly an empty list);
* a :class:`~meshkit.tensor.DTensor`: its local block (``Shard`` placements cut it; ``Replicate``
  copies hold the same box, written once);
* a JSON value (``int``, ``float``, ``str``, ``bool``, ``None``, lists of them): kept in the
  metadata file and replaced in the dict on load (like DCP's non-tensor values);
* a :class:`~meshkit.parallel.StepCount`: a JSON value read from its optimizer when saved and
  written back into it when loaded (the dict keeps the same leaf, so it stays current).

Containers are dicts (string keys) and, as in torch's state dicts (``param_groups``), lists and
tuples of anything but JSON values (``[w0, w1]``, ``[{"lr": 0.1}, ...]``), nested by index.
Keys are joined with ``.`` into one flat key per leaf, a ``.`` or ``\\`` inside a key escaped
with ``\\`` so that no two leaves share one: ``{"optim": {"step": {"w0": 3}}}`` is
``optim.step.w0``, ``{"layer.0": {"w": x}}`` is ``layer\\.0.w`` and ``{"layer": [{"w": x}]}``
is ``layer.0.w``. Checkpoints of format version 1 and 2 joined keys without escaping; they are
read with their own keys (:func:`flatten`'s ``legacy``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator

import numpy as np

from ..comm._seams import is_array
from ..state import ShardedArray, StepCount
from ..tensor import DTensor, Partial, Replicate
from ..tensor._seams import local_shape_and_offset
from .errors import CheckpointError

__all__ = ["Piece", "ArrayLeaf", "flatten", "flat_key", "array_leaf", "check_dtype", "is_value", "json_value"]


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
    """An array leaf: its global shape and dtype (None where this rank holds no piece) and pieces;
    ``replicated``: other ranks hold the same boxes by the leaf's kind (a plain array, a DTensor
    over a ``Replicate`` mesh dim), so the plan checks that their copies agree."""

    shape: tuple[int, ...] | None
    dtype: Any
    pieces: tuple[Piece, ...]
    replicated: bool = False


def _plain(x: Any) -> bool:
    """A JSON value of plain types (lists of them included)."""
    if x is None or isinstance(x, (bool, int, float, str, np.bool_, np.integer, np.floating)):
        return True
    return isinstance(x, (list, tuple)) and all(_plain(v) for v in x)


def is_value(x: Any) -> bool:
    """Whether ``x`` is stored as a JSON value (not as array data): a plain value (NumPy scalars
    count, as their Python value), or a :class:`~meshkit.parallel.StepCount`."""
    return isinstance(x, StepCount) or _plain(x)


def json_value(x: Any) -> Any:
    """``x`` (a value, see :func:`is_value`) as plain JSON types now: lists for tuples, Python
    scalars, a step count's current count."""
    if isinstance(x, StepCount):
        return x.value
    if isinstance(x, (list, tuple)):
        return [json_value(v) for v in x]
    return x.item() if isinstance(x, np.generic) else x


def flat_key(path: tuple[str, ...], legacy: bool = False) -> str:
    """The flat key of a leaf at ``path``: its components joined by ``.``, each ``\\`` and ``.``
    in them escaped by a ``\\`` (``legacy``: joined as they are, as format versions 1 and 2 did)."""
    if legacy:
        return ".".join(path)
    return ".".join(c.replace("\\", "\\\\").replace(".", "\\.") for c in path)


def _is_container(v: Any) -> bool:
    """A dict, or a list/tuple that is not a leaf (a JSON value, or a non-empty list of
    ShardedArray pieces; an empty list is a leaf: no pieces here, or an empty JSON list)."""
    if isinstance(v, dict):
        return True
    if not isinstance(v, (list, tuple)) or not v or _plain(v):
        return False
    return not (isinstance(v, list) and all(isinstance(p, ShardedArray) for p in v))


def flatten(state_dict: Any, where: str, rank: int, *, legacy: bool = False) -> Iterator[tuple[str, Any, Any, Any]]:
    """``(key, leaf, parent container, key in the parent)`` for every leaf of ``state_dict``, in order.

    Args:
        legacy: keys as format versions 1 and 2 joined them (no escaping); two leaves that join
            to one such key are refused, naming both (the reader of an old checkpoint asks).
    """
    if not isinstance(state_dict, dict):
        raise CheckpointError(f"meshkit.checkpoint: rank {rank}: {where}: state_dict must be a dict, "
                              f"got {type(state_dict).__name__}")
    seen: dict[str, tuple[Any, ...]] = {}
    for path, v, parent, k in _walk(state_dict, (), where, rank):
        key = flat_key(path, legacy)
        if key in seen:  # only legacy keys can collide: escaping makes the join one-to-one
            raise CheckpointError(f"meshkit.checkpoint: rank {rank}: {where}: the entries at {list(seen[key])} and "
                                  f"{list(path)} both read the key {key!r} of this checkpoint (its format version "
                                  "joined keys with '.' without escaping); load it into a dict without keys "
                                  "containing '.', then save it again")
        seen[key] = path
        yield key, v, parent, k


def _walk(d: Any, prefix: tuple[str, ...], where: str, rank: int) -> Iterator[tuple[tuple[str, ...], Any, Any, Any]]:
    items = d.items() if isinstance(d, dict) else enumerate(d)
    for k, v in items:
        if isinstance(d, dict) and not isinstance(k, str):
            raise CheckpointError(f"meshkit.checkpoint: rank {rank}: {where}: key {k!r} under "
                                  f"{flat_key(prefix) or 'the top'!r} is a {type(k).__name__}; state dict keys must "
                                  "be strings")
        path = (*prefix, str(k))
        if _is_container(v):
            yield from _walk(v, path, where, rank)
        else:
            yield path, v, d, k


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
        replicated = any(isinstance(p, Replicate) and n > 1 for p, n in zip(value.placements, mesh.shape))
        return ArrayLeaf(tuple(value.shape), local.dtype, pieces, replicated)
    if isinstance(value, np.generic):  # a NumPy scalar: a value, like the Python number it holds
        return None
    if is_array(value):
        return ArrayLeaf(tuple(value.shape), value.dtype, (Piece((0,) * value.ndim, value),), True)
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
                          "dict leaf must be an array, a list of ShardedArray, a DTensor, a StepCount or a JSON "
                          "value (int, float, str, bool, None, or a list of them); dicts, lists and tuples of "
                          "leaves nest")
