"""DeviceMesh: an N-dimensional array of ranks with one process group per dimension.

Names and per-rank semantics follow torch's ``DeviceMesh``. All rank arithmetic (groups,
sub-meshes, flatten, unflatten, rearrange, and the axis order) is :mod:`meshkit.mesh.layout`'s;
this module turns it into groups, collectively.

How groups are made: every mesh keeps its *layout* (see `layout`): itself and all of its
sibling sub-meshes, shape ``(n_siblings, *shape)``, so every rank knows every group of every
dimension without communicating. Building a dimension is one collective split
(``create_groups``, MPI's ``Comm_split``) over the root's group, never one call per subgroup.
``create_groups`` skips a partition already split over a group holding all the ranks it is
collective over, and returns the parent itself for a partition of one part, the parent's ranks;
groups are cached by rank set, so the same ranks never get a second communicator.

Construction cost, in collective splits: at most one per dimension; none for a dimension whose
groups exist from an earlier construction over the same ranks (the same mesh built again), or
whose one group is the whole root; none for slicing. A mesh over a subset of the world costs one
more, for the group of all its ranks, over which later ``flatten``/``unflatten``/``rearrange``
calls run (they are collective over the root mesh only). Every construction also exchanges one
small object (see `agreement`): the ranks must pass the same arguments, and all raise if not.

Device types: "cpu" over any backend; "cuda" only over the ``nccl`` backend, as torch allows
"cuda" meshes only with a GPU backend (over ``mpi``, device arrays work in collectives, but MPI is
not a GPU engine). A "cuda" mesh's groups are the NCCL engine's (one ``commSplit`` per
dimension); ``describe()`` names each rank's GPU, the index its NCCL engine drives.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Sequence, TextIO

import numpy as np

from ..comm import DistTypeError, DistValueError, ProcessGroup, all_gather_object, get_backend
from ..comm._seams import backend_devices, create_groups, current_world
from . import errors, layout
from .agreement import agree

__all__ = ["DeviceMesh", "init_device_mesh", "host_names"]

logger = logging.getLogger("meshkit")

DEVICE_TYPES = ("cpu", "cuda")
#: A "cuda" mesh is valid over a backend registered with "cuda" among its devices (nccl; a
#: third-party one through register_backend(..., devices=...)), as torch's "cuda" meshes need a GPU
#: backend: an mpi world moves device arrays too, but through host memory or a CUDA-aware MPI, not
#: as a GPU engine.

#: the plain errors `layout` and the argument checks raise; `errors.convert` prefixes them
_ARG_ERRORS = (TypeError, ValueError, KeyError, IndexError)


def host_names(group: ProcessGroup) -> list[str]:
    """The host of every rank of ``group`` (MPI's processor name), collective over ``group``."""
    names: list[Any] = [None] * group.size
    all_gather_object(names, group.host_name(), group=group)
    return names


def _check_device(device_type: str, backend: str) -> str:
    """``device_type`` if ``backend`` serves it (the devices it was registered with: "cpu" for mpi and
    local, "cpu" and "cuda" for nccl)."""
    valid = list(backend_devices(backend))
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"unknown device_type {device_type!r}; valid types are {valid} (backend {backend!r})")
    if device_type == "cuda" and device_type not in valid:
        raise ValueError(f"device_type 'cuda' needs meshkit's NCCL engine (backend 'nccl'), but the backend here "
                         f"is {backend!r}; call init_process_group('nccl') on GPUs, or use device_type='cpu' "
                         f"(valid over {backend!r}: {valid})")
    if device_type not in valid:  # a third-party backend registered with devices="cuda" alone
        raise ValueError(f"device_type {device_type!r} is not served by backend {backend!r}: it was registered "
                         f"with devices {valid} (meshkit.register_backend)")
    return device_type


def _gpu(group: ProcessGroup) -> int | None:
    """This rank's GPU in ``group`` (the NCCL engine's device index), None without one."""
    device = group.device
    return int(device) if device is not None else None


