"""Zero-bubble pipeline schedules: ZB-H1 and ZB-V with each backward split into B
(input gradient) and W (weight gradient). Orders checked by simulation (no deadlock, every
microbatch's F, B and W once per stage, in dependency order), simulated bubbles against the
formula, peak held activations against 1F1B's, equality with single-process training on the
local engine and under meshkit-run, and parameters shared by two stages counted once."""

from __future__ import annotations

import numpy as np
import pytest

import meshkit
import pipeline_cases as cases
from meshkit.comm import DistError, DistValueError, local
from meshkit.parallel import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleZBH1,
                              ScheduleZBVZeroBubble, bubble_fraction)
from meshkit.parallel.pipelining.schedules import Action, one_f_one_b_order, simulate, zb_h1_order, zbv_order


# --------------------------------------------------------------------------- orders (no communication)
def _zb_orders(kind: str, p: int, m: int) -> tuple[list[list[Action]], int]:
    if kind == "zbh1":
        return [zb_h1_order(r, p, m) for r in range(p)], p
    return [zbv_order(r, p, m) for r in range(p)], 2 * p


def _check_order(orders: list[list[Action]], num_stages: int, m: int, placement) -> None:
    """Each (microbatch, stage)'s F, B and W exactly once, on the rank holding the stage; the
    dependencies hold and nothing deadlocks (:func:`simulate` raises on either)."""
    seen = [tuple(a) for o in orders for a in o]
    assert len(seen) == len(set(seen)) == 3 * m * num_stages
    assert set(seen) == {(k, mb, s) for k in "FBW" for mb in range(m) for s in range(num_stages)}
    for r, o in enumerate(orders):
        assert all(placement(a.stage) == r for a in o), (r, o)
    simulate(orders, num_stages)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 9, 16])
def test_zero_bubble_orders_run_to_the_end_and_cover_every_pass_once(p, m):
    orders, n = _zb_orders("zbh1", p, m)
    _check_order(orders, n, m, lambda s: s)
    orders, n = _zb_orders("zbv", p, m)
    _check_order(orders, n, m, lambda s: s if s < p else 2 * p - 1 - s)


def test_the_simulation_refuses_a_pass_before_what_it_needs():
    # W before its own B; B before the next stage's B: both wait forever (a deadlock)
    with pytest.raises(ValueError, match="deadlock"):
        simulate([[Action("F", 0, 0), Action("W", 0, 0), Action("B", 0, 0)]], 1)
    with pytest.raises(ValueError, match="deadlock"):
        simulate([[Action("F", 0, 0), Action("B", 0, 0), Action("W", 0, 0)],
                  [Action("F", 0, 1), Action("W", 0, 1), Action("B", 0, 1)]], 2)


def test_zb_h1_order_written_out():
    F, B, W = ((lambda m, k=k: Action(k, m, 1)) for k in "FBW")
    # stage 1 of 3, 4 microbatches: 1F1B's warm-up, then each B's W one step later (stage 1 lags by 1)
    assert zb_h1_order(1, 3, 4) == [F(0), F(1), B(0), F(2), B(1), W(0), F(3), B(2), W(1), B(3), W(2), W(3)]
    # the first stage runs each W right after its B, the last lags by p - 1 = 2
    F, B, W = ((lambda m, k=k: Action(k, m, 0)) for k in "FBW")
    assert zb_h1_order(0, 3, 4) == [F(0), F(1), F(2), B(0), W(0), F(3), B(1), W(1), B(2), W(2), B(3), W(3)]
    F, B, W = ((lambda m, k=k: Action(k, m, 2)) for k in "FBW")
    assert zb_h1_order(2, 3, 4) == [F(0), B(0), F(1), B(1), F(2), B(2), W(0), F(3), B(3), W(1), W(2), W(3)]


