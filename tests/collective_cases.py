"""Every collective against a NumPy reference, run by each rank (local engine and MPI scripts).

Each rank can compute every rank's input (``make``), so each checks its own output against a
reference written with plain NumPy, independent of meshkit's reduction code. Values are small
integers (or halves), so sums and products are exact in every dtype, float16 included.
"""

from __future__ import annotations

import numpy as np

import meshkit
from meshkit import ReduceOp
from meshkit.comm._seams import prepare_collective, resolve_group

DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
          np.float16, np.float32, np.float64, np.longdouble, np.complex64, np.complex128]

# Which ops each kind of dtype supports, written out (torch's rules).
OPS = {
    "b": [ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR],
    "i": [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR],
    "f": [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX],
    "c": [ReduceOp.SUM, ReduceOp.AVG],
}
OPS["u"] = OPS["i"]


def ops_for(dtype) -> list[ReduceOp]:
    return OPS[np.dtype(dtype).kind]


def make(rank: int, n: int, dtype, count: int = 6, *, for_product: bool = False) -> np.ndarray:
    """Rank ``rank``'s deterministic input: small values, distinct per rank and element."""
    base = (np.arange(count) * 3 + rank * 7) % 5 + 1  # 1..5
    if for_product:  # at most three ranks contribute a 2: products stay tiny
        base = np.where((base % 3 == 0) & (rank < 3), 2, 1)
    kind = np.dtype(dtype).kind
    if kind == "b":
        return (base % 2 == 0).astype(dtype)
    if kind == "i":
        return (base - 2).astype(dtype) if not for_product else base.astype(dtype)
    if kind == "f":
        return (base * 0.5).astype(dtype)
    if kind == "c":
        return (base + 1j * (base % 3)).astype(dtype)
    return base.astype(dtype)


def reference(op: ReduceOp, stack: np.ndarray) -> np.ndarray:
    dtype = stack.dtype
    if op is ReduceOp.SUM:
        return np.add.reduce(stack, axis=0, dtype=dtype)
    if op is ReduceOp.AVG:
        return (np.add.reduce(stack, axis=0, dtype=dtype) / len(stack)).astype(dtype)
    if op is ReduceOp.PRODUCT:
        return np.multiply.reduce(stack, axis=0, dtype=dtype)
    if op is ReduceOp.MIN:
        return np.logical_and.reduce(stack, axis=0) if dtype.kind == "b" else stack.min(axis=0)
    if op is ReduceOp.MAX:
        return np.logical_or.reduce(stack, axis=0) if dtype.kind == "b" else stack.max(axis=0)
    if op is ReduceOp.BAND:
        return np.bitwise_and.reduce(stack, axis=0)
    if op is ReduceOp.BOR:
        return np.bitwise_or.reduce(stack, axis=0)
    return np.bitwise_xor.reduce(stack, axis=0)


def avg_rtol(dtype, n: int) -> float:
    """Relative error bound of NCCL's AVG of ``n`` positive inputs against their sum divided by n:
    NCCL multiplies each input by fl(1/n) in its own type, then sums (FuncPreMulSum; the double
    models it): fl(1/n), the n products and n-1 additions each round by at most half an ulp, and
    so do the reference's sum and division. fp16 at 7 ranks: 7.8e-3 (1.7e-3 measured)."""
    return 2 * (n + 1) * float(np.finfo(dtype).eps) / 2