def _placements(group: ProcessGroup, *, gpus: bool = False) -> list[tuple[str, int | None]]:
    """``(host, GPU index or None)`` of every rank of ``group``; collective over ``group``.

    The GPU is asked only when ``gpus`` (a "cuda" mesh); None where the engine drives none.
    """
    out: list[Any] = [None] * group.size
    all_gather_object(out, (group.host_name(), _gpu(group) if gpus else None), group=group)
    return [tuple(p) for p in out]


def _context(exc: Exception, context: str) -> Exception:
    """``exc`` again, its message led by ``context`` (which argument it is about)."""
    text = str(exc.args[0]) if exc.args else str(exc)
    return type(exc)(context + text)


def _new_name(name: object, arg: str) -> str:
    """A new dim name: a str that is an identifier."""
    if not isinstance(name, str):
        raise TypeError(f"{arg} must be a str (a new dim name), got {name!r} ({type(name).__name__})")
    if not name.isidentifier():
        raise ValueError(f"{arg} {name!r} is not a valid identifier; use names like 'dp' or 'dp_tp'")
    return name


class DeviceMesh:
    """An N-D arrangement of global ranks with one process group per dimension.

    Attributes:
        device_type: ``"cpu"`` or ``"cuda"`` (over the ``nccl`` backend).
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
                inside ``meshkit.comm.local.run``); ``"cuda"``: only over the ``nccl`` backend
                (each rank's GPU is its engine's), as torch allows "cuda" only with a GPU backend.
            mesh: integer array-like of distinct global ranks; may cover part of the world
                (ranks outside it take part and get ``get_coordinate() is None``).
            mesh_dim_names: one unique name per dimension.

        Raises:
            DistValueError, DistTypeError: a bad device type, mesh or names, on this rank or on
                another (every rank raises; the message says what is valid).
            MeshMismatchError: ranks passed different meshes, names or device types.
        """
        world = current_world()
        args: dict[str, Any] | None = None
        error: Exception | None = None
        try:
            device_type = _check_device(device_type, world.backend)
            ranks = layout.validate_mesh(mesh, world.size)
            names = layout.validate_dim_names(mesh_dim_names, ranks.ndim)
            args = {"device_type": device_type, "mesh": ranks, "mesh_dim_names": names}
        except _ARG_ERRORS as exc:
            error = exc
        parent = world.default_group
        assert parent is not None, "an initialized world has its default group"
        agree(parent, "DeviceMesh", args, error)
        self._build_root(device_type, ranks, names, parent)

    # ------------------------------------------------------------------ construction helpers
    def _build_root(self, device_type: str, ranks: np.ndarray, names: tuple[str, ...] | None,
                    parent: ProcessGroup) -> None:
        """Groups of a root mesh, collectively over ``parent`` (the world)."""
        members = sorted(ranks.ravel().tolist())
        root_group = create_groups(parent, [members], name="mesh" + str(list(ranks.shape)))
        self._setup(device_type, layout.root_layout(ranks), names, anchor=None)
        self._root_group = root_group
        self._groups = [self._build_group(d, parent) for d in range(self.ndim)]

    def _setup(self, device_type: str, lay: np.ndarray, names: tuple[str, ...] | None, *,
               anchor: DeviceMesh | None) -> None:
        world = current_world()
        self.device_type = device_type
        self._world = world
        lay.flags.writeable = False
        self._layout = lay
        self._anchor = anchor if anchor is not None else self
        if anchor is None:
            self._flattened: dict[str, DeviceMesh] = {}
        self.mesh_dim_names = names
        found = layout.coordinate(lay, world.rank)  # (sibling, *coordinate in it), None outside the mesh
        self.mesh: np.ndarray = lay[found[0] if found is not None else 0]
        self._coordinate = found[1:] if found is not None else None

    @classmethod
    def _derived(cls, source: DeviceMesh, lay: np.ndarray, names: tuple[str, ...] | None,
                 groups: list[ProcessGroup | None] | None = None) -> DeviceMesh:
        """A mesh derived from ``source`` (same root): a slice (``groups`` given), or a flatten,
        unflatten or rearrange, whose groups are built over the root's group."""
        mesh = cls.__new__(cls)
        mesh._setup(source.device_type, lay, names, anchor=source._anchor)
        if groups is None:
            groups = [mesh._build_group(d, source._anchor._root_group) for d in range(mesh.ndim)]
        mesh._groups = groups
        return mesh

    def _build_group(self, dim: int, parent: ProcessGroup | None) -> ProcessGroup | None:
        """This rank's group of dimension ``dim``: one split over ``parent``, unless already built."""
        assert parent is not None, "callers check that this rank is in the mesh, hence in its root's group"
        name = self.mesh_dim_names[dim] if self.mesh_dim_names else f"mesh_dim{dim}"
        return create_groups(parent, layout.dim_groups(self._layout, dim).tolist(), name=name)

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
        return self.shape[self._dim("DeviceMesh.size", dim)]

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
        d = self._dim("DeviceMesh.get_local_rank", dim)
        return self._member_coordinate("DeviceMesh.get_local_rank")[d]

    def get_group(self, dim: int | str | None = None) -> ProcessGroup:
        """This rank's process group along ``dim`` (required when the mesh has more than one dim)."""
        d = self._dim("DeviceMesh.get_group", dim)
        self._member_coordinate("DeviceMesh.get_group")
        group = self._groups[d]
        assert group is not None, "a member of the mesh has a group in every dimension"
        return group

    def get_all_groups(self) -> list[ProcessGroup]:
        """This rank's group of every dimension, in dimension order."""
        self._member_coordinate("DeviceMesh.get_all_groups")
        return [g for g in self._groups if g is not None]

    def _valid_dims(self) -> list[int | str]:
        return list(self.mesh_dim_names) if self.mesh_dim_names else list(range(self.ndim))

    def _dim(self, op: str, dim: int | str | None) -> int:
        if dim is None:
            if self.ndim != 1:
                raise DistValueError(f"{errors.prefix(op)}the mesh has {self.ndim} dims, so dim is required; "
                                     f"valid dims are {self._valid_dims()}")
            return 0
        try:
            return layout.dim_index(dim, self.mesh_dim_names, self.ndim)
        except _ARG_ERRORS as exc:
            raise errors.convert(op, exc, f"dim {dim!r}: ") from None

    def _member_coordinate(self, op: str) -> tuple[int, ...]:
        if self._coordinate is None:
            raise DistValueError(f"{errors.prefix(op)}this rank is not in the mesh {self.mesh.tolist()}; "
                                 "only its ranks may call this")
        return self._coordinate

    # ------------------------------------------------------------------ slicing and reshaping
    def __getitem__(self, dims: str | int | Sequence[str | int]) -> DeviceMesh:
        """The sub-mesh over ``dims`` containing this rank; never creates a communicator.

        A name flattened on the root mesh (``root["dp"]`` after ``...flatten("dp")``) selects
        that flattened 1-D mesh. Out-of-order names give the transposed sub-mesh.
        """
        op = "DeviceMesh.__getitem__"
        if isinstance(dims, str) and self._anchor is self and dims in self._flattened and \
                not (self.mesh_dim_names and dims in self.mesh_dim_names):
            return self._flattened[dims]
        try:
            index = layout.dim_indices(dims, self.mesh_dim_names, self.ndim)
        except _ARG_ERRORS as exc:
            flattened = f" (or a name flattened on it: {sorted(self._flattened)})" \
                if self._anchor is self and self._flattened else ""
            raise errors.convert(op, exc, f"dims {dims!r}{flattened}: ") from None
        self._member_coordinate(op)
        names = tuple(self.mesh_dim_names[d] for d in index) if self.mesh_dim_names else None
        return DeviceMesh._derived(self, layout.submeshes(self._layout, index), names,
                                   [self._groups[d] for d in index])

    def _agree(self, op: str, args: dict[str, Any] | None, error: Exception | None) -> None:
        """Every rank of the root mesh passed the same arguments to ``op`` (raises on all if not)."""
        root = self._anchor._root_group
        assert root is not None, "callers check that this rank is in the mesh, hence in its root's group"
        agree(root, op, None if args is None else {"layout": self._layout, **args}, error)

    def flatten(self, name: str | None = None) -> DeviceMesh:
        """A 1-D mesh over this mesh's ranks (row-major); collective over the root mesh.

        The name (default: the dim names joined by ``_``) is registered on the root, so
        ``root[name]`` returns it; flattening again with the same name returns the same mesh.

        Example (2x2 mesh ``("dp", "tp")``)::

            mesh.flatten("dp_tp").mesh      # every rank: [0, 1, 2, 3]
            mesh["dp"].flatten().mesh       # rank 0, 2: [0, 2]  (the dp groups: no new communicator)
        """
        op = "DeviceMesh.flatten"
        self._member_coordinate(op)
        args, error = None, None
        try:
            default = "_".join(self.mesh_dim_names) if self.mesh_dim_names else "flat"
            new_name = _new_name(default if name is None else name, "name")
            args = {"name": new_name}
        except _ARG_ERRORS as exc:
            error = exc
        self._agree(op, args, error)
        flat = layout.flatten(self._layout)
        anchor = self._anchor
        existing = anchor._flattened.get(new_name)
        if existing is not None:
            if not layout.same_layout(existing._layout, flat):
                raise DistValueError(f"{errors.prefix(op)}the flatten name {new_name!r} is already used for a "
                                     f"different layout (meshes {existing._layout.tolist()}, not {flat.tolist()}); "
                                     "choose another name")
            return existing
        if anchor.mesh_dim_names and new_name in anchor.mesh_dim_names and not layout.same_layout(
                flat, layout.submeshes(anchor._layout, (anchor.mesh_dim_names.index(new_name),))):
            raise DistValueError(f"{errors.prefix(op)}the flatten name {new_name!r} is a dim of the root mesh with "
                                 f"a different layout; valid new names differ from {list(anchor.mesh_dim_names)}")
        result = DeviceMesh._derived(self, flat, (new_name,))
        anchor._flattened[new_name] = result
        return result

    def _flatten(self, mesh_dim_name: str | None = None, backend_override: Any = None) -> DeviceMesh:
        """torch's private ``DeviceMesh._flatten``, which torchtitan calls
        (``world_mesh["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp")``): :meth:`flatten`.

        ``backend_override`` (torch's per-mesh backend options) must be None: a meshkit mesh's
        groups use its world's engine.
        """
        if backend_override is not None:
            raise DistValueError(f"{errors.prefix('DeviceMesh._flatten')}backend_override={backend_override!r} is not "
                                 "supported: a meshkit mesh's groups use its world's engine; leave it out (None)")
        return self.flatten(mesh_dim_name)

    def unflatten(self, dim: int | str, sizes: Sequence[int], names: Sequence[str]) -> DeviceMesh:
        """Split dimension ``dim`` into ``sizes`` (one may be -1) named ``names``; collective over the root.

        Example (1-D mesh ``("world",)`` of 8 ranks)::

            m = mesh.unflatten("world", (2, 4), ("dp", "tp"))
            m.mesh                           # [[0, 1, 2, 3], [4, 5, 6, 7]]
            m.get_group("tp")                # rank 5: group of ranks [4, 5, 6, 7]
        """
        op = "DeviceMesh.unflatten"
        self._member_coordinate(op)
        args, error = None, None
        try:
            try:
                d = layout.dim_index(dim, self.mesh_dim_names, self.ndim)
            except _ARG_ERRORS as exc:
                raise _context(exc, f"dim {dim!r}: ") from None
            new = layout.unflatten(self._layout, d, sizes)
            count = new.ndim - self._layout.ndim + 1
            resolved = new.shape[1 + d:1 + d + count]
            if isinstance(names, (tuple, list)) and len(names) != count:
                raise ValueError(f"names {tuple(names)} has {len(names)} names but sizes {tuple(sizes)} has "
                                 f"{count}; give one new dim name per size")
            checked = layout.validate_dim_names(names, count, name="names")
            if checked is None:
                raise TypeError("names must be a sequence of new dim names, one per size, got None")
            new_names: tuple[str, ...] = checked
            old = self.mesh_dim_names or tuple(f"mesh_dim{i}" for i in range(self.ndim))
            kept = old[:d] + old[d + 1:]
            clash = [n for n in new_names if n in kept]
            if clash:
                raise ValueError(f"names {new_names} reuse {clash}, the names of dims the mesh keeps; valid "
                                 f"names differ from {list(kept)}")
            args = {"dim": d, "sizes": resolved, "names": new_names}
        except _ARG_ERRORS as exc:
            error = exc
        self._agree(op, args, error)
        return DeviceMesh._derived(self, new, old[:d] + new_names + old[d + 1:])

    def rearrange(self, pattern: str, **sizes: int) -> DeviceMesh:
        """Rearrange the rank array with an einops pattern; output axis names become dim names.

        Collective over the root mesh (new dimensions get groups; known ones are reused).

        Example (1-D mesh of 8 ranks, 2 nodes of 4)::

            m = mesh.rearrange("(node gpu) -> gpu node", node=2)
            m.mesh                           # [[0, 4], [1, 5], [2, 6], [3, 7]]
            m.mesh_dim_names                 # ("gpu", "node")
            m.get_group("node")              # rank 1: group of ranks [1, 5]
        """
        op = "DeviceMesh.rearrange"
        self._member_coordinate(op)
        args, error = None, None
        try:
            new, names = layout.rearrange(self._layout, pattern, **sizes)
            args = {"pattern": pattern, "sizes": sorted(sizes.items())}
        except _ARG_ERRORS as exc:
            error = exc
        self._agree(op, args, error)
        return DeviceMesh._derived(self, new, names)

    @classmethod
    def from_group(cls, group: ProcessGroup, device_type: str = "cpu", *,
                   mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
        """A 1-D mesh over an existing group's ranks; creates no communicator. Not collective.

        ``device_type="cuda"`` needs a group of the ``nccl`` backend.

        Example (4 ranks, ``group = new_group([1, 2, 3])``)::

            mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("dp",))
            mesh.mesh                        # every rank: [1, 2, 3]
            mesh.get_group("dp") is group    # ranks 1, 2, 3: True   (rank 0: get_coordinate() is None)
        """
        op = "DeviceMesh.from_group"
        if not isinstance(group, ProcessGroup):
            raise DistTypeError(f"{errors.prefix(op)}group must be a ProcessGroup (e.g. from new_group), got "
                                f"{group!r} ({type(group).__name__})")
        try:
            device_type = _check_device(device_type, get_backend(group))
            names = layout.validate_dim_names(mesh_dim_names, 1)
        except _ARG_ERRORS as exc:
            raise errors.convert(op, exc) from None
        mesh = cls.__new__(cls)
        mesh._setup(device_type, layout.root_layout(np.array(group.ranks)), names, anchor=None)
        mesh._root_group = group if group.is_member else None
        mesh._groups = [group if group.is_member else None]
        return mesh

    # ------------------------------------------------------------------ display
    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, {self.mesh.tolist()}{names})"

    def __eq__(self, other: object) -> bool:
        if other is self:  # the common case (DTensor ops compare their operands' meshes): no array compare
            return True
        if not isinstance(other, DeviceMesh):
            return NotImplemented
        return (self.device_type == other.device_type and self.mesh_dim_names == other.mesh_dim_names
                and np.array_equal(self._layout, other._layout))

    def __hash__(self) -> int:
        return hash((self.device_type, self.mesh_dim_names, self._layout.tobytes(), self._layout.shape))

    def describe(self, file: TextIO | None = None) -> str:
        """Each dimension's groups and every rank's host (and GPU, on a "cuda" mesh); collective
        over the root mesh.

        Prints on the mesh's first rank (to ``file``, default stdout) and returns the text on
        every rank. Warns when a dimension listed after another crosses hosts while the earlier
        one does not: the inner (later) dimensions usually carry the most traffic and belong
        inside a host, so this is likely a mistake in the order of ``mesh_shape``.
        """
        self._member_coordinate("DeviceMesh.describe")
        root = self._anchor._root_group
        assert root is not None
        cuda = self.device_type == "cuda"
        where = dict(zip(root.ranks, _placements(root, gpus=True) if cuda else
                         [(h, None) for h in host_names(root)]))
        hosts = {r: h for r, (h, _) in where.items()}
        names = self.mesh_dim_names or tuple(f"mesh_dim{i}" for i in range(self.ndim))
        lines = [repr(self)]
        crosses = []
        for d, name in enumerate(names):
            parts = layout.dim_groups(self._layout, d).tolist()
            crossing = any(len({hosts[r] for r in p}) > 1 for p in parts)
            crosses.append(crossing)
            paths = self.get_group(d).paths()  # this rank's group of the dim: its collectives' paths
            lines.append(f"  dim {d} {name!r} (size {self.shape[d]}){' crosses hosts' if crossing else ''}: "
                         f"groups {parts}" + (f"; {paths}" if paths else ""))
        by_host: dict[str, list[int]] = {}
        for r in sorted(int(r) for r in self._layout.ravel()):
            by_host.setdefault(hosts[r], []).append(r)
        lines += [f"  host {h}: ranks {rs}" + (f" on GPUs {[where[r][1] for r in rs]}" if cuda else "")
                  for h, rs in by_host.items()]
        for i in range(self.ndim):
            for j in range(i + 1, self.ndim):
                if crosses[j] and not crosses[i]:
                    warning = (f"warning: dim {names[j]!r} crosses hosts while the earlier dim {names[i]!r} "
                               f"does not; put the dimension with the most traffic last in mesh_shape")
                    lines.append(f"  {warning}")
                    logger.warning("meshkit.mesh: %s", warning)
        text = "\n".join(lines)
        if self._world.rank == int(self._layout.ravel().min()):
            print(text, file=file or sys.stdout, flush=True)
        return text


