"""TCPStore's server: one thread in the master process serving every client through ``selectors``.

One thread owns the table, so each request is applied whole before the next (no lost ``add``);
a ``get``/``wait`` whose keys are missing parks its connection (a waiter) until a change sets them or
its deadline passes, while the loop serves the other connections. A client that disconnects, even
halfway through a frame, only loses its own connection, and its waiter is forgotten at once.

Who gets in: the server speaks first (a greeting with a nonce, :mod:`.auth`); with the job's secret
every connection must authenticate before anything else, so a client without the secret is
refused before it reads or writes a key. What it may cost (its bounds,
:class:`~.limits.ServerLimits`): a frame is refused before anything is allocated for it when it is
longer than the protocol allows (1 KiB before authentication, :data:`~.wire.MAX_MESSAGE_BYTES`
after) or than the memory bound leaves; the values held, the frames being received and the replies
not yet read share one budget (``MESHKIT_STORE_MAX_BYTES``): a request that would make the values
exceed it is refused, and one whose frame or reply would make the traffic exceed it waits (its
connection is not read) until replies drain; connections are capped, and one idle past its timeout
(or slow to authenticate) is closed. A refused request is answered with an error naming the bound
and its variable, then its connection is closed.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import heapq
import hmac
import itertools
import logging
import selectors
import socket
import threading
import time
from typing import Callable

from ..errors import DistStoreError
from . import auth
from .limits import MAX_BYTES, MAX_CONNECTIONS, MAX_WAIT_KEYS, ServerLimits
from .store import KeyTable, NotAnInteger
from .wire import HEADER, MAX_MESSAGE_BYTES, MAX_VALUE_BYTES, GREETING, Op, ProtocolError, Status, fields_of, reply

__all__ = ["StoreServer"]

logger = logging.getLogger("meshkit")

_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_READ | selectors.EVENT_WRITE
#: Seconds between the loop's sweeps for idle and unauthenticated connections (at most; a quarter
#: of the shorter of the two timeouts where that is less).
_SWEEP_S = 1.0


class _Conn:
    __slots__ = ("sock", "peer", "inbuf", "outbuf", "waiter", "closing", "dead", "writing", "nonce",
                 "authed", "reserved", "deferred", "deferred_bytes", "paused", "opened", "active", "discard", "refusal")

    def __init__(self, sock: socket.socket, peer: str, nonce: bytes, authed: bool, now: float) -> None:
        self.sock, self.peer = sock, peer
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.waiter: _Waiter | None = None
        self.closing = False  # close once the reply is out (after a refused frame)
        self.dead = False
        self.writing = False  # registered for EVENT_WRITE (a reply did not fit the socket's buffer)
        self.nonce = nonce  # the server's nonce of the greeting
        self.authed = authed  # an open server: authed from the start
        self.reserved = 0  # bytes of the memory budget held for the frame being received
        self.deferred: bytes | None = None  # a get whose reply waits for memory (paused)
        self.deferred_bytes = 0  # the size of that reply
        self.paused = False  # waiting for memory: not read, not processed
        self.opened = now
        self.active = now  # the last byte in or out
        self.discard = 0  # bytes of a refused frame still to read and drop (its client is still sending it)
        self.refusal = ""  # the answer once they are


class _Waiter:
    """A parked request: ``kind`` is ``"wait"`` (keys set or queues non-empty), ``"get"`` (a key's
    value), ``"multi"`` (the values of keys) or ``"pop"`` (a queue's oldest value); ``seq`` orders
    waiters of one key (pops are served first come, first served)."""

    __slots__ = ("conn", "keys", "kind", "deadline", "done", "seq")

    def __init__(self, conn: _Conn, keys: list[str], kind: str, deadline: float, seq: int) -> None:
        self.conn, self.keys, self.kind, self.deadline, self.done, self.seq = conn, keys, kind, deadline, False, seq


class _Refused(Exception):
    """A request the server will not serve: answered with this message, then the connection closes."""


class StoreServer:
    """Listens on ``host:port`` (``port=0``: a free port, then :attr:`port`) and serves in a daemon
    thread; with ``key`` (:func:`.auth.store_key` of the job's secret) every client must authenticate."""

    def __init__(self, host: str, port: int, family: int, address: tuple, key: bytes | None = None,
                 limits: ServerLimits | None = None) -> None:
        self.limits = limits or ServerLimits.from_env()
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            # SO_REUSEADDR: a restarted master may take a port in TIME_WAIT; Linux still refuses a
            # port another socket listens on, so "in use" is still caught.
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(socket.SOMAXCONN)  # 128+ clients may connect at once
        except OSError as exc:
            listener.close()
            if exc.errno == errno.EADDRINUSE:
                why = "the port is in use (another TCPStore or program listens there); pass port=0 for a free one"
            elif exc.errno == errno.EADDRNOTAVAIL:
                why = "the address is not one of this machine's; the master's host_name must name the master"
            else:
                why = str(exc)
            raise DistStoreError(f"TCPStore: cannot listen on {host}:{port}: {why} ({exc})") from None
        listener.setblocking(False)
        self.host, self.port = host, listener.getsockname()[1]
        self._key = key
        self._listener = listener
        self._table = KeyTable()
        self._held = 0  # bytes of keys and values in the table
        self._traffic = 0  # bytes reserved by frames being received, and of replies not yet sent
        self._conns: set[_Conn] = set()
        self._paused: collections.deque[_Conn] = collections.deque()
        self._resuming = False
        self._waiters: dict[str, set[_Waiter]] = {}
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._stale = 0  # heap entries of waiters already done (compacted when they outnumber the live)
        self._order = itertools.count()
        self._joined = 0
        self._joined_changed = threading.Condition()
        self._refused_auth = 0
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name=f"meshkit-TCPStore-{self.port}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the master's side
    def wait_for_workers(self, world_size: int, timeout: float) -> int:
        """How many clients joined when ``world_size`` had, or when ``timeout`` passed."""
        with self._joined_changed:
            self._joined_changed.wait_for(lambda: self._joined >= world_size, timeout)
            return self._joined

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    # ------------------------------------------------------------------ the loop
    def _serve(self) -> None:
        sweep_s = min(_SWEEP_S, self.limits.idle_timeout / 4, self.limits.handshake_timeout / 4)
        next_sweep = time.monotonic() + sweep_s
        try:
            while not self._stopping:
                # at the next sweep (while anyone is connected) or the first waiter's deadline
                wake = next_sweep if self._conns else None
                if self._deadlines and (wake is None or self._deadlines[0][0] < wake):
                    wake = self._deadlines[0][0]
                timeout = None if wake is None else min(max(wake - time.monotonic(), 0.0), 3600.0)
                for key, mask in self._selector.select(timeout):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        conn = key.data
                        try:
                            if mask & selectors.EVENT_WRITE and not conn.dead:
                                self._flush(conn)
                            if mask & selectors.EVENT_READ and not conn.dead and not conn.paused:
                                self._read(conn)
                        except Exception:  # a bug or an OS surprise costs that connection, never the server
                            logger.debug("meshkit: TCPStore server dropped %s", conn.peer, exc_info=True)
                            self._drop(conn)
                now = time.monotonic()
                self._expire(now)
                if now >= next_sweep:
                    self._sweep(now)
                    next_sweep = now + sweep_s
        finally:
            for key in list(self._selector.get_map().values()):
                with contextlib.suppress(OSError):
                    key.fileobj.close()
            self._selector.close()
            with contextlib.suppress(OSError):
                self._wake_w.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, a reset before accept: keep serving
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    logger.warning("meshkit: TCPStore at port %d: out of file descriptors (%s)", self.port, exc)
                return
            peer = f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)
            if len(self._conns) >= self.limits.max_connections:
                with contextlib.suppress(OSError):
                    sock.setblocking(False)
                    sock.send(reply(Status.ERROR, (
                        f"the server has {len(self._conns)} connections, its limit ({MAX_CONNECTIONS}="
                        f"{self.limits.max_connections}); connection refused").encode()))
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = auth.nonce()
            conn = _Conn(sock, peer, nonce, self._key is None, time.monotonic())
            self._conns.add(conn)
            self._selector.register(sock, _READ, conn)
            self._send(conn, Status.OK, GREETING, auth.MODE_OPEN if self._key is None else auth.MODE_AUTH, nonce)

    def _drop(self, conn: _Conn) -> None:
        if conn.dead:
            return
        conn.dead = True
        self._conns.discard(conn)
        self._traffic -= conn.reserved + len(conn.outbuf)
        conn.reserved = 0
        conn.outbuf.clear()
        if conn.waiter is not None:
            conn.waiter.done = True
            self._stale += 1
            self._forget(conn.waiter)
            conn.waiter = None
        if not conn.paused:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()
        self._resume()  # memory freed

    def _sweep(self, now: float) -> None:
        """Close what has overstayed: unauthenticated connections past the handshake timeout, and
        idle ones (nothing parked, nothing in flight, no traffic) past the idle timeout."""
        limits = self.limits
        for conn in list(self._conns):
            if not conn.authed and now - conn.opened > limits.handshake_timeout:
                self._drop(conn)
            elif conn.waiter is None and not conn.paused and now - conn.active > limits.idle_timeout:
                self._drop(conn)  # a client finds it closed and reconnects (tcp_store.py)
        if self._stale > 64 and self._stale > len(self._deadlines) // 2:
            self._deadlines = [d for d in self._deadlines if not d[2].done]
            heapq.heapify(self._deadlines)
            self._stale = 0

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(1 << 16 if conn.authed else auth.PRE_AUTH_MAX_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not data:  # the client left, maybe halfway through a frame: only its connection goes
            self._drop(conn)
            return
        conn.active = time.monotonic()
        if conn.discard:  # the rest of a frame refused for memory: read and dropped, then the refusal
            dropped = min(conn.discard, len(data))
            conn.discard -= dropped
            data = data[dropped:]
            if conn.discard:
                return
            self._refuse(conn, conn.refusal)
            return
        conn.inbuf += data
        if (conn.waiter is not None or conn.outbuf) and len(conn.inbuf) > MAX_MESSAGE_BYTES + HEADER.size:
            self._drop(conn)  # frames piling up behind a parked request or an unread reply: not a meshkit client
            return
        self._process(conn)

    def _budget_left(self) -> int:
        return self.limits.max_bytes - self._held - self._traffic

    def _pause(self, conn: _Conn) -> None:
        """Stop reading ``conn`` until memory is freed (it has nothing to send: requests are served
        one at a time, the next once the last reply is out)."""
        if not conn.paused:
            conn.paused = True
            self._paused.append(conn)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.sock)

    def _resume(self) -> None:
        """Serve paused connections, in order, while memory allows (not re-entered: serving one may
        free memory, and the loop here goes on to the next)."""
        if self._resuming:
            return
        self._resuming = True
        try:
            while self._paused:
                conn = self._paused[0]
                if not conn.dead and self._traffic > 0 and self._needs(conn) > self._budget_left():
                    return
                self._paused.popleft()
                if conn.dead:
                    continue
                conn.paused = False
                self._selector.register(conn.sock, _READ, conn)
                body, conn.deferred = conn.deferred, None
                if body is not None:
                    self._serve_request(conn, body)
                self._process(conn)
        finally:
            self._resuming = False

    def _needs(self, conn: _Conn) -> int:
        """The memory a paused connection waits for: its deferred reply, or its next frame."""
        if conn.deferred is not None:
            return conn.deferred_bytes
        return HEADER.unpack_from(conn.inbuf, 0)[0] if len(conn.inbuf) >= HEADER.size else 0

    def _process(self, conn: _Conn) -> None:
        buf = conn.inbuf
        # one request at a time per connection, and the next only once the last reply is out: a client
        # that sends without reading cannot make the server buffer replies without bound
        while (conn.waiter is None and not conn.outbuf and not conn.closing and not conn.dead and not conn.paused
               and len(buf) >= HEADER.size):
            (n,) = HEADER.unpack_from(buf, 0)
            if not conn.authed and n > auth.PRE_AUTH_MAX_BYTES:
                self._refuse(conn, f"a frame of {n} bytes before authenticating (the handshake's are under "
                                   f"{auth.PRE_AUTH_MAX_BYTES}); closing the connection")
                return
            if n > MAX_MESSAGE_BYTES:
                self._refuse(conn, f"a frame of {n} bytes is over the limit of {MAX_MESSAGE_BYTES} bytes "
                                   f"(meshkit.comm.stores.wire.MAX_MESSAGE_BYTES); closing the connection")
                return
            if len(buf) < HEADER.size + n:
                # A frame still arriving holds memory for its whole length from here on (one that
                # arrived whole, most of them, is served at once and holds nothing)
                if conn.reserved:
                    return
                if n > self._budget_left():
                    if self._traffic > 0:  # others' traffic will drain: wait for it
                        self._pause(conn)
                        return
                    # the values alone leave no room: refused once its client has sent it (a client
                    # still sending when the connection closes would read a reset, not the reason)
                    conn.refusal = self._over(n, "a request of")
                    conn.discard = HEADER.size + n - len(buf)
                    buf.clear()
                    if conn.discard <= 0:
                        conn.discard = 0
                        self._refuse(conn, conn.refusal)
                    return
                conn.reserved = n
                self._traffic += n
                return
            body = bytes(buf[HEADER.size:HEADER.size + n])
            del buf[:HEADER.size + n]
            if conn.reserved:
                self._traffic -= conn.reserved
                conn.reserved = 0
            if not conn.authed:
                self._authenticate(conn, body)
            else:
                self._serve_request(conn, body)

    def _serve_request(self, conn: _Conn, body: bytes) -> None:
        try:
            self._handle(conn, body)
        except NotAnInteger as exc:
            self._send(conn, Status.NOT_AN_INTEGER, exc.held)
        except _Refused as exc:
            self._refuse(conn, str(exc))
        except (ProtocolError, ValueError) as exc:  # a bad field (not UTF-8, not a number) too
            self._refuse(conn, f"a malformed request ({exc}); closing the connection")
        except Exception as exc:  # never let one request stop the server
            self._send(conn, Status.ERROR, f"the server failed: {exc!r}".encode())

    def _over(self, n: int, what: str) -> str:
        return (f"{what} {n} bytes would pass the server's memory limit ({MAX_BYTES}={self.limits.max_bytes}: "
                f"{self._held} bytes of values held, {self._traffic} in flight); refused, closing the connection")

    def _authenticate(self, conn: _Conn, body: bytes) -> None:
        """The client's answer to the greeting: ``AUTH(nonce, proof)``; the server's proof back."""
        op, f = fields_of(body)
        if op != Op.AUTH or len(f) != 2 or len(f[0]) != auth.NONCE_BYTES:
            self._refuse(conn, "this store requires the job's secret: authenticate first (a meshkit TCPStore "
                               "client with secret= or MESHKIT_JOB_SECRET does); closing the connection")
            return
        client_nonce, proof = f
        if not hmac.compare_digest(auth.client_proof(self._key, conn.nonce, client_nonce), proof):
            self._refused_auth += 1
            if self._refused_auth in (1, 10, 100) or self._refused_auth % 1000 == 0:
                logger.warning("meshkit: TCPStore at port %d refused %s: it does not know the job's secret (%d "
                               "refused so far)", self.port, conn.peer, self._refused_auth)
            self._refuse(conn, "authentication failed: this client does not know the job's secret "
                               "(MESHKIT_JOB_SECRET); closing the connection")
            return
        conn.authed = True
        self._send(conn, Status.OK, auth.server_proof(self._key, conn.nonce, client_nonce))

    def _refuse(self, conn: _Conn, why: str) -> None:
        conn.closing = True
        self._traffic -= conn.reserved
        conn.reserved = 0
        conn.inbuf.clear()
        self._send(conn, Status.ERROR, why.encode())

    def _send(self, conn: _Conn, status: int, *fields: bytes) -> None:
        """Send the reply ``status, fields`` as far as the socket takes it; queue the rest."""
        if conn.dead:
            return
        data = reply(status, *fields)
        if conn.outbuf:  # behind a reply still going out (only a refusal comes after one)
            conn.outbuf += data
            self._traffic += len(data)
            return
        sent = self._try_send(conn, data)  # most replies leave at once, never copied into the buffer
        if sent is None:
            return
        if sent < len(data):
            conn.outbuf += memoryview(data)[sent:]
            self._traffic += len(data) - sent
            self._want_write(conn)
        elif conn.closing:
            self._drop(conn)

    def _try_send(self, conn: _Conn, data: bytes | bytearray) -> int | None:
        """How much of ``data`` the socket took now; None where the connection is gone (dropped)."""
        try:
            sent = conn.sock.send(data)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError:
            self._drop(conn)
            return None
        if sent:
            conn.active = time.monotonic()
        return sent

    def _want_write(self, conn: _Conn) -> None:
        """Be told when the socket takes more (a reply did not fit its buffer)."""
        if not conn.writing:
            self._selector.modify(conn.sock, _WRITE, conn)
            conn.writing = True

    def _flush(self, conn: _Conn) -> None:
        sent = self._try_send(conn, conn.outbuf)
        if sent is None:
            return
        del conn.outbuf[:sent]
        self._traffic -= sent
        if conn.outbuf:
            self._want_write(conn)
        elif conn.closing:
            self._drop(conn)
        elif conn.writing:
            self._selector.modify(conn.sock, _READ, conn)
            conn.writing = False
            self._process(conn)  # requests that arrived while the reply went out
        if sent and self._paused:
            self._resume()

    # ------------------------------------------------------------------ requests
    def _check_keys(self, op: int, keys: list[bytes]) -> None:
        if len(keys) > self.limits.max_wait_keys:
            raise _Refused(f"{Op.NAMES[op]} names {len(keys)} keys, over the limit of {self.limits.max_wait_keys} "
                           f"({MAX_WAIT_KEYS}); closing the connection")

    def _store(self, key: str, grows: int) -> None:
        """Room for ``grows`` more bytes of values, or the refusal naming the bound."""
        if grows > 0 and self._held + grows > self.limits.max_bytes - self._traffic:
            raise _Refused(self._over(grows, f"setting {key!r} adds"))

    def _handle(self, conn: _Conn, body: bytes) -> None:
        op, f = fields_of(body)
        table = self._table
        if op == Op.ADD:
            _need(op, f, 2)
            key = f[0].decode()
            held = table.data.get(key)
            if held is None:
                self._store(key, len(key) + 24)  # a new counter: its key and up to ~24 digits
            total = table.add(key, int(f[1]))
            self._held += len(table.data[key]) - (len(held) if held is not None else -len(key))
            self._changed(key)
            self._send(conn, Status.OK, str(total).encode())
        elif op == Op.SET:
            _need(op, f, 2)
            key = f[0].decode()
            self._set(key, f[1])
            self._send(conn, Status.OK)
        elif op in (Op.GET, Op.WAIT, Op.MULTI_GET, Op.QUEUE_POP):
            if len(f) < 2 or (op in (Op.GET, Op.QUEUE_POP) and len(f) != 2):
                raise ProtocolError(f"{Op.NAMES[op]} takes a timeout and "
                                    f"{'a key' if op in (Op.GET, Op.QUEUE_POP) else 'keys'}")
            self._check_keys(op, f[1:])
            seconds = float(f[0])
            if not 0 <= seconds < 1e9:  # NaN and inf fail too
                raise ProtocolError(f"{Op.NAMES[op]}'s timeout must be finite and >= 0 seconds, got {f[0]!r}")
            keys = [k.decode() for k in f[1:]]
            kind = {Op.GET: "get", Op.WAIT: "wait", Op.MULTI_GET: "multi", Op.QUEUE_POP: "pop"}[op]
            missing, fields = self._ready(kind, keys)
            if not missing:
                self._reply(conn, body, fields)
                if kind == "pop":
                    self._resume()  # memory freed
                return
            if kind == "pop" and seconds == 0:  # queue_pop(block=False): at once
                self._send(conn, Status.MISSING, *(k.encode() for k in missing))
                return
            seq = next(self._order)
            waiter = _Waiter(conn, keys, kind, time.monotonic() + seconds, seq)
            conn.waiter = waiter
            for key in missing:
                self._waiters.setdefault(key, set()).add(waiter)
            heapq.heappush(self._deadlines, (waiter.deadline, seq, waiter))
        elif op == Op.MULTI_SET:
            if not f or len(f) % 2:
                raise ProtocolError(f"multi_set takes pairs of a key and a value, got {len(f)} fields")
            self._check_keys(op, f[0::2])
            pairs = {k.decode(): v for k, v in zip(f[0::2], f[1::2])}  # a key given twice: its last value
            grows = sum(len(v) - (len(table.data[k]) if k in table.data else -len(k)) for k, v in pairs.items())
            if grows > 0 and self._held + grows > self.limits.max_bytes - self._traffic:
                raise _Refused(self._over(grows, f"multi_set of {len(pairs)} keys adds"))
            for key, value in pairs.items():
                table.set(key, value)
            self._held += grows
            for key in pairs:
                self._changed(key)
            self._send(conn, Status.OK)
            if grows < 0:
                self._resume()
        elif op == Op.APPEND:
            _need(op, f, 2)
            key, value = f[0].decode(), f[1]
            held = table.data.get(key)
            if (len(held) if held is not None else 0) + len(value) > MAX_VALUE_BYTES:
                self._send(conn, Status.TOO_LONG, str(len(held) if held is not None else 0).encode())
                return
            self._grow(key, len(value) + (0 if held is not None else len(key)), lambda: table.append(key, value))
            self._send(conn, Status.OK)
        elif op == Op.QUEUE_PUSH:
            _need(op, f, 2)
            key, value = f[0].decode(), f[1]
            self._grow(key, len(value) + (0 if key in table.queues else len(key)), lambda: table.push(key, value))
            self._send(conn, Status.OK)
        elif op == Op.QUEUE_LEN:
            _need(op, f, 1)
            self._send(conn, Status.OK, str(table.queue_len(f[0].decode())).encode())
        elif op == Op.LIST_KEYS:
            _need(op, f, 1)
            self._reply(conn, body, [k.encode() for k in table.keys(f[0].decode())])
        elif op == Op.CAS:
            _need(op, f, 3)
            key, expected, desired = f[0].decode(), f[1], f[2]
            if table.sets(key, expected):
                self._set(key, desired)
                self._send(conn, Status.OK, desired)
            else:
                self._send(conn, Status.OK, table.compare_set(key, expected, desired))
        elif op == Op.CHECK:
            self._check_keys(op, f)
            self._send(conn, Status.OK, *(k.encode() for k in table.missing([k.decode() for k in f])))
        elif op == Op.DELETE:
            _need(op, f, 1)
            key = f[0].decode()
            held = table.data.get(key)
            if held is not None:
                self._held -= len(key) + len(held)
            self._send(conn, Status.OK, b"1" if table.delete(key) else b"0")
            self._resume()
        elif op == Op.COUNT:
            _need(op, f, 1)
            self._send(conn, Status.OK, str(table.count(f[0].decode())).encode())
        elif op == Op.JOIN:
            with self._joined_changed:
                self._joined += 1
                self._joined_changed.notify_all()
            self._send(conn, Status.OK)
        else:
            raise ProtocolError(f"unknown opcode {op}")

    def _ready(self, kind: str, keys: list[str]) -> tuple[list[str], list[bytes]]:
        """What a request of ``kind`` still waits for (the keys), or, when nothing, its reply's
        fields (a pop takes its value out of the table here)."""
        table = self._table
        if kind == "pop":
            value = table.pop(keys[0])
            if value is None:
                return keys, []
            self._held -= len(value) + (0 if keys[0] in table.queues else len(keys[0]))
            return [], [value]
        if kind == "wait":
            return table.missing(keys), []
        missing = table.absent(keys)
        return missing, ([] if missing else [table.data[k] for k in keys])

    def _reply(self, conn: _Conn, body: bytes, fields: list[bytes]) -> None:
        """Send ``fields``: refused past the frame limit (naming it); deferred while the memory bound
        leaves no room for it and others' replies will drain (served again when they have)."""
        size = 1 + sum(HEADER.size + len(x) for x in fields)
        if size > MAX_MESSAGE_BYTES:
            op = Op.NAMES.get(body[0], body[0])
            raise _Refused(f"{op}'s reply of {size} bytes ({len(fields)} fields) is over the limit of "
                           f"{MAX_MESSAGE_BYTES} bytes (meshkit.comm.stores.wire.MAX_MESSAGE_BYTES); ask for fewer "
                           "keys at once; closing the connection")
        if size > self._budget_left() and self._traffic > 0 and body[0] != Op.QUEUE_POP:
            conn.deferred, conn.deferred_bytes = body, size  # its reply waits until others' replies drain
            self._pause(conn)
            return
        self._send(conn, Status.OK, *fields)

    def _set(self, key: str, value: bytes) -> None:
        """Hold ``value`` under ``key`` within the memory bound, and wake its waiters."""
        held = self._table.data.get(key)
        grows = len(value) - (len(held) if held is not None else -len(key))
        if grows > 0:
            self._store(key, grows)
        self._table.set(key, value)
        self._held += grows
        self._changed(key)
        if grows < 0:
            self._resume()

    def _grow(self, key: str, grows: int, apply: Callable[[], None]) -> None:
        """``apply`` a change that adds ``grows`` bytes under ``key`` (append, push) within the
        memory bound, and wake its waiters."""
        self._store(key, grows)
        apply()
        self._held += grows
        self._changed(key)

    def _changed(self, key: str) -> None:
        """Wake the waiters whose keys are now all set (a push: pops in the order they came, while
        the queue lasts)."""
        waiters = self._waiters.pop(key, None)
        if not waiters:
            return
        popped = False
        for w in sorted(waiters, key=lambda w: w.seq):
            if w.done:
                continue
            missing, fields = self._ready(w.kind, w.keys)
            if missing:  # park it under every key still missing (one may have been deleted meanwhile)
                for k in missing:
                    self._waiters.setdefault(k, set()).add(w)
                continue
            popped |= w.kind == "pop"
            self._finish(w, Status.OK, fields)
        if popped:
            self._resume()  # memory freed

    def _finish(self, w: _Waiter, status: int, fields: list[bytes]) -> None:
        w.done = True
        self._stale += 1
        self._forget(w)
        conn = w.conn
        conn.waiter = None
        if 1 + sum(HEADER.size + len(x) for x in fields) > MAX_MESSAGE_BYTES:  # a multi_get's values grew meanwhile
            self._refuse(conn, f"{w.kind}'s reply of {len(fields)} values is over the limit of {MAX_MESSAGE_BYTES} "
                               "bytes (meshkit.comm.stores.wire.MAX_MESSAGE_BYTES); ask for fewer keys at once; "
                               "closing the connection")
            return
        self._send(conn, status, *fields)
        self._process(conn)  # frames that arrived behind the parked one

    def _forget(self, w: _Waiter) -> None:
        for k in w.keys:
            parked = self._waiters.get(k)
            if parked is not None:
                parked.discard(w)
                if not parked:
                    del self._waiters[k]

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, w = heapq.heappop(self._deadlines)
            if w.done:
                self._stale = max(0, self._stale - 1)
            else:
                missing = self._ready(w.kind, w.keys)[0] if w.kind != "pop" else w.keys
                self._finish(w, Status.MISSING, [k.encode() for k in missing])
                self._stale = max(0, self._stale - 1)


def _need(op: int, fields: list[bytes], n: int) -> None:
    if len(fields) != n:
        raise ProtocolError(f"{Op.NAMES.get(op, op)} takes {n} fields, got {len(fields)}")
