"""Pipeline parallelism: schedule orders (pure), equivalence with single-process training on the
local engine for GPipe, 1F1B and interleaved 1F1B, activation counts, and failures that end
every stage instead of hanging."""

from __future__ import annotations

import collections
import threading
import time
import types

import numpy as np
import pytest

import meshkit
import pipeline_cases as cases
from meshkit.comm import DistError, DistValueError, local
from meshkit.parallel import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                              bubble_fraction)
from meshkit.parallel.pipelining.schedules import (Action, gpipe_order, interleaved_order, one_f_one_b_order,
                                                   zb_h1_order, zbv_order)


# --------------------------------------------------------------------------- orders (no communication)
def test_one_f_one_b_order_written_out():
    F, B = (lambda m: Action("F", m, 1)), (lambda m: Action("B", m, 1))
    # stage 1 of 4, 5 microbatches: 2 warm-up forwards, then F/B pairs, then 2 cool-down backwards
    assert one_f_one_b_order(1, 4, 5) == [F(0), F(1), F(2), B(0), F(3), B(1), F(4), B(2), B(3), B(4)]
    assert one_f_one_b_order(3, 4, 2) == [Action("F", 0, 3), Action("B", 0, 3), Action("F", 1, 3), Action("B", 1, 3)]
    assert gpipe_order(0, 2, 2) == [Action("F", 0, 0), Action("F", 1, 0), Action("B", 0, 0), Action("B", 1, 0)]


def test_interleaved_order_written_out():
    # rank 0 of 2 holding stages 0 and 2, 4 microbatches (Megatron-LM's order)
    got = [(a.kind, a.microbatch, a.stage) for a in interleaved_order(0, 2, 2, 4)]
    assert got == [("F", 0, 0), ("F", 1, 0), ("F", 0, 2), ("F", 1, 2), ("F", 2, 0), ("B", 0, 2), ("F", 3, 0),
                   ("B", 1, 2), ("F", 2, 2), ("B", 0, 0), ("F", 3, 2), ("B", 1, 0), ("B", 2, 2), ("B", 3, 2),
                   ("B", 2, 0), ("B", 3, 0)]


def _orders(kind: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    if kind == "gpipe":
        return [gpipe_order(r, p, m) for r in range(p)]
    if kind == "1f1b":
        return [one_f_one_b_order(r, p, m) for r in range(p)]
    return [interleaved_order(r, p, v, m) for r in range(p)]


def _simulate(orders: list[list[Action]], num_stages: int) -> None:
    """Run every rank's order with non-blocking sends and blocking receives; fail on a deadlock.
    A "W" (zero-bubble schedules' weight gradient) needs its own stage's "B"."""
    done: set[tuple[str, int, int]] = set()
    pos = [0] * len(orders)
    while any(pos[r] < len(o) for r, o in enumerate(orders)):
        moved = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                a = order[pos[r]]
                need = (("F", a.microbatch, a.stage - 1) if a.kind == "F" and a.stage > 0 else
                        ("B", a.microbatch, a.stage + 1) if a.kind == "B" and a.stage < num_stages - 1 else None)
                if a.kind == "B":
                    assert ("F", a.microbatch, a.stage) in done, f"backward before forward: {a}"
                if a.kind == "W":
                    assert ("B", a.microbatch, a.stage) in done, f"weight gradient before input gradient: {a}"
                if need is not None and need not in done:
                    break
                done.add(tuple(a))
                pos[r] += 1
                moved = True
        assert moved, f"deadlock: ranks wait at {[o[i] if i < len(o) else None for o, i in zip(orders, pos)]}"
    passes = 3 if any(a.kind == "W" for o in orders for a in o) else 2
    assert len(done) == passes * len({(a.microbatch, a.stage) for o in orders for a in o})


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 9])
def test_every_order_runs_to_the_end_and_covers_every_pass_once(kind, p, m):
    orders = _orders(kind, p, m)
    for o in orders:
        assert len(o) == len(set(o)) == 2 * m
    _simulate(orders, p)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 9])
