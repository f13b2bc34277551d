"""Train a NumPy MLP classifier with data parallelism on meshkit.

    meshkit-run -n 4 examples/train_mlp.py                 # DDP, 200 steps, progress bar
    meshkit-run -n 4 examples/train_mlp.py --check         # ... and compare with one process
    python examples/train_mlp.py --steps 50                # a world of one

The model is a tanh MLP with a softmax cross-entropy loss and a hand-written backward pass that
runs layer by layer, from the last to the first, marking each layer's gradients ready as soon
as they are computed, so DDP averages the last layers' buckets while earlier layers are still
differentiating. Data is synthetic (a fixed random "teacher" network labels Gaussian inputs)
and made in the script. Every step draws the same global batch on every rank (the same seed),
and each rank trains on its contiguous share, so the run is comparable, step for step, with
single-process training on the global batch: ``--check`` does exactly that and compares the
final parameters (float64: to 1e-10).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

import numpy as np

import meshkit
from meshkit.parallel import AdamW, DistributedDataParallel, Optimizer, SGD

FEATURES, CLASSES = 20, 4


def make_data(samples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian inputs labelled by a fixed random teacher network (a learnable, non-linear task)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, FEATURES))
    teacher = rng.standard_normal((FEATURES, 32)), rng.standard_normal((32, CLASSES))
    y = np.argmax(np.tanh(x @ teacher[0]) @ teacher[1], axis=1)
    return x, y


def init_params(hidden: tuple[int, ...] = (64, 64), dtype: Any = np.float64, seed: int = 1) -> dict[str, np.ndarray]:
    """``w0, b0, w1, b1, ...`` in forward order (Xavier-scaled weights, zero biases)."""
    rng = np.random.default_rng(seed)
    sizes = (FEATURES, *hidden, CLASSES)
    params: dict[str, np.ndarray] = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"w{i}"] = (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(dtype)
        params[f"b{i}"] = np.zeros(fan_out, dtype)
    return params


def layers(params: dict[str, Any]) -> int:
    return sum(1 for name in params if name.startswith("w"))


def forward(params: dict[str, Any], x: Any) -> list[Any]:
    """Activations of every layer (input first; the last entry is the logits)."""
    acts = [x.astype(params["w0"].dtype)]
    n = layers(params)
    for i in range(n):
        z = acts[-1] @ params[f"w{i}"] + params[f"b{i}"]
        acts.append(np.tanh(z) if i < n - 1 else z)
    return acts


def loss_and_grad_logits(logits: Any, y: Any) -> tuple[float, Any]:
    """Mean softmax cross-entropy and its gradient with respect to the logits."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(shifted)
    probs /= probs.sum(axis=1, keepdims=True)
    rows = np.arange(len(y))
    loss = float(-np.log(probs[rows, y]).mean())
    probs[rows, y] -= 1
    return loss, probs / len(y)


def backward(params: dict[str, Any], acts: list[Any], dlogits: Any, on_grad: Callable[[str, Any], None]) -> None:
    """Back-propagate layer by layer, calling ``on_grad(name, grad)`` as each gradient is final."""
    delta = dlogits
    for i in reversed(range(layers(params))):
        on_grad(f"w{i}", acts[i].T @ delta)
        on_grad(f"b{i}", delta.sum(axis=0))
        if i:
            delta = (delta @ params[f"w{i}"].T) * (1 - acts[i] ** 2)


def batch_indices(step: int, samples: int, batch: int) -> np.ndarray:
    """The global batch of a step: the same on every rank."""
    return np.random.default_rng(1000 + step).choice(samples, size=batch, replace=False)


def make_optimizer(name: str, lr: float) -> Optimizer:
    if name == "adamw":
        return AdamW(lr=lr, weight_decay=0.01)
    return SGD(lr=lr, momentum=0.9)


def train_reference(args: argparse.Namespace) -> tuple[dict[str, np.ndarray], list[float]]:
    """Single-process training on the global batch: what every strategy must reproduce."""
    x, y = make_data(args.samples)
    params = init_params(dtype=np.dtype(args.dtype))
    opt = make_optimizer(args.optimizer, args.lr)
    losses = []
    for step in range(args.steps):
        idx = batch_indices(step, args.samples, args.batch)
        acts = forward(params, x[idx])
        loss, dlogits = loss_and_grad_logits(acts[-1], y[idx])
        grads: dict[str, np.ndarray] = {}
        backward(params, acts, dlogits, grads.__setitem__)
        opt.step(params, grads)
        losses.append(loss)
    return params, losses