def test_zbv_order_starts_as_torchs():
    # rank 0 of 2 (stages 0 and 3): 2(p - r) - 1 forwards of stage 0, then F/B/W of stage 3
    got = zbv_order(0, 2, 4)
    assert got[:6] == [Action("F", 0, 0), Action("F", 1, 0), Action("F", 2, 0), Action("F", 0, 3),
                       Action("B", 0, 3), Action("W", 0, 3)]


def _idle(orders, n, costs=None) -> list[float]:
    busy = simulate(orders, n, costs)
    work = [sum({"F": 1.0, "B": 1.0, "W": 1.0, **(costs or {})}[a.kind] for a in o) for o in orders]
    return [w / b - w for w, b in zip(work, busy)]  # step - busy, per rank


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 13, 32])
def test_simulated_bubbles_match_the_formula(p, m):
    # ZB-H1 with F = B = W = 1; 1F1B with the same work (its B is B + W = 2)
    zb = 1 - min(simulate(_zb_orders("zbh1", p, m)[0], p))
    assert zb == pytest.approx(bubble_fraction("zbh1", p, m), abs=1e-12)
    one = 1 - min(simulate([one_f_one_b_order(s, p, m) for s in range(p)], p, {"B": 2.0}))
    assert one == pytest.approx(bubble_fraction("1f1b", p, m), abs=1e-12)
    if m >= p:  # the paper's claim: a third of 1F1B's idle time (Qi et al., 2024, sec. 3.1)
        zb_idle = _idle(_zb_orders("zbh1", p, m)[0], p)
        f1_idle = _idle([one_f_one_b_order(s, p, m) for s in range(p)], p, {"B": 2.0})
        assert max(zb_idle) == pytest.approx(max(f1_idle) / 3) == pytest.approx(p - 1)
    # ZB-V: each of the two chunks a rank holds costs half a stage: F = B = W = 1/2
    zbv = 1 - min(simulate(_zb_orders("zbv", p, m)[0], 2 * p, {"F": 0.5, "B": 0.5, "W": 0.5}))
    assert zbv == pytest.approx(bubble_fraction("zbv", p, m), abs=1e-12)
    if 2 * m >= 3 * p - 1:  # enough microbatches: only the first forward's way down stays idle
        assert zbv == pytest.approx((p - 1) / (6 * m + p - 1)) and zbv < zb


def test_bubble_fraction_of_the_new_kinds_and_a_bad_kind():
    assert bubble_fraction("zbh1", 4, 8) == pytest.approx(3 / 27)
    assert bubble_fraction("zbv", 4, 8) == pytest.approx(3 / 51)
    assert bubble_fraction("zbh1", 4, 1) == pytest.approx(6 / 9)
    with pytest.raises(ValueError, match="kind must be one of gpipe, 1f1b, interleaved, zbh1, zbv, got 'zb'"):
        bubble_fraction("zb", 4, 8)


def _held_peak(order: list[Action]) -> dict[int, int]:
    """Per stage, the most microbatches held at once: from F to W (to B without a W)."""
    split = any(a.kind == "W" for a in order)
    live: dict[int, set[int]] = {}
    peak: dict[int, int] = {}
    for a in order:
        held = live.setdefault(a.stage, set())
        if a.kind == "F":
            held.add(a.microbatch)
        elif a.kind == ("W" if split else "B"):
            held.discard(a.microbatch)
        peak[a.stage] = max(peak.get(a.stage, 0), len(held))
    return peak


@pytest.mark.parametrize("p, m", [(2, 1), (2, 5), (3, 3), (4, 2), (4, 9), (5, 16)])
def test_zb_h1_holds_no_more_activations_than_1f1b(p, m):
    zb = [_held_peak(zb_h1_order(s, p, m))[s] for s in range(p)]
    one = [_held_peak(one_f_one_b_order(s, p, m))[s] for s in range(p)]
    assert one == [min(p - s, m) for s in range(p)]
    assert max(zb) == max(one) == min(p, m)  # the paper's "same peak memory as 1F1B"
    assert all(z <= min(p, m) for z in zb)


