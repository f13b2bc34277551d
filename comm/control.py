"""Control messages: the fixed, typed wire format of what meshkit's ranks tell each other.

Notices, exchanges (detail mode's ``(seq, Call)``, levels, verdicts, splits, a GPU's UUID, NCCL's
unique id) and their answers cross a transport that may not authenticate its peers: a
rendezvous store that an outsider can write (a TCPStore on a known port, a file:// file), or
MPI. Unpickling such bytes runs whatever code their writer chose, so control messages never
travel as pickles: :func:`encode` writes, and :func:`decode` reads back, exactly these values:

* ``None``, ``bool``, ``int`` (any size), ``float``, ``str``, ``bytes``, ``bytearray``;
* ``list``, ``tuple``, ``dict`` (keys: any of these that is hashable), nested up to
  :func:`max_depth` levels (``MESHKIT_CONTROL_MAX_DEPTH``, default 100);
* NumPy arrays and scalars of a plain dtype: bool, signed and unsigned integers, floats and
  complex numbers (either byte order); never object, string, datetime or structured dtypes;
* the records that travel: :class:`~meshkit.comm.notices.Notice`, :class:`~meshkit.comm.debug.Call`
  and ``set_debug_level``'s switch, each by a fixed tag, rebuilt field by field with each
  field's type checked.

Exact types only: a subclass (an ``IntEnum``, a ``namedtuple``, an ``OrderedDict``) would come
back as its base class, so it is refused rather than changed. What the format cannot carry is a
:class:`~meshkit.comm.errors.DistTypeError` naming its type (for a control message, a bug in
meshkit; object collectives turn it into their every-rank error, comm/objects.py).

Reading is bounded by the input: every length and count is checked against the bytes that
remain before anything is allocated (so a small message never asks for a large allocation),
nothing refers back to an earlier value (no recursion bombs), nesting is bounded, and an array
or a big integer takes no more memory than its bytes in the message. Anything malformed (a
wrong tag, a length past the end, bytes left over, invalid UTF-8, a record field of the wrong
type, a pickle) raises :class:`ControlMessageError` naming the channel (``what``) and the
fault, and nothing else.

Wire: one format byte (:data:`FORMAT`), then one value; each value is a tag byte and its body,
little-endian, lengths and counts as 4 bytes (a value larger than 4 GiB is refused)::

    N T F                 None, True, False
    i <q>                 an int in 64 bits        I <len> <bytes>   any other int (two's complement)
    f <d>                 a float                  s <len> <utf-8>   str (lone surrogates kept)
    b <len> <bytes>       bytes                    B <len> <bytes>   bytearray
    l/t <count> values    list / tuple             d <count> (key value)*   dict
    v/u <count> <q each>  a list / tuple of ints that all fit in 64 bits (ranks, shapes, counts)
    a <dtype> <ndim> <shape: q each> <nbytes: Q> <bytes>   an ndarray, C order
    g <dtype> <bytes>     a NumPy scalar           R <record> <len> values   a record's fields, in order

Speed (``python -c "from meshkit.comm import control; control.timings()"`` measures it):
``(seq, Call)``, detail mode's exchange entry at every collective, encodes and decodes faster
than pickle (each distinct Call is encoded and decoded once, then served from a cache); a Notice,
sent only when a rank fails, rejects a call or leaves, and tiny messages (a monitored barrier's
``(seq, None)``) are slower than pickle, which matters little off the hot path.
"""

from __future__ import annotations

import functools
import operator
import struct
import sys
from typing import Any, Callable

import numpy as np

from . import env
from .debug import Call, DebugLevel
from .errors import DistBackendError, DistTypeError
from .level_state import Switch
from .notices import BROKEN, LEFT, REJECTED, Notice

__all__ = ["encode", "decode", "decode_notice", "join", "ControlMessageError", "FORMAT", "MAX_DEPTH_ENV", "max_depth",
           "timings"]

#: The first byte of every control message: the format's version (a pickle starts with 0x80).
FORMAT = 0xC1
_HEADER = bytes([FORMAT])