def test_zero_bubble_orders_run_to_the_end_here_too(p, m):
    # ZB-H1 and ZB-V (tests/test_zero_bubble.py has the rest): F, B and W of every pair once
    for orders, n in (([zb_h1_order(r, p, m) for r in range(p)], p), ([zbv_order(r, p, m) for r in range(p)], 2 * p)):
        assert sum(len(o) for o in orders) == len({a for o in orders for a in o}) == 3 * m * n
        _simulate(orders, n)


@pytest.mark.parametrize("p, v, m", [(2, 2, 2), (2, 2, 4), (2, 3, 6), (3, 2, 3), (3, 2, 9), (4, 2, 8), (4, 3, 4),
                                     (1, 3, 2)])
def test_interleaved_orders_run_to_the_end(p, v, m):
    orders = _orders("interleaved", p, m, v)
    assert all(len(o) == len(set(o)) == 2 * m * v for o in orders)
    _simulate(orders, p * v)


def _peak(order: list[Action]) -> int:
    live = peak = 0
    for a in order:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("p, m", [(2, 1), (3, 3), (4, 9), (4, 2)])
def test_1f1b_keeps_at_most_num_stages_minus_index_activations(p, m):
    for s in range(p):
        assert _peak(one_f_one_b_order(s, p, m)) == min(p - s, m)
        assert _peak(gpipe_order(s, p, m)) == m