# --------------------------------------------------------------------------- equivalence (local engine)
def _run(kind: str, p: int, m: int, *, steps: int = 1, split: bool = True, tied: bool = False, share: bool = True,
         batch_per_mb: int = 2):
    """``steps`` steps on ``p`` ranks; each rank returns (losses, {stage: grads}, {stage: peak})."""
    v = 2 if kind in ("zbv", "interleaved") else 1
    n = p * v
    ps = cases.params(n)
    if tied:  # the first and the last stage use one weight (tied embeddings)
        ps[n - 1]["w"] = ps[0]["w"]
    x, t = cases.data(m * batch_per_mb)
    placement = "v" if kind == "zbv" else "loop"

    def body():
        r = meshkit.get_rank()
        mine = [r, 2 * p - 1 - r] if kind == "zbv" else [r + i * p for i in range(v)]
        grads = {s: {k: np.zeros_like(a) for k, a in ps[s].items()} for s in mine}
        if tied and 0 in mine and n - 1 in mine:  # one rank holds both uses: one gradient array, as a user would
            grads[n - 1]["w"] = grads[0]["w"]
        stages = []
        for s in mine:
            shared = {"tied": grads[s]["w"]} if tied and share and s in (0, n - 1) else None
            if split:
                stages.append(cases.split_stage(ps[s], grads[s], s, n, placement=placement, shared=shared))
            else:
                stages.append(PipelineStage(*cases.stage_fns(ps[s], grads[s]), s, n, placement=placement,
                                            shared=shared))
        schedule = {"zbh1": lambda: ScheduleZBH1(stages[0], m, cases.loss_fn),
                    "zbv": lambda: ScheduleZBVZeroBubble(stages, m, cases.loss_fn),
                    "1f1b": lambda: Schedule1F1B(stages[0], m, cases.loss_fn),
                    "gpipe": lambda: ScheduleGPipe(stages[0], m, cases.loss_fn),
                    "interleaved": lambda: ScheduleInterleaved1F1B(stages, m, cases.loss_fn)}[kind]()
        losses = [schedule.step(x if 0 in mine else None, target=t if n - 1 in mine else None) for _ in range(steps)]
        return losses, grads, {s.stage_index: s.peak_live_activations for s in stages}

    ref_loss, ref = cases.reference(ps, x, t)
    return local.run(body, p, timeout=60), ref_loss, ref


def _assert_equal(results, ref_loss, ref, n, steps=1):
    seen = set()
    for losses, grads, _ in results:
        for s, g in grads.items():
            seen.add(s)
            for k in g:
                np.testing.assert_allclose(g[k], steps * ref[s][k], rtol=1e-12, atol=1e-14, err_msg=f"stage {s} {k}")
        if losses[0] is not None:
            assert abs(np.mean(losses[-1]) - ref_loss) <= 1e-12 * abs(ref_loss)
    assert seen == set(range(n))


ZBH1_CASES = [(p, m) for p in (2, 3, 4) for m in sorted({max(1, p - 1), p, 2 * p + 1})]


@pytest.mark.parametrize("p, m", ZBH1_CASES)
def test_zb_h1_equals_single_process_training_and_holds_what_1f1b_holds(p, m):
    results, ref_loss, ref = _run("zbh1", p, m)
    _assert_equal(results, ref_loss, ref, p)
    peaks = {s: pk for _, _, d in results for s, pk in d.items()}
    # measured by the executor (F to W): the order's count, never above 1F1B's first stage
    assert peaks == {s: _held_peak(zb_h1_order(s, p, m))[s] for s in range(p)}
    assert max(peaks.values()) == min(p, m)


