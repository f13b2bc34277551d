"""TCPStore's authentication: a mutual challenge-response on the job's secret, once per connection.

Who may use a job's store: its own ranks and its user (docs/security.md). Both sides of a
connection prove they know the job's secret ``S`` without sending it (a squatter on the port, or a
client without ``S``, learns nothing it could reuse):

1. the server speaks first: ``greeting(mode, Ns)``, a fresh 32-byte nonce (``mode`` says whether
   it authenticates at all: a store made with no secret is open, as torch's);
2. the client answers ``AUTH(Nc, HMAC(K, "client" | Ns | Nc))`` with its own nonce;
3. the server checks it and answers ``HMAC(K, "server" | Ns | Nc)``, which the client checks.

``K`` is derived from ``S`` (so the secret never keys anything directly) and the proofs carry
distinct labels, so neither side's proof can be reflected to the other. Until a connection has
authenticated, the server reads nothing from it but the handshake (at most
:data:`PRE_AUTH_MAX_BYTES`), and a client reads nothing from a server that has not proved itself.
Not encrypted: values travel in clear (rendezvous data, not tensors).

Why per connection and not a MAC on every frame: what a per-frame MAC adds is protection from an
attacker on the network path who injects into an established TCP connection. No local user can
(a connection on loopback is the kernel's; injecting needs root), and one on the network path
can already read and inject MPI's traffic between hosts, which authenticates nothing: multi-host
jobs need a network only the job's hosts reach either way (docs/security.md). A keyed BLAKE2b tag on
every frame made the store engine's barrier and exchange markedly slower (benchmarks/stores.py
measures it), far more than the tag costs in a tight loop; the handshake costs one round trip
per connection, and clients keep their connections in a pool.
"""

from __future__ import annotations

import hmac
import os

__all__ = ["MODE_OPEN", "MODE_AUTH", "NONCE_BYTES", "PRE_AUTH_MAX_BYTES", "store_key", "nonce", "client_proof",
           "server_proof"]

MODE_OPEN, MODE_AUTH = b"open", b"hmac-sha256"
NONCE_BYTES = 32
#: The longest frame a server reads from a connection that has not authenticated: the handshake's
#: frames are under 100 bytes, so an outsider can make the server allocate at most this.
PRE_AUTH_MAX_BYTES = 1024


def store_key(secret: bytes) -> bytes:
    """The key TCPStore derives from the job's secret (never the secret itself)."""
    return hmac.digest(secret, b"meshkit TCPStore key v1", "sha256")


def nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def client_proof(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.digest(key, b"client" + server_nonce + client_nonce, "sha256")


def server_proof(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.digest(key, b"server" + server_nonce + client_nonce, "sha256")