def assert_close(actual: np.ndarray, expected: np.ndarray, what: str, *, averaged_over: int = 0) -> None:
    """``averaged_over``: the number of ranks of an AVG (its own rounding, see :func:`avg_rtol`)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    if actual.dtype.kind in "fc":
        part = np.finfo(actual.dtype).dtype  # a complex number's parts: complex64 has float32 precision
        rtol = 1e-3 if part == np.float16 else 1e-12 if part.itemsize >= 8 else 1e-6
        if averaged_over:
            rtol = max(rtol, avg_rtol(part, averaged_over))
        np.testing.assert_allclose(actual, expected, rtol=rtol, err_msg=what)
    else:
        np.testing.assert_array_equal(actual, expected, err_msg=what)


def _same(a):
    return a


def check_all(dtype, group=None, *, dev=_same, host=_same, ops=ops_for) -> int:
    """Run every buffer collective on ``group`` with ``dtype``; return the number of checks.

    ``dev`` turns a host array into the array the collectives get (e.g. a device copy), ``host``
    the other way for the comparison; ``ops(dtype)`` lists the reduce ops to try.
    """
    dtype = np.dtype(dtype)
    rank, n = meshkit.get_rank(group), meshkit.get_world_size(group)
    members = meshkit.get_process_group_ranks(group)
    checks = 0

    def ok(actual, expected, what):
        nonlocal checks
        averaged = n if what.endswith(f" {ReduceOp.AVG}") else 0  # the reductions' checks end with their op
        assert_close(host(actual), expected, f"{what} dtype={dtype} rank={rank}/{n}", averaged_over=averaged)
        checks += 1

    def empty(*shape):
        return dev(np.empty(shape, dtype))

    for op in ops(dtype):
        prod = op is ReduceOp.PRODUCT
        stack = np.stack([make(r, n, dtype, for_product=prod) for r in range(n)])
        x = dev(make(rank, n, dtype, for_product=prod))
        meshkit.all_reduce(x, op, group=group)
        ok(x, reference(op, stack), f"all_reduce {op}")

        root = n - 1
        y = dev(make(rank, n, dtype, for_product=prod))
        meshkit.reduce(y, dst=members[root], op=op, group=group)
        ok(y, reference(op, stack) if rank == root else make(rank, n, dtype, for_product=prod), f"reduce {op}")

        big = np.stack([make(r, n, dtype, count=3 * n, for_product=prod) for r in range(n)])
        expected = reference(op, big).reshape(n, 3)[rank]
        out = empty(3)
        meshkit.reduce_scatter_tensor(out, dev(big[rank].copy()), op, group=group)
        ok(out, expected, f"reduce_scatter_tensor {op}")
        out = empty(3)
        meshkit.reduce_scatter(out, [dev(c.copy()) for c in big[rank].reshape(n, 3)], op, group=group)
        ok(out, expected, f"reduce_scatter {op}")

        # prepared (one shape, validated once): the same results, and the input left alone
        pg = resolve_group(group)
        scatter = prepare_collective(pg, "reduce_scatter_tensor", (3 * n,), dtype, reduce_op=op)
        mine = dev(big[rank].copy())
        ok(scatter(mine), expected, f"prepared reduce_scatter_tensor {op}")
        ok(mine, big[rank], f"prepared reduce_scatter_tensor {op} input")
        reduce_all = prepare_collective(pg, "all_reduce", (6,), reduce_op=op)  # any dtype
        x = dev(make(rank, n, dtype, for_product=prod))
        ok(reduce_all(x), reference(op, stack), f"prepared all_reduce {op}")
        ok(x, make(rank, n, dtype, for_product=prod), f"prepared all_reduce {op} input")

    everyone = np.stack([make(r, n, dtype) for r in range(n)])
    root = n // 2
    b = dev(make(rank, n, dtype))
    meshkit.broadcast(b, src=members[root], group=group)
    ok(b, everyone[root], "broadcast")

    outs = [empty(6) for _ in range(n)]
    meshkit.all_gather(outs, dev(make(rank, n, dtype)), group=group)
    ok(np.stack([host(o) for o in outs]), everyone, "all_gather")
    flat = empty(6 * n)
    meshkit.all_gather_into_tensor(flat, dev(make(rank, n, dtype)), group=group)
    ok(flat, everyone.reshape(-1), "all_gather_into_tensor")
    flat = dev(np.zeros((n, 6), dtype))  # in place: the input is this rank's row of the output
    flat[rank] = dev(make(rank, n, dtype))  # a device copy first: the strict fake refuses host values
    meshkit.all_gather_into_tensor(flat, flat[rank], group=group)
    ok(flat, everyone, "all_gather_into_tensor in place")

    pg = resolve_group(group)
    gather_all = prepare_collective(pg, "all_gather_into_tensor", (2, 3), dtype)
    mine = make(rank, n, dtype).reshape(3, 2)
    ok(gather_all(dev(mine.T.copy())), np.stack([m.reshape(3, 2).T for m in everyone]).reshape(2 * n, 3),
       "prepared all_gather_into_tensor")
    if host is _same:  # a strided (transposed) NumPy input is made contiguous first (inputs are only read)
        ok(gather_all(mine.T), np.stack([m.reshape(3, 2).T for m in everyone]).reshape(2 * n, 3),
           "prepared all_gather_into_tensor, strided input")
    exchange = prepare_collective(pg, "all_to_all_single", (2 * n,), dtype)
    rows = np.stack([make(r * n, n, dtype, count=2 * n) for r in range(n)])  # rank r sends rows[r]
    ok(exchange(dev(rows[rank].copy())), rows.reshape(n, n, 2)[:, rank].reshape(-1), "prepared all_to_all_single")

    gl = [empty(6) for _ in range(n)] if rank == 0 else None
    meshkit.gather(dev(make(rank, n, dtype)), gl, dst=members[0], group=group)
    if rank == 0:
        ok(np.stack([host(g) for g in gl]), everyone, "gather")
    s = empty(6)
    meshkit.scatter(s, [dev(everyone[r].copy()) for r in range(n)] if rank == n - 1 else None,
                    src=members[n - 1], group=group)
    ok(s, everyone[rank], "scatter")

    # all_to_all with uneven sizes: rank i sends (i + j) % 3 + 1 elements to rank j.
    def piece(i, j):
        return make(i * n + j, n, dtype, count=(i + j) % 3 + 1)
    outs = [empty((j + rank) % 3 + 1) for j in range(n)]
    meshkit.all_to_all(outs, [dev(piece(rank, j)) for j in range(n)], group=group)
    for j in range(n):
        ok(outs[j], piece(j, rank), f"all_to_all from {j}")
    send_rows = [(rank + j) % 3 for j in range(n)]
    recv_rows = [(j + rank) % 3 for j in range(n)]
    inp = np.concatenate([np.broadcast_to(piece(rank, j)[:1], (send_rows[j], 1)) for j in range(n)]
                         + [np.empty((0, 1), dtype)]).astype(dtype).reshape(-1, 1)
    out = empty(sum(recv_rows), 1)
    meshkit.all_to_all_single(out, dev(np.ascontiguousarray(inp)), recv_rows, send_rows, group=group)
    expected = np.concatenate([np.broadcast_to(piece(j, rank)[:1], (recv_rows[j], 1)) for j in range(n)]
                              + [np.empty((0, 1), dtype)]).astype(dtype)
    ok(out, expected.reshape(-1, 1), "all_to_all_single uneven")

    # Ring shift with point-to-point: everything posted first, then waited.
    nxt, prv = members[(rank + 1) % n], members[(rank - 1) % n]
    got = empty(6)
    works = meshkit.batch_isend_irecv([meshkit.P2POp(meshkit.isend, dev(make(rank, n, dtype)), nxt, group),
                                       meshkit.P2POp(meshkit.irecv, got, prv, group)])
    for w in works:
        w.wait()
    ok(got, everyone[(rank - 1) % n], "ring shift")
    meshkit.barrier(group=group)
    return checks


def check_objects(group=None) -> int:
    """The four object collectives, with objects of different sizes per rank."""
    rank, n = meshkit.get_rank(group), meshkit.get_world_size(group)
    members = meshkit.get_process_group_ranks(group)

    def obj(r):
        return {"rank": r, "payload": list(range(r * 3)), "name": "x" * r}

    got = [None] * n
    meshkit.all_gather_object(got, obj(rank), group=group)
    assert got == [obj(r) for r in range(n)]
    lst = [obj(rank), "mine"] if rank == n - 1 else [None, None]
    meshkit.broadcast_object_list(lst, src=members[n - 1], group=group)
    assert lst == [obj(n - 1), "mine"]
    gl = [None] * n if rank == 0 else None
    meshkit.gather_object(obj(rank), gl, dst=members[0], group=group)
    if rank == 0:
        assert gl == [obj(r) for r in range(n)]
    out = [None]
    meshkit.scatter_object_list(out, [obj(r) for r in range(n)] if rank == 0 else None, src=members[0],
                                group=group)
    assert out[0] == obj(rank)
    return 4


def check_subgroup(dtype, **options) -> int:
    """Collectives on the group of even ranks; odd ranks only take part in creating it.

    ``options`` go to :func:`check_all` (``dev``, ``host``, ``ops``)."""
    world = meshkit.get_world_size()
    evens = list(range(0, world, 2))
    group = meshkit.new_group(evens)
    assert meshkit.new_group(evens) is group, "groups are cached by rank set"
    if meshkit.get_rank() % 2:
        assert meshkit.get_rank(group) == -1
        return 0
    assert meshkit.get_rank(group) == evens.index(meshkit.get_rank())
    return check_all(dtype, group, **options) + check_objects(group)