#: The variable that bounds how deeply values nest (lists in dicts in tuples ...): comm/env.py.
MAX_DEPTH_ENV = env.CONTROL_MAX_DEPTH


class ControlMessageError(DistBackendError):
    """Bytes that should be a control message are not one meshkit wrote (malformed, truncated,
    of another format, or a record with a field of the wrong type)."""


class _Malformed(Exception):
    """Inside decoding: what was wrong (decode adds where and which channel)."""


@functools.cache
def max_depth() -> int:
    """``MESHKIT_CONTROL_MAX_DEPTH`` (:func:`meshkit.comm.env.control_max_depth`): how deeply control
    messages and the objects of object collectives on unauthenticated groups may nest. Read once."""
    return env.control_max_depth()


# --------------------------------------------------------------------------- dtypes
def _plain_dtypes() -> tuple[np.dtype, ...]:
    """Every dtype an array may have on the wire: bool, integers, floats, complex, both byte orders."""
    seen: dict[str, np.dtype] = {}
    for char in "?bBhHiIlLqQefdgFDG":
        for order in "<>":
            dtype = np.dtype(char).newbyteorder(order)
            seen.setdefault(dtype.str, dtype)
    return tuple(seen.values())


#: The allowed dtypes, by their one-byte code on the wire (the index here); no other dtype is ever
#: rebuilt from a message (no string is parsed into a dtype).
_DTYPES = _plain_dtypes()
_DTYPE_CODE = {d.str: i for i, d in enumerate(_DTYPES)}
#: NumPy's scalar types of those dtypes (a scalar's dtype is native order).
_SCALARS = frozenset(d.type for d in _DTYPES)
#: The most dimensions an array has (NumPy 2's NPY_MAXDIMS).
_MAX_NDIM = 64


# --------------------------------------------------------------------------- records
def _ints(v: Any) -> bool:
    if type(v) is not tuple:
        return False
    for x in v:  # a loop, not all() over a generator: 3x faster for the few items of a rank tuple
        if type(x) is not int:
            return False
    return True


def _opt_ints(v: Any) -> bool:
    return v is None or _ints(v)


def _opt(kind: type) -> Callable[[Any], bool]:
    return lambda v: v is None or type(v) is kind


def _is(kind: type) -> Callable[[Any], bool]:
    return lambda v: type(v) is kind


def _group_counts(v: Any) -> bool:
    """``((ranks, count), ...)``: a Notice's and a switch's calls issued per group."""
    if type(v) is not tuple:
        return False
    for p in v:
        if type(p) is not tuple or len(p) != 2 or type(p[1]) is not int or not _ints(p[0]):
            return False
    return True


def _call_counts(v: Any) -> bool:
    """None or ``(send counts, receive counts)``: all_to_all's per-peer counts."""
    return v is None or (type(v) is tuple and len(v) == 2 and _ints(v[0]) and _ints(v[1]))


def _notice_kind(v: Any) -> bool:
    return type(v) is str and v in (REJECTED, BROKEN, LEFT)


def _level(v: Any) -> bool:
    return type(v) is int and v in DebugLevel._value2member_map_


class _Record:
    """One dataclass that travels: its tag, its fields' checks, and how it is made from and into fields.

    ``cached``: its values repeat (detail mode sends the same few Calls at every collective), so each
    distinct one is encoded and decoded once: an object is frozen, so one decoded object can serve
    every message with the same bytes.
    """

    __slots__ = ("tag", "cls", "names", "checks", "fields", "make", "cached")

    def __init__(self, tag: int, cls: type, checks: dict[str, Callable[[Any], bool]], *,
                 fields: Callable[[Any], tuple] | None = None, make: Callable[..., Any] | None = None,
                 cached: bool = False) -> None:
        self.tag, self.cls, self.names, self.checks = tag, cls, tuple(checks), tuple(checks.values())
        # Plain fields by default; the switch's level travels as an int and becomes a DebugLevel again.
        self.fields = fields or operator.attrgetter(*self.names)
        self.make = make or cls
        self.cached = cached


