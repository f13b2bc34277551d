"""The DTensor ops attention and MoE layers need: np.einsum, max reductions,
logsumexp, exp, np.where, concatenate/split/array_split, take; their placements, the
collectives they issue, and their values against NumPy on 1-D and 2-D meshes (local engine)."""

from __future__ import annotations

import numpy as np
import pytest
from tensor_cases import distribute_tensor, new_records

import meshkit
from meshkit.comm import local
from meshkit.tensor import Partial, Replicate, Shard, logsumexp

S0, S1, S2, S3, R, P = Shard(0), Shard(1), Shard(2), Shard(3), Replicate(), Partial()
RNG = np.random.default_rng(28)
Q, K = RNG.standard_normal((2, 3, 5, 4)), RNG.standard_normal((2, 3, 7, 4))  # (batch, heads, seq, dim)
SC = RNG.standard_normal((2, 3, 5, 7))                                         # attention scores
X, W = RNG.standard_normal((5, 7)), RNG.standard_normal((7, 3))               # tokens x d, d x h


def _run(mesh_shape, fn, *globals_and_placements):
    """Each rank: distribute every (array, placements), call ``fn``; returns (placements, collectives, full)."""
    def body():
        mesh = meshkit.init_device_mesh("cpu", mesh_shape)
        args = [distribute_tensor(a, mesh, list(p)) for a, p in globals_and_placements]
        start = meshkit.flight_record()
        out = fn(*args)
        issued = [r["op"] for r in new_records(start)]
        outs = out if isinstance(out, list) else [out]
        return [o.placements for o in outs], issued, [o.full_tensor() for o in outs]
    return local.run(body, int(np.prod(mesh_shape)), timeout=60)


def _check(results, placements, issued, want):
    want = want if isinstance(want, list) else [want]
    for got_p, got_ops, full in results:
        assert got_p == [tuple(p) for p in placements] and got_ops == issued, (got_p, got_ops)
        for f, w in zip(full, want):
            assert f.shape == w.shape
            np.testing.assert_allclose(f, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mesh,subscripts,a,b,pa,pb,out,issued", [
    # heads sharded (attention's tensor parallelism): no communication
    ((2,), "bhqd,bhkd->bhqk", Q, K, [S1], [S1], [S1], []),
    ((2,), "bhqk,bhkd->bhqd", SC, K, [S1], [S1], [S1], []),
    # the contraction index sharded: Partial(sum), no communication
    ((2,), "bhqd,bhkd->bhqk", Q, K, [S3], [S3], [P], []),
    ((3,), "td,dh->th", X, W, [S1], [S0], [P], []),
    ((3,), "td,dh->th", X, W, [S0], [R], [S0], []),               # token-sharded, weight whole
    ((3,), "td,dh->th", X, W, [R], [S0], [P], []),                # X sliced locally to match
    ((2,), "td,dh->th", X, W, [P], [R], [P], []),                 # linear in each operand
    ((2,), "td,dh->th", X, W, [Partial("max")], [R], [R], ["all_reduce"]),  # max is not
    ((2,), "td,dh->th", X, W, [S0], [S1], [S0], ["all_gather_into_tensor"]),  # no rule: one gathered
    # 2-D: batch over one mesh dim, heads over the other (uneven 3 heads over 2)
    ((2, 2), "bhqd,bhkd->bhqk", Q, K, [S0, S1], [S0, S1], [S0, S1], []),
    ((2, 2), "bhqk,bhkd->bhqd", SC, K, [S1, S3], [S1, S2], [S1, P], []),
])
def test_einsum_rules(mesh, subscripts, a, b, pa, pb, out, issued):
    _check(_run(mesh, lambda x, y: np.einsum(subscripts, x, y), (a, pa), (b, pb)), [out], issued,
           np.einsum(subscripts, a, b))


