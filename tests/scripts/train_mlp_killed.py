"""examples/train_mlp.py whose rank 1 dies (os._exit, like kill -9) in step K: argv K then the
example's flags."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import meshkit  # noqa: E402
import mlp  # noqa: E402
import train_mlp  # noqa: E402

die_at = int(sys.argv.pop(1))
calls = 0
real = mlp.loss_and_grad_logits


def loss_and_grad_logits(logits, y):
    global calls
    calls += 1
    if calls == die_at and meshkit.get_rank() == 1:
        print(f"rank 1 dies in step {die_at}", flush=True)
        os._exit(9)
    return real(logits, y)


mlp.loss_and_grad_logits = loss_and_grad_logits
sys.exit(train_mlp.main(sys.argv[1:]))
