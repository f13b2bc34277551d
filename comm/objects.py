"""Object collectives: picklable Python objects through the buffer collectives.

Warning: these use :mod:`pickle`. Unpickling data from a peer can execute arbitrary code, so
use them only in jobs where every rank is trusted (as torch.distributed warns for its own).
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from .api import _group_rank
from .checks import where
from .errors import DistTypeError, DistValueError
from .group import ProcessGroup
from .registry import resolve_group

__all__ = ["broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list"]


def _dump(obj: Any) -> np.ndarray:
    return np.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=np.uint8)


def _load(buf: np.ndarray) -> Any:
    return pickle.loads(buf.tobytes())


def _padded(blob: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros(size, np.uint8)
    out[:blob.size] = blob
    return out


def _gathered_sizes(g: ProcessGroup, n: int) -> np.ndarray:
    sizes = np.empty(g.size, np.int64)
    g.all_gather_into_tensor(sizes, np.array([n], np.int64))
    return sizes


def _check_list(g: ProcessGroup, op: str, arg: str, xs: Any, slots: int | None = None) -> None:
    """``xs`` is a list (of ``slots`` entries, when given)."""
    if not isinstance(xs, list):
        raise DistTypeError(f"{where(g, op)}: {arg} must be a list, got {type(xs).__name__}")
    if slots is not None and len(xs) != slots:
        raise DistValueError(f"{where(g, op)}: {arg} has {len(xs)} slots, expected one per rank ({slots})")


def broadcast_object_list(object_list: list[Any], src: int | None = None, group: ProcessGroup | None = None,
                          group_src: int | None = None) -> None:
    """Replace the elements of ``object_list`` on every rank with ``src``'s, in place.

    Every rank passes a list of the same length. Uses pickle: trusted jobs only.
    """
    g = resolve_group(group)
    root = _group_rank(g, "broadcast_object_list", "src", src, group_src)
    _check_list(g, "broadcast_object_list", "object_list", object_list)
    blob = _dump(object_list) if g.rank == root else np.empty(0, np.uint8)
    size = np.array([blob.size], np.int64)
    g.broadcast(size, root)
    buf = blob if g.rank == root else np.empty(int(size[0]), np.uint8)
    g.broadcast(buf, root)
    if g.rank != root:
        received = _load(buf)
        if len(received) != len(object_list):
            raise DistValueError(f"{where(g, 'broadcast_object_list')}: object_list has {len(object_list)} "
                                 f"elements but the source's has {len(received)}; they must match")
        object_list[:] = received


def all_gather_object(object_list: list[Any], obj: Any, group: ProcessGroup | None = None) -> None:
    """Fill ``object_list`` (one slot per rank) with every rank's ``obj``. Pickle: trusted jobs only.

    Example (2 ranks): rank r passes ``obj = {"rank": r}``; both get
    ``[{"rank": 0}, {"rank": 1}]``.
    """
    g = resolve_group(group)
    _check_list(g, "all_gather_object", "object_list", object_list, g.size)
    blob = _dump(obj)
    sizes = _gathered_sizes(g, blob.size)
    width = int(sizes.max())
    out = np.empty(width * g.size, np.uint8)
    g.all_gather_into_tensor(out, _padded(blob, width))
    rows = out.reshape(g.size, width)
    object_list[:] = [_load(rows[i, :sizes[i]]) for i in range(g.size)]


def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                  group: ProcessGroup | None = None, group_dst: int | None = None) -> None:
    """Gather every rank's ``obj`` into ``object_gather_list`` on ``dst``. Pickle: trusted jobs only."""
    g = resolve_group(group)
    root = _group_rank(g, "gather_object", "dst", dst, group_dst)
    if g.rank == root:
        _check_list(g, "gather_object", "object_gather_list", object_gather_list, g.size)
    blob = _dump(obj)
    sizes = _gathered_sizes(g, blob.size)
    width = int(sizes.max())
    rows = [np.empty(width, np.uint8) for _ in range(g.size)] if g.rank == root else None
    g.gather(_padded(blob, width), rows, root)
    if rows is not None:
        object_gather_list[:] = [_load(rows[i][:sizes[i]]) for i in range(g.size)]


def scatter_object_list(scatter_object_output_list: list[Any], scatter_object_input_list: list[Any] | None = None,
                        src: int | None = None, group: ProcessGroup | None = None,
                        group_src: int | None = None) -> None:
    """``src`` sends ``scatter_object_input_list[r]`` to rank r's ``scatter_object_output_list[0]``.

    Pickle: trusted jobs only.
    """
    g = resolve_group(group)
    root = _group_rank(g, "scatter_object_list", "src", src, group_src)
    _check_list(g, "scatter_object_list", "scatter_object_output_list", scatter_object_output_list)
    if not scatter_object_output_list:
        raise DistValueError(f"{where(g, 'scatter_object_list')}: scatter_object_output_list needs at least "
                             "one slot to receive into")
    width = np.zeros(1, np.int64)
    blobs = None
    if g.rank == root:
        _check_list(g, "scatter_object_list", "scatter_object_input_list", scatter_object_input_list, g.size)
        blobs = [_dump(o) for o in scatter_object_input_list]
        width[0] = max(b.size for b in blobs) + 8
    g.broadcast(width, root)
    w = int(width[0])
    mine = np.empty(w, np.uint8)
    rows = None
    if blobs is not None:
        # Each row: 8 bytes of length, then the pickle, padded to the widest.
        rows = [_padded(np.concatenate([np.array([b.size], np.int64).view(np.uint8), b]), w) for b in blobs]
    g.scatter(mine, rows, root)
    n = int(mine[:8].view(np.int64)[0])
    scatter_object_output_list[0] = _load(mine[8:8 + n])