def test_bubble_fractions():
    assert bubble_fraction("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("interleaved", 4, 8, 2) == pytest.approx(3 / 19)


# --------------------------------------------------------------------------- equivalence (local engine)
def _train(schedule_kind: str, p: int, m: int, v: int = 1, batch_per_mb: int = 2):
    """One step on ``p`` ranks; each rank returns (losses or None, {stage: grads}, {stage: peak})."""
    num_stages = p * v
    ps = cases.params(num_stages)
    x, t = cases.data(m * batch_per_mb)

    def body():
        r = meshkit.get_rank()
        mine = [r + i * p for i in range(v)]
        grads = {s: {k: np.zeros_like(a) for k, a in ps[s].items()} for s in mine}
        stages = [PipelineStage(*cases.stage_fns(ps[s], grads[s]), s, num_stages) for s in mine]
        if schedule_kind == "interleaved":
            schedule = ScheduleInterleaved1F1B(stages, m, cases.loss_fn)
        else:
            schedule = (ScheduleGPipe if schedule_kind == "gpipe" else Schedule1F1B)(stages[0], m, cases.loss_fn)
        losses = schedule.step(x if r == 0 else None, target=t if (num_stages - 1) % p == r else None)
        return losses, grads, {s.stage_index: s.peak_live_activations for s in stages}

    return local.run(body, p), cases.reference(ps, x, t)


CASES = [(kind, p, m) for kind in ("gpipe", "1f1b") for p in (2, 3, 4) for m in sorted({max(1, p - 1), p, 2 * p + 1})]


@pytest.mark.parametrize("kind, p, m", CASES)
def test_gradients_and_losses_equal_single_process_training(kind, p, m):
    results, (ref_loss, ref_grads) = _train(kind, p, m)
    losses = results[p - 1][0]
    assert len(losses) == m and abs(np.mean(losses) - ref_loss) <= 1e-12 * abs(ref_loss)
    for r, (ls, grads, peaks) in enumerate(results):
        assert (ls is None) == (r != p - 1)
        for s, g in grads.items():
            for k in g:
                np.testing.assert_allclose(g[k], ref_grads[s][k], rtol=1e-12, atol=1e-14, err_msg=f"stage {s} {k}")
        for s, peak in peaks.items():
            assert peak == (m if kind == "gpipe" else min(p - s, m)), (s, peak)


@pytest.mark.parametrize("p, v, m", [(2, 2, 2), (2, 2, 6), (3, 2, 3), (2, 3, 4), (1, 2, 3)])
def test_interleaved_equals_single_process_training(p, v, m):
    results, (ref_loss, ref_grads) = _train("interleaved", p, m, v)
    losses = results[(p * v - 1) % p][0]
    assert abs(np.mean(losses) - ref_loss) <= 1e-12 * abs(ref_loss)
    for _, grads, _ in results:
        for s, g in grads.items():
            for k in g:
                np.testing.assert_allclose(g[k], ref_grads[s][k], rtol=1e-12, atol=1e-14, err_msg=f"stage {s} {k}")


def test_a_second_step_reuses_the_learned_shapes_and_accumulates():
    ps = cases.params(2)
    x, t = cases.data(4)

    def body():
        r = meshkit.get_rank()
        grads = {k: np.zeros_like(a) for k, a in ps[r].items()}
        stage = PipelineStage(*cases.stage_fns(ps[r], grads), r, 2)
        schedule = Schedule1F1B(stage, 2, cases.loss_fn)
        for _ in range(2):
            schedule.step(x if r == 0 else None, target=t if r == 1 else None)
        return grads, stage.input_spec

    results = local.run(body, 2)
    _, ref = cases.reference(ps, x, t)
    for r, (grads, spec) in enumerate(results):
        np.testing.assert_allclose(grads["w"], 2 * ref[r]["w"], rtol=1e-12)
    assert results[1][1] == ((2, cases.WIDTH), np.dtype(np.float64)) and results[0][1] is None


# --------------------------------------------------------------------------- buffers still being sent
class _Rendezvous:
    """Point-to-point traffic that reads a send's array only when its receiver takes it, as MPI's
    rendezvous protocol does for large messages (the local engine copies at the send, which would
    hide a buffer reused while its send is in flight). Receives on ``slow`` take ``delay`` s."""

    def __init__(self, slow: int, delay: float) -> None:
        self.cond, self.queues = threading.Condition(), collections.defaultdict(collections.deque)
        self.slow, self.delay = slow, delay

    def group(self, group):
        hub = self

        class Group:  # the stage's group, its sends and receives through the hub
            def __getattr__(self, name):
                return getattr(group, name)

            def isend(self, tensor, dst, tag=0):
                sent = threading.Event()
                with hub.cond:
                    hub.queues[(group.rank, dst, tag)].append((tensor, sent))
                    hub.cond.notify_all()
                return types.SimpleNamespace(is_completed=sent.is_set, wait=lambda timeout=None: sent.wait(30))

            def irecv(self, tensor, src=None, tag=0):
                def wait(timeout=None):
                    if group.rank == hub.slow:
                        time.sleep(hub.delay)
                    with hub.cond:
                        queue = hub.queues[(src, group.rank, tag)]
                        assert hub.cond.wait_for(lambda: queue, 30), f"nothing sent from {src} tag {tag}"
                        data, sent = queue.popleft()
                        tensor[...] = data  # the send's array, read now
                    sent.set()
                return types.SimpleNamespace(wait=wait)

        return Group()


@pytest.mark.parametrize("kinds", [("scale", "pass", "scale"), ("scale", "inplace", "scale")])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_buffer_goes_back_to_its_pool_only_once_its_send_completed(kinds, schedule):
    """A backward that returns ``dy`` itself, or its input buffer, sends a pooled buffer; the next
    receive must not reuse it while the (slow) previous stage has not taken it yet."""
    ws, m = [1.5, 0.5 if kinds[1] == "inplace" else 1.0, 0.5], 4
    rng = np.random.default_rng(0)
    x, t = rng.standard_normal((4 * m, 64)), rng.standard_normal((4 * m, 64))
    hub = _Rendezvous(slow=0, delay=0.05)

    def body():
        r = meshkit.get_rank()
        grad = np.zeros(1)
        stage = PipelineStage(*cases.scale_stage(kinds[r], ws[r], grad), r, 3)
        sched = (ScheduleGPipe if schedule == "gpipe" else Schedule1F1B)(stage, m, cases.loss_fn)
        stage.group = hub.group(stage.group)  # the stage's transfers (the schedule's first-step check: the group's)
        sched.step(x if r == 0 else None, target=t if r == 2 else None)
        return grad[0]

    got = local.run(body, 3, timeout=60)
    ref = cases.scale_reference(ws, x, t)
    for r in range(3):
        if kinds[r] != "pass":
            assert got[r] == pytest.approx(ref[r], rel=1e-12), (r, got, ref)


# --------------------------------------------------------------------------- bad input and failures
def _steps(p: int, v: int, m: int, x, targets, make_fns=None, loss_fn=cases.loss_fn):
    """Steps of one pipeline (objects kept across steps) with ``targets[i]`` at step i on ``p`` ranks,
    ``v`` stages each; every rank's losses per step, or its exception (type name, text) and the
    seconds the run took."""
    num_stages = p * v
    ps = cases.params(num_stages)

    def body():
        r = meshkit.get_rank()
        mine = [r + i * p for i in range(v)]
        grads = {s: {k: np.zeros_like(a) for k, a in ps[s].items()} for s in mine}
        stages = [PipelineStage(*(make_fns or (lambda s, q, g: cases.stage_fns(q, g)))(s, ps[s], grads[s]), s,
                                num_stages) for s in mine]
        schedule = ScheduleInterleaved1F1B(stages, m, loss_fn) if v > 1 else Schedule1F1B(stages[0], m, loss_fn)
        out = []
        try:
            for t in targets:
                out.append(schedule.step(x if r == 0 else None, target=t if (num_stages - 1) % p == r else None))
        except DistError as exc:
            return type(exc).__name__, str(exc)
        return out

    start = time.monotonic()
    results = local.run(body, p, timeout=30)
    return results, time.monotonic() - start


def _failing_run(p: int, make_fns, m: int = 2, batch: int = 4, loss_fn=cases.loss_fn):
    """Every rank's exception (type name, text; None if it had none) and how long the run took."""
    x, t = cases.data(batch)
    results, took = _steps(p, 1, m, x, [t], make_fns, loss_fn)
    return [r if isinstance(r, tuple) else None for r in results], took


def test_a_stage_raising_in_its_forward_names_stage_and_microbatch_and_the_others_end():
    def make(r, p, g):
        fwd, bwd = cases.stage_fns(p, g)
        calls = []

        def forward(x):
            calls.append(1)
            if r == 1 and len(calls) == 2:
                raise FloatingPointError("overflow in layer")
            return fwd(x)
        return forward, bwd

    results, took = _failing_run(3, make, m=3, batch=6)
    assert results[1] == ("PipelineError", "meshkit.parallel: rank 1: pipeline stage 1: forward of microbatch 1 "
                                           "raised FloatingPointError: overflow in layer")
    for r in (0, 2):
        assert results[r] is not None and results[r][1].endswith(
            "rank 1 stopped using group world, sends and receives included: meshkit.parallel: rank 1: pipeline "
            "stage 1: forward of microbatch 1 raised FloatingPointError: overflow in layer"), results  # no "at call #0"
    assert took < 10


def test_errors_name_the_global_rank_and_the_rank_in_the_pipeline_group():
    ps = cases.params(2)
    x, t = cases.data(4)

    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))  # pp groups [0, 2], [1, 3]
        r = mesh.get_local_rank("pp")
        grads = {k: np.zeros_like(a) for k, a in ps[r].items()}
        fwd, bwd = cases.stage_fns(ps[r], grads)

        def forward(a):
            if meshkit.get_rank() == 3:
                raise FloatingPointError("nan in layer")
            return fwd(a)
        try:
            Schedule1F1B(PipelineStage(forward, bwd, r, 2, group=mesh["pp"]), 2, cases.loss_fn).step(
                x if r == 0 else None, target=t if r == 1 else None)
        except DistError as exc:
            return str(exc)
        return None

    texts = local.run(body, 4, timeout=30)
    assert texts[3] == ("meshkit.parallel: rank 3 (pp rank 1): pipeline stage 1: forward of microbatch 0 raised "
                        "FloatingPointError: nan in layer")
    assert texts[2] is None and "rank 3 (pp rank 1): pipeline stage 1: forward" in texts[1], texts


