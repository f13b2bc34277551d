"""DeviceMesh: an N-dimensional array of ranks with one process group per dimension.

Names and per-rank semantics follow torch's ``DeviceMesh``. The rank arithmetic lives in
:mod:`meshkit.mesh.layout`; this module turns it into groups, collectively.

How groups are made: every mesh object keeps its *layout*, the arrangement of all of its
sibling sub-meshes across the root mesh, shape ``(n_siblings, *shape)`` (a root mesh has one
sibling: itself). The groups of dimension ``d`` are the rows of that layout with axis ``d``
moved last, so every rank knows every group without communicating. Building a dimension is one
collective split over the root (``ProcessGroup.split``, MPI's ``Comm_split``), never one call
per subgroup. The root remembers which partitions of its ranks it has built; slicing, and
flattening into a partition that exists already, create no communicator, and groups are cached
by rank set across meshes too (``World.groups``).

Construction cost, in collective splits: at most one per dimension; none for a dimension whose
groups already exist from an earlier world-collective construction (the same mesh built again)
or whose one group is the whole root (the world's own group). A mesh over a subset of the world
costs one more, for the group of all its ranks, over which later ``flatten``/``unflatten``/
``rearrange`` calls run (they are collective over the root mesh only).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Sequence, TextIO

import numpy as np

from ..comm import (CollectiveMismatchError, DebugLevel, DistValueError, ProcessGroup, all_gather_object,
                    create_groups, current_world)
from . import layout

__all__ = ["DeviceMesh", "init_device_mesh", "host_names"]

logger = logging.getLogger("meshkit")

DEVICE_TYPES = ("cpu",)


def host_names(group: ProcessGroup) -> list[str]:
    """The host of every rank of ``group`` (MPI's processor name), collective over ``group``."""
    names: list[Any] = [None] * group.size
    all_gather_object(names, group.host_name(), group=group)
    return names


def _check_device(device_type: str) -> str:
    if device_type == "cuda":
        raise DistValueError("meshkit.mesh: device_type 'cuda' needs meshkit's NCCL engine, which is not "
                             "available in this version; use device_type='cpu'")
    if device_type not in DEVICE_TYPES:
        raise DistValueError(f"meshkit.mesh: unknown device_type {device_type!r}; valid types are "
                             f"{list(DEVICE_TYPES)}")
    return device_type


def _partition(full: np.ndarray, dim: int) -> list[list[int]]:
    """The groups of dimension ``dim`` of a layout ``(n_siblings, *shape)``."""
    moved = np.moveaxis(full, dim + 1, -1)
    return moved.reshape(-1, full.shape[dim + 1]).tolist()


def _key(parts: list[list[int]]) -> frozenset[frozenset[int]]:
    return frozenset(frozenset(p) for p in parts)


class DeviceMesh:
    """An N-D arrangement of global ranks with one process group per dimension.

    Attributes:
        device_type: ``"cpu"``.
        mesh: the ndarray of global ranks of this mesh (for a sub-mesh, the one containing
            this rank).
        mesh_dim_names: the dimension names, or None.

    Example (4 ranks, ``mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``)::

        mesh.mesh                        # [[0, 1], [2, 3]] on every rank
        mesh["tp"].mesh                  # rank 0, 1: [0, 1]    rank 2, 3: [2, 3]
        mesh["dp"].mesh                  # rank 0, 2: [0, 2]    rank 1, 3: [1, 3]
        mesh["tp", "dp"].mesh            # every rank: [[0, 2], [1, 3]]  (transposed)
        mesh.get_local_rank("dp")        # rank 0: 0, rank 1: 0, rank 2: 1, rank 3: 1
        mesh.get_group("tp")             # rank 0: group of ranks [0, 1]
    """

    def __init__(self, device_type: str, mesh: Any, *, mesh_dim_names: Sequence[str] | None = None) -> None:
        """Build the mesh and its groups; collective over the whole world.

        Args:
            device_type: ``"cpu"``: groups on the current engine (``mpi``, or ``local``
                inside ``meshkit.comm.local.run``).
            mesh: integer array-like of distinct global ranks; may cover part of the world
                (ranks outside it take part and get ``get_coordinate() is None``).
            mesh_dim_names: one unique name per dimension.

        Raises:
            ValueError: a bad mesh or bad names (the message says what is valid).
            CollectiveMismatchError: with ``MESHKIT_DEBUG=detail``, ranks passed different meshes.
        """
        world = current_world()
        device_type = _check_device(device_type)
        ranks = layout.validate_mesh(mesh, world.size)
        names = layout.validate_dim_names(mesh_dim_names, ranks.ndim)
        parent = world.default_group
        assert parent is not None
        if world.debug >= DebugLevel.DETAIL:
            _check_same_mesh(parent, ranks, names)
        members = sorted(ranks.ravel().tolist())
        if len(members) == world.size:
            root_group: ProcessGroup | None = parent
        else:
            root_group = create_groups(parent, [members], name="mesh" + str(list(ranks.shape)))
        self._setup(device_type, ranks[None], names, anchor=None, groups=None)
        self._root_group = root_group
        self._groups = [self._build_group(d, parent) for d in range(self.ndim)]

    # ------------------------------------------------------------------ construction helpers
    def _setup(self, device_type: str, full: np.ndarray, names: tuple[str, ...] | None, *,
               anchor: DeviceMesh | None, groups: list[ProcessGroup | None] | None) -> None:
        world = current_world()
        self.device_type = device_type
        self._world = world
        self._full = full
        self._anchor = anchor if anchor is not None else self
        if anchor is None:
            self._known: set[frozenset[frozenset[int]]] = set()
            self._flattened: dict[str, DeviceMesh] = {}
        self.mesh_dim_names = names
        rows = np.flatnonzero((full == world.rank).reshape(full.shape[0], -1).any(axis=1))
        self._sibling = int(rows[0]) if rows.size else None
        mine = full[self._sibling] if self._sibling is not None else full[0]
        mine.flags.writeable = False
        self.mesh: np.ndarray = mine
        self._coordinate = layout.coordinate(mine, world.rank) if self._sibling is not None else None
        if groups is not None:
            self._groups = groups

    @classmethod
    def _derived(cls, source: DeviceMesh, full: np.ndarray, names: tuple[str, ...] | None,
                 groups: list[ProcessGroup | None] | None = None) -> DeviceMesh:
        """A mesh derived from ``source`` (same root): a slice, flatten, unflatten or rearrange."""
        mesh = cls.__new__(cls)
        mesh._setup(source.device_type, np.ascontiguousarray(full), names, anchor=source._anchor, groups=groups)
        if groups is None:
            root_group = source._anchor._root_group
            mesh._groups = [mesh._build_group(d, root_group) for d in range(mesh.ndim)]
        return mesh

    def _build_group(self, dim: int, parent: ProcessGroup | None) -> ProcessGroup | None:
        """This rank's group of dimension ``dim``; one split over ``parent`` unless already built."""
        parts = _partition(self._full, dim)
        key = _key(parts)
        anchor = self._anchor
        root = anchor._root_group
        if key not in anchor._known and root is not None and key == frozenset([frozenset(root.ranks)]):
            anchor._known.add(key)  # the root's own rank set: its group exists on every member
        if key in anchor._known:
            mine = next((p for p in parts if self._world.rank in p), None)
            return None if mine is None else self._world.groups[frozenset(mine)]
        if parent is None:
            raise DistValueError(f"meshkit.mesh: rank {self._world.rank} is not in this mesh, so it cannot take "
                                 "part in building its groups")
        name = self.mesh_dim_names[dim] if self.mesh_dim_names else f"mesh_dim{dim}"
        group = create_groups(parent, parts, name=name)
        anchor._known.add(key)
        return group

    # ------------------------------------------------------------------ properties
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape)

    @property
    def ndim(self) -> int:
        return self.mesh.ndim

    def size(self, dim: int | str | None = None) -> int:
        """Number of ranks in the mesh, or along one dimension."""
        if dim is None:
            return int(self.mesh.size)
        return self.shape[layout.dim_index(dim, self.mesh_dim_names, self.ndim)]

    def get_rank(self) -> int:
        """This process's global rank."""
        return self._world.rank

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's coordinate in the mesh, or None if it is not in the mesh."""
        return self._coordinate

    def get_local_rank(self, dim: int | str | None = None) -> int:
        """This rank's coordinate along ``dim`` (required when the mesh has more than one dim).

        It equals the rank within ``get_group(dim)`` whenever the mesh's ranks increase along
        ``dim``, as they do for every mesh built by ``init_device_mesh``, slicing and flatten.
        """
        d = self._dim("get_local_rank", dim)
        coordinate = self._member_coordinate("get_local_rank")
        return coordinate[d]

    def get_group(self, dim: int | str | None = None) -> ProcessGroup:
        """This rank's process group along ``dim`` (required when the mesh has more than one dim)."""
        d = self._dim("get_group", dim)
        self._member_coordinate("get_group")
        group = self._groups[d]
        assert group is not None
        return group

    def get_all_groups(self) -> list[ProcessGroup]:
        """This rank's group of every dimension, in dimension order."""
        self._member_coordinate("get_all_groups")
        return [g for g in self._groups if g is not None]

    def _dim(self, op: str, dim: int | str | None) -> int:
        if dim is None:
            if self.ndim != 1:
                valid = list(self.mesh_dim_names) if self.mesh_dim_names else list(range(self.ndim))
                raise DistValueError(f"meshkit.mesh: rank {self._world.rank}: DeviceMesh.{op}: the mesh has "
                                     f"{self.ndim} dims, so dim is required; valid dims are {valid}")
            return 0
        return layout.dim_index(dim, self.mesh_dim_names, self.ndim)

    def _member_coordinate(self, op: str) -> tuple[int, ...]:
        if self._coordinate is None:
            raise DistValueError(f"meshkit.mesh: rank {self._world.rank}: DeviceMesh.{op}: this rank is not in "
                                 f"the mesh {self.mesh.tolist()}")
        return self._coordinate

    # ------------------------------------------------------------------ slicing and reshaping
    def __getitem__(self, dims: str | int | Sequence[str | int]) -> DeviceMesh:
        """The sub-mesh over ``dims`` containing this rank; never creates a communicator.

        A name flattened on the root mesh (``root["dp"]`` after ``...flatten("dp")``) selects
        that flattened 1-D mesh. Out-of-order names give the transposed sub-mesh.
        """
        if isinstance(dims, str) and self._anchor is self and dims in self._flattened and \
                not (self.mesh_dim_names and dims in self.mesh_dim_names):
            return self._flattened[dims]
        self._member_coordinate("__getitem__")
        index = layout.dim_indices(dims, self.mesh_dim_names, self.ndim)
        moved = np.moveaxis(self._full, [d + 1 for d in index], range(self.ndim + 1 - len(index), self.ndim + 1))
        full = moved.reshape(-1, *[self.shape[d] for d in index])
        names = tuple(self.mesh_dim_names[d] for d in index) if self.mesh_dim_names else None
        return DeviceMesh._derived(self, full, names, [self._groups[d] for d in index])

    def flatten(self, name: str | None = None) -> DeviceMesh:
        """A 1-D mesh over this mesh's ranks (row-major); collective over the root mesh.

        The name (default: the dim names joined by ``_``) is registered on the root, so
        ``root[name]`` returns it; flattening again with the same name returns the same mesh.

        Example (2x2 mesh ``("dp", "tp")``)::

            mesh.flatten("dp_tp").mesh      # every rank: [0, 1, 2, 3]
            mesh["dp"].flatten().mesh       # rank 0, 2: [0, 2]  (the dp groups: no new communicator)
        """
        self._member_coordinate("flatten")
        if name is None:
            name = "_".join(self.mesh_dim_names) if self.mesh_dim_names else "flat"
        if not isinstance(name, str) or not name:
            raise DistValueError(f"meshkit.mesh: flatten name must be a non-empty str, got {name!r}")
        full = self._full.reshape(self._full.shape[0], -1)
        anchor = self._anchor
        existing = anchor._flattened.get(name)
        if existing is not None:
            if _key(_partition(existing._full, 0)) != _key(_partition(full, 0)):
                raise DistValueError(f"meshkit.mesh: rank {self._world.rank}: flatten name {name!r} is already "
                                     f"used for a different layout (groups {_partition(existing._full, 0)}); "
                                     "choose another name")
            return existing
        if anchor.mesh_dim_names and name in anchor.mesh_dim_names and \
                _key(_partition(full, 0)) != _key(_partition(anchor._full, anchor.mesh_dim_names.index(name))):
            raise DistValueError(f"meshkit.mesh: rank {self._world.rank}: flatten name {name!r} is a dim of the "
                                 f"root mesh with a different layout; valid new names differ from "
                                 f"{list(anchor.mesh_dim_names)}")
        flat = DeviceMesh._derived(self, full, (name,))
        anchor._flattened[name] = flat
        return flat

    def unflatten(self, dim: int | str, sizes: Sequence[int], names: Sequence[str]) -> DeviceMesh:
        """Split dimension ``dim`` into ``sizes`` (one may be -1) named ``names``; collective over the root.

        Example (1-D mesh ``("world",)`` of 8 ranks)::

            m = mesh.unflatten("world", (2, 4), ("dp", "tp"))
            m.mesh                           # [[0, 1, 2, 3], [4, 5, 6, 7]]
            m.get_group("tp")                # rank 5: group of ranks [4, 5, 6, 7]
        """
        self._member_coordinate("unflatten")
        d = layout.dim_index(dim, self.mesh_dim_names, self.ndim)
        sizes = layout.infer_shape(sizes, self.shape[d], name="sizes")
        names = tuple(names)
        if len(names) != len(sizes):
            raise DistValueError(f"meshkit.mesh: unflatten got {len(sizes)} sizes but {len(names)} names")
        old = self.mesh_dim_names or tuple(f"mesh_dim{i}" for i in range(self.ndim))
        new_names = layout.validate_dim_names(old[:d] + names + old[d + 1:], self.ndim - 1 + len(sizes))
        full = self._full.reshape(self._full.shape[0], *self.shape[:d], *sizes, *self.shape[d + 1:])
        return DeviceMesh._derived(self, full, new_names)

    def rearrange(self, pattern: str, **sizes: int) -> DeviceMesh:
        """Rearrange the rank array with an einops pattern; output axis names become dim names.

        Collective over the root mesh (new dimensions get groups; known ones are reused).

        Example (1-D mesh of 8 ranks, 2 nodes of 4)::

            m = mesh.rearrange("(node gpu) -> gpu node", node=2)
            m.mesh                           # [[0, 4], [1, 5], [2, 6], [3, 7]]
            m.mesh_dim_names                 # ("gpu", "node")
            m.get_group("node")              # rank 1: group of ranks [1, 5]
        """
        self._member_coordinate("rearrange")
        results = [layout.rearrange(sibling, pattern, **sizes) for sibling in self._full]
        names = results[0][1]
        return DeviceMesh._derived(self, np.stack([r[0] for r in results]), names)

    @classmethod
    def from_group(cls, group: ProcessGroup, device_type: str = "cpu", *,
                   mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
        """A 1-D mesh over an existing group's ranks; creates no communicator. Not collective."""
        if not isinstance(group, ProcessGroup):
            raise DistValueError(f"meshkit.mesh: from_group needs a ProcessGroup, got {type(group).__name__}")
        mesh = cls.__new__(cls)
        names = layout.validate_dim_names(mesh_dim_names, 1)
        full = np.array([group.ranks], dtype=np.int64)
        mesh._setup(_check_device(device_type), full, names, anchor=None, groups=None)
        mesh._root_group = group if group.is_member else None
        mesh._known.add(_key(_partition(full, 0)))
        mesh._groups = [group if group.is_member else None]
        return mesh

    # ------------------------------------------------------------------ display
    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, {self.mesh.tolist()}{names})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DeviceMesh):
            return NotImplemented
        return (self.device_type == other.device_type and self.mesh_dim_names == other.mesh_dim_names
                and np.array_equal(self._full, other._full))

    def __hash__(self) -> int:
        return hash((self.device_type, self.mesh_dim_names, self._full.tobytes(), self._full.shape))

    def describe(self, file: TextIO | None = None) -> str:
        """Each dimension's groups and every rank's host; collective over the root mesh.

        Prints on the mesh's first rank (to ``file``, default stdout) and returns the text on
        every rank. Warns when a dimension listed after another crosses hosts while the earlier
        one does not: the inner (later) dimensions usually carry the most traffic and belong
        inside a host, so this is likely a mistake in the order of ``mesh_shape``.
        """
        self._member_coordinate("describe")
        root = self._anchor._root_group
        assert root is not None
        hosts = dict(zip(root.ranks, host_names(root)))
        names = self.mesh_dim_names or tuple(f"mesh_dim{i}" for i in range(self.ndim))
        lines = [repr(self)]
        crosses = []
        for d, name in enumerate(names):
            parts = _partition(self._full, d)
            crossing = any(len({hosts[r] for r in p}) > 1 for p in parts)
            crosses.append(crossing)
            lines.append(f"  dim {d} {name!r} (size {self.shape[d]}){' crosses hosts' if crossing else ''}: "
                         f"groups {parts}")
        by_host: dict[str, list[int]] = {}
        for r in sorted(int(r) for r in self._full.ravel()):
            by_host.setdefault(hosts[r], []).append(r)
        lines += [f"  host {h}: ranks {rs}" for h, rs in by_host.items()]
        for i in range(self.ndim):
            for j in range(i + 1, self.ndim):
                if crosses[j] and not crosses[i]:
                    warning = (f"warning: dim {names[j]!r} crosses hosts while the earlier dim {names[i]!r} "
                               f"does not; put the dimension with the most traffic last in mesh_shape")
                    lines.append(f"  {warning}")
                    logger.warning("meshkit.mesh: %s", warning)
        text = "\n".join(lines)
        if self._world.rank == int(self._full.ravel().min()):
            print(text, file=file or sys.stdout, flush=True)
        return text


