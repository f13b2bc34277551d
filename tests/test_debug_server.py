"""``meshkit.debug.start_debug_server``: what every rank is doing now (its stacks, its
in-flight collectives, its flight record) over HTTP, answered while the ranks are stuck in a
collective; on the local engine (each rank a thread with its own server) and on real processes."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import meshkit
import meshkit.debug
from meshkit.comm import local
from meshkit.comm.errors import DistError, DistTypeError, DistValueError

from conftest import LAUNCHER_MODULE, SCRIPTS


#: The test's own requests go straight to the servers, whatever proxy the environment names.
_direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str, timeout: float = 5.0) -> dict:
    with _direct.open(url, timeout=timeout) as reply:
        return json.loads(reply.read())


def _functions(thread: dict) -> list[str]:
    return [f["function"] for f in thread["frames"]]


def _main_thread(snapshot: dict, role: str) -> dict:
    [thread] = [t for t in snapshot["stacks"]["threads"] if t["role"] == role]
    return thread


def _refused(url: str, within: float = 2.0) -> bool:
    """True once ``url`` stops answering (the serving loop checks every 0.2 s)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            _get(url, timeout=0.5)
        except (urllib.error.URLError, ConnectionError):
            return True
        time.sleep(0.05)
    return False


# ----------------------------------------------------------------- local engine


def test_each_local_rank_serves_its_own_port_with_its_own_stack_record_and_the_index_of_all():
    def job():
        url = meshkit.debug.start_debug_server()
        x = np.ones(3)
        meshkit.all_reduce(x)
        meshkit.barrier()
        index = _get(url + "/")
        stacks = _get(url + "/stacks")
        record = _get(url + "/flight_record")
        inflight = _get(url + "/inflight")
        meshkit.barrier()  # every rank read its own before any stops
        meshkit.debug.stop_debug_server()
        return url, index, stacks, record, inflight

    results = local.run(job, 3, timeout=20)
    urls = [r[0] for r in results]
    assert len({_port(u) for u in urls}) == 3 and all(u.startswith("http://127.0.0.1:") for u in urls)
    assert len({_token(u) for u in urls}) == 1 and len(_token(urls[0])) == 32  # the job's, from rank 0
    for rank, (url, index, stacks, record, inflight) in enumerate(results):
        assert index["rank"] == rank and index["world_size"] == 3 and index["backend"] == "local"
        assert index["ranks"] == urls and index["url"] == url and index["pid"] == os.getpid()
        assert set(index["endpoints"]) == {"/", "/stacks", "/inflight", "/flight_record", "/snapshot", "/all"}
        # the rank's own thread only: the other ranks' threads share this process but are not its
        [thread] = stacks["threads"]
        assert thread["name"] == f"meshkit-local-rank{rank}" and thread["role"] == "rank"
        assert "job" in _functions(thread) and 'stacks = _get(url + "/stacks")' in thread["text"]
        assert record["rank"] == rank and record["format"] == "meshkit-flight-record/1"
        assert [(e["op"], e["state"]) for e in record["entries"]][-2:] == [("all_reduce", "completed"),
                                                                           ("barrier", "completed")]
        assert inflight["collectives"] == [] and inflight["groups"][0]["ranks"] == [0, 1, 2]


def test_a_base_port_gives_rank_r_port_plus_r():
    base = _free_ports(2)
    urls = local.run(lambda: _start_and_stop(port=base), 2)
    token = _token(urls[0])
    assert urls == [f"http://127.0.0.1:{base}/{token}", f"http://127.0.0.1:{base + 1}/{token}"]


def test_host_all_interfaces_is_reported_by_the_host_name_and_answers_on_localhost():
    url = local.run(lambda: _start_and_stop(host="0.0.0.0", query=True), 1)[0]
    assert url.startswith(f"http://{socket.gethostname()}:")


def _port(url: str) -> int:
    return urllib.parse.urlsplit(url).port


def _token(url: str) -> str:
    return urllib.parse.urlsplit(url).path.strip("/")