@pytest.mark.parametrize("mesh,subscripts,p,out", [
    ((2,), "ij->i", [S1], [P]), ((2,), "ij->j", [S1], [S0]), ((2,), "ij->ji", [S0], [S1]),
    ((2, 2), "ij->", [S0, S1], [P, P]), ((2,), "ii->i", [S0], [R]),  # a diagonal is never cut
])
def test_einsum_of_one_operand(mesh, subscripts, p, out):
    a = RNG.standard_normal((5, 5))
    results = _run(mesh, lambda x: np.einsum(subscripts, x), (a, p))
    _check(results, [out], results[0][1], np.einsum(subscripts, a))


def test_einsum_errors():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        x = distribute_tensor(X, mesh, [S0])
        with pytest.raises(NotImplementedError, match=r"np.einsum: subscripts '\.\.\.d->\.\.\.': '\.\.\.' has no"):
            np.einsum("...d->...", x)
        with pytest.raises(ValueError, match=r"np.einsum: subscripts 'ijk->i': term 'ijk' of operand 0 must be 2"):
            np.einsum("ijk->i", x)
        with pytest.raises(NotImplementedError, match=r"argument 1 is a ndarray, not a DTensor"):
            np.einsum("td,dh->th", x, W)
        with pytest.raises(NotImplementedError, match=r"out= is not supported"):
            np.einsum("td->t", x, out=np.zeros(5))
    local.run(body, 2)


@pytest.mark.parametrize("mesh,p,axis,out,issued", [
    ((2,), [S0], 0, [Partial("max")], []),           # each rank's max; the ranks' still to combine
    ((2,), [S0], 1, [S0], []),
    ((3,), [Partial("max")], 1, [Partial("max")], []),  # max of maxes
    ((3,), [P], 1, [R], ["all_reduce"]),              # max of a partial sum: reduced first
    ((2, 3), [S0, S1], 1, [S0, Partial("max")], []),
    ((2, 3), [S0, S0], 0, [Partial("max"), Partial("max")], []),  # 5 rows over 6: one rank empty
])
@pytest.mark.parametrize("name", ["max", "amax", "min", "amin"])
def test_max_min_reductions(mesh, p, axis, out, issued, name):
    f = getattr(np, name)
    if name in ("min", "amin"):
        out = [Partial("min") if q == Partial("max") else q for q in out]
        p = [Partial("min") if q == Partial("max") else q for q in p]
        issued = issued if p != [Partial("min")] else []
    _check(_run(mesh, lambda x: f(x, axis=axis), (X, p)), [out], issued, f(X, axis=axis))


def _logsumexp(a, axis=None, keepdims=False):
    """The definition, in long double: the reference the stable form must meet."""
    return np.log(np.sum(np.exp(a.astype(np.longdouble)), axis=axis, keepdims=keepdims)).astype(a.dtype)


@pytest.mark.parametrize("mesh,p,axis,keepdims,out,issued", [
    ((2,), [S1], 1, False, [R], ["all_reduce", "all_reduce"]),  # max, then sum of exp: exact
    ((3,), [S1], 1, True, [R], ["all_reduce", "all_reduce"]),
    ((2,), [S0], 1, False, [S0], []),                             # rows whole on each rank
    ((2,), [P], 1, False, [R], ["all_reduce"]),                   # the partial sum reduced once
    ((2, 2), [S0, S1], -1, False, [S0, R], ["all_reduce", "all_reduce"]),
    ((2, 3), [S1, S0], None, False, [R, R], ["all_reduce"] * 4),
])
def test_logsumexp_on_dtensors(mesh, p, axis, keepdims, out, issued):
    a = X * 400  # exp(400 * x) overflows unshifted
    with np.errstate(over="ignore"):
        assert not np.isfinite(np.log(np.sum(np.exp(a), axis=1))).all()
    _check(_run(mesh, lambda x: logsumexp(x, axis=axis, keepdims=keepdims), (a, p)), [out], issued,
           _logsumexp(a, axis=axis, keepdims=keepdims))


