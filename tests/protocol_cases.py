"""Per-rank cases of the manual gradient protocol and of state-dict loading (issue 12).

Each case runs on every rank (local engine or real processes, any world size >= 2) and asserts
that misuse ends in the right result or in an error raised on *every* rank, naming the rank,
the object and what to do. ``CROSS_RANK`` are the cases where ranks do different things.
"""

from __future__ import annotations

import contextlib
import re
import time

import numpy as np
import pytest

import meshkit
from meshkit.parallel import (SGD, AdamW, DistributedDataParallel, FullyShardedDataParallel,
                              ZeroRedundancyOptimizer, data_parallel)

RANKED = r"meshkit\.parallel: rank \d+: "  # every parallel error starts so


def params() -> dict[str, np.ndarray]:
    """Three float64 parameters; tiny caps below put each in a bucket of its own."""
    return {"a": np.zeros(2), "b": np.zeros(3), "c": np.zeros(4)}


CAPS = {"bucket_cap_mb": 1e-6, "first_bucket_cap_mb": 1e-6}


def grad(name: str, rank: int) -> np.ndarray:
    """Rank r's gradient of ``name``: r + 1 everywhere, so the average over n ranks is (n + 1) / 2."""
    return np.full(params()[name].shape, rank + 1.0)


def make(kind: str, p=None, **kw):
    p = params() if p is None else p
    if kind == "ddp":
        return DistributedDataParallel(p, **CAPS, **kw)
    if kind == "ddp-copies":
        return DistributedDataParallel(p, gradient_as_bucket_view=False, **CAPS, **kw)
    return ZeroRedundancyOptimizer(p, SGD(lr=1.0), stage=int(kind[-1]), **CAPS, **kw)


KINDS = ["ddp", "ddp-copies", "zero1", "zero2"]


def expected(n: int) -> float:
    return (n + 1) / 2


def grads_of(model) -> dict[str, np.ndarray]:
    """Averaged gradients: DDP's ``grads``; ZeRO's from a step of SGD(lr=1) on zero parameters."""
    if isinstance(model, DistributedDataParallel):
        return {k: v.copy() for k, v in model.grads.items()}
    before = {k: v.copy() for k, v in model.params.items()}
    model.step()
    return {k: before[k] - v for k, v in model.params.items()}


def raises_everywhere(match: str, exc=ValueError):
    """``pytest.raises`` that also checks the message names this rank first."""
    return pytest.raises(exc, match=f"^{RANKED}(?s:.*){match}")


# ---------------------------------------------------------------------------- 1: reading early

def read_before_finish_changes_nothing(kind: str, steps: int = 3) -> None:
    """Issue 23.4: every gradient marked, no finish: reading the gradients (DDP's grads, ZeRO's
    grad_shards()) raises, naming the calls that finish the sync, and changes nothing, so the
    explicit finish that follows averages them. (step() and clip_grad_norm_() are collective
    and finish a complete pass themselves: the protocol of issue 25.1.) Objects kept across
    steps, as in a training loop; the last rank alone also reads (a read never communicates)."""
    rank, n = meshkit.get_rank(), meshkit.get_world_size()
    model = make(kind)
    unfinished = r"being reduced: every gradient is marked ready but the sync is not finished; step\(\) or " \
                 r"clip_grad_norm_\(\) finish it .*reading them does not finish it"
    for step in range(steps):
        model.zero_grad()
        for name in reversed(list(params())):
            model.mark_grad_ready(name, grad(name, rank))
        reads = [lambda: model.grads["c"], lambda: dict(model.grads)] if kind.startswith("ddp") else \
            [model.grad_shards, lambda: dict(model.grads)]
        for read in reads if step != 1 else reads[:1] if rank == n - 1 else []:
            with raises_everywhere(unfinished):
                read()
        model.finish_gradient_sync()
        assert model.iteration == step + 1
        for name, g in grads_of(model).items():
            np.testing.assert_array_equal(g, np.full(g.shape, expected(n)), err_msg=f"{kind} {name} step {step}")


