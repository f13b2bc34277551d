"""Issue 40's rules, by what they decide: the placements they give and where they communicate
(none where the sharded axis is untouched), what a write changes, and NumPy's dtypes. Values are
the validator's (tests/test_tensor_validation.py); here each rule's promise is pinned."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import meshkit
from meshkit.comm import local
from meshkit.tensor import Partial, Replicate, Shard
from tensor_cases import distribute_tensor, new_records

X = np.random.default_rng(41).standard_normal((5, 7))
S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial("sum")


def _on(n, body):
    """``body(mesh)`` on ``n`` ranks of a 1-D mesh; every rank's result."""
    return local.run(lambda: body(meshkit.init_device_mesh("cpu", (n,))), n)


def _quiet(fn):
    """``(fn(), the collectives it issued)``."""
    start = meshkit.flight_record()
    out = fn()
    return out, [r["op"] if isinstance(r, dict) and "op" in r else r for r in new_records(start)]


def test_the_untouched_sharded_axis_communicates_nothing():
    def body(mesh):
        d = distribute_tensor(X, mesh, [S0])
        seen = {}
        for name, fn, want in [("var(axis=1)", lambda: np.var(d, axis=1), np.var(X, axis=1)),
                               ("cumsum(axis=1)", lambda: np.cumsum(d, axis=1), np.cumsum(X, axis=1)),
                               ("sort(axis=1)", lambda: np.sort(d, axis=1), np.sort(X, axis=1)),
                               ("median(axis=1)", lambda: np.median(d, axis=1), np.median(X, axis=1)),
                               ("diff(axis=1)", lambda: np.diff(d, axis=1), np.diff(X, axis=1)),
                               ("flip(axis=1)", lambda: np.flip(d, axis=1), np.flip(X, axis=1)),
                               ("pad(cols)", lambda: np.pad(d, ((0, 0), (1, 2))), np.pad(X, ((0, 0), (1, 2)))),
                               ("argmax(axis=1)", lambda: np.argmax(d, axis=1), np.argmax(X, axis=1)),
                               ("x[1:4]", lambda: d[1:4], X[1:4]),  # each rank's chunk of rows 1-3 is its own
                               ("count_nonzero", lambda: np.count_nonzero(d > 0), np.count_nonzero(X > 0)),
                               ("trace", lambda: np.trace(d), np.trace(X)),
                               ("average", lambda: np.average(d, axis=0, weights=np.arange(1.0, 6.0)),
                                np.average(X, axis=0, weights=np.arange(1.0, 6.0)))]:
            out, issued = _quiet(fn)
            seen[name] = (out.placements, issued)
            np.testing.assert_allclose(out.full_tensor(), want, rtol=1e-12, err_msg=name)
        return seen

    seen = _on(2, body)[0]
    assert all(issued == [] for _, issued in seen.values()), seen
    placements = {name: p for name, (p, _) in seen.items()}
    assert placements["var(axis=1)"] == (S0,) and placements["sort(axis=1)"] == (S0,)
    assert placements["x[1:4]"] == (S0,) and placements["argmax(axis=1)"] == (S0,)
    assert placements["count_nonzero"] == (P,) and placements["trace"] == (P,)  # completed only when needed
    assert placements["average"] == (P,)


def test_a_reduced_or_moved_sharded_axis_takes_one_named_collective():
    def body(mesh):
        d = distribute_tensor(X, mesh, [S0])
        out = {}
        for name, fn in [("var", lambda: np.var(d, axis=0)), ("cumsum", lambda: np.cumsum(d, axis=0)),
                         ("argmax", lambda: np.argmax(d)), ("prod", lambda: np.prod(d, axis=0)),
                         ("sort", lambda: np.sort(d, axis=0)), ("x[::-1]", lambda: d[::-1]),
                         ("norm", lambda: np.linalg.norm(d)), ("x[2]", lambda: d[2])]:
            result, issued = _quiet(fn)
            out[name] = (result.placements, len(issued))
        _, issued = _quiet(lambda: d[2])
        out["x[2] by"] = [r.get("op") if isinstance(r, dict) else r for r in issued]
        return out

    got = _on(3, body)[0]
    assert got["var"] == ((R,), 1) and got["argmax"] == ((R,), 1) and got["prod"] == ((R,), 1)
    assert got["cumsum"] == ((S0,), 1)  # the exclusive scan of the shard totals: one all-gather of a line
    assert got["sort"] == ((S1,), 1)  # one all-to-all: the rows go whole, the result sharded on columns
    assert got["x[::-1]"][0] == (S0,)  # still sharded on rows after the move
    assert got["norm"] == ((R,), 1)
    assert got["x[2]"] == ((R,), 1) and "broadcast" in str(got["x[2] by"])  # the owner's row only, not a gather