def test_logsumexp_on_plain_arrays_and_infinities():
    a = X * 400
    np.testing.assert_allclose(logsumexp(a, axis=0), _logsumexp(a, axis=0), rtol=1e-12)
    assert np.isscalar(logsumexp(a)) or np.ndim(logsumexp(a)) == 0
    np.testing.assert_allclose(logsumexp(a), _logsumexp(a), rtol=1e-12)
    rows = np.array([[-np.inf, -np.inf], [np.inf, 0.0], [1.0, -np.inf]])
    np.testing.assert_array_equal(logsumexp(rows, axis=1), [-np.inf, np.inf, 1.0])  # no NaN

    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        return logsumexp(distribute_tensor(rows.T, mesh, [S1]), axis=0).full_tensor()
    for full in local.run(body, 2):
        np.testing.assert_array_equal(full, [-np.inf, np.inf, 1.0])


def test_exp_of_a_partial_sum_is_reduced_first():
    # exp(a + b) != exp(a) + exp(b): keeping Partial through exp would be silently wrong
    for mesh, p in (((2,), [P]), ((2, 2), [S0, P]), ((3,), [Partial("avg")]), ((2,), [Partial("max")])):
        out = [R if q.is_partial() else q for q in p]
        _check(_run(mesh, np.exp, (X, p)), [out], ["all_reduce"], np.exp(X))


@pytest.mark.parametrize("mesh,pc,px,py,out,issued", [
    ((2,), [S0], [S0], [R], [S0], []),                     # y (a row) broadcast: whole on every rank
    ((2,), [R], [S1], [S0], [S1], []),                     # the row sliced locally
    ((3,), [S0], [P], [R], [S0], ["reduce_scatter_tensor"]),  # a Partial is reduced (selection is not linear)
    ((2, 2), [S0, R], [R, S1], [R, R], [S0, S1], []),
])
def test_where_broadcasts_three_inputs(mesh, pc, px, py, out, issued):
    cond, y = X > 0, -X[0]
    _check(_run(mesh, np.where, (cond, pc), (X, px), (y, py)), [out], issued, np.where(cond, X, y))


@pytest.mark.parametrize("mesh,pa,pb,axis,out,issued", [
    ((2,), [S1], [S1], 0, [S1], []),                       # along an unsharded axis: local
    ((2,), [S0], [S0], 0, [R], ["all_gather_into_tensor"] * 2),  # along the sharded axis: gathered
    ((3,), [S1], [R], 0, [S1], []),                        # the Replicate sliced locally
    ((2,), [P], [P], 0, [P], []),                          # joining the terms joins the sums
    ((2,), [P], [R], 0, [R], ["all_reduce"]),
    ((2, 3), [S1, S0], [R, S0], 1, [R, S0], ["all_gather_into_tensor"]),
])
def test_concatenate(mesh, pa, pb, axis, out, issued):
    a, b = X, RNG.standard_normal((3, 7)) if axis == 0 else RNG.standard_normal((5, 2))
    _check(_run(mesh, lambda x, y: np.concatenate([x, y], axis=axis), (a, pa), (b, pb)), [out], issued,
           np.concatenate([a, b], axis=axis))


@pytest.mark.parametrize("mesh,p,fn,out,issued", [
    ((2,), [S1], lambda a: np.split(a, [1, 3]), [S1], []),
    ((2,), [S0], lambda a: np.array_split(a, 3), [R], ["all_gather_into_tensor"]),  # 5 uneven rows
    ((3,), [P], lambda a: np.array_split(a, 2, axis=1), [P], []),
    ((2, 2), [S0, S1], lambda a: np.array_split(a, 4, axis=1), [S0, R], ["all_gather_into_tensor"]),
    ((2,), [S0], lambda a: np.split(a, [-2], axis=1), [S0], []),
])
def test_split_and_array_split(mesh, p, fn, out, issued):
    want = fn(X)
    _check(_run(mesh, fn, (X, p)), [out] * len(want), issued, want)