def train_ddp(args: argparse.Namespace, comm_hook: Any = None, comm_state: Any = None,
              progress: bool = True) -> tuple[dict[str, np.ndarray], list[float]]:
    """DDP training: each rank takes its share of every global batch."""
    rank, world = meshkit.get_rank(), meshkit.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must divide evenly over {world} ranks")
    x, y = make_data(args.samples)
    mesh = meshkit.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    ddp = DistributedDataParallel(init_params(dtype=np.dtype(args.dtype)), mesh=mesh, comm_hook=comm_hook,
                                  comm_state=comm_state, bucket_cap_mb=args.bucket_cap_mb,
                                  first_bucket_cap_mb=min(1.0, args.bucket_cap_mb))
    opt = make_optimizer(args.optimizer, args.lr)
    losses = []
    bar = _progress(args.steps, enabled=progress and rank == 0)
    for step in range(args.steps):
        idx = np.array_split(batch_indices(step, args.samples, args.batch), world)[rank]
        ddp.zero_grad()
        acts = forward(ddp.params, x[idx])
        loss, dlogits = loss_and_grad_logits(acts[-1], y[idx])
        backward(ddp.params, acts, dlogits, lambda name, g: ddp.mark_grad_ready(name, g))
        ddp.finish_gradient_sync()
        opt.step(ddp.params, ddp.grads)
        global_loss = np.array([loss])
        meshkit.all_reduce(global_loss, meshkit.ReduceOp.AVG)
        losses.append(float(global_loss[0]))
        bar(losses[-1])
    return ddp.params, losses


def _progress(total: int, enabled: bool) -> Callable[[float], None]:
    """A tqdm bar showing the loss (a log line every 10% without tqdm); a no-op when disabled."""
    if not enabled:
        return lambda loss: None
    try:
        from tqdm import tqdm
    except ImportError:
        state = {"step": 0, "start": time.monotonic()}

        def log(loss: float) -> None:
            state["step"] += 1
            if state["step"] % max(1, total // 10) == 0 or state["step"] == total:
                print(f"step {state['step']}/{total} loss {loss:.4f} "
                      f"({time.monotonic() - state['start']:.1f} s)", flush=True)
        return log
    bar = tqdm(total=total, desc="train", file=sys.stdout, mininterval=0.5)

    def update(loss: float) -> None:
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        bar.update()
        if bar.n == total:
            bar.close()
    return update


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="ddp", choices=["ddp"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=120, help="global batch (divisible by the world size)")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--hook", default="allreduce", choices=["allreduce", "fp16", "powersgd"])
    parser.add_argument("--check", action="store_true", help="compare with single-process training")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    meshkit.init_process_group("auto")
    from meshkit.parallel import PowerSGDState, fp16_compress_hook, powersgd_hook
    hook, state = {"allreduce": (None, None), "fp16": (fp16_compress_hook, None),
                   "powersgd": (powersgd_hook, PowerSGDState(rank=2, start_iter=10))}[args.hook]
    params, losses = train_ddp(args, hook, state)
    rank = meshkit.get_rank()
    if rank == 0:
        print(f"{args.strategy} on {meshkit.get_world_size()} ranks: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    status = 0
    if args.check:
        reference, ref_losses = train_reference(args)
        rtol = 1e-10 if args.dtype == "float64" else 1e-5
        worst = max(float(np.max(np.abs(params[n] - reference[n]) / (np.abs(reference[n]) + 1e-12 / rtol)))
                    for n in reference)
        ok = all(np.allclose(params[n], reference[n], rtol=rtol, atol=rtol * 1e-2) for n in reference)
        if rank == 0:
            print(f"check against single-process training: {'OK' if ok else 'FAILED'} "
                  f"(worst relative difference {worst:.2e}, tolerance {rtol:g})")
        status = 0 if ok else 1
    meshkit.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
