"""A loop written without ``survive.start`` (``model = build()`` at the top), under ``--spares``: the
spare that takes a lost rank's place must fail at its first collective, naming the call it skipped,
not run ``build()`` against the survivors' recovery exchange (mismatched collectives)."""

import os
import signal
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import mlp  # noqa: E402

import meshkit  # noqa: E402
from meshkit.comm import RankFailedError  # noqa: E402
from meshkit.parallel import survive  # noqa: E402

meshkit.init_process_group("mpi")
x, y = mlp.make_data(240)


def build():
    return mlp.build("ddp", hidden=(32, 32), optimizer="sgd", lr=0.05)


model, step = build(), 0  # (the documented loop: model, step = survive.start(build))
while step < 6:
    try:
        if step == 3 and os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        rank, world = meshkit.get_rank(), meshkit.get_world_size()
        model.zero_grad()
        idx = np.array_split(mlp.batch_indices(step, 240, 120), world)[rank]
        acts = mlp.forward_layers(model, x[idx])
        _, dl = mlp.loss_and_grad_logits(acts[-1], y[idx])
        mlp.backward_layers(model, acts, dl)
        model.step()
        step += 1
    except RankFailedError:
        model, step = survive.shrink(model, build)
print(f"done on {meshkit.get_world_size()} ranks", flush=True)
meshkit.destroy_process_group()