@pytest.mark.parametrize("p, m", [(1, 1), (1, 3), (2, 1), (2, 3), (2, 4), (3, 2), (3, 5), (3, 7), (4, 9)])
def test_zbv_equals_single_process_training(p, m):
    results, ref_loss, ref = _run("zbv", p, m)
    _assert_equal(results, ref_loss, ref, 2 * p)
    peaks = {s: pk for _, _, d in results for s, pk in d.items()}
    for r in range(p):
        order = _held_peak(zbv_order(r, p, m))
        assert peaks[r] == order[r] and peaks[2 * p - 1 - r] == order[2 * p - 1 - r]


def test_a_second_zero_bubble_step_accumulates():
    for kind, p in (("zbh1", 3), ("zbv", 2)):
        results, ref_loss, ref = _run(kind, p, 4, steps=2)
        _assert_equal(results, ref_loss, ref, p * (2 if kind == "zbv" else 1), steps=2)


@pytest.mark.parametrize("kind, p, m", [("1f1b", 3, 4), ("gpipe", 2, 3), ("interleaved", 2, 4)])
def test_split_stages_run_under_the_other_schedules(kind, p, m):
    # B then W back to back: the schedules that do not split run split stages as they are
    results, ref_loss, ref = _run(kind, p, m)
    _assert_equal(results, ref_loss, ref, p * (2 if kind == "interleaved" else 1))


@pytest.mark.parametrize("kind, p", [("zbh1", 2), ("zbv", 2)])
def test_a_zero_bubble_schedule_refuses_a_stage_without_the_split_on_every_rank(kind, p):
    def body():
        try:
            _body_unsplit(kind, p)
        except DistValueError as exc:
            return str(exc)
        return None

    out = local.run(body, p, timeout=30)
    name = "ScheduleZBH1" if kind == "zbh1" else "ScheduleZBVZeroBubble"
    for r, text in enumerate(out):
        assert text is not None and text.startswith(f"meshkit.parallel: rank {r}: {name}.step: {name} splits each "
                                                    "backward into its input and weight gradients, but stage 0 (on "
                                                    "rank 0) has a single backward; pass backward_input=(ctx, dy) -> "
                                                    "(dx, wctx) and backward_weight=(wctx) -> None to its "
                                                    "PipelineStage instead of backward"), text


def _body_unsplit(kind, p):
    r = meshkit.get_rank()
    n = 2 * p if kind == "zbv" else p
    ps = cases.params(n)
    mine = [r, 2 * p - 1 - r] if kind == "zbv" else [r]
    placement = "v" if kind == "zbv" else "loop"
    stages = []
    for s in mine:
        g = {k: np.zeros_like(a) for k, a in ps[s].items()}
        if s == 0:  # only the first stage lacks the split
            stages.append(PipelineStage(*cases.stage_fns(ps[s], g), s, n, placement=placement))
        else:
            stages.append(cases.split_stage(ps[s], g, s, n, placement=placement))
    schedule = ScheduleZBH1(stages[0], 2, cases.loss_fn) if kind == "zbh1" else ScheduleZBVZeroBubble(
        stages, 2, cases.loss_fn)
    x, t = cases.data(4)
    schedule.step(x if 0 in mine else None, target=t if n - 1 in mine else None)


