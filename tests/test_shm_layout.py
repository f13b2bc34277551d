"""The shared-memory path without processes: its arithmetic, its settings, and its collectives
driven by threads over one anonymous mapping (each thread a rank with its own Channel).

The real-process cases (one meshkit-run job) are in tests/test_shm.py.
"""

from __future__ import annotations

import mmap
import os
import re
import time

import numpy as np
import pytest

from meshkit import ReduceOp
from meshkit.comm import env
from meshkit.comm.engines import shm_cma
from meshkit.comm.engines import shm_layout as layout
from meshkit.comm.engines.engine import CallsDiffer
from meshkit.comm.engines.shm_collectives import Channel, ShmRequest
from meshkit.comm.errors import DistBackendError, DistValueError, RankFailedError
from shm_threads import finish, on_threads


# --------------------------------------------------------------------------- arithmetic
@pytest.mark.parametrize("itemsize", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 16])
def test_slices_cover_each_chunk_once_and_start_on_a_cache_line(n, itemsize):
    for length in (0, 1, 5, 63, 64, 65, 1000, 4096 // itemsize, 12345):
        bounds = [layout.slice_of(length, n, r, itemsize) for r in range(n)]
        covered = np.zeros(length, int)
        for lo, hi in bounds:
            assert 0 <= lo <= hi <= length
            assert lo == length or (lo * itemsize) % 64 == 0, (length, n, lo)
            covered[lo:hi] += 1
        assert (covered == 1).all(), (length, n, bounds)


def test_slices_and_chunks_written_out():
    assert [layout.slice_of(100, 3, r, 8) for r in range(3)] == [(0, 40), (40, 80), (80, 100)]
    assert [layout.slice_of(10, 4, r, 4) for r in range(4)] == [(0, 10), (10, 10), (10, 10), (10, 10)]
    assert layout.chunks(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert layout.chunks(0, 4) == [(0, 0)]
    assert layout.segment_bytes(2, 4096) == 2 * 256 + 4 * 4096
    assert layout.data_offset(2, 4096, 1, 1) == 2 * 256 + 3 * 4096
    with pytest.raises(ValueError, match="chunk_bytes=100 is not a positive multiple of 64"):
        layout.segment_bytes(2, 100)


# --------------------------------------------------------------------------- settings
@pytest.mark.parametrize("raw", ["2", "yes", "-1"])
def test_a_bad_MESHKIT_SHM_names_the_variable_and_the_valid_values(monkeypatch, raw):
    monkeypatch.setenv("MESHKIT_SHM", raw)
    with pytest.raises(DistValueError, match=rf"MESHKIT_SHM='{raw}' is not valid; valid values are 0 \(collectives "
                                             r"over MPI only\) or 1"):
        env.shm_enabled()
    monkeypatch.setenv("MESHKIT_SHM", "0")
    assert env.shm_enabled() is False


@pytest.mark.parametrize("raw", ["2", "on", " "])
def test_MESHKIT_SHM_REUSE_is_0_or_1_and_a_bad_value_is_named(monkeypatch, raw):
    monkeypatch.setenv("MESHKIT_SHM_REUSE", raw)
    if raw.strip():
        with pytest.raises(DistValueError, match=rf"MESHKIT_SHM_REUSE='{raw}' is not valid; valid values are 0 "):
            env.shm_reuse()
    else:
        assert env.shm_reuse() is True  # empty: the default
    monkeypatch.setenv("MESHKIT_SHM_REUSE", "0")
    assert env.shm_reuse() is False


@pytest.mark.parametrize("name, raw", [("MESHKIT_SHM_MIN_BYTES", "-5"), ("MESHKIT_SHM_MIN_BYTES", "1e3"),
                                       ("MESHKIT_SHM_CHUNK_BYTES", "100"), ("MESHKIT_SHM_CHUNK_BYTES", "0"),
                                       ("MESHKIT_SHM_CHUNK_BYTES", str(2 << 30)),
                                       ("MESHKIT_SHM_SMALL_MIN_BYTES", "16Q"), ("MESHKIT_SHM_SMALL_MIN_BYTES", "16 K B"),
                                       ("MESHKIT_SHM_SMALL_MIN_BYTES", "0x10")])
def test_bad_byte_settings_name_the_variable(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(DistValueError, match=rf"{name}='{raw}' is not valid; valid values are integers"):
        env.shm_bytes(name, 4096, multiple=64 if "CHUNK" in name else 1, zero="MIN" in name)


# --------------------------------------------------------------------------- the collectives, threads as ranks
CHUNK, SMALL = 4096, 1024


def _drive(n: int, calls, *, timeout: float = 20.0, chunk: int = CHUNK, small: int = SMALL, direct: int = 0):
    """Run ``calls[r](channel, request)`` (a generator factory) on n threads over one mapping; each
    rank's result or exception. ``direct``: the channels move ordinary buffers by cross-memory
    attach, ``direct`` bytes a piece (every "peer" is this process: the kernel's copy is the same)."""
    memory = mmap.mmap(-1, layout.segment_bytes(n, chunk))
    channels = [Channel(memory, n, r, chunk, small, list(range(n))) for r in range(n)]
    if direct:
        for channel in channels:
            channel.attach_directly([os.getpid()] * n, direct)
    def rank(r):
        if calls[r] is not None:
            finish(ShmRequest("test", lambda req: calls[r](channels[r], req)), r, timeout)

    return on_threads(n, rank)


def _ordered(op, parts):
    acc = parts[0].copy()
    for p in parts[1:]:
        acc = {ReduceOp.SUM: np.add, ReduceOp.PRODUCT: np.multiply, ReduceOp.MIN: np.minimum,
               ReduceOp.MAX: np.maximum}[op](acc, p)
    return acc


def _self_attach() -> str:
    """Why this process cannot read itself with process_vm_readv ("" where it can)."""
    magic = np.frombuffer(bytearray(b"meshkit-cma-test"), np.uint8)
    return shm_cma.probe([os.getpid(), os.getpid()], [magic.ctypes.data] * 2, 0, magic.tobytes())


needs_cma = pytest.mark.skipif(bool(_self_attach()), reason=f"process_vm_readv refused here: {_self_attach()}")


@pytest.mark.parametrize("n", [2, 3, 5])
# one meeting (800 B; by cross-memory attach where direct: above half of SMALL); two meetings over 6 chunks
# (24 KB); two chunks, then a last one of 608 B that meets once
@pytest.mark.parametrize("count", [100, 3000, 1100])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX])
@pytest.mark.parametrize("direct", [0, pytest.param(192, marks=needs_cma)])  # direct: pieces of 192 B
def test_all_reduce_is_the_fixed_order_reduction_bit_for_bit_on_every_rank(n, count, op, direct):
    rng = np.random.default_rng(count)
    parts = [rng.standard_normal(count) for _ in range(n)]
    bufs = [p.copy() for p in parts]
    errors = _drive(n, [lambda ch, req, r=r: ch.all_reduce(req, bufs[r], op) for r in range(n)], direct=direct)
    assert errors == [None] * n
    expected = _ordered(op, parts)
    for b in bufs:
        assert b.tobytes() == expected.tobytes()


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("direct", [0, pytest.param(256, marks=needs_cma)])
def test_reduce_scatter_all_gather_broadcast_and_reduce(n, direct):
    m = 1500  # 12 KB per block: several chunks
    rng = np.random.default_rng(7)
    ins = [rng.standard_normal(n * m) for _ in range(n)]
    outs = [np.empty(m) for _ in range(n)]
    assert _drive(n, [lambda ch, req, r=r: ch.reduce_scatter(req, outs[r], ins[r], ReduceOp.SUM)
                      for r in range(n)], direct=direct) == [None] * n
    full = _ordered(ReduceOp.SUM, ins)
    for r in range(n):
        assert np.array_equal(outs[r], full[r * m:(r + 1) * m])
    # the output is the rank's own block of its input (the order reads that block last on rank 2)
    copies = [a.copy() for a in ins]
    assert _drive(n, [lambda ch, req, r=r: ch.reduce_scatter(req, copies[r][r * m:(r + 1) * m], copies[r],
                                                             ReduceOp.SUM) for r in range(n)], direct=direct) == [None] * n
    for r in range(n):
        assert np.array_equal(copies[r][r * m:(r + 1) * m], full[r * m:(r + 1) * m])
    mine = [np.full(m, float(r)) for r in range(n)]
    gathered = [np.empty(n * m) for _ in range(n)]
    assert _drive(n, [lambda ch, req, r=r: ch.all_gather(req, gathered[r], mine[r], False)
                      for r in range(n)], direct=direct) == [None] * n
    for g in gathered:
        assert np.array_equal(g, np.repeat(np.arange(n, dtype=float), m))
    bufs = [np.full(m, float(r)) for r in range(n)]
    assert _drive(n, [lambda ch, req, r=r: ch.broadcast(req, bufs[r], n - 1) for r in range(n)],
                  direct=direct) == [None] * n
    assert all((b == n - 1).all() for b in bufs)
    bufs = [np.full(m, r + 1.0) for r in range(n)]
    assert _drive(n, [lambda ch, req, r=r: ch.all_reduce(req, bufs[r], ReduceOp.SUM, 0) for r in range(n)],
                  direct=direct) == [None] * n
    assert (bufs[0] == n * (n + 1) / 2).all() and all((bufs[r] == r + 1).all() for r in range(1, n))


def test_a_mismatched_call_raises_on_every_rank_before_any_data_is_read():
    a, b = np.ones(100), np.full(100, 2.0)
    errors = _drive(2, [lambda ch, req: ch.all_reduce(req, a, ReduceOp.SUM),
                        lambda ch, req: ch.all_reduce(req, b, ReduceOp.MAX)])
    assert all(isinstance(e, CallsDiffer) for e in errors), errors
    calls = [str(c) for _, c in errors[0].entries]
    assert calls == ["all_reduce(shape=(100,), dtype=float64, op=SUM)",
                     "all_reduce(shape=(100,), dtype=float64, op=MAX)"]
    assert (a == 1).all() and (b == 2).all()  # nothing was written


def test_a_missing_rank_is_named_and_a_dead_one_fails_its_peers_at_once():
    memory = mmap.mmap(-1, layout.segment_bytes(2, CHUNK))
    me = Channel(memory, 2, 0, CHUNK, SMALL, [5, 9])
    Channel(memory, 2, 1, CHUNK, SMALL, [5, 9])  # rank 1 attached (its pid is this process's) but never calls
    request = ShmRequest("all_reduce", lambda req: me.all_reduce(req, np.ones(10), ReduceOp.SUM))
    assert not request.Test() and request.missing_ranks == [1]
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    me.words[1 * layout.CONTROL_WORDS + layout.PID] = dead  # rank 1's process is gone
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=rf"rank 5: all_reduce over shared memory cannot complete: "
                                             rf"rank 9 \(pid {dead}\) died before it arrived"):
        while not request.Test():
            time.sleep(0.001)
    assert time.monotonic() - start < 1.0


