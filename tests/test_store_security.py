"""The stores admit no one else: TCPStore's mutual authentication with the job's
secret (a handshake per connection), FileStore's private, exclusive files, and the TCPStore server's bounds.

Each attack is made as an outsider would make it (another local user through setpriv where this
machine allows it, else the same attack from this uid without the secret), and the job's own
traffic is checked to work after it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import stat
import struct
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from meshkit import DistStoreError, FileStore, TCPStore
from meshkit.comm.setup import init_methods
from meshkit.comm.stores import auth, wire
from outsider import can_run_as_outsider, run_as_outsider

SECRET = secrets.token_hex(32)
OTHER = secrets.token_hex(32)
T = timedelta(seconds=10)


@pytest.fixture(autouse=True)
def no_job_secret(monkeypatch):
    """Each test names the secrets it uses; none comes from the environment."""
    for name in ("MESHKIT_JOB_SECRET", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "PBS_JOBID", "LSB_JOBID"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def master():
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=T, secret=SECRET)
    store.set("job/key", "mine")
    yield store
    store.close()


def _body(sock: socket.socket) -> bytes:
    """One frame's body, read byte-exact."""
    def exactly(n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionResetError(f"closed after {len(data)} of {n} bytes")
            data += chunk
        return bytes(data)

    (n,) = struct.unpack("!I", exactly(4))
    return exactly(n)


def _frame(sock: socket.socket) -> tuple[int, list[bytes]]:
    return wire.fields_of(_body(sock))


@pytest.fixture
def shared_dir():
    """A folder every local user may write, with the sticky bit, as /tmp (pytest's tmp_path lies
    under a folder only this user can enter, where no outsider could plant anything)."""
    path = tempfile.mkdtemp(prefix="meshkit-shared-", dir="/tmp")
    os.chmod(path, 0o1777)
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


def _server(store: TCPStore):
    return store._server


def _untouched(store: TCPStore) -> None:
    """The job's keys are as the job left them, and the job's own traffic still works."""
    assert store.num_keys() == 1 and store.get("job/key") == b"mine"
    with TCPStore("127.0.0.1", store.port, timeout=T, secret=SECRET) as rank:
        assert rank.add("job/count", 1) == 1
    store.delete_key("job/count")


# --------------------------------------------------------------------------- who gets in
def test_a_client_without_the_secret_is_refused_at_connect_and_the_keys_are_untouched(master):
    start = time.monotonic()
    with pytest.raises(DistStoreError, match=r"the server requires the job's secret and this process has none: set "
                                             r"MESHKIT_JOB_SECRET"):
        TCPStore("127.0.0.1", master.port, timeout=T)
    assert time.monotonic() - start < 2  # refused at once, not retried to the timeout
    with pytest.raises(DistStoreError, match=r"authentication failed: this client does not know the job's secret"):
        TCPStore("127.0.0.1", master.port, timeout=T, secret=OTHER)
    _untouched(master)


def test_a_raw_client_that_skips_the_handshake_reads_and_writes_nothing(master):
    s = socket.create_connection(("127.0.0.1", master.port), timeout=5)
    status, (greeting, mode, nonce) = _frame(s)
    assert (status, greeting, mode, len(nonce)) == (wire.Status.OK, wire.GREETING, auth.MODE_AUTH, auth.NONCE_BYTES)
    s.sendall(wire.request(wire.Op.SET, b"job/key", b"theirs"))
    status, fields = _frame(s)
    assert status == wire.Status.ERROR and b"this store requires the job's secret: authenticate first" in fields[0]
    assert s.recv(16) == b""  # closed
    s.close()
    big = socket.create_connection(("127.0.0.1", master.port), timeout=5)
    _frame(big)
    big.sendall(struct.pack("!I", 100_000) + b"\x02")  # 100 KB announced before authenticating
    status, fields = _frame(big)
    assert status == wire.Status.ERROR and b"a frame of 100000 bytes before authenticating" in fields[0]
    big.close()
    _untouched(master)


def _authenticated(port: int, secret: str = SECRET) -> tuple[socket.socket, bytes, bytes]:
    """A raw connection that authenticated as a meshkit client does: the socket and its
    ``(client nonce, proof)``."""
    key = auth.store_key(secret.encode())
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    _, (_, _, server_nonce) = _frame(s)
    client_nonce = auth.nonce()
    proof = auth.client_proof(key, server_nonce, client_nonce)
    s.sendall(wire.request(wire.Op.AUTH, client_nonce, proof))
    status, (theirs,) = _frame(s)
    assert status == wire.Status.OK and theirs == auth.server_proof(key, server_nonce, client_nonce)
    return s, client_nonce, proof


def test_a_captured_handshake_cannot_be_replayed_or_reflected(master):
    """What an eavesdropper saw of one connection's handshake opens no other: each connection's
    proof covers the server's fresh nonce, and the two sides' proofs carry different labels."""
    s, client_nonce, proof = _authenticated(master.port)
    s.sendall(wire.request(wire.Op.ADD, b"n", b"1"))
    assert _frame(s) == (wire.Status.OK, [b"1"])
    s.close()
    replay = socket.create_connection(("127.0.0.1", master.port), timeout=5)
    _, (_, _, fresh) = _frame(replay)
    replay.sendall(wire.request(wire.Op.AUTH, client_nonce, proof))  # the captured answer, another nonce
    status, fields = _frame(replay)
    assert status == wire.Status.ERROR and b"authentication failed" in fields[0]
    assert replay.recv(16) == b""
    replay.close()
    key = auth.store_key(SECRET.encode())
    assert auth.client_proof(key, fresh, client_nonce) != auth.server_proof(key, fresh, client_nonce)
    assert master.get("n") == b"1"
    master.delete_key("n")
    _untouched(master)


# --------------------------------------------------------------------------- squatters
def test_a_client_refuses_a_squatter_on_the_port():
    """Whatever listens on the port first cannot pass for the job's store: not an open store, not a
    store of another job, not a fake that greets and echoes."""
    open_squatter = TCPStore("127.0.0.1", 0, is_master=True, timeout=T)
    with pytest.raises(DistStoreError, match=r"the server does not authenticate .* refusing it: it may be another "
                                             r"program squatting on the port"):
        TCPStore("127.0.0.1", open_squatter.port, timeout=T, secret=SECRET)
    open_squatter.close()
    other_job = TCPStore("127.0.0.1", 0, is_master=True, timeout=T, secret=OTHER)
    with pytest.raises(DistStoreError, match="authentication failed"):
        TCPStore("127.0.0.1", other_job.port, timeout=T, secret=SECRET)
    assert other_job.num_keys() == 0
    other_job.close()

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    seen: list[bytes] = []

    def fake() -> None:  # greets as an authenticating store, then answers with the client's own proof
        conn, _ = listener.accept()
        conn.sendall(wire.reply(wire.Status.OK, wire.GREETING, auth.MODE_AUTH, auth.nonce()))
        _, (client_nonce, proof) = _frame(conn)
        seen.append(proof)
        conn.sendall(wire.reply(wire.Status.OK, proof))
        time.sleep(0.5)
        conn.close()

    t = threading.Thread(target=fake)
    t.start()
    with pytest.raises(DistStoreError, match=r"the server did not prove that it knows the job's secret"):
        TCPStore("127.0.0.1", listener.getsockname()[1], timeout=T, secret=SECRET)
    t.join(5)
    listener.close()
    assert seen and SECRET.encode() not in seen[0]  # the proof reveals nothing of the secret


def test_env_rendezvous_refuses_a_squatter_on_master_port(monkeypatch):
    """An outsider serves a store on MASTER_PORT before rank 0 does. Rank 0
    cannot listen there (named), and rank 1 refuses the squatter instead of taking its answers."""
    squatter = TCPStore("127.0.0.1", 0, is_master=True, timeout=T)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(squatter.port))
    monkeypatch.setenv("MESHKIT_JOB_SECRET", SECRET)
    asked = init_methods.requested("env://", 2, 1, None)
    with pytest.raises(DistStoreError, match="does not authenticate"):
        init_methods.rendezvous(asked, 5)
    with pytest.raises(DistStoreError, match="the port is in use"):
        init_methods.rendezvous(init_methods.requested("env://", 2, 0, None), 5)
    assert squatter.num_keys() == 0
    squatter.close()