def test_split_and_placement_errors_name_the_problem():
    def body():
        r = meshkit.get_rank()
        ps = cases.params(4)
        g = {k: np.zeros_like(a) for k, a in ps[r].items()}
        fwd, bi, bw = cases.split_stage_fns(ps[r], g)
        out = []
        for make in (lambda: PipelineStage(fwd, None, r, 2, backward_input=bi),
                     lambda: PipelineStage(fwd, lambda c, d: d, r, 2, backward_input=bi, backward_weight=bw),
                     lambda: PipelineStage(fwd, None, r, 2),
                     lambda: PipelineStage(fwd, None, r, 2, backward_input=bi, backward_weight=bw, placement="w"),
                     lambda: PipelineStage(fwd, None, r, 2, backward_input=bi, backward_weight=bw, placement="v"),
                     lambda: PipelineStage(fwd, None, 3 - r, 4, backward_input=bi, backward_weight=bw),
                     lambda: ScheduleZBVZeroBubble([cases.split_stage(ps[r], g, r, 4),
                                                    cases.split_stage(ps[r], g, r + 2, 4)], 2, cases.loss_fn),
                     lambda: ScheduleZBVZeroBubble([cases.split_stage(ps[r], g, r, 4, placement="v")], 2,
                                                   cases.loss_fn),
                     lambda: ScheduleInterleaved1F1B([cases.split_stage(ps[r], g, r, 4, placement="v"),
                                                      cases.split_stage(ps[r], g, 3 - r, 4, placement="v")], 2,
                                                     cases.loss_fn),
                     lambda: PipelineStage(fwd, None, r, 2, backward_input=bi, backward_weight=bw,
                                           shared={"tied": 3.0})):
            try:
                make()
                out.append(None)
            except DistValueError as exc:
                out.append(str(exc))
        return out

    out = local.run(body, 2)[1]
    head = "meshkit.parallel: rank 1: PipelineStage"
    assert out[0] == f"{head}: stage 1: pass both backward_input and backward_weight (the split backward), or neither"
    assert out[1] == f"{head}: stage 1: pass backward or backward_input and backward_weight, not both"
    assert out[2].startswith(f"{head}: forward and backward (or backward_input and backward_weight) must be callables")
    assert out[3] == f"{head}: placement must be 'loop' or 'v', got 'w'"
    assert out[4] == f"{head}: placement 'v' needs num_stages == 2 * the group's 2 ranks, got 2"
    assert out[5] == (f"{head}: stage 2 of 4 lives on group rank 0 (stage i on rank i % 2), not on this rank "
                      "(group rank 1)")
    assert out[6] == ("meshkit.parallel: rank 1: ScheduleZBVZeroBubble needs this rank's stages [1, 2] of 4 (rank r "
                      "holds stages r and 2p - 1 - r, placement='v'), got [1, 3] of 4")
    assert out[7].startswith("meshkit.parallel: rank 1: ScheduleZBVZeroBubble needs this rank's stages [1, 2] of 4")
    assert out[8] == ("meshkit.parallel: rank 1: ScheduleInterleaved1F1B needs this rank's stages [1, 3] of 4, got "
                      "[1, 2]")
    assert out[9].startswith(f"{head}: stage 1: shared must be a dict of name -> gradient array, got {{'tied': 3.0}}")


def test_a_v_stage_under_a_loop_schedule_is_named():
    def body():
        r = meshkit.get_rank()
        ps = cases.params(3)
        g = {k: np.zeros_like(a) for k, a in ps[r].items()}
        # three ranks, V placement: rank 1 holds stages 1 and 4 (as loop's interleaved would)
        st = [cases.split_stage(ps[0], g, r, 6, placement="v"), cases.split_stage(ps[0], g, 5 - r, 6, placement="v")]
        try:
            ScheduleInterleaved1F1B(st, 3, cases.loss_fn)
        except DistValueError as exc:
            return str(exc)

    out = local.run(body, 3)
    assert out[1] == ("meshkit.parallel: rank 1: ScheduleInterleaved1F1B: runs stages placed 'loop'; stage 1 was "
                      "built with placement='v': pass placement='loop' to its PipelineStage")


def test_w_runs_after_b_with_what_b_kept_even_in_received_buffers():
    # the split stage keeps its received input x for W; the executor must not hand that buffer
    # to the next receive before W ran (ZB-H1 delays stage 1's W past the next F's receive)
    results, ref_loss, ref = _run("zbh1", 3, 6, batch_per_mb=1)
    _assert_equal(results, ref_loss, ref, 3)
    assert zb_h1_order(1, 3, 6).index(Action("W", 0, 1)) > zb_h1_order(1, 3, 6).index(Action("F", 2, 1))


