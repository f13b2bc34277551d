"""The shared-memory path on real processes: two meshkit-run jobs (process starts are CI's scarcest
resource; the path's algorithm is tested in-process in tests/test_shm_layout.py, its segment's
security in tests/test_shm_segment.py).

1. tests/scripts/mpi_shm.py at 3 ranks, with tiny sizes (every path at a few KB): every dtype x op
   of all_reduce, reduce, reduce_scatter, all_gather (also in place) and broadcast against NumPy's
   reduction in the same rank order, exactly, sync and async; bitwise the same result on every rank
   and on a second run; the MPI path below MESHKIT_SHM_MIN_BYTES; the path by cross-memory attach where
   the kernel permits it (as root here; a CI user under Yama's ptrace_scope 1 copies through the segment,
   which tests/test_shm_layout.py drives in-process everywhere); a shared buffer reduced in place
   (MPI below MESHKIT_SHM_SHARED_MIN_BYTES)
   (and DDP's buckets in one); a timeout naming the rank whose flag never came; a mismatch raised on
   every rank; nothing left in /dev/shm.
2. tests/scripts/mpi_shm_kill.py at 2 ranks: a rank SIGKILLed mid-job; its peer fails at once, naming
   it, and the launcher removes the segment the dead rank held.
"""

from __future__ import annotations

import glob
import os
import re

import pytest

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm (POSIX shared memory)")

TINY = {"MESHKIT_SHM_MIN_BYTES": "512", "MESHKIT_SHM_MOVE_MIN_BYTES": "512", "MESHKIT_SHM_SMALL_BYTES": "2048",
        "MESHKIT_SHM_SMALL_MIN_BYTES": "512",  # all_reduces of 512-1024 B meet once (comm/engines/shm_small.py)
        "MESHKIT_SHM_SHARED_MIN_BYTES": "600",
        "MESHKIT_SHM_CHUNK_BYTES": "4096",
        "MESHKIT_SHM_CMA": "2"}  # attach wherever permitted: not left to the host's measurement (comm/engines/shm.py)


def _segments() -> set[str]:
    return set(glob.glob("/dev/shm/meshkit-shm-*"))


def test_every_collective_dtype_and_op_through_shared_memory(mpirun):
    before = _segments()
    out = mpirun("mpi_shm.py", 3, env=TINY, timeout=240).stdout
    for r in range(3):
        assert re.search(rf"\[rank{r}\]: OK \d+ checks on rank {r}", out), out
    assert re.search(r"TIMEOUT meshkit.comm: rank 0: all_reduce #0 on group group\[0, 1\] \(ranks \[0, 1\]\) timed "
                     r"out after 1.5 s; ranks that did not arrive: \[1\] \(all_reduce over shared memory", out), out
    assert ("MISMATCH meshkit.comm: rank 0: collective mismatch on group world at #" in out
            and "rank 0: all_reduce(shape=(200,), dtype=float64, op=SUM)" in out
            and "ranks [1, 2]: all_reduce(shape=(100,), dtype=float64, op=SUM)" in out), out
    assert _segments() <= before


@pytest.mark.parametrize("setting, said", [("small", r"MESHKIT_SHM_SMALL_BYTES \(from 65536 to 131072\)"),
                                           ("reuse", r"MESHKIT_SHM_REUSE \(from 0 to 1\)")])
def test_ranks_whose_path_settings_differ_all_refuse_to_start(mpirun, setting, said):
    # 64 KiB of MESHKIT_SHM_SMALL_BYTES on one rank, 128 KiB on the other: a 96 KiB all_reduce would take
    # the one meeting on one and another protocol on the other, with the same header; MESHKIT_SHM_REUSE
    # on one rank only: its second all_reduce would wait at a step the other never posts
    out = mpirun("mpi_shm_settings.py", 2, setting, timeout=60).stdout
    for rank in (0, 1):
        assert re.search(rf"rank {rank} refused: meshkit.comm: rank {rank}: the shared-memory path's settings differ "
                         rf"between ranks \[0, 1\]: {said}; each size's protocol depends on them", out), out
    assert "started" not in out


def test_a_killed_rank_fails_its_peer_at_once_and_leaves_nothing_in_dev_shm(mpirun):
    before = _segments()
    proc = mpirun("mpi_shm_kill.py", 2, check=False, timeout=60, env={"MESHKIT_SHM_MIN_BYTES": "512"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    held = re.search(r"HELD (\S+)", out)
    assert held, out
    killed = re.search(r"KILLED at ([\d.]+)", out)
    failed = re.search(r"\[rank0\]: FAILED at ([\d.]+): RankFailedError: meshkit.comm: rank 0: all_reduce over "
                       r"shared memory cannot complete: rank 1 \(pid \d+\) died before it arrived", out)
    assert killed and failed and float(failed.group(1)) - float(killed.group(1)) < 1.0, out  # not the 30 s timeout
    assert not os.path.exists(held.group(1)), out
    assert _segments() <= before


@pytest.mark.parametrize("mode", ["1", "2"])
def test_the_way_ordinary_buffers_move_is_measured_once_and_shared(mpirun, mode):
    """MESHKIT_SHM_CMA=1 (the default): where the kernel permits cross-memory attach, the group times
    the kernel's copy against a user-space copy once at creation, and every rank takes the same way:
    through the segment up to ATTACH_LARGE_BYTES where attach measured over ATTACH_DEARER times
    dearer, else by attach; 2: attach wherever permitted, nothing measured. Results exact either way."""
    from meshkit.comm.engines.shm_settings import ATTACH_DEARER, ATTACH_LARGE_BYTES

    out = mpirun("shm_attach_choice.py", 2, env={"MESHKIT_SHM_CMA": mode}, timeout=120).stdout
    found = re.findall(r"rank (\d): attach (on|off) ratio (\S+) segment up to (\d+)", out)
    assert len(found) == 2 and len({f[1:] for f in found}) == 1, out  # the same verdict on both ranks
    attach, ratio, above = found[0][1], found[0][2], int(found[0][3])
    if attach == "off":  # the kernel refused (Yama's ptrace_scope 1): everything through the segment
        assert ratio == "none" and above == 0, out
        return
    if mode == "2":
        assert ratio == "none" and above == 0, out
    else:
        assert float(ratio) > 0 and above == (ATTACH_LARGE_BYTES if float(ratio) > ATTACH_DEARER else 0), out
    assert "rank 0: 4194304 bytes by shm" in out and "rank 0: 41943040 bytes by shm" in out, out


def test_the_way_ordinary_buffers_move_leaves_the_bits_alone(mpirun):
    """The segment and cross-memory attach reduce every element in the same rank order, so the way the
    host's measurement picks never changes a result: 3 ranks, all_reduce and reduce_scatter of float32
    and float64 from 0.3 to 3 M elements, bit for bit the same both ways (where the kernel refuses
    attach, both runs take the segment)."""
    seen = {}
    for mode in ("0", "2"):
        out = mpirun("shm_path_bits.py", 3, env={"MESHKIT_SHM_CMA": mode, "MESHKIT_SHM_MIN_BYTES": "524288"},
                     timeout=120).stdout
        seen[mode] = dict(re.findall(r"rank (\d) digests (.+)", out))
        assert len(seen[mode]) == 3, out
    assert seen["0"] == seen["2"], seen