@pytest.mark.skipif(not can_run_as_outsider(), reason="needs root and setpriv to run code as another user")
def test_another_user_cannot_use_the_store_or_its_file(master, shared_dir):
    """As user nobody: a client with no secret (it cannot read the job's environment) is refused,
    and the job's FileStore file can be neither read nor replaced."""
    code = r"""
import socket, struct, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5)
def frame():
    n = struct.unpack("!I", s.recv(4, socket.MSG_WAITALL))[0]
    return s.recv(n, socket.MSG_WAITALL)
frame()  # the greeting
body = bytes([2]) + struct.pack("!I", 7) + b"job/key" + struct.pack("!I", 6) + b"theirs"
s.sendall(struct.pack("!I", len(body)) + body)
print("reply", frame()[:1] == bytes([3]))
try:
    open(sys.argv[2], "rb").read()
    print("read the store file")
except PermissionError:
    print("file denied")
try:
    import os; os.unlink(sys.argv[2]); print("deleted the store file")
except PermissionError:
    print("unlink denied")
"""
    store_file = shared_dir / "store"
    fs = FileStore(store_file, secret=SECRET)
    fs.set("k", "v")
    proc = run_as_outsider(code, str(master.port), str(store_file))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:3] == ["reply True", "file denied", "unlink denied"], proc.stdout
    _untouched(master)
    assert fs.get("k") == b"v"
    fs.close()


