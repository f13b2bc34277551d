"""Sharding propagation of NumPy ops on DTensors: placements, values, and the collectives issued."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from tensor_cases import distribute_tensor, new_records

import meshkit
from meshkit.comm import local
from meshkit.tensor import DTensor, Partial, Replicate, Shard

S0, S1, S2, R, P = Shard(0), Shard(1), Shard(2), Replicate(), Partial()
RNG = np.random.default_rng(3)
A, B = RNG.standard_normal((5, 7)), RNG.standard_normal((7, 3))  # uneven over 2 and 4 ranks


def _run(world, fn, *args):
    """Run ``fn(mesh, *args)`` on a 1-D mesh; each rank returns (placements, full value, collectives)."""
    def body():
        mesh = meshkit.init_device_mesh("cpu", (world,))
        start = meshkit.flight_record()
        out = fn(mesh, *args)
        ops = [r["op"] for r in new_records(start)]
        return out.placements, ops, out.full_tensor()
    return local.run(body, world, timeout=60)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("pa,pb,out,ops", [
    (R, R, R, []), (S0, R, S0, []), (R, S1, S1, []), (S1, S0, P, []), (P, R, P, []), (R, P, P, []),
    (S1, R, P, []),                                        # B sliced locally to Shard(0): no collective
    (S0, S1, S0, ["all_gather_into_tensor"]),              # no rule: one operand gathered
    (R, S0, P, []),                                        # A sliced locally to Shard(1)
    (Partial("max"), R, R, ["all_reduce"]),                # max is not linear: reduced first
])
def test_matmul_rules(world, pa, pb, out, ops):
    def fn(mesh):
        a, b = distribute_tensor(A, mesh, [pa]), distribute_tensor(B, mesh, [pb])
        return a @ b
    for placements, issued, full in _run(world, fn):
        assert placements == (out,) and issued == ops
        np.testing.assert_allclose(full, A @ B, atol=1e-12)


def test_batched_matmul_and_dot():
    x, w = RNG.standard_normal((4, 3, 5)), RNG.standard_normal((5, 2))

    def fn(mesh):
        start = meshkit.flight_record()
        d = distribute_tensor(x, mesh, [S0]) @ distribute_tensor(w, mesh, [R])  # batch-sharded, weight broadcast
        assert d.placements == (S0,) and d.shape == (4, 3, 2) and new_records(start) == []
        both = distribute_tensor(x, mesh, [S0]) @ distribute_tensor(np.swapaxes(x, 1, 2), mesh, [S0])
        assert both.placements == (S0,)
        np.testing.assert_allclose(both.full_tensor(), x @ np.swapaxes(x, 1, 2), atol=1e-12)
        dd = np.dot(distribute_tensor(A, mesh, [S1]), distribute_tensor(B, mesh, [S0]))
        assert dd.placements == (P,)
        np.testing.assert_allclose(dd.full_tensor(), A @ B, atol=1e-12)
        with pytest.raises(NotImplementedError, match=r"np.matmul.*\(Shard\(dim=0\),\)"):
            distribute_tensor(np.ones(3), mesh, [S0]) @ distribute_tensor(np.ones(3), mesh, [S0])
        return d

    for placements, _, full in _run(2, fn):
        assert placements == (S0,)
        np.testing.assert_allclose(full, x @ w, atol=1e-12)


@pytest.mark.parametrize("expr,pa,pb,out,ops", [
    (lambda a, b: 2 * a + 1, S0, None, S0, []),
    (lambda a, b: np.tanh(a) / 3.0, S1, None, S1, []),
    (lambda a, b: a + b, S1, S1, S1, []),
    (lambda a, b: a - b, P, P, P, []),                     # linear in the terms
    (lambda a, b: a * 2.5 - b * 0.5, P, P, P, []),
    (lambda a, b: -a / b, P, R, P, []),
    (lambda a, b: a + b, P, R, R, ["all_reduce"]),         # P + R is not linear: reduce first
    (lambda a, b: a + 1, P, None, R, ["all_reduce"]),
    (lambda a, b: np.exp(a), P, None, R, ["all_reduce"]),
    (lambda a, b: a * b, S0, S1, S0, ["all_to_all_single"]),
    (lambda a, b: a * b, S0, R, S0, []),                   # b sliced locally
    (lambda a, b: a * b, P, S0, S0, ["reduce_scatter_tensor"]),
])
def test_elementwise_rules(expr, pa, pb, out, ops):
    b_global = RNG.standard_normal(A.shape) + 3.0

    def fn(mesh):
        a = distribute_tensor(A, mesh, [pa])
        b = distribute_tensor(b_global, mesh, [pb]) if pb else None
        return expr(a, b)
    want = expr(A, b_global)
    for placements, issued, full in _run(4, fn):
        assert placements == (out,) and issued == ops
        np.testing.assert_allclose(full, want, atol=1e-12)


def test_broadcasting_a_bias_slices_it_locally():
    h, bias = RNG.standard_normal((5, 6)), RNG.standard_normal(6)

    def fn(mesh):
        start = meshkit.flight_record()
        by_col = distribute_tensor(h, mesh, [S1]) + distribute_tensor(bias, mesh, [R])
        assert new_records(start) == [], "the bias is sliced locally"
        by_row = distribute_tensor(h, mesh, [S0]) + distribute_tensor(bias, mesh, [R])
        assert by_row.placements == (S0,)
        np.testing.assert_allclose(by_row.full_tensor(), h + bias)
        col = distribute_tensor(h[:, :1], mesh, [R]) * distribute_tensor(h, mesh, [S1])  # (5, 1) broadcast
        np.testing.assert_allclose(col.full_tensor(), h[:, :1] * h)
        return by_col

    for placements, issued, full in _run(4, fn):
        assert placements == (S1,)
        np.testing.assert_allclose(full, h + bias)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_reductions(world):
    def body():
        mesh = meshkit.init_device_mesh("cpu", (world,))
        a = distribute_tensor(A, mesh, [S0])
        out = {}
        for name, fn, want in [("sum", lambda x: np.sum(x), A.sum()), ("sum0", lambda x: x.sum(axis=0), A.sum(0)),
                               ("sum1", lambda x: np.sum(x, 1), A.sum(1)),
                               ("mean0k", lambda x: np.mean(x, axis=0, keepdims=True), A.mean(0, keepdims=True)),
                               ("mean", lambda x: x.mean(), A.mean()), ("max", np.max, A.max()),
                               ("min1", lambda x: np.min(x, axis=1), A.min(1)),
                               ("maxP", lambda x: np.max(x * 1.0 + 0.0, axis=(0, 1)), A.max())]:
            r = fn(a)
            np.testing.assert_allclose(r.full_tensor(), want, atol=1e-12, err_msg=name)
            out[name] = r.placements
        partial_sum = np.sum(distribute_tensor(A, mesh, [P]), axis=1)
        out["P"] = partial_sum.placements
        np.testing.assert_allclose(partial_sum.full_tensor(), A.sum(1), atol=1e-12)
        return out

    for out in local.run(body, world):  # 5 rows over 4 ranks: 2, 2, 1, 0 — max/min of an empty block
        assert out == {"sum": (P,), "sum0": (P,), "sum1": (S0,), "mean0k": (P,), "mean": (P,),
                       "max": (Partial("max"),), "min1": (S0,), "maxP": (Partial("max"),), "P": (P,)}


def test_transpose_and_reshape():
    x = np.arange(4 * 6 * 5.0).reshape(4, 6, 5)

    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2))
        d = distribute_tensor(x, mesh, [S0, S2])
        t = np.transpose(d, (2, 0, 1))
        assert t.placements == (S1, S0) and t.shape == (5, 4, 6)
        assert d.T.placements == (S2, S0) and d.transpose(1, 0, 2).placements == (S1, S2)
        np.testing.assert_array_equal(t.full_tensor(), np.transpose(x, (2, 0, 1)))
        merged = distribute_tensor(x, mesh, [S0, R]).reshape(24, 5)  # 4 rows of 6 over 2: evenly
        assert merged.placements == (S0, R)
        np.testing.assert_array_equal(merged.full_tensor(), x.reshape(24, 5))
        split = distribute_tensor(x, mesh, [S1, S2]).reshape(4, 2, 3, 5)
        assert split.placements == (S1, Shard(3))
        np.testing.assert_array_equal(split.full_tensor(), x.reshape(4, 2, 3, 5))
        kept = np.reshape(distribute_tensor(x, mesh, [S2, P]), (2, 12, 5))
        assert kept.placements == (S2, P)
        inner = distribute_tensor(x, mesh, [S1, R]).reshape(4, 30)  # 6 = 2 x 3 rows of 5: chunks stay whole
        assert inner.placements == (S1, R)
        np.testing.assert_array_equal(inner.full_tensor(), x.reshape(4, 30))
        # blocks would move (issue 40): gathered, reshaped, cut again along the largest new axis
        moving = distribute_tensor(x, mesh, [S1, R]).reshape(24, 5)  # the sharded axis merges into the batch
        assert moving.placements == (S0, R)
        np.testing.assert_array_equal(moving.full_tensor(), x.reshape(24, 5))
        uneven = distribute_tensor(np.arange(10.).reshape(5, 2), mesh, [S0, R]).reshape(10)  # 5 rows unevenly
        assert uneven.placements == (S0, R)
        np.testing.assert_array_equal(uneven.full_tensor(), np.arange(10.))
        return True

    assert all(local.run(body, 4))


def test_bad_mixes_are_named_and_redistribution_is_logged(caplog):
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        other = meshkit.DeviceMesh("cpu", [1, 0])
        a = distribute_tensor(A, mesh, [S0])
        with pytest.raises(ValueError, match=r"rank \d: np.add: argument 1 is on mesh"):
            a + distribute_tensor(A, other, [S0])
        with pytest.raises(NotImplementedError, match="np.multiply: argument 1 is a ndarray"):
            a * A
        with pytest.raises(ValueError, match=r"np.add: in place \(x op= y, or out=x\) the result would have "
                                             r"placements \(Shard\(dim=0\),\) .* but out has placements \(Replicate"):
            np.add(distribute_tensor(A, mesh, [R]), a, out=distribute_tensor(A, mesh, [R]))
        with pytest.raises(NotImplementedError, match=r"np.unique: has no DTensor rule \(placements \(Shard\(dim=0\),\)\); "
                                                      "redistribute to Replicate first"):
            np.unique(a)
        p = distribute_tensor(A, mesh, [P])
        return (p + 1).placements

    with caplog.at_level(logging.DEBUG, logger="meshkit.tensor"):
        assert local.run(body, 2) == [(R,), (R,)]
    assert any("np.add: redistributing argument 0 from (Partial(sum),) to (Replicate(),)" in r.getMessage()
               for r in caplog.records)


def test_item_free_scalars_and_numpy_scalars():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        a = distribute_tensor(A, mesh, [S1])
        b = np.float64(2.0) * a ** 2 - np.array(1.0)
        assert isinstance(b, DTensor) and b.placements == (S1,)
        return b.full_tensor()

    for full in local.run(body, 2):
        np.testing.assert_allclose(full, 2 * A ** 2 - 1)


ALL_PLACEMENTS = [S0, S1, R, P, Partial("avg"), Partial("max"), Partial("min")]


@pytest.mark.parametrize("world", [2, 3])
def test_an_operand_used_twice_is_two_operands(world):
    # y / y with y Partial(sum) once kept Partial (the terms' ratios summed: 2 or NaN, not 1)
    x = A + 3.0  # no zeros: x / x is 1

    def body():
        mesh = meshkit.init_device_mesh("cpu", (world,))
        out = []
        for p in ALL_PLACEMENTS:
            d = distribute_tensor(x, mesh, [p])
            for name, f in [("x*x", lambda v: v * v), ("x/x", lambda v: v / v), ("x-x", lambda v: v - v),
                            ("x+x", lambda v: v + v), ("true_divide", lambda v: np.true_divide(v, v))]:
                out.append((p, name, f(d).full_tensor(), f(x)))
        y = distribute_tensor(A, mesh, [S1]) @ distribute_tensor(B, mesh, [S0])  # Partial(sum), real terms
        out.append((y.placements, "y/y", (y / y).full_tensor(), np.ones((5, 3))))
        return out

    for rank in local.run(body, world):
        for p, name, got, want in rank:
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"{name} on {p}")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy's own inf * 0 and x / 0
@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2)])
def test_partial_times_a_non_finite_factor_is_reduced_first(mesh_shape):
    # Partial(sum) terms times inf (or over 0) are +-inf and NaN where a term is 0 (the idle ranks'
    # -0.0): the sum was NaN where NumPy gives +-inf. Every rank decides alike (same placements).
    v, m = np.array([1.0, -2.0, 0.5]), np.array([[np.inf, 1.0], [2.0, 3.0], [1.0, -np.inf]])
    cases = [("p*inf", lambda p, r, z, w: p * np.inf, v * np.inf),
             ("inf*p", lambda p, r, z, w: np.float64(-np.inf) * p, -np.inf * v),
             ("p/0.0", lambda p, r, z, w: p / 0.0, v / 0.0),
             ("p/R(zeros)", lambda p, r, z, w: p / z, v / np.zeros(3)),
             ("p*R(inf)", lambda p, r, z, w: p * r, v * np.array([np.inf, 1.0, -np.inf])),
             ("p*nan", lambda p, r, z, w: p * np.nan, v * np.nan),
             ("p@R(inf)", lambda p, r, z, w: p.reshape(1, 3) @ w, v.reshape(1, 3) @ m),
             ("p*2 stays", lambda p, r, z, w: p * 2.0, v * 2.0)]

    def body():
        mesh = meshkit.init_device_mesh("cpu", mesh_shape)
        reps = [R] * len(mesh_shape)
        p = distribute_tensor(v, mesh, [P] + reps[1:])
        r = distribute_tensor(np.array([np.inf, 1.0, -np.inf]), mesh, reps)
        z, w = distribute_tensor(np.zeros(3), mesh, reps), distribute_tensor(m, mesh, reps)
        return [(name, f(p, r, z, w).placements, f(p, r, z, w).full_tensor()) for name, f, _ in cases]

    results = local.run(body, int(np.prod(mesh_shape)))
    for rank in results:
        for (name, placements, got), (_, _, want) in zip(rank, cases):
            np.testing.assert_array_equal(got, want, err_msg=name)
            assert placements == results[0][[c[0] for c in cases].index(name)][1], "every rank decides alike"
    assert results[0][-1][1][0] == P, "a finite factor keeps the Partial (no collective)"


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_max_min_of_every_dtype_with_an_empty_block(mesh_shape):
    # 3 rows over 4 ranks (2, 1, 0, 0): the empty blocks hold the identity, whatever the dtype
    # (bool once failed on the empty ranks only, leaving the others waiting in the collective)
    arrays = {"bool": np.array([[True, False], [False, False], [True, False]]),
              "int8": np.array([[-3, 5], [7, -128], [0, 127]], dtype=np.int8),
              "uint8": np.array([[3, 0], [255, 1], [9, 8]], dtype=np.uint8),
              "float16": np.array([[1.5, -2.0], [np.inf, 0.0], [-1.0, 3.0]], dtype=np.float16),
              "complex128": np.array([[1 + 2j, 2 - 1j], [2 + 0j, -1j], [1 + 3j, 0j]])}

    def body():
        mesh = meshkit.init_device_mesh("cpu", mesh_shape)
        out = []
        for name, x in arrays.items():
            d = distribute_tensor(x, mesh, [S0] * len(mesh_shape))
            for f in (np.max, np.min):
                for axis in (None, 0, 1):
                    r = f(d, axis=axis)
                    out.append((name, f.__name__, axis, r.full_tensor(), f(x, axis=axis)))
        dates = distribute_tensor(np.array(["2020-01-01", "2021-01-01", "2019-01-01"], dtype="datetime64[D]"),
                                  mesh, [S0] * len(mesh_shape))
        with pytest.raises(TypeError, match=r"np.max: dtype datetime64\[D\] over an axis sharded by "
                                            r"\(Shard\(dim=0\),"):
            np.max(dates)
        return out

    for rank in local.run(body, 4):
        for name, f, axis, got, want in rank:
            assert got.dtype == want.dtype, (name, f, axis)
            np.testing.assert_array_equal(got, want, err_msg=f"{f} {name} axis={axis}")


def test_matmul_of_global_shapes_that_do_not_multiply_raises_on_every_rank():
    # each rank's blocks multiplied: (5, 4) @ (3, 4) with Shard(1) gave rank 0 a product of w's first
    # two rows (its blocks (5, 2) and (2, 4) fit) while rank 1 raised NumPy's own error, alone
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        x = distribute_tensor(np.ones((5, 4)), mesh, [Shard(1)])
        w = distribute_tensor(np.ones((3, 4)), mesh, [Shard(1)])
        with pytest.raises(ValueError) as info:
            x @ w
        with pytest.raises(ValueError, match=r"shapes \(2, 5, 4\) and \(3, 4, 2\) do not multiply"):
            distribute_tensor(np.ones((2, 5, 4)), mesh, [Replicate()]) @ \
                distribute_tensor(np.ones((3, 4, 2)), mesh, [Replicate()])
        return str(info.value)

    for rank, msg in enumerate(local.run(body, 2)):
        assert msg == (f"meshkit.tensor: rank {rank}: np.matmul: shapes (5, 4) and (3, 4) do not multiply (the "
                       "contraction dims differ: 4 and 3); a @ b needs a.shape[-1] == b.shape[-2] and batch dims "
                       "that broadcast"), msg
