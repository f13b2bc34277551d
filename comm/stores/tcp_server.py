"""TCPStore's server: one thread in the master process serving every client through ``selectors``.

One thread owns the table, so each request is applied whole before the next (no lost ``add``);
a ``get``/``wait`` whose keys are missing parks its connection (a waiter) until a change sets them or
its deadline passes, while the loop serves the other connections. A client that disconnects, even
halfway through a frame, only loses its own connection; a frame claiming more than
:data:`~.wire.MAX_MESSAGE_BYTES` is answered with an error and the connection closed, before
anything is allocated for it.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import itertools
import selectors
import socket
import threading
import time

from ..errors import DistStoreError
from .store import KeyTable, NotAnInteger
from .wire import HEADER, MAX_MESSAGE_BYTES, Op, ProtocolError, Status, fields_of, reply

__all__ = ["StoreServer"]

_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_READ | selectors.EVENT_WRITE


class _Conn:
    __slots__ = ("sock", "inbuf", "outbuf", "waiter", "closing", "dead", "writing")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.waiter: _Waiter | None = None
        self.closing = False  # close once the reply is out (after a refused frame)
        self.dead = False
        self.writing = False  # registered for EVENT_WRITE (a reply did not fit the socket's buffer)


class _Waiter:
    __slots__ = ("conn", "keys", "value_of", "deadline", "done")

    def __init__(self, conn: _Conn, keys: list[str], value_of: str | None, deadline: float) -> None:
        self.conn, self.keys, self.value_of, self.deadline, self.done = conn, keys, value_of, deadline, False


class StoreServer:
    """Listens on ``host:port`` (``port=0``: a free port, then :attr:`port`) and serves in a daemon thread."""

    def __init__(self, host: str, port: int, family: int, address: tuple) -> None:
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
        self._listener = listener
        self._table = KeyTable()
        self._waiters: dict[str, set[_Waiter]] = {}
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._order = itertools.count()
        self._joined = 0
        self._joined_changed = threading.Condition()
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
        try:
            while not self._stopping:
                timeout = None
                if self._deadlines:  # capped: epoll refuses a timeout past a C int of milliseconds
                    timeout = min(max(0.0, self._deadlines[0][0] - time.monotonic()), 3600.0)
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
                            if mask & selectors.EVENT_READ and not conn.dead:
                                self._read(conn)
                        except Exception:  # a bug or an OS surprise costs that connection, never the server
                            self._drop(conn)
                self._expire(time.monotonic())
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
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, a connection reset before accept: keep serving
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._selector.register(sock, _READ, _Conn(sock))

    def _drop(self, conn: _Conn) -> None:
        if conn.dead:
            return
        conn.dead = True
        if conn.waiter is not None:
            conn.waiter.done = True
            self._forget(conn.waiter)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not data:  # the client left, maybe halfway through a frame: only its connection goes
            self._drop(conn)
            return
        conn.inbuf += data
        if (conn.waiter is not None or conn.outbuf) and len(conn.inbuf) > MAX_MESSAGE_BYTES + HEADER.size:
            self._drop(conn)  # frames piling up behind a parked request or an unread reply: not a meshkit client
            return
        self._process(conn)

    def _process(self, conn: _Conn) -> None:
        buf = conn.inbuf
        # one request at a time per connection, and the next only once the last reply is out: a client
        # that sends without reading cannot make the server buffer replies without bound
        while (conn.waiter is None and not conn.outbuf and not conn.closing and not conn.dead
               and len(buf) >= HEADER.size):
            (n,) = HEADER.unpack_from(buf, 0)
            if n > MAX_MESSAGE_BYTES:
                self._refuse(conn, f"a frame of {n} bytes is over the limit of {MAX_MESSAGE_BYTES} bytes "
                                   f"(meshkit.comm.stores.wire.MAX_MESSAGE_BYTES); closing the connection")
                return
            if len(buf) < HEADER.size + n:
                return
            body = bytes(buf[HEADER.size:HEADER.size + n])
            del buf[:HEADER.size + n]
            try:
                self._handle(conn, body)
            except NotAnInteger as exc:
                self._send(conn, reply(Status.NOT_AN_INTEGER, exc.held))
            except (ProtocolError, ValueError) as exc:  # a bad field (not UTF-8, not a number) too
                self._refuse(conn, f"a malformed request ({exc}); closing the connection")
            except Exception as exc:  # never let one request stop the server
                self._send(conn, reply(Status.ERROR, f"the server failed: {exc!r}".encode()))

    def _refuse(self, conn: _Conn, why: str) -> None:
        conn.closing = True
        conn.inbuf.clear()
        self._send(conn, reply(Status.ERROR, why.encode()))

    def _send(self, conn: _Conn, data: bytes) -> None:
        if conn.dead:
            return
        pending = bool(conn.outbuf)
        conn.outbuf += data
        if not pending:
            self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.outbuf)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._drop(conn)
            return
        del conn.outbuf[:sent]
        if conn.outbuf:
            if not conn.writing:
                self._selector.modify(conn.sock, _WRITE, conn)
                conn.writing = True
        elif conn.closing:
            self._drop(conn)
        elif conn.writing:
            self._selector.modify(conn.sock, _READ, conn)
            conn.writing = False
            self._process(conn)  # requests that arrived while the reply went out

    # ------------------------------------------------------------------ requests
    def _handle(self, conn: _Conn, body: bytes) -> None:
        op, f = fields_of(body)
        table = self._table
        if op == Op.ADD:
            _need(op, f, 2)
            total = table.add(f[0].decode(), int(f[1]))
            self._changed(f[0].decode())
            self._send(conn, reply(Status.OK, str(total).encode()))
        elif op == Op.SET:
            _need(op, f, 2)
            key = f[0].decode()
            table.set(key, f[1])
            self._changed(key)
            self._send(conn, reply(Status.OK))
        elif op in (Op.GET, Op.WAIT):
            if len(f) < 2 or (op == Op.GET and len(f) != 2):
                raise ProtocolError(f"{Op.NAMES[op]} takes a timeout and {'a key' if op == Op.GET else 'keys'}")
            seconds = float(f[0])
            if not 0 <= seconds < 1e9:  # NaN and inf fail too
                raise ProtocolError(f"{Op.NAMES[op]}'s timeout must be finite and >= 0 seconds, got {f[0]!r}")
            keys = [k.decode() for k in f[1:]]
            missing = table.missing(keys)
            if not missing:
                self._send(conn, reply(Status.OK, *([table.data[keys[0]]] if op == Op.GET else [])))
                return
            waiter = _Waiter(conn, keys, keys[0] if op == Op.GET else None, time.monotonic() + seconds)
            conn.waiter = waiter
            for key in missing:
                self._waiters.setdefault(key, set()).add(waiter)
            heapq.heappush(self._deadlines, (waiter.deadline, next(self._order), waiter))
        elif op == Op.CAS:
            _need(op, f, 3)
            key = f[0].decode()
            held = table.compare_set(key, f[1], f[2])
            self._changed(key)
            self._send(conn, reply(Status.OK, held))
        elif op == Op.CHECK:
            self._send(conn, reply(Status.OK, *(k.encode() for k in table.missing([k.decode() for k in f]))))
        elif op == Op.DELETE:
            _need(op, f, 1)
            self._send(conn, reply(Status.OK, b"1" if table.delete(f[0].decode()) else b"0"))
        elif op == Op.COUNT:
            _need(op, f, 1)
            self._send(conn, reply(Status.OK, str(table.count(f[0].decode())).encode()))
        elif op == Op.JOIN:
            with self._joined_changed:
                self._joined += 1
                self._joined_changed.notify_all()
            self._send(conn, reply(Status.OK))
        else:
            raise ProtocolError(f"unknown opcode {op}")

    def _changed(self, key: str) -> None:
        """Wake the waiters whose keys are now all set."""
        waiters = self._waiters.pop(key, None)
        if not waiters:
            return
        for w in waiters:
            if w.done:
                continue
            missing = self._table.missing(w.keys)
            if missing:  # park it under every key still missing (one may have been deleted meanwhile)
                for k in missing:
                    self._waiters.setdefault(k, set()).add(w)
                continue
            self._finish(w, reply(Status.OK, *([self._table.data[w.value_of]] if w.value_of is not None else [])))

    def _finish(self, w: _Waiter, message: bytes) -> None:
        w.done = True
        self._forget(w)
        conn = w.conn
        conn.waiter = None
        self._send(conn, message)
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
            if not w.done:
                self._finish(w, reply(Status.MISSING, *(k.encode() for k in self._table.missing(w.keys))))


def _need(op: int, fields: list[bytes], n: int) -> None:
    if len(fields) != n:
        raise ProtocolError(f"{Op.NAMES.get(op, op)} takes {n} fields, got {len(fields)}")