def init_device_mesh(device_type: str, mesh_shape: Sequence[int], *,
                     mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
    """A mesh of shape ``mesh_shape`` over all ranks in order; collective over the world.

    One entry of ``mesh_shape`` may be -1, inferred from the world size.

    Example (8 ranks)::

        mesh = init_device_mesh("cpu", (2, -1), mesh_dim_names=("dp", "tp"))
        mesh.mesh                        # [[0, 1, 2, 3], [4, 5, 6, 7]]
        mesh["dp"].mesh                  # rank 5: [1, 5]

    Raises:
        DistValueError, DistTypeError: a bad device type, shape or names, on this rank or on
            another (every rank raises; the message says what is valid).
        MeshMismatchError: ranks passed different shapes, names or device types.
    """
    world = current_world()
    args: dict[str, Any] | None = None
    error: Exception | None = None
    try:
        device_type = _check_device(device_type, world.backend)
        try:
            shape = layout.infer_shape(mesh_shape, world.size)
        except ValueError as exc:
            raise ValueError(f"{exc} (init_device_mesh lays out the world's {world.size} ranks)") from None
        names = layout.validate_dim_names(mesh_dim_names, len(shape))
        args = {"device_type": device_type, "mesh_shape": shape, "mesh_dim_names": names}
    except _ARG_ERRORS as exc:
        error = exc
    parent = world.default_group
    assert parent is not None, "an initialized world has its default group"
    agree(parent, "init_device_mesh", args, error)
    mesh = DeviceMesh.__new__(DeviceMesh)
    mesh._build_root(device_type, layout.make_mesh(shape), names, parent)
    return mesh