# --------------------------------------------------------------------------- the switch
def test_MESHKIT_SHM_0_keeps_mpi_and_a_bad_value_is_named(monkeypatch):
    from meshkit.comm.engines import shm_settings  # (no MPI: comm/engines/shm.py would start it)

    monkeypatch.setenv("MESHKIT_SHM", "0")
    assert not shm_settings.applies(2)
    monkeypatch.setenv("MESHKIT_SHM", "off")
    with pytest.raises(DistValueError, match=r"MESHKIT_SHM='off' is not valid"):
        shm_settings.applies(2)
    monkeypatch.setenv("MESHKIT_SHM", "1")
    monkeypatch.delenv("MESHKIT_SURVIVE", raising=False)
    assert shm_settings.applies(2) == shm_settings.supported() and not shm_settings.applies(1)
    monkeypatch.setenv("MESHKIT_SURVIVE", "1")  # meshkit-run --survive: a wait notices the dead and the revoke too
    assert shm_settings.applies(2) == shm_settings.supported()
    # where MPI is Open MPI over TCP the path takes every size, unless the variables say otherwise
    assert shm_settings.min_bytes() == 0 and shm_settings.move_min_bytes() == 0
    monkeypatch.setenv("MESHKIT_SHM_MIN_BYTES", "4096")
    assert shm_settings.min_bytes() == 4096 and shm_settings.move_min_bytes() == 0
    monkeypatch.delenv("MESHKIT_SHM_MIN_BYTES")
    monkeypatch.setenv("MESHKIT_SURVIVE", "0")
    assert shm_settings.applies(2) == shm_settings.supported()
    monkeypatch.setattr(shm_settings.platform, "machine", lambda: "aarch64")  # no TSO: the ordering argument fails
    assert not shm_settings.applies(2)


