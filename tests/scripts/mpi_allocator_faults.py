"""One rank of examples/mlp.py's FSDP (hidden 512,512,512, AdamW): prints the minor page faults of
its steady-state steps (after a warm-up), which meshkit-run's malloc settings keep low."""

import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import meshkit  # noqa: E402
import mlp  # noqa: E402

meshkit.init_process_group("mpi", timeout=60)
model = mlp.build(sys.argv[1], hidden=(512, 512, 512), optimizer="adamw", lr=1e-3)
x, y = mlp.make_data(256)


def step() -> None:
    model.zero_grad()
    acts = mlp.forward_layers(model, x)
    _, dlogits = mlp.loss_and_grad_logits(acts[-1], y)
    mlp.backward_layers(model, acts, dlogits)
    model.step()


for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print("faults per step:", (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
meshkit.destroy_process_group()
