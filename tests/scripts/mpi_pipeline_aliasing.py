"""Stages that return the buffers the pipeline gave them (an identity layer's ``y = x`` and ``dx =
dy``, a backward writing ``dx`` into its saved input), on real processes: messages large enough
for MPI's rendezvous protocol (the data moves when the receiver takes it) and a slow first stage,
so that a buffer reused while its send is in flight would corrupt the gradients."""

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import pipeline_cases as cases  # noqa: E402

import meshkit  # noqa: E402
from meshkit.parallel import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B  # noqa: E402

meshkit.init_process_group("mpi", timeout=60)
r, p = meshkit.get_rank(), meshkit.get_world_size()
wrong = 0
for kind, v, m in [("gpipe", 1, 4), ("1f1b", 1, 4), ("interleaved", 2, p), ("interleaved", 2, 2 * p)]:
    n = p * v
    kinds = ["scale"] + [("pass", "inplace", "scale")[(s - 1) % 3] for s in range(1, n)]
    ws = [1.0 if k == "pass" else 0.5 + 0.25 * s for s, k in enumerate(kinds)]
    rng = np.random.default_rng(0)
    x, t = rng.standard_normal((32 * m, 1024)), rng.standard_normal((32 * m, 1024))  # 256 KB per microbatch
    mine = [r + i * p for i in range(v)]
    grads = {s: np.zeros(1) for s in mine}

    def stage(s):
        fwd, bwd = cases.scale_stage(kinds[s], ws[s], grads[s])

        def slow_backward(ctx, dy):
            time.sleep(0.05 if s == 0 else 0)  # the first stage takes its gradients late
            return bwd(ctx, dy)
        return PipelineStage(fwd, slow_backward, s, n)

    stages = [stage(s) for s in mine]
    schedule = (ScheduleInterleaved1F1B(stages, m, cases.loss_fn) if kind == "interleaved" else
                (Schedule1F1B if kind == "1f1b" else ScheduleGPipe)(stages[0], m, cases.loss_fn))
    schedule.step(x if r == 0 else None, target=t if (n - 1) % p == r else None)
    ref = cases.scale_reference(ws, x, t)
    bad = [(s, kinds[s], grads[s][0], ref[s]) for s in mine
           if kinds[s] != "pass" and not abs(grads[s][0] - ref[s]) <= 1e-10 * abs(ref[s])]
    print(f"aliasing {kind} m={m} " + (f"WRONG (stage, kind, gradient, reference): {bad}" if bad else "OK"), flush=True)
    wrong += bool(bad)
meshkit.destroy_process_group()
sys.exit(1 if wrong else 0)