def test_the_default_chunk_keeps_a_segment_within_its_budget(monkeypatch):
    from meshkit.comm.engines import shm_settings

    monkeypatch.delenv("MESHKIT_SHM_CHUNK_BYTES", raising=False)
    assert shm_settings.chunk_bytes(2) == 4 << 20 and shm_settings.chunk_bytes(16) == 2 << 20
    assert shm_settings.chunk_bytes(1024) == 64 << 10
    monkeypatch.setenv("MESHKIT_SHM_CHUNK_BYTES", "8192")
    assert shm_settings.chunk_bytes(16) == 8192
    monkeypatch.delenv("MESHKIT_SHM_SHARED_MIN_BYTES", raising=False)
    monkeypatch.delenv("MESHKIT_SHM_MIN_BYTES", raising=False)
    assert shm_settings.shared_min_bytes() == 64 << 10  # below, MPI on a shared buffer's memory is faster
    assert [shm_settings.direct_bytes(n) for n in (2, 32, 128, 4096)] == [256 << 10, 256 << 10, 64 << 10, 4096]
    assert shm_settings.min_bytes(direct=True) == 512 << 10 and shm_settings.min_bytes() == 32 << 20
    monkeypatch.setenv("MESHKIT_SHM_SHARED_MIN_BYTES", "-1")
    with pytest.raises(DistValueError, match=r"MESHKIT_SHM_SHARED_MIN_BYTES='-1' is not valid; valid values are "
                                             r"integers 0\.\.1073741824"):
        shm_settings.shared_min_bytes()
    monkeypatch.delenv("MESHKIT_SHM_MOVE_MIN_BYTES", raising=False)
    assert shm_settings.move_min_bytes() == 1 << 30  # all_gather and broadcast: MPICH's one copy wins
    monkeypatch.setenv("MESHKIT_SHM_MOVE_MIN_BYTES", "x")
    with pytest.raises(DistValueError, match=r"MESHKIT_SHM_MOVE_MIN_BYTES='x' is not valid; valid values are integers"):
        shm_settings.move_min_bytes()