# --------------------------------------------------------------------------- shared (tied) weights
@pytest.mark.parametrize("kind, p, m", [("zbv", 2, 4), ("zbv", 3, 5), ("zbh1", 2, 3), ("1f1b", 3, 4),
                                        ("zbv", 1, 2)])
@pytest.mark.parametrize("steps", [1, 2])
def test_a_weight_shared_by_two_stages_gets_every_use_once(kind, p, m, steps):
    """The first and the last stage use one weight: its gradient is the sum of both uses (the
    reference: one process, both uses accumulated into one array), in every holder's array.
    ZB-V: one rank holds both stages and one array; the others: two ranks, an array each."""
    n = 2 * p if kind == "zbv" else p
    results, ref_loss, ref = _run(kind, p, m, tied=True, steps=steps)
    tied = ref[0]["w"] + ref[n - 1]["w"]
    # both uses contribute, so counting one twice, or leaving one out, moves the result
    for wrong in (ref[0]["w"], ref[n - 1]["w"], tied + ref[0]["w"], tied + ref[n - 1]["w"], 2 * tied):
        assert np.abs(wrong - tied).max() > 1e-3
    for losses, grads, _ in results:
        for s, g in grads.items():
            want = steps * (tied if s in (0, n - 1) else ref[s]["w"])
            np.testing.assert_allclose(g["w"], want, rtol=1e-12, atol=1e-14, err_msg=f"stage {s}")
            np.testing.assert_allclose(g["b"], steps * ref[s]["b"], rtol=1e-12, atol=1e-14, err_msg=f"stage {s}")


def test_without_declaring_the_sharing_each_holder_has_its_own_use_only():
    # the same run without shared=: on two ranks each holder's gradient misses the other use
    results, _, ref = _run("1f1b", 2, 2, tied=True, share=False)
    np.testing.assert_allclose(results[0][1][0]["w"], ref[0]["w"], rtol=1e-12)
    np.testing.assert_allclose(results[1][1][1]["w"], ref[1]["w"], rtol=1e-12)


def test_stages_sharing_a_name_with_other_shapes_are_refused_on_every_rank():
    def body():
        r = meshkit.get_rank()
        ps = cases.params(2)
        g = {k: np.zeros_like(a) for k, a in ps[r].items()}
        st = cases.split_stage(ps[r], g, r, 2, shared={"tied": g["w"] if r == 0 else g["b"]})
        try:
            ScheduleZBH1(st, 2, cases.loss_fn).step(cases.data(4)[0] if r == 0 else None,
                                                    target=cases.data(4)[1] if r == 1 else None)
        except DistError as exc:
            return str(exc)

    for r, text in enumerate(local.run(body, 2, timeout=30)):
        assert text == (f"meshkit.parallel: rank {r}: ScheduleZBH1.step: the stages sharing 'tied' declare gradients "
                        "of different shapes, dtypes or devices: stage 0: (5, 5) float64, stage 1: (5,) float64")


# --------------------------------------------------------------------------- real processes
def test_zero_bubble_schedules_under_meshkit_run(mpirun):
    out = mpirun("mpi_zero_bubble.py", 3).stdout
    assert out.count("zero bubble OK") == 3 and out.count("tied OK") == 3 and out.count("unsplit refused") == 3, out


def test_a_weight_gradient_that_raises_names_stage_and_microbatch_and_the_others_end():
    def body():
        r = meshkit.get_rank()
        ps = cases.params(2)
        g = {k: np.zeros_like(a) for k, a in ps[r].items()}
        fwd, bi, bw = cases.split_stage_fns(ps[r], g)

        def broken(wctx):
            raise FloatingPointError("overflow in W")

        stage = PipelineStage(fwd, None, r, 2, backward_input=bi, backward_weight=broken if r == 1 else bw)
        x, t = cases.data(8)  # 4 microbatches: rank 0 still waits for gradients when W 0 fails on rank 1
        try:
            ScheduleZBH1(stage, 4, cases.loss_fn).step(x if r == 0 else None, target=t if r == 1 else None)
        except DistError as exc:
            return str(exc)

    out = local.run(body, 2, timeout=30)
    assert out[1] == ("meshkit.parallel: rank 1: pipeline stage 1: backward_weight of microbatch 0 raised "
                      "FloatingPointError: overflow in W")
    assert out[0] is not None and out[0].endswith("backward_weight of microbatch 0 raised FloatingPointError: "
                                                  "overflow in W"), out