def read_in_incomplete_pass_raises(kind: str) -> None:
    """Some gradients marked, others not, no finish: using the gradients raises, naming the gradient,
    the unmarked ones and finish_gradient_sync(); then finishing the pass gives the averages."""
    rank, n = meshkit.get_rank(), meshkit.get_world_size()
    model = make(kind)
    model.zero_grad()
    model.grads["c"][...] = grad("c", rank)  # writing before marking works
    model.mark_grad_ready("c")
    model.mark_grad_ready("b", grad("b", rank))
    if kind.startswith("ddp"):
        with raises_everywhere(r"grads: gradient 'c' is being reduced .*gradients \['a'\] are not marked ready; "
                               r"mark them and call finish_gradient_sync\(\)"):
            model.grads["c"]
        with raises_everywhere(r"grads: gradient 'b' was already marked ready and is being reduced; assign it "
                               r"before mark_grad_ready\(\)"):
            model.grads["b"] = np.zeros(3)
    else:
        with raises_everywhere(r"step: gradients are being reduced .*gradients \['a'\] are not marked ready"):
            model.step()
        with raises_everywhere(r"grad_shards: gradients are being reduced"):
            model.grad_shards()
    with raises_everywhere(r"zero_grad: gradients \['c', 'b'\] were marked ready in a pass that was not finished"):
        model.zero_grad()
    model.grads["a"][...] = grad("a", rank)  # unmarked: still writable
    model.mark_grad_ready("a")
    model.finish_gradient_sync()
    for name, g in grads_of(model).items():
        np.testing.assert_array_equal(g, np.full(g.shape, expected(n)), err_msg=f"{kind} {name}")


def zero_step_refuses_unsynchronized_gradients(stage: int) -> None:
    """ZeRO's step() uses only averaged gradients: not after no_sync() passes alone, not inside
    no_sync(), not after zero_grad() without a synchronized pass."""
    rank = meshkit.get_rank()
    zero = make(f"zero{stage}")
    with raises_everywhere(r"step: no synchronized gradient pass since zero_grad\(\) \(or construction\)"):
        zero.step()
    with zero.no_sync():
        for name in params():
            zero.mark_grad_ready(name, grad(name, rank))
        with raises_everywhere(r"step: gradients marked ready inside no_sync\(\) are local sums, not averages"):
            zero.step()
        zero.finish_gradient_sync()
    with raises_everywhere(r"step: gradients \['a', 'b', 'c'\] were accumulated under no_sync\(\) but never "
                           r"synchronized"):
        zero.step()
    zero.zero_grad()
    with raises_everywhere(r"step: no synchronized gradient pass since zero_grad\(\)"):
        zero.step()


def zero2_grads_of_a_launched_bucket_are_guarded() -> None:
    rank = meshkit.get_rank()
    zero = make("zero2")
    zero.mark_grad_ready("c", grad("c", rank))  # its own bucket: launched, reduced to its owner
    with raises_everywhere(r"grads: gradient 'c' is being reduced"):
        zero.grads["c"]
    zero.sync_gradients()


# ---------------------------------------------------------------------------- 2: the params dict

def owns_its_parameters(kind: str) -> None:
    """Deleting or reshaping an entry of the caller's dict after wrapping changes nothing that is
    reduced; the strategy's own params refuse changes with a clear error."""
    rank, n = meshkit.get_rank(), meshkit.get_world_size()
    p = params()
    model = make(kind, p)
    del p["a"]
    p["b"].shape = (3, 1)  # in place: the array is shared with the strategy's
    with raises_everywhere(r"mark_grad_ready: gradient 'b' has shape \(3, 1\) and dtype float64; expected the "
                           r"parameter's shape \(3,\)"):
        model.mark_grad_ready("b", np.ones((3, 1)))
    p["b"].shape = (3,)
    for name in ("c", "b", "a"):
        model.mark_grad_ready(name, grad(name, rank))
    model.finish_gradient_sync()
    for name, g in grads_of(model).items():
        np.testing.assert_array_equal(g, np.full(g.shape, expected(n)), err_msg=f"{kind} {name}")
    with raises_everywhere(r"params is read-only, so params\['a'\] cannot be replaced or removed: update the "
                           r"arrays in place", TypeError):
        model.params["a"] = np.ones(2)
    with raises_everywhere(r"params\['c'\] cannot be replaced or removed", TypeError):
        del model.params["c"]
    assert list(model.params) == ["a", "b", "c"]


