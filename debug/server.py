"""A small HTTP server on every rank that answers, while the job runs, what each rank is doing now.

:func:`start_debug_server` (collective over the world) starts on each rank a
:class:`~http.server.ThreadingHTTPServer` in a daemon thread and gathers every rank's address, so
that any rank can answer for all of them. JSON endpoints:

* ``/``: this rank, the world size and every rank's URL, and the endpoints;
* ``/stacks``: the Python stack of each of this rank's threads (``sys._current_frames``);
* ``/inflight``: its calls not finished (flight-recorder entries scheduled or started) and each
  group's queue of asynchronous collectives (:func:`meshkit.comm._seams.inflight_document`);
* ``/flight_record``: its last 64 operations (:func:`meshkit.comm._seams.flight_document`);
* ``/snapshot``: the three above in one answer;
* ``/all``: every rank's ``/snapshot``, fetched by HTTP in parallel with a short timeout per rank
  (``?timeout=SECONDS``, default 2), the ranks that did not answer named, and a one-line summary
  per rank of the call it is in.

The server thread answers while the rank's own threads are blocked: a rank waiting in a collective
waits in MPI, NCCL or a lock, all of which release the GIL, and pure Python code gives it up every
5 ms (``sys.getswitchinterval``). Only code that holds the GIL for long (a C extension that does not
release it) delays the answer; ``/all`` then names that rank as not answering.

Who may ask: the job's user, and no one else on the host. Rank 0 draws a token
(``secrets.token_urlsafe``) that reaches every rank in the exchange of addresses; each server
answers only under the path ``/<token>`` (the URL :func:`start_debug_server` returns ends with it,
so ``f"{url}/all"`` works) and ``/all`` fetches the other ranks with it: another local user, who
could connect to 127.0.0.1, gets 403 and nothing of the stacks or records. A request naming a
``Host`` that is not this host (a web page whose name was rebound to 127.0.0.1 sends its own name)
gets 421. Each server serves at most ``MESHKIT_DEBUG_SERVER_CONNECTIONS`` connections at once (a
thread each; more are answered 503 at once; ``/all`` runs one at a time, fetching with up to 32
threads, and reads at most ``MESHKIT_DEBUG_MAX_RECORD_BYTES`` of each rank's answer), and a
client has ``MESHKIT_DEBUG_SERVER_TIMEOUT`` seconds to send its request and for each read or write
of the answer (half a request does not hold a thread). No TLS: across hosts, the token crosses the network in the clear. The server stops
with :func:`stop_debug_server` or when the process group is destroyed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import hmac
import http.client
import ipaddress
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..comm import DistError, DistTypeError, DistValueError, all_gather_object
from ..comm._seams import current_world, flight_document, inflight_document, positive_setting
from .divergence import MAX_RECORD_ENV, max_record_bytes

__all__ = ["start_debug_server", "stop_debug_server"]

logger = logging.getLogger("meshkit")

#: Seconds ``/all`` waits for each rank's answer unless ``?timeout=`` says otherwise: a rank's
#: answer takes milliseconds (its snapshot is a few KB), so 2 s only passes for a rank whose
#: process is frozen or whose host is unreachable.
DEFAULT_TIMEOUT = 2.0
#: The most ``?timeout=`` may ask: one slow rank must not hold ``/all`` for long.
_MAX_TIMEOUT = 60.0
#: How often the serving loop checks whether it was stopped or its world destroyed (seconds).
_POLL = 0.2
#: Ranks' problems a failed start names (then "and K more"): a port in use on 1000 ranks is one line.
_PROBLEMS_SHOWN = 8
#: The variable that sets how many connections a rank's server serves at once (each one a thread).
CONNECTIONS_ENV = "MESHKIT_DEBUG_SERVER_CONNECTIONS"
#: Its default: a person with curl needs one or two, and ``/all`` on any rank opens one on each
#: other rank; a connection beyond them is answered 503 at once instead of starting a thread.
DEFAULT_CONNECTIONS = 16
#: The variable that sets the seconds a client has to send its request, and for each read or
#: write of the answer.
TIMEOUT_ENV = "MESHKIT_DEBUG_SERVER_TIMEOUT"
#: Its default: a request is a few hundred bytes sent at once and an answer of some MB is read in
#: milliseconds on a local socket; a client silent for 10 s is not going to finish.
DEFAULT_CLIENT_TIMEOUT = 10.0
#: Names of the server's own threads, left out of ``/stacks``.
_THREAD_PREFIX = "meshkit-debug-server"
_ENDPOINTS = {
    "/": "this index",
    "/stacks": "the Python stack of each of this rank's threads",
    "/inflight": "this rank's collectives not finished, and each group's queue of asynchronous ones",
    "/flight_record": "this rank's last operations (the flight recorder)",
    "/snapshot": "stacks, inflight and flight_record in one answer",
    "/all": "every rank's snapshot, fetched with a timeout per rank (?timeout=SECONDS, default 2)",
}


@dataclasses.dataclass(eq=False)
class _Server:
    """One rank's server and what it answers about."""

    httpd: ThreadingHTTPServer
    world: Any
    caller: int  # the ident of the thread that started it: the rank's thread on the local engine
    base: str  # http://HOST:PORT
    hosts: frozenset[str]  # the Host names it answers to (IP literals too)
    client_timeout: float
    connections: int  # served at once, at most
    slots: threading.BoundedSemaphore  # one per connection served at once
    token: str = ""  # the job's: every path starts with /<token>
    urls: list[str] = dataclasses.field(default_factory=list)  # every rank's, in rank order
    stopping: threading.Event = dataclasses.field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    #: connections whose request has not been read yet, with when they were accepted
    pending: dict[Any, float] = dataclasses.field(default_factory=dict)
    pending_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    #: ``/all`` runs one at a time (each runs up to 32 threads fetching the other ranks)
    all_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        """The URL the rank's user is given: the base and the token."""
        return f"{self.base}/{self.token}"


