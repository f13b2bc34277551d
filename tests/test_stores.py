"""Key-value stores: one semantics for HashStore, FileStore, TCPStore and PrefixStore,
TCPStore's server under load and abuse, and both process-shared stores across real processes."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

import meshkit
from meshkit import DistStoreError, FileStore, HashStore, PrefixStore, Store, TCPStore
from meshkit.comm.stores import wire
from support.ports import free_port

WORKER = Path(__file__).parent / "scripts" / "store_worker.py"
SHORT = timedelta(seconds=0.3)  # what a timeout test waits: the failure must come this soon, not hang


# --------------------------------------------------------------------------- one semantics, four stores
@pytest.fixture(params=["hash", "file", "tcp", "tcp-secret", "prefix"])
def stores(request, tmp_path):
    """``(store, another)``: a store with a short timeout and a function giving another handle on the
    same keys (a second client, a second opener of the file; the same object for a HashStore)."""
    opened: list[Store] = []

    def keep(s: Store) -> Store:
        opened.append(s)
        return s

    kind = request.param
    if kind == "hash":
        store = keep(HashStore())
        another = lambda: store  # noqa: E731  (a HashStore is one process's: its handle is itself)
    elif kind == "file":
        path = tmp_path / "store"
        store = keep(FileStore(str(path)))
        another = lambda: keep(FileStore(str(path)))  # noqa: E731
    elif kind.startswith("tcp"):  # "tcp-secret": every frame authenticated (comm/stores/auth.py)
        secret = "s" * 32 if kind == "tcp-secret" else None
        store = keep(TCPStore("127.0.0.1", 0, is_master=True, world_size=1, timeout=timedelta(seconds=10),
                              secret=secret))
        another = lambda: keep(TCPStore("127.0.0.1", store.port, timeout=timedelta(seconds=10),  # noqa: E731
                                        secret=secret))
    else:
        inner = keep(TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10)))
        store = PrefixStore("job", inner)
        another = lambda: PrefixStore("job", keep(TCPStore("127.0.0.1", inner.port)))  # noqa: E731
    store.set_timeout(SHORT)
    yield store, another
    for s in reversed(opened):
        s.close()


def test_set_and_get_bytes_and_str(stores):
    store, another = stores
    store.set("k", "välue")
    store.set("b", b"\x00\xff")
    assert store.get("k") == "välue".encode() and isinstance(store.get("k"), bytes)
    assert another().get("b") == b"\x00\xff"
    store.set("k", b"second")  # set replaces
    assert another().get("k") == b"second"
    store.set("empty", b"")
    assert store.get("empty") == b""
    big = os.urandom(3 << 20)  # more than a socket buffer: the server's reply goes out in several sends
    store.set("big", big)
    assert another().get("big") == big


def test_get_of_a_missing_key_raises_dist_store_error_naming_it_and_the_time_waited(stores):
    store, _ = stores
    start = time.monotonic()
    with pytest.raises(DistStoreError, match=r"get timed out after waiting 0\.[0-9]+ s for key\(s\) 'nope' "
                                             r"\(timeout 0\.3 s") as info:
        store.get("nope")
    assert 0.29 <= time.monotonic() - start < 3
    assert info.value.keys == ["nope"] and 0.29 <= info.value.waited < 3
    assert isinstance(info.value, meshkit.DistError)


def test_get_waits_for_a_key_another_handle_sets(stores):
    store, another = stores
    store.set_timeout(timedelta(seconds=10))
    other = another()
    threading.Timer(0.1, other.set, ("late", "here")).start()
    assert store.get("late") == b"here"


def test_add_counts_from_amount_returns_the_new_value_and_refuses_a_non_integer(stores):
    store, another = stores
    assert store.add("n", 5) == 5
    assert another().add("n", -7) == -2
    assert store.add("n", 0) == -2
    assert store.get("n") == b"-2"
    store.set("n", "40")  # a counter set by hand is a counter
    assert store.add("n", 2) == 42
    store.set("text", "abc")
    with pytest.raises(ValueError, match=r"Store\.add\('text', 1\): key 'text' holds b'abc', not an integer"):
        store.add("text", 1)
    assert store.get("text") == b"abc"
    with pytest.raises(TypeError, match=r"add\('n', amount\): amount must be an int, got float 1.5"):
        store.add("n", 1.5)
    with pytest.raises(TypeError, match="amount must be an int, got bool"):
        store.add("n", True)


def test_compare_set_follows_torchs_rule(stores):
    store, _ = stores
    # missing key, expected "": set
    assert store.compare_set("a", "", "first") == b"first"
    assert store.get("a") == b"first"
    # missing key, expected something: nothing set, expected returned (torch's HashStore/TCPStore)
    assert store.compare_set("b", "x", "y") == b"x"
    assert not store.check(["b"])
    # held == expected: set
    assert store.compare_set("a", "first", "second") == b"second"
    # held != expected: unchanged, the value held returned
    assert store.compare_set("a", "other", "third") == b"second"
    assert store.get("a") == b"second"


def test_check_answers_now_without_waiting(stores):
    store, _ = stores
    store.set_timeout(timedelta(seconds=10))
    store.set("x", "1")
    start = time.monotonic()
    assert store.check(["x"]) is True
    assert store.check(["x", "y"]) is False
    assert store.check([]) is True
    assert time.monotonic() - start < 5  # a check that waited would take the 10 s timeout


def test_wait_returns_when_keys_are_set_and_times_out_naming_only_the_missing_ones(stores):
    store, another = stores
    other = another()
    store.set("a", "1")
    threading.Timer(0.1, other.set, ("b", "2")).start()
    store.wait(["a", "b"], timedelta(seconds=10))
    store.wait([])
    start = time.monotonic()
    with pytest.raises(DistStoreError, match=r"wait timed out after waiting 0\.[0-9]+ s for key\(s\) 'c', 'd' "
                                             r"\(timeout 0\.2 s") as info:
        store.wait(["a", "c", "d"], timeout=timedelta(seconds=0.2))
    assert info.value.keys == ["c", "d"]
    assert 0.19 <= time.monotonic() - start < 3
    with pytest.raises(DistStoreError, match=r"for key\(s\) 'c' \(timeout 0\.3 s"):  # the store's timeout
        store.wait(["c"])


def test_a_key_deleted_while_waited_for_is_waited_for_again(stores):
    store, another = stores
    other = another()

    def churn():
        other.set("a", "1")
        other.delete_key("a")
        time.sleep(0.05)
        other.set("b", "1")
        time.sleep(0.05)
        other.set("a", "2")

    threading.Timer(0.05, churn).start()
    store.wait(["a", "b"], timedelta(seconds=10))
    assert store.get("a") == b"2"


def test_delete_key_says_whether_the_key_was_there(stores):
    store, _ = stores
    store.set("k", "v")
    assert store.num_keys() == 1
    assert store.delete_key("k") is True
    assert store.delete_key("k") is False  # torch's FileStore says True here
    assert store.delete_key("never") is False
    assert store.num_keys() == 0
    store.set_timeout(0.05)
    with pytest.raises(DistStoreError, match="'k'"):
        store.get("k")


def test_num_keys_counts_the_users_keys_only(stores):
    store, another = stores
    another()  # a second user (a TCP client joins, a FileStore user counts itself in): no key of the user's
    assert store.num_keys() == 0
    store.set("a", "1")
    store.add("b", 1)
    store.compare_set("c", "", "x")
    assert store.num_keys() == 3


def test_timeout_property_and_set_timeout(stores):
    store, _ = stores
    assert store.timeout == SHORT
    store.set_timeout(timedelta(seconds=2))
    assert store.timeout == timedelta(seconds=2)
    store.set_timeout(1.5)  # seconds as a number too
    assert store.timeout == timedelta(seconds=1.5)
    with pytest.raises(TypeError, match="timeout must be a datetime.timedelta .*got str '5'"):
        store.set_timeout("5")
    with pytest.raises(ValueError, match=r"timeout must be finite and >= 0 seconds, got datetime.timedelta\(days=-1"):
        store.set_timeout(timedelta(seconds=-1))
    with pytest.raises(ValueError, match="timeout must be finite"):
        store.wait(["a"], timeout=float("inf"))


def test_bad_keys_and_values_are_refused_naming_the_argument(stores):
    store, _ = stores
    with pytest.raises(TypeError, match="key must be a str, got int 3"):
        store.set(3, "v")
    with pytest.raises(TypeError, match="value must be str or bytes, got int 3"):
        store.set("k", 3)
    with pytest.raises(TypeError, match="desired_value must be str or bytes, got NoneType"):
        store.compare_set("k", "", None)
    with pytest.raises(TypeError, match="keys must be a list of str, got str 'ab'"):
        store.check("ab")
    with pytest.raises(TypeError, match="each of keys must be a str, got int 1"):
        store.wait(["a", 1])
    with pytest.raises(ValueError, match=f"value of {wire.MAX_VALUE_BYTES + 1} bytes is over the stores' limit of "
                                         f"{wire.MAX_VALUE_BYTES} bytes"):
        store.set("big", bytes(wire.MAX_VALUE_BYTES + 1))
    assert store.num_keys() == 0


def test_concurrent_adds_through_one_handle_and_through_several_lose_nothing(stores):
    store, another = stores
    handles = [store, store, another(), another()]

    def work(h):
        for _ in range(50):
            h.add("n", 1)

    threads = [threading.Thread(target=work, args=(h,)) for h in handles for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert int(store.get("n")) == 400


def test_a_thread_blocked_in_wait_does_not_hold_up_another_threads_set_on_the_same_handle(stores):
    store, _ = stores
    store.set_timeout(timedelta(seconds=10))
    got = []
    waiter = threading.Thread(target=lambda: got.append(store.get("k")))
    waiter.start()
    time.sleep(0.1)
    store.set("k", "v")  # the same object: a lock held across the wait would deadlock here
    waiter.join(10)
    assert got == [b"v"]


def test_a_closed_store_says_so(stores):
    store, _ = stores
    store.close()
    with pytest.raises(DistStoreError, match="set on a closed store"):
        store.set("k", "v")


# --------------------------------------------------------------------------- PrefixStore
def test_prefix_store_keys_live_under_prefix_slash_and_num_keys_counts_its_own():
    base = HashStore()
    base.set("other", "1")
    a, b = PrefixStore("a", base), PrefixStore("b", base)
    a.set("k", "in a")
    b.add("k", 3)
    assert base.get("a/k") == b"in a" and base.get("b/k") == b"3"
    assert a.num_keys() == 1 and b.num_keys() == 1 and base.num_keys() == 3
    nested = PrefixStore("inner", a)
    nested.set("x", "1")
    assert base.get("a/inner/x") == b"1"
    assert a.num_keys() == 2 and nested.num_keys() == 1
    assert nested.underlying_store is a
    nested.set_timeout(0.1)
    with pytest.raises(DistStoreError, match=r"prefix 'inner/' of PrefixStore \(prefix 'a/' of HashStore\)\): wait timed out .* "
                                             r"for key\(s\) 'missing' \(") as info:
        nested.wait(["x", "missing"])
    assert info.value.keys == ["missing"]
    assert a.timeout == base.timeout  # set_timeout changed the view only
    with pytest.raises(TypeError, match="store must be a meshkit Store, got dict"):
        PrefixStore("p", {})
    with pytest.raises(TypeError, match="prefix must be a str, got int 1"):
        PrefixStore(1, base)


# --------------------------------------------------------------------------- FileStore
def test_file_store_deletes_its_file_when_the_last_of_world_size_users_closes(tmp_path):
    path = tmp_path / "store"
    first = FileStore(str(path), world_size=2)
    first.set("k", "v")
    first.close()
    first.close()  # idempotent: counted out once
    assert path.exists()  # one of two users finished
    with FileStore(path, world_size=2) as second:
        assert second.get("k") == b"v"
        assert second.num_keys() == 1  # the users' count is not a key
    assert not path.exists()
    unbounded = FileStore(str(tmp_path / "kept"))  # world_size=-1: never deleted
    unbounded.close()
    assert (tmp_path / "kept").exists()


def test_file_store_refuses_bad_arguments_and_a_foreign_file(tmp_path):
    with pytest.raises(ValueError, match=r"world_size must be -1 \(unknown\) or an int >= 1, got 0"):
        FileStore(str(tmp_path / "s"), world_size=0)
    with pytest.raises(TypeError, match="file_name must be a path, got int 3"):
        FileStore(3)
    with pytest.raises(DistStoreError, match="cannot open the file"):
        FileStore(str(tmp_path / "no" / "such" / "dir" / "s"))
    (tmp_path / "foreign").write_text("hello")
    with pytest.raises(DistStoreError, match=r"foreign': its mode is 0644: others may read or write it"):
        FileStore(str(tmp_path / "foreign"))
    (tmp_path / "foreign").chmod(0o600)
    with pytest.raises(DistStoreError, match="the file is not a meshkit FileStore"):
        FileStore(str(tmp_path / "foreign"))


# --------------------------------------------------------------------------- TCPStore
def _raw(port: int, greeted: bool = True) -> socket.socket:
    """A raw connection to an open server, past its greeting (``greeted``)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    if greeted:
        status, fields = _read_frame(s)
        assert status == wire.Status.OK and fields[:2] == [wire.GREETING, b"open"], fields
    return s