# ---------------------------------------------------------------------------- 3: one rank fails

def one_rank_fails_the_sync(kind: str) -> None:
    """The last rank forgets a gradient: finish_gradient_sync() raises on every rank, naming that rank
    and the gradient, within seconds; the gradients cannot be used; after zero_grad() the next pass is
    correct (the ranks' collectives stayed aligned)."""
    rank, n = meshkit.get_rank(), meshkit.get_world_size()
    last = meshkit.get_world_size() - 1
    model = make(kind)
    model.zero_grad()
    for name in ("c", "b", "a"):
        if not (rank == last and name == "b"):
            model.mark_grad_ready(name, grad(name, rank))
    start = time.perf_counter()
    with raises_everywhere(rf"finish_gradient_sync: the gradient sync failed on rank\(s\) \[{last}\]: rank {last}: "
                           r"gradients \['b'\] were not marked ready in this backward pass.*discarded \(zeroed\) on "
                           r"every rank; run the backward pass again"):
        model.finish_gradient_sync()
    assert time.perf_counter() - start < 10
    if kind.startswith("ddp"):
        with raises_everywhere(rf"grads: the gradient sync failed on rank\(s\) \[{last}\].*call zero_grad\(\) and "
                               r"run the backward pass again"):
            model.grads["a"]
    else:
        with raises_everywhere(rf"step: the gradient sync failed on rank\(s\) \[{last}\]"):
            model.step()
    model.zero_grad()
    for name in ("c", "b", "a"):
        model.mark_grad_ready(name, grad(name, rank))
    model.finish_gradient_sync()
    for name, g in grads_of(model).items():
        np.testing.assert_array_equal(g, np.full(g.shape, expected(n)), err_msg=f"{kind} {name}")


def one_rank_catches_and_carries_on(kind: str) -> None:
    """The reported case: one rank catches the 'not marked ready' error and goes on without
    zero_grad(). Every rank raised, the failed pass's gradients were zeroed on every rank, so the
    next pass (again without zero_grad) averages only its own gradients."""
    rank, n = meshkit.get_rank(), meshkit.get_world_size()
    model = make(kind)
    for step in range(2):
        for name in ("c", "b", "a"):
            if not (step == 0 and rank == 0 and name == "a"):
                model.mark_grad_ready(name, grad(name, rank))
        with pytest.raises(ValueError, match=r"failed on rank\(s\) \[0\]") if step == 0 else contextlib.nullcontext():
            model.finish_gradient_sync()
    for name, g in grads_of(model).items():
        np.testing.assert_array_equal(g, np.full(g.shape, expected(n)), err_msg=f"{kind} {name}")


# ---------------------------------------------------------------------------- 4: state dicts

def fsdp(p=None, opt=None):
    mesh = meshkit.init_device_mesh("cpu", (meshkit.get_world_size(),))
    return FullyShardedDataParallel(params() if p is None else p, mesh=mesh, optimizer=opt or AdamW(lr=0.1),
                                    units=[["a", "b"], ["c"]])


def sharded(kind: str, opt=None):
    if kind == "fsdp":
        return fsdp(opt=opt)
    return ZeroRedundancyOptimizer(params(), opt or AdamW(lr=0.1), stage=int(kind[-1]), **CAPS)