def _check_same_mesh(parent: ProcessGroup, ranks: np.ndarray, names: tuple[str, ...] | None) -> None:
    """Detail mode: every rank must pass the same mesh and names (else the splits would hang)."""
    mine = (ranks.shape, ranks.ravel().tolist(), names)
    everyone: list[Any] = [None] * parent.size
    all_gather_object(everyone, mine, group=parent)
    if any(e != mine for e in everyone):
        calls = {parent.ranks[i]: f"mesh {np.array(e[1]).reshape(e[0]).tolist()} names {e[2]}"
                 for i, e in enumerate(everyone)}
        listing = "; ".join(f"rank {r}: {c}" for r, c in calls.items())
        raise CollectiveMismatchError(f"meshkit.mesh: rank {parent.global_rank}: ranks passed different meshes "
                                      f"to DeviceMesh: {listing}", calls=calls)


def init_device_mesh(device_type: str, mesh_shape: Sequence[int], *,
                     mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
    """A mesh of shape ``mesh_shape`` over all ranks in order; collective over the world.

    One entry of ``mesh_shape`` may be -1, inferred from the world size.

    Example (8 ranks)::

        mesh = init_device_mesh("cpu", (2, -1), mesh_dim_names=("dp", "tp"))
        mesh.mesh                        # [[0, 1, 2, 3], [4, 5, 6, 7]]
        mesh["dp"].mesh                  # rank 5: [1, 5]
    """
    world = current_world()
    shape = layout.infer_shape(mesh_shape, world.size)
    return DeviceMesh(device_type, layout.make_mesh(shape), mesh_dim_names=mesh_dim_names)