def _start_and_stop(query: bool = False, **kwargs) -> str:
    url = meshkit.debug.start_debug_server(**kwargs)
    if query:  # through 127.0.0.1, which "every interface" includes
        assert _get(f"http://127.0.0.1:{_port(url)}/{_token(url)}/")["url"] == url
    meshkit.barrier()
    meshkit.debug.stop_debug_server()
    return url


def _free_ports(n: int) -> int:
    """A base port whose next ``n`` ports are free now (the OS picks the base)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        held = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    pytest.fail("no run of free ports")


def test_all_answers_while_ranks_are_stuck_in_a_collective_on_the_local_engine():
    """Ranks 0 and 1 wait in an all_reduce that rank 2 (in "compute": an Event) has not reached.
    The test, outside the job, asks rank 0's /all: each rank's stack is where it is blocked."""
    urls: dict[int, str] = {}
    go = threading.Event()

    def job():
        urls[meshkit.get_rank()] = meshkit.debug.start_debug_server()
        if meshkit.get_rank() == 2:
            go.wait(15)
        x = np.ones(3)
        meshkit.all_reduce(x)
        return x

    results: list = []
    runner = threading.Thread(target=lambda: results.append(local.run(job, 3, timeout=20)))
    runner.start()
    try:
        doc = _wait_for_stuck(lambda: urls.get(0), [0, 1])
    finally:
        go.set()
        runner.join(20)
    assert [list(x) for x in results[0]] == [[3.0] * 3] * 3
    assert doc["did_not_answer"] == {}
    assert doc["summary"]["2"] == "in no collective"
    for r in ("0", "1"):
        assert doc["summary"][r].startswith("in all_reduce #2 on world [0, 1, 2] (started, ")
        thread = _main_thread(doc["ranks"][r], "rank")
        names = _functions(thread)
        assert "job" in names and "all_reduce" in names and "wait" in names[names.index("all_reduce"):]
        [call] = doc["ranks"][r]["inflight"]["collectives"]
        assert (call["op"], call["seq"], call["state"], call["shapes"]) == ("all_reduce", 2, "started", [[3]])
    rank2 = _functions(_main_thread(doc["ranks"]["2"], "rank"))
    assert "job" in rank2 and "all_reduce" not in rank2 and rank2[-1] == "wait"  # go.wait(15)
    assert all(_refused(u) for u in urls.values())  # destroying the group stopped every server


def _wait_for_stuck(url_of_rank0, stuck: list[int], within: float = 15.0) -> dict:
    """Rank 0's /all once the ranks ``stuck`` are in a collective (they get there in milliseconds)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        url = url_of_rank0()
        if url is not None:
            doc = _get(url + "/all")
            if all(doc["summary"].get(str(r), "").startswith("in all_reduce") for r in stuck):
                return doc
        time.sleep(0.05)
    pytest.fail(f"ranks {stuck} never showed in an all_reduce")


