"""SGD, AdamW and clip_grad_norm_ against independent float64 restatements of torch's rules."""

from __future__ import annotations

import math

import numpy as np
import pytest

import meshkit
from meshkit.comm import local
from meshkit.parallel import SGD, AdamW, Optimizer, array_namespace, clip_grad_norm_

STEPS = 6
SHAPES = {"w": (4, 5), "b": (7,), "s": ()}


# --- independent references: torch's documented rules, float64, one plain loop over steps --------

def ref_sgd(p0, grads, *, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False):
    """torch.optim.SGD's algorithm box, restated."""
    p = np.asarray(p0, dtype=np.float64).copy()
    buf = None
    for grad in grads:
        g = np.asarray(grad, dtype=np.float64)
        if maximize:
            g = -g
        if weight_decay != 0:
            g = g + weight_decay * p
        if momentum != 0:
            buf = g.copy() if buf is None else momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        p = p - lr * g
    return p


def ref_adamw(p0, grads, *, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, amsgrad=False, maximize=False):
    """torch.optim.AdamW's algorithm box, restated (eps after the bias-corrected sqrt)."""
    b1, b2 = betas
    p = np.asarray(p0, dtype=np.float64).copy()
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    vmax = np.zeros_like(p)
    for t, grad in enumerate(grads, start=1):
        g = np.asarray(grad, dtype=np.float64)
        if maximize:
            g = -g
        p = p * (1 - lr * weight_decay)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        if amsgrad:
            vmax = np.maximum(vmax, v)
        second = vmax if amsgrad else v
        denom = np.sqrt(second) / math.sqrt(1 - b2 ** t) + eps
        p = p - (lr / (1 - b1 ** t)) * m / denom
    return p


def make_problem(dtype, seed=0):
    """Parameters of several shapes and STEPS changing gradients for each."""
    rng = np.random.default_rng(seed)
    params = {k: rng.uniform(-2, 2, size=s).astype(dtype) for k, s in SHAPES.items()}
    grads = [{k: rng.standard_normal(size=s).astype(dtype) * (t + 1) for k, s in SHAPES.items()}
             for t in range(STEPS)]
    return params, grads


def run(opt, params, grads):
    params = {k: v.copy() for k, v in params.items()}
    for g in grads:
        opt.step(params, g)
    return params


SGD_CASES = {
    "plain": dict(lr=0.1),
    "momentum": dict(lr=0.05, momentum=0.9),
    "nesterov": dict(lr=0.05, momentum=0.9, nesterov=True),
    "dampening": dict(lr=0.05, momentum=0.8, dampening=0.3),
    "weight_decay": dict(lr=0.05, momentum=0.9, weight_decay=0.1),
    "nesterov_decay_maximize": dict(lr=0.05, momentum=0.5, nesterov=True, weight_decay=0.2, maximize=True),
    "maximize": dict(lr=0.1, maximize=True),
}
ADAMW_CASES = {
    "default": dict(lr=1e-2),
    "no_decay": dict(lr=1e-2, weight_decay=0.0),
    "decay": dict(lr=3e-2, weight_decay=0.5, betas=(0.8, 0.99)),
    "amsgrad": dict(lr=1e-2, amsgrad=True, weight_decay=0.1),
    "maximize": dict(lr=1e-2, maximize=True, eps=1e-3),
    "small_beta1": dict(lr=1e-2, betas=(0.3, 0.9)),  # lerp weight 0.7 >= 0.5: torch's second branch
}
TOL = {np.float64: dict(rtol=1e-12, atol=1e-12), np.float32: dict(rtol=1e-6, atol=1e-7)}


def _cases():
    for name, kw in SGD_CASES.items():
        yield pytest.param(SGD, ref_sgd, kw, id=f"SGD-{name}")
    for name, kw in ADAMW_CASES.items():
        yield pytest.param(AdamW, ref_adamw, kw, id=f"AdamW-{name}")


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("cls, ref, kw", list(_cases()))
def test_matches_reference(cls, ref, kw, dtype):
    params, grads = make_problem(dtype)
    opt = cls(**kw)
    out = run(opt, params, grads)
    for name in SHAPES:
        expected = ref(params[name], [g[name] for g in grads], **kw)
        assert out[name].dtype == dtype and out[name].shape == SHAPES[name]
        np.testing.assert_allclose(out[name], expected, **TOL[dtype], err_msg=name)
        for arr in opt.state[name].values():
            assert arr.dtype == dtype and arr.shape == (int(np.prod(SHAPES[name])),)
        assert opt.steps[name] == STEPS