def _read_frame(sock: socket.socket) -> tuple[int, list[bytes]]:
    """One frame, read byte-exact (the frames after it stay in the socket)."""
    def exactly(n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = sock.recv(min(n - len(data), 1 << 20))
            assert chunk, f"closed after {len(data)} of {n} bytes"
            data += chunk
        return bytes(data)

    (n,) = struct.unpack("!I", exactly(4))
    return wire.fields_of(exactly(n))


@pytest.fixture
def master():
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    yield store
    store.close()


def test_port_zero_picks_a_free_port_and_the_server_binds_the_address_given():
    store = TCPStore("127.0.0.2", 0, is_master=True, timeout=timedelta(seconds=5))
    try:
        assert 0 < store.port < 65536 and store.host == "127.0.0.2"
        client = TCPStore("127.0.0.2", store.port)
        client.set("k", "v")
        assert store.get("k") == b"v"
        with pytest.raises(ConnectionRefusedError):  # bound to 127.0.0.2 only, not every address
            socket.create_connection(("127.0.0.1", store.port), timeout=5)
        client.close()
    finally:
        store.close()
    everywhere = TCPStore("0.0.0.0", 0, is_master=True, timeout=timedelta(seconds=5))  # every interface
    with TCPStore("127.0.0.1", everywhere.port, timeout=timedelta(seconds=5)) as client:
        client.set("k", "v")
        assert everywhere.get("k") == b"v"
    everywhere.close()


def test_a_port_in_use_is_an_error_naming_host_and_port(master):
    with pytest.raises(DistStoreError, match=rf"cannot listen on 127\.0\.0\.1:{master.port}: the port is in use"):
        TCPStore("127.0.0.1", master.port, is_master=True)


@pytest.mark.parametrize("host, match", [
    ("node-01:29500", r"'node-01:29500' is not a host name or address; pass the port separately"),
    ("two words", r"'two words' is not a host name or address"),
    ("", r"'' is not a host name or address"),
    ("no-such-host.invalid", r"'no-such-host.invalid' does not resolve to an address"),
])
def test_a_malformed_host_is_an_error_naming_it(host, match):
    with pytest.raises(ValueError, match=match):
        TCPStore(host, 29500, timeout=timedelta(seconds=1))


def test_bad_ports_and_world_sizes_are_refused():
    with pytest.raises(ValueError, match=r"port must be an int in \[0, 65535\], got 70000"):
        TCPStore("127.0.0.1", 70000)
    with pytest.raises(ValueError, match=r"port=0 \(pick a free port\) is for the master"):
        TCPStore("127.0.0.1", 0)
    with pytest.raises(ValueError, match=r"world_size must be None or an int >= 1 .*got 0"):
        TCPStore("127.0.0.1", 0, world_size=0, is_master=True)


def test_a_client_retries_until_the_timeout_then_names_host_port_and_the_time():
    port = free_port()  # nobody listens there
    start = time.monotonic()
    with pytest.raises(DistStoreError, match=rf"no server answered at 127\.0\.0\.1:{port} within the timeout of "
                                             rf"0\.5 s \(waited [0-9.]+ s; last error: .*refused") as info:
        TCPStore("127.0.0.1", port, timeout=timedelta(seconds=0.5))
    assert 0.5 <= info.value.waited <= time.monotonic() - start < 3


def test_a_client_retries_until_the_master_comes_up():
    port = free_port()
    box = []
    t = threading.Thread(target=lambda: box.append(TCPStore("127.0.0.1", port, timeout=timedelta(seconds=10))))
    t.start()
    time.sleep(0.3)  # the worker is up first, as under a launcher
    master = TCPStore("127.0.0.1", port, is_master=True, world_size=2, timeout=timedelta(seconds=10))
    t.join(10)
    box[0].set("k", "v")
    assert master.get("k") == b"v"
    box[0].close()
    master.close()


def test_a_listener_that_never_answers_is_an_error_naming_it():
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        port = mute.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(DistStoreError, match=rf"the server at 127\.0\.0\.1:{port} did not answer within 0\.4 s"):
            TCPStore("127.0.0.1", port, timeout=timedelta(seconds=0.4))
        assert time.monotonic() - start < 3


def test_wait_for_workers_raises_within_the_timeout_naming_how_many_arrived():
    port = free_port()
    worker = threading.Thread(target=lambda: TCPStore("127.0.0.1", port, timeout=timedelta(seconds=5)).close())
    worker.start()
    start = time.monotonic()
    with pytest.raises(DistStoreError, match=rf"TCPStore at 127\.0\.0\.1:{port}: 2 of world_size=3 users \(the master "
                                             r"included\) connected within the timeout of 1\.5 s"):
        TCPStore("127.0.0.1", port, is_master=True, world_size=3, timeout=timedelta(seconds=1.5))
    assert time.monotonic() - start < 4
    worker.join(10)
    TCPStore("127.0.0.1", port, is_master=True).close()  # the failed master let its port go


def test_the_server_survives_a_client_that_leaves_halfway_through_a_request(master):
    half = wire.request(wire.Op.SET, b"key", b"value")[:-3]
    for cut in (2, 7, len(half)):  # inside the header, inside a field, all but the last bytes
        s = _raw(master.port)
        s.sendall(half[:cut])
        s.close()
    parked = _raw(master.port)  # a client that leaves while its wait is parked
    parked.sendall(wire.request(wire.Op.WAIT, b"30", b"later"))
    time.sleep(0.05)
    parked.close()
    time.sleep(0.05)
    master.set("later", "1")
    client = TCPStore("127.0.0.1", master.port)
    assert client.add("n", 1) == 1 and master.get("later") == b"1"
    assert not master.check(["key"]) and master.num_keys() == 2
    client.close()


def test_a_frame_over_the_limit_is_refused_before_it_is_allocated(master):
    s = _raw(master.port)
    s.sendall(struct.pack("!I", 0xFFFFFFF0) + b"\x02")  # claims 4 GiB
    status, fields = _read_frame(s)
    assert status == wire.Status.ERROR
    assert f"a frame of {0xFFFFFFF0} bytes is over the limit of {wire.MAX_MESSAGE_BYTES} bytes" in fields[0].decode()
    assert s.recv(16) == b""  # and the connection closed
    s.close()
    garbled = _raw(master.port)
    garbled.sendall(wire.frame(b"\x04" + struct.pack("!I", 99) + b"short"))  # a field running past its frame
    status, fields = _read_frame(garbled)
    assert status == wire.Status.ERROR and b"a malformed request" in fields[0]
    garbled.close()
    for timeout in (b"inf", b"nan", b"-1", b"1e300"):  # the server's loop must not take these as its own timeout
        endless = _raw(master.port)
        endless.sendall(wire.request(wire.Op.WAIT, timeout, b"never"))
        status, fields = _read_frame(endless)
        assert status == wire.Status.ERROR and b"timeout must be finite and >= 0 seconds" in fields[0], fields
        endless.close()
    master.set("still", "serving")
    assert master.get("still") == b"serving"


def test_a_client_that_sends_without_reading_gets_one_reply_buffered_at_a_time(master):
    big = bytes(3 << 20)
    master.set("big", big)
    greedy = _raw(master.port)
    greedy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    greedy.sendall(wire.request(wire.Op.GET, b"5", b"big") * 20)  # 60 MiB of replies asked for, none read
    time.sleep(0.3)
    conns = [k.data for k in master._server._selector.get_map().values() if not isinstance(k.data, str)]
    buffered = sum(len(c.outbuf) for c in conns)
    assert 0 < buffered <= len(big) + 64, buffered  # one reply in flight, not 20
    assert master.get("big") == big  # and everyone else is served meanwhile
    head = greedy.recv(9, socket.MSG_WAITALL)  # the first reply's start (the rest crawls through a 4 KiB window)
    assert struct.unpack("!IBI", head) == (len(big) + 5, wire.Status.OK, len(big)), head
    greedy.close()


def test_a_client_of_a_master_that_closed_gets_an_error_naming_it(master):
    client = TCPStore("127.0.0.1", master.port, timeout=timedelta(seconds=2))
    client.set("k", "v")
    master.close()
    with pytest.raises(DistStoreError, match=rf"TCPStore at 127\.0\.0\.1:{master.port}: (get failed|no server answered)"):
        client.get("k")
    client.close()


# --------------------------------------------------------------------------- across real processes
def _spawn(*args: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(procs: list[subprocess.Popen]) -> list[str]:
    lines = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        lines.append(out.strip())
    return lines


def test_tcp_store_across_processes_128_clients_lose_no_add_and_rendezvous():
    """2 processes x 64 client threads x 1000 adds on one counter, started before their master (they
    retry), which waits for all 129 users; then every process waits for every other's key."""
    nprocs, clients, adds = 2, 64, 1000
    port = free_port()
    procs = [_spawn("tcp", port, r, nprocs, clients, adds) for r in range(nprocs)]
    master = TCPStore("127.0.0.1", port, is_master=True, world_size=nprocs * clients + 1,
                      timeout=timedelta(seconds=90))
    try:
        start = time.monotonic()
        master.wait(["all_finished"])
        took = time.monotonic() - start
        lines = _finish(procs)
        total = nprocs * clients * adds
        assert sorted(lines) == [f"rank {r} saw {total}" for r in range(nprocs)]
        assert int(master.get("count")) == total
        assert master.num_keys() == 3 + nprocs  # count, finished, all_finished, rank/*
        print(f"{total} adds from {nprocs * clients} clients in {took:.2f} s ({total / took:.0f} adds/s)")
    finally:
        for p in procs:
            p.kill()
        master.close()


def test_file_store_across_processes_counts_rendezvouses_and_is_deleted_by_the_last(tmp_path):
    nprocs, adds = 3, 100
    path = tmp_path / "store"
    procs = [_spawn("file", path, r, nprocs, adds) for r in range(nprocs)]
    lines = _finish(procs)
    assert sorted(lines) == [f"rank {r} saw {nprocs * adds}" for r in range(nprocs)]
    assert not path.exists(), "the last of world_size users to close it deletes the file"


def test_the_stores_are_meshkits_public_api():
    for name in ("Store", "HashStore", "FileStore", "TCPStore", "PrefixStore", "DistStoreError"):
        assert name in meshkit.comm.__all__ and getattr(meshkit, name) is getattr(meshkit.comm, name)
    assert issubclass(DistStoreError, meshkit.DistError)
    assert all(issubclass(c, Store) for c in (HashStore, FileStore, TCPStore, PrefixStore))
    assert os.path.basename(meshkit.comm.stores.wire.__file__) == "wire.py"


def test_a_hash_store_is_the_rendezvous_of_the_local_engines_ranks():
    """The ``local`` engine's ranks are threads of one process: a HashStore shared by them is their
    rendezvous, with add as the arrival counter."""
    from meshkit.comm import local

    store = HashStore()
    store.set_timeout(10)

    def body():
        rank = meshkit.get_rank()
        store.set(f"addr/{rank}", f"rank-{rank}")
        if store.add("arrived", 1) == meshkit.get_world_size():
            store.set("go", "1")
        store.wait(["go"])
        return [store.get(f"addr/{r}") for r in range(meshkit.get_world_size())]

    assert local.run(body, 4) == [[b"rank-0", b"rank-1", b"rank-2", b"rank-3"]] * 4
    assert store.get("arrived") == b"4" and store.num_keys() == 6


def test_try_get_waits_up_to_its_timeout_and_gives_none_instead_of_raising(stores):
    store, another = stores
    start = time.monotonic()
    assert store.try_get("absent", 0.2) is None
    assert 0.19 <= time.monotonic() - start < 3
    threading.Timer(0.1, another().set, ("late", "here")).start()
    assert store.try_get("late", timedelta(seconds=10)) == b"here"
    with pytest.raises(ValueError, match=r"timeout must be finite and >= 0 seconds, got -1"):
        store.try_get("k", -1)


# --------------------------------------------------------------------------- torch 2.13's later methods
def test_multi_get_multi_set_append_and_list_keys(stores, monkeypatch):
    from meshkit.comm.stores import store as store_module, tcp_server

    for module in (store_module, tcp_server):  # the value limit, lowered: 16 MiB values cost a second a store
        monkeypatch.setattr(module, "MAX_VALUE_BYTES", 1024)
    store, another = stores
    store.multi_set(["a", "b", "a"], ["1", b"\x00", "3"])  # a key given twice: its last value
    other = another()
    assert other.multi_get(["b", "a"]) == [b"\x00", b"3"] and store.multi_get([]) == []
    store.append("s", "po")
    other.append("s", b"tato")
    assert store.get("s") == b"potato"
    assert store.list_keys() == ["a", "b", "s"] == other.list_keys() and store.num_keys() == 3
    store.set_timeout(0.05)  # a timeout that must fire: short
    with pytest.raises(DistStoreError, match=r"multi_get timed out after waiting 0\.[0-9]+ s for key\(s\) 'nope' "
                                             r"\(timeout 0\.05 s") as info:
        store.multi_get(["a", "nope"])
    assert info.value.keys == ["nope"]
    threading.Timer(0.05, lambda: other.set("late", "x")).start()
    store.set_timeout(timedelta(seconds=5))
    assert store.multi_get(["a", "late"]) == [b"3", b"x"]  # waits for the last key
    with pytest.raises(ValueError, match=r"multi_set\(keys, values\): 2 keys but 1 values; give one value per key"):
        store.multi_set(["x", "y"], ["1"])
    with pytest.raises(TypeError, match=r"multi_set\(keys, values\): values must be a list of str or bytes, got str"):
        store.multi_set(["x"], "1")
    store.set("full", bytes(1023))
    with pytest.raises(ValueError, match=r"append\('full', ...\): 'full' holds 1023 bytes, and 2 more would pass the "
                                         r"stores' limit of 1024 bytes a value"):
        store.append("full", b"xy")
    assert len(other.get("full")) == 1023 and store.has_extended_api()


def test_queues_push_pop_in_order_wake_a_popper_and_are_not_keys(stores):
    store, another = stores
    other = another()
    assert store.queue_len("q") == 0 and not store.check(["q"])
    store.queue_push("q", "first")
    other.queue_push("q", b"second")
    assert other.queue_len("q") == 2 and store.check(["q"])
    store.wait(["q"])  # wait sees a non-empty queue, as torch's
    assert store.list_keys() == [] and store.num_keys() == 0  # a queue is not a key
    assert store.queue_pop("q") == b"first" and other.queue_pop("q", block=False) == b"second"
    with pytest.raises(meshkit.comm.stores.QueueEmptyError, match=r"queue_pop\('q', block=False\): the queue is empty"):
        store.queue_pop("q", block=False)
    store.set_timeout(0.05)  # a timeout that must fire: short
    with pytest.raises(DistStoreError, match=r"queue_pop timed out after waiting 0\.[0-9]+ s for key\(s\) 'q' "
                                             r"\(timeout 0\.05 s.*\): no one pushed onto it in time"):
        store.queue_pop("q")
    store.set_timeout(timedelta(seconds=5))
    threading.Timer(0.05, lambda: other.queue_push("q", "late")).start()
    assert store.queue_pop("q") == b"late" and store.queue_len("q") == 0
    store.set("q", "a key of the same name")  # lives beside the queue
    store.queue_push("q", "v")
    assert store.get("q") == b"a key of the same name" and store.queue_pop("q") == b"v"


def test_a_clone_is_another_handle_for_another_thread(stores):
    store, _ = stores
    store.set_timeout(timedelta(seconds=5))
    clones = [store.clone() for _ in range(4)]
    assert all(c.timeout == store.timeout for c in clones)

    def work(c: Store, i: int) -> None:
        for _ in range(25):
            c.add("n", 1)
        c.queue_push("done", str(i))

    threads = [threading.Thread(target=work, args=(c, i)) for i, c in enumerate(clones)]
    for t in threads:
        t.start()
    assert sorted(store.queue_pop("done") for _ in range(4)) == [b"0", b"1", b"2", b"3"]
    for t in threads:
        t.join()
    assert store.get("n") == b"100"
    for c in clones:
        c.close()
    assert store.get("n") == b"100"  # closing a clone leaves the store open
    with pytest.raises(DistStoreError, match=r"get on a closed store"):
        clones[0].get("n")


def test_barrier_waits_for_world_size_callers_and_serves_again(stores):
    store, _ = stores
    store.set_timeout(timedelta(seconds=10))
    passed: list[int] = []

    def member(c: Store) -> None:
        for round_ in range(3):
            c.barrier("b", 3)
            passed.append(round_)

    handles = [store.clone() for _ in range(2)]
    threads = [threading.Thread(target=member, args=(h,)) for h in handles]
    for t in threads:
        t.start()
    for round_ in range(3):
        time.sleep(0.02)
        assert passed.count(round_) == 0  # nobody passes round r before the third caller arrives
        store.barrier("b", 3)
        while passed.count(round_) < 2:
            time.sleep(0.002)
    for t in threads:
        t.join()
    assert passed == [0, 0, 1, 1, 2, 2] and store.list_keys() == ["b/arrived", "b/done/2"]
    with pytest.raises(DistStoreError, match=r"barrier\('lonely', world_size=2\) timed out after waiting 0\.[0-9]+ s "
                                             r"\(timeout 0\.1 s.*\): 1 of 2 callers arrived; the others never called"):
        store.barrier("lonely", 2, timeout=0.1)
    with pytest.raises(ValueError, match=r"barrier\('x', world_size\): world_size must be an int >= 1, got 0"):
        store.barrier("x", 0)
    for h in handles:
        h.close()


def test_a_timeout_of_zero_is_refused_where_torch_waits_without_limit(stores):
    """torch reads ``set_timeout(timedelta(0))`` as no limit; meshkit's get then raised at once.
    meshkit bounds every wait, so it refuses 0 naming what to give (docs/stores.md)."""
    store, _ = stores
    with pytest.raises(ValueError, match=r"timeout must be positive, got datetime.timedelta\(0\): torch reads 0 as "
                                         r"'wait without limit', and meshkit's stores bound every wait; give the "
                                         r"longest wait you accept"):
        store.set_timeout(timedelta(0))
    assert store.timeout == SHORT  # unchanged
    with pytest.raises(ValueError, match=r"timeout must be positive, got 0"):
        TCPStore("127.0.0.1", 0, is_master=True, timeout=0)
    assert store.try_get("nope", 0) is None  # a bound of 0 where a call takes one: look once


def test_the_servers_bounds_hold_for_the_new_requests(monkeypatch):
    """multi_set, append and queue_push are held within MESHKIT_STORE_MAX_BYTES; multi_get names
    at most MESHKIT_STORE_MAX_WAIT_KEYS keys; a multi_get or list_keys reply over the frame limit is
    refused naming it (limit lowered here: 16 MiB values would take 64 MiB per reply)."""
    from meshkit.comm.stores import tcp_server

    monkeypatch.setenv("MESHKIT_STORE_MAX_BYTES", str(1 << 20))
    monkeypatch.setenv("MESHKIT_STORE_MAX_WAIT_KEYS", "4")
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    half = bytes(600 << 10)
    store.queue_push("q", half)
    for refused in (lambda: store.queue_push("q", half), lambda: store.append("a", half),
                    lambda: store.multi_set(["x", "y"], [half[:400 << 10], half[:400 << 10]])):
        with pytest.raises(DistStoreError, match=r"would pass the server's memory limit \(MESHKIT_STORE_MAX_BYTES="
                                                 r"1048576"):
            refused()
    assert store.queue_pop("q") == half and store.list_keys() == []  # nothing of the refused ones was kept
    store.append("a", half)  # room again once popped
    with pytest.raises(DistStoreError, match=r"multi_get names 5 keys, over the limit of 4 "
                                             r"\(MESHKIT_STORE_MAX_WAIT_KEYS\)"):
        store.multi_get(["a"] * 5)
    monkeypatch.setattr(tcp_server, "MAX_MESSAGE_BYTES", 512 << 10)
    store.multi_set(["k1", "k2"], [bytes(300 << 10), bytes(100 << 10)])
    with pytest.raises(DistStoreError, match=r"multi_get's reply of \d+ bytes \(3 fields\) is over the limit of "
                                             r"524288 bytes \(meshkit.comm.stores.wire.MAX_MESSAGE_BYTES\); ask for "
                                             r"fewer keys at once"):
        store.multi_get(["a", "k1", "k2"])
    assert store.multi_get(["k1", "k2"])[1] == bytes(100 << 10) and store.list_keys() == ["a", "k1", "k2"]
    store.close()
