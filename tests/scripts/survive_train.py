"""DDP (or ``SURVIVE_STRATEGY``) training of examples/mlp.py's MLP under ``meshkit-run --survive K``, with rank failures.

    meshkit-run -n 4 --survive 2 survive_train.py FAULT [FAULT ...]

Each FAULT (on the job's first attempt only) is ``KIND:R:S``, R a rank of the world at that moment (ranks are renumbered after a
shrink) and S a step: ``step`` os._exit's rank R as step S starts; ``kill`` SIGKILLs it there;
``bucket`` SIGKILLs it in step S's backward pass, after its first gradient was handed over, so
the others are inside a bucket's all-reduce. The loop is the documented pattern: on
RankFailedError, ``survive.shrink`` and redo the step it returns. At the end rank 0 compares the
parameters with single-process training (float64, 1e-10) and prints each recovery by phase:
detection (the death, whose time the dying rank leaves in ``$SURVIVE_DIR``, to this rank's
RankFailedError), shrink (revoke, ULFM's Shrink and agreement, the new world), state (agreeing
on the source, its broadcast, the new DDP, its load) and redo (the step done again).
``SURVIVE_STRATEGY`` (default ddp) picks mlp.build's strategy, ``SURVIVE_STEPS`` (default 12) and ``SURVIVE_HIDDEN`` (default 64) size the run.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import mlp  # noqa: E402

import meshkit  # noqa: E402
from meshkit.comm import RankFailedError  # noqa: E402
from meshkit.parallel import LocalStrategy, survive  # noqa: E402

STEPS, SAMPLES, BATCH, LR = int(os.environ.get("SURVIVE_STEPS", "12")), 240, 120, 0.05
HIDDEN = (int(os.environ.get("SURVIVE_HIDDEN", "64")),) * 2
LOG = os.environ.get("SURVIVE_DIR")
STRATEGY = os.environ.get("SURVIVE_STRATEGY", "ddp")  # ddp, zero1, zero2, fsdp or hsdp (mlp.STRATEGIES)
# on the first attempt only: past --survive K, a restart (--max-restarts) trains without them
faults = [(k, int(r), int(s)) for k, r, s in (f.split(":") for f in sys.argv[1:])
          if os.environ.get("MESHKIT_RESTART_COUNT", "0") == "0"]


def die(kind: str) -> None:
    sys.stdout.flush()
    if LOG:
        Path(LOG, "died").write_text(repr(time.time()))
    if kind == "step":
        os._exit(9)
    os.kill(os.getpid(), signal.SIGKILL)


def build():
    world = meshkit.get_world_size()
    if STRATEGY == "hsdp":  # hsdp's mesh adapts as train_mlp's default does: 2 x N/2 for an even N, else 1 x N
        return mlp.build("hsdp", hidden=HIDDEN, optimizer="adamw", lr=LR,
                         hsdp_mesh=(2, world // 2) if world % 2 == 0 else (1, world))
    return mlp.build(STRATEGY, hidden=HIDDEN, optimizer="adamw", lr=LR,
                     **({} if STRATEGY == "fsdp" else {"bucket_cap_mb": 0.01}))


def run_step(model, step: int, x, y) -> None:
    rank, world = meshkit.get_rank(), meshkit.get_world_size()
    fault = next((f for f in faults if f[2] == step and f[1] == rank), None)
    if fault is not None and fault[0] in ("step", "kill"):
        die(fault[0])
    model.zero_grad()
    idx = np.array_split(mlp.batch_indices(step, SAMPLES, BATCH), world)[rank]
    acts = mlp.forward_layers(model, x[idx])
    _, dlogits = mlp.loss_and_grad_logits(acts[-1], y[idx])
    marked = []

    def on_grad(name, grad):
        marked.append(name)
        model.mark_grad_ready(name, grad)
        if fault is not None and fault[0] == "bucket" and len(marked) == 2:
            time.sleep(0.05)  # the others' first bucket is in its all-reduce
            die("kill")

    mlp.backward_layers(model, acts, dlogits, on_grad=on_grad)
    model.step()


meshkit.init_process_group("mpi")
# whether each rank leads a session of its own: the rank bootstrap's setsid gives one under MPICH's
# hydra, but not under --survive, where ranks stay in prterun's session (their own cost every step)
print(f"survive_train: rank {meshkit.get_rank()} leads its session: {os.getsid(0) == os.getpid()}", flush=True)
x, y = mlp.make_data(SAMPLES)
model = build()
step, recoveries, redo = 0, [], None
meshkit.barrier()
started = time.perf_counter()
while step < STEPS:
    try:
        run_step(model, step, x, y)
        step += 1
        if redo is not None:  # the first step completed after a recovery
            recoveries[-1].append(time.time() - redo)
            redo = None
    except RankFailedError as exc:
        failed_at = time.time()
        at = step
        model, step = survive.shrink(model, build)  # faults for later steps name ranks of the shrunk world
        # the dead stay dead: the agreed set (a survivor sharing no group with the dead, as in hsdp, was
        # woken by the revoke, its RankFailedError naming no rank)
        faults = [f for f in faults if f[2] > at or f[1] not in survive.last_recovery().world.failed]
        redo = time.time()
        died = float(Path(LOG, "died").read_text()) if LOG else failed_at
        recoveries.append([exc.failed_ranks, survive.last_recovery(), failed_at - died])
elapsed = time.perf_counter() - started
final = model.full_state_dict()["model"]

if meshkit.get_rank() == 0:
    ref = LocalStrategy(mlp.init_params(HIDDEN), optimizer=mlp.make_optimizer("adamw", LR))
    for s in range(STEPS):
        ref.zero_grad()
        idx = mlp.batch_indices(s, SAMPLES, BATCH)
        acts = mlp.forward_layers(ref, x[idx])
        _, dl = mlp.loss_and_grad_logits(acts[-1], y[idx])
        mlp.backward_layers(ref, acts, dl)
        ref.step()
    diff = max(float(np.max(np.abs(final[k] - ref.params[k]))) for k in ref.params)
    for dead, r, detection, *redone in recoveries:
        again = redone[0] if redone else float("nan")
        print(f"recovered from the loss of {list(dead)}: failure -> next step {detection + r.shrink + r.state + again:.4f} s "
              f"= detection {detection:.4f} + shrink {r.shrink:.4f} + state {r.state:.4f} + redo {again:.4f}; "
              f"redo from step {r.step} (source rank {r.source}), world {r.world.old_size} -> {r.world.size}")
    print(f"{STEPS} steps in {elapsed:.3f} s ({elapsed / STEPS * 1e3:.2f} ms a step)")
    print(f"survived {len(recoveries)} failure(s); world {meshkit.get_world_size()}; max |diff| {diff:.3g}")
    assert diff < 1e-10, diff
meshkit.destroy_process_group()