@pytest.mark.parametrize("differ, expected", [
    ("m", "rank 0 has n_microbatches=4 and rank 1 n_microbatches=2"),
    ("kind", "rank 0 has schedule='ScheduleGPipe' and rank 1 schedule='Schedule1F1B'"),
    ("stages", "rank 0 has num_stages=4 and rank 1 num_stages=6"),
])
def test_ranks_that_build_different_pipelines_fail_on_every_rank_at_the_first_step(differ, expected):
    x, t = cases.data(8)

    def body():
        r = meshkit.get_rank()
        v = 3 if differ == "stages" and r == 1 else 2
        ps = cases.params(2 * v)
        grads = {s: {k: np.zeros_like(a) for k, a in ps[s].items()} for s in range(2 * v)}
        stages = [PipelineStage(*cases.stage_fns(ps[s], grads[s]), s, 2 * v) for s in (r, r + 2, r + 4)[:v]]
        if differ == "stages":
            schedule = ScheduleInterleaved1F1B(stages, 2, cases.loss_fn)
            target_rank = (2 * v - 1) % 2
        else:
            stages = [PipelineStage(*cases.stage_fns(ps[r], grads[r]), r, 2)]
            kind = ScheduleGPipe if differ == "kind" and r == 0 else Schedule1F1B
            schedule, target_rank = kind(stages[0], 4 if differ == "m" and r == 0 else 2, cases.loss_fn), 1
        with pytest.raises(DistValueError) as exc:
            schedule.step(x if r == 0 else None, target=t if r == target_rank else None)
        return str(exc.value)

    start = time.monotonic()
    texts = local.run(body, 2, timeout=30)
    assert time.monotonic() - start < 10
    for r, text in enumerate(texts):
        assert text.startswith(f"meshkit.parallel: rank {r}: "), text
        assert (f".step: the ranks of the pipeline disagree: {expected}; every rank must build the same schedule "
                "with the same num_stages and n_microbatches") in text


