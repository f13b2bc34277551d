"""tests/support/tensor_validation.py: every rule of the dispatch tables checked against NumPy,
Partial inputs split unevenly with mixed signs; a planted wrong rule is caught; none is wrong."""

from __future__ import annotations

import time

import numpy as np
import pytest

import meshkit
from meshkit.comm import local
from meshkit.tensor import Partial, Shard, dispatch, shape_ops, ufuncs
from support.tensor_validation import Report, _name, _terms, operations, samples_for, validate_rules


def _validate(mesh_shape, **kwargs) -> Report:
    def body():
        return validate_rules(meshkit.init_device_mesh("cpu", mesh_shape), **kwargs)
    reports = local.run(body, int(np.prod(mesh_shape)), timeout=300)
    assert all(r.totals() == reports[0].totals() for r in reports)  # the same report on every rank
    return reports[0]


def test_partial_terms_are_uneven_large_and_of_either_sign():
    rng = np.random.default_rng(0)
    value = np.abs(rng.standard_normal((5, 6))) + 0.1  # all positive
    for op, reduce in (("sum", np.sum), ("avg", np.mean), ("max", np.max), ("min", np.min)):
        terms = _terms(value, op, 3, np.random.default_rng(1))
        np.testing.assert_allclose(reduce(np.stack(terms), axis=0), value, rtol=1e-12, atol=1e-12)
        assert not any(np.allclose(t, value / 3) or np.allclose(t, value) for t in terms), op
    signs = np.sign(np.stack(_terms(value, "sum", 3, np.random.default_rng(1))))
    assert (signs < 0).any() and (signs > 0).any()  # a positive array split into terms of both signs
    assert np.max(np.abs(_terms(value, "sum", 3, np.random.default_rng(1))[0])) > 2 * np.max(value)


def test_every_table_entry_is_enumerated_and_has_samples():
    ops = operations()
    for f in dispatch.FUNCTIONS:  # read from the tables, not a hand list
        assert _name(f) in ops
    assert "np.matmul" in ops and "np.exp" in ops and "np.einsum" in ops and "meshkit.tensor.logsumexp" in ops
    assert {"np.var", "np.cumsum", "np.sort", "np.linalg.norm", "DTensor.__setitem__"} <= set(ops)  # issue 40
    assert [name for name, op in ops.items() if not samples_for(op)] == []


def test_a_partial_kept_through_exp_is_reported_wrong(monkeypatch):
    right = _validate((2,), ops=["np.exp", "np.negative"])
    assert right.totals()["wrong"] == 0 and right.ops["np.exp"].tried == 7  # S(0), S(1), R, four Partials
    monkeypatch.setattr(ufuncs, "_UNARY_LINEAR", ufuncs._UNARY_LINEAR | {np.exp})  # exp "linear": a wrong rule
    planted = _validate((2,), ops=["np.exp", "np.negative"])
    wrong = planted.ops["np.exp"].wrong
    assert len(wrong) == 2 and all("P(sum)" in w or "P(avg)" in w for w in wrong), wrong
    assert "values differ" in wrong[0] and planted.ops["np.negative"].wrong == []
    assert "np.exp: 2 wrong/7" in planted.summary()


def test_a_shard_claimed_on_the_wrong_dim_is_reported_wrong(monkeypatch):
    def lying_transpose(a, axes=None):  # keeps Shard(d) where the axis moved: the classic mistake
        out = shape_ops.transpose(a, axes)
        return type(out)(out.to_local(), out.device_mesh, a.placements, shape=out.shape)
    monkeypatch.setitem(dispatch.FUNCTIONS, np.transpose, lying_transpose)
    report = _validate((2, 2), ops=["np.transpose"], max_combos=None)
    wrong = report.ops["np.transpose"].wrong
    assert wrong and all("S(" in w for w in wrong), wrong
    assert any("holds a block of shape" in w for w in wrong)  # 5 rows claimed where 6 are held


def test_a_rule_that_only_some_ranks_refuse_is_wrong(monkeypatch):
    def copy_refused_on_rank_1(a, *args, **kwargs):  # np.copy communicates nothing: no hang to fear
        if meshkit.get_rank() == 1:
            raise NotImplementedError("only here")
        return type(a)(a.to_local().copy(), a.device_mesh, a.placements, shape=a.shape)
    monkeypatch.setitem(dispatch.FUNCTIONS, np.copy, copy_refused_on_rank_1)
    wrong = _validate((2,), ops=["np.copy"]).ops["np.copy"].wrong
    assert len(wrong) == 7 and "only some ranks refused" in wrong[0], wrong


def test_the_mesh_must_span_the_world():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        validate_rules(mesh["a"])
    with pytest.raises(ValueError, match=r"rank \d: validate_rules: the mesh \(2,\) must span the world of 4 ranks"):
        local.run(body, 4)


#: What the rules refuse, by op, over the CI sample (the gaps, listed)
EXPECTED_GAPS = {"np.matvec", "np.vecdot", "np.vecmat"}


# NumPy's own var/std of a one-row sample with ddof=1 (the reference the rules are judged against)
# warns and gives NaN; the NaN is what is compared, the warning is NumPy's and expected
@pytest.mark.filterwarnings("ignore:Degrees of freedom <= 0 for slice:RuntimeWarning")
def test_no_rule_is_wrong_on_1d_and_2d_meshes():
    """The whole validator, every op of the tables, on meshes of 2, 3, 2x2 and 2x3 ranks (uneven:
    5 rows over 2, 3 and 6). Sampled for CI: at most 8 placement combinations per sample on 2
    ranks and 4 elsewhere, drawn deterministically; ``max_combos=None`` tries them all."""
    start = time.perf_counter()
    report = _validate((2,), max_combos=8)
    for shape in ((3,), (2, 2), (2, 3)):
        report = report.merge(_validate(shape, max_combos=4))
    totals = report.totals()
    print(report.summary(examples=1), f"\n{time.perf_counter() - start:.1f} s")
    assert totals["wrong"] == 0 and totals["errors"] == 0, report.summary()
    assert totals["ops"] == len(operations()) and report.no_sample == []
    assert totals["tried"] > 3000
    gaps = {name for name, r in report.ops.items() if r.missing}
    assert gaps <= EXPECTED_GAPS, gaps - EXPECTED_GAPS
    assert {"np.vecdot", "np.matvec"} <= gaps  # gufuncs have no rule (and are reported)
    assert report.ops["np.divmod"].tried and not report.ops["np.divmod"].missing  # two outputs have one


def test_layer_op_rules_on_real_processes(mpirun):
    out = mpirun("mpi_tensor_validation.py", 4, timeout=240).stdout
    assert out.count("VALIDATION OK") == 4, out
