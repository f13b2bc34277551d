"""TCPStore's authentication: a mutual challenge-response on the job's secret, then a MAC on every frame.

Who may use a job's store: its own ranks and its user (docs/security.md). Both sides of a
connection prove they know the job's secret ``S`` without sending it (a squatter on the port, or a
client without ``S``, learns nothing it could reuse):

1. the server speaks first: ``greeting(mode, Ns)``, a fresh 32-byte nonce (``mode`` says whether
   it authenticates at all: a store made with no secret is open, as torch's);
2. the client answers ``AUTH(Nc, HMAC(K, "client" | Ns | Nc))`` with its own nonce;
3. the server checks it and answers ``HMAC(K, "server" | Ns | Nc)``, which the client checks.

``K`` is derived from ``S`` (so the secret never keys anything directly) and the proofs carry
distinct labels, so neither side's proof can be reflected to the other. From there on, every
frame's body ends with a 16-byte keyed BLAKE2b tag over a per-direction counter and the body
(:class:`Session`), under a key of this connection alone: an injected, altered, replayed or
reordered frame is refused and the connection closed. Not encrypted: the values travel in clear
(rendezvous data, not tensors); on networks others can read, see docs/security.md.

Why a MAC on every frame rather than only a handshake per connection: object collectives over a
store unpickle what their peers wrote, which is safe only if no one but the job can write a frame,
on-path attackers included. The MAC is keyed BLAKE2b for frames up to :data:`SMALL_FRAME` bytes
and HMAC-SHA256 above (measured here: 1.3 us against 2.1 us for a 60-byte frame, 1.44 ms against
0.79 ms for 1 MiB, where SHA-256 runs on the CPU's SHA instructions); benchmarks/stores.py
measures what they cost a round trip, side by side with the store without them.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

__all__ = ["MODE_OPEN", "MODE_AUTH", "NONCE_BYTES", "TAG_BYTES", "SMALL_FRAME", "PRE_AUTH_MAX_BYTES", "AuthError",
           "store_key", "client_proof", "server_proof", "Session"]

MODE_OPEN, MODE_AUTH = b"open", b"mac-blake2b-sha256"
#: Frames up to this many bytes are tagged with keyed BLAKE2b, longer ones with HMAC-SHA256 (the
#: faster of the two at each size on this project's machines, module docstring).
SMALL_FRAME = 8192
NONCE_BYTES = 32
TAG_BYTES = 16
#: The longest frame a server reads from a connection that has not authenticated: the handshake's
#: frames are under 100 bytes, so an outsider can make the server allocate at most this.
PRE_AUTH_MAX_BYTES = 1024


_HEADER = struct.Struct("!I")  # the frame header of wire.py (which imports nothing of this module)


class AuthError(ValueError):
    """A proof or a frame's tag did not check out."""


def store_key(secret: bytes) -> bytes:
    """The key TCPStore derives from the job's secret (never the secret itself)."""
    return hmac.digest(secret, b"meshkit TCPStore key v1", "sha256")


def nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def client_proof(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.digest(key, b"client" + server_nonce + client_nonce, "sha256")


def server_proof(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.digest(key, b"server" + server_nonce + client_nonce, "sha256")


class Session:
    """The MACs of one authenticated connection: ``seal`` what this side sends, ``open`` what it
    receives. Each direction has its own key and counter, so a frame cannot be replayed, reordered
    or sent back the other way."""

    __slots__ = ("_send", "_recv", "_sent", "_received")

    def __init__(self, key: bytes, server_nonce: bytes, client_nonce: bytes, *, server: bool) -> None:
        nonces = server_nonce + client_nonce
        keys = {}
        for direction in (b"to server", b"to client"):
            small = hmac.digest(key, direction + b" blake2b" + nonces, "sha256")
            large = hmac.new(hmac.digest(key, direction + b" sha256" + nonces, "sha256"), digestmod=hashlib.sha256)
            keys[direction] = (small, large)
        self._send, self._recv = ((keys[b"to client"], keys[b"to server"]) if server
                                  else (keys[b"to server"], keys[b"to client"]))
        self._sent = self._received = 0

    @staticmethod
    def _tag(keys: tuple[bytes, hmac.HMAC], counter: int, pieces: list, size: int) -> bytes:
        if size <= SMALL_FRAME:
            h = hashlib.blake2b(key=keys[0], digest_size=TAG_BYTES, salt=counter.to_bytes(16, "big"))
        else:
            h = keys[1].copy()
            h.update(counter.to_bytes(8, "big"))
        for piece in pieces:
            h.update(piece)
        return h.digest()[:TAG_BYTES]

    def frame(self, pieces: list[bytes], size: int) -> bytes:
        """The frame of a body given as ``pieces`` (:func:`.wire.parts`), header and tag included:
        one join, no copy of the body before it."""
        tag = self._tag(self._send, self._sent, pieces, size)
        self._sent += 1
        return b"".join([_HEADER.pack(size + TAG_BYTES), *pieces, tag])

    def seal(self, body: bytes) -> bytes:
        """``body`` with its tag appended."""
        tag = self._tag(self._send, self._sent, [body], len(body))
        self._sent += 1
        return body + tag

    def open(self, sealed: bytes | bytearray | memoryview) -> memoryview:
        """The body of a sealed frame (a view, not a copy); AuthError where its tag is not this
        connection's next one."""
        if len(sealed) < TAG_BYTES:
            raise AuthError(f"a frame of {len(sealed)} bytes is shorter than its {TAG_BYTES}-byte tag")
        view = memoryview(sealed)
        body = view[:-TAG_BYTES]
        if not hmac.compare_digest(self._tag(self._recv, self._received, [body], len(body)), view[-TAG_BYTES:]):
            raise AuthError("a frame's tag does not check out (altered, injected, replayed or reordered)")
        self._received += 1
        return body
