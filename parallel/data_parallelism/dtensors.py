"""DTensor parameters in the data-parallel strategies: the blocks they train, the layout they keep.

Tensor parallelism lays a parameter out over a ``tp`` mesh (a :class:`~meshkit.tensor.DTensor`);
data parallelism over another mesh dimension then averages, or shards, each rank's *block* over
its ``dp`` group. A 2 x 2 ``dp x tp`` mesh ``[[0, 1], [2, 3]]`` with ``w`` ``Shard(1)`` over
``tp``::

    rank 0: dp group [0, 2], tp mesh [0, 1], block w[:, :n/2]     rank 1: dp group [1, 3], w[:, n/2:]
    rank 2: dp group [0, 2], tp mesh [2, 3], block w[:, :n/2]     rank 3: dp group [1, 3], w[:, n/2:]

Averaging the blocks of ``[0, 2]`` averages the same columns, because every rank of a dp group
holds the same placements, global shape and mesh coordinate (checked collectively at
construction, :mod:`.setup`), and the DTensor's mesh holds no other rank of the dp group (its
blocks are not already laid out over ``dp``). So a strategy unwraps the DTensors once, at
construction (:func:`split`), runs its buckets and flat buffers on the blocks as on any arrays,
and wraps its own arrays again where the user reads them (``params``, ``grads``):
:class:`BlockLayout` is what it keeps per parameter.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from ...comm import DistTypeError, DistValueError, ProcessGroup
from ...mesh import DeviceMesh
from ...tensor import DTensor
from ...tensor._seams import local_shape_and_offset
from ...state import ShardedArray

__all__ = ["BlockLayout", "split", "layout_problem", "layout_spec", "describe_spec", "block_of", "wrap_all"]


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """How a DTensor parameter is laid out: its mesh, placements and global shape."""

    mesh: DeviceMesh
    placements: tuple[Any, ...]
    shape: tuple[int, ...]
    #: the global index of this rank's block's first element
    offset: tuple[int, ...]

    def wrap(self, block: Any) -> DTensor:
        """``block`` (this rank's array, not copied) as a DTensor laid out as the parameter."""
        return DTensor(block, self.mesh, self.placements, shape=self.shape)

    def place(self, pieces: list[ShardedArray]) -> list[ShardedArray]:
        """Boxes of this rank's block (a flat shard's pieces of it) as boxes of the global array.

        Off coordinate 0 of a ``Replicate`` mesh dim they are marked ``replica``: the block is a
        copy of coordinate 0's, but its flat shard may cut it elsewhere (a flat buffer packs
        blocks of other sizes before it when other parameters' blocks are uneven over tp), so
        its pieces can overlap coordinate 0's without being equal; a checkpoint writes
        coordinate 0's only.
        """
        coordinate = self.mesh.get_coordinate() or ()
        replica = any(q.is_replicate() and c for q, c in zip(self.placements, coordinate))
        return [ShardedArray(p.local, self.shape, tuple(o + b for o, b in zip(p.offsets, self.offset)), replica)
                for p in pieces]

    @property
    def sharded_dims(self) -> tuple[int, ...]:
        """The mesh dims the parameter is ``Shard`` on: a norm's partial sums are added over them."""
        return tuple(i for i, q in enumerate(self.placements) if q.is_shard())


def split(params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, BlockLayout]]:
    """``params`` as this rank's blocks (a new dict; the same memory), and the layout of each
    DTensor among them (an empty dict when there is none)."""
    blocks, layouts = {}, {}
    for name, p in params.items():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            offset = local_shape_and_offset(p.shape, mesh.shape, mesh.get_coordinate(), p.placements)[1]
            layouts[name] = BlockLayout(mesh, p.placements, p.shape, tuple(offset))
            p = p.to_local()
        blocks[name] = p
    return blocks, layouts


def wrap_all(blocks: dict[str, Any], layouts: dict[str, BlockLayout]) -> dict[str, Any]:
    """``blocks`` with each DTensor parameter's block wrapped as a DTensor laid out as it."""
    return {name: layouts[name].wrap(b) if name in layouts else b for name, b in blocks.items()}


def layout_problem(name: str, p: DTensor, group: ProcessGroup, ranks: Sequence[int] | None = None) -> str | None:
    """What keeps DTensor parameter ``p`` from being data-parallel over ``group``, or None.

    ``ranks``: every rank the parameters are data-parallel over, when that is more than
    ``group`` (HSDP's 2-D mesh, ``group`` being one of its dims); ``p``'s mesh may hold none of them.
    """
    if any(q.is_partial() for q in p.placements):
        return (f"params[{name!r}] is a DTensor with placements {p.placements!r}; a Partial parameter holds "
                "terms of a sum, not values: redistribute it to Shard or Replicate placements first")
    mesh = p.device_mesh
    if mesh.get_coordinate() is None:
        return f"params[{name!r}] is a DTensor on mesh {mesh.mesh.tolist()}, which does not hold this rank"
    dp, what = (list(group.ranks), "group") if ranks is None else ([int(r) for r in ranks], "mesh")
    others = sorted(set(int(r) for r in mesh.mesh.reshape(-1)) & set(dp) - {group.global_rank})
    if others:
        return (f"params[{name!r}] is a DTensor on mesh {mesh.mesh.tolist()} (dims {mesh.mesh_dim_names}), which "
                f"holds ranks {others} of the data-parallel {what} {dp} besides this rank: it is laid "
                "out over the data-parallel dimension already; lay parameters out over another mesh dimension "
                "(e.g. mesh['tp'] of a dp x tp mesh) and pass mesh['dp'] to the strategy")
    return None


def layout_spec(p: Any) -> tuple[Any, ...] | None:
    """What must be equal on every rank of a data-parallel group for a DTensor parameter: its
    placements, global shape, mesh shape and this rank's coordinate in it (None: a plain array)."""
    if not isinstance(p, DTensor):
        return None
    mesh = p.device_mesh
    return (repr(p.placements), tuple(p.shape), tuple(mesh.shape), tuple(mesh.get_coordinate() or ()))


def describe_spec(spec: tuple[Any, ...] | None) -> str:
    """``layout_spec``'s value in words, for messages."""
    if spec is None:
        return "a plain array"
    placements, shape, mesh_shape, coordinate = spec
    return f"a DTensor {placements} of global shape {shape} at coordinate {coordinate} of a {mesh_shape} mesh"


def block_of(head: str, what: str, name: str, value: Any, layout: BlockLayout | None) -> Any:
    """This rank's block of ``value``, a DTensor that must be laid out as parameter ``name``
    (``what`` names ``value`` in messages: ``"gradient 'w'"``).

    Raises:
        DistTypeError: the parameter is a plain array.
        DistValueError: ``value``'s mesh, placements or global shape differ from the parameter's.
    """
    if layout is None:
        raise DistTypeError(f"{head}: {what} is a DTensor but parameter {name!r} is a plain array; pass this rank's "
                            "array (to_local())")
    if value.device_mesh != layout.mesh or value.placements != layout.placements or value.shape != layout.shape:
        raise DistValueError(f"{head}: {what} is a DTensor {value.placements!r} of shape {value.shape} on mesh "
                             f"{value.device_mesh.mesh.tolist()}; parameter {name!r} is {layout.placements!r} of "
                             f"shape {layout.shape} on mesh {layout.mesh.mesh.tolist()}: redistribute it to the "
                             "parameter's placements first")
    return value.to_local()