def test_state_keys_and_dtype():
    params, grads = make_problem(np.float32)
    sgd = SGD(lr=0.1)
    run(sgd, params, grads)
    assert all(st == {} for st in sgd.state.values())
    sgd = SGD(lr=0.1, momentum=0.9)
    run(sgd, params, grads)
    assert all(set(st) == {"momentum_buffer"} for st in sgd.state.values())
    adam = AdamW(amsgrad=True)
    run(adam, params, grads)
    assert all(set(st) == {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"} for st in adam.state.values())
    assert all(a.dtype == np.float32 for st in adam.state.values() for a in st.values())
    assert adam.state_nbytes() == 3 * 4 * (20 + 7 + 1) and SGD(lr=0.1).state_nbytes() == 0


def test_adamw_first_step_by_hand():
    # Step 1: m = (1-b1) g, v = (1-b2) g^2, so m / (1-b1) = g and sqrt(v / (1-b2)) = |g|: the
    # update is lr * g / (|g| + eps) = lr * sign(g) up to eps/|g| (1e-8 here). Decay comes first:
    # p1 = p0 * (1 - lr * wd) - lr * sign(g).
    lr, wd = 0.1, 0.5
    p = np.array([1.0, -2.0, 3.0])
    AdamW(lr=lr, weight_decay=wd).step({"p": p}, {"p": np.array([2.0, -0.5, 4.0])})
    np.testing.assert_allclose(p, [0.95 - 0.1, -1.9 + 0.1, 2.85 - 0.1], rtol=0, atol=1e-8)


def test_sgd_momentum_by_hand():
    # g = 1 every step, momentum 0.5: buffers 1, 1.5, 1.75 -> p = 0 - 0.1 * (1 + 1.5 + 1.75).
    p = np.zeros(2)
    opt = SGD(lr=0.1, momentum=0.5)
    for _ in range(3):
        opt.step({"p": p}, {"p": np.ones(2)})
    np.testing.assert_allclose(p, [-0.425, -0.425], rtol=1e-15)


def test_grad_none_is_skipped():
    params, grads = make_problem(np.float64)
    opt = AdamW(lr=1e-2)
    p = {k: v.copy() for k, v in params.items()}
    opt.step(p, {**grads[0], "b": None})
    assert np.array_equal(p["b"], params["b"]) and "b" not in opt.state and "b" not in opt.steps
    assert opt.steps == {"w": 1, "s": 1}
    opt.update("b", p["b"], None)
    assert "b" not in opt.steps


# --- sharding: the whole parameter and its flat shards step identically ------------------------

@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("cls, kw", [(SGD, SGD_CASES["nesterov_decay_maximize"]), (SGD, SGD_CASES["dampening"]),
                                     (AdamW, ADAMW_CASES["amsgrad"]), (AdamW, ADAMW_CASES["maximize"]),
                                     (AdamW, ADAMW_CASES["small_beta1"])], ids=lambda x: getattr(x, "__name__", ""))
def test_shards_equal_whole_bitwise(cls, kw, dtype):
    rng = np.random.default_rng(1)
    whole = rng.uniform(-1, 1, size=(6, 7)).astype(dtype)
    flat = whole.reshape(-1).copy()
    cuts = [(0, 5), (5, 22), (22, 42)]  # three uneven pieces
    whole_opt, shard_opt, prim_opt = cls(**kw), cls(**kw), cls(**kw)
    prim = flat.copy()
    for _ in range(STEPS):
        g = rng.standard_normal(size=(6, 7)).astype(dtype)
        whole_opt.step({"w": whole}, {"w": g})
        gf = g.reshape(-1)
        shard_opt.step({f"w{i}": flat[a:b] for i, (a, b) in enumerate(cuts)},
                       {f"w{i}": gf[a:b] for i, (a, b) in enumerate(cuts)})
        prim_opt.update("flat", prim, gf)
    assert np.array_equal(whole.reshape(-1), flat)
    assert np.array_equal(prim, flat)
    assert shard_opt.steps == {"w0": STEPS, "w1": STEPS, "w2": STEPS}
    for key, arr in whole_opt.state["w"].items():
        joined = np.concatenate([shard_opt.state[f"w{i}"][key] for i in range(3)])
        assert np.array_equal(arr, joined) and np.array_equal(arr, prim_opt.state["flat"][key])


def test_non_contiguous_parameter_is_written_back():
    rng = np.random.default_rng(2)
    base = rng.standard_normal((4, 10))
    view = base[:, ::2]
    dense = view.copy()
    opt_a, opt_b = AdamW(lr=0.1), AdamW(lr=0.1)
    for _ in range(3):
        g = rng.standard_normal((4, 5))
        opt_a.step({"v": view}, {"v": g})
        opt_b.step({"v": dense}, {"v": g})
    assert np.array_equal(view, dense) and np.array_equal(base[:, ::2], dense)


# --- state dicts ---------------------------------------------------------------------------

@pytest.mark.parametrize("cls, kw", [(SGD, SGD_CASES["nesterov"]), (AdamW, ADAMW_CASES["amsgrad"])],
                         ids=["SGD", "AdamW"])
def test_state_dict_round_trip_bitwise(cls, kw):
    params, grads = make_problem(np.float32)
    full = run(cls(**kw), params, grads)
    first = cls(**kw)
    half = run(first, params, grads[:3])
    sd = first.state_dict()
    resumed = cls(lr=123.0)  # hyperparameters come back from the state dict, as in torch
    resumed.load_state_dict(sd)
    assert resumed.hyper == first.hyper
    for arrays in sd["state"].values():  # load copied: the caller's arrays are not the state
        for arr in arrays.values():
            arr[...] = np.nan
    for g in grads[3:]:
        resumed.step(half, g)
    for name in SHAPES:
        assert np.array_equal(half[name], full[name]), name


def test_state_dict_is_a_copy():
    params, grads = make_problem(np.float64)
    opt = AdamW()
    p = run(opt, params, grads[:2])
    sd = opt.state_dict()
    before = sd["state"]["w"]["exp_avg"].copy()
    opt.step(p, grads[2])
    assert np.array_equal(sd["state"]["w"]["exp_avg"], before)
    assert sd["step"] == {"w": 2, "b": 2, "s": 2}
    assert sd["hyper"] == {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
                           "amsgrad": False, "maximize": False}


def test_loaded_state_follows_parameter_dtype():
    params, grads = make_problem(np.float64)
    opt = SGD(lr=0.1, momentum=0.9)
    run(opt, params, grads[:1])
    fresh = SGD(lr=0.1, momentum=0.9)
    fresh.load_state_dict(opt.state_dict())
    p32 = {k: v.astype(np.float32) for k, v in params.items()}
    fresh.step(p32, {k: v.astype(np.float32) for k, v in grads[1].items()})
    assert all(st["momentum_buffer"].dtype == np.float32 for st in fresh.state.values())


# --- clip_grad_norm_ ------------------------------------------------------------------------

def _grads(dtype=np.float64, seed=3):
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal((3, 4)).astype(dtype), "b": rng.standard_normal(5).astype(dtype),
            "c": None, "d": rng.standard_normal(()).astype(dtype)}


def _concat(grads):
    return np.concatenate([np.asarray(g, dtype=np.float64).reshape(-1) for g in grads.values() if g is not None])


@pytest.mark.parametrize("norm_type", [2.0, math.inf, "inf", 3.0, 1.0])
def test_clip_norm_matches_numpy(norm_type):
    grads = _grads()
    ord_ = math.inf if norm_type == "inf" else norm_type
    expected = np.linalg.norm(_concat(grads), ord=ord_)
    before = {k: None if g is None else g.copy() for k, g in grads.items()}
    total = clip_grad_norm_(grads, 1e9, norm_type=norm_type)
    assert isinstance(total, float) and total == pytest.approx(expected, rel=1e-12)
    for k, g in grads.items():  # max_norm far above the norm: gradients untouched, bitwise
        assert g is None or np.array_equal(g, before[k])
    as_list = list(before.values())
    assert clip_grad_norm_(as_list, 1e9, norm_type=norm_type) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
def test_clip_scales_when_norm_exceeds(dtype):
    grads = _grads(dtype)
    full = _concat(grads)
    expected_norm = np.linalg.norm(full)
    total = clip_grad_norm_(grads, 0.5)
    assert total == pytest.approx(expected_norm, rel=1e-6 if dtype == np.float32 else 1e-12)
    coef = 0.5 / (expected_norm + 1e-6)  # torch's coefficient
    np.testing.assert_allclose(_concat(grads), full * coef, **TOL[dtype])
    assert all(g is None or g.dtype == dtype for g in grads.values())
    assert np.linalg.norm(_concat(grads)) == pytest.approx(0.5, rel=1e-5)


def test_clip_single_array_and_empty():
    g = np.array([3.0, 4.0])
    assert clip_grad_norm_(g, 1.0) == 5.0
    np.testing.assert_allclose(g, [3 / (5 + 1e-6), 4 / (5 + 1e-6)], rtol=1e-15)
    assert clip_grad_norm_([], 1.0) == 0.0 and clip_grad_norm_({"x": None}, 1.0) == 0.0


def test_clip_nonfinite():
    grads = [np.array([1.0, np.nan]), np.array([2.0])]
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_: the total norm of order 2.0 .* is nan, not finite"):
        clip_grad_norm_(grads, 1.0, error_if_nonfinite=True)
    assert np.array_equal(grads[1], [2.0])  # raised before scaling
    assert math.isnan(clip_grad_norm_(grads, 1.0))
    assert np.isnan(grads[1]).all()  # as torch: the nan coefficient is applied


def _clip_on_rank(full, n, max_norm, norm_type):
    rank = meshkit.get_rank()
    group = meshkit.new_group()
    shard = np.array_split(full, n)[rank].copy()
    total = clip_grad_norm_({"flat": shard}, max_norm, norm_type=norm_type, group=group)
    return total, shard


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 3.0])
def test_clip_sharded_equals_single_process(world_size, norm_type):
    full = np.random.default_rng(4).standard_normal(23) * 3
    reference = full.copy()
    expected = clip_grad_norm_([reference], 2.0, norm_type=norm_type)
    assert expected > 2.0
    results = local.run(_clip_on_rank, world_size, full, world_size, 2.0, norm_type, timeout=30)
    for total, _ in results:
        assert total == pytest.approx(expected, rel=1e-12)
    np.testing.assert_allclose(np.concatenate([shard for _, shard in results]), reference, rtol=1e-12)