# --------------------------------------------------------------------------- files of the job's own
def test_a_file_store_is_created_exclusively_with_mode_0600_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        store = FileStore(tmp_path / "s", secret=SECRET)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "s").st_mode) == 0o600
    assert store.authenticated
    store.close()


def test_a_file_store_refuses_a_symlink_a_fifo_and_a_file_others_may_write(tmp_path):
    target = tmp_path / "mine"
    FileStore(target, secret=SECRET).close()
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(DistStoreError, match=r"link': it is a symbolic link \(to .*mine'\); refusing it"):
        FileStore(tmp_path / "link", secret=SECRET)
    (tmp_path / "zero").symlink_to("/dev/zero")
    with pytest.raises(DistStoreError, match="it is a symbolic link"):
        FileStore(tmp_path / "zero", secret=SECRET)
    os.mkfifo(tmp_path / "fifo", 0o600)
    start = time.monotonic()
    with pytest.raises(DistStoreError, match=r"fifo': it is not a regular file"):
        FileStore(tmp_path / "fifo", secret=SECRET)
    assert time.monotonic() - start < 2  # opened without waiting for a writer
    shared = tmp_path / "shared"
    FileStore(shared, secret=SECRET).close()
    shared.chmod(0o666)
    with pytest.raises(DistStoreError, match=r"its mode is 0666: others may read or write it"):
        FileStore(shared, secret=SECRET)


def test_a_file_another_user_planted_is_refused_naming_its_owner(shared_dir):
    planted = shared_dir / "rendezvous"
    if can_run_as_outsider():  # the attack as it happens: nobody pre-creates the job's path in a shared folder
        proc = run_as_outsider("import os, sys; os.close(os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY, 0o600))",
                               str(planted))
        assert proc.returncode == 0, proc.stderr
    elif os.geteuid() == 0:
        planted.write_bytes(b"")
        os.chown(planted, 65534, 65534)
    else:
        pytest.skip("needs another user to own a file: root, or setpriv")
    with pytest.raises(DistStoreError, match=r"rendezvous': it belongs to uid 65534"):
        FileStore(planted, secret=SECRET)


def test_two_jobs_on_one_path_never_form_one_world(tmp_path, monkeypatch):
    """An attack on the path (and the accident): a second job, or an outsider's file, on the path of a
    job's file:// rendezvous is refused, naming the path; the job's own second rank joins."""
    path = tmp_path / "rendezvous"
    job_a = FileStore(path, world_size=2, secret=SECRET)
    job_a.set("rank/0", "a0")
    with pytest.raises(DistStoreError, match=r"rendezvous': another job made it \(its job identity differs"):
        FileStore(path, world_size=2, secret=OTHER)
    with pytest.raises(DistStoreError, match=r"a job with an identity made it, and this process has none"):
        FileStore(path, world_size=2)  # no secret and no launcher's job id here
    same_job = FileStore(path, world_size=2, secret=SECRET)
    assert same_job.get("rank/0") == b"a0"
    job_a.close()
    same_job.close()
    assert not path.exists()
    # the identity of the rendezvous is the job's (the secret, else the launcher's job id)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    slurm = FileStore(path, secret=None)
    monkeypatch.setenv("SLURM_STEP_ID", "1")  # another step of the job: another job's world
    with pytest.raises(DistStoreError, match="another job made it"):
        FileStore(path)
    slurm.close()


def test_a_file_rendezvous_without_any_job_identity_is_refused(tmp_path):
    asked = init_methods.requested(f"file://{tmp_path}/rv", 2, 1, None)
    with pytest.raises(ValueError, match=r"rank 1: init_process_group over file://.*/rv needs the job's identity, so "
                                         r"that two jobs on one path never form one world: set MESHKIT_JOB_SECRET"):
        init_methods.open_store(asked, 5)
    assert not (tmp_path / "rv").exists()