@pytest.mark.parametrize("p, v", [(2, 1), (3, 1), (1, 2), (2, 2)])
def test_a_target_of_another_batch_than_x_fails_on_every_rank(p, v):
    """An x of 8 samples, target of 4, 4 microbatches: the loss's broadcasting (a (2, 5)
    output minus a (1, 5) target) would hide it; every rank raises at the first step."""
    x, t = cases.data(8)
    results, took = _steps(p, v, 4, x, [t[:4]])
    last = (p * v - 1) % p
    for r, result in enumerate(results):
        assert result == ("DistValueError", f"meshkit.parallel: rank {r}: "
                          f"{'ScheduleInterleaved1F1B' if v > 1 else 'Schedule1F1B'}.step: target has 4 samples along "
                          f"axis 0 (on rank {last}, the last stage's) but x has 8 (on rank 0, the first stage's); "
                          "each microbatch's target must be that microbatch's: pass a target of 8 samples"), result
    assert took < 10


def test_a_target_of_another_batch_at_a_later_step_fails_on_every_rank():
    x, t = cases.data(8)
    results, took = _steps(2, 1, 4, x, [t, t, t[:4]])
    assert results[1] == ("DistValueError", "meshkit.parallel: rank 1: Schedule1F1B.step: target has 4 samples along "
                          "axis 0 (on rank 1, the last stage's) but x had 8 at the first step (on rank 0, the first "
                          "stage's); each microbatch's target must be that microbatch's: pass a target of 8 samples")
    assert results[0][0] == "RankFailedError" and "rank 1: Schedule1F1B.step failed: DistValueError: " \
        "meshkit.parallel: rank 1: Schedule1F1B.step: target has 4 samples" in results[0][1], results[0]
    assert took < 10
    (first, last), _ = _steps(2, 1, 4, x, [t, t])  # the same target each step is fine
    assert first == [None, None] and [len(losses) for losses in last] == [4, 4], (first, last)