def trained(kind: str):
    """A sharded strategy after one AdamW step with known gradients."""
    rank = meshkit.get_rank()
    model = sharded(kind)
    if kind == "fsdp":
        for u, names in enumerate([["a", "b"], ["c"]]):
            with model.unshard(u):
                pass
            model.reduce_grads(u, {name: grad(name, rank) for name in names})
    else:
        for name in params():
            model.mark_grad_ready(name, grad(name, rank))
        model.finish_gradient_sync()
    model.step()
    return model


def _copy(sd, *path):
    """A copy of ``sd`` whose dicts along ``path`` are new (the arrays are shared); the last one."""
    sd = dict(sd)
    target = sd
    for key in path:
        target[key] = dict(target[key])
        target = target[key]
    return sd, target


def _without(sd, *path):
    sd, target = _copy(sd, *path[:-1])
    del target[path[-1]]
    return sd


def _with(sd, value, *path):
    sd, target = _copy(sd, *path[:-1])
    target[path[-1]] = value
    return sd


def state_dict_loading_is_strict(kind: str) -> None:
    """Missing or extra optimizer state, unknown keys, bad hyperparameters, wrong sizes: an error on
    every rank naming the key, the rank, expected and got; nothing is loaded."""
    model = trained(kind)
    sd = model.full_state_dict()
    before = model.full_state_dict()
    who = r"load_full_state_dict: nothing was loaded; invalid state dict on ranks \[[\d, ]+\]: "
    cases = [
        (_without(sd, "optim"), r"the state dict: keys differ from \['model', 'optim'\]: missing "
                                    r"\['optim'\], unexpected \[\] \(strict=True\)"),
        (_without(sd, "optim", "state", "b"), r"state_dict\['optim'\]\['state'\] covers \['a', 'c'\] but not "
                                                  r"\['b'\] \(strict=True: all parameters or none\)"),
        (_without(sd, "optim", "step", "a"), r"state_dict\['optim'\]\['step'\] covers \['b', 'c'\] but not "
                                                  r"\['a'\]"),
        (_with(sd, -5.0, "optim", "hyper", "lr"), r"state_dict\['optim'\]\['hyper'\] is invalid: AdamW: "
                                                      r"lr=-5\.0 must be >= 0"),
        (_with(sd, "fast", "optim", "hyper", "lr"), r"hyper'\] is invalid: AdamW: lr must be a real number, got "
                                                        r"str 'fast'"),
        (_with(sd, 1, "optim", "hyper", "warmup"), r"state_dict\['optim'\]\['hyper'\]: keys differ from "
                                                       r"\['amsgrad', .*unexpected \['warmup'\] \(strict=True\): a state "
                                                       r"dict of another optimizer than AdamW\?"),
        (_with(sd, SGD(lr=0.1).hyper, "optim", "hyper"), r"hyper'\]: keys differ from .*missing \['amsgrad', "
                                                             r"'betas', 'eps'\], unexpected \['dampening', 'momentum', "
                                                             r"'nesterov'\]"),
        (_with(sd, {}, "unused"), r"the state dict: keys differ .*unexpected \['unused'\]"),
        (_with(sd, np.zeros(5), "model", "b"), r"state_dict\['model'\]\['b'\] has shape \(5,\), expected the "
                                                r"model's \(3,\)"),
        (_with(sd, {"exp_avg": np.zeros(3), "exp_avg_sq": np.zeros(7)}, "optim", "state", "b"),
         r"state_dict\['optim'\]\['state'\]\['b'\]\['exp_avg_sq'\] must be a floating-point array of 3 elements "
         r"\(the parameter's size\), got float64 array of 7 elements"),
        (_with(sd, {"exp_avg": np.zeros(3)}, "optim", "state", "b"),
         r"state'\]\['b'\]: keys differ from \['exp_avg', 'exp_avg_sq'\]: missing \['exp_avg_sq'\]"),
        (_with(sd, 2, "optim", "step", "b"), r"step'\] has different counts \[1, 2\] for parameters of the flat "
                                                  r"shard"),
        (_with(sd, -1, "optim", "step", "b"), r"step'\]\['b'\]=-1 must be an int >= 0"),
        ([1, 2], r"the state dict must be a dict, got list"),
    ]
    if kind == "fsdp":  # "a" and "b" share a unit: the case above needs them apart
        cases = [c for c in cases if "different counts" not in c[1]]
    for bad, match in cases:
        with raises_everywhere(who + r".*" + match):
            model.load_full_state_dict(bad)
    after = model.full_state_dict()
    for name in before["model"]:
        np.testing.assert_array_equal(after["model"][name], before["model"][name])
        for key, value in before["optim"]["state"][name].items():
            np.testing.assert_array_equal(after["optim"]["state"][name][key], value)
    assert after["optim"]["hyper"] == before["optim"]["hyper"]
    model.load_full_state_dict(sd)  # the complete state dict loads