#: The running servers by world: one per rank (the local engine's ranks share this process).
_servers: dict[Any, _Server] = {}
_servers_lock = threading.Lock()


def start_debug_server(port: int = 0, host: str = "127.0.0.1") -> str:
    """Start this rank's debug server and return its URL (collective over the world).

    Every rank calls it: each binds ``host:port + rank`` (``port=0``: a free port each), then the
    ranks exchange their addresses (an ``all_gather_object``), so that every rank's ``/all``
    answers for all of them. If any rank cannot bind, every rank raises and keeps no new server.
    On the local engine each rank (a thread) gets its own server and port, and ``/stacks`` shows
    that rank's thread and its groups' communication threads; in a process it shows every thread.

    Args:
        port: the base port (rank r listens on ``port + r``), or 0 for a free port per rank.
        host: the address to listen on. Ranks on several hosts need one that rank 0 can reach
            (``"0.0.0.0"``: every interface; the URLs then carry the host's name) for ``/all``.

    Returns:
        This rank's URL, ``http://HOST:PORT/TOKEN``, a base for the endpoints (``f"{url}/all"``):
        the server answers only under it (the job's token, drawn on rank 0); its ``/`` lists
        every rank's.

    Raises:
        DistTypeError / DistValueError: ``port`` is not an int in range or ``host`` not a non-empty
            str, or ``MESHKIT_DEBUG_SERVER_CONNECTIONS`` / ``MESHKIT_DEBUG_SERVER_TIMEOUT`` is not
            valid (on each rank, before any exchange).
        DistError: some rank could not listen (the port is in use, the address is not this
            host's), or this rank already runs a server: on every rank, naming the ranks and why.

    Example (2 ranks)::

        url = meshkit.debug.start_debug_server()      # rank 0: "http://127.0.0.1:41017/3q2x...Jw"
        # while the job runs: curl http://127.0.0.1:41017/3q2x...Jw/all
        meshkit.debug.stop_debug_server()
    """
    world = current_world()
    rank, size = world.rank, world.size
    where = f"meshkit.debug: rank {rank}: start_debug_server"
    if isinstance(port, bool) or not isinstance(port, int):
        raise DistTypeError(f"{where}: port must be an int, got {type(port).__name__} {port!r}")
    if not isinstance(host, str) or not host:
        raise DistTypeError(f"{where}: host must be a non-empty str (an address to listen on), got "
                            f"{type(host).__name__} {host!r}")
    if port != 0 and not 1 <= port <= 65536 - size:
        raise DistValueError(f"{where}: port={port} is out of range: rank r listens on port + r, so port "
                             f"must be 0 (a free port per rank) or 1..{65536 - size} for {size} ranks")
    connections = int(positive_setting(CONNECTIONS_ENV, DEFAULT_CONNECTIONS, integer=True, where=where,
                                       valid=f"a positive whole number of connections served at once (default "
                                             f"{DEFAULT_CONNECTIONS})"))
    client_timeout = positive_setting(TIMEOUT_ENV, DEFAULT_CLIENT_TIMEOUT, where=where, upper=3600.0,
                                      valid=f"a positive number of seconds (default {DEFAULT_CLIENT_TIMEOUT:g}; "
                                            "at most 3600)")
    with _servers_lock:
        running = _servers.get(world)
    server, problem, mine = None, None, port + rank if port else 0
    if running is not None:
        problem = f"rank {rank} runs a debug server already at {running.url}; call stop_debug_server() first"
    else:
        try:
            server = _bind(world, host, mine, connections, client_timeout)
        except OSError as exc:
            problem = f"rank {rank} cannot listen on {_netloc(host, mine)}: {_why(exc)}"
    token = secrets.token_urlsafe(24) if rank == 0 else None  # 192 bits; reaches every rank in the exchange
    answers: list[Any] = [None] * size
    try:
        all_gather_object(answers, (problem, None if server is None else server.base, token))
    except BaseException:  # a rank that never called (a timeout), a peer's failure: keep no half-started server
        if server is not None:
            server.httpd.server_close()
        raise
    problems = [p for p, _, _ in answers if p is not None]
    if problems:
        if server is not None:
            server.httpd.server_close()
        more = f"; and {len(problems) - _PROBLEMS_SHOWN} more ranks" if len(problems) > _PROBLEMS_SHOWN else ""
        raise DistError(f"{where}: {'; '.join(problems[:_PROBLEMS_SHOWN])}{more}; no server was started")
    server.token = answers[0][2]
    server.urls = [f"{base}/{server.token}" for _, base, _ in answers]
    server.thread = threading.Thread(target=_serve, args=(server,), name=f"{_THREAD_PREFIX}[rank {rank}]",
                                     daemon=True)
    with _servers_lock:
        _servers[world] = server
    server.thread.start()
    logger.info("meshkit: rank %d debug server at %s (%s/all answers for every rank)", rank, server.url, server.url)
    return server.url