@pytest.mark.parametrize("change", ["shape", "dtype"])
@pytest.mark.parametrize("p, v", [(1, 2), (2, 1), (2, 2)])
def test_a_stage_that_changes_its_output_is_named_not_the_next_one(p, v, change):
    """Stage 0 changes its output at microbatch 1: with two stages on one rank (p=1) the activation
    goes through memory, and the next stage's matmul failed (shape) or took float32 (dtype)."""
    def make(s, q, g):
        fwd, bwd = cases.stage_fns(q, g)
        calls = []

        def forward(a):
            calls.append(1)
            y, ctx = fwd(a)
            if s == 0 and len(calls) == 2:
                y = y[:, :3] if change == "shape" else y.astype(np.float32)
            return y, ctx
        return forward, bwd

    x, t = cases.data(4)
    results, took = _steps(p, v, 2, x, [t], make)
    got = "(2, 3) and dtype float64" if change == "shape" else "(2, 5) and dtype float32"
    assert results[0] == ("PipelineError", f"meshkit.parallel: rank 0: pipeline stage 0: the output of microbatch 1 "
                          f"has shape {got}; the first microbatch's had (2, 5) and float64 (activations crossing a "
                          "stage boundary must keep their shape)"), results
    assert all(r is not None and "stage 0: the output of microbatch 1" in r[1] for r in results[1:]), results
    assert took < 10


def test_a_backward_whose_dx_is_unlike_the_input_is_named_on_one_rank_too():
    """Two stages on one rank: stage 1's dx goes to stage 0 through memory and is checked as a send is."""
    def make(s, q, g):
        fwd, bwd = cases.stage_fns(q, g)
        return fwd, (lambda ctx, dy: bwd(ctx, dy)[:, :2]) if s == 1 else bwd

    x, t = cases.data(4)
    (result,), _ = _steps(1, 2, 2, x, [t], make)
    assert result[0] == "PipelineError" and "pipeline stage 1: backward of microbatch 0 returned dx with shape " \
        "(2, 2) and dtype float64; the input had shape (2, 5) and dtype float64" in result[1], result


def test_a_forward_that_does_not_return_y_and_ctx_is_named():
    def make(r, p, g):
        fwd, bwd = cases.stage_fns(p, g)
        return (lambda x: fwd(x)[0]) if r == 0 else fwd, bwd

    results, took = _failing_run(2, make)
    assert results[0] == ("PipelineError", "meshkit.parallel: rank 0: pipeline stage 0: forward of microbatch 0 "
                                           "returned a ndarray; it must return (y, ctx), ctx being what its backward "
                                           "needs")
    assert results[1] is not None and took < 10


def test_a_forward_whose_output_is_not_an_array_is_named():
    def make(r, p, g):
        fwd, bwd = cases.stage_fns(p, g)
        return (lambda x: (fwd(x)[0].tolist(), None)) if r == 0 else fwd, bwd

    results, took = _failing_run(2, make)
    assert results[0] == ("PipelineError", "meshkit.parallel: rank 0: pipeline stage 0: forward of microbatch 0 "
                                           "returned y of type list; y must be a NumPy or CuPy array")
    assert results[1] is not None and took < 10