def test_all_lists_queued_asynchronous_collectives_and_names_ranks_that_do_not_answer():
    """Rank 2 stops its server (refused); rank 1 stops its and leaves a socket on its port that
    never answers (a frozen process): rank 0's /all?timeout=0.3 names both and answers for itself,
    its two async all_reduces shown (the second queued behind the first)."""

    def job():
        rank = meshkit.get_rank()
        url = meshkit.debug.start_debug_server()
        index = _get(url + "/")
        frozen = None
        if rank == 1:
            meshkit.debug.stop_debug_server()
            frozen = _listen_until_free(_port(url))
        if rank == 2:
            meshkit.debug.stop_debug_server()
        sub = meshkit.new_group([0, 1])
        meshkit.barrier()
        doc, works = None, []
        if rank == 0:
            works = [meshkit.all_reduce(np.ones(3), group=sub, async_op=True) for _ in range(2)]
            started = time.monotonic()
            doc = _get(url + "/all?timeout=0.3")
            took = time.monotonic() - started
            doc = doc, took, _error(url + "/all?timeout=soon"), _error(url + "/nothing"), index["ranks"]
        meshkit.barrier()
        if frozen is not None:
            frozen.close()
        if rank == 1:
            works = [meshkit.all_reduce(np.ones(3), group=sub, async_op=True) for _ in range(2)]
        for w in works:
            w.wait()
        meshkit.debug.stop_debug_server()
        return doc

    (doc, took, bad, missing, urls), *_ = local.run(job, 3, timeout=20)
    assert took < 1.5, took  # the frozen rank cost 0.3 s, not the default 2
    assert sorted(doc["did_not_answer"]) == ["1", "2"]
    assert doc["did_not_answer"]["1"].startswith(f"{urls[1]} did not answer within 0.3 s: ")
    assert "refused" in doc["did_not_answer"]["2"].lower(), doc["did_not_answer"]["2"]
    assert list(doc["ranks"]) == ["0"] and doc["timeout"] == 0.3
    groups = {g["name"]: g for g in doc["ranks"]["0"]["inflight"]["groups"]}
    [sub] = [g for name, g in groups.items() if name != "world"]
    assert [(q["op"], q["posted"]) for q in sub["queued"]] == [("all_reduce", True), ("all_reduce", False)]
    calls = doc["ranks"]["0"]["inflight"]["collectives"]
    assert [(c["op"], c["state"]) for c in calls] == [("all_reduce", "started"), ("all_reduce", "scheduled")]
    assert doc["summary"]["0"].startswith(f"in all_reduce #0 on {sub['name']} [0, 1] (started, ")
    assert bad == (400, {"error": "/all: timeout='soon' must be a number of seconds in (0, 60]"})
    assert missing[0] == 404 and "no endpoint '/nothing'" in missing[1]["error"]


def test_all_reaches_the_other_ranks_directly_whatever_http_proxy_the_environment_names(monkeypatch):
    """Clusters often set http_proxy; a proxy cannot reach 127.0.0.1 or a compute node's port."""
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # nothing listens on the discard port
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)

    def job():
        url = meshkit.debug.start_debug_server()
        doc = _get(url + "/all") if meshkit.get_rank() == 0 else None
        meshkit.barrier()
        meshkit.debug.stop_debug_server()
        return doc

    doc = local.run(job, 2)[0]
    assert doc["did_not_answer"] == {} and sorted(doc["ranks"]) == ["0", "1"]


def _error(url: str) -> tuple[int, dict]:
    try:
        _direct.open(url, timeout=5)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    pytest.fail(f"{url} answered 200")


def _listen_until_free(port: int) -> socket.socket:
    """Listen on ``port`` (once the stopped server released it), never accepting: a frozen rank."""
    deadline = time.monotonic() + 5
    while True:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the server's side of /'s connection waits
        try:
            s.bind(("127.0.0.1", port))
            s.listen(8)
            return s
        except OSError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# ----------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, error, match", [
    ({"port": -1}, DistValueError, r"port=-1 is out of range: rank r listens on port \+ r, so port must be 0 "
                                   r"\(a free port per rank\) or 1\.\.65534 for 2 ranks"),
    ({"port": 65535}, DistValueError, r"port=65535 is out of range: .* or 1\.\.65534 for 2 ranks"),
    ({"port": "8080"}, DistTypeError, r"port must be an int, got str '8080'"),
    ({"port": True}, DistTypeError, r"port must be an int, got bool True"),
    ({"host": ""}, DistTypeError, r"host must be a non-empty str \(an address to listen on\), got str ''"),
    ({"host": None}, DistTypeError, r"host must be a non-empty str .*, got NoneType None"),
])
def test_bad_port_or_host_is_an_error_naming_the_argument_and_the_rank(kwargs, error, match):
    def job():
        meshkit.debug.start_debug_server(**kwargs)

    with pytest.raises(error, match=r"meshkit.debug: rank \d: start_debug_server: " + match):
        local.run(job, 2)