def stop_debug_server() -> None:
    """Stop this rank's debug server (not collective; nothing happens where none runs).

    Destroying the process group stops it too. After it, ``/all`` on another rank names this rank as
    not answering.
    """
    try:
        world = current_world()
    except DistError:  # no process group: its server, if any, stopped with it
        return
    with _servers_lock:
        server = _servers.pop(world, None)
    if server is not None:
        server.stopping.set()
        if server.thread is not None and server.thread is not threading.current_thread():
            server.thread.join()


class _DebugHTTPServer(ThreadingHTTPServer):
    """A thread per connection, up to the server's slots; a connection beyond them is answered 503
    at once, from the serving thread, and closed."""

    daemon_threads = True
    debug_server: _Server

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.debug_server.slots.acquire(blocking=False):
            _refuse(request, self.debug_server)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self.debug_server.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.debug_server.slots.release()


def _refuse(request: socket.socket, server: _Server) -> None:
    """Answer 503 without waiting on the client (its buffer takes a few hundred bytes)."""
    body = json.dumps({"error": f"meshkit debug server: {server.connections} connections are being served "
                                f"({CONNECTIONS_ENV}); retry"}).encode()
    head = (f"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
            "\r\nConnection: close\r\n\r\n").encode()
    try:
        request.setblocking(False)
        request.send(head + body)
        request.recv(1 << 16)  # what the client sent already: unread, it would make close() reset the answer
    except OSError:
        pass


def _bind(world: Any, host: str, port: int, connections: int, client_timeout: float) -> _Server:
    """Listen on ``host:port`` (IPv4 or IPv6, as ``host`` resolves); OSError if it cannot."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("_DebugHTTPServer", (_DebugHTTPServer,), {"address_family": family})
    httpd = server_class((host, port), _Handler)
    httpd.timeout = _POLL
    name = socket.gethostname()
    shown = name if host in ("0.0.0.0", "::") else host  # an address the other ranks can use
    hosts = frozenset(h.lower().rstrip(".") for h in (host, shown, name, name.split(".")[0], "localhost"))
    server = _Server(httpd, world, threading.get_ident(), f"http://{_netloc(shown, httpd.server_address[1])}", hosts,
                     client_timeout, connections, threading.BoundedSemaphore(connections))
    httpd.debug_server = server  # type: ignore[attr-defined]
    return server


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _why(exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return "the port is in use (another program or rank listens there); pass port=0 for free ports"
    if exc.errno == errno.EADDRNOTAVAIL:
        return "the address is not one of this host's"
    return str(exc)


def _serve(server: _Server) -> None:
    """Answer requests until stopped or until the rank's process group is destroyed."""
    try:
        while not server.stopping.is_set() and not server.world.destroyed:
            server.httpd.handle_request()  # returns after _POLL seconds without a request
            _drop_slow_clients(server)
    finally:
        server.httpd.server_close()
        with _servers_lock:
            if _servers.get(server.world) is server:
                del _servers[server.world]