def test_writes_change_only_the_owning_ranks_block_and_a_partial_sum_one_term():
    def body(mesh):
        d = distribute_tensor(X, mesh, [S0])
        before = d.to_local().copy()
        _, issued = _quiet(lambda: d.__setitem__((4, 0), 9.0))
        changed = not np.array_equal(before, d.to_local())
        p = distribute_tensor(X, mesh, [R]).redistribute(placements=[P])
        p[1, 2:4] = [7.0, 8.0]
        p += 1.5
        want = X.copy()
        want[4, 0] = 9.0
        wantp = X.copy()
        wantp[1, 2:4] = [7.0, 8.0]
        np.testing.assert_array_equal(d.full_tensor(), want)
        np.testing.assert_allclose(p.full_tensor(), wantp + 1.5, rtol=1e-12)
        return changed, issued, p.placements, p.to_local()[1, 2]

    (c0, i0, pl0, t0), (c1, i1, pl1, t1) = _on(2, body)
    assert (c0, c1) == (False, True) and i0 == i1 == []  # row 4 lives on rank 1 (rows 3-4) only
    assert pl0 == pl1 == (P,) and (t0, t1) == (8.5, 0.0)  # coordinate 0's term holds the value


def test_a_boolean_mask_gives_every_rank_the_same_data_dependent_length():
    def body(mesh):
        d = distribute_tensor(X, mesh, [S1])
        out = d[d > 0.3]
        return out.shape, out.placements

    shapes = _on(3, body)
    assert shapes == [((int(np.count_nonzero(X > 0.3)),), (R,))] * 3


def test_numpys_dtypes_and_nan():
    ints = (X * 4).astype(np.int32)
    nan = X.copy()
    nan[3, 2] = np.nan

    def body(mesh):
        di, db, dn, df = (distribute_tensor(v, mesh, [S0]) for v in (ints, ints > 0, nan, X.astype(np.float32)))
        out = {"var(int32)": np.var(di, axis=0), "cumsum(bool)": np.cumsum(db, axis=0),
               "argmax(nan)": np.argmax(dn), "std(float32)": np.std(df, axis=0), "prod(int32)": np.prod(di, axis=0),
               "median(nan)": np.median(dn, axis=0), "any(bool)": np.any(db, axis=0)}
        return {k: (v.dtype, v.full_tensor()) for k, v in out.items()}

    got = _on(2, body)[0]
    want = {"var(int32)": np.var(ints, axis=0), "cumsum(bool)": np.cumsum(ints > 0, axis=0),
            "argmax(nan)": np.argmax(nan), "std(float32)": np.std(X.astype(np.float32), axis=0),
            "prod(int32)": np.prod(ints, axis=0), "median(nan)": np.median(nan, axis=0),
            "any(bool)": np.any(ints > 0, axis=0)}
    for name, (dtype, value) in got.items():
        assert dtype == want[name].dtype, name
        np.testing.assert_allclose(value, want[name], rtol=1e-5 if dtype == np.float32 else 1e-12, err_msg=name)
    assert got["argmax(nan)"][1] == 3 * 7 + 2


def test_var_with_no_degrees_of_freedom_left_warns_and_gives_nan_as_numpy():
    """ddof at least the count: NumPy warns "Degrees of freedom <= 0" and gives NaN (or inf); so does
    the rule, on every rank, for real and complex blocks, sharded or not along the reduced axis."""
    row = X[:1]

    def body(mesh):
        return [np.std(distribute_tensor(v, mesh, [p]), axis=0, ddof=1).full_tensor()
                for v in (row, row.astype(complex)) for p in (S0, S1)]

    with pytest.warns(RuntimeWarning, match="Degrees of freedom <= 0 for slice") as caught:
        got = _on(2, body)
    assert sum("Degrees of freedom" in str(w.message) for w in caught) == 8  # 4 calls on each of 2 ranks
    for value in (v for rank in got for v in rank):
        assert np.isnan(value).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # enough degrees left: no warning
        _on(2, lambda mesh: np.std(distribute_tensor(X, mesh, [S0]), axis=0, ddof=1).full_tensor())


def test_the_ndarray_methods_route_to_the_rules():
    def body(mesh):
        d = distribute_tensor(X, mesh, [S1])
        return {name: np.asarray(getattr(d, name)(*args).full_tensor()) for name, args in
                [("var", (0,)), ("std", ()), ("prod", (1,)), ("any", ()), ("all", (0,)), ("argmax", ()),
                 ("argmin", (1,)), ("cumsum", (1,)), ("cumprod", (0,)), ("argsort", ()), ("trace", ()),
                 ("ravel", ()), ("flatten", ())]} | {"dot": d.dot(d.T).full_tensor()}

    got = _on(3, body)[0]
    for name, args in [("var", (0,)), ("std", ()), ("prod", (1,)), ("any", ()), ("all", (0,)), ("argmax", ()),
                       ("argmin", (1,)), ("cumsum", (1,)), ("cumprod", (0,)), ("argsort", ()), ("trace", ()),
                       ("ravel", ()), ("flatten", ())]:
        np.testing.assert_allclose(got[name], getattr(X, name)(*args), rtol=1e-12, err_msg=name)
    np.testing.assert_allclose(got["dot"], X.dot(X.T), rtol=1e-12)