_RECORDS = (
    _Record(1, Notice, {"kind": _notice_kind, "sender": _is(int), "group": _opt_ints, "seq": _is(int),
                        "detail": _is(str), "counts": _group_counts, "timed_out": _is(bool),
                        "failed": _ints}),
    _Record(2, Call, {"op": _is(str), "dtype": _opt(str), "shape": _opt_ints, "reduce_op": _opt(str),
                      "root": _opt(int), "counts": _call_counts}, cached=True),
    _Record(3, Switch, {"level": _level, "counts": _group_counts},
            fields=lambda s: (int(s.level), s.counts), make=lambda level, counts: Switch(DebugLevel(level), counts)),
)
_RECORD_OF_TYPE = {r.cls: r for r in _RECORDS}
_RECORD_OF_TAG = {r.tag: r for r in _RECORDS}
#: Distinct records of a cached kind kept, each way (emptied when full): a job's distinct calls
#: are its distinct collectives (shape, dtype, op, root), tens to hundreds, as debug.fingerprint's cache.
_CACHE_SIZE = 1024
_ENCODED: dict[int, tuple[Any, bytes]] = {}  # id(record) -> (record, its encoding)
_DECODED: dict[bytes, Any] = {}  # a record's encoding -> the record


# --------------------------------------------------------------------------- encoding
_TAG_INT = struct.Struct("<cq").pack
_TAG_FLOAT = struct.Struct("<cd").pack
_TAG_LEN = struct.Struct("<cI").pack
_TAG_RECORD = struct.Struct("<cBI").pack
_ARRAY_HEAD = struct.Struct("<cBB").pack
_NBYTES = struct.Struct("<Q").pack
_SCALAR_HEAD = struct.Struct("<cB").pack
#: Packers of 0..32 ints (the sizes of rank tuples and shapes), made once.
_PACK_INTS = tuple(struct.Struct(f"<{n}q").pack for n in range(33))
_JUST_INT = {int}
_I64 = 1 << 63
_U32 = 1 << 32
_STR, _BYTES, _BYTEARRAY, _LIST, _TUPLE, _DICT, _INTS_TUPLE, _INTS_LIST = b"s", b"b", b"B", b"l", b"t", b"d", b"u", b"v"
_NONE, _TRUE, _FALSE = b"N", b"T", b"F"


class _Uncarried(Exception):
    """Inside encoding: a value the format has no place for (encode names it)."""


def encode(obj: Any) -> bytes:
    """``obj`` as a control message.

    Raises:
        DistTypeError: ``obj`` holds a value the format cannot carry (named by its type and where
            it is), nests deeper than :func:`max_depth`, or has a length over 4 GiB.
    """
    out = [_HEADER]
    try:
        _put(out, obj, max_depth())
    except _Uncarried as exc:
        raise DistTypeError(f"meshkit.comm: a control message cannot carry {exc}") from None
    except RecursionError:
        raise DistTypeError("meshkit.comm: a control message cannot carry a value this deeply nested (a cycle?)") \
            from None
    return b"".join(out)


def _length(n: int, what: str) -> int:
    if n >= _U32:
        raise _Uncarried(f"{what} {n} (over 4 GiB)")
    return n


