"""Prepared collectives: checked once, then each call as the public method (results, errors, records).

Their results on every dtype and op are in collective_cases.check_all (local engine, MPI, the
NCCL double, device arrays over MPI); here: what they refuse, and that a call is a collective
like any other (numbered, recorded, checked across ranks in detail mode, failing on a broken group).
"""

from __future__ import annotations

import numpy as np
import pytest

import meshkit
from meshkit.comm import local
from meshkit.comm._seams import all_reduce_owned, prepare_collective, resolve_group


def _world():
    return resolve_group(None)


def test_preparing_checks_the_op_shape_dtype_and_reduction_once():
    def body():
        g = _world()
        with pytest.raises(meshkit.DistValueError, match=r"rank \d: prepare_collective\('broadcast'\): op must be"):
            prepare_collective(g, "broadcast", (4,), np.float32)
        with pytest.raises(meshkit.DistValueError, match=r"shape\[0\] = 3 must be a multiple of the group size 2"):
            prepare_collective(g, "reduce_scatter_tensor", (3,), np.float32)
        with pytest.raises(meshkit.DistValueError, match="shape must be a non-empty tuple"):
            prepare_collective(g, "all_gather_into_tensor", (), np.float32)
        with pytest.raises(meshkit.DistTypeError, match="dtype object cannot be communicated"):
            prepare_collective(g, "all_gather_into_tensor", (2,), object)
        with pytest.raises(meshkit.DistTypeError, match="AVG is not defined for dtype int32"):
            prepare_collective(g, "all_reduce", (2,), np.int32, reduce_op=meshkit.ReduceOp.AVG)
        with pytest.raises(meshkit.DistTypeError, match="reduce_op='mean' is not a ReduceOp"):
            prepare_collective(g, "all_reduce", (2,), reduce_op="mean")
        with pytest.raises(meshkit.DistTypeError, match="group must be a ProcessGroup"):
            prepare_collective(None, "all_reduce", (2,))
        return True

    assert local.run(body, 2, timeout=30) == [True, True]


def test_an_input_unlike_the_prepared_one_is_refused_on_every_rank():
    """A rank whose input has another shape or dtype is refused, naming both, and its peers'
    matching call fails too (instead of running with mismatched sizes or waiting)."""
    def body():
        g, rank = _world(), meshkit.get_rank()
        gather = prepare_collective(g, "all_gather_into_tensor", (2, 3), np.float32)
        assert np.array_equal(gather(np.full((2, 3), rank, np.float32)),
                              np.repeat(np.arange(2, dtype=np.float32), 2)[:, None] * np.ones(3))
        with pytest.raises(meshkit.DistTypeError, match="input must be an array, got list"):
            gather([1.0])
        scatter = prepare_collective(g, "reduce_scatter_tensor", (4,))  # any dtype
        assert np.array_equal(scatter(np.ones(4, np.int16)), np.full(2, 2, np.int16))
        if rank == 0:
            with pytest.raises(meshkit.DistTypeError, match=r"rank 0: all_gather_into_tensor: input has dtype "
                                                            r"float64 but this collective was prepared for dtype float32"):
                gather(np.zeros((2, 3)))
            with pytest.raises(meshkit.DistValueError, match=r"rank 0: reduce_scatter_tensor: input has shape "
                                                             r"\(3,\) but this collective was prepared for shape \(4,\)"):
                scatter(np.zeros(3))
            with pytest.raises(meshkit.DistTypeError, match="dtype object but this collective was prepared for any "
                                                            "communicable dtype"):
                scatter(np.zeros(4, object))
            return "refused"
        for call in (gather, scatter, scatter):  # each matching call fails once rank 0's refusal arrives
            with pytest.raises(meshkit.DistError, match="rank 0"):
                call(np.zeros((2, 3), np.float32) if call is gather else np.zeros(4))
        return "told"

    assert local.run(body, 2, timeout=30) == ["refused", "told"]


def test_a_prepared_call_is_numbered_recorded_and_checked_in_detail_mode(monkeypatch):
    monkeypatch.setenv("MESHKIT_DEBUG", "detail")

    def body():
        g, rank = _world(), meshkit.get_rank()
        gather = prepare_collective(g, "all_gather_into_tensor", (2,), np.int64)
        gather(np.arange(2) + rank)
        last = meshkit.flight_record()[-1]
        assert (last["op"], last["state"], last["shapes"]) == ("all_gather_into_tensor", "completed", ((2,), (4,))), last
        if rank == 0:
            gather(np.arange(2))
        else:
            meshkit.all_reduce(np.zeros(2))
        return True

    with pytest.raises(meshkit.CollectiveMismatchError, match="collective mismatch on group world"):
        local.run(body, 2, timeout=30)


