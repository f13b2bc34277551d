"""The shared-memory segment's security, in-process: created exclusively with mode 0600 under an
unguessable name; another local user cannot open it; a name taken first, a planted link, or a
file that is not ours is never mapped (comm/engines/shm_segment.py)."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys

import pytest

from meshkit.comm.engines import shm_segment

SHM = shm_segment.SHM_DIR
pytestmark = pytest.mark.skipif(not os.path.isdir(SHM), reason=f"no {SHM} (POSIX shared memory) here")


@pytest.fixture
def segment():
    seg = shm_segment.create(4096)
    yield seg
    seg.unlink()
    seg.close()


def test_a_segment_is_a_0600_file_of_this_user_under_128_random_bits(segment):
    info = os.lstat(segment.path)
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()
    assert re.fullmatch(r"/dev/shm/meshkit-shm-[0-9a-f]{32}", segment.path)
    other = shm_segment.attach(segment.path, 4096)  # a rank of the group maps the same memory
    other.memory[:5] = b"hello"
    assert segment.memory[:5] == b"hello"
    segment.unlink()  # once every rank mapped it: the name is gone, the memory stays
    assert not os.path.exists(segment.path) and other.memory[:5] == b"hello"
    other.close()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="playing another local user needs root and setpriv (the same-user attacker, who "
                           "lacks only the name, is test_a_taken_name_is_never_opened's and the unlink's)")
def test_another_local_user_cannot_open_the_segment(segment):
    code = f"import os; os.open({segment.path!r}, os.O_RDONLY)"
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "PermissionError" in out.stderr, out.stderr
    # and the job's own use of it still works
    shm_segment.attach(segment.path, 4096).close()


def test_a_taken_name_is_never_opened(monkeypatch, tmp_path):
    """An attacker who made the name first (or planted a link there): create() fails, touching nothing."""
    monkeypatch.setattr(shm_segment.secrets, "token_hex", lambda n: "ab" * n)
    target = tmp_path / "victim"
    target.write_bytes(b"do not touch")
    taken = os.path.join(SHM, shm_segment.PREFIX + "ab" * 16)
    for plant in (lambda: open(taken, "wb").close(), lambda: os.symlink(target, taken)):
        plant()
        try:
            with pytest.raises(FileExistsError):
                shm_segment.create(4096)
            assert target.read_bytes() == b"do not touch"
        finally:
            os.unlink(taken)


def test_attach_refuses_what_is_not_a_0600_segment_of_this_user(segment, tmp_path):
    os.chmod(segment.path, 0o644)
    with pytest.raises(PermissionError, match=r"mode 644, not 600; refusing to map it"):
        shm_segment.attach(segment.path, 4096)
    os.chmod(segment.path, 0o600)
    with pytest.raises(PermissionError, match=r"4096 bytes, not 8192; refusing to map it"):
        shm_segment.attach(segment.path, 8192)
    link = os.path.join(SHM, shm_segment.PREFIX + "link-" + os.urandom(4).hex())
    os.symlink(segment.path, link)
    try:
        with pytest.raises(OSError):  # O_NOFOLLOW: ELOOP
            shm_segment.attach(link, 4096)
    finally:
        os.unlink(link)
    with pytest.raises(PermissionError, match="is not a meshkit segment"):
        shm_segment.attach(str(tmp_path / "elsewhere"), 4096)
    if os.geteuid() == 0:
        os.chown(segment.path, 65534, 65534)
        with pytest.raises(PermissionError, match=r"owned by uid 65534, not this user's \(0\)"):
            shm_segment.attach(segment.path, 4096)


# --------------------------------------------------------------------------- cross-memory attach (shm_cma.py)
_VICTIM = """
import ctypes, os, sys
secret = ctypes.create_string_buffer(b"meshkit-rank-secret-0123456789", 32)
print(os.getpid(), ctypes.addressof(secret), flush=True)
sys.stdin.read()
"""
#: A process that reads 32 bytes of another's memory the way shm_cma does (plain ctypes: the kernel's
#: rule is what is tested, and the attacker needs nothing of ours).
_READER = """
import ctypes, os, sys
class V(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
libc = ctypes.CDLL(None, use_errno=True)
libc.process_vm_readv.restype = ctypes.c_ssize_t
got = ctypes.create_string_buffer(32)
local, remote = V(ctypes.addressof(got), 32), V(int(sys.argv[2]), 32)
n = libc.process_vm_readv(int(sys.argv[1]), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
print("READ", got.value.decode() if n == 32 else os.strerror(ctypes.get_errno()))
"""


def _yama_scope() -> int:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read())
    except OSError:
        return 0


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None or not sys.platform.startswith("linux"),
                    reason="playing two local users needs root and setpriv (a rank reading its own process's "
                           "memory is tests/test_shm_layout.py's direct cases)")
def test_another_local_user_cannot_read_a_ranks_memory_by_cross_memory_attach():
    def as_user(uid, *args, **kw):
        return subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable,
                                 "-c", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)

    victim = as_user(65534, _VICTIM, stdin=subprocess.PIPE)
    try:
        pid, address = victim.stdout.readline().split()
        attacker = as_user(65533, _READER, pid, address)
        out, err = attacker.communicate(timeout=30)
        assert "READ Operation not permitted" in out, (out, err)
        peer = as_user(65534, _READER, pid, address)  # the same user (a rank of the job): permitted, but Yama's
        out, err = peer.communicate(timeout=30)        # scope 1 allows only ancestors: then the path copies instead
        expected = "READ meshkit-rank-secret-0123456789" if _yama_scope() == 0 else "READ Operation not permitted"
        assert expected in out, (out, err)
    finally:
        victim.communicate(timeout=30)
