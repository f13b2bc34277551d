"""The bounds of a TCPStore server: what one server may hold, for how many, for how long.

Each bound has a default, a ``MESHKIT_STORE_*`` variable to change it (read by :mod:`meshkit.comm.env`,
checked when the server starts), and a clear error naming the variable when a client meets it
(docs/security.md lists them):

=================================  =========  ======================================================
variable                           default    what it bounds
=================================  =========  ======================================================
``MESHKIT_STORE_MAX_BYTES``        1 GiB      the values held, the requests being received and the
                                              replies not yet read, together
``MESHKIT_STORE_MAX_CONNECTIONS``  4096       open connections (also at most the process's open-file
                                              limit less 64)
``MESHKIT_STORE_IDLE_TIMEOUT``     300 s      a connection with nothing in progress and no traffic
                                              (a client reconnects on its own)
``MESHKIT_STORE_HANDSHAKE_TIMEOUT`` 30 s      a connection that has not authenticated
``MESHKIT_STORE_MAX_WAIT_KEYS``    65536      the keys one ``wait``/``check`` may name
=================================  =========  ======================================================
"""

from __future__ import annotations

import dataclasses
import resource

from .. import env

__all__ = ["ServerLimits", "MAX_BYTES", "MAX_CONNECTIONS", "IDLE_TIMEOUT", "HANDSHAKE_TIMEOUT", "MAX_WAIT_KEYS"]

MAX_BYTES, MAX_CONNECTIONS, IDLE_TIMEOUT = env.STORE_MAX_BYTES, env.STORE_MAX_CONNECTIONS, env.STORE_IDLE_TIMEOUT
HANDSHAKE_TIMEOUT, MAX_WAIT_KEYS = env.STORE_HANDSHAKE_TIMEOUT, env.STORE_MAX_WAIT_KEYS

#: Descriptors kept free for the rest of the master process when the connections are capped by
#: its open-file limit.
_SPARE_FDS = 64


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """The bounds of one server (module docstring). A rendezvous of 16384 ranks holds about 2 MB
    of keys and keeps one connection per rank open, well inside the defaults."""

    #: 1 GiB: a store carries rendezvous data, the largest legitimate load being object
    #: collectives over a store-bootstrapped world (values up to 16 MiB each).
    max_bytes: int = 1 << 30
    #: 4096 connections: one per rank and thread of a large job; capped by the open-file limit.
    max_connections: int = 4096
    #: 300 s: a pooled connection idle this long is closed; the client reconnects (a new
    #: connection and handshake, about a millisecond) the next time it needs one.
    idle_timeout: float = 300.0
    #: 30 s for the handshake's one round trip, a margin for a loaded master.
    handshake_timeout: float = 30.0
    #: 65536 keys: the store engine's barriers and exchanges wait for one key per rank.
    max_wait_keys: int = 65536

    @classmethod
    def from_env(cls) -> "ServerLimits":
        """The defaults, each replaced by its variable where set (a bad value raises naming it)."""
        d = cls()
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        connections = env.positive_number(MAX_CONNECTIONS, d.max_connections, integer=True)
        if soft != resource.RLIM_INFINITY:
            connections = max(1, min(connections, soft - _SPARE_FDS))
        return cls(max_bytes=env.positive_number(MAX_BYTES, d.max_bytes, integer=True),
                   max_connections=connections,
                   idle_timeout=env.positive_number(IDLE_TIMEOUT, d.idle_timeout, upper=env.MAX_TIMEOUT_S),
                   handshake_timeout=env.positive_number(HANDSHAKE_TIMEOUT, d.handshake_timeout,
                                                         upper=env.MAX_TIMEOUT_S),
                   max_wait_keys=env.positive_number(MAX_WAIT_KEYS, d.max_wait_keys, integer=True))