def state_dict_strict_false_keeps_what_is_missing(kind: str) -> None:
    """strict=False: missing entries keep their current values, unknown ones are ignored."""
    model = trained(kind)
    sd = model.full_state_dict()
    moments = sd["optim"]["state"]
    new_params = {name: np.full(p.shape, 7.0) for name, p in params().items()}
    model.load_full_state_dict({"model": new_params, "extra": 1}, strict=False)  # params only
    after = model.full_state_dict()
    for name in params():
        np.testing.assert_array_equal(after["model"][name], new_params[name])
        for key, value in moments[name].items():
            np.testing.assert_array_equal(after["optim"]["state"][name][key], value)  # moments kept
    assert after["optim"]["step"] == sd["optim"]["step"]
    partial = {"model": {}, "optim": {"state": {"c": {"exp_avg": np.full(4, 3.0), "exp_avg_sq": np.ones(4)}},
                                           "hyper": {"lr": 0.5}}}
    model.load_full_state_dict(partial, strict=False)
    after = model.full_state_dict()
    np.testing.assert_array_equal(after["optim"]["state"]["c"]["exp_avg"], np.full(4, 3.0))
    np.testing.assert_array_equal(after["optim"]["state"]["a"]["exp_avg"], moments["a"]["exp_avg"])
    assert after["optim"]["hyper"]["lr"] == 0.5 and model.optimizer.betas == (0.9, 0.999)
    with raises_everywhere(r"hyper'\] is invalid: AdamW: lr=-5\.0 must be >= 0"):  # values are still checked
        model.load_full_state_dict({"optim": {"hyper": {"lr": -5.0}}}, strict=False)


def state_dicts_differing_across_ranks_are_refused(kind: str) -> None:
    """Each rank loads a state dict of its own (e.g. two checkpoint files): every rank raises and
    nothing is loaded, instead of mixing shards of both."""
    rank = meshkit.get_rank()
    model = trained(kind)
    sd = model.full_state_dict()
    before = model.full_state_dict()
    mine = _with(sd, sd["model"]["c"] + (1.0 if rank == 1 else 0.0), "model", "c")
    with raises_everywhere(r"load_full_state_dict: nothing was loaded; the state dicts differ across ranks: "
                           r"(ranks \[0(, [2-9])*\]|rank 0) passed one with digest [0-9a-f]+; rank 1 passed one with digest "
                           r"[0-9a-f]+; every rank must load the same state dict"):
        model.load_full_state_dict(mine)
    after = model.full_state_dict()
    for name in params():
        np.testing.assert_array_equal(after["model"][name], before["model"][name])


# ---------------------------------------------------------------------------- 5: construction

def different_order_across_ranks_raises(kind: str) -> None:
    rank = meshkit.get_rank()
    p = params()
    if rank == 1:
        p = {"b": p["b"], "a": p["a"], "c": p["c"]}
    with raises_everywhere(r"parameters are in a different order on rank 0 and rank 1: position 0 holds 'a' on rank "
                           r"0 and 'b' on rank 1 \(rank 0: \['a', 'b', 'c'\], rank 1: \['b', 'a', 'c'\]\); every "
                           r"rank must pass the same names, shapes and dtypes in the same order"):
        fsdp(p) if kind == "fsdp" else make(kind, p)


