"""The compiled calls of the reductions (tensor/reduction_plan.py's ``compiled``): a second call of
the same request runs a closure compiled by the first. Each must give the general path's result
bit for bit, a request must never hit another's closure (a wrong hit is a silent wrong result),
and the closures kept are bounded by ``MESHKIT_DTENSOR_PLANS``. Also DTensor's operators, which
skip the ufunc protocol where both layouts agree."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import meshkit
from meshkit.comm import local
from meshkit.tensor import Partial, Replicate, Shard
from meshkit.tensor import reduction_plan as plans
from tensor_cases import distribute_tensor

S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial("sum")
X = np.random.default_rng(43).standard_normal((5, 7))  # 5 rows: uneven over 2 and 3 ranks


class _Hits(dict):
    """``_compiled`` counting the lookups that found an entry."""

    hits = 0

    def get(self, key, default=None):
        found = super().get(key, default)
        if found is not None:
            type(self).hits += 1
        return found


def _requests():
    """``(name, call(d), NumPy's answer(x))``: every compiled rule with each argument that changes it."""
    out = []
    for axis in (None, 0, 1):
        for keep in (False, True):
            out += [(f"var {axis} {keep}", lambda d, a=axis, k=keep: np.var(d, axis=a, keepdims=k),
                     lambda x, a=axis, k=keep: np.var(x, axis=a, keepdims=k)),
                    (f"std ddof=1 {axis} {keep}", lambda d, a=axis, k=keep: np.std(d, axis=a, ddof=1, keepdims=k),
                     lambda x, a=axis, k=keep: np.std(x, axis=a, ddof=1, keepdims=k)),
                    (f"prod {axis} {keep}", lambda d, a=axis, k=keep: np.prod(d, axis=a, keepdims=k),
                     lambda x, a=axis, k=keep: np.prod(x, axis=a, keepdims=k)),
                    (f"argmax {axis} {keep}", lambda d, a=axis, k=keep: np.argmax(d, axis=a, keepdims=k),
                     lambda x, a=axis, k=keep: np.argmax(x, axis=a, keepdims=k)),
                    (f"argmin {axis} {keep}", lambda d, a=axis, k=keep: np.argmin(d, axis=a, keepdims=k),
                     lambda x, a=axis, k=keep: np.argmin(x, axis=a, keepdims=k)),
                    (f"count_nonzero {axis} {keep}",
                     lambda d, a=axis, k=keep: np.count_nonzero(d > 0, axis=a, keepdims=k).full_tensor(),
                     lambda x, a=axis, k=keep: np.count_nonzero(x > 0, axis=a, keepdims=k)),
                    (f"any {axis} {keep}", lambda d, a=axis, k=keep: np.any(d > 1, axis=a, keepdims=k).full_tensor(),
                     lambda x, a=axis, k=keep: np.any(x > 1, axis=a, keepdims=k))]
        if axis is not None:
            out += [(f"cumsum {axis}", lambda d, a=axis: np.cumsum(d, axis=a), lambda x, a=axis: np.cumsum(x, axis=a)),
                    (f"cumprod {axis}", lambda d, a=axis: np.cumprod(d, axis=a),
                     lambda x, a=axis: np.cumprod(x, axis=a))]
    out += [("norm", np.linalg.norm, np.linalg.norm),
            ("norm keepdims", lambda d: np.linalg.norm(d, keepdims=True), lambda x: np.linalg.norm(x, keepdims=True))]
    return out


def _local_of(result):
    return result.to_local() if hasattr(result, "to_local") else result


@pytest.mark.parametrize("n", [2, 3])
def test_a_compiled_call_gives_the_general_paths_result_bit_for_bit(monkeypatch, n):
    """Every compiled rule, on [Shard(0)], [Shard(1)], [Replicate()] and [Partial(sum)] (which
    cumsum keeps; the others reduce it first) of uneven blocks, for
    float64, float32, int64 and bool: the first call takes the general path (and compiles), the
    second and third run the closure; all three agree bit for bit, in placements and shape too,
    and with NumPy."""
    monkeypatch.setattr(plans, "_compiled", _Hits())
    _Hits.hits = 0
    values = {"float64": X, "float32": X.astype(np.float32), "int64": np.round(X * 3).astype(np.int64),
              "bool": X > 0.2}

    def body(mesh):
        bad = []
        for dtype, x in values.items():
            for placements in ([S0], [S1], [R]) + (([P],) if dtype != "bool" else ()):  # no SUM of bools
                d = distribute_tensor(x, mesh, placements) if placements != [P] else \
                    distribute_tensor(x, mesh, [R]).redistribute(placements=[P])  # terms: cumsum keeps them
                for name, call, want in _requests():
                    try:
                        expected = want(x)
                    except TypeError:  # NumPy refuses (cumprod of bool is fine; nothing here should)
                        continue
                    runs = [call(d) for _ in range(3)]
                    blocks = [np.asarray(_local_of(r)) for r in runs]
                    layouts = {(r.placements, r.shape) for r in runs if hasattr(r, "placements")}
                    if len(layouts) > 1 or any(b.dtype != blocks[0].dtype or b.shape != blocks[0].shape or
                                               b.tobytes() != blocks[0].tobytes() for b in blocks):
                        bad.append(f"{dtype} {placements} {name}: the runs differ")
                    for run in runs:  # the second and third complete by the program the first found
                        full = run.full_tensor() if hasattr(run, "full_tensor") else run
                        if np.shape(full) != np.shape(expected) or \
                                not np.allclose(full, expected, rtol=1e-5 if dtype == "float32" else 1e-12):
                            bad.append(f"{dtype} {placements} {name}: {full!r} != NumPy's {expected!r}")
        return bad

    for bad in local.run(lambda: body(meshkit.init_device_mesh("cpu", (n,))), n):
        assert bad == []
    assert _Hits.hits > 100  # the closures ran (3 calls a request: the 2nd and 3rd hit)


def test_no_request_hits_another_requests_closure(monkeypatch):
    """A closure compiled for var(axis=0) of a (5, 7) float64 [Shard(0)] array is not run for any
    request that differs in one thing: the axis (1, and True, which equals 1 in a dict but is
    refused as NumPy refuses it), keepdims, ddof, the op (std), the dtype, the shape, the
    placements, the mesh. Each gets NumPy's answer; each adds its own entry."""
    monkeypatch.setattr(plans, "_compiled", {})

    def body(mesh):
        other = meshkit.init_device_mesh("cpu", (2,))  # the same ranks, another mesh object
        x32, x6 = X.astype(np.float32), np.vstack([X, X[:1]])
        big = 2**60 + np.arange(35, dtype=np.int64).reshape(5, 7)  # each column's largest in the last row
        d = distribute_tensor(X, mesh, [S0])
        cases = [("axis=0", lambda: np.var(d, axis=0), np.var(X, axis=0)),
                 ("axis=1", lambda: np.var(d, axis=1), np.var(X, axis=1)),
                 ("keepdims", lambda: np.var(d, axis=0, keepdims=True), np.var(X, axis=0, keepdims=True)),
                 ("ddof", lambda: np.var(d, axis=0, ddof=1), np.var(X, axis=0, ddof=1)),
                 ("std", lambda: np.std(d, axis=0), np.std(X, axis=0)),
                 ("float32", lambda: np.var(distribute_tensor(x32, mesh, [S0]), axis=0), np.var(x32, axis=0)),
                 ("shape", lambda: np.var(distribute_tensor(x6, mesh, [S0]), axis=0), np.var(x6, axis=0)),
                 ("S1", lambda: np.var(distribute_tensor(X, mesh, [S1]), axis=0), np.var(X, axis=0)),
                 ("mesh", lambda: np.var(distribute_tensor(X, other, [S0]), axis=0), np.var(X, axis=0)),
                 # a float64 closure packs values as float64: run on int64 beyond 2^53 it would tie them
                 ("argmax float64", lambda: np.argmax(d, axis=0), np.argmax(X, axis=0)),
                 ("argmax int64", lambda: np.argmax(distribute_tensor(big, mesh, [S0]), axis=0), np.argmax(big, axis=0))]
        out = {}
        for name, call, want in cases * 2:  # each compiled, then each run again beside the others
            got = call().full_tensor()
            mine = [key for key in list(plans._compiled) if key[1] in (id(mesh), id(other))]  # not the other rank's
            right = got.shape == want.shape and got.dtype == want.dtype and \
                np.allclose(got, want, rtol=1e-5 if want.dtype == np.float32 else 1e-12)
            out[name] = (right, len(mine))
        with pytest.raises(TypeError, match=r"axis must be an int or a tuple of ints, got True"):
            np.var(d, axis=True)  # == 1 and hash(True) == hash(1): never a hit on axis=1's closure
        out["np.int64 axis"] = np.allclose(np.var(d, axis=np.int64(1)).full_tensor(), np.var(X, axis=1), rtol=1e-12)
        return out

    for out in local.run(lambda: body(meshkit.init_device_mesh("cpu", (2,))), 2):
        assert out.pop("np.int64 axis")
        assert all(right for right, _ in out.values()), [k for k, (right, _) in out.items() if not right]
        assert out["argmax int64"][1] == len(out)  # one entry per request: none shared


def test_compiled_calls_are_bounded_and_belong_to_their_mesh(monkeypatch):
    """``MESHKIT_DTENSOR_PLANS`` bounds the compiled calls kept (the oldest dropped first, results
    unchanged); an entry is its mesh's only while the mesh lives (an id can be reused after)."""
    monkeypatch.setattr(plans, "_compiled", {})
    monkeypatch.setenv("MESHKIT_DTENSOR_PLANS", "2")

    def body(mesh):
        d = distribute_tensor(X, mesh, [S0])
        got, kept = [], []
        for _ in range(2):
            for call in (lambda: np.prod(d, axis=0), lambda: np.prod(d, axis=1), lambda: np.prod(d)):
                got.append(call().full_tensor())
                kept.append([key[-2] for key in plans._compiled])  # the axes kept, oldest first
        return got, kept

    # one rank: the table is the process's (the local engine's ranks are threads sharing it), so
    # the order of eviction is this rank's alone
    for got, kept in local.run(lambda: body(meshkit.init_device_mesh("cpu", (1,))), 1):
        for value, want in zip(got, [np.prod(X, axis=0), np.prod(X, axis=1), np.prod(X)] * 2):
            np.testing.assert_allclose(value, want, rtol=1e-12)
        assert kept[:3] == [[0], [0, 1], [1, None]]  # the third request dropped the first
        assert all(len(k) <= 2 for k in kept)

    class Mesh:  # any object a weak reference can point to stands for the mesh here
        pass

    mine, another = Mesh(), Mesh()
    key = ("np.prod", id(mine), (5, 7))
    monkeypatch.setenv("MESHKIT_DTENSOR_PLANS", "8")
    call = plans.keep_compiled(key, mine, lambda a: a)
    assert plans.compiled(key, mine) is call and plans.compiled(key, another) is None
    del mine
    gc.collect()
    assert plans.compiled(key, another) is None  # the mesh died: its entry answers no one


def test_the_operators_fast_path_keeps_numpys_results_and_the_partial_rules():
    """``d + e``, ``2 - d``, ``d / 2``, ``1 / d``, ``d > 0``, ``d <= e`` on the same layout give NumPy's
    blocks; a Partial operand, another layout or a NumPy array operand take the ufunc rules (a
    Partial(sum) plus a scalar adds it once, on coordinate 0)."""
    def body(mesh):
        d, e = distribute_tensor(X, mesh, [S0]), distribute_tensor(2 * X, mesh, [S0])
        got = {"add": d + e, "rsub": 2 - d, "div": d / 2, "rdiv": 1 / d, "gt": d > 0, "le": d <= e,
               "mul": 3 * d * e}
        out = {k: v.full_tensor() for k, v in got.items()}
        out["placements"] = {v.placements for v in got.values()}
        p = distribute_tensor(X, mesh, [R]).redistribute(placements=[Partial("sum")])
        out["partial + 1"] = (p + 1).full_tensor()
        out["S0 + R"] = (d + distribute_tensor(X, mesh, [R])).full_tensor()
        return out

    want = {"add": 3 * X, "rsub": 2 - X, "div": X / 2, "rdiv": 1 / X, "gt": X > 0, "le": X <= 2 * X,
            "mul": 3 * X * (2 * X), "partial + 1": X + 1, "S0 + R": 2 * X}
    for out in local.run(lambda: body(meshkit.init_device_mesh("cpu", (3,))), 3):
        assert out.pop("placements") == {(S0,)}
        for name, value in want.items():
            np.testing.assert_allclose(out[name], value, rtol=1e-12, err_msg=name)


def test_a_compiled_counts_results_complete_by_the_program_found_once_and_stay_right(monkeypatch, caplog):
    """The compiled whole count (``np.count_nonzero(m).full_tensor()``: a training loop's accuracy)
    keeps, beside its closure, the program that completes its results, once one ``full_tensor()``
    found it: counts of new data each step, kept and completed late, match NumPy's; the program is
    looked up once per rank, not once per call; a count of arrays whose ``from_local(shape=)`` is
    unchecked still has it checked, on every rank (the kept program is not taken then); and under
    DEBUG logging the redistribution is still logged."""
    import threading

    from meshkit.tensor import DTensor
    from meshkit.tensor import dtensor as dtensor_module

    real = dtensor_module._programs
    lookups: dict[int, int] = {}

    class Counted:  # full_tensor's table, counting this thread's (this rank's) lookups
        def get(self, key, default=None):
            me = threading.get_ident()
            lookups[me] = lookups.get(me, 0) + 1
            return real.get(key, default)

    monkeypatch.setattr(dtensor_module, "_programs", Counted())
    monkeypatch.setattr(plans, "_compiled", {})
    steps = [np.random.default_rng(s).standard_normal((5, 7)) > 0.3 * s for s in range(5)]

    def body(mesh):
        counts, late = [], []
        for x in steps:
            m = distribute_tensor(x, mesh, [S0])
            c, kept = np.count_nonzero(m), np.count_nonzero(m)
            counts.append(int(c.full_tensor()))
            late.append(kept)
        first = lookups[threading.get_ident()]
        counts += [int(k.full_tensor()) for k in late]  # completed after newer counts: their own values
        after = lookups[threading.get_ident()]
        with caplog.at_level("DEBUG", logger="meshkit.tensor"):
            logged = int(np.count_nonzero(distribute_tensor(steps[0], mesh, [S0])).full_tensor())
        rank = meshkit.get_rank()
        block = steps[1][:3] if rank == 0 else steps[1][3:]  # 5 rows cut 3, 2
        # unchecked and differing: rank 0's claim is the steps' layout, whose program its count kept
        claimed = DTensor.from_local(block, mesh, [S0], shape=(5, 7) if rank == 0 else (4, 7))
        with pytest.raises(ValueError, match="built this DTensor .* on global layouts that differ"):
            np.count_nonzero(claimed).full_tensor()
        return counts, first, after, logged

    want = [int(np.count_nonzero(x)) for x in steps]
    for counts, first, after, logged in local.run(lambda: body(meshkit.init_device_mesh("cpu", (2,))), 2):
        assert counts == want + want
        assert logged == want[0]
        assert first <= 2 and after == first  # found by the first completion (or two), then kept
    assert any("redistribute on mesh dim 0" in r.getMessage() for r in caplog.records)
