"""TCPStore's wire protocol: length-prefixed frames of length-prefixed fields, and their limits.

A frame is a 4-byte big-endian length ``N`` followed by ``N`` bytes. The server speaks first: a
greeting (:data:`GREETING`, the mode, a nonce), then, with the job's secret, the handshake of
:mod:`.auth`. A request's body is one opcode
byte and its fields; a reply's body is one status byte and its fields. A field is a 4-byte
big-endian length and that many bytes; integers and timeouts travel as ASCII decimals (``b"-3"``,
``b"0.25"``), so a counter is not bounded by a fixed-width integer. The server reads the length
first and refuses a frame longer than :data:`MAX_MESSAGE_BYTES` before allocating anything for it
(a stray connection claiming 4 GiB must not cost the master 4 GiB).
"""

from __future__ import annotations

import struct

__all__ = ["MAX_MESSAGE_BYTES", "MAX_VALUE_BYTES", "GREETING", "Op", "Status", "ProtocolError", "frame", "request",
           "reply", "fields_of", "HEADER"]

#: The longest frame either side accepts, header excluded. A store carries rendezvous data
#: (addresses, NCCL unique ids of 128 bytes, small pickled objects), not tensors: 64 MiB is far
#: above that and bounds what one connection can make the master allocate.
MAX_MESSAGE_BYTES = 64 << 20
#: The longest value any meshkit store accepts (every store, so code that runs on a HashStore runs on
#: a TCPStore): a ``compare_set`` carries two values and a key, which fit one frame with room.
MAX_VALUE_BYTES = 16 << 20

HEADER = struct.Struct("!I")
#: The first field of the server's greeting, the first frame of every connection (then the mode,
#: open or authenticating, and the server's nonce: comm/stores/auth.py). A client that reads
#: anything else has not reached a meshkit TCPStore of this protocol.
GREETING = b"meshkit-store 2"


class Op:
    """Request opcodes (one byte)."""
    JOIN = 1      # a TCPStore client announces itself: counted for wait_for_workers
    SET = 2       # key, value
    GET = 3       # timeout, key -> value, or MISSING at the deadline
    ADD = 4       # key, amount -> new value
    CAS = 5       # key, expected, desired -> value now held
    CHECK = 6     # keys... -> the keys missing now
    WAIT = 7      # timeout, keys... -> OK, or MISSING with the keys still missing at the deadline
    DELETE = 8    # key -> b"1" or b"0"
    COUNT = 9     # prefix -> number of user keys starting with it
    AUTH = 10     # client nonce, client proof -> server proof (comm/stores/auth.py)
    MULTI_GET = 11   # timeout, keys... -> their values, or MISSING with the keys unset at the deadline
    MULTI_SET = 12   # key, value, key, value... (applied together)
    APPEND = 13      # key, value -> OK, or TOO_LONG with the length held
    QUEUE_PUSH = 14  # key, value
    QUEUE_POP = 15   # timeout, key -> the oldest value, or MISSING at the deadline (0: at once)
    QUEUE_LEN = 16   # key -> the queue's length
    LIST_KEYS = 17   # prefix -> the user keys starting with it, sorted

    NAMES = {JOIN: "join", SET: "set", GET: "get", ADD: "add", CAS: "compare_set", CHECK: "check", WAIT: "wait",
             DELETE: "delete_key", COUNT: "num_keys", AUTH: "authenticate", MULTI_GET: "multi_get",
             MULTI_SET: "multi_set", APPEND: "append", QUEUE_PUSH: "queue_push", QUEUE_POP: "queue_pop",
             QUEUE_LEN: "queue_len", LIST_KEYS: "list_keys"}


class Status:
    """Reply status (one byte)."""
    OK = 0
    MISSING = 1       # the deadline passed; fields are the missing keys
    NOT_AN_INTEGER = 2  # add on a value that is not a decimal integer; the field is (the start of) that value
    ERROR = 3         # the request was malformed or refused (too long); the server closes the connection
    TOO_LONG = 4      # append would pass MAX_VALUE_BYTES; the field is the length the key holds


class ProtocolError(ValueError):
    """A frame or field that does not follow the protocol."""


def frame(body: bytes) -> bytes:
    """``body`` with its length header."""
    return HEADER.pack(len(body)) + body


def _pack(code: int, fields: tuple[bytes, ...]) -> bytes:
    """A frame, header included, joined once."""
    pieces, size = [bytes((code,))], 1
    for f in fields:
        pieces.append(HEADER.pack(len(f)))
        pieces.append(f)
        size += HEADER.size + len(f)
    return b"".join([HEADER.pack(size), *pieces])


def request(op: int, *fields: bytes) -> bytes:
    """A request frame, header included."""
    return _pack(op, fields)


def reply(status: int, *fields: bytes) -> bytes:
    """A reply frame, header included."""
    return _pack(status, fields)


def fields_of(body: bytes | bytearray | memoryview) -> tuple[int, list[bytes]]:
    """``(code, fields)`` of a frame's body (without its header); each field a ``bytes`` of its own."""
    if not len(body):
        raise ProtocolError("an empty frame (no opcode)")
    copy = not isinstance(body, bytes)  # a view's slices are views: each field is copied out once
    out, pos, end = [], 1, len(body)
    while pos < end:
        if pos + 4 > end:
            raise ProtocolError(f"a field header cut at byte {pos} of {end}")
        (n,) = HEADER.unpack_from(body, pos)
        pos += 4
        if pos + n > end:
            raise ProtocolError(f"a field of {n} bytes at byte {pos} runs past the frame's {end}")
        out.append(bytes(body[pos:pos + n]) if copy else body[pos:pos + n])
        pos += n
    return body[0], out