def bad_argument_on_one_rank_raises_everywhere(kind: str) -> None:
    """One rank's bad parameter fails every rank at once (no rank waits in a collective)."""
    rank = meshkit.get_rank()
    p = params()
    if rank == 1:
        p["b"] = np.zeros(3, np.int64)
    start = time.perf_counter()
    with raises_everywhere(r"invalid arguments on rank 1: params\['b'\] has dtype int64; parameters must be "
                           r"floating-point or complex"):
        fsdp(p) if kind == "fsdp" else make(kind, p)
    assert time.perf_counter() - start < 10


def settings_differing_across_ranks_raise() -> None:
    rank = meshkit.get_rank()
    with raises_everywhere(r"DistributedDataParallel: settings differ between rank 0 \(\{'bucket_cap_mb': 1e-06\}\) "
                           r"and rank 1 \(\{'bucket_cap_mb': 2e-06\}\)"):
        DistributedDataParallel(params(), bucket_cap_mb=1e-6 * (1 + (rank == 1)), first_bucket_cap_mb=1e-6)
    with raises_everywhere(r"ZeroRedundancyOptimizer: settings differ between rank 0 \(\{'optimizer': 'SGD\(lr=1\.0"):
        ZeroRedundancyOptimizer(params(), SGD(lr=1.0 + (rank == 1)), **CAPS)
    mesh = meshkit.init_device_mesh("cpu", (meshkit.get_world_size(),))
    units = [["a", "b"], ["c"]] if rank != 1 else [["a"], ["b", "c"]]
    with raises_everywhere(r"FullyShardedDataParallel: settings differ between rank 0 \(\{'units': \[\['a', 'b'\], "
                           r"\['c'\]\]\}\) and rank 1 \(\{'units': \[\['a'\], \['b', 'c'\]\]\}\)"):
        FullyShardedDataParallel(params(), mesh=mesh, optimizer=SGD(lr=1.0), units=units)


# ---------------------------------------------------------------------------- 6: the rules every strategy enforces

# Issue 36.1: the same loop (data_parallel, only protocol methods) under every strategy: marking
# order, second marks, a skipped step() and the gradient's dtype give the single-process result
# or the same error on every rank. A two-layer model in two units, trained with SGD momentum.
RULE_STRATEGIES = ["ddp", "zero1", "zero2", "fsdp", "hsdp"]
RULE_UNITS = [["w0", "b0"], ["w1"]]
RULE_BATCH, RULE_STEPS = 24, 3


def rule_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {"w0": rng.standard_normal((4, 5)) / 2, "b0": rng.standard_normal(5) * 0.1,
            "w1": rng.standard_normal((5, 3)) / 2}


