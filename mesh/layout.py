"""Pure rank arithmetic for device meshes: no process groups, no communication.

Axis order, stated once for all of meshkit:

* A *mesh* is an integer ndarray of global ranks laid out row-major (C order), so
  ``make_mesh((2, 4))`` puts rank ``r`` at ``(r // 4, r % 4)``.
* The groups of dimension ``d`` come from moving axis ``d`` last and reshaping to
  ``(-1, shape[d])``, as torch's DeviceMesh and picotron's grid do: each row is one group, rows
  follow the row-major order of the remaining coordinates, and a rank's position in its group
  is its coordinate along ``d``. On ``[[0, 1, 2, 3], [4, 5, 6, 7]]`` dim 0 has groups
  ``[0, 4], [1, 5], [2, 6], [3, 7]`` and dim 1 has groups ``[0, 1, 2, 3], [4, 5, 6, 7]``.
* A *layout* stacks a mesh with its *siblings*, shape ``(n_siblings, *shape)``: the sub-meshes
  that the same slicing gives the other ranks of the root mesh. A root mesh is its own only
  sibling (`root_layout`). Selecting dims (`submeshes`) is the rule above for several dims at
  once: the selected axes move last, in the order given, and every other axis, the sibling axis
  first, is flattened row-major into the new sibling axis. On the 2x4 root above, ``mesh[1]``
  has the layout ``[[0, 1, 2, 3], [4, 5, 6, 7]]`` and ``mesh[0]`` the layout ``[[0, 4], [1, 5],
  [2, 6], [3, 7]]``; rank 5's sub-mesh is the row that holds 5. `flatten`, `unflatten` and
  `rearrange` act on every sibling alike, and `coordinate` on a layout gives
  ``(sibling, *coordinate)``.

Every rank holds the whole layout, so every rank knows every group of every sibling: what
building a dimension's groups with one collective split needs. Every function is deterministic
and gives the same answer on every rank. Functions return new C-contiguous arrays; only
`validate_mesh` freezes them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

import einops
import numpy as np

__all__ = [
    "coordinate",
    "dim_groups",
    "dim_index",
    "dim_indices",
    "flatten",
    "infer_shape",
    "make_mesh",
    "rearrange",
    "root_layout",
    "same_layout",
    "submeshes",
    "unflatten",
    "validate_dim_names",
    "validate_mesh",
]


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _name_ranks(ranks: Iterable[int], limit: int = 8) -> str:
    vals = [int(r) for r in ranks]
    if len(vals) == 1:
        return f"rank {vals[0]}"
    more = ", ..." if len(vals) > limit else ""
    return f"ranks [{', '.join(map(str, vals[:limit]))}{more}]"


def _short(x: object, limit: int = 120) -> str:
    """``repr(x)``, cut to ``limit`` characters for error messages."""
    text = repr(x)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _parse_shape(shape: Sequence[int], name: str) -> tuple[int, ...]:
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
        raise TypeError(f"{name} must be a sequence of ints, got {shape!r}")
    shape = tuple(shape)
    if not shape:
        raise ValueError(f"{name} must have at least one dimension, got ()")
    for s in shape:
        if not _is_int(s):
            raise TypeError(f"{name} entries must be ints, got {s!r} ({type(s).__name__}) in {shape}")
    shape = tuple(int(s) for s in shape)
    bad = [s for s in shape if s < 1 and s != -1]
    if bad:
        raise ValueError(f"{name} {shape} has non-positive size {bad[0]}; "
                         "sizes must be >= 1, or -1 for one inferred dimension")
    if shape.count(-1) > 1:
        raise ValueError(f"{name} {shape} has {shape.count(-1)} entries of -1; "
                         "at most one dimension can be inferred")
    return shape


def infer_shape(shape: Sequence[int], size: int, *, name: str = "mesh_shape") -> tuple[int, ...]:
    """Resolve a mesh shape for ``size`` ranks, inferring one ``-1`` as numpy's reshape does.

    Args:
        shape: positive ints, at most one of them ``-1``.
        size: the number of ranks the shape must hold.
        name: what to call ``shape`` in error messages.

    Returns:
        The shape with ``-1`` replaced, as a tuple of Python ints.

    Raises:
        TypeError: ``shape`` is not a sequence of ints.
        ValueError: a size is 0 or below -1, there is more than one ``-1``, or the
            shape cannot hold exactly ``size`` ranks.

    Example:
        >>> infer_shape((2, -1), 8)
        (2, 4)
    """
    shape = _parse_shape(shape, name)
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if size < 1 or size % known:
            raise ValueError(f"{name} {shape} cannot hold {size} ranks: {size} is not a positive "
                             f"multiple of {known}, the product of the other sizes")
        return tuple(size // known if s == -1 else s for s in shape)
    if known != size:
        raise ValueError(f"{name} {shape} has {known} ranks but {size} were given")
    return shape


def make_mesh(shape: Sequence[int], ranks: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """Lay ``ranks`` out row-major in an array of ``shape``.

    Args:
        shape: the mesh shape; one ``-1`` is inferred from the number of ranks.
        ranks: 1-D global ranks, default ``0 .. prod(shape) - 1`` (then no ``-1`` allowed).

    Returns:
        The validated mesh (read-only int64, see `validate_mesh`).

    Example:
        >>> make_mesh((2, 2)).tolist()
        [[0, 1], [2, 3]]
        >>> make_mesh((-1, 2), [4, 5, 6, 7]).tolist()
        [[4, 5], [6, 7]]
    """
    if ranks is None:
        parsed = _parse_shape(shape, "mesh_shape")
        if -1 in parsed:
            raise ValueError(f"mesh_shape {parsed} has a -1 but no ranks were given to infer "
                             "it from; pass ranks or give every size")
        ranks = np.arange(math.prod(parsed))
    ranks = np.asarray(ranks)
    if ranks.ndim != 1:
        raise ValueError(f"ranks must be 1-D, got an array of shape {ranks.shape}")
    return validate_mesh(ranks.reshape(infer_shape(shape, ranks.size)))


def validate_mesh(mesh: np.ndarray | Sequence, world_size: int | None = None) -> np.ndarray:
    """Check a rank array and return a read-only C-contiguous int64 copy.

    Args:
        mesh: array-like of global ranks, at least 1-D and non-empty.
        world_size: if given, every rank must lie in ``[0, world_size)``.

    Raises:
        TypeError: the ranks are not integers (floats are refused even if integral).
        ValueError: the mesh is ragged, 0-d or empty, repeats a rank, or holds a
            rank that is negative or not below ``world_size``.
    """
    try:
        arr = np.asarray(mesh)
    except ValueError:
        raise ValueError(f"mesh must be a rectangular array of ranks (rows of equal length), "
                         f"got {_short(mesh)}") from None
    if arr.dtype == object:
        raise TypeError(f"mesh must be an array-like of integer ranks, got {_short(mesh)} "
                        f"({type(mesh).__name__})")
    if arr.ndim == 0:
        raise ValueError(f"mesh must have at least one dimension, got the 0-d array {arr.item()}")
    if arr.size == 0:
        raise ValueError(f"mesh must hold at least one rank, got an empty mesh of shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"mesh must hold integer ranks, got dtype {arr.dtype}")
    if world_size is None:
        bad = np.unique(arr[arr < 0])
        if bad.size:
            raise ValueError(f"mesh holds negative {_name_ranks(bad)}; ranks must be >= 0")
    else:
        if not _is_int(world_size) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        bad = np.unique(arr[(arr < 0) | (arr >= world_size)])
        if bad.size:
            raise ValueError(f"mesh holds {_name_ranks(bad)} outside the world of size "
                             f"{world_size}; valid ranks are 0 to {world_size - 1}")
    values, counts = np.unique(arr, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"mesh of shape {arr.shape} repeats {_name_ranks(values[counts > 1])}; "
                         "each rank may appear once")
    out = np.array(arr, dtype=np.int64, order="C", copy=True)
    out.flags.writeable = False
    return out


def validate_dim_names(names: Sequence[str] | None, ndim: int, *,
                       name: str = "mesh_dim_names") -> tuple[str, ...] | None:
    """Check mesh dimension names: unique identifiers, one per dimension; None stays None.

    ``name`` is what to call ``names`` in error messages.

    Raises:
        TypeError: ``names`` is a bare string or holds a non-string.
        ValueError: a name is not an identifier, is repeated, or the count is not ``ndim``.
    """
    if names is None:
        return None
    if isinstance(names, str):
        raise TypeError(f"{name} must be a sequence of strings, got the string "
                        f"{names!r}; for one dimension write ({names!r},)")
    if not isinstance(names, Iterable):
        raise TypeError(f"{name} must be a sequence of strings, got {_short(names)} ({type(names).__name__})")
    names = tuple(names)
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"{name} must be strings, got {n!r} ({type(n).__name__}) in {names}")
        if not n.isidentifier():
            raise ValueError(f"mesh dim name {n!r} in {names} is not a valid identifier; "
                             "use names like 'dp' or 'tp_inner'")
    for i, n in enumerate(names):
        if n in names[:i]:
            raise ValueError(f"{name} {names} repeat {n!r}; names must be unique")
    if len(names) != ndim:
        raise ValueError(f"{name} {names} has {len(names)} names but the mesh has "
                         f"{ndim} dimensions; give one name per dimension")
    return names


def dim_index(dim: int | str, names: Sequence[str] | None, ndim: int) -> int:
    """Resolve a mesh dimension given by name or (possibly negative) index to ``0 .. ndim-1``.

    Raises:
        KeyError: an unknown name, or a name when the mesh has no dim names.
        IndexError: an index outside ``[-ndim, ndim)``.
        TypeError: ``dim`` is neither an int nor a str.

    Example:
        >>> dim_index("tp", ("dp", "tp"), 2), dim_index(-2, None, 2)
        (1, 0)
    """
    if isinstance(dim, str):
        if names is None:
            raise KeyError(f"Cannot find mesh dim {dim!r}: the mesh has no mesh_dim_names; "
                           f"pass mesh_dim_names or use an index in [{-ndim}, {ndim})")
        if dim not in names:
            raise KeyError(f"Invalid mesh dim {dim!r}. Valid dims are {list(names)}")
        return list(names).index(dim)
    if not _is_int(dim):
        raise TypeError(f"mesh dim must be an int or a str, got {dim!r} ({type(dim).__name__})")
    if not -ndim <= dim < ndim:
        raise IndexError(f"mesh dim {dim} is out of range for a mesh with {ndim} dimensions; "
                         f"valid indices are {-ndim} to {ndim - 1}")
    return int(dim) % ndim


def dim_indices(dims: int | str | Sequence[int | str], names: Sequence[str] | None,
                ndim: int) -> tuple[int, ...]:
    """Resolve a selection of dims (as in ``mesh["dp", "tp"]``), keeping its order.

    A single name or index is a selection of one. Errors are those of `dim_index`, plus
    TypeError for a selection that is not a name, an index, a tuple or a list, and ValueError
    for an empty selection or one that names a dimension twice.

    Example:
        >>> dim_indices(("tp", "dp"), ("pp", "dp", "tp"), 3)
        (2, 1)
    """
    if isinstance(dims, str) or _is_int(dims):
        sel: tuple = (dims,)
    elif isinstance(dims, (tuple, list)):
        sel = tuple(dims)
    else:
        raise TypeError(f"mesh dims must be a dim name, an index, or a tuple of them, got {_short(dims)} "
                        f"({type(dims).__name__})")
    if not sel:
        raise ValueError("at least one mesh dim must be selected, got ()")
    idx = tuple(dim_index(d, names, ndim) for d in sel)
    for i, d in enumerate(idx):
        if d in idx[:i]:
            label = f"{d} ({names[d]!r})" if names is not None else f"{d}"
            raise ValueError(f"mesh dims {sel} select dim {label} more than once; "
                             "each dim may be selected once")
    return idx


def coordinate(mesh: np.ndarray, rank: int) -> tuple[int, ...] | None:
    """The coordinate of global ``rank`` in ``mesh``, or None if the mesh does not hold it.

    On a layout the coordinate is ``(sibling, *coordinate in that sibling)``.

    Example:
        >>> coordinate(make_mesh((2, 4)), 6), coordinate(make_mesh((2, 4)), 8)
        ((1, 2), None)
        >>> coordinate(submeshes(root_layout(make_mesh((2, 4))), (0,)), 6)   # mesh[0]: [2, 6] is sibling 2
        (2, 1)
    """
    hits = np.argwhere(np.asarray(mesh) == rank)
    return tuple(int(c) for c in hits[0]) if len(hits) else None


def _layout(layout: np.ndarray) -> np.ndarray:
    layout = np.asarray(layout)
    if layout.ndim < 2:
        raise ValueError(f"a layout has shape (n_siblings, *mesh_shape), got an array of shape {layout.shape}; "
                         "root_layout(mesh) is the layout of a root mesh")
    return layout


def root_layout(mesh: np.ndarray) -> np.ndarray:
    """The layout of a root mesh: the mesh as its own only sibling, shape ``(1, *mesh.shape)``.

    Example:
        >>> root_layout(make_mesh((2, 2))).tolist()
        [[[0, 1], [2, 3]]]
    """
    return np.array(mesh, dtype=np.int64)[None]


def submeshes(layout: np.ndarray, dims: Sequence[int]) -> np.ndarray:
    """The layout of the sub-meshes over mesh ``dims``, in that order: ``mesh[dims]`` of every rank.

    Out-of-order dims give transposed sub-meshes, as torch's ``mesh["tp", "dp"]`` does.

    Example (a 2x2x2 root with dims ``(pp, dp, tp)``)::

        >>> root = root_layout(make_mesh((2, 2, 2)))   # [[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]]
        >>> submeshes(root, (1, 2)).tolist()           # mesh["dp", "tp"]: one sibling per pp
        [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
        >>> submeshes(root, (2, 0)).tolist()           # mesh["tp", "pp"]: one sibling per dp
        [[[0, 4], [1, 5]], [[2, 6], [3, 7]]]
        >>> submeshes(submeshes(root, (1, 2)), (1,)).tolist() == submeshes(root, (2,)).tolist()
        True

    Raises:
        ValueError, IndexError, KeyError, TypeError: as `dim_indices` for the mesh's dims.
    """
    layout = _layout(layout)
    kept = [d + 1 for d in dim_indices(dims, None, layout.ndim - 1)]
    rest = [a for a in range(layout.ndim) if a not in kept]
    return layout.transpose(*rest, *kept).reshape(-1, *(layout.shape[a] for a in kept)).copy()


def dim_groups(layout: np.ndarray, dim: int) -> np.ndarray:
    """Every group of mesh dimension ``dim`` across all siblings, one a row: ``(n_groups, size)``.

    Example:
        >>> root = root_layout(make_mesh((2, 2)))      # [[[0, 1], [2, 3]]]
        >>> dim_groups(root, 0).tolist(), dim_groups(root, 1).tolist()
        ([[0, 2], [1, 3]], [[0, 1], [2, 3]])
    """
    return submeshes(layout, (dim,))


def flatten(layout: np.ndarray) -> np.ndarray:
    """Every sibling as a row-major 1-D mesh: shape ``(n_siblings, size)``.

    Example:
        >>> flatten(submeshes(root_layout(make_mesh((2, 2))), (1, 0))).tolist()   # mesh["tp", "dp"]
        [[0, 2, 1, 3]]
    """
    layout = _layout(layout)
    return layout.reshape(layout.shape[0], -1).copy()


def unflatten(layout: np.ndarray, dim: int, sizes: Sequence[int]) -> np.ndarray:
    """Split mesh dimension ``dim`` of every sibling into ``sizes`` (row-major; one ``-1`` is inferred).

    Example:
        >>> unflatten(root_layout(make_mesh((2, 4))), 1, (2, -1)).tolist()
        [[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]]
    """
    layout = _layout(layout)
    shape = layout.shape[1:]
    d = dim_index(dim, None, len(shape))
    try:
        new = infer_shape(sizes, shape[d], name="sizes")
    except (TypeError, ValueError) as e:
        raise type(e)(f"cannot unflatten mesh dim {d} of size {shape[d]} (mesh shape {shape}): {e}") from e
    return layout.reshape(layout.shape[0], *shape[:d], *new, *shape[d + 1:]).copy()


def same_layout(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two layouts hold the same sub-meshes (siblings in any order).

    Example:
        >>> root = root_layout(make_mesh((2, 2)))
        >>> same_layout(submeshes(root, (0,))[::-1], submeshes(root, (0,))), \\
        ...     same_layout(submeshes(root, (0,)), submeshes(root, (1,)))
        (True, False)
    """
    a, b = _layout(a), _layout(b)
    if a.shape != b.shape:
        return False
    return sorted(map(tuple, flatten(a).tolist())) == sorted(map(tuple, flatten(b).tolist()))


# An output axis of an einops pattern: a parenthesized group, or one bare token.
_OUTPUT_AXIS = re.compile(r"\(([^()]*)\)|([^\s()]+)")


def _rearrange_one(mesh: np.ndarray, pattern: str, sizes: dict[str, int]) -> tuple[np.ndarray, tuple[str, ...]]:
    try:
        out = einops.rearrange(mesh, pattern, **sizes)
    except einops.EinopsError as e:
        reason = " ".join(str(e).split())
        raise ValueError(f"cannot rearrange mesh of shape {mesh.shape} with pattern "
                         f"{pattern!r}: {reason}") from e
    names = []
    for m in _OUTPUT_AXIS.finditer(pattern.split("->")[1]):
        parts = m.group(1).split() if m.group(1) is not None else [m.group(2)]
        if any("..." in p for p in parts):
            raise ValueError(f"pattern {pattern!r} has '...' in its output; name every output "
                             "axis, since the names become the mesh dim names")
        parts = [p for p in parts if p != "1"]
        if not parts:
            raise ValueError(f"pattern {pattern!r} has an unnamed output axis {m.group(0)!r}; "
                             "name every output axis, since the names become the mesh dim names")
        names.append("_".join(parts))
    validate_dim_names(names, out.ndim)
    return out, tuple(names)


def rearrange(layout: np.ndarray, pattern: str, **sizes: int) -> tuple[np.ndarray, tuple[str, ...]]:
    """Apply an einops ``rearrange`` pattern to every sibling's rank array; name the output axes.

    An output group ``(a b)`` is named ``a_b``; ``...`` and unnamed axes (``1``, ``()``)
    are refused in the output, since every mesh dimension needs a name.

    Example:
        >>> out, names = rearrange(root_layout(make_mesh((8,))), "(node gpu) -> gpu node", node=2)
        >>> out[0].tolist(), names
        ([[0, 4], [1, 5], [2, 6], [3, 7]], ('gpu', 'node'))

    Raises:
        TypeError: ``pattern`` is not a string.
        ValueError: einops refuses the pattern (its message is quoted), or an output
            axis has no name.
    """
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be an einops pattern string, got {pattern!r}")
    layout = _layout(layout)
    results = [_rearrange_one(sibling, pattern, sizes) for sibling in layout]
    return np.ascontiguousarray(np.stack([r[0] for r in results])), results[0][1]