def _put(out: list, obj: Any, depth: int) -> None:
    """Append ``obj``'s encoding to ``out``: the common types first, by exact type."""
    t = type(obj)
    if t is int:
        out.append(_TAG_INT(b"i", obj) if -_I64 <= obj < _I64 else _big(obj))
    elif t is str:
        data = obj.encode("utf-8", "surrogatepass")
        if len(data) >= _U32:
            _length(len(data), "a str of length")
        out.append(_TAG_LEN(_STR, len(data)))
        out.append(data)
    elif obj is None:
        out.append(_NONE)
    elif t is tuple or t is list:
        if depth <= 0:
            raise _Uncarried(f"a value nested deeper than {max_depth()} levels ({MAX_DEPTH_ENV})")
        n = len(obj)
        if n >= _U32:
            _length(n, f"a {t.__name__} of length")
        # ranks, shapes, counts, NCCL's id: one struct call (the ends are looked at first: cheaper
        # than a generator over a tuple that holds other things, such as (seq, Call))
        if n and type(obj[0]) is int and type(obj[-1]) is int and {*map(type, obj)} == _JUST_INT:
            try:
                pack = _PACK_INTS[n] if n < len(_PACK_INTS) else struct.Struct(f"<{n}q").pack
                out.append(_TAG_LEN(_INTS_TUPLE if t is tuple else _INTS_LIST, n))
                out.append(pack(*obj))
                return
            except struct.error:  # an int over 64 bits: item by item
                out.pop()
        out.append(_TAG_LEN(_TUPLE if t is tuple else _LIST, n))
        for x in obj:  # None and small ints inline: a call per item is most of a small message's cost
            if x is None:
                out.append(_NONE)
            elif type(x) is int and -_I64 <= x < _I64:
                out.append(_TAG_INT(b"i", x))
            else:
                _put(out, x, depth - 1)
    elif t is bool:
        out.append(_TRUE if obj else _FALSE)
    elif t in _RECORD_OF_TYPE:
        hit = _ENCODED.get(id(obj))
        out.append(hit[1] if hit is not None and hit[0] is obj else _put_record(obj, _RECORD_OF_TYPE[t], depth))
    elif t is float:
        out.append(_TAG_FLOAT(b"f", obj))
    elif t is dict:
        if depth <= 0:
            raise _Uncarried(f"a value nested deeper than {max_depth()} levels ({MAX_DEPTH_ENV})")
        out.append(_TAG_LEN(_DICT, _length(len(obj), "a dict of length")))
        for k, v in obj.items():
            _put(out, k, depth - 1)
            _put(out, v, depth - 1)
    elif t is bytes or t is bytearray:
        out.append(_TAG_LEN(_BYTES if t is bytes else _BYTEARRAY, _length(len(obj), f"{t.__name__} of length")))
        out.append(obj)
    elif t is np.ndarray:
        _put_array(out, obj)
    elif t in _SCALARS:
        code = _DTYPE_CODE.get(obj.dtype.str)
        if code is None:
            raise _Uncarried(f"a NumPy scalar of dtype {obj.dtype}")
        out.append(_SCALAR_HEAD(b"g", code))
        out.append(obj.tobytes())
    else:
        raise _Uncarried(_named(obj))


def _put_record(obj: Any, record: _Record, depth: int) -> bytes:
    """A record's encoding: its tag, the length of its fields' bytes, the fields."""
    fields: list = []
    for x in record.fields(obj):
        _put(fields, x, depth - 1)
    body = b"".join(fields)
    data = _TAG_RECORD(b"R", record.tag, _length(len(body), "a record of byte length")) + body
    if record.cached:
        if len(_ENCODED) >= _CACHE_SIZE:
            _ENCODED.clear()
        _ENCODED[id(obj)] = (obj, data)  # the object is kept: its id is not reused while it is here
    return data


def _big(n: int) -> bytes:
    data = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return _TAG_LEN(b"I", _length(len(data), "an int of byte length")) + data


def _put_array(out: list, a: np.ndarray) -> None:
    code = _DTYPE_CODE.get(a.dtype.str)
    if code is None or a.dtype.fields is not None or a.dtype.subdtype is not None:
        raise _Uncarried(f"a NumPy array of dtype {a.dtype} (only bool, integer, float and complex dtypes travel)")
    flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    out.append(_ARRAY_HEAD(b"a", code, a.ndim))
    out.append(struct.pack(f"<{a.ndim}q", *a.shape))
    out.append(_NBYTES(flat.size))
    out.append(flat)


def _named(obj: Any) -> str:
    t = type(obj)
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    base = next((b.__name__ for b in (bool, int, float, str, bytes, tuple, list, dict) if isinstance(obj, b)), None)
    why = (f" (a subclass of {base}: it would come back as a plain {base}, so it is refused)" if base else
           " (it carries None, bool, int, float, str, bytes, list, tuple, dict, NumPy arrays and scalars of plain "
           "dtypes, and meshkit's own notices and calls)")
    return f"a value of type {name}{why}"


