"""``TCPStore``: a store served over TCP by the master process, for processes on any machines."""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import numbers
import os
import socket
import struct
import threading
import time
from datetime import timedelta

from ..errors import DistStoreError, DistTypeError, DistValueError
from .. import env
from . import auth, wire
from .store import DEFAULT_TIMEOUT, NotAnInteger, Store, ValueTooLong
from .tcp_server import StoreServer

__all__ = ["TCPStore"]

#: How much longer than a ``get``/``wait``'s own timeout a client waits for the server's answer
#: (the server answers at the deadline; this covers a loaded master's delay, not a dead one's,
#: which a closed connection reports at once).
_REPLY_GRACE_S = 5.0
#: Connect retries back off from 10 ms to 250 ms: workers usually start before their master, and a
#: refused connect is cheap, so a worker notices its master within a quarter second.
_RETRY_FIRST_S, _RETRY_MAX_S = 0.01, 0.25
#: The shortest ``secret=`` accepted: 16 bytes (128 bits), the least a key should have.
_MIN_SECRET_BYTES = 16


class _Stale(ConnectionResetError):
    """A pooled connection the server had closed (idle) before this request reached it: retried."""


class _Connection:
    """One socket to the server, used by one request at a time.

    The socket is blocking with kernel timeouts (``SO_RCVTIMEO``/``SO_SNDTIMEO``, set only when the
    timeout changes) rather than Python's ``settimeout``, which polls before every send and receive:
    a request is then one ``send`` and usually one ``recv`` (128 clients x 1000 adds went from 6
    system calls a request to 2).
    """

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(None)
        self.sock = sock
        self._timeout = -1.0

    def _deadline(self, timeout: float) -> None:
        if timeout != self._timeout:
            seconds = max(timeout, 1e-3)
            tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            self._timeout = timeout

    def call(self, message: bytes, timeout: float) -> tuple[int, list[bytes]]:
        """Send a request frame and read its reply (``(status, fields)``)."""
        self._deadline(timeout)
        try:
            self.sock.sendall(message)
        except BrokenPipeError:
            raise _Stale("the server had closed the connection") from None
        except BlockingIOError:  # SO_SNDTIMEO expired
            raise TimeoutError(f"no answer within {timeout:g} s") from None
        return self._reply(timeout, True)

    def read(self, timeout: float) -> tuple[int, list[bytes]]:
        """The next frame from the server (the greeting)."""
        self._deadline(timeout)
        return self._reply(timeout, False)

    def _reply(self, timeout: float, first: bool) -> tuple[int, list[bytes]]:
        """The next frame. Usually one ``recv`` (a reply under 64 KiB arrives whole); a longer one
        is read into its own buffer. ``first``: EOF before any byte is a stale connection."""
        try:
            buf = self._recv(1 << 16, stale=first)
            while len(buf) < wire.HEADER.size:
                buf += self._recv(1 << 16)
            (n,) = wire.HEADER.unpack_from(buf, 0)
            if n > wire.MAX_MESSAGE_BYTES:
                raise wire.ProtocolError(f"the server announced a reply of {n} bytes, over the limit")
            end = wire.HEADER.size + n
            if len(buf) >= end:
                body: bytes | bytearray | memoryview = buf[wire.HEADER.size:end]
            else:
                body = bytearray(n)
                view = memoryview(body)
                have = len(buf) - wire.HEADER.size
                view[:have] = buf[wire.HEADER.size:]
                while have < n:
                    got = self.sock.recv_into(view[have:], n - have)
                    if not got:
                        raise ConnectionResetError("the server closed the connection")
                    have += got
        except BlockingIOError:  # SO_RCVTIMEO/SO_SNDTIMEO expired
            raise TimeoutError(f"no answer within {timeout:g} s") from None
        return wire.fields_of(body)

    def _recv(self, size: int, *, stale: bool = False) -> bytes:
        """What the socket has, up to ``size`` bytes: EOF at the first read of a reply means a stale
        connection (closed by the server while idle), later a connection lost mid-reply."""
        try:
            chunk = self.sock.recv(size)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            if stale:
                raise _Stale("the server closed the connection")
            raise ConnectionResetError("the server closed the connection")
        return chunk

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def _check_secret(secret: object) -> bytes | None:
    """The store's secret as bytes: ``secret=`` where given, else the job's (``MESHKIT_JOB_SECRET``)."""
    if secret is None:
        return env.job_secret()
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, (bytes, bytearray)):
        raise DistTypeError(f"TCPStore(secret): secret must be str or bytes (or None: the job's, "
                            f"{env.JOB_SECRET}), got {type(secret).__name__}")
    if len(secret) < _MIN_SECRET_BYTES:
        raise DistValueError(f"TCPStore(secret): a secret of {len(secret)} bytes is too short to be a key; give at "
                             f"least {_MIN_SECRET_BYTES} random bytes (its value is not shown)")
    return bytes(secret)