def _drop_slow_clients(server: _Server) -> None:
    """Close the connections that have not sent their request within the client timeout (a client
    trickling a byte at a time would reset a per-read timeout forever)."""
    now = time.monotonic()
    with server.pending_lock:
        late = [c for c, since in server.pending.items() if now - since > server.client_timeout]
        for connection in late:
            del server.pending[connection]
    for connection in late:
        try:
            connection.shutdown(socket.SHUT_RDWR)  # its thread's read returns: the connection ends
        except OSError:
            pass


class _Handler(BaseHTTPRequestHandler):
    """GET only; every answer is JSON. The Host must be this host's, the path start with the token."""

    server_version = "meshkit-debug"

    def setup(self) -> None:
        server: _Server = self.server.debug_server  # type: ignore[attr-defined]
        self.timeout = server.client_timeout  # each read and write of this connection (StreamRequestHandler)
        super().setup()
        with server.pending_lock:
            server.pending[self.connection] = time.monotonic()

    def parse_request(self) -> bool:
        server: _Server = self.server.debug_server  # type: ignore[attr-defined]
        with server.pending_lock:
            server.pending.pop(self.connection, None)  # read whole: no longer held to the request deadline
        return super().parse_request()

    def finish(self) -> None:
        server: _Server = self.server.debug_server  # type: ignore[attr-defined]
        with server.pending_lock:
            server.pending.pop(self.connection, None)
        super().finish()

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        server: _Server = self.server.debug_server  # type: ignore[attr-defined]
        threading.current_thread().name = f"{_THREAD_PREFIX}[rank {server.world.rank}] request"
        refused = _host_problem(self.headers.get("Host"), server)
        if refused is not None:
            self._reply(*refused)
            return
        url = urllib.parse.urlsplit(self.path)
        first, _, rest = url.path.lstrip("/").partition("/")
        if not hmac.compare_digest(first.encode(), server.token.encode()):
            self._reply(403, {"error": "meshkit debug server: this server answers only under the path of the URL "
                                       "start_debug_server returned (http://HOST:PORT/TOKEN, the job's token)"})
            return
        path = "/" + rest
        try:
            if path == "/":
                body = {"rank": server.world.rank, "world_size": server.world.size, "backend": server.world.backend,
                        "pid": os.getpid(), "host": socket.gethostname(), "url": server.url, "ranks": server.urls,
                        "endpoints": _ENDPOINTS}
            elif path == "/stacks":
                body = _stacks(server)
            elif path == "/inflight":
                body = inflight_document(server.world)
            elif path == "/flight_record":
                body = flight_document(server.world)
            elif path == "/snapshot":
                body = _snapshot(server)
            elif path == "/all":
                timeout = _timeout(urllib.parse.parse_qs(url.query))
                if not server.all_lock.acquire(timeout=timeout):
                    self._reply(503, {"error": f"another /all ran for more than {timeout:g} s; retry"})
                    return
                try:
                    body = _all(server, timeout)
                finally:
                    server.all_lock.release()
            else:
                self._reply(404, {"error": f"no endpoint {path!r}; endpoints: {sorted(_ENDPOINTS)}"})
                return
        except DistValueError as exc:
            self._reply(400, {"error": str(exc)})
            return
        self._reply(200, body)

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body, default=str).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
        logger.debug("meshkit debug server: " + format, *args)


def _host_problem(header: str | None, server: _Server) -> tuple[int, dict[str, str]] | None:
    """``(status, body)`` refusing a request whose Host header is missing or names another host
    than this one (its names, ``localhost``, the address it listens on, or an IP address: a page
    whose name was rebound to 127.0.0.1 sends its own name), else None."""
    if not header:
        return 400, {"error": "meshkit debug server: a request must name the Host"}
    name = header.strip()
    name = name[1:name.find("]")] if name.startswith("[") else name.rsplit(":", 1)[0] if name.count(":") == 1 \
        else name
    name = name.lower().rstrip(".")
    if name in server.hosts:
        return None
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return 421, {"error": f"meshkit debug server: Host {header[:100]!r} is not this host; ask for "
                              f"{server.base}"}
    return None


def _timeout(query: dict[str, list[str]]) -> float:
    text = query.get("timeout", [str(DEFAULT_TIMEOUT)])[-1]
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= _MAX_TIMEOUT:
        raise DistValueError(f"/all: timeout={text!r} must be a number of seconds in (0, {_MAX_TIMEOUT:g}]")
    return value