def test_a_backward_input_that_does_not_return_dx_and_wctx_is_named():
    def body():
        r = meshkit.get_rank()
        ps = cases.params(2)
        g = {k: np.zeros_like(a) for k, a in ps[r].items()}
        fwd, bi, bw = cases.split_stage_fns(ps[r], g)
        stage = PipelineStage(fwd, None, r, 2, backward_input=(lambda c, d: bi(c, d)[0]) if r == 1 else bi,
                              backward_weight=bw)
        x, t = cases.data(4)
        try:
            ScheduleZBH1(stage, 2, cases.loss_fn).step(x if r == 0 else None, target=t if r == 1 else None)
        except DistError as exc:
            return str(exc)

    out = local.run(body, 2, timeout=30)
    assert out[1] == ("meshkit.parallel: rank 1: pipeline stage 1: backward_input of microbatch 0 returned a "
                      "ndarray; it must return (dx, wctx), wctx being what backward_weight needs")
    assert out[0] is not None


# --------------------------------------------------------------------------- device arrays (tests/doubles/fake_cupy.py)
@pytest.mark.parametrize("kind", ["zbh1", "zbv"])
def test_device_arrays_with_a_tied_weight_match_one_process(cupy, kind):
    # CuPy stages over the local engine; ZB-V's rank 1 holds no tied stage (its share of the
    # all-reduce is host zeros), ZB-H1's two ranks hold one use each
    p, m = 2, 3
    n = 2 * p if kind == "zbv" else p
    ps = cases.params(n)
    ps[n - 1]["w"] = ps[0]["w"]
    x, t = cases.data(2 * m)

    def body():
        r = meshkit.get_rank()
        mine = [r, 2 * p - 1 - r] if kind == "zbv" else [r]
        dev = {s: {k: cupy.asarray(a) for k, a in ps[s].items()} for s in mine}
        grads = {s: {k: cupy.zeros_like(a) for k, a in dev[s].items()} for s in mine}
        if 0 in mine and n - 1 in mine:
            grads[n - 1]["w"] = grads[0]["w"]
        stages = [cases.split_stage(dev[s], grads[s], s, n, placement="v" if kind == "zbv" else "loop",
                                    shared={"tied": grads[s]["w"]} if s in (0, n - 1) else None) for s in mine]

        def loss_fn(y, target):
            d = y - target
            return 0.0, d / y.shape[0]

        schedule = (ScheduleZBVZeroBubble(stages, m, loss_fn) if kind == "zbv" else
                    ScheduleZBH1(stages[0], m, loss_fn))
        schedule.step(cupy.asarray(x) if 0 in mine else None, target=cupy.asarray(t) if n - 1 in mine else None)
        return {s: {k: a.get() for k, a in g.items()} for s, g in grads.items()}

    results = local.run(body, p, timeout=60)
    ref = cases.reference(ps, x, t)[1]
    for grads in results:
        for s, g in grads.items():
            want = ref[0]["w"] + ref[n - 1]["w"] if s in (0, n - 1) else ref[s]["w"]
            np.testing.assert_allclose(g["w"], want, rtol=1e-12, atol=1e-14, err_msg=f"stage {s}")
            np.testing.assert_allclose(g["b"], ref[s]["b"], rtol=1e-12, atol=1e-14, err_msg=f"stage {s}")