def test_a_port_in_use_fails_on_every_rank_naming_host_and_port_and_leaves_no_server():
    base = _free_ports(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base))
        taken.listen(1)

        def job():
            try:
                meshkit.debug.start_debug_server(port=base)
            except DistError as exc:
                error = str(exc)
            else:
                error = None
            url = meshkit.debug.start_debug_server()  # not "running already": the failed start kept none
            meshkit.debug.stop_debug_server()
            return error, url

        results = local.run(job, 2)
    for rank, (error, url) in enumerate(results):
        assert error == (f"meshkit.debug: rank {rank}: start_debug_server: rank 0 cannot listen on "
                         f"127.0.0.1:{base}: the port is in use (another program or rank listens there); "
                         f"pass port=0 for free ports; no server was started")
        assert url.startswith("http://127.0.0.1:")
    assert _refused(f"http://127.0.0.1:{base + 1}")  # rank 1 bound it, then closed it


def test_an_address_it_cannot_listen_on_fails_on_every_rank_naming_it():
    host, why = "192.0.2.1", "the address is not one of this host's"  # TEST-NET-1 (RFC 5737): no host has it

    def job():
        meshkit.debug.start_debug_server(host=host)

    with pytest.raises(DistError, match=rf"rank \d: start_debug_server: rank 0 cannot listen on {host}:0: {why}; "
                                        rf"rank 1 cannot listen on {host}:0: {why}; no server was started"):
        local.run(job, 2)


def test_a_second_start_on_a_rank_is_an_error_on_every_rank_and_stop_then_start_works():
    def job():
        first = meshkit.debug.start_debug_server()
        with pytest.raises(DistError) as raised:
            meshkit.debug.start_debug_server()
        assert _get(first + "/")["url"] == first  # the running one is kept
        meshkit.debug.stop_debug_server()
        meshkit.debug.stop_debug_server()  # nothing runs: nothing happens
        assert _refused(first)
        second = meshkit.debug.start_debug_server()
        meshkit.debug.stop_debug_server()
        return first, str(raised.value), second

    results = local.run(job, 2)
    firsts = [r[0] for r in results]
    for rank, (first, error, second) in enumerate(results):
        assert error == (f"meshkit.debug: rank {rank}: start_debug_server: rank 0 runs a debug server already "
                         f"at {firsts[0]}; call stop_debug_server() first; rank 1 runs a debug server already at "
                         f"{firsts[1]}; call stop_debug_server() first; no server was started")
        assert second.startswith("http://127.0.0.1:")


# ----------------------------------------------------------------- real processes


