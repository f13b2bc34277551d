"""Object collectives: Python objects through the buffer collectives.

Every one sends sizes first, then bytes. A rank that cannot serialize its object sends a negative
size instead, the length of its error message, and the message in place of the object: every
rank then raises :class:`ObjectCollectiveError` naming the ranks that failed and why, and the
calls stay paired on every rank (a rank that fails alone would otherwise leave the others
waiting, and its next call would meet their second step).

How an object travels depends on whether the group's peers are authenticated
(``capabilities.authenticated_peers`` of its engine: MPI's processes, local's threads, a store
that proves the job's secret). There, it is a :mod:`pickle`, as in torch (unpickling runs code,
so this is for peers that are the job's own). Elsewhere (an nccl world started without MPI whose
rendezvous store has no job secret: anyone who can write the store could send a pickle), it
travels in meshkit's typed format (:mod:`~meshkit.comm.control`), which carries plain data: None,
bool, int, float, str, bytes, lists, tuples, dicts and NumPy arrays. An object it cannot carry
(an instance of a class of one's own) fails the call on every rank, naming ``MESHKIT_JOB_SECRET``.
Each payload's first byte says which (:data:`_PICKLE` or :data:`_TYPED`), and a rank of an
unauthenticated group refuses a pickle without unpickling it.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from . import control
from .collectives import _group_rank
from .groups.call_fingerprint import compare
from .checks import check_member, where
from .control import ControlMessageError
from .errors import DistError, DistTypeError, DistValueError
from .groups.group import ProcessGroup
from .setup.registry import resolve_group
from .stores.wire import MAX_VALUE_BYTES

__all__ = ["broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
           "ObjectCollectiveError"]

#: The first byte of every object's bytes: a pickle (authenticated groups only) or the typed format.
_PICKLE, _TYPED = b"P", b"C"

#: How to authenticate a world whose ranks met through a store (the variable the stores read).
_JOB_SECRET_HINT = ("set MESHKIT_JOB_SECRET to the same secret on every rank, e.g. from "
                   "`python -c 'import secrets; print(secrets.token_hex(32))'`")
#: Why an unauthenticated group carries no pickles (the end of its errors).
_WHY_TYPED = ("this group's peers are not authenticated (its ranks met through a rendezvous store that does not "
              "prove the job's secret, so a process outside the job could write what they read), so objects "
              "travel in meshkit's typed format, never as pickles")


class ObjectCollectiveError(DistError, TypeError):
    """An object collective failed on some rank (its object could not be serialized); raised on all."""


def _authenticated(g: Any) -> bool:
    """Whether ``g``'s peers are the job's own (its engine says so): objects travel as pickles."""
    return g.engine is not None and g.engine.capabilities.authenticated_peers


def _dump(obj: Any, pickles: bool) -> tuple[np.ndarray, int]:
    """``(bytes, size)``: the object's tag byte and bytes and their length, or an error message
    and minus its length. ``pickles``: as a pickle, else in the typed format."""
    if pickles:
        try:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 (any pickling error is reported to every rank)
            return _error(f"{type(exc).__name__}: {exc}")
    else:
        try:
            data = control.encode(obj)
        except DistTypeError as exc:  # the typed format cannot carry it
            carry = str(exc).replace("meshkit.comm: a control message cannot carry", "the typed format cannot carry")
            return _error(f"{carry}; {_WHY_TYPED}: pass plain data, or {_JOB_SECRET_HINT}")
    blob = bytearray(_PICKLE if pickles else _TYPED)
    blob += data  # one copy, as bytearray(data) was
    return np.frombuffer(blob, dtype=np.uint8), len(blob)


def _error(message: str) -> tuple[np.ndarray, int]:
    data = message.encode()
    return np.frombuffer(bytearray(data), dtype=np.uint8), -len(data)


def _load(g: Any, op: str, buf: np.ndarray, sender: int) -> Any:
    """The object group rank ``sender`` sent in ``buf``. A pickle is unpickled only on a group
    whose peers are authenticated; anything malformed is a ControlMessageError naming the sender."""
    tag = bytes(buf[:1])
    if tag == _PICKLE and _authenticated(g):  # the path of MPI and local: as fast as before
        return pickle.loads(buf[1:])
    who = f"rank {g.global_rank}: {op}: the object from rank {g.ranks[sender]}"
    if tag == _TYPED:
        return control.decode(buf[1:].tobytes(), what=who)
    if tag == _PICKLE:
        raise ControlMessageError(f"meshkit.comm: {who} is a pickle, refused without unpickling it: {_WHY_TYPED}; a "
                                  f"process outside this job may have written to the rendezvous store (to use pickle, "
                                  f"{_JOB_SECRET_HINT})")
    raise ControlMessageError(f"meshkit.comm: {who} is neither a pickle nor in meshkit's typed format (its first "
                              f"byte is {tag!r}); a process outside this job may have written to the rendezvous store")


class _Refusing:
    """``with _Refusing(g):`` bytes that are not what a member sent (forged, malformed:
    ControlMessageError) are refused after the group's calls completed here: this rank then stops
    using the group and tells the others, so that their next call fails at once instead of
    waiting for it until the timeout. (A class, not contextlib's generator: half the cost
    a call, and it runs at every collective.)"""

    __slots__ = ("g",)

    def __init__(self, g: Any) -> None:
        self.g = g

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        g = self.g
        if isinstance(exc, ControlMessageError) and g.failures.reason is None:
            g.failures.broken(str(exc), g.queue.seq - 1)


def _failures(g: ProcessGroup, op: str, what: str, sizes: np.ndarray, rows: Any) -> None:
    """Raise on every rank if any rank could not serialize (negative size), naming them and why."""
    failed = [i for i, n in enumerate(sizes) if n < 0]
    if failed:
        reasons = "; ".join(f"rank {g.ranks[i]}: {bytes(rows[i][:-sizes[i]]).decode(errors='replace')}"
                            if len(rows[i]) else f"rank {g.ranks[i]}: its error is reported on the destination"
                            for i in failed)
        how = "pickled" if _authenticated(g) else "sent in meshkit's typed format"
        raise ObjectCollectiveError(f"{where(op, g)}: {what} could not be {how} on ranks "
                                    f"{[g.ranks[i] for i in failed]} ({reasons}); every rank raises")


class _OverExchange:
    """The four buffer collectives the object collectives use, each as one ``exchange`` of the
    group's engine, for an engine that moves no host arrays (``capabilities.host_arrays`` False:
    the store engine under an nccl world started without MPI, comm/engines/store_engine.py). Everything else is the
    group's. The data is small (objects' bytes and their sizes), which a store carries; each part
    that comes back must be an array like the one this rank passed (else ControlMessageError,
    naming the rank it came from)."""

    def __init__(self, g: ProcessGroup) -> None:
        self._g = g

    def __getattr__(self, name: str) -> Any:
        return getattr(self._g, name)

    def _all(self, op: str, payload: Any) -> list[Any]:
        g = self._g
        check_member(g, op)
        return g.queue.blocking(op, lambda seq, deadline: g.engine.exchange(payload, seq, deadline, watched=True),
                                g.timeout)

    def _like(self, op: str, part: Any, like: np.ndarray, sender: int) -> np.ndarray:
        if type(part) is not np.ndarray or part.dtype != like.dtype or part.shape != like.shape:
            g = self._g
            got = (f"an array of shape {part.shape} and dtype {part.dtype}" if isinstance(part, np.ndarray)
                   else f"a {type(part).__name__}")
            raise ControlMessageError(f"{where(op, g)}: the exchange brought {got} from rank {g.ranks[sender]}, "
                                      f"where an array of shape {like.shape} and dtype {like.dtype} was sent; a "
                                      "process outside this job may have written to the rendezvous store")
        return part

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        parts = self._all("broadcast", buf if self._g.rank == root else None)
        if self._g.rank != root:
            buf[...] = self._like("broadcast", parts[root], buf, root)

    def all_gather_into_tensor(self, out: np.ndarray, inp: np.ndarray) -> None:
        parts = self._all("all_gather_into_tensor", inp)
        out[...] = np.concatenate([self._like("all_gather_into_tensor", p, inp, i) for i, p in enumerate(parts)])

    def gather(self, inp: np.ndarray, rows: list[np.ndarray] | None, root: int) -> None:
        parts = self._all("gather", inp)
        if rows is not None:
            for i, (row, part) in enumerate(zip(rows, parts)):
                row[...] = self._like("gather", part, inp, i)

    def scatter(self, out: np.ndarray, rows: list[np.ndarray] | None, root: int) -> None:
        sent = self._all("scatter", rows)[root]
        if type(sent) is not list or len(sent) != self._g.size:
            raise ControlMessageError(f"{where('scatter', self._g)}: the exchange brought a "
                                      f"{type(sent).__name__} from rank {self._g.ranks[root]}, where a list of "
                                      f"{self._g.size} arrays was sent; a process outside this job may have written "
                                      "to the rendezvous store")
        out[...] = self._like("scatter", sent[self._g.rank], out, root)


def _host_side(g: ProcessGroup) -> Any:
    """``g``, or where its engine moves no host arrays, ``g`` with its buffer collectives over exchange."""
    return _OverExchange(g) if g.engine is not None and not g.engine.capabilities.host_arrays else g


def _bounded(g: Any, op: str, sizes: Any, senders: Any) -> None:
    """Over a store's exchange, sizes that no store carries (:data:`MAX_VALUE_BYTES`) are forged:
    refused before anything of that size is allocated."""
    if isinstance(g, _OverExchange):
        for n, i in zip(sizes, senders):
            if abs(int(n)) > MAX_VALUE_BYTES:
                raise ControlMessageError(f"{where(op, g)}: rank {g.ranks[i]} announced {abs(int(n))} bytes, more "
                                          f"than any store carries ({MAX_VALUE_BYTES}); a process outside this job "
                                          "may have written to the rendezvous store")


def _padded(blob: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros(size, np.uint8)
    out[:blob.size] = blob
    return out


def _gathered_sizes(g: ProcessGroup, n: int, op: str) -> np.ndarray:
    """Every rank's size, gathered beside its fingerprint of the group's calls so far
    (comm/groups/call_fingerprint.py): if the members' calls differed, every rank raises here, before
    sizes read from another call's data are used (a shifted sequence made this an allocation of
    8 EiB, or an UnpicklingError naming nothing)."""
    queue = g.queue
    token = (queue.seq, queue.sequence.value)
    pairs = np.empty(2 * g.size, np.int64)
    g.all_gather_into_tensor(pairs, np.array([n, token[1]], np.int64))
    compare(g, pairs[1::2].tolist(), token, op)
    return pairs[0::2].copy()


def _check_list(g: ProcessGroup, op: str, arg: str, xs: Any, slots: int | None = None) -> None:
    """``xs`` is a list (of ``slots`` entries, when given)."""
    if not isinstance(xs, list):
        raise DistTypeError(f"{where(op, g)}: {arg} must be a list, got {type(xs).__name__}")
    if slots is not None and len(xs) != slots:
        raise DistValueError(f"{where(op, g)}: {arg} has {len(xs)} slots, expected one per rank ({slots})")


def broadcast_object_list(object_list: list[Any], src: int | None = None, group: ProcessGroup | None = None,
                          group_src: int | None = None) -> None:
    """Replace the elements of ``object_list`` on every rank with ``src``'s, in place.

    Every rank passes a list of the same length. Pickle on authenticated groups, else plain data
    (see the module docstring).
    """
    g = resolve_group(group)
    root = _group_rank(g, "broadcast_object_list", "src", src, group_src)
    _check_list(g, "broadcast_object_list", "object_list", object_list)
    g = _host_side(g)
    with _Refusing(g):
        blob, n = _dump(object_list, _authenticated(g)) if g.rank == root else (np.empty(0, np.uint8), 0)
        size = np.array([n], np.int64)
        g.broadcast(size, root)
        n = int(size[0])
        _bounded(g, "broadcast_object_list", [n], [root])
        buf = blob if g.rank == root else np.empty(abs(n), np.uint8)
        g.broadcast(buf, root)
        if n < 0:
            how = "pickled" if _authenticated(g) else "sent in meshkit's typed format"
            raise ObjectCollectiveError(f"{where('broadcast_object_list', g)}: object_list could not be {how} on "
                                        f"the source, rank {g.ranks[root]} ({bytes(buf).decode(errors='replace')}); "
                                        "every rank raises")
        if g.rank != root:
            received = _load(g, "broadcast_object_list", buf, root)
            if type(received) is not list:
                raise ControlMessageError(f"{where('broadcast_object_list', g)}: the source, rank {g.ranks[root]}, "
                                          f"sent a {type(received).__name__}, not a list")
            if len(received) != len(object_list):
                raise DistValueError(f"{where('broadcast_object_list', g)}: object_list has {len(object_list)} "
                                     f"elements but the source's has {len(received)}; they must match")
            object_list[:] = received


def all_gather_object(object_list: list[Any], obj: Any, group: ProcessGroup | None = None) -> None:
    """Fill ``object_list`` (one slot per rank) with every rank's ``obj`` (pickled on authenticated
    groups, else plain data: see the module docstring).

    Example (2 ranks): rank r passes ``obj = {"rank": r}``; both get
    ``[{"rank": 0}, {"rank": 1}]``.
    """
    g = resolve_group(group)
    _check_list(g, "all_gather_object", "object_list", object_list, g.size)
    g = _host_side(g)
    with _Refusing(g):
        blob, n = _dump(obj, _authenticated(g))
        sizes = _gathered_sizes(g, n, "all_gather_object")
        _bounded(g, "all_gather_object", sizes, range(g.size))
        width = int(abs(sizes).max())
        out = np.empty(width * g.size, np.uint8)
        g.all_gather_into_tensor(out, _padded(blob, width))
        rows = out.reshape(g.size, width)
        _failures(g, "all_gather_object", "obj", sizes, rows)
        object_list[:] = [_load(g, "all_gather_object", rows[i, :sizes[i]], i) for i in range(g.size)]


def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                  group: ProcessGroup | None = None, group_dst: int | None = None) -> None:
    """Gather every rank's ``obj`` into ``object_gather_list`` on ``dst`` (pickled on authenticated
    groups, else plain data: see the module docstring)."""
    g = resolve_group(group)
    root = _group_rank(g, "gather_object", "dst", dst, group_dst)
    if g.rank == root:
        _check_list(g, "gather_object", "object_gather_list", object_gather_list, g.size)
    g = _host_side(g)
    with _Refusing(g):
        blob, n = _dump(obj, _authenticated(g))
        sizes = _gathered_sizes(g, n, "gather_object")
        _bounded(g, "gather_object", sizes, range(g.size))
        width = int(abs(sizes).max())
        rows = [np.empty(width, np.uint8) for _ in range(g.size)] if g.rank == root else None
        g.gather(_padded(blob, width), rows, root)
        mine = [blob if i == g.rank else np.empty(0, np.uint8) for i in range(g.size)]  # a failing rank's own error
        _failures(g, "gather_object", "obj", sizes, rows if rows is not None else mine)
        if rows is not None:
            object_gather_list[:] = [_load(g, "gather_object", rows[i][:sizes[i]], i) for i in range(g.size)]


def scatter_object_list(scatter_object_output_list: list[Any], scatter_object_input_list: list[Any] | None = None,
                        src: int | None = None, group: ProcessGroup | None = None,
                        group_src: int | None = None) -> None:
    """``src`` sends ``scatter_object_input_list[r]`` to rank r's ``scatter_object_output_list[0]``.

    Pickled on authenticated groups, else plain data (see the module docstring).
    """
    g = resolve_group(group)
    root = _group_rank(g, "scatter_object_list", "src", src, group_src)
    _check_list(g, "scatter_object_list", "scatter_object_output_list", scatter_object_output_list)
    if not scatter_object_output_list:
        raise DistValueError(f"{where('scatter_object_list', g)}: scatter_object_output_list needs at least "
                             "one slot to receive into")
    g = _host_side(g)
    with _Refusing(g):
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
                pickles = _authenticated(g)
                dumped = [_dump(o, pickles) for o in scatter_object_input_list]
            bad = next(((b, n) for b, n in dumped if n < 0), None)
            if bad is not None:
                blobs, width[0] = [bad[0]], bad[1]  # a negative width: the error message follows
            else:
                blobs = [b for b, _ in dumped]
                width[0] = max(b.size for b in blobs) + 8
        g.broadcast(width, root)
        w = int(width[0])
        _bounded(g, "scatter_object_list", [w], [root])
        if w < 0:
            message = blobs[0] if blobs is not None else np.empty(-w, np.uint8)
            g.broadcast(message, root)
            if g.rank == root and error is not None:
                raise error
            text = bytes(message).decode(errors="replace")
            raise ObjectCollectiveError(f"{where('scatter_object_list', g)}: the source, rank {g.ranks[root]}, could "
                                        f"not send scatter_object_input_list ({text}); every rank raises")
        mine = np.empty(w, np.uint8)
        rows = None
        if blobs is not None:
            # Each row: 8 bytes of length, then the object's bytes, padded to the widest.
            rows = [_padded(np.concatenate([np.array([b.size], np.int64).view(np.uint8), b]), w) for b in blobs]
        g.scatter(mine, rows, root)
        n = int(mine[:8].view(np.int64)[0])
        if not 0 < n <= w - 8:
            raise ControlMessageError(f"{where('scatter_object_list', g)}: the source, rank {g.ranks[root]}, sent a "
                                      f"row of {w} bytes that says it holds {n}")
        scatter_object_output_list[0] = _load(g, "scatter_object_list", mine[8:8 + n], root)