def test_a_shared_buffer_reduces_in_place_and_a_different_place_is_a_mismatch():
    n, m = 3, 1000
    regions = mmap.mmap(-1, n * m * 8)
    views = [np.frombuffer(regions, np.float64, m, r * m * 8) for r in range(n)]
    for r in range(n):
        views[r][:] = np.arange(m) * (r + 1)
    assert _drive(n, [lambda ch, req: ch.all_reduce_in_place(req, views, ReduceOp.SUM, 0)] * n) == [None] * n
    for v in views:
        assert np.array_equal(v, np.arange(m) * 6.0)
    parts = [v[:10] for v in views]
    errors = _drive(2, [lambda ch, req: ch.all_reduce_in_place(req, parts[:2], ReduceOp.SUM, 0),
                        lambda ch, req: ch.all_reduce_in_place(req, parts[:2], ReduceOp.SUM, 80)])
    assert all(isinstance(e, CallsDiffer) for e in errors), errors


def test_all_gather_into_and_reduce_scatter_of_a_shared_buffer_need_no_copy_in():
    n, m = 3, 500
    regions = mmap.mmap(-1, n * n * m * 8)
    arrays = [np.frombuffer(regions, np.float64, n * m, r * n * m * 8) for r in range(n)]
    for r in range(n):
        arrays[r][:] = np.arange(n * m) + 1000 * r
    outs = [np.empty(m) for _ in range(n)]
    assert _drive(n, [lambda ch, req, r=r: ch.reduce_scatter_in_place(req, outs[r], arrays, ReduceOp.SUM, 0)
                      for r in range(n)]) == [None] * n
    full = _ordered(ReduceOp.SUM, [a.copy() for a in arrays])
    for r in range(n):
        assert np.array_equal(outs[r], full[r * m:(r + 1) * m])
    mine = [np.full(m, float(r)) for r in range(n)]
    assert _drive(n, [lambda ch, req, r=r: ch.all_gather_in_place(req, arrays, mine[r], 0)
                      for r in range(n)]) == [None] * n
    for a in arrays:
        assert np.array_equal(a, np.repeat(np.arange(n, dtype=float), m))
    # in place: each rank's input is its own block of the shared array
    for r in range(n):
        arrays[r][r * m:(r + 1) * m] = 10.0 + r
    assert _drive(n, [lambda ch, req, r=r: ch.all_gather_in_place(req, arrays, arrays[r][r * m:(r + 1) * m], 0)
                      for r in range(n)]) == [None] * n
    for a in arrays:
        assert np.array_equal(a, np.repeat(10.0 + np.arange(n), m))