def test_clip_sharded_with_empty_rank_and_nan():
    # 5 ranks, 3 elements: ranks 3 and 4 hold nothing and must still join the all-reduce.
    results = local.run(_clip_on_rank, 5, np.array([3.0, 4.0, 12.0]), 5, 1e9, 2.0, timeout=30)
    assert [r[0] for r in results] == [pytest.approx(13.0, rel=1e-15)] * 5
    # a nan on one rank reaches every rank, also for inf-norms (reduced with MAX)
    for norm_type in (2.0, math.inf):
        results = local.run(_clip_on_rank, 3, np.array([1.0, np.nan, 2.0]), 3, 1.0, norm_type, timeout=30)
        assert all(math.isnan(total) for total, _ in results)


# --- misc API ---------------------------------------------------------------------------------

def test_array_namespace_and_exports():
    import meshkit.parallel as parallel
    import meshkit.parallel.arrays as arrays
    import meshkit.parallel.optim.clip as clip
    import meshkit.parallel.optim.optimizers as optim

    assert array_namespace(np.zeros(2)) is np and array_namespace(3.0) is np
    assert optim.__all__ == ["SGD", "AdamW", "Optimizer"]  # optim/optimizers.py holds the optimizers only
    assert clip.__all__ == ["clip_grad_norm_", "clip_grad_norm_parts"] and "array_namespace" in arrays.__all__
    assert {"SGD", "AdamW", "Optimizer", "clip_grad_norm_", "array_namespace"} <= set(parallel.__all__)
    assert isinstance(SGD(lr=0.1), Optimizer) and isinstance(AdamW(), Optimizer)
    assert repr(SGD(lr=0.1)) == ("SGD(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, "
                                 "maximize=False)")


