"""The one-meeting path for small ordinary buffers (comm/engines/shm_small.py) without processes:
threads as ranks, each with its own Channel over one anonymous mapping (as tests/test_shm_layout.py
drives the channel's other calls). The real-process cases run in tests/test_shm.py's job, whose tiny
settings send its one-chunk all_reduces through this path.
"""

from __future__ import annotations

import mmap
import os
import threading
import time

import numpy as np
import pytest

from collective_cases import ops_for
from shm_threads import finish, on_threads
from meshkit import ReduceOp
from meshkit.comm.engines import shm_layout as layout
from meshkit.comm.engines.engine import CallsDiffer
from meshkit.comm.engines.shm_collectives import Channel, ShmRequest
from meshkit.comm.engines.shm_small import CACHED_SHAPES, SmallPath, SmallRequest
from meshkit.comm.errors import RankFailedError

CHUNK = 4096


def _paths(n: int, least: int = 0, most: int = CHUNK) -> list[SmallPath]:
    memory = mmap.mmap(-1, layout.segment_bytes(n, CHUNK))
    return [SmallPath(Channel(memory, n, r, CHUNK, 1024, list(range(n))), least, most) for r in range(n)]


def _drive(paths: list[SmallPath], calls, timeout: float = 20.0) -> list:
    """Run ``calls[r](path)`` (each a list of request factories, run in order) on a thread per rank;
    each rank's first exception, or None."""
    def rank(r):
        for call in calls[r]:
            finish(call(paths[r]), r, timeout)

    return on_threads(len(paths), rank)


def _ordered(op: ReduceOp, parts: list[np.ndarray]) -> np.ndarray:
    """The reduction in rank order, by NumPy (AVG sums: the group divides afterwards)."""
    fn = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PRODUCT: np.multiply, ReduceOp.MIN: np.minimum,
          ReduceOp.MAX: np.maximum, ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or,
          ReduceOp.BXOR: np.bitwise_xor}[op]
    if parts[0].dtype == bool and op in (ReduceOp.SUM, ReduceOp.AVG):
        fn = np.logical_or
    acc = parts[0].copy()
    for p in parts[1:]:
        acc = fn(acc, p)
    return acc


def _inputs(n: int, dtype, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    kind = np.dtype(dtype).kind
    if kind == "b":
        return [rng.integers(0, 2, count).astype(bool) for _ in range(n)]
    if kind in "iu":
        return [rng.integers(1, 4, count).astype(dtype) for _ in range(n)]
    if kind == "c":
        return [(rng.standard_normal(count) + 1j * rng.standard_normal(count)).astype(dtype) for _ in range(n)]
    return [rng.standard_normal(count).astype(dtype) for _ in range(n)]


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int32, np.uint8, np.bool_, np.complex64, np.longdouble])
def test_all_reduce_and_reduce_scatter_are_the_fixed_order_reduction_bit_for_bit(n, dtype):
    count = 24  # n blocks of 24 for reduce_scatter; every size fits one chunk of 4 KB
    for i, op in enumerate(ops_for(dtype)):
        parts = _inputs(n, dtype, count, seed=i)
        bufs = [p.copy() for p in parts]
        ins = _inputs(n, dtype, n * count, seed=100 + i)
        outs = [np.empty(count, dtype) for _ in range(n)]
        assert _drive(_paths(n), [[lambda p, r=r: p.all_reduce(bufs[r], op),
                                   lambda p, r=r: p.reduce_scatter(outs[r], ins[r], op)] for r in range(n)]) == [None] * n
        expected, full = _ordered(op, parts), _ordered(op, ins)
        for r in range(n):  # exactly NumPy's values in rank order, and bitwise the same bytes on every rank
            assert np.array_equal(bufs[r], expected) and bufs[r].tobytes() == bufs[0].tobytes(), (op, r)
            assert np.array_equal(outs[r], full[r * count:(r + 1) * count]), (op, r)
    # all_gather: every rank's block in rank order, bit for bit; rank 1 gathers in place (its input is its block)
    parts = _inputs(n, dtype, count, seed=7)
    gathered = [np.zeros(n * count, dtype) for _ in range(n)]
    gathered[1][count:2 * count] = parts[1]
    ins = [parts[r] if r != 1 else gathered[1][count:2 * count] for r in range(n)]
    assert _drive(_paths(n), [[lambda p, r=r: p.all_gather(gathered[r], ins[r])] for r in range(n)]) == [None] * n
    for r in range(n):
        assert gathered[r].tobytes() == np.concatenate(parts).tobytes(), r