# --------------------------------------------------------------------------- decoding
_INT = struct.Struct("<q").unpack_from
_FLOAT = struct.Struct("<d").unpack_from
_LEN = struct.Struct("<I").unpack_from
_U64 = struct.Struct("<Q").unpack_from
_UNPACK_INTS = tuple(struct.Struct(f"<{n}q").unpack_from for n in range(33))
# Tags as the ints that indexing bytes gives.
_T_INT, _T_STR, _T_NONE, _T_TUPLE, _T_LIST, _T_TRUE, _T_FALSE, _T_RECORD, _T_FLOAT, _T_DICT, _T_BYTES, \
    _T_BYTEARRAY, _T_BIG, _T_ARRAY, _T_SCALAR, _T_INTS_TUPLE, _T_INTS_LIST = b"isNtlTFRfdbBIaguv"


def decode(data: bytes | bytearray | memoryview, *, what: str) -> Any:
    """The value of control message ``data``.

    Args:
        data: the message.
        what: the channel, key or sender it came from, for the error (``"notice 3 to rank 1 (store
            key n/1/3)"``).

    Raises:
        ControlMessageError: ``data`` is not a control message: naming ``what`` and the fault.
    """
    if type(data) is memoryview:
        data = data.tobytes()
    elif type(data) is not bytes and type(data) is not bytearray:
        raise ControlMessageError(f"meshkit.comm: {what}: expected the bytes of a control message, got "
                                  f"{type(data).__name__}")
    size = len(data)
    try:
        if not size or data[0] != FORMAT:
            raise _Malformed("it is empty" if not size else
                             "it is a pickle, which control messages never are (refused, not unpickled)"
                             if data[0] == 0x80 else f"its first byte is {data[0]:#04x}, not meshkit's format "
                             f"byte {FORMAT:#04x}")
        value, pos = _get(data, 1, max_depth())
        if pos != size:
            raise _Malformed(f"{size - pos} bytes follow the value")
        return value
    except _Malformed as exc:
        reason = str(exc)
    except RecursionError:
        reason = "it nests too deeply for this thread's stack"
    except (struct.error, IndexError):
        reason = "it ends in the middle of a value (truncated)"
    except (UnicodeDecodeError, ValueError, TypeError, OverflowError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
    raise ControlMessageError(f"meshkit.comm: {what}: not a control message meshkit wrote ({size} bytes): {reason}")


def join(messages: list[bytes]) -> bytes:
    """The message of a list whose items are the values of ``messages`` (each made by
    :func:`encode`, and read back by :func:`decode` already), without decoding and encoding
    them again: an exchange's answer is every member's payload, as they sent it."""
    if len(messages) >= _U32:
        raise DistTypeError(f"meshkit.comm: a control message cannot carry a list of length {len(messages)} (over "
                            "4 GiB)")
    parts = [_HEADER, _TAG_LEN(_LIST, len(messages))]
    for message in messages:
        if message[:1] != _HEADER:
            raise DistTypeError("meshkit.comm: control.join: an item is not a control message")
        parts.append(memoryview(message)[1:])
    return b"".join(parts)


def decode_notice(data: bytes | bytearray | memoryview, *, what: str) -> Notice:
    """:func:`decode`, for a value that must be a :class:`~meshkit.comm.notices.Notice`."""
    notice = decode(data, what=what)
    if type(notice) is not Notice:
        raise ControlMessageError(f"meshkit.comm: {what}: a control message, but a {type(notice).__name__}, "
                                  "not a notice")
    return notice


def _count(data: Any, pos: int, unit: int, what: str) -> tuple[int, int]:
    """A length or count at ``pos`` and where its items start; each item takes at least ``unit``
    bytes, so a count the remaining bytes cannot hold is refused before anything is made."""
    n = _LEN(data, pos)[0]
    pos += 4
    if n * unit > len(data) - pos:
        raise _Malformed(f"{what} {n} at byte {pos - 5}, but only {len(data) - pos} bytes remain")
    return n, pos


def _get(data: Any, pos: int, depth: int) -> tuple[Any, int]:
    """The value at ``pos`` and the position after it."""
    tag = data[pos]
    pos += 1
    if tag == _T_INT:
        return _INT(data, pos)[0], pos + 8
    if tag == _T_STR:
        n = _LEN(data, pos)[0]
        end = pos + 4 + n
        if end > len(data):
            raise _Malformed(f"a str of length {n} at byte {pos - 1}, but only {len(data) - pos - 4} bytes remain")
        return data[pos + 4:end].decode("utf-8", "surrogatepass"), end
    if tag == _T_NONE:
        return None, pos
    if tag == _T_INTS_TUPLE or tag == _T_INTS_LIST:
        n, pos = _count(data, pos, 8, "a sequence of ints of length")
        ints = (_UNPACK_INTS[n] if n < len(_UNPACK_INTS) else struct.Struct(f"<{n}q").unpack_from)(data, pos)
        return (ints if tag == _T_INTS_TUPLE else list(ints)), pos + 8 * n
    if tag == _T_TUPLE or tag == _T_LIST:
        if depth <= 0:
            raise _Malformed(f"it nests deeper than {max_depth()} levels ({MAX_DEPTH_ENV})")
        n = _LEN(data, pos)[0]
        pos += 4
        if n > len(data) - pos:
            raise _Malformed(f"a list of length {n} at byte {pos - 5}, but only {len(data) - pos} bytes remain")
        items = []
        for _ in range(n):  # None and ints inline, as encode writes them
            item = data[pos]
            if item == _T_NONE:
                items.append(None)
                pos += 1
            elif item == _T_INT:
                items.append(_INT(data, pos + 1)[0])
                pos += 9
            else:
                x, pos = _get(data, pos, depth - 1)
                items.append(x)
        return (tuple(items) if tag == _T_TUPLE else items), pos
    if tag == _T_TRUE:
        return True, pos
    if tag == _T_FALSE:
        return False, pos
    if tag == _T_RECORD:
        return _get_record(data, pos, depth)
    if tag == _T_FLOAT:
        return _FLOAT(data, pos)[0], pos + 8
    if tag == _T_DICT:
        if depth <= 0:
            raise _Malformed(f"it nests deeper than {max_depth()} levels ({MAX_DEPTH_ENV})")
        n, pos = _count(data, pos, 2, "a dict of length")
        out = {}
        for _ in range(n):
            k, pos = _get(data, pos, depth - 1)
            v, pos = _get(data, pos, depth - 1)
            try:
                out[k] = v
            except TypeError:
                raise _Malformed(f"a dict key of type {type(k).__name__}, which is not hashable") from None
        return out, pos
    if tag == _T_BYTES or tag == _T_BYTEARRAY:
        n, pos = _count(data, pos, 1, "bytes of length")
        chunk = data[pos:pos + n]
        return (bytes(chunk) if tag == _T_BYTES else bytearray(chunk)), pos + n
    if tag == _T_BIG:
        n, pos = _count(data, pos, 1, "an int of byte length")
        return int.from_bytes(data[pos:pos + n], "little", signed=True), pos + n
    if tag == _T_ARRAY:
        return _get_array(data, pos)
    if tag == _T_SCALAR:
        dtype = _dtype(data[pos], pos)
        end = pos + 1 + dtype.itemsize
        if end > len(data):
            raise _Malformed(f"a NumPy {dtype} scalar at byte {pos - 1} runs past the end")
        return np.frombuffer(data, dtype, 1, pos + 1)[0], end
    raise _Malformed(f"unknown tag {tag:#04x} at byte {pos - 1}")


def _dtype(code: int, pos: int) -> np.dtype:
    if code >= len(_DTYPES):
        raise _Malformed(f"unknown dtype code {code} at byte {pos} (only bool, integer, float and complex "
                         "dtypes travel)")
    return _DTYPES[code]


def _get_array(data: Any, pos: int) -> tuple[np.ndarray, int]:
    start = pos - 1
    dtype, ndim = _dtype(data[pos], pos), data[pos + 1]
    pos += 2
    if ndim > _MAX_NDIM:
        raise _Malformed(f"an array of {ndim} dimensions at byte {start} (at most {_MAX_NDIM})")
    shape = struct.unpack_from(f"<{ndim}q", data, pos)
    pos += 8 * ndim
    nbytes = _U64(data, pos)[0]
    pos += 8
    if any(d < 0 for d in shape):
        raise _Malformed(f"an array of shape {shape} at byte {start}")
    count = 1
    for d in shape:
        count *= d
    if count * dtype.itemsize != nbytes:
        raise _Malformed(f"an array of shape {shape} and dtype {dtype} at byte {start} says it holds {nbytes} "
                         f"bytes, not {count * dtype.itemsize}")
    if nbytes > len(data) - pos:
        raise _Malformed(f"an array of {nbytes} bytes at byte {start}, but only {len(data) - pos} bytes remain")
    flat = np.frombuffer(data, dtype, count, pos) if count else np.empty(0, dtype)
    return flat.reshape(shape).copy(), pos + nbytes


def _get_record(data: Any, pos: int, depth: int) -> tuple[Any, int]:
    start = pos - 1
    if depth <= 0:
        raise _Malformed(f"it nests deeper than {max_depth()} levels ({MAX_DEPTH_ENV})")
    record = _RECORD_OF_TAG.get(data[pos])
    if record is None:
        raise _Malformed(f"unknown record tag {data[pos]} at byte {pos}")
    n, pos = _count(data, pos + 1, 1, "a record of byte length")
    end = pos + n
    if record.cached:
        span = bytes(data[start:end])
        hit = _DECODED.get(span)
        if hit is not None:
            return hit, end
    fields = []
    for name, check in zip(record.names, record.checks):
        value, pos = _get(data, pos, depth - 1)
        if pos > end:
            raise _Malformed(f"a {record.cls.__name__} at byte {start} says it holds {n} bytes, but its field "
                             f"{name} ends past them")
        if not check(value):
            raise _Malformed(f"a {record.cls.__name__} whose field {name} is {_short(value)} "
                             f"(type {type(value).__name__}), which it cannot be")
        fields.append(value)
    if pos != end:
        raise _Malformed(f"a {record.cls.__name__} at byte {start} says it holds {n} bytes, its fields take "
                         f"{n - (end - pos)}")
    obj = record.make(*fields)
    if record.cached:
        if len(_DECODED) >= _CACHE_SIZE:
            _DECODED.clear()
        _DECODED[span] = obj
    return obj, end


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def timings() -> None:  # pragma: no cover (the figures of the module docstring)
    """Print encode and decode times of detail mode's ``(seq, Call)`` and of a Notice, beside pickle's."""
    import pickle
    import timeit
    from .debug import fingerprint
    from .reduce_op import ReduceOp
    samples = {"(seq, Call)": (17, fingerprint("all_reduce", np.dtype(np.float32), (4,), ReduceOp.SUM, None, None)),
               "Notice": Notice(BROKEN, 1, (0, 1), 17, "RuntimeError: boom", (((0, 1), 18),), True)}
    def best(fn: Callable[[], Any]) -> float:  # the least of 5 runs: the machine is shared
        return min(timeit.repeat(fn, number=20000, repeat=5)) / 20000 * 1e6

    for name, obj in samples.items():
        wire, pickled = encode(obj), pickle.dumps(obj)
        ours = [best(lambda: encode(obj)), best(lambda: decode(wire, what="timing"))]
        theirs = [best(lambda: pickle.dumps(obj)), best(lambda: pickle.loads(pickled))]
        print(f"{name}: control {len(wire)} B, encode {ours[0]:.2f} us + decode {ours[1]:.2f} us = "
              f"{sum(ours):.2f} us; pickle {len(pickled)} B, {theirs[0]:.2f} + {theirs[1]:.2f} = {sum(theirs):.2f} us",
              file=sys.stdout)
