"""An example run under ``meshkit-run --max-restarts``, with a fault on its first attempt.

    meshkit-run -n 4 --max-restarts 1 elastic_train.py EXAMPLE.py EXAMPLE-ARGS...

The example (``examples/train_mlp.py`` or ``train_3d.py``) runs as its own ``__main__``, unchanged;
this wrapper only arms a fault, from the environment, on the attempts it names
(``MESHKIT_RESTART_COUNT``), so one job can be killed differently on successive attempts:

* ``ELASTIC_FAULT=FAULT[,FAULT...]``: the first FAULT is armed on attempt 0, the second on
  attempt 1, and so on (an attempt past the list runs unharmed). A FAULT is one of:

  * ``step:R:S``: SIGKILL rank R right after training step S (its first training loop only: the
    single-process reference of ``--check`` trains through the same loop);
  * ``save:R:S``: SIGKILL rank R in the middle of saving the checkpoint of step S: its data file
    written, its marker not (so that checkpoint can never commit);
  * ``vanish:R:S``: after step S, SIGKILL rank R's watcher and then rank R: the process vanishes
    without anyone reporting how; the time of the kill goes to ``$ELASTIC_LOG/killed``;
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


faults = [f for f in os.environ.get("ELASTIC_FAULT", "").split(",") if f]
if attempt < len(faults):
    kind, victim, at = faults[attempt].split(":")
    victim_rank, at_step = int(victim), int(at)
    if kind in ("step", "vanish") and rank == victim_rank:
        import loop  # the examples' one training loop (beside them)

        train, armed = loop.train, [True]

        def train_then_die(model, steps, run_pass, *, after_step=None, **options):
            first, armed[0] = armed[0], False  # the distributed run; --check's reference comes later

            def after(done: int) -> None:
                if after_step is not None:
                    after_step(done)
                if first and done == at_step:
                    print(f"elastic_train: killing rank {rank} after step {done}", flush=True)
                    _die(vanish=kind == "vanish")
            return train(model, steps, run_pass, after_step=after, **options)

        loop.train = train_then_die
    elif kind == "save" and rank == victim_rank:
        from meshkit.checkpoint import writer  # a test reaches inside to kill at the exact point

        write_chunks = writer.write_chunks

        def write_then_die(tmp, r, chunks):
            records = write_chunks(tmp, r, chunks)
            if Path(tmp).name.startswith(f".step_{at_step}.tmp-"):
                print(f"elastic_train: killing rank {rank} inside the save of step {at_step}", flush=True)
                _die()
            return records

        writer.write_chunks = write_then_die

runpy.run_path(str(example), run_name="__main__")