# --------------------------------------------------------------------------- cross-memory attach
def test_MESHKIT_SHM_CMA_is_validated_and_named(monkeypatch):
    from meshkit.comm.engines import shm_settings

    monkeypatch.delenv("MESHKIT_SHM_CMA", raising=False)
    assert shm_settings.direct() is True and shm_settings.direct_measured() is True
    monkeypatch.setenv("MESHKIT_SHM_CMA", "0")
    assert shm_settings.direct() is False and shm_settings.direct_measured() is False
    monkeypatch.setenv("MESHKIT_SHM_CMA", "2")
    assert shm_settings.direct() is True and shm_settings.direct_measured() is False
    monkeypatch.setenv("MESHKIT_SHM_CMA", "no")
    with pytest.raises(DistValueError, match=r"MESHKIT_SHM_CMA='no' is not valid; valid values are 0 \(copy through "
                                             r"the segment\), 1 \(cross-memory attach where the kernel permits it "
                                             r"and it measured cheaper here; the default\) or 2"):
        shm_settings.direct()
    from meshkit.comm import env

    with pytest.raises(DistValueError, match=r"MESHKIT_SHM_CMA='no' is not valid"):
        env.check_all()  # so the error comes at init_process_group, as every variable's does
    monkeypatch.setenv("MESHKIT_SHM_CMA", "1")
    monkeypatch.setenv("MESHKIT_SHM_SHARED_MIN_BYTES", "lots")
    with pytest.raises(DistValueError, match=r"MESHKIT_SHM_SHARED_MIN_BYTES='lots' is not valid.*default 65536"):
        shm_settings.check_all()  # (init_process_group calls it after env.check_all: tests/test_errors.py)
    monkeypatch.setenv("MESHKIT_SURVIVE", "1")
    with pytest.raises(DistValueError, match=r"MESHKIT_SHM_SHARED_MIN_BYTES='lots' is not valid.*\(bytes, .*; default 0\)"):
        shm_settings.check_all()  # under --survive the path takes every size
    monkeypatch.delenv("MESHKIT_SURVIVE")
    monkeypatch.delenv("MESHKIT_SHM_SHARED_MIN_BYTES")
    monkeypatch.setenv("MESHKIT_SURVIVE_LEARN_S", "61")
    with pytest.raises(DistValueError, match=r"MESHKIT_SURVIVE_LEARN_S='61' is not valid; valid values are a positive "
                                             r"number at most 60"):
        env.check_all()


