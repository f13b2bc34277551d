"""Train a NumPy MLP classifier with data parallelism on meshkit.

    meshkit-run -n 4 examples/train_mlp.py                 # DDP, 200 steps, progress bar
    meshkit-run -n 4 examples/train_mlp.py --check         # ... and compare with one process
    meshkit-run -n 4 examples/train_mlp.py --strategy zero2 --optimizer adamw --check
    meshkit-run -n 4 examples/train_mlp.py --strategy fsdp --check      # one unit per layer
    meshkit-run -n 4 examples/train_mlp.py --strategy hsdp --mesh 2x2 --check
    python examples/train_mlp.py --steps 50                # a world of one

The model is a tanh MLP with a softmax cross-entropy loss and a hand-written backward pass that
runs layer by layer, from the last to the first, marking each layer's gradients ready as soon
as they are computed, so DDP averages the last layers' buckets while earlier layers are still
differentiating. Data is synthetic (a fixed random "teacher" network labels Gaussian inputs)
and made in the script. DDP and ZeRO-1/2 keep full parameters on every rank; FSDP (ZeRO-3) and
hybrid sharding gather each layer only while it runs (prefetching the next) and reduce-scatter
its gradients at once. Every step draws the same global batch on every rank (the same seed),
and each rank trains on its contiguous share, so the run is comparable, step for step, with
single-process training on the global batch: ``--check`` does exactly that and compares the
final parameters (float64: to 1e-10).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import Any, Callable, Iterator

import numpy as np

import meshkit
from meshkit.parallel import (SGD, AdamW, DistributedDataParallel, FullyShardedDataParallel, Optimizer,
                              ZeroRedundancyOptimizer)

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
    return forward_layers(Plain(params), x)


def forward_layers(model: Strategy, x: Any) -> list[Any]:
    """Forward pass that fetches each layer's parameters from ``model`` only while it runs."""
    n = model.layers
    acts = [x.astype(model.dtype)]
    for i in range(n):
        with model.layer(i, upcoming=i + 1 if i + 1 < n else None) as p:
            z = acts[-1] @ p[f"w{i}"] + p[f"b{i}"]
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
    backward_layers(Plain(params, on_grad), acts, dlogits)


def backward_layers(model: Strategy, acts: list[Any], dlogits: Any) -> None:
    """Backward pass, last layer first; each layer's gradients go to ``model`` as soon as known."""
    delta = dlogits
    for i in reversed(range(model.layers)):
        with model.layer(i, upcoming=i - 1 if i else None) as p:
            dw, db = acts[i].T @ delta, delta.sum(axis=0)
            if i:
                delta = (delta @ p[f"w{i}"].T) * (1 - acts[i] ** 2)
        model.grads_ready(i, {f"w{i}": dw, f"b{i}": db})


