"""Sharded state dicts: each rank's pieces of the global arrays, as views into its own memory.

(Here, in :mod:`meshkit.state`, below ``parallel`` and ``checkpoint``: see the package's docstring.
The strategies' flat shards are cut into boxes by ``parallel/data_parallelism/flat.py``'s
``flat_shard_pieces``, with :func:`flat_range_boxes` and :func:`box_view` from here.)

A checkpoint must not gather a model to one rank. Instead every strategy describes what it
holds: for each parameter (and each optimizer state array) the N-D *boxes* of the global array
that live on this rank, each as a view into the strategy's own buffers, so that reading a box
reads the model and writing it (a checkpoint load) writes the model, with no copy in between.

Flat shards (ZeRO, FSDP) cut a parameter at arbitrary element offsets: a row-major flat range
``[start, stop)`` of an array is a box only when it spans whole rows. :func:`flat_range_boxes`
cuts such a range into at most ``2 * ndim - 1`` boxes (a partial row, whole blocks, a partial
row, recursively); each is contiguous in memory, so each box's data is a reshaped slice of the
flat shard, i.e. still a view. A reader wanting any other box (a DTensor's ``Shard(1)``, a
smaller world's flat range) intersects boxes; nothing here depends on who wrote what.

The keys do not depend on the strategy or the world size::

    {"model": {name: value},
     "optim": {"state": {name: {key: value}}, "step": {name: StepCount}}}

where a value is a full array (replicated: every rank holds all of it) or a list of
:class:`ShardedArray` (this rank's boxes; possibly empty). Optimizer state arrays have their
parameter's shape. A step count is a :class:`StepCount`: read from the optimizer whenever it
is used, so a state dict built once is as current as the arrays it views. ``full_state_dict()``
has the same keys with full arrays (the one state shape, :mod:`meshkit.parallel.strategy`).

**Words for a shard.** The house has one word for what a rank holds of a global array when it is
saved, loaded or compared across strategies: a *box*, a :class:`ShardedArray` (an N-D rectangle
of the global array at ``offsets``). Three other shapes of a shard remain, each because its
geometry is what its owner computes on, and each is described as boxes at the state-dict boundary:

- a :class:`~meshkit.tensor.DTensor` (torch's name and the user's type): a global array laid out
  over a mesh by placements; its local part, ``to_local()``, is a *block*. Kept because tensor
  parallelism computes on blocks and redistributes by placement, which a box cannot say.
- a *flat shard* (``FlatLayout``, ZeRO and FSDP): rank r's contiguous range of a padded flat buffer
  of several parameters. Kept because one collective (all-gather, reduce-scatter) moves a flat
  buffer; it cuts parameters at any element, so :func:`flat_range_boxes` describes it as boxes.
- a ``BlockLayout`` (parallel/data_parallelism/dtensors.py) is not a shard but the bridge: how a
  DTensor parameter's block sits in its global array, so that a data-parallel strategy can
  flat-shard blocks and still give boxes of the global array.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Sequence

from ..comm import DistValueError

__all__ = ["ShardedArray", "StepCount", "flat_range_boxes", "box_view", "load_pieces", "optimizer_state_views"]


@dataclasses.dataclass(frozen=True)
class ShardedArray:
    """One box of a global array held by this rank.

    Attributes:
        local: the box's data, of shape ``lengths`` (a view into the owner's memory: writing it
            writes the model).
        global_shape: the shape of the whole array.
        offsets: the global index of ``local[0, ..., 0]``.
        replica: another rank holds these elements too, with the same values, and saves them (a
            copy over a ``Replicate`` mesh dim, at a coordinate other than 0): a checkpoint does
            not write this box, and loads into it as into any other.
    """

    local: Any
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    replica: bool = False

    def __post_init__(self) -> None:
        shape, offsets, lengths = tuple(self.global_shape), tuple(self.offsets), tuple(self.local.shape)
        if not (len(shape) == len(offsets) == len(lengths)) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, shape)):
            raise ValueError(f"ShardedArray: a box at offsets {offsets} of lengths {lengths} does not fit in "
                             f"an array of shape {shape}")
        object.__setattr__(self, "global_shape", shape)
        object.__setattr__(self, "offsets", offsets)

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(self.local.shape)

    @property
    def dtype(self) -> Any:
        return self.local.dtype


class StepCount:
    """An optimizer's step count in a state dict: read from the optimizer whenever it is used.

    The arrays of a state dict are views, so a dict built once before training is current when
    it is saved 100 steps later; a step count copied as an ``int`` would not be (every
    checkpoint would record step 0, and a resumed AdamW would restart its bias correction).
    A ``StepCount`` is that int read through: ``int(c)`` (and ``==``, ``repr``) give the count
    now, :meth:`set` writes it into the optimizer. A checkpoint saves the count at the moment of
    the save and loads by :meth:`set` (torch keeps the count in a tensor for the same reason).

    Several parameters may share one count (a flat shard's, under ZeRO and FSDP): ``key`` names
    the optimizer's entry, ``target`` identifies it.

    Example::

        _, optim = get_state_dict(ddp, opt)
        c = optim["step"]["w"]     # StepCount(3) after 3 steps
        opt.step(...)              # now int(c) == 4
    """

    __slots__ = ("optimizer", "key")

    def __init__(self, optimizer: Any, key: str) -> None:
        self.optimizer, self.key = optimizer, key

    @property
    def value(self) -> int:
        """The count now (0 before the first step)."""
        return int(self.optimizer.steps.get(self.key, 0))

    @property
    def target(self) -> tuple[int, str]:
        """What :meth:`set` writes: equal for two counts that are one optimizer entry."""
        return id(self.optimizer), self.key

    @staticmethod
    def check(count: Any) -> int:
        """``count`` as an int if it is a valid step count (an int >= 0, not a bool).

        Raises:
            ValueError: naming the value.
        """
        if isinstance(count, StepCount):
            return count.value
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
            raise ValueError(f"a step count must be an int >= 0, got {count!r}")
        return int(count)

    def set(self, count: Any) -> None:
        """Make ``count`` the optimizer's count (checked by :meth:`check`)."""
        self.optimizer.steps[self.key] = self.check(count)

    def __int__(self) -> int:
        return self.value

    __index__ = __int__

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, (StepCount, numbers.Integral)):
            return self.value == int(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # its value changes

    def __repr__(self) -> str:
        return f"StepCount({self.value})"


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The row-major flat range ``[start, stop)`` of an array of ``shape`` as boxes, in order.

    Each box is ``(offsets, lengths)`` and contiguous in row-major order, and their flat ranges
    tile ``[start, stop)`` exactly; at most ``2 * ndim - 1`` boxes.

    Example::

        flat_range_boxes((3, 4), 2, 11) == [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]
    """
    shape = tuple(int(s) for s in shape)
    size = math.prod(shape)
    if not 0 <= start <= stop <= size:
        raise ValueError(f"flat_range_boxes: range [{start}, {stop}) is outside an array of {size} elements "
                         f"(shape {shape})")
    if start == stop:
        return []
    if not shape:
        return [((), ())]
    return _boxes(shape, start, stop)


def _boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """:func:`flat_range_boxes` for a non-empty range of a non-scalar shape."""
    inner = math.prod(shape[1:])
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    first, last = start // inner, (stop - 1) // inner  # rows (along axis 0) the range touches
    if first == last:  # inside one row: recurse into it
        return [((first, *off), (1, *n)) for off, n in _boxes(shape[1:], start - first * inner, stop - first * inner)]
    out = []
    if start % inner:  # a partial first row
        out += [((first, *off), (1, *n)) for off, n in _boxes(shape[1:], start - first * inner, inner)]
        first += 1
    whole_end = stop // inner  # rows [first, whole_end) are whole
    if whole_end > first:
        out.append(((first, *(0,) * (len(shape) - 1)), (whole_end - first, *shape[1:])))
    if stop % inner:  # a partial last row
        out += [((whole_end, *off), (1, *n)) for off, n in _boxes(shape[1:], 0, stop - whole_end * inner)]
    return out


def box_view(flat: Any, shape: Sequence[int], start: int, offsets: Sequence[int], lengths: Sequence[int]) -> Any:
    """The data of box ``(offsets, lengths)`` of an array of ``shape`` whose flat elements from
    ``start`` on are ``flat[0:]``: a reshaped slice, hence a view (the box must come from
    :func:`flat_range_boxes`, so that it is contiguous)."""
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    begin = sum(o * s for o, s in zip(offsets, strides)) - start
    return flat[begin:begin + math.prod(lengths)].reshape(tuple(lengths))


def load_pieces(where: str, what: str, mine: dict[str, Any], given: Any) -> None:
    """Copy ``given`` into ``mine`` (same nested keys; leaves are arrays or lists of
    :class:`ShardedArray` with the same boxes), skipping leaves that are already the same memory."""
    if not isinstance(given, dict) or set(given) != set(mine):
        got = sorted(given) if isinstance(given, dict) else type(given).__name__
        raise DistValueError(f"meshkit.parallel: {where}: {what} must have the keys {sorted(mine)}, got {got}")
    for key, ours in mine.items():
        theirs = given[key]
        if isinstance(ours, dict):
            load_pieces(where, f"{what}[{key!r}]", ours, theirs)
            continue
        ours_list = ours if isinstance(ours, list) else [ours]
        theirs_list = theirs if isinstance(theirs, list) else [theirs]
        if len(ours_list) != len(theirs_list):
            raise DistValueError(f"meshkit.parallel: {where}: {what}[{key!r}] has {len(theirs_list)} pieces on this "
                                 f"rank, expected {len(ours_list)}")
        for a, b in zip(ours_list, theirs_list):
            a_box = (a.offsets, a.lengths) if isinstance(a, ShardedArray) else None
            b_box = (b.offsets, b.lengths) if isinstance(b, ShardedArray) else None
            dst, src = (a.local, b.local) if a_box else (a, b)
            if a_box != b_box or tuple(getattr(src, "shape", ())) != tuple(dst.shape) or src.dtype != dst.dtype:
                raise DistValueError(f"meshkit.parallel: {where}: {what}[{key!r}]: got a piece of box {b_box}, shape "
                                     f"{getattr(src, 'shape', None)} and dtype {getattr(src, 'dtype', None)}; expected "
                                     f"box {a_box}, shape {tuple(dst.shape)} and dtype {dst.dtype}")
            if src is not dst:
                dst[...] = src


def optimizer_state_views(optimizer: Any, params: dict[str, Any]) -> dict[str, Any]:
    """``{"state": {name: {key: view}}, "step": {name: StepCount}}`` of an optimizer over whole
    (replicated) parameters, e.g. the one a DDP user steps: the state arrays materialized and
    reshaped to their parameter's shape (views)."""
    state = {name: {key: arr.reshape(p.shape) for key, arr in optimizer.materialize(name, p.reshape(-1)).items()}
             for name, p in params.items()}
    return {"state": state, "step": {name: StepCount(optimizer, name) for name in params}}
