"""Object collectives: picklable Python objects through the buffer collectives.

Every one sends sizes first, then bytes. A rank that cannot pickle its object sends a negative
size instead, the length of its error message, and the message in place of the pickle: every
rank then raises :class:`ObjectCollectiveError` naming the ranks that failed and why, and the
calls stay paired on every rank (a rank that fails alone would otherwise leave the others
waiting, and its next call would meet their second step).

Warning: these use :mod:`pickle`. Unpickling data from a peer can execute arbitrary code, so
use them only in jobs where every rank is trusted (as torch.distributed warns for its own).
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from .collectives import _group_rank
from .checks import check_member, where
from .errors import DistError, DistTypeError, DistValueError
from .group import ProcessGroup
from .registry import resolve_group

__all__ = ["broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
           "ObjectCollectiveError"]


class ObjectCollectiveError(DistError, TypeError):
    """An object collective failed on some rank (its object could not be pickled); raised on all."""


def _dump(obj: Any) -> tuple[np.ndarray, int]:
    """``(bytes, size)``: the pickle and its length, or an error message and minus its length."""
    try:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 (any pickling error is reported to every rank)
        message = f"{type(exc).__name__}: {exc}".encode()
        return np.frombuffer(bytearray(message), dtype=np.uint8), -len(message)
    return np.frombuffer(bytearray(data), dtype=np.uint8), len(data)


def _failures(g: ProcessGroup, op: str, what: str, sizes: np.ndarray, rows: Any) -> None:
    """Raise on every rank if any rank could not pickle (negative size), naming them and why."""
    failed = [i for i, n in enumerate(sizes) if n < 0]
    if failed:
        reasons = "; ".join(f"rank {g.ranks[i]}: {bytes(rows[i][:-sizes[i]]).decode(errors='replace')}"
                            if len(rows[i]) else f"rank {g.ranks[i]}: its error is reported on the destination"
                            for i in failed)
        raise ObjectCollectiveError(f"{where(g, op)}: {what} could not be pickled on ranks "
                                    f"{[g.ranks[i] for i in failed]} ({reasons}); every rank raises")


class _OverExchange:
    """The four buffer collectives the object collectives use, each as one ``exchange`` of the
    group's engine, for an engine that moves no host arrays (``capabilities.host_arrays`` False:
    the store engine under an nccl world started without MPI, comm/store_engine.py). Everything else is the
    group's. The data is small (pickles and their sizes), which a store carries."""

    def __init__(self, g: ProcessGroup) -> None:
        self._g = g

    def __getattr__(self, name: str) -> Any:
        return getattr(self._g, name)

    def _all(self, op: str, payload: Any) -> list[Any]:
        g = self._g
        check_member(g, op)
        return g.queue.blocking(op, lambda seq, deadline: g.engine.exchange(payload, seq, deadline, watched=True),
                                g.timeout)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        parts = self._all("broadcast", buf if self._g.rank == root else None)
        if self._g.rank != root:
            buf[...] = parts[root]

    def all_gather_into_tensor(self, out: np.ndarray, inp: np.ndarray) -> None:
        out[...] = np.concatenate(self._all("all_gather_into_tensor", inp))

    def gather(self, inp: np.ndarray, rows: list[np.ndarray] | None, root: int) -> None:
        parts = self._all("gather", inp)
        if rows is not None:
            for row, part in zip(rows, parts):
                row[...] = part

    def scatter(self, out: np.ndarray, rows: list[np.ndarray] | None, root: int) -> None:
        out[...] = self._all("scatter", rows)[root][self._g.rank]


def _host_side(g: ProcessGroup) -> Any:
    """``g``, or where its engine moves no host arrays, ``g`` with its buffer collectives over exchange."""
    return _OverExchange(g) if g.engine is not None and not g.engine.capabilities.host_arrays else g


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
    g = _host_side(g)
    blob, n = _dump(object_list) if g.rank == root else (np.empty(0, np.uint8), 0)
    size = np.array([n], np.int64)
    g.broadcast(size, root)
    n = int(size[0])
    buf = blob if g.rank == root else np.empty(abs(n), np.uint8)
    g.broadcast(buf, root)
    if n < 0:
        raise ObjectCollectiveError(f"{where(g, 'broadcast_object_list')}: object_list could not be pickled on "
                                    f"the source, rank {g.ranks[root]} ({bytes(buf).decode(errors='replace')}); "
                                    "every rank raises")
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
    g = _host_side(g)
    blob, n = _dump(obj)
    sizes = _gathered_sizes(g, n)
    width = int(abs(sizes).max())
    out = np.empty(width * g.size, np.uint8)
    g.all_gather_into_tensor(out, _padded(blob, width))
    rows = out.reshape(g.size, width)
    _failures(g, "all_gather_object", "obj", sizes, rows)
    object_list[:] = [_load(rows[i, :sizes[i]]) for i in range(g.size)]


def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                  group: ProcessGroup | None = None, group_dst: int | None = None) -> None:
    """Gather every rank's ``obj`` into ``object_gather_list`` on ``dst``. Pickle: trusted jobs only."""
    g = resolve_group(group)
    root = _group_rank(g, "gather_object", "dst", dst, group_dst)
    if g.rank == root:
        _check_list(g, "gather_object", "object_gather_list", object_gather_list, g.size)
    g = _host_side(g)
    blob, n = _dump(obj)
    sizes = _gathered_sizes(g, n)
    width = int(abs(sizes).max())
    rows = [np.empty(width, np.uint8) for _ in range(g.size)] if g.rank == root else None
    g.gather(_padded(blob, width), rows, root)
    mine = [blob if i == g.rank else np.empty(0, np.uint8) for i in range(g.size)]  # a failing rank's own error
    _failures(g, "gather_object", "obj", sizes, rows if rows is not None else mine)
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
    g = _host_side(g)
    width = np.zeros(1, np.int64)
    blobs = None
    if g.rank == root:
        try:
            _check_list(g, "scatter_object_list", "scatter_object_input_list", scatter_object_input_list, g.size)
        except (DistTypeError, DistValueError) as exc:
            error: BaseException | None = exc
            text = f"{type(exc).__name__}: {exc}".encode()
            dumped = [(np.frombuffer(bytearray(text), np.uint8), -len(text))]
        else:
            error = None
            dumped = [_dump(o) for o in scatter_object_input_list]
        bad = next(((b, n) for b, n in dumped if n < 0), None)
        if bad is not None:
            blobs, width[0] = [bad[0]], bad[1]  # a negative width: the error message follows
        else:
            blobs = [b for b, _ in dumped]
            width[0] = max(b.size for b in blobs) + 8
    g.broadcast(width, root)
    w = int(width[0])
    if w < 0:
        message = blobs[0] if blobs is not None else np.empty(-w, np.uint8)
        g.broadcast(message, root)
        if g.rank == root and error is not None:
            raise error
        raise ObjectCollectiveError(f"{where(g, 'scatter_object_list')}: the source, rank {g.ranks[root]}, could "
                                    f"not send scatter_object_input_list ({bytes(message).decode(errors='replace')}); "
                                    "every rank raises")
    mine = np.empty(w, np.uint8)
    rows = None
    if blobs is not None:
        # Each row: 8 bytes of length, then the pickle, padded to the widest.
        rows = [_padded(np.concatenate([np.array([b.size], np.int64).view(np.uint8), b]), w) for b in blobs]
    g.scatter(mine, rows, root)
    n = int(mine[:8].view(np.int64)[0])
    scatter_object_output_list[0] = _load(mine[8:8 + n])
