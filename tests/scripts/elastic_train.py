"""An example run under ``meshkit-run --max-restarts``, with a fault on its first attempt.

    meshkit-run -n 4 --max-restarts 1 elastic_train.py EXAMPLE.py EXAMPLE-ARGS...

The example (``examples/train_mlp.py`` or ``train_3d.py``) runs as its own ``__main__``, unchanged;
this wrapper only arms a fault, from the environment, on the attempts it names
(``MESHKIT_RESTART_COUNT``), so one job can be killed differently on successive attempts:

* ``ELASTIC_FAULT=FAULTS[,FAULTS...]``: the first FAULTS are armed on attempt 0, the second on
  attempt 1, and so on (an attempt past the list runs unharmed); FAULTS is one FAULT or several
  joined by ``+``, all armed on that attempt (``meshkit-run --survive`` loses several ranks in one
  attempt). R is the rank as launched (``RANK``: under ``--survive`` a survivor keeps it, whatever
  its number in the shrunk world). A FAULT is one of:

  * ``step:R:S``: SIGKILL rank R right after training step S (its distributed training only: the
    single-process reference of ``--check`` trains through the same loop);
  * ``bucket:R:S``: SIGKILL rank R in step S's backward pass, 50 ms after it handed over its second
    gradient, so the others are inside a gradient reduction: a DDP/ZeRO bucket's all-reduce (with
    a small ``--bucket-cap-mb``) or an FSDP unit's reduce-scatter;
  * ``save:R:S``: SIGKILL rank R in the middle of saving the checkpoint of step S: its data file
    written, its marker not (so that checkpoint can never commit);
  * ``vanish:R:S``: after step S, SIGKILL rank R's watcher and then rank R: the process vanishes
    without anyone reporting how; the time of the kill goes to ``$ELASTIC_LOG/killed``;
  * ``recovery:R:N``: SIGKILL rank R in its N-th recovery (``survive.shrink``, counted from 1),
    right after the world shrank: the other survivors are in the recovery's state exchange; R a
    spare of ``meshkit-run --spares`` (as launched): its join counts as a recovery, and it is
    killed once the survivors told it which exchange follows;
  * ``spare:R:S``: after step S, rank 0 (as launched) SIGKILLs process R, an idle spare of
    ``meshkit-run --spares`` (it runs no code of the script: its pid is read from the launcher's
    status directory), and waits half a second for the other spares to notice;
* ``ELASTIC_SHRINK=PATH:N[,N...]``: rank 0 of attempt a rewrites the host file PATH to the a-th N
  slots of this host (the launcher read it before this attempt; the restart reads it again);
* ``ELASTIC_LOG=DIR``: every rank of every attempt writes ``attempt-{a}.rank-{r}`` (its pid and
  the attempt's world size) and fails if a process of an earlier attempt is still alive.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time
from pathlib import Path

attempt = int(os.environ["MESHKIT_RESTART_COUNT"])
rank = int(os.environ["RANK"])
example = Path(sys.argv[1]).resolve()
sys.argv = [str(example), *sys.argv[2:]]
sys.path.insert(0, str(example.parent))

log = os.environ.get("ELASTIC_LOG")
if log:
    for earlier in Path(log).glob("attempt-*.rank-[0-9]"):
        pid = int(earlier.read_text().split()[0])
        if int(earlier.name.split(".")[0].split("-")[1]) < attempt and Path(f"/proc/{pid}").exists():
            status = Path(f"/proc/{pid}/status").read_text()
            if "\nState:\tZ" not in status:  # a zombie is over; only its parent has not reaped it yet
                raise SystemExit(f"attempt {attempt} started while {earlier.name} (pid {pid}) is still alive")
    record = Path(log, f"attempt-{attempt}.rank-{rank}")
    Path(f"{record}.part").write_text(f"{os.getpid()} {os.environ['WORLD_SIZE']}")
    os.replace(f"{record}.part", record)  # whole: another rank reads it at its start

shrink = os.environ.get("ELASTIC_SHRINK")
if shrink and rank == 0:
    path, _, sizes = shrink.rpartition(":")
    if attempt < len(sizes.split(",")):
        Path(path).write_text(f"localhost:{sizes.split(',')[attempt]}\n")


def _die(vanish: bool = False) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    if vanish:
        Path(log or ".", "killed").write_text(str(time.time_ns()))
        os.kill(os.getppid(), signal.SIGKILL)  # the watcher first: nobody is left to say how the rank ended
    os.kill(os.getpid(), signal.SIGKILL)


def _distributed(model) -> bool:
    return type(model).__name__ != "LocalStrategy"  # --check's single-process reference is not harmed


attempts = [f for f in os.environ.get("ELASTIC_FAULT", "").split(",") if f]
faults = [f.split(":") for f in attempts[attempt].split("+")] if attempt < len(attempts) else []
mine = [(kind, int(at)) for kind, victim, at in faults if int(victim) == rank and kind != "spare"]
after_steps = {at: kind for kind, at in mine if kind in ("step", "vanish")}
spares_killed = {int(at): int(victim) for kind, victim, at in faults if kind == "spare"} if rank == 0 else {}
after_steps.update({at: "spare" for at in spares_killed})
bucket_steps = {at for kind, at in mine if kind == "bucket"}
save_steps = {at for kind, at in mine if kind == "save"}
recoveries = {at for kind, at in mine if kind == "recovery"}
if after_steps or bucket_steps:
    import loop  # the examples' one training loop (beside them)
    import mlp  # the examples' model (beside them)

    train, backward_layers, current = loop.train, mlp.backward_layers, [None]

    def train_then_die(model, steps, run_pass, *, after_step=None, **options):
        if not _distributed(model):
            return train(model, steps, run_pass, after_step=after_step, **options)

        def tracked(model, step):
            current[0] = step
            return run_pass(model, step)

        def after(done: int) -> None:
            if after_step is not None:
                after_step(done)
            if done in spares_killed:
                victim = spares_killed.pop(done)
                start = Path(os.environ["MESHKIT_LAUNCH_STATUS_DIR"], f"start.{victim}").read_text().split()
                print(f"elastic_train: killing the idle spare {victim} after step {done}", flush=True)
                os.kill(int(start[0]), signal.SIGKILL)
                time.sleep(0.5)
            elif done in after_steps:
                print(f"elastic_train: killing rank {rank} after step {done}", flush=True)
                _die(vanish=after_steps[done] == "vanish")
        return train(model, steps, tracked, after_step=after, **options)

    def backward_then_die(model, acts, dlogits, on_grad=None, **options):
        if current[0] not in bucket_steps or not _distributed(model):
            return backward_layers(model, acts, dlogits, on_grad, **options)
        handed = []

        def mark(name, grad):
            (on_grad or model.mark_grad_ready)(name, grad)
            handed.append(name)
            if len(handed) == 2:
                time.sleep(0.05)  # the others are in the reduction this gradient started
                print(f"elastic_train: killing rank {rank} inside step {current[0]}'s gradient reduction",
                      flush=True)
                _die()
        return backward_layers(model, acts, dlogits, mark, **options)

    loop.train, mlp.backward_layers = train_then_die, backward_then_die
if save_steps:
    from meshkit.checkpoint import writer  # a test reaches inside to kill at the exact point

    write_chunks = writer.write_chunks

    def write_then_die(tmp, r, chunks):
        records = write_chunks(tmp, r, chunks)
        at_step = next((s for s in save_steps if Path(tmp).name.startswith(f".step_{s}.tmp-")), None)
        if at_step is not None:
            print(f"elastic_train: killing rank {rank} inside the save of step {at_step}", flush=True)
            _die()
        return records

    writer.write_chunks = write_then_die

if recoveries:
    from meshkit.parallel import survive  # a test reaches inside to kill at the exact point

    shrink_world, seen = survive.shrink_world, [0]

    def shrink_then_die(*args, **kwargs):
        shrunk = shrink_world(*args, **kwargs)
        seen[0] += 1
        if seen[0] in recoveries:
            print(f"elastic_train: killing rank {rank} in its recovery {seen[0]}, the world shrunk", flush=True)
            _die()
        return shrunk

    survive.shrink_world = shrink_then_die
    spare_joined = survive.spare_joined

    def join_then_die(*args, **kwargs):
        spare_joined(*args, **kwargs)
        seen[0] += 1
        if seen[0] in recoveries:
            print(f"elastic_train: killing rank {rank} (a spare) in its join, recovery {seen[0]}", flush=True)
            _die()

    survive.spare_joined = join_then_die

runpy.run_path(str(example), run_name="__main__")
