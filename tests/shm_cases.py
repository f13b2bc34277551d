"""The shared-memory path's cases, run by every rank of one meshkit-run job (tests/test_shm.py).

The job runs with tiny settings (``MESHKIT_SHM_MIN_BYTES=512`` and ``MESHKIT_SHM_MOVE_MIN_BYTES=512``,
``MESHKIT_SHM_SMALL_BYTES=2048``, ``MESHKIT_SHM_SMALL_MIN_BYTES=512``, ``MESHKIT_SHM_SHARED_MIN_BYTES=600``,
``MESHKIT_SHM_CHUNK_BYTES=4096``), so that a few KB exercise every path: MPI below 512 bytes, an
ordinary all_reduce of 512 B-1 KB in one meeting of comm/engines/shm_small.py (the mismatch case
meets a 1.6 KB call of the chunked path there), a reduce or a reduce_scatter of 2 KB or less in
one meeting of the chunked path, two meetings and many chunks above. Each rank computes every
rank's input, and the reference is NumPy's reduction in the same fixed rank order
(``((x0 op x1) op x2) ...``), so every dtype compares exactly, float64 included; each result's
digest is gathered, so every rank holds bitwise the same bytes.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np

import meshkit
from meshkit import ReduceOp
from meshkit.comm._seams import resolve_group

from collective_cases import DTYPES, ops_for

#: Bytes of each case's arrays: below MESHKIT_SHM_MIN_BYTES (MPI), one chunk of at most
#: MESHKIT_SHM_SMALL_BYTES (one meeting), five chunks of MESHKIT_SHM_CHUNK_BYTES (two meetings).
SIZES = {"mpi": 256, "small": 768, "chunked": 20000}
#: MESHKIT_SHM_MIN_BYTES of the job: the path compares it with a collective's largest array
#: (all_gather's output, reduce_scatter's input: n times a rank's part).
MIN_BYTES = 512


def path_for(nbytes: int) -> str:
    return "shm" if nbytes >= MIN_BYTES else "mpi"


def inputs(rank: int, dtype, count: int, op: ReduceOp) -> np.ndarray:
    """Rank ``rank``'s input: random in float kinds (exactness comes from the order, not the values),
    small in integers (products stay in range), 0/1 for booleans."""
    rng = np.random.default_rng(1000 * rank + count)
    kind = np.dtype(dtype).kind
    if kind == "b":
        return rng.integers(0, 2, count).astype(dtype)
    if kind in "iu":
        top = 3 if op is ReduceOp.PRODUCT else 50
        return rng.integers(1, top, count).astype(dtype)
    if kind == "c":
        return (rng.standard_normal(count) + 1j * rng.standard_normal(count)).astype(dtype)
    return rng.standard_normal(count).astype(dtype)


def ordered(op: ReduceOp, parts: list[np.ndarray]) -> np.ndarray:
    """NumPy's reduction of ``parts`` in rank order, in their dtype (AVG: the sum, then the group's division)."""
    acc = parts[0].copy()
    for other in parts[1:]:
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            acc = np.logical_or(acc, other) if acc.dtype.kind == "b" else np.add(acc, other, dtype=acc.dtype)
        elif op is ReduceOp.PRODUCT:
            acc = np.multiply(acc, other, dtype=acc.dtype)
        elif op is ReduceOp.MIN:
            acc = np.minimum(acc, other)
        elif op is ReduceOp.MAX:
            acc = np.maximum(acc, other)
        elif op is ReduceOp.BAND:
            acc = np.bitwise_and(acc, other)
        elif op is ReduceOp.BOR:
            acc = np.bitwise_or(acc, other)
        else:
            acc = np.bitwise_xor(acc, other)
    if op is ReduceOp.AVG:
        n = len(parts)
        acc = acc * acc.dtype.type(1.0 / n) if n & (n - 1) == 0 and acc.dtype.kind == "f" else acc / n
    return acc.astype(parts[0].dtype)


def _last_path() -> str:
    return meshkit.flight_record()[-1]["path"]


def _same_everywhere(arrays: list[np.ndarray], what: str) -> None:
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()
    every = [None] * meshkit.get_world_size()
    meshkit.all_gather_object(every, digest)
    assert len(set(every)) == 1, f"{what}: the ranks' results differ bitwise: {every}"


def check_dtype_ops(dtype) -> int:
    """Every collective of the path, every op of ``dtype``, at each size, sync and async."""
    rank, n = meshkit.get_rank(), meshkit.get_world_size()
    itemsize = np.dtype(dtype).itemsize
    checks = 0
    digests = []
    for label, nbytes in SIZES.items():
        if label == "mpi" and np.dtype(dtype) not in (np.dtype(np.float64), np.dtype(np.int32)):
            continue  # the step aside below the threshold: two dtypes are enough (CI's time)
        count = max(1, nbytes // itemsize)
        path = "mpi" if label == "mpi" else "shm"
        results = []
        for i, op in enumerate(ops_for(dtype)):
            what = f"{np.dtype(dtype).name} {op.name} {label}"
            parts = [inputs(r, dtype, count, op) for r in range(n)]
            expected = ordered(op, parts)
            buf = parts[rank].copy()
            work = meshkit.all_reduce(buf, op=op, async_op=bool(i % 2))
            if work is not None:
                work.wait()
            assert _last_path() == path, f"all_reduce {what}: path {_last_path()}, expected {path}"
            if path == "shm" or np.dtype(dtype).kind not in "fc":  # MPI's order is MPI's
                assert np.array_equal(buf, expected), f"all_reduce {what}: {buf[:4]} != {expected[:4]}"
            results.append(buf)
            # reduce to the last rank: only its array changes
            buf = parts[rank].copy()
            meshkit.reduce(buf, dst=n - 1, op=op)
            want = expected if rank == n - 1 else parts[rank]
            if path == "shm" or np.dtype(dtype).kind not in "fc":
                assert np.array_equal(buf, want), f"reduce {what}"
            # reduce_scatter: rank r gets block r of the reduction of every rank's n blocks
            blocks = [inputs(r, dtype, count * n, op) for r in range(n)]
            out = np.empty(count, dtype)
            meshkit.reduce_scatter_tensor(out, blocks[rank], op=op)
            assert _last_path() == path_for(blocks[rank].nbytes), f"reduce_scatter {what}: path {_last_path()}"
            if _last_path() == "shm" or np.dtype(dtype).kind not in "fc":
                full = ordered(op, blocks)
                assert np.array_equal(out, full[rank * count:(rank + 1) * count]), f"reduce_scatter {what}"
            checks += 3
        if path == "shm":  # (MPI's long double results differ in their padding bytes)
            digests += results
        mine = inputs(rank, dtype, count, ReduceOp.SUM)
        out = np.empty(count * n, dtype)
        meshkit.all_gather_into_tensor(out, mine, async_op=True).wait()
        assert _last_path() == path_for(out.nbytes), f"all_gather {np.dtype(dtype).name} {label}: {_last_path()}"
        assert np.array_equal(out, np.concatenate([inputs(r, dtype, count, ReduceOp.SUM) for r in range(n)]))
        inplace = np.concatenate([inputs(r, dtype, count, ReduceOp.SUM) if r == rank else np.zeros(count, dtype)
                                  for r in range(n)])
        meshkit.all_gather_into_tensor(inplace, inplace[rank * count:(rank + 1) * count])
        assert np.array_equal(inplace, out), f"in-place all_gather {np.dtype(dtype).name} {label}"
        buf = mine.copy()
        meshkit.broadcast(buf, src=1)
        assert np.array_equal(buf, inputs(1, dtype, count, ReduceOp.SUM)), f"broadcast {np.dtype(dtype).name} {label}"
        checks += 3
    _same_everywhere(digests, f"all_reduce {np.dtype(dtype).name}")
    return checks


def check_repeats() -> None:
    """The same float32 all_reduce twice gives bitwise the same bytes (the order is fixed, not timing's)."""
    rank = meshkit.get_rank()
    x = inputs(rank, np.float32, 30000, ReduceOp.SUM)
    a, b = x.copy(), x.copy()
    meshkit.all_reduce(a)
    meshkit.all_reduce(b, async_op=True).wait()
    assert a.tobytes() == b.tobytes()


def check_mismatch() -> str:
    """Rank 0 reduces 200 elements, the others 100: every rank raises CollectiveMismatchError at once,
    naming both calls; the group works afterwards."""
    rank = meshkit.get_rank()
    count = 200 if rank == 0 else 100
    try:
        meshkit.all_reduce(np.ones(count))
    except meshkit.CollectiveMismatchError as exc:
        message = str(exc)
    else:
        raise AssertionError("a mismatched all_reduce did not raise")
    assert "all_reduce(shape=(200,), dtype=float64, op=SUM)" in message, message
    assert "all_reduce(shape=(100,), dtype=float64, op=SUM)" in message, message
    buf = np.ones(300)
    meshkit.all_reduce(buf)
    assert (buf == meshkit.get_world_size()).all()
    return message


def check_timeout() -> str | None:
    """On group [0, 1] (timeout 1.5 s) rank 1 skips an all_reduce: rank 0 raises CollectiveTimeout
    naming rank 1, whose flag never came; rank 1 learns that the group broke."""
    rank = meshkit.get_rank()
    group = meshkit.new_group([0, 1], timeout=1.5)
    if rank == 0:
        try:
            meshkit.all_reduce(np.ones(1000), group=group)
        except meshkit.CollectiveTimeout as exc:
            assert "ranks that did not arrive: [1]" in str(exc), str(exc)
            assert meshkit.flight_record()[-1]["state"] == "timed_out"
            assert resolve_group(group).engine.__class__.__name__ == "ShmEngine"
            return str(exc)
        raise AssertionError("an all_reduce rank 1 never joined did not time out")
    return None


def check_shared_buffer() -> None:
    """A buffer of ``shared_buffer`` is reduced in place (path shm from MESHKIT_SHM_SHARED_MIN_BYTES, 600
    in this job; MPI below it, on the same memory, even where an ordinary array of its size meets once), a view of it too,
    and DDP's buckets live in one: its gradients reduce in place and match the expected sum."""
    rank, n = meshkit.get_rank(), meshkit.get_world_size()
    group = resolve_group(None)
    buf = group.shared_buffer(8 * 1000).view(np.float64)
    assert buf.shape == (1000,) and not buf.any()
    buf[:] = np.arange(1000) * (rank + 1)
    meshkit.all_reduce(buf)
    assert _last_path() == "shm" and np.array_equal(buf, np.arange(1000) * (n * (n + 1) // 2))
    part = buf[10:90]  # a view: the same place on every rank, below MESHKIT_SHM_MIN_BYTES
    part[:] = rank
    meshkit.all_reduce(part, op=ReduceOp.MAX, async_op=True).wait()
    assert _last_path() == "shm" and (part == n - 1).all() and np.array_equal(buf[:10], np.arange(10) * (n * (n + 1) // 2))
    # 560 bytes, below 600: not the one meeting of an ordinary array of its size (512-1024 B here), but
    # what it took before there was one (the chunked path from MESHKIT_SHM_MIN_BYTES, 512 here); asked
    # of the engine itself, the only place the two differ
    mid = buf[200:270]
    mid[:] = rank + 1
    request = group.engine.all_reduce(mid, ReduceOp.SUM)
    assert type(request).__name__ == "ShmRequest", type(request)
    group.engine.wait(request, time.monotonic() + 30)
    assert (mid == n * (n + 1) // 2).all()
    small = buf[100:110]  # 80 bytes, below MESHKIT_SHM_SHARED_MIN_BYTES: MPI on the same memory
    small[:] = rank + 1
    meshkit.all_reduce(small)
    assert _last_path() == "mpi" and (small == n * (n + 1) // 2).all() and (buf[90:100] == np.arange(90, 100) * (n * (n + 1) // 2)).all()
    flat = group.shared_buffer(8 * 300 * n).view(np.float64)  # FSDP's layout: gather into, scatter from
    flat[rank * 300:(rank + 1) * 300] = rank
    meshkit.all_gather_into_tensor(flat, flat[rank * 300:(rank + 1) * 300])
    assert _last_path() == "shm" and np.array_equal(flat, np.repeat(np.arange(n, dtype=float), 300))
    shard = np.empty(300)
    meshkit.reduce_scatter_tensor(shard, flat)
    assert _last_path() == "shm" and (shard == n * rank).all()
    from meshkit.parallel import DistributedDataParallel

    params = {"w": np.zeros((64, 8)), "b": np.zeros(8)}
    ddp = DistributedDataParallel(params)
    for name in params:
        ddp.grads[name][...] = rank + 1.0
        ddp.mark_grad_ready(name)
    ddp.finish_gradient_sync()
    for name in params:
        assert (ddp.grads[name] == (n + 1) / 2).all(), (name, ddp.grads[name].ravel()[:3])
    reduced = [e for e in meshkit.flight_record() if e["op"] == "all_reduce" and e["dtype"] == "float64"][-1]
    assert reduced["path"] == "shm", reduced  # a bucket of 4 KB, below the threshold: in place in the segment