# --- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("make, exc, match", [
    (lambda: SGD(lr=-1.0), ValueError, r"SGD: lr=-1\.0 must be >= 0"),
    (lambda: SGD(lr=float("nan")), ValueError, r"SGD: lr=nan must be >= 0"),
    (lambda: SGD(lr=0.1, momentum=-0.5), ValueError, r"SGD: momentum=-0\.5 must be >= 0"),
    (lambda: SGD(lr=0.1, weight_decay=-1), ValueError, r"SGD: weight_decay=-1\.0 must be >= 0"),
    (lambda: SGD(lr=0.1, nesterov=True), ValueError,
     r"nesterov=True requires momentum > 0 and dampening == 0, got momentum=0\.0, dampening=0\.0"),
    (lambda: SGD(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), ValueError, r"dampening=0\.1"),
    (lambda: SGD(lr="0.1"), TypeError, r"SGD: lr must be a real number, got str '0\.1'"),
    (lambda: SGD(lr=0.1, nesterov=1), TypeError, r"SGD: nesterov must be a bool, got int 1"),
    (lambda: AdamW(lr=-1.0), ValueError, r"AdamW: lr=-1\.0 must be >= 0"),
    (lambda: AdamW(betas=(1.0, 0.999)), ValueError, r"AdamW: betas\[0\]=1\.0 must be in \[0, 1\)"),
    (lambda: AdamW(betas=(0.9, -0.1)), ValueError, r"AdamW: betas\[1\]=-0\.1 must be in \[0, 1\)"),
    (lambda: AdamW(betas=0.9), ValueError, r"AdamW: betas=0\.9 must be a pair"),
    (lambda: AdamW(eps=-1e-8), ValueError, r"AdamW: eps=-1e-08 must be >= 0"),
    (lambda: AdamW(weight_decay=-0.01), ValueError, r"AdamW: weight_decay=-0\.01 must be >= 0"),
    (lambda: AdamW(amsgrad="yes"), TypeError, r"AdamW: amsgrad must be a bool"),
], ids=lambda x: "" if callable(x) else None)
def test_bad_hyperparameters(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_bad_step_inputs_change_nothing():
    params, grads = make_problem(np.float64)
    snapshot = {k: v.copy() for k, v in params.items()}
    opt = AdamW()
    cases = [
        ({**grads[0], "b": np.zeros(8)}, ValueError,
         r"AdamW\.step: grad of parameter 'b' has shape \(8,\), the parameter has shape \(7,\)"),
        ({**grads[0], "b": grads[0]["b"].astype(np.float32)}, TypeError,
         r"AdamW\.step: grad of parameter 'b' has dtype float32, the parameter has float64"),
        ({"w": grads[0]["w"], "b": grads[0]["b"]}, ValueError, r"missing \['s'\], unexpected \[\]"),
        ({**grads[0], "x": np.zeros(1)}, ValueError, r"missing \[\], unexpected \['x'\]"),
        ({**grads[0], "b": [0.0] * 7}, TypeError, r"grad of parameter 'b' must be an array or None, got list"),
    ]
    for bad, exc, match in cases:
        with pytest.raises(exc, match=match):
            opt.step(params, bad)
    for k in params:  # 'w' comes before 'b': checks run before any update
        assert np.array_equal(params[k], snapshot[k])
    assert opt.state == {} and opt.steps == {}
    with pytest.raises(TypeError, match=r"AdamW\.step: parameter 'i' has dtype int64; only floating-point"):
        opt.step({"i": np.zeros(3, dtype=np.int64)}, {"i": np.zeros(3, dtype=np.int64)})
    with pytest.raises(TypeError, match=r"parameter 'f' must be a NumPy or CuPy array, got float"):
        opt.step({"f": 1.0}, {"f": 1.0})
    with pytest.raises(TypeError, match=r"params and grads must be dicts of arrays, got list and dict"):
        opt.step([params["w"]], grads[0])


def test_bad_update_inputs():
    opt = SGD(lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"SGD\.update: parameter 'x' must be a 1-D flat array, got shape \(2, 2\)"):
        opt.update("x", np.zeros((2, 2)), np.zeros((2, 2)))
    with pytest.raises(ValueError, match=r"SGD\.update: grad of parameter 'x' has shape \(3,\)"):
        opt.update("x", np.zeros(4), np.zeros(3))
    opt.update("x", np.zeros(4), np.ones(4))
    with pytest.raises(ValueError, match=r"SGD\.update: state for 'x' has 4 elements but the parameter has 5"):
        opt.update("x", np.zeros(5), np.ones(5))
    with pytest.raises(ValueError, match=r"SGD\.step: state for 'x' has 4 elements but the parameter has 6"):
        opt.step({"x": np.zeros((2, 3))}, {"x": np.ones((2, 3))})


def test_bad_state_dicts():
    params, grads = make_problem(np.float64)
    opt = AdamW()
    run(opt, params, grads[:1])
    good = opt.state_dict()

    def broken(**changes):
        sd = opt.state_dict()
        for path, value in changes.items():
            *outer, last = path.split("__")
            target = sd
            for key in outer:
                target = target[key]
            target[last] = value
        return sd

    cases = [
        ([1, 2], TypeError,
         r"AdamW\.load_state_dict: expected a dict with keys \['hyper', 'state', 'step'\], got list"),
        (SGD(lr=0.1).state_dict(), ValueError, r"hyper must have the keys \['amsgrad', 'betas', 'eps', 'lr', "),
        (broken(hyper__lr=-2.0), ValueError, r"AdamW: lr=-2\.0 must be >= 0"),
        (broken(hyper__amsgrad=True), ValueError,
         r"state\['w'\] must have the keys \['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq'\], got \['exp_avg', "),
        (broken(step__w=-1), ValueError, r"step\['w'\]=-1 must be an int >= 0"),
        (broken(state__b__exp_avg=np.zeros(3)), ValueError,
         r"state\['b'\] arrays have sizes \[3, 7\], expected one size"),
        (broken(state__b__exp_avg=np.zeros((7, 1))), ValueError, r"state\['b'\]\['exp_avg'\] must be a 1-D array"),
        ({**good, "step": {"w": 1}}, ValueError, r"step has names \['w'\] but state has \['b', 's', 'w'\]"),
        ({**good, "step": {"q": 1}, "state": {"q": good["state"]["w"]}}, ValueError,
         r"state has names \['q'\], this optimizer holds \['b', 's', 'w'\]"),
    ]
    for sd, exc, match in cases:
        with pytest.raises(exc, match=match):
            opt.load_state_dict(sd)
    assert opt.hyper == good["hyper"] and opt.steps == good["step"]  # failed loads changed nothing
    fresh = AdamW()  # a fresh optimizer takes the sizes from the state dict
    big = {**good, "state": {**good["state"], "w": {k: np.zeros(30) for k in good["state"]["w"]}}}
    fresh.load_state_dict(big)
    with pytest.raises(ValueError, match=r"AdamW\.step: state for 'w' has 30 elements but the parameter has 20"):
        fresh.step(params, grads[1])


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(max_norm=-1.0), ValueError, r"clip_grad_norm_: max_norm=-1\.0 must be >= 0"),
    (dict(max_norm=1.0, norm_type=0), ValueError, r"clip_grad_norm_: norm_type=0\.0 must be > 0 \(or inf\)"),
    (dict(max_norm=1.0, norm_type="fro"), TypeError, r"clip_grad_norm_: norm_type must be a real number"),
    (dict(max_norm="1"), TypeError, r"clip_grad_norm_: max_norm must be a real number, got str"),
])
def test_clip_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        clip_grad_norm_([np.ones(3)], **kwargs)


def test_clip_bad_grads():
    with pytest.raises(TypeError,
                       match=r"clip_grad_norm_: grads\['k'\] must be a floating-point array, got dtype int64"):
        clip_grad_norm_({"k": np.ones(3, dtype=np.int64)}, 1.0)
    with pytest.raises(TypeError, match=r"clip_grad_norm_: grads\[1\] must be a floating-point array, got list"):
        clip_grad_norm_([np.ones(3), [1.0]], 1.0)
    with pytest.raises(TypeError, match=r"grads must be a dict, a list or an array, got int"):
        clip_grad_norm_(3, 1.0)