@pytest.mark.parametrize("bad, got", [
    (lambda d: d.sum(axis=0, keepdims=True), "d_output of shape (1, 5) and dtype float64"),  # would broadcast
    (lambda d: d.astype(np.float32), "d_output of shape (2, 5) and dtype float32"),
    (lambda d: d.tolist(), "d_output of type list; it must be an array like the output"),
], ids=["would-broadcast", "dtype", "list"])
def test_a_d_output_unlike_the_output_is_named(bad, got):
    def loss_fn(y, t):
        loss, d = cases.loss_fn(y, t)
        return loss, bad(d)

    results, took = _failing_run(2, lambda r, p, g: cases.stage_fns(p, g), loss_fn=loss_fn)
    assert results[1][0] == "PipelineError" and results[1][1].startswith(
        f"meshkit.parallel: rank 1: pipeline stage 1: loss_fn of microbatch 0 returned {got}"), results
    if "shape" in got:
        assert results[1][1].endswith("; the output has shape (2, 5) and dtype float64, and d_output (the loss's "
                                      "gradient with respect to it) must have the same")
    assert results[0] is not None and took < 10


def test_numpy_integers_are_accepted_for_the_stage_index_and_counts():
    ps = cases.params(2)
    x, t = cases.data(6)
    _, ref = cases.reference(ps, x, t)

    def body():
        r = meshkit.get_rank()
        grads = {k: np.zeros_like(a) for k, a in ps[r].items()}
        stage = PipelineStage(*cases.stage_fns(ps[r], grads), np.int64(r), np.int64(2))
        Schedule1F1B(stage, np.int64(3), cases.loss_fn).step(x if r == 0 else None, target=t if r == 1 else None)
        return grads, type(stage.stage_index), type(stage.num_stages)

    for r, (grads, *types_) in enumerate(local.run(body, 2)):
        assert types_ == [int, int]
        np.testing.assert_allclose(grads["w"], ref[r]["w"], rtol=1e-12)


def test_a_given_input_spec_is_checked_against_what_arrives():
    ps = cases.params(2)
    x, t = cases.data(4)

    def body(spec):
        r = meshkit.get_rank()
        grads = {k: np.zeros_like(a) for k, a in ps[r].items()}
        stage = PipelineStage(*cases.stage_fns(ps[r], grads), r, 2, input_spec=spec if r == 1 else None)
        try:
            Schedule1F1B(stage, 2, cases.loss_fn).step(x if r == 0 else None, target=t if r == 1 else None)
        except DistError as exc:
            return str(exc)
        return None

    assert local.run(lambda: body(((2, cases.WIDTH), "float64")), 2) == [None, None]
    texts = local.run(lambda: body(((2, 4), "float32")), 2, timeout=30)
    assert ("stage 1: the previous stage sends inputs of shape (2, 5) and dtype float64; input_spec says shape "
            "(2, 4) and dtype float32") in texts[1] and texts[0] is not None


def test_a_batch_that_does_not_split_is_refused_and_the_others_end():
    results, took = _failing_run(2, lambda r, p, g: cases.stage_fns(p, g), m=2, batch=5)
    assert results[0] == ("DistValueError", "meshkit.parallel: rank 0: Schedule1F1B.step: x has 5 samples along "
                                            "axis 0, which do not split into 2 equal microbatches; use a batch "
                                            "that is a multiple of 2")
    assert results[1] is not None and took < 10