@needs_cma
def test_the_probe_names_what_it_could_not_read_and_a_dead_peer_fails_a_direct_copy():
    magic = np.frombuffer(bytearray(b"0123456789abcdef"), np.uint8)
    me = os.getpid()
    assert shm_cma.probe([me, me], [magic.ctypes.data] * 2, 0, magic.tobytes()) == ""
    assert "read other bytes than that rank's" in shm_cma.probe([me, me], [magic.ctypes.data] * 2, 1, b"x" * 16)
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    assert re.search(rf"process_vm_readv of 16 bytes at 0x[0-9a-f]+ in pid {dead} failed: No such process",
                     shm_cma.probe([me, dead], [0, magic.ctypes.data], 0, magic.tobytes()))
    memory = mmap.mmap(-1, layout.segment_bytes(2, CHUNK))
    channel = Channel(memory, 2, 0, CHUNK, SMALL, [4, 7])
    channel.attach_directly([me, dead], 256)
    with pytest.raises(RankFailedError, match=rf"rank 4: all_reduce over shared memory cannot complete: rank 7 "
                                             rf"\(pid {dead}\) died during it"):
        channel._read(1, magic.ctypes.data, np.empty(16, np.uint8), "all_reduce")
    channel.pids[1] = me  # alive, but the address is not mapped: the copy's own error, and the way out
    with pytest.raises(DistBackendError, match=r"rank 4: all_reduce over shared memory: a direct copy with rank 7 "
                                              r"failed: .*Bad address; MESHKIT_SHM_CMA=0 copies through the segment"):
        channel._read(1, 8, np.empty(16, np.uint8), "all_reduce")
    assert channel.goes_direct(SMALL + 1) and not channel.goes_direct(SMALL)
    # an all_reduce from where the one-meeting path stops (half of small_bytes)
    assert channel.reduces_direct(SMALL // 2 + 1) and not channel.reduces_direct(SMALL // 2)


_UFUNCS = {ReduceOp.SUM: np.add, ReduceOp.PRODUCT: np.multiply, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
           ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor}


def _same(a, b) -> bool:
    """Bit for bit, but for x87 long doubles, whose padding bytes (6 of 16) hold whatever the ufunc left."""
    return np.array_equal(a, b) if a.dtype == np.longdouble else a.tobytes() == b.tobytes()


def _in_rank_order(op, parts):
    """The reduction in rank order, written out independently of the path (bool SUM: logical or)."""
    fn = np.logical_or if op is ReduceOp.SUM and parts[0].dtype == bool else _UFUNCS[op]
    acc = parts[0].copy()
    for p in parts[1:]:
        acc = fn(acc, p)
    return acc


@needs_cma
@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("dtype, op", [(np.float32, ReduceOp.SUM), (np.float64, ReduceOp.PRODUCT),
                                       (np.int32, ReduceOp.BXOR), (np.int64, ReduceOp.MIN), (np.bool_, ReduceOp.SUM),
                                       (np.longdouble, ReduceOp.SUM), (np.complex128, ReduceOp.SUM)])
def test_reduce_scatter_by_cross_memory_attach_reduces_each_block_in_rank_order_in_pieces(n, dtype, op, monkeypatch):
    # blocks of 1001 elements read in pieces of 192 bytes: many pieces, the last one short
    m = 1001
    moved = []
    move = shm_cma.Transfer.move
    monkeypatch.setattr(shm_cma.Transfer, "move", lambda self, fn, pid, address, local, nbytes:
                        (moved.append(nbytes), move(self, fn, pid, address, local, nbytes)))
    rng = np.random.default_rng(n)
    ins = [(rng.standard_normal(n * m) * 50).astype(dtype) if dtype != np.bool_ else rng.random(n * m) < 0.3
           for _ in range(n)]
    full = _in_rank_order(op, ins)
    outs = [np.empty(m, dtype) for _ in range(n)]
    kept = [a.copy() for a in ins]
    assert _drive(n, [lambda ch, req, r=r: ch.reduce_scatter(req, outs[r], ins[r], op) for r in range(n)],
                  direct=192) == [None] * n
    for r in range(n):
        assert _same(outs[r], full[r * m:(r + 1) * m]), r
        assert ins[r].tobytes() == kept[r].tobytes()  # the inputs are only read
    itemsize = np.dtype(dtype).itemsize
    per = 192 // itemsize
    # every rank read its block of each peer's input in pieces of 192 bytes (the last one shorter)
    assert sorted(moved) == sorted(([per * itemsize] * (m // per) + [m % per * itemsize]) * n * (n - 1))
    # in place (torch's form: the output is the rank's own block, read first, second or later by the order)
    assert _drive(n, [lambda ch, req, r=r: ch.reduce_scatter(req, ins[r][r * m:(r + 1) * m], ins[r], op)
                      for r in range(n)], direct=192) == [None] * n
    for r in range(n):
        assert _same(ins[r][r * m:(r + 1) * m], full[r * m:(r + 1) * m]), r


@needs_cma
@pytest.mark.parametrize("n", [2, 3])
def test_a_direct_reduce_scatter_into_a_block_its_peers_read_waits_until_they_have(n):
    # each rank's output is the block of its input that the NEXT rank reads: written only after every
    # peer has read it (a result written at once would reach the next rank's sum instead of the input)
    m = 700
    ins = [np.arange(n * m, dtype=np.float64) * (r + 1) for r in range(n)]
    full = _in_rank_order(ReduceOp.SUM, ins)
    nxt = [(r + 1) % n for r in range(n)]
    assert _drive(n, [lambda ch, req, r=r: ch.reduce_scatter(req, ins[r][nxt[r] * m:(nxt[r] + 1) * m], ins[r],
                                                             ReduceOp.SUM) for r in range(n)], direct=192) == [None] * n
    for r in range(n):
        assert np.array_equal(ins[r][nxt[r] * m:(nxt[r] + 1) * m], full[r * m:(r + 1) * m]), r


@needs_cma
def test_a_dead_peer_fails_the_direct_loops_naming_it_not_this_rank():
    me = os.getpid()
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    for kind in ("all_reduce", "reduce_scatter"):
        memory = mmap.mmap(-1, layout.segment_bytes(2, CHUNK))
        channels = [Channel(memory, 2, r, CHUNK, SMALL, [4, 7]) for r in range(2)]
        for channel in channels:
            channel.attach_directly([me, me], 256)
        channels[0].pids[1] = dead  # rank 0's peer is gone once it starts to read
        bufs = [np.ones(4000) for _ in range(2)]
        outs = [np.empty(2000) for _ in range(2)]

        def start(r):
            ch = channels[r]
            return lambda req: (ch.all_reduce(req, bufs[r], ReduceOp.SUM) if kind == "all_reduce" else
                                ch.reduce_scatter(req, outs[r], bufs[r], ReduceOp.SUM))

        assert not ShmRequest(kind, start(1)).Test()  # rank 1 posted and waits
        with pytest.raises(RankFailedError, match=rf"rank 4: {kind} over shared memory cannot complete: rank 7 "
                                                 rf"\(pid {dead}\) died during it"):
            ShmRequest(kind, start(0))


@needs_cma
def test_a_transfer_larger_than_one_kernel_call_moves_in_calls_of_the_most_bytes(monkeypatch):
    monkeypatch.setattr(shm_cma, "_MOST_BYTES", 64)  # (the kernel's limit is about 2 GiB)
    src = np.arange(1000, dtype=np.uint8) * 7
    into = np.zeros(1000, np.uint8)
    transfer = shm_cma.Transfer()
    transfer.read(os.getpid(), src.ctypes.data, into)  # 15 calls of 64 bytes and one of 40
    assert np.array_equal(into, src)
    back = np.zeros(1000, np.uint8)
    transfer.write(os.getpid(), back.ctypes.data, src[::-1].copy())
    assert np.array_equal(back, src[::-1])
    with pytest.raises(OSError, match=r"process_vm_readv of 64 bytes at 0x[0-9a-f]+ in pid \d+ failed: Bad address"):
        transfer.read(os.getpid(), 64, into)


def test_an_all_reduce_after_one_takes_its_buffers_again_once_every_rank_has_read_them():
    """Back-to-back all_reduces through the segment: the second takes the buffers the first used (a
    skipped step: they are the ones in the cache), and writes them only once every rank posted its
    done flag. Driven by hand in one thread: rank 0 finishes the first call while rank 1 still waits
    to copy its result out of rank 0's buffer; rank 0's second call must wait (not overwrite it),
    rank 1's first result is exact, then the second call is too."""
    n, count = 2, 300  # 2400 bytes: one chunk, above SMALL (two meetings: rank 1 reads rank 0's slice last)
    memory = mmap.mmap(-1, layout.segment_bytes(n, CHUNK))
    channels = [Channel(memory, n, r, CHUNK, SMALL, list(range(n))) for r in range(n)]
    rng = np.random.default_rng(5)
    first = [rng.standard_normal(count) for _ in range(n)]
    second = [rng.standard_normal(count) * 100 for _ in range(n)]
    a = [x.copy() for x in first]
    b = [x.copy() for x in second]

    def start(r, bufs):  # a request's first Test runs it to its first wait (ShmRequest's __init__)
        return ShmRequest("all_reduce", lambda req: channels[r].all_reduce(req, bufs[r], ReduceOp.SUM))

    r0 = start(0, a)  # copies in, posts, waits for rank 1
    r1 = start(1, a)  # copies in, meets, reduces its slice, waits for rank 0's reduced flag
    assert not r1.Test() and r1.missing_ranks == [0]
    assert r0.Test()  # meets, reduces, copies rank 1's slice out: done, and its done flag posted
    assert channels[0].done_step == channels[0].step == 1
    s0 = start(0, b)  # the next call: the same buffers, so it waits for rank 1's done flag
    for _ in range(5):
        assert not s0.Test() and s0.missing_ranks == [1]
    assert channels[0].step == 2  # step 2 skipped: its first chunk is step 3, the parity of step 1
    assert r1.Test()  # rank 1 copies rank 0's slice of the first result out: untouched
    want = _ordered(ReduceOp.SUM, first)
    assert a[0].tobytes() == want.tobytes() and a[1].tobytes() == want.tobytes()
    s1 = start(1, b)
    for _ in range(100):
        done = [s0.Test(), s1.Test()]
        if all(done):
            break
    assert all(done)
    want = _ordered(ReduceOp.SUM, second)
    assert b[0].tobytes() == want.tobytes() and b[1].tobytes() == want.tobytes()
    assert channels[0].step == channels[1].step == 3


@pytest.mark.parametrize("n", [2, 3])
def test_all_reduces_of_every_shape_between_the_other_calls_stay_exact(n):
    """All_reduces (one meeting, two meetings, several chunks) and reduces back to back and between
    the channel's other calls, 120 calls with new values each, on threads: each result exact, so
    the buffers an all_reduce takes again (after one of its own) are never written too early and
    a call of another kind after it finds its own."""
    rng = np.random.default_rng(11)
    kinds = ["all_reduce", "all_reduce", "reduce", "all_reduce", "reduce_scatter", "all_reduce", "all_gather",
             "broadcast"]
    plan = [(kinds[int(rng.integers(len(kinds)))], int(rng.choice([100, 300, 1100, 3000]))) for _ in range(120)]
    data = [[rng.standard_normal(n * c) for _ in range(n)] for _, c in plan]
    got: list[list[np.ndarray]] = [[] for _ in range(n)]

    def calls(ch, req, r):
        for k, (kind, c) in enumerate(plan):
            src = data[k][r].copy()
            if kind in ("all_reduce", "reduce"):
                yield from ch.all_reduce(req, src, ReduceOp.SUM, root=-1 if kind == "all_reduce" else k % n)
                got[r].append(src)
            elif kind == "reduce_scatter":
                dst = np.empty(c)
                yield from ch.reduce_scatter(req, dst, src, ReduceOp.SUM)
                got[r].append(dst)
            elif kind == "all_gather":
                dst = np.empty(n * c)
                yield from ch.all_gather(req, dst, src[r * c:(r + 1) * c].copy(), False)
                got[r].append(dst)
            else:
                yield from ch.broadcast(req, src, k % n)
                got[r].append(src)

    assert _drive(n, [lambda ch, req, r=r: calls(ch, req, r) for r in range(n)]) == [None] * n
    for k, (kind, c) in enumerate(plan):
        total = _ordered(ReduceOp.SUM, data[k])
        for r in range(n):
            want = {"all_reduce": total, "reduce": total if r == k % n else data[k][r],
                    "reduce_scatter": total[r * c:(r + 1) * c],
                    "all_gather": np.concatenate([data[k][q][q * c:(q + 1) * c] for q in range(n)]),
                    "broadcast": data[k][k % n]}[kind]
            if kind == "reduce" and r != k % n:
                continue  # a reduce leaves a non-root's buffer as MPI does: unspecified
            assert got[r][k].tobytes() == want.tobytes(), (k, kind, c, r)