@pytest.mark.parametrize("n", [2, 3])
def test_back_to_back_calls_of_mixed_sizes_never_read_a_buffer_the_next_call_overwrote(n):
    """No barrier between calls: 300 calls with new values each (sizes and ops changing; every fourth
    a reduce_scatter, every eighth into its own block of its input; most fifths an all_gather), every
    result checked."""
    paths = _paths(n)
    rng = np.random.default_rng(0)
    rounds, ops = 300, [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN]
    counts = [int(c) for c in rng.integers(1, 120, rounds)]
    data = [[rng.standard_normal(n * c) for _ in range(n)] for c in counts]
    got: list[list[np.ndarray]] = [[] for _ in range(n)]

    def calls(r):
        out = []
        for k, c in enumerate(counts):
            src, op = data[k][r].copy(), ops[k % 3]
            if k % 4 == 3:
                dst = src[r * c:(r + 1) * c] if k % 8 == 7 else np.empty(c)
                out.append(lambda p, d=dst, s=src, op=op: p.reduce_scatter(d, s, op))
                got[r].append(dst)
            elif k % 5 == 4:  # an all_gather of block r of this round's data
                dst = np.empty(n * c)
                out.append(lambda p, d=dst, s=src[r * c:(r + 1) * c].copy(): p.all_gather(d, s))
                got[r].append(dst)
            else:
                out.append(lambda p, s=src, op=op: p.all_reduce(s, op))
                got[r].append(src)
        return out

    assert _drive(paths, [calls(r) for r in range(n)]) == [None] * n
    for k, c in enumerate(counts):
        full = _ordered(ops[k % 3], data[k])
        if k % 4 != 3 and k % 5 == 4:
            full = np.concatenate([data[k][q][q * c:(q + 1) * c] for q in range(n)])
        for r in range(n):
            want = full[r * c:(r + 1) * c] if k % 4 == 3 else full
            assert got[r][k].tobytes() == want.tobytes(), (k, r)


def test_a_mismatch_with_a_call_on_the_channels_other_path_raises_on_every_rank_before_any_data_is_read():
    """Rank 0's 200 elements take the channel's chunked path, rank 1's 100 this one: they meet at the
    same step, compare the same headers, and both raise, naming both calls; a second pair differs in
    the op only, both on this path."""
    paths = _paths(2, most=1024)
    a, b = np.ones(200), np.full(100, 2.0)
    errors: list = [None, None]

    def rank0():
        request = ShmRequest("all_reduce", lambda req: paths[0].channel.all_reduce(req, a, ReduceOp.SUM))
        try:
            while not request.Test():
                os.sched_yield()
        except CallsDiffer as exc:
            errors[0] = exc

    thread = threading.Thread(target=rank0)
    thread.start()
    request = paths[1].all_reduce(b, ReduceOp.SUM)
    with pytest.raises(CallsDiffer) as raised:
        while not request.Test():
            os.sched_yield()
    thread.join()
    assert isinstance(errors[0], CallsDiffer), errors
    for exc in (errors[0], raised.value):
        assert [str(c) for _, c in exc.entries] == ["all_reduce(shape=(200,), dtype=float64, op=SUM)",
                                                    "all_reduce(shape=(100,), dtype=float64, op=SUM)"]
    assert (a == 1).all() and (b == 2).all()  # nothing was written
    c, d = np.ones(10), np.ones(10)
    errors = _drive(paths, [[lambda p: p.all_reduce(c, ReduceOp.SUM)], [lambda p: p.all_reduce(d, ReduceOp.MAX)]])
    assert all(isinstance(e, CallsDiffer) for e in errors), errors
    assert [str(c) for _, c in errors[1].entries] == ["all_reduce(shape=(10,), dtype=float64, op=SUM)",
                                                      "all_reduce(shape=(10,), dtype=float64, op=MAX)"]
    e, f = np.ones(10), np.full(10, 3.0)  # the channel goes on in lockstep afterwards
    assert _drive(paths, [[lambda p: p.all_reduce(e, ReduceOp.SUM)], [lambda p: p.all_reduce(f, ReduceOp.SUM)]]) == \
        [None, None]
    assert (e == 4).all() and (f == 4).all()