def _stacks(server: _Server) -> dict[str, Any]:
    """Each thread's stack, innermost frame last (as a traceback prints it). On the local engine only
    the rank's thread and its groups' communication threads: the process's others are every rank's."""
    frames = sys._current_frames()
    threads = {t.ident: t for t in threading.enumerate()}
    main = threading.main_thread().ident
    comm = {g["comm_thread"] for g in inflight_document(server.world)["groups"]} - {None}
    mine = {server.caller} | comm if server.world.backend == "local" else None
    out = []
    for ident, frame in frames.items():
        thread = threads.get(ident)
        name = thread.name if thread is not None else f"thread {ident}"
        if name.startswith(_THREAD_PREFIX) or (mine is not None and ident not in mine):
            continue
        summary = traceback.extract_stack(frame)
        role = ("rank" if ident == server.caller and mine is not None else "main" if ident == main
                else "comm" if ident in comm else "other")
        out.append({"name": name, "ident": ident, "role": role, "daemon": None if thread is None else thread.daemon,
                    "frames": [{"file": f.filename, "line": f.lineno, "function": f.name, "code": f.line}
                               for f in summary],
                    "text": "".join(traceback.format_list(summary))})
    out.sort(key=lambda t: (t["role"] not in ("main", "rank"), t["name"]))
    return {"rank": server.world.rank, "time": time.time(), "threads": out}


def _snapshot(server: _Server) -> dict[str, Any]:
    """The rank's calls in flight, then its stacks: a rank that is stuck in the calls read first is
    in them still when its stacks are read (the other order once showed a rank that entered an
    all_reduce between the two reads in the all_reduce by its record but not by its stack)."""
    inflight = inflight_document(server.world)
    return {"rank": server.world.rank, "pid": os.getpid(), "host": socket.gethostname(), "inflight": inflight,
            "stacks": _stacks(server), "flight_record": flight_document(server.world)}


#: Fetches the other ranks' answers directly: never through an ``http_proxy`` of the environment
#: (clusters often set one), which would not reach 127.0.0.1 or a compute node's port.
_direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _fetch(url: str, timeout: float, limit: int) -> dict[str, Any]:
    """A rank's snapshot: at most ``limit`` bytes of JSON (ValueError beyond, or not JSON)."""
    with _direct.open(f"{url}/snapshot", timeout=timeout) as reply:
        data = reply.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"its answer is larger than {limit} bytes ({MAX_RECORD_ENV})")
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("its answer is JSON nested too deeply") from None


def _all(server: _Server, timeout: float) -> dict[str, Any]:
    """Every rank's snapshot (this rank's read directly), and the ranks that did not answer, and why."""
    ranks: dict[int, Any] = {server.world.rank: _snapshot(server)}
    missing: dict[int, str] = {}
    others = [(r, u) for r, u in enumerate(server.urls) if r != server.world.rank]
    try:
        limit = max_record_bytes()
    except DistValueError:  # (a bad variable: the default, with the error where records are read)
        limit = 16 << 20
    if others:
        with concurrent.futures.ThreadPoolExecutor(min(32, len(others)),
                                                   thread_name_prefix=f"{_THREAD_PREFIX} fetch") as pool:
            futures = {r: pool.submit(_fetch, u, timeout, limit) for r, u in others}
            for r, future in futures.items():
                try:
                    ranks[r] = future.result()
                except (OSError, ValueError, http.client.HTTPException) as exc:  # refused, timed out, reset, not JSON
                    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
                    missing[r] = f"{server.urls[r]} did not answer within {timeout:g} s: {reason}"
    return {"rank": server.world.rank, "world_size": server.world.size, "time": time.time(), "timeout": timeout,
            "summary": {r: _doing(ranks[r]) for r in sorted(ranks)}, "did_not_answer": missing,
            "ranks": {r: ranks[r] for r in sorted(ranks)}}


def _doing(snapshot: dict[str, Any]) -> str:
    """One line: the calls a rank is in, e.g. ``all_reduce #3 on world [0, 1, 2] (started, 2.1 s)``."""
    calls = snapshot["inflight"]["collectives"]
    if not calls:
        return "in no collective"
    return "in " + "; ".join(f"{c['op']} #{c['seq']} on {c['group']} {c['ranks']} ({c['state']}"
                             + ("" if c["seconds"] is None else f", {c['seconds']:.1f} s") + ")" for c in calls)