def test_construction_errors_name_the_problem():
    def body():
        mesh2d = meshkit.init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "dp"))  # collective
        if meshkit.get_rank() != 0:  # construction is local: rank 0 tries every mistake
            return None
        fwd, bwd = cases.stage_fns(cases.params(1)[0], {})
        out = []
        for args, kw in [((fwd, bwd, 2, 2), {}), ((fwd, bwd, 1, 2), {}), ((fwd, bwd, 0, 3), {})]:
            with pytest.raises(DistValueError) as exc:
                PipelineStage(*args, **kw)
            out.append(str(exc.value))
        with pytest.raises(DistValueError, match=r"group must be a ProcessGroup or a 1-D mesh \(e.g. mesh\['pp'\]\), "
                                                 r"got a 2-D mesh \('pp', 'dp'\)"):
            PipelineStage(fwd, bwd, 0, 1, group=mesh2d)
        stage = PipelineStage(fwd, bwd, 0, 4)
        with pytest.raises(DistValueError, match="runs one stage per rank: num_stages 4 != the group's 2 ranks"):
            Schedule1F1B(stage, 2, cases.loss_fn)
        with pytest.raises(DistValueError, match="needs n_microbatches a multiple of the 2 pipeline ranks, got 3"):
            ScheduleInterleaved1F1B([stage, PipelineStage(fwd, bwd, 2, 4)], 3, cases.loss_fn)
        with pytest.raises(DistValueError, match=r"needs this rank's stages \[0, 2\] of 4, got \[0\]"):
            ScheduleInterleaved1F1B([stage], 2, cases.loss_fn)
        return out

    out = local.run(body, 2)[0]
    assert out[0] == ("meshkit.parallel: rank 0: PipelineStage: stage_index 2 is out of range for 2 stages "
                      "(valid: 0..1)")
    assert out[1] == ("meshkit.parallel: rank 0: PipelineStage: stage 1 of 2 lives on group rank 1 (stage i on "
                      "rank i % 2), not on this rank (group rank 0)")
    assert "num_stages must be a positive multiple of the group's 2 ranks, got 3" in out[2]


# --------------------------------------------------------------------------- real processes
def test_pipelines_under_meshkit_run(mpirun):
    out = mpirun("mpi_pipeline.py", 2).stdout
    assert out.count("pipeline OK") == 2 and out.count("failure ended the other stage") == 2, out
    assert out.count("target of another batch refused") == 2, out


def test_stages_that_return_their_buffers_under_meshkit_run(mpirun):
    # three ranks: a pass-through stage between two others (and in-place ones), every schedule
    out = mpirun("mpi_pipeline_aliasing.py", 3).stdout
    assert out.count(" OK") == 12 and "WRONG" not in out, out


# --------------------------------------------------------------------------- device arrays (tests/doubles/fake_cupy.py)
def _device_run(cupy, backend: str, kind: str):
    ps = cases.params(2)
    x, t = cases.data(4)

    def body():
        meshkit.init_process_group(backend, timeout=30)
        r = meshkit.get_rank()
        dp = {k: cupy.asarray(a) for k, a in ps[r].items()}
        grads = {k: cupy.zeros_like(a) for k, a in dp.items()}
        stage = PipelineStage(*cases.stage_fns(dp, grads), r, 2)

        def loss_fn(y, target):
            d = y - target
            return 0.0, d / y.shape[0]

        schedule = (ScheduleGPipe if kind == "gpipe" else Schedule1F1B)(stage, 2, loss_fn)
        try:
            schedule.step(cupy.asarray(x) if r == 0 else None, target=cupy.asarray(t) if r == 1 else None)
        except DistError as exc:
            return str(exc)
        return {k: g.get() for k, g in grads.items()}

    return local.run(body, 2, init=False, timeout=60), cases.reference(ps, x, t)[1]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_device_arrays_through_the_host_engine_match_one_process(cupy, kind):
    results, ref = _device_run(cupy, "local", kind)
    for r, grads in enumerate(results):
        assert isinstance(grads, dict), grads
        for k in grads:
            np.testing.assert_allclose(grads[k], ref[r][k], rtol=1e-12, atol=1e-14)


def test_device_arrays_over_nccl_are_refused_on_every_stage(cupy):
    results, _ = _device_run(cupy, "nccl", "1f1b")
    assert all(isinstance(t, str) for t in results), results
    assert "device arrays cannot cross pipeline stages over the NCCL engine yet" in results[0], results