def test_a_missing_rank_is_named_and_a_dead_one_fails_its_peer_at_once():
    memory = mmap.mmap(-1, layout.segment_bytes(2, CHUNK))
    me = SmallPath(Channel(memory, 2, 0, CHUNK, 1024, [5, 9]), 0, 1024)
    Channel(memory, 2, 1, CHUNK, 1024, [5, 9])  # rank 1 attached (its pid is this process's) but never calls
    request = me.all_reduce(np.ones(10), ReduceOp.SUM)
    assert isinstance(request, SmallRequest) and request.path == "shm"
    assert not request.Test() and request.missing_ranks == [1]
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    me.channel.words[1 * layout.CONTROL_WORDS + layout.PID] = dead  # rank 1's process is gone
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=rf"rank 5: all_reduce over shared memory cannot complete: "
                                             rf"rank 9 \(pid {dead}\) died before it arrived"):
        while not request.Test():
            time.sleep(0.001)
    assert time.monotonic() - start < 1.0
    with pytest.raises(RankFailedError):  # raised again by every later Test
        request.Test()


def test_which_buffers_it_takes_and_its_caches_stay_bounded():
    path = _paths(2, least=64, most=1 << 20)[0]
    assert path.most == CHUNK  # held to one chunk
    assert [path.takes(b) for b in (63, 64, CHUNK, CHUNK + 1)] == [False, True, True, False]
    assert path.most_reduced == CHUNK // 2
    assert [path.gathers(b) for b in (63, 64, CHUNK // 4, CHUNK // 4 + 1)] == [False, True, True, False]
    assert path.describe() == (", all_reduce of NumPy arrays of 64-2048 bytes, reduce_scatter of 64-4096 and all_gather "
                               "of 64-1024 in one meeting")
    assert _paths(2, least=2048, most=1024)[0].describe() == ""  # least above most: off
    paths = _paths(2)
    for count in range(1, CACHED_SHAPES + 40):
        bufs = [np.ones(count % 500 + 1) for _ in range(2)]
        assert _drive(paths, [[lambda p, b=b: p.all_reduce(b, ReduceOp.SUM)] for b in bufs]) == [None, None]
        assert (bufs[0] == 2).all()
    assert all(len(p._reduced) <= CACHED_SHAPES for p in paths)
    paths[0].close()
    assert not paths[0]._reduced


def test_closing_lets_the_segment_be_unmapped():
    memory = mmap.mmap(-1, layout.segment_bytes(2, CHUNK))
    channels = [Channel(memory, 2, r, CHUNK, 1024, [0, 1]) for r in range(2)]
    paths = [SmallPath(c, 0, CHUNK) for c in channels]
    bufs = [np.ones(50), np.ones(50)]
    assert _drive(paths, [[lambda p, b=b: p.all_reduce(b, ReduceOp.SUM)] for b in bufs]) == [None, None]
    for path in paths:
        path.close()
        path.channel.close()
    memory.close()  # refused (BufferError) while any view of it lived
    assert memory.closed
