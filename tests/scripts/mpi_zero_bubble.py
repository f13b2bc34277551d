"""Zero-bubble schedules on real processes: ZB-H1 and ZB-V against one process, a weight tied
between the first and the last stage counted once, and a stage without the split backward
refused on every rank (no hang)."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import pipeline_cases as cases  # noqa: E402

import meshkit  # noqa: E402
from meshkit.comm import DistValueError  # noqa: E402
from meshkit.parallel import PipelineStage, ScheduleZBH1, ScheduleZBVZeroBubble  # noqa: E402

meshkit.init_process_group("mpi", timeout=30)
r, p = meshkit.get_rank(), meshkit.get_world_size()


def run(kind, m, tied=False, steps=1):
    n = 2 * p if kind == "zbv" else p
    ps = cases.params(n)
    if tied:
        ps[n - 1]["w"] = ps[0]["w"]
    x, t = cases.data(2 * m)
    mine = [r, 2 * p - 1 - r] if kind == "zbv" else [r]
    grads = {s: {k: np.zeros_like(a) for k, a in ps[s].items()} for s in mine}
    if tied and 0 in mine and n - 1 in mine:
        grads[n - 1]["w"] = grads[0]["w"]
    stages = [cases.split_stage(ps[s], grads[s], s, n, placement="v" if kind == "zbv" else "loop",
                                shared={"tied": grads[s]["w"]} if tied and s in (0, n - 1) else None) for s in mine]
    schedule = (ScheduleZBVZeroBubble(stages, m, cases.loss_fn) if kind == "zbv" else
                ScheduleZBH1(stages[0], m, cases.loss_fn))
    for _ in range(steps):
        losses = schedule.step(x if 0 in mine else None, target=t if n - 1 in mine else None)
    ref_loss, ref = cases.reference(ps, x, t)
    for s in mine:
        want = dict(ref[s])
        if tied and s in (0, n - 1):
            want["w"] = ref[0]["w"] + ref[n - 1]["w"]
        for k in grads[s]:
            np.testing.assert_allclose(grads[s][k], steps * want[k], rtol=1e-12, atol=1e-14)
    if losses is not None:
        assert abs(np.mean(losses) - ref_loss) <= 1e-12 * abs(ref_loss)


for kind, m in [("zbh1", 2), ("zbh1", 7), ("zbv", 1), ("zbv", 4), ("zbv", 7)]:
    run(kind, m)
print("zero bubble OK", flush=True)
run("zbv", 5, tied=True, steps=2)
run("zbh1", 4, tied=True)
print("tied OK", flush=True)

ps = cases.params(p)
g = {k: np.zeros_like(a) for k, a in ps[r].items()}
stage = (PipelineStage(*cases.stage_fns(ps[r], g), r, p) if r == p - 1 else cases.split_stage(ps[r], g, r, p))
try:
    ScheduleZBH1(stage, 2, cases.loss_fn).step(cases.data(4)[0] if r == 0 else None,
                                               target=cases.data(4)[1] if r == p - 1 else None)
except DistValueError as exc:
    assert f"but stage {p - 1} (on rank {p - 1}) has a single backward" in str(exc), exc
    print("unsplit refused", flush=True)

meshkit.destroy_process_group()