def test_every_reduction_is_one_collective_of_one_packed_buffer_for_every_dtype():
    """Issue 40's speed point: int64 argmax (float64 cannot hold its values), complex argmax and
    var, the TSQR of a matrix 2-norm and norm(x) of a 3-d array each issue one collective; the
    layout facts are worked out once per layout (the same plan comes back)."""
    from meshkit.tensor.reduction_plan import reduction_plan

    big = (np.arange(35).reshape(5, 7) * (2**60 // 35)).astype(np.int64)  # distinct beyond float64's 2^53
    cplx = X + 1j * X[::-1]
    tall = np.random.default_rng(7).standard_normal((13, 3))

    def body(mesh):
        d, c, t = (distribute_tensor(v, mesh, [S0]) for v in (big, cplx, tall))
        x3 = distribute_tensor(np.arange(60.0).reshape(5, 4, 3), mesh, [S0])
        out = {}
        for name, fn, want in [("argmax int64", lambda: np.argmax(d, axis=0), np.argmax(big, axis=0)),
                               ("argmin int64 flat", lambda: np.argmin(d), np.argmin(big)),
                               ("argmax complex", lambda: np.argmax(c), np.argmax(cplx)),
                               ("var complex", lambda: np.var(c, axis=0), np.var(cplx, axis=0)),
                               ("norm 2 (TSQR)", lambda: np.linalg.norm(t, 2), np.linalg.norm(tall, 2)),
                               ("norm nuc (TSQR)", lambda: np.linalg.norm(t, "nuc"), np.linalg.norm(tall, "nuc")),
                               ("norm 3-d", lambda: np.linalg.norm(x3), np.linalg.norm(np.arange(60.0)))]:
            result, issued = _quiet(fn)
            np.testing.assert_allclose(result.to_local(), want, rtol=1e-12, err_msg=name)
            out[name] = (result.placements, len(issued))
        first = reduction_plan(mesh, d.shape, d.placements, (0,), False)
        out["cached"] = first is reduction_plan(mesh, d.shape, d.placements, (0,), False)
        return out

    got = _on(2, body)[0]
    assert got.pop("cached")
    assert got == {name: ((R,), 1) for name in got}, got


def test_a_scan_over_blocks_some_of_them_empty_adds_the_right_totals():
    """3 columns over the 6 ranks of [Shard(2), Shard(2)] on a 2x3 mesh: three ranks hold no column.
    The exclusive scan of the shard totals counts every rank's (0 for an empty block) by its
    position; leaving the empty ones out of the gathered totals shifted the positions (found by the
    validator run over every combination)."""
    x3 = np.random.default_rng(3).standard_normal((5, 6, 3))

    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 3))
        d = distribute_tensor(x3, mesh, [Shard(2), Shard(2)])
        return np.cumsum(d, axis=2).full_tensor(), np.cumprod(d, axis=2).full_tensor()

    for got_sum, got_prod in local.run(body, 6):
        np.testing.assert_allclose(got_sum, np.cumsum(x3, axis=2), rtol=1e-12)
        np.testing.assert_allclose(got_prod, np.cumprod(x3, axis=2), rtol=1e-12)


def test_the_plans_kept_are_bounded_by_their_variable(monkeypatch):
    """MESHKIT_DTENSOR_PLANS bounds the reduction plans kept (the oldest dropped; results unchanged)
    and a bad value is refused naming the variable, before any communication."""
    import pytest

    from meshkit.tensor import reduction_plan as plans

    monkeypatch.setattr(plans, "_plans", {})
    monkeypatch.setenv("MESHKIT_DTENSOR_PLANS", "2")

    def body(mesh):
        d = distribute_tensor(X, mesh, [S0])
        got = [np.var(d, axis=0).full_tensor(), np.var(d, axis=1).full_tensor(), np.var(d).full_tensor()]
        return got, len(plans._plans)

    for got, kept in _on(1, body):
        assert kept <= 2
        for value, want in zip(got, (np.var(X, axis=0), np.var(X, axis=1), np.var(X))):
            np.testing.assert_allclose(value, want, rtol=1e-12)
    monkeypatch.setenv("MESHKIT_DTENSOR_PLANS", "many")
    with pytest.raises(meshkit.DistValueError, match=r"meshkit.tensor: MESHKIT_DTENSOR_PLANS='many' is not valid; "
                                                     r"valid values are a positive integer \(default 1024\)"):
        _on(1, lambda mesh: np.prod(distribute_tensor(X, mesh, [S0]), axis=1))