def test_an_uninvolved_rank_or_a_destroyed_group_is_refused():
    def body():
        rank = meshkit.get_rank()
        sub = meshkit.new_group([0])
        if rank == 1:
            with pytest.raises(meshkit.DistValueError, match="not a member of group"):
                prepare_collective(sub, "all_reduce", (2,))
        g = _world()
        reduce_all = prepare_collective(g, "all_reduce", (2,), np.float64)
        assert np.array_equal(reduce_all(np.ones(2)), np.full(2, 2.0))
        meshkit.barrier()
        return reduce_all

    prepared = local.run(body, 2, timeout=30)
    with pytest.raises(meshkit.DistError, match="destroyed"):
        prepared[0](np.ones(2))


def test_an_owned_all_reduce_is_the_public_one_without_its_checks(monkeypatch):
    """all_reduce_owned (the compiled DTensor rules' in-place all-reduce of an array they made):
    the public method's results for every op (AVG exact, integers as MPI's), numbered and recorded
    as "all_reduce", checked across ranks in detail mode; what it was not made for (a list, a pair
    of op and dtype not yet checked, a name for an op) goes to the public method and its errors."""
    monkeypatch.setenv("MESHKIT_DEBUG", "detail")

    def body():
        g, rank = _world(), meshkit.get_rank()
        out = {}
        for op in (meshkit.ReduceOp.SUM, meshkit.ReduceOp.PRODUCT, meshkit.ReduceOp.MAX, meshkit.ReduceOp.AVG):
            mine, public = np.array([rank + 1.0, -2.0 * rank, 7.0]), np.array([rank + 1.0, -2.0 * rank, 7.0])
            all_reduce_owned(g, mine, op)
            g.all_reduce(public, op)
            out[op.name] = np.array_equal(mine, public)
        ints = np.array([2**62 + rank], dtype=np.int64)
        all_reduce_owned(g, ints, meshkit.ReduceOp.SUM)  # wraps as MPI's (and NumPy's) int64
        n, total = g.size, sum(2**62 + r for r in range(g.size))
        out["int64 wraps"] = n > 1 and int(ints[0]) == (total + 2**63) % 2**64 - 2**63
        last = meshkit.flight_record()[-1]
        out["recorded"] = (last["op"], last["state"], last["shapes"]) == ("all_reduce", "completed", ((1,),))
        with pytest.raises(meshkit.DistTypeError, match=r"rank \d: all_reduce: tensor must be a numpy.ndarray"):
            all_reduce_owned(g, [1.0])
        with pytest.raises(meshkit.DistTypeError, match="AVG is not defined for dtype int16"):
            all_reduce_owned(g, np.ones(2, np.int16), meshkit.ReduceOp.AVG)
        x = np.array([rank + 1.0, 3.0])
        all_reduce_owned(g, x, meshkit.ReduceOp.PRODUCT)
        out["product"] = x.tolist()
        return out

    want = {"SUM": True, "PRODUCT": True, "MAX": True, "AVG": True, "int64 wraps": True, "recorded": True}
    assert local.run(body, 3, timeout=30) == [{**want, "product": [6.0, 27.0]}] * 3

    def mismatched():
        # another shape on one rank: detail mode names the mismatch on both
        all_reduce_owned(_world(), np.zeros(3 if meshkit.get_rank() == 0 else 2))

    with pytest.raises(meshkit.CollectiveMismatchError, match="collective mismatch on group world"):
        local.run(mismatched, 2, timeout=30)


def test_an_owned_all_reduce_whose_engine_call_fails_fails_as_the_public_one():
    """The engine refusing the call (here: a RuntimeError from the engine's all_reduce) surfaces from
    all_reduce_owned exactly as from the public method: the same error type and text, the call
    numbered one after the other and left in the flight recorder."""
    def body():
        g = _world()
        engine = g.engine

        def refuses(buf, op):
            raise RuntimeError("the engine refused")

        engine.all_reduce = refuses
        seen = []
        for call in (lambda x: g.all_reduce(x), lambda x: all_reduce_owned(g, x, meshkit.ReduceOp.SUM)):
            try:
                call(np.ones(2))
            except Exception as exc:  # the public method's error is the one to match
                seen.append((type(exc).__name__, str(exc)))
        del engine.all_reduce
        records = [r for r in meshkit.flight_record() if r["op"] == "all_reduce"][-2:]
        return seen, [r["seq"] for r in records]

    for seen, seqs in local.run(body, 2, timeout=30):
        assert len(seen) == 2 and seen[0][0] == seen[1][0], seen
        assert all(text == "the engine refused" for _, text in seen), seen
        assert seqs[1] == seqs[0] + 1, seqs
