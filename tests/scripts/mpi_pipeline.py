"""Pipelines on real processes: 1F1B, GPipe and interleaved 1F1B against one process, then a
stage whose forward raises: both ranks end with an error (no hang)."""

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import pipeline_cases as cases  # noqa: E402

import meshkit  # noqa: E402
from meshkit.comm import DistError  # noqa: E402
from meshkit.parallel import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B  # noqa: E402

meshkit.init_process_group("mpi", timeout=30)
r, p = meshkit.get_rank(), meshkit.get_world_size()
for kind, v, m in [("1f1b", 1, 5), ("gpipe", 1, 3), ("interleaved", 2, 4)]:
    ps = cases.params(p * v)
    x, t = cases.data(2 * m)
    mine = [r + i * p for i in range(v)]
    grads = {s: {k: np.zeros_like(a) for k, a in ps[s].items()} for s in mine}
    stages = [PipelineStage(*cases.stage_fns(ps[s], grads[s]), s, p * v) for s in mine]
    schedule = (ScheduleInterleaved1F1B(stages, m, cases.loss_fn) if kind == "interleaved" else
                (Schedule1F1B if kind == "1f1b" else ScheduleGPipe)(stages[0], m, cases.loss_fn))
    losses = schedule.step(x if r == 0 else None, target=t if (p * v - 1) % p == r else None)
    ref_loss, ref = cases.reference(ps, x, t)
    for s in mine:
        for k in grads[s]:
            np.testing.assert_allclose(grads[s][k], ref[s][k], rtol=1e-12, atol=1e-14)
    if losses is not None:
        assert abs(np.mean(losses) - ref_loss) <= 1e-12 * abs(ref_loss)
print("pipeline OK", flush=True)

# a target of another batch than x: refused on every rank at the first step, at once
x, t = cases.data(8)
ps = cases.params(p)
grads = {k: np.zeros_like(a) for k, a in ps[r].items()}
start = time.monotonic()
try:
    Schedule1F1B(PipelineStage(*cases.stage_fns(ps[r], grads), r, p), 4, cases.loss_fn).step(
        x if r == 0 else None, target=t[:4] if r == p - 1 else None)
except DistError as exc:
    assert "target has 4 samples along axis 0" in str(exc) and "but x has 8" in str(exc), exc
    assert time.monotonic() - start < 10
    print("target of another batch refused", flush=True)

# a stage that fails: every rank ends with an error, quickly
ps = cases.params(p)
grads = {k: np.zeros_like(a) for k, a in ps[r].items()}
fwd, bwd = cases.stage_fns(ps[r], grads)


def broken(x):
    if r == p - 1:
        raise RuntimeError("boom")
    return fwd(x)


group = meshkit.new_group(list(range(p)))  # the world's ranks: the world group itself, which the failure breaks
start = time.monotonic()
try:
    Schedule1F1B(PipelineStage(broken, bwd, r, p, group=group), 2, cases.loss_fn).step(
        cases.data(4)[0] if r == 0 else None, target=cases.data(4)[1] if r == p - 1 else None)
except DistError as exc:
    assert "raised RuntimeError: boom" in str(exc), exc
    assert time.monotonic() - start < 10
    print("failure ended the other stage", flush=True)

meshkit.destroy_process_group()