class Strategy:
    """What the training loop needs of a parallel strategy: a layer's parameters while it runs,
    somewhere to put gradients as they are ready, and an optimizer step."""

    layers: int
    dtype: Any

    def layer(self, i: int, upcoming: int | None = None) -> Any:
        """Context manager yielding ``{name: full parameter}`` for layer ``i``."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        pass

    def grads_ready(self, i: int, grads: dict[str, Any]) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def full_params(self) -> dict[str, np.ndarray]:
        raise NotImplementedError


class Plain(Strategy):
    """One process, or a view of a dict of parameters (the single-process reference)."""

    def __init__(self, params: dict[str, Any], on_grad: Callable[[str, Any], None] | None = None,
                 optimizer: Optimizer | None = None) -> None:
        self.params, self.on_grad, self.optimizer = params, on_grad, optimizer
        self.layers, self.dtype = layers(params), params["w0"].dtype
        self.grads: dict[str, Any] = {}

    def layer(self, i: int, upcoming: int | None = None) -> Any:
        return contextlib.nullcontext(self.params)

    def grads_ready(self, i: int, grads: dict[str, Any]) -> None:
        for name, g in grads.items():
            (self.on_grad or self.grads.__setitem__)(name, g)

    def step(self) -> None:
        self.optimizer.step(self.params, self.grads)

    def full_params(self) -> dict[str, np.ndarray]:
        return self.params


class Replicated(Strategy):
    """DDP or ZeRO-1/2: full parameters on every rank, gradients marked ready as they come."""

    def __init__(self, model: Any, optimizer: Optimizer | None) -> None:
        self.model, self.optimizer = model, optimizer
        self.layers, self.dtype = layers(model.params), model.params["w0"].dtype

    def layer(self, i: int, upcoming: int | None = None) -> Any:
        return contextlib.nullcontext(self.model.params)

    def zero_grad(self) -> None:
        self.model.zero_grad()

    def grads_ready(self, i: int, grads: dict[str, Any]) -> None:
        for name, g in grads.items():
            self.model.mark_grad_ready(name, g)

    def step(self) -> None:
        self.model.finish_gradient_sync()
        if self.optimizer is None:  # ZeRO owns its optimizer
            self.model.step()
        else:
            self.optimizer.step(self.model.params, self.model.grads)

    def full_params(self) -> dict[str, np.ndarray]:
        return self.model.params


class Sharded(Strategy):
    """FSDP / HSDP: one unit per layer, gathered (with the next one prefetched) while it runs."""

    def __init__(self, fsdp: FullyShardedDataParallel, dtype: Any, n_layers: int) -> None:
        self.fsdp, self.dtype, self.layers = fsdp, dtype, n_layers

    @contextlib.contextmanager
    def layer(self, i: int, upcoming: int | None = None) -> Iterator[dict[str, Any]]:
        with self.fsdp.unshard(i) as params:
            if upcoming is not None:
                self.fsdp.prefetch(upcoming)
            yield params

    def zero_grad(self) -> None:
        self.fsdp.zero_grad()

    def grads_ready(self, i: int, grads: dict[str, Any]) -> None:
        self.fsdp.reduce_grads(i, grads)

    def step(self) -> None:
        self.fsdp.step()

    def full_params(self) -> dict[str, np.ndarray]:
        return self.fsdp.full_state_dict()["params"]


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
    model = Plain(init_params(dtype=np.dtype(args.dtype)), optimizer=make_optimizer(args.optimizer, args.lr))
    losses = []
    for step in range(args.steps):
        idx = batch_indices(step, args.samples, args.batch)
        acts = forward_layers(model, x[idx])
        loss, dlogits = loss_and_grad_logits(acts[-1], y[idx])
        backward_layers(model, acts, dlogits)
        model.step()
        losses.append(loss)
    return model.params, losses


def build(args: argparse.Namespace, comm_hook: Any = None, comm_state: Any = None) -> tuple[Strategy, Any]:
    """The strategy named by ``--strategy`` over all ranks, and the data-parallel mesh."""
    world = meshkit.get_world_size()
    params = init_params(dtype=np.dtype(args.dtype))
    opt = make_optimizer(args.optimizer, args.lr)
    if args.strategy == "hsdp":
        replicate, shard = (int(v) for v in args.mesh.lower().split("x"))
        mesh = meshkit.init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = meshkit.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    caps = {"bucket_cap_mb": args.bucket_cap_mb, "first_bucket_cap_mb": min(1.0, args.bucket_cap_mb)}
    if args.strategy == "ddp":
        ddp = DistributedDataParallel(params, mesh=mesh, comm_hook=comm_hook, comm_state=comm_state, **caps)
        return Replicated(ddp, opt), mesh
    if args.strategy in ("zero1", "zero2"):
        zero = ZeroRedundancyOptimizer(params, opt, mesh=mesh, stage=int(args.strategy[-1]), **caps)
        return Replicated(zero, None), mesh
    n_layers = layers(params)
    units = [[f"w{i}", f"b{i}"] for i in range(n_layers)]
    fsdp = FullyShardedDataParallel(params, mesh=mesh, optimizer=opt, units=units)
    return Sharded(fsdp, params["w0"].dtype, n_layers), mesh


def train(args: argparse.Namespace, comm_hook: Any = None, comm_state: Any = None,
          progress: bool = True) -> tuple[dict[str, np.ndarray], list[float]]:
    """Train with ``--strategy``: each rank takes its share of every global batch."""
    rank, world = meshkit.get_rank(), meshkit.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must divide evenly over {world} ranks")
    x, y = make_data(args.samples)
    model, _ = build(args, comm_hook, comm_state)
    losses = []
    bar = _progress(args.steps, enabled=progress and rank == 0)
    for step in range(args.steps):
        idx = np.array_split(batch_indices(step, args.samples, args.batch), world)[rank]
        model.zero_grad()
        acts = forward_layers(model, x[idx])
        loss, dlogits = loss_and_grad_logits(acts[-1], y[idx])
        backward_layers(model, acts, dlogits)
        model.step()
        global_loss = np.array([loss])
        meshkit.all_reduce(global_loss, meshkit.ReduceOp.AVG)
        losses.append(float(global_loss[0]))
        bar(losses[-1])
    return model.full_params(), losses


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
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "zero1", "zero2", "fsdp", "hsdp"])
    parser.add_argument("--mesh", default="2x2", help="replicate x shard degrees of hsdp's 2-D mesh")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=120, help="global batch (divisible by the world size)")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--hook", default="allreduce", choices=["allreduce", "fp16", "powersgd"])
    parser.add_argument("--check", action="store_true",
                        help="compare with single-process training (float64: to 1e-10; float32: to 1e-5 over "
                             "short runs)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    meshkit.init_process_group("auto")
    from meshkit.parallel import PowerSGDState, fp16_compress_hook, powersgd_hook
    hook, state = {"allreduce": (None, None), "fp16": (fp16_compress_hook, None),
                   "powersgd": (powersgd_hook, PowerSGDState(rank=2, start_iter=10))}[args.hook]
    params, losses = train(args, hook, state)
    rank = meshkit.get_rank()
    if rank == 0:
        print(f"{args.strategy} on {meshkit.get_world_size()} ranks: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    status = 0
    if args.check:
        reference, ref_losses = train_reference(args)
        # Relative to each parameter's scale (an element near zero is not held to 1e-10 of itself).
        rtol = 1e-10 if args.dtype == "float64" else 1e-5
        errors = {n: float(np.max(np.abs(params[n] - reference[n]))) / float(np.max(np.abs(reference[n])) or 1.0)
                  for n in reference}
        worst = max(errors, key=errors.get)
        ok = errors[worst] <= rtol
        if rank == 0:
            print(f"check against single-process training: {'OK' if ok else 'FAILED'} (worst difference "
                  f"{errors[worst]:.2e} of the scale of {worst!r}, tolerance {rtol:g})")
            if not ok and args.dtype == "float32":
                print("note: in float32, N ranks sum gradients in another order than one process; the "
                      "rounding differences compound over many steps at a high learning rate. The 1e-5 "
                      "bar holds for short runs (a few dozen steps); --dtype float64 checks exactly.")
        status = 0 if ok else 1
    meshkit.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