def _text(fields: list[bytes]) -> str:
    """A server's message (its first field), for an error."""
    return fields[0][:2000].decode(errors="replace") if fields else "(no message)"


def _check_host(host_name: object) -> str:
    if not isinstance(host_name, str):
        raise DistTypeError(f"TCPStore(host_name): host_name must be a str, got {type(host_name).__name__} "
                            f"{host_name!r}")
    host = host_name.strip("[]") if host_name.startswith("[") else host_name
    if not host or any(c.isspace() for c in host) or "/" in host:
        raise DistValueError(f"TCPStore(host_name): {host_name!r} is not a host name or address "
                             f"(e.g. 'localhost', '10.0.0.1', 'node-01')")
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise DistValueError(f"TCPStore(host_name): {host_name!r} is not a host name or address; pass the port "
                                 f"separately: TCPStore('node-01', 29500), not TCPStore('node-01:29500', ...)") from None
    return host


class TCPStore(Store):
    """A store served over TCP (torch's ``TCPStore``), authenticated with the job's secret.

    The process made with ``is_master=True`` runs the server (a thread listening on
    ``host_name:port``; ``port=0`` picks a free port, reported by :attr:`port`) and is itself a
    client; every other process connects to it, retrying until ``timeout``. ``world_size`` counts
    every user, the master included: with ``wait_for_workers=True`` the master's constructor returns
    once that many have connected, and raises :class:`DistStoreError` naming how many did if they
    have not within ``timeout``. The server listens on the address ``host_name`` names (its first
    address), not on every interface: on the master, name the address the others reach, or
    ``"0.0.0.0"`` for every interface. The server lives as long as the master's store: close it (or
    let it go) last. Methods are thread-safe; each concurrent call gets a connection of its own, so a
    thread blocked in ``wait`` does not hold up another thread's ``set``.

    ``secret`` (default: the job's, ``MESHKIT_JOB_SECRET``, which ``meshkit-run`` and
    ``meshkit.spawn`` set for their ranks) authenticates both ends of every connection and every
    frame (comm/stores/auth.py): a client without it is refused at connect, before it reads or
    writes a key, and a server that cannot prove it knows it (a squatter on the port) is refused by
    the client. With no secret anywhere the store is open, as torch's: anyone who reaches the port
    can read and write its keys (docs/security.md). The server's bounds (memory, connections, idle
    time) are in comm/stores/limits.py.
    """

    def __init__(self, host_name: str, port: int, world_size: int | None = None, is_master: bool = False,
                 timeout: timedelta = DEFAULT_TIMEOUT, wait_for_workers: bool = True, *,
                 secret: str | bytes | None = None) -> None:
        host = _check_host(host_name)
        if isinstance(port, bool) or not isinstance(port, numbers.Integral) or not 0 <= port <= 65535:
            raise DistValueError(f"TCPStore(port): port must be an int in [0, 65535], got {port!r}")
        if port == 0 and not is_master:
            raise DistValueError("TCPStore(port): port=0 (pick a free port) is for the master (is_master=True); "
                                 "a client must name the master's port (the master's store.port)")
        if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral)
                                       or world_size < 1):
            raise DistValueError(f"TCPStore(world_size): world_size must be None or an int >= 1 (clients plus the "
                                 f"master), got {world_size!r}")
        secret_bytes = _check_secret(secret)
        super().__init__(timeout)
        self._host, self._port, self._world_size = host, int(port), world_size
        self._is_master = bool(is_master)
        self._key = None if secret_bytes is None else auth.store_key(secret_bytes)
        self._idle: list[_Connection] = []
        self._pool_lock = threading.Lock()
        self._server: StoreServer | None = None
        try:
            infos = socket.getaddrinfo(host, self._port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise DistValueError(f"TCPStore(host_name): {host_name!r} does not resolve to an address ({exc.strerror}); "
                                 f"it must name the master's machine") from None
        family, _, _, _, address = infos[0]
        start = time.monotonic()
        if self._is_master:
            self._server = StoreServer(host, self._port, family, address, self._key)
            self._port = self._server.port
        try:
            self._idle.append(self._join(start))
            if self._is_master and wait_for_workers and world_size is not None:
                joined = self._server.wait_for_workers(world_size, self._left(start))
                if joined < world_size:
                    raise DistStoreError(
                        f"TCPStore at {self._hostport}: {joined} of world_size={world_size} users (the master "
                        f"included) connected within the timeout of {self._timeout_s:g} s (waited "
                        f"{time.monotonic() - start:.3f} s); the others never reached this host and port",
                        waited=time.monotonic() - start)
        except BaseException:
            self.close()
            raise

    @property
    def host(self) -> str:
        """The host name the store was made with."""
        return self._host

    @property
    def port(self) -> int:
        """The server's port (the one picked when made with ``port=0``)."""
        return self._port

    @property
    def world_size(self) -> int | None:
        return self._world_size

    @property
    def authenticated(self) -> bool:
        """Whether every connection proves the job's secret both ways (False: an open store)."""
        return self._key is not None

    @property
    def _hostport(self) -> str:
        return f"[{self._host}]:{self._port}" if ":" in self._host else f"{self._host}:{self._port}"

    def _where(self) -> str:
        return f" at {self._hostport}"

    def close(self) -> None:
        """Close this client's connections; on the master, stop the server (other clients then fail)."""
        self._closed = True
        with self._pool_lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        if self._server is not None:
            self._server.stop()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # ------------------------------------------------------------------ connections
    def _left(self, start: float) -> float:
        return max(0.0, self._timeout_s - (time.monotonic() - start))

    def _join(self, start: float) -> _Connection:
        """The first connection, joined, retrying until the timeout: a server that accepts and then
        resets it is the previous job's master on the same port, closing (the next world of the
        same MASTER_PORT starts right after), and the new one may not listen yet."""
        delay = _RETRY_FIRST_S
        while True:
            conn = self._connect(start)
            try:
                self._checked(conn.call(wire.request(wire.Op.JOIN), max(self._left(start), 0.05)), "join")
                return conn
            except (OSError, wire.ProtocolError) as exc:
                conn.close()
                left = self._left(start)
                if left <= 0:
                    raise DistStoreError(
                        f"TCPStore: the server at {self._hostport} did not answer within {self._timeout_s:g} s "
                        f"(waited {time.monotonic() - start:.3f} s; last error: {exc}); is a meshkit TCPStore "
                        f"master listening there?", waited=time.monotonic() - start) from None
            time.sleep(min(delay, left))
            delay = min(delay * 2, _RETRY_MAX_S)

    def _connect(self, start: float, *, retry: bool = True) -> _Connection:
        """A new connection, authenticated where the store has a secret, retrying refused connects
        and servers that do not greet (the master may start later, or a previous one be closing)
        until the timeout."""
        delay, last, greeted = _RETRY_FIRST_S, None, False
        while True:
            left = self._left(start)
            try:
                sock = socket.create_connection((self._host, self._port), timeout=max(left, 0.05))
            except OSError as exc:
                last, greeted = exc, False
            else:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn = _Connection(sock)
                try:
                    self._handshake(conn, max(self._left(start), 0.05))
                    return conn
                except (OSError, wire.ProtocolError) as exc:  # not (yet) a meshkit server: retried
                    conn.close()
                    last, greeted = exc, True
                except BaseException:
                    conn.close()
                    raise
            left = self._left(start)
            if not retry:
                raise last
            if left <= 0:
                waited = time.monotonic() - start
                if greeted:
                    raise DistStoreError(
                        f"TCPStore: the server at {self._hostport} did not answer within {self._timeout_s:g} s "
                        f"(waited {waited:.3f} s; last error: {last}); is a meshkit TCPStore master listening there?",
                        waited=waited)
                raise DistStoreError(
                    f"TCPStore: no server answered at {self._hostport} within the timeout of {self._timeout_s:g} s "
                    f"(waited {waited:.3f} s; last error: {last}); is the master (is_master=True) running there, "
                    f"and are host_name and port the master's?", waited=waited)
            time.sleep(min(delay, left))
            delay = min(delay * 2, _RETRY_MAX_S)

    def _handshake(self, conn: _Connection, timeout: float) -> None:
        """Read the server's greeting and, with a secret, prove it and check the server's proof.

        Raises:
            DistStoreError: the two sides disagree on the secret, or the server refused the connection
                (a bound): not worth retrying.
            wire.ProtocolError / OSError: not (yet) a meshkit server; the caller retries.
        """
        status, fields = conn.read(timeout)
        if status == wire.Status.ERROR:
            raise DistStoreError(f"TCPStore at {self._hostport}: the server refused the connection: "
                                 f"{_text(fields)}")
        if status != wire.Status.OK or len(fields) != 3 or fields[0] != wire.GREETING:
            raise wire.ProtocolError("it did not greet as a meshkit TCPStore does (another program on the port, or "
                                     "a meshkit of another protocol version)")
        mode, server_nonce = fields[1], fields[2]
        if mode == auth.MODE_OPEN:
            if self._key is not None:
                raise DistStoreError(f"TCPStore at {self._hostport}: the server does not authenticate (it was made "
                                     f"without a secret) while this process has the job's secret ({env.JOB_SECRET}); "
                                     "refusing it: it may be another program squatting on the port. Give the master "
                                     "the same secret")
            return
        if mode != auth.MODE_AUTH or len(server_nonce) != auth.NONCE_BYTES:
            raise wire.ProtocolError(f"an unknown authentication mode {mode[:32]!r}")
        if self._key is None:
            raise DistStoreError(f"TCPStore at {self._hostport}: the server requires the job's secret and this "
                                 f"process has none: set {env.JOB_SECRET} to the job's secret (meshkit-run and "
                                 "meshkit.spawn set it for their ranks) or pass secret=")
        client_nonce = auth.nonce()
        status, fields = conn.call(wire.request(wire.Op.AUTH, client_nonce,
                                                auth.client_proof(self._key, server_nonce, client_nonce)), timeout)
        if status != wire.Status.OK:
            raise DistStoreError(f"TCPStore at {self._hostport}: {_text(fields)}")
        if len(fields) != 1 or not hmac.compare_digest(fields[0], auth.server_proof(self._key, server_nonce,
                                                                                     client_nonce)):
            raise DistStoreError(f"TCPStore at {self._hostport}: the server did not prove that it knows the job's "
                                 "secret (another program squatting on the port, or a store of another job); "
                                 "refusing it")

    def _request(self, op: int, fields: list[bytes], reply_timeout: float) -> tuple[bool, list[bytes]]:
        """``(found, fields)`` of the server's answer; ``found`` is False for a get/wait past its deadline."""
        message = wire.request(op, *fields)
        if len(message) - wire.HEADER.size > wire.MAX_MESSAGE_BYTES:
            raise DistValueError(f"TCPStore.{wire.Op.NAMES[op]}: a request of {len(message)} bytes is over the limit "
                                 f"of {wire.MAX_MESSAGE_BYTES} bytes (meshkit.comm.stores.wire.MAX_MESSAGE_BYTES)")
        with self._pool_lock:
            conn = self._idle.pop() if self._idle else None
        try:
            if conn is None:
                conn = self._connect(time.monotonic())
                answer = conn.call(message, reply_timeout)
            else:
                try:
                    answer = conn.call(message, reply_timeout)
                except _Stale:  # closed while idle in the pool (the server's idle timeout): never applied
                    conn.close()
                    conn = None  # once, at once: a master that is gone refuses it (reported below)
                    conn = self._connect(time.monotonic(), retry=False)
                    answer = conn.call(message, reply_timeout)
        except DistStoreError:  # refused by the server, or the master's store is gone: said already
            raise
        except (OSError, wire.ProtocolError) as exc:
            if conn is not None:
                conn.close()
            why = "no answer within the timeout" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__
            raise DistStoreError(f"TCPStore at {self._hostport}: {wire.Op.NAMES[op]} failed: {why} (pid "
                                 f"{os.getpid()}); did the master's store close?") from None
        if answer[0] == wire.Status.ERROR:  # the server closes a refused request's connection
            conn.close()
        else:
            with self._pool_lock:
                if self._closed:
                    conn.close()
                else:
                    self._idle.append(conn)
        return self._checked(answer, wire.Op.NAMES[op])

    def _checked(self, answer: tuple[int, list[bytes]], op: str) -> tuple[bool, list[bytes]]:
        status, fields = answer
        if status == wire.Status.OK or status == wire.Status.MISSING:
            return status == wire.Status.OK, fields
        if status == wire.Status.NOT_AN_INTEGER:
            raise NotAnInteger(fields[0] if fields else b"")
        if status == wire.Status.TOO_LONG:
            raise ValueTooLong(int(fields[0]) if fields else 0)
        raise DistStoreError(f"TCPStore at {self._hostport}: the server refused {op}: {_text(fields)}")

    # ------------------------------------------------------------------ the primitives
    def _set(self, key: str, value: bytes) -> None:
        self._request(wire.Op.SET, [key.encode(), value], self._timeout_s)

    def _get(self, key: str, timeout: float) -> bytes | None:
        found, out = self._request(wire.Op.GET, [repr(timeout).encode(), key.encode()], timeout + _REPLY_GRACE_S)
        return out[0] if found else None

    def _add(self, key: str, amount: int) -> int:
        return int(self._request(wire.Op.ADD, [key.encode(), str(amount).encode()], self._timeout_s)[1][0])

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._request(wire.Op.CAS, [key.encode(), expected, desired], self._timeout_s)[1][0]

    def _missing(self, keys: list[str]) -> list[str]:
        return [k.decode() for k in self._request(wire.Op.CHECK, [k.encode() for k in keys], self._timeout_s)[1]]

    def _wait(self, keys: list[str], timeout: float) -> list[str]:
        found, out = self._request(wire.Op.WAIT, [repr(timeout).encode(), *(k.encode() for k in keys)],
                                   timeout + _REPLY_GRACE_S)
        return [] if found else [k.decode() for k in out]

    def _delete(self, key: str) -> bool:
        return self._request(wire.Op.DELETE, [key.encode()], self._timeout_s)[1][0] == b"1"

    def _count(self, prefix: str) -> int:
        return int(self._request(wire.Op.COUNT, [prefix.encode()], self._timeout_s)[1][0])

    def _multi_get(self, keys: list[str], timeout: float) -> tuple[list[bytes] | None, list[str]]:
        found, out = self._request(wire.Op.MULTI_GET, [repr(timeout).encode(), *(k.encode() for k in keys)],
                                   timeout + _REPLY_GRACE_S)
        return (out, []) if found else (None, [k.decode() for k in out])

    def _multi_set(self, pairs: list[tuple[str, bytes]]) -> None:
        self._request(wire.Op.MULTI_SET, [x for k, v in pairs for x in (k.encode(), v)], self._timeout_s)

    def _append(self, key: str, value: bytes) -> None:
        self._request(wire.Op.APPEND, [key.encode(), value], self._timeout_s)

    def _push(self, key: str, value: bytes) -> None:
        self._request(wire.Op.QUEUE_PUSH, [key.encode(), value], self._timeout_s)

    def _pop(self, key: str, timeout: float) -> bytes | None:
        found, out = self._request(wire.Op.QUEUE_POP, [repr(timeout).encode(), key.encode()], timeout + _REPLY_GRACE_S)
        return out[0] if found else None

    def _queue_len(self, key: str) -> int:
        return int(self._request(wire.Op.QUEUE_LEN, [key.encode()], self._timeout_s)[1][0])

    def _list(self, prefix: str) -> list[str]:
        return [k.decode() for k in self._request(wire.Op.LIST_KEYS, [prefix.encode()], self._timeout_s)[1]]

    def _clone(self) -> "TCPStore":
        """A client of the same server: its own connections (made as it needs them, authenticated
        with the same secret), not counted as a worker, never the server's owner."""
        other = TCPStore.__new__(TCPStore)
        Store.__init__(other, self._timeout_s)
        other._host, other._port, other._world_size = self._host, self._port, self._world_size
        other._is_master, other._key, other._server = False, self._key, None
        other._idle, other._pool_lock = [], threading.Lock()
        return other