# --------------------------------------------------------------------------- the server's bounds
def _open_master(monkeypatch, **variables) -> TCPStore:
    for name, value in variables.items():
        monkeypatch.setenv(f"MESHKIT_STORE_{name}", str(value))
    return TCPStore("127.0.0.1", 0, is_master=True, timeout=T)


def _greeted(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    _frame(s)
    return s


def test_clients_that_never_read_their_replies_cannot_grow_the_master_past_its_memory_bound(monkeypatch):
    """One client that never read its replies to GETs of a 60 MiB value grew the master by
    1 GB per 16 requests. Now the values held, the frames received and the replies unread share
    MESHKIT_STORE_MAX_BYTES; the greedy connections are closed at the idle timeout and the others
    are served."""
    store = _open_master(monkeypatch, MAX_BYTES=12 << 20, IDLE_TIMEOUT=0.4)
    server = _server(store)
    store.set("big", bytes(3 << 20))
    greedy = []
    for _ in range(16):
        s = _greeted(store.port)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(wire.request(wire.Op.GET, b"5", b"big"))
        greedy.append(s)
    peak, end = 0, time.monotonic() + 0.3
    while time.monotonic() < end:
        peak = max(peak, server._held + server._traffic)
        time.sleep(0.01)
    assert peak <= 12 << 20, peak
    start = time.monotonic()
    assert store.get("big") == bytes(3 << 20)  # served once the greedy ones are closed
    assert time.monotonic() - start < 5
    for s in greedy:
        s.close()
    store.close()


def test_a_refused_request_names_its_bound_and_leaves_the_pool_clean(monkeypatch):
    store = _open_master(monkeypatch, MAX_BYTES=1 << 20, MAX_WAIT_KEYS=10)
    with pytest.raises(DistStoreError, match=r"the server refused set: a request of 2097165 bytes would pass the "
                                             r"server's memory limit \(MESHKIT_STORE_MAX_BYTES=1048576"):
        store.set("huge", bytes(2 << 20))
    assert store.add("n", 1) == 1  # the next valid call goes through (its connection was not pooled)
    with pytest.raises(DistStoreError, match=r"wait names 11 keys, over the limit of 10 \(MESHKIT_STORE_MAX_WAIT_KEYS"):
        store.wait([f"k{i}" for i in range(11)], timeout=timedelta(seconds=1))
    assert store.get("n") == b"1" and not store.check(["huge"])
    store.close()


def test_connections_are_capped_and_the_one_over_is_told_why(monkeypatch):
    store = _open_master(monkeypatch, MAX_CONNECTIONS=3)
    others = [_greeted(store.port) for _ in range(2)]  # with the master's own: 3
    with pytest.raises(DistStoreError, match=r"the server refused the connection: the server has 3 connections, its "
                                             r"limit \(MESHKIT_STORE_MAX_CONNECTIONS=3\)"):
        TCPStore("127.0.0.1", store.port, timeout=T)
    others[0].close()
    time.sleep(0.05)
    with TCPStore("127.0.0.1", store.port, timeout=T) as late:
        late.set("k", "v")
    for s in others:
        s.close()
    store.close()


def test_idle_and_unauthenticated_connections_are_closed_and_a_client_reconnects(monkeypatch):
    monkeypatch.setenv("MESHKIT_STORE_IDLE_TIMEOUT", "0.2")
    monkeypatch.setenv("MESHKIT_STORE_HANDSHAKE_TIMEOUT", "0.2")
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=T, secret=SECRET)
    silent = _greeted(store.port)  # greeted, never authenticates
    store.set("k", "v")
    time.sleep(0.6)
    assert silent.recv(16) == b""  # closed by the server
    assert len(_server(store)._conns) == 0  # the master's pooled connection too
    assert store.get("k") == b"v"  # reconnects on its own
    silent.close()
    store.close()


def test_a_client_that_leaves_while_waiting_is_forgotten_at_once(master):
    server = _server(master)
    for _ in range(200):
        s, _, _ = _authenticated(master.port)
        s.sendall(wire.request(wire.Op.WAIT, b"1e8", b"never"))
        s.close()
    deadline = time.monotonic() + 3
    while (server._waiters or len(server._deadlines) > 100) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not server._waiters and len(server._deadlines) <= 100  # forgotten, and the deadline heap compacted
    _untouched(master)