def test_under_meshkit_run_all_shows_each_process_stuck_in_all_reduce_and_names_a_frozen_one(tmp_path):
    """3 processes; ranks 0 and 1 wait in an all_reduce, rank 2 in a sleep loop until the test
    creates GO (MESHKIT_TIMEOUT=15 ends the job should the test fail first). Rank 0's /all shows
    each process's main thread where it is; with rank 1 stopped (SIGSTOP), /all names it."""
    go = tmp_path / "go"
    path = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "MESHKIT_TIMEOUT": "15"}
    proc = subprocess.Popen([sys.executable, "-m", LAUNCHER_MODULE, "-n", "3", "--timeout", "60",
                             str(SCRIPTS / "mpi_debug_server.py"), str(go)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        url = _url_line(lines, seen)
        doc = _wait_for_stuck(lambda: url, [0, 1])
        pid1 = doc["ranks"]["1"]["pid"]
        os.kill(pid1, signal.SIGSTOP)
        try:
            frozen = _get(url + "/all?timeout=0.5")
        finally:
            os.kill(pid1, signal.SIGCONT)
        go.touch()
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(5)
    while not lines.empty():
        seen.append(lines.get())
    output = "".join(seen)
    assert proc.returncode == 0, output
    assert all(f"rank {r}: sum 3" in output for r in range(3)), output
    assert doc["did_not_answer"] == {} and len({doc["ranks"][r]["pid"] for r in "012"}) == 3
    for r in ("0", "1"):
        assert doc["summary"][r].startswith("in all_reduce #2 on world [0, 1, 2] (started, "), doc["summary"]
        main = _main_thread(doc["ranks"][r], "main")
        names = _functions(main)
        assert names[0] == "<module>" and "all_reduce" in names, main["text"]
        assert "wait" in names[names.index("all_reduce"):], main["text"]
    rank2 = _main_thread(doc["ranks"]["2"], "main")
    assert doc["summary"]["2"] == "in no collective" and "all_reduce" not in _functions(rank2)
    assert "time.sleep(0.01)" in rank2["text"] or "os.path.exists(go)" in rank2["text"], rank2["text"]  # its loop
    assert sorted(frozen["did_not_answer"]) == ["1"] and sorted(frozen["ranks"]) == ["0", "2"]
    assert "did not answer within 0.5 s" in frozen["did_not_answer"]["1"]


def _url_line(lines: queue.Queue, seen: list[str], within: float = 60.0) -> str:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        seen.append(line)
        if "URL http://" in line:
            return line.split("URL ", 1)[1].strip()
    pytest.fail(f"rank 0 printed no URL:\n{''.join(seen)}")


# ----------------------------------------------------------------- who may ask, and how much
NOBODY = 65534
AS_NOBODY = os.geteuid() == 0 and shutil.which("setpriv") is not None

_OUTSIDER = """
import sys, urllib.error, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
for url in sys.argv[1:]:
    try:
        with opener.open(url, timeout=10) as reply:
            print(reply.status, reply.read()[:300])
    except urllib.error.HTTPError as exc:
        print(exc.code, exc.read()[:300])
"""


def test_another_local_user_without_the_token_gets_403_and_nothing_else():
    """The URLs differ from what the attacker can guess: the base, a wrong token of the right
    length, the token's prefix, a path after a wrong token. Run as user nobody where root can
    (setpriv), else by this user without the token. The job's own /all still answers after."""
    def job():
        url = meshkit.debug.start_debug_server()
        meshkit.barrier()
        out = None
        if meshkit.get_rank() == 0:
            base, token = url.rsplit("/", 1)
            guesses = [f"{base}/", f"{base}/stacks", f"{base}/{'A' * len(token)}/all", f"{base}/{token[:-1]}/stacks",
                       f"{base}/{token}x/snapshot", f"{base}/x/{token}/all"]
            prefix = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] if AS_NOBODY else []
            proc = subprocess.run([*prefix, sys.executable, "-c", _OUTSIDER, *guesses], capture_output=True, text=True,
                                  timeout=60)
            out = proc.stdout, proc.stderr, _get(url + "/all")
        meshkit.barrier()
        meshkit.debug.stop_debug_server()
        return out

    stdout, stderr, doc = local.run(job, 2, timeout=60)[0]
    lines = stdout.splitlines()
    assert len(lines) == 6, (stdout, stderr)
    for line in lines:
        assert line.startswith("403 b'{\"error\": \"meshkit debug server: this server answers only under the path of "
                               "the URL start_debug_server returned"), line
        assert "frames" not in line and "entries" not in line
    assert doc["did_not_answer"] == {} and sorted(doc["ranks"]) == ["0", "1"]


def _raw(port: int, request: bytes, timeout: float = 5.0) -> bytes:
    """Send ``request`` as is and read the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        chunks = []
        while True:
            part = s.recv(65536)
            if not part:
                return b"".join(chunks)
            chunks.append(part)


def test_a_host_that_is_not_this_one_is_refused_421_and_no_host_400():
    """DNS rebinding: a web page whose name now resolves to 127.0.0.1 makes the browser send its
    own name as Host (and it cannot know the token either)."""
    def job():
        url = meshkit.debug.start_debug_server()
        port, path = _port(url), urllib.parse.urlsplit(url).path
        answers = {host: _raw(port, f"GET {path}/ HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
                   for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io", f"localhost:{port}",
                                f"127.0.0.1:{port}", f"[::1]:{port}", socket.gethostname())}
        answers[None] = _raw(port, f"GET {path}/ HTTP/1.0\r\n\r\n".encode())
        meshkit.debug.stop_debug_server()
        return answers

    answers = local.run(job, 1)[0]
    for host, answer in answers.items():
        if host is None:
            assert answer.startswith(b"HTTP/1.0 400 ") and b"a request must name the Host" in answer, answer[:200]
        elif host.startswith(("evil.example", "127.0.0.1.nip.io")):
            assert answer.startswith(b"HTTP/1.0 421 ") and b"is not this host" in answer, (host, answer[:200])
            assert b"frames" not in answer and b"ranks" not in answer
        else:
            assert answer.startswith(b"HTTP/1.0 200 "), (host, answer[:200])


def test_connections_are_capped_and_half_a_request_holds_no_thread(monkeypatch):
    """MESHKIT_DEBUG_SERVER_CONNECTIONS=2, MESHKIT_DEBUG_SERVER_TIMEOUT=0.5: two clients send half
    a request (one trickles a byte every 0.1 s, which a per-read timeout alone would let it do
    forever); a third is answered 503 at once; within the timeout both are dropped, and a request
    of the job's own is answered."""
    monkeypatch.setenv("MESHKIT_DEBUG_SERVER_CONNECTIONS", "2")
    monkeypatch.setenv("MESHKIT_DEBUG_SERVER_TIMEOUT", "0.5")

    def job():
        url = meshkit.debug.start_debug_server()
        port = _port(url)
        slow = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
        for s in slow:
            s.sendall(b"GET /")
        time.sleep(0.1)  # both accepted (the serving loop takes a connection within milliseconds)
        started = time.monotonic()
        third = _raw(port, b"", timeout=5)
        refused_in = time.monotonic() - started
        closed = []
        for i in range(40):  # 4 s at most
            try:
                slow[1].sendall(b"x")  # the trickle
            except OSError:
                pass
            for s in slow:
                s.setblocking(False)
                try:
                    if s.recv(1024) == b"" and s not in closed:
                        closed.append(s)
                except BlockingIOError:
                    pass
                except OSError:
                    if s not in closed:
                        closed.append(s)
            if len(closed) == 2:
                break
            time.sleep(0.1)
        dropped_in = time.monotonic() - started
        own = _get(url + "/")
        for s in slow:
            s.close()
        meshkit.debug.stop_debug_server()
        return third, refused_in, len(closed), dropped_in, own

    third, refused_in, closed, dropped_in, own = local.run(job, 1, timeout=30)[0]
    assert third.startswith(b"HTTP/1.0 503 Service Unavailable") and b"MESHKIT_DEBUG_SERVER_CONNECTIONS" in third
    assert refused_in < 1.0, refused_in
    assert closed == 2 and dropped_in < 2.5, (closed, dropped_in)  # 0.5 s, and the 0.2 s serving loop
    assert own["rank"] == 0


@pytest.mark.parametrize("name, value, valid", [
    ("MESHKIT_DEBUG_SERVER_CONNECTIONS", "0", "a positive whole number of connections served at once"),
    ("MESHKIT_DEBUG_SERVER_CONNECTIONS", "many", "a positive whole number of connections served at once"),
    ("MESHKIT_DEBUG_SERVER_TIMEOUT", "-1", "a positive number of seconds"),
    ("MESHKIT_DEBUG_SERVER_TIMEOUT", "inf", "a positive number of seconds"),
])
def test_a_bad_bound_is_an_error_naming_the_variable_on_every_rank(name, value, valid, monkeypatch):
    monkeypatch.setenv(name, value)
    with pytest.raises(DistValueError, match=rf"meshkit.debug: rank \d: start_debug_server: {name}='{value}' is not "
                                             rf"valid; valid values are {valid} \(default "):
        local.run(meshkit.debug.start_debug_server, 2)