def test_split_errors():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        with pytest.raises(ValueError, match=r"np.split: .*equal division: axis of length 5 into 2 sections"):
            np.split(distribute_tensor(X, mesh, [S1]), 2)
    local.run(body, 2)


@pytest.mark.parametrize("mesh,p,indices,axis,out,issued", [
    ((2,), [S1], [4, 0, 4], 0, [S1], []),                  # rows gathered locally from column blocks
    ((2,), [S0], [[6, 0], [1, 1]], 1, [S0], []),           # 2-D indices: the kept dims shift
    ((3,), [S1], np.array([[4, 0]]), 0, [S2], []),
    ((2,), [S0], [4, 0], 0, [R], ["all_gather_into_tensor"]),  # along the sharded axis: gathered
    ((2,), [P], [2], 1, [P], []),                          # selection commutes with the sum
    ((2, 2), [S0, S1], 3, 1, [S0, R], ["all_gather_into_tensor"]),
    ((2,), [S1], [7, 0], None, [R], ["all_gather_into_tensor"]),  # the flattened array
])
def test_take(mesh, p, indices, axis, out, issued):
    _check(_run(mesh, lambda a: np.take(a, indices, axis=axis), (X, p)), [out], issued,
           np.take(X, indices, axis=axis))


def test_take_errors():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        x = distribute_tensor(X, mesh, [S1])
        with pytest.raises(IndexError, match=r"np.take: index 5 is out of bounds for axis 0 with size 5"):
            np.take(x, [0, 5], axis=0)
        with pytest.raises(TypeError, match=r"np.take: indices must be integers, got dtype float64"):
            np.take(x, [0.5], axis=0)
        with pytest.raises(ValueError, match=r"np.take: axis must be an int in \[-2, 2\) for 2 dims, got 2"):
            np.take(x, [0], axis=2)
    local.run(body, 2)


def test_an_attention_block_on_a_2x2_mesh_equals_numpy():
    """softmax(q k^T / sqrt(d)) v with logsumexp, heads over one mesh dim and the key sequence
    over the other (ring-attention's layout): only the softmax's reductions communicate."""
    v = RNG.standard_normal((2, 3, 7, 4))
    s = np.einsum("bhqd,bhkd->bhqk", Q, K) / 2.0
    want = np.einsum("bhqk,bhkd->bhqd", np.exp(s - _logsumexp(s, axis=-1, keepdims=True)), v)

    def fn(q, k, vv):
        scores = np.einsum("bhqd,bhkd->bhqk", q, k) / 2.0
        assert scores.placements == (S1, S3)
        probs = np.exp(scores - logsumexp(scores, axis=-1, keepdims=True))
        return np.einsum("bhqk,bhkd->bhqd", probs, vv)
    results = _run((2, 2), fn, (Q, [S1, R]), (K, [S1, S2]), (v, [S1, S2]))
    _check(results, [[S1, P]], ["all_reduce", "all_reduce"], want)


@pytest.mark.parametrize("mesh,pa,pb,out,issued", [
    ((2,), [S0], [S0], [S0], []),
    ((3,), [S1], [R], [S1], []),
    ((2, 2), [P, S1], [R, R], [R, S1], ["all_reduce"]),  # floor division of a partial sum: reduced first
])
def test_ufuncs_of_two_outputs(mesh, pa, pb, out, issued):
    b = np.abs(X) + 0.5
    results = _run(mesh, lambda x, y: list(np.divmod(x, y)), (X, pa), (b, pb))
    _check(results, [out, out], issued, list(np.divmod(X, b)))
    results = _run(mesh, lambda x: list(np.modf(x)), (X, pb))
    _check(results, [pb, pb], [], list(np.modf(X)))