def rule_batch(step: int, rank: int = 0, n: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(50 + step)
    x, y = rng.standard_normal((RULE_BATCH, 4)), rng.standard_normal((RULE_BATCH, 3))
    return np.array_split(x, n)[rank], np.array_split(y, n)[rank]


def rule_grads(p, x, y) -> dict[str, np.ndarray]:
    """Gradients of 0.5 * mean squared error of ``tanh(x @ w0 + b0) @ w1`` over the batch."""
    h = np.tanh(x @ p["w0"] + p["b0"])
    delta = (h @ p["w1"] - y) / len(y)
    dh = (delta @ p["w1"].T) * (1 - h ** 2)
    return {"w1": h.T @ delta, "b0": dh.sum(axis=0), "w0": x.T @ dh}


def rule_reference(skipped: tuple[int, ...] = ()) -> dict[str, np.ndarray]:
    """One process, the global batch, no strategy; the steps in ``skipped`` are not applied."""
    params, opt = rule_params(), SGD(lr=0.1, momentum=0.9)
    for step in range(RULE_STEPS):
        if step not in skipped:
            opt.step(params, rule_grads(params, *rule_batch(step)))
    return params


def rule_model(strategy: str):
    n = meshkit.get_world_size()
    shape, names = ((2, n // 2), ("replicate", "shard")) if strategy == "hsdp" else ((n,), ("dp",))
    mesh = meshkit.init_device_mesh("cpu", shape, mesh_dim_names=names)
    caps = CAPS if strategy in ("ddp", "zero1", "zero2") else {}  # DDP, ZeRO: a bucket per parameter
    return data_parallel(rule_params(), mesh, strategy, optimizer=SGD(lr=0.1, momentum=0.9), units=RULE_UNITS,
                         **caps)


def rule_pass(model, step: int, order=("w1", "b0", "w0"), mark=None) -> None:
    """This rank's forward and backward pass: every unit unsharded, the gradients marked in ``order``
    (through ``mark(name, grad)`` if given)."""
    rank, n = meshkit.get_rank(), meshkit.get_world_size()
    full = {}
    for u in range(len(model.units)):
        with model.unshard(u) as p:
            full.update({k: np.array(v) for k, v in p.items()})
    grads = rule_grads(full, *rule_batch(step, rank, n))
    for name in order:
        (mark or model.mark_grad_ready)(name, grads[name])


def assert_rule_result(model, ref: dict[str, np.ndarray], what: str) -> None:
    got = model.full_state_dict()["model"]
    for name, expected in ref.items():
        np.testing.assert_allclose(got[name], expected, rtol=1e-10, atol=1e-10, err_msg=f"{what}: {name}")


def marks_in_any_order(strategy: str) -> None:
    """Rank 1 marks w0, b0, w1 and rank 0 w1, b0, w0 (other ranks alternate): the result does not
    depend on it (FSDP reduced units in the order they completed: 0.16-0.29 off after 3 steps)."""
    rank = meshkit.get_rank()
    model = rule_model(strategy)
    for step in range(RULE_STEPS):
        model.zero_grad()
        rule_pass(model, step, ("w0", "b0", "w1") if rank % 2 else ("w1", "b0", "w0"))
        model.step()
    assert_rule_result(model, rule_reference(), f"{strategy} marked in rank-dependent order")


def marked_twice(strategy: str, ranks: str) -> None:
    """A gradient marked a second time in a backward pass (w1, a unit of its own, complete after its
    first mark), on every rank or on rank 1 alone: refused on that rank, naming it, and nothing
    changes, so the run goes on to the single-process result (FSDP reduced it again)."""
    rank = meshkit.get_rank()
    model = rule_model(strategy)
    again = ranks == "every" or rank == 1

    def mark(name, grad):
        model.mark_grad_ready(name, grad)
        if name == "w1" and again:
            with raises_everywhere(r"mark_grad_ready: gradient 'w1' was already marked ready in this backward pass"):
                model.mark_grad_ready(name, grad)

    for step in range(RULE_STEPS):
        model.zero_grad()
        rule_pass(model, step, mark=mark)
        model.step()
    assert_rule_result(model, rule_reference(), f"{strategy} w1 marked twice on {ranks} rank(s)")


def skipped_step(strategy: str) -> None:
    """Rank 1 skips step() once (step 1) and carries on: the ranks' next synchronization (rank 0's
    step(), rank 1's zero_grad()) raises on every rank, naming rank 1 and the skipped step(); no rank
    applies step 1, so all go on alike, to the single-process result without step 1 (FSDP: both ranks
    0.13-0.15 off, reporting nothing)."""
    rank = meshkit.get_rank()
    model = rule_model(strategy)
    raised = []
    for step in range(RULE_STEPS):
        try:
            model.zero_grad()
        except ValueError as exc:
            raised.append(("zero_grad", step, str(exc)))
        rule_pass(model, step)
        if rank == 1 and step == 1:
            continue
        try:
            model.step()
        except ValueError as exc:
            raised.append(("step", step, str(exc)))
    where = ("zero_grad", 2) if rank == 1 else ("step", 1)
    assert [r[:2] for r in raised] == [where], raised
    assert re.match(rf"^{RANKED}.*{where[0]}: the gradient sync failed on rank\(s\) \[1\]: rank 1: zero_grad\(\) "
                    r"discarded a backward pass that step\(\) had not ended: step\(\) was skipped on this rank, while "
                    r"rank\(s\) \[0(, \d)*\] ended the pass to use its gradients \(step\(\) or clip_grad_norm_\(\)\)\. "
                    r"This pass's gradients were discarded \(zeroed\) on every rank", raised[0][2]), raised[0][2]
    assert_rule_result(model, rule_reference(skipped=(1,)), f"{strategy} rank 1 skipped step 1")


def skipped_step_after_clipping(strategy: str) -> None:
    """Rank 1 clips (which ends the pass) and skips step() at step 1: nothing tells it then, but the
    next pass's sync (the next clip_grad_norm_()) compares the ranks' step counts and raises on every
    rank, naming rank 1."""
    rank = meshkit.get_rank()
    model = rule_model(strategy)
    for step in range(RULE_STEPS):
        model.zero_grad()
        rule_pass(model, step)
        if step == 2:
            with raises_everywhere(r"clip_grad_norm_: the gradient sync failed on rank\(s\) \[1\]: rank 1: it has taken "
                                   r"1 optimizer step\(s\) where rank\(s\) \[0(, \d)*\] took 2: step\(\) was skipped on "
                                   r"this rank"):
                model.clip_grad_norm_(1e9)
            return
        model.clip_grad_norm_(1e9)
        if not (rank == 1 and step == 1):
            model.step()


def float32_gradients_are_refused(strategy: str) -> None:
    """float32 gradients of float64 parameters: refused on every rank, naming the gradient, its
    dtype and the parameter's (FSDP accepted them); the float64 pass that follows trains right."""
    model = rule_model(strategy)
    for step in range(RULE_STEPS):
        model.zero_grad()
        if step == 0:
            with raises_everywhere(r"mark_grad_ready: gradient 'w1' has shape \(5, 3\) and dtype float32; expected "
                                   r"the parameter's shape \(5, 3\) and dtype float64"):
                rule_pass(model, step, mark=lambda name, g: model.mark_grad_ready(name, g.astype(np.float32)))
        rule_pass(model, step)
        model.step()
    assert_rule_result(model, rule_reference(), f"{strategy} after float32 gradients")


CROSS_RANK = [
    *(lambda kind=kind: one_rank_fails_the_sync(kind) for kind in KINDS),
    *(lambda kind=kind: one_rank_catches_and_carries_on(kind) for kind in KINDS),
    *(lambda kind=kind: state_dicts_differing_across_ranks_are_refused(kind) for kind in ("zero1", "zero2", "fsdp")),
    *(lambda kind=kind: different_order_across_ranks_raises(kind) for kind in ("ddp", "zero1", "fsdp")),
    *(lambda kind=kind: bad_argument_on_one_rank_raises_everywhere(kind) for kind in ("ddp", "zero2", "fsdp")),
    settings_differing_across_ranks_raise,
    *(lambda kind=kind: read_before_finish_changes_nothing(kind) for kind in KINDS),
    *(lambda s=s: marks_in_any_order(s) for s in ("ddp", "zero2", "fsdp")),
    *(lambda s=s: marked_twice(s, "one") for s in ("zero1", "fsdp")),
    *(lambda s=s: skipped_step(s) for s in ("ddp", "zero2", "fsdp")),
]


def run_cross_rank_cases() -> int:
    """Every cross-rank case, in order; returns how many ran."""
    for case in CROSS_RANK:
        case()
    return len(CROSS_RANK)

