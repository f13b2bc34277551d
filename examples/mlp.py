"""The example's model: a tanh MLP classifier on synthetic data, and how each strategy runs it.

``examples/train_mlp.py`` (the command-line example), the benchmarks and the tests share this
module. It is not part of the installed package: a script next to it imports it as ``mlp``
(Python puts the script's folder first on ``sys.path``); a script elsewhere adds the
``examples`` folder to ``sys.path`` first::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import mlp

The model has a softmax cross-entropy loss and a hand-written backward pass that runs layer by
layer, from the last to the first, handing each layer's gradients over as soon as they are
computed (so DDP averages the last layers' buckets while earlier layers still differentiate).
Data is synthetic: a fixed random "teacher" network labels Gaussian inputs.

The model math takes its array library from its arrays (``array_namespace``): the same code
trains NumPy arrays on the host and CuPy arrays on a GPU (``build(..., device="cuda")``).

The training loop speaks the protocol every data-parallel strategy implements
(:mod:`meshkit.parallel.data_parallelism.protocol`: ``unshard``/``prefetch`` a layer's unit while it runs,
``mark_grad_ready`` as gradients are known, ``step``): :func:`build` makes any strategy with
:func:`meshkit.parallel.data_parallel` (DDP, ZeRO-1/2, FSDP and hybrid sharding, one unit per
layer), and the library's :class:`meshkit.parallel.LocalStrategy` is the same protocol in one
process, the single-process reference.
``loop.py`` beside this file is the loop itself, which every example shares.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

import meshkit
from meshkit.parallel import SGD, AdamW, LocalStrategy, Optimizer, array_namespace, data_parallel

__all__ = [
    "FEATURES", "CLASSES", "STRATEGIES", "make_data", "init_params", "layer_count", "batch_indices",
    "loss_and_grad_logits", "forward", "backward", "forward_layers", "backward_layers", "make_optimizer",
    "Plain", "build",
]

FEATURES, CLASSES = 20, 4
#: The strategies :func:`build` knows.
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "hsdp")


# --------------------------------------------------------------------------- data and parameters
def make_data(samples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian inputs labelled by a fixed random teacher network (a learnable, non-linear task)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, FEATURES))
    teacher = rng.standard_normal((FEATURES, 32)), rng.standard_normal((32, CLASSES))
    y = np.argmax(np.tanh(x @ teacher[0]) @ teacher[1], axis=1)
    return x, y


def init_params(hidden: Sequence[int] = (64, 64), dtype: Any = np.float64, seed: int = 1) -> dict[str, np.ndarray]:
    """``w0, b0, w1, b1, ...`` in forward order (Xavier-scaled weights, zero biases)."""
    rng = np.random.default_rng(seed)
    sizes = (FEATURES, *hidden, CLASSES)
    params: dict[str, np.ndarray] = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"w{i}"] = (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(dtype)
        params[f"b{i}"] = np.zeros(fan_out, dtype)
    return params


def to_device(arrays: Any, device: str) -> Any:
    """``arrays`` (a dict or tuple of NumPy arrays) on ``device``: themselves for ``"cpu"``, CuPy
    copies for ``"cuda"`` (the one host-to-device copy of a GPU run)."""
    if device != "cuda":
        return arrays
    import cupy  # only for a GPU run: CuPy stays optional

    if isinstance(arrays, dict):
        return {name: cupy.asarray(a) for name, a in arrays.items()}
    return tuple(cupy.asarray(a) for a in arrays)


def layer_count(params: dict[str, Any]) -> int:
    """Layers of the MLP whose parameters are ``params``."""
    return sum(1 for name in params if name.startswith("w"))


def batch_indices(step: int, samples: int, batch: int) -> np.ndarray:
    """The global batch of a step: the same on every rank (``batch <= samples``)."""
    return np.random.default_rng(1000 + step).choice(samples, size=batch, replace=False)


def make_optimizer(name: str, lr: float) -> Optimizer:
    """The example's optimizers: ``sgd`` (momentum 0.9) or ``adamw`` (weight decay 0.01)."""
    if name == "adamw":
        return AdamW(lr=lr, weight_decay=0.01)
    if name == "sgd":
        return SGD(lr=lr, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r}; valid: 'sgd', 'adamw'")


# --------------------------------------------------------------------------- forward, loss, backward
def loss_and_grad_logits(logits: Any, y: Any) -> tuple[float, Any]:
    """Mean softmax cross-entropy and its gradient with respect to the logits."""
    xp = array_namespace(logits)
    shifted = logits - logits.max(axis=1, keepdims=True)
    probs = xp.exp(shifted)
    probs /= probs.sum(axis=1, keepdims=True)
    rows = xp.arange(len(y))
    loss = float(-xp.log(probs[rows, y]).mean())  # on a GPU: the step's one scalar copied to the host
    probs[rows, y] -= 1
    return loss, probs / len(y)


def forward(params: dict[str, Any], x: Any) -> list[Any]:
    """Activations of every layer (input first; the last entry is the logits)."""
    return forward_layers(LocalStrategy(params), x)


def backward(params: dict[str, Any], acts: list[Any], dlogits: Any, on_grad: Callable[[str, Any], None]) -> None:
    """Back-propagate layer by layer, calling ``on_grad(name, grad)`` as each gradient is final."""
    backward_layers(LocalStrategy(params), acts, dlogits, on_grad)


def _layer_units(model: Any) -> list[int]:
    """The unit of each layer of ``model`` (a strategy of the protocol), by its weight's name."""
    unit = {name: u for u, names in enumerate(model.units) for name in names}
    return [unit[f"w{i}"] for i in range(sum(1 for name in unit if name.startswith("w")))]


def forward_layers(model: Any, x: Any, prefetch: bool = True) -> list[Any]:
    """Forward pass through ``model``, any strategy of the protocol (:mod:`meshkit.parallel.data_parallelism.protocol`)
    or a ``LocalStrategy``: each layer's unit unsharded only while it runs, the next one prefetched
    (unless ``prefetch`` is False)."""
    units = _layer_units(model)
    n = len(units)
    acts = [x]
    for i in range(n):
        with model.unshard(units[i]) as p:
            if prefetch and i + 1 < n:
                model.prefetch(units[i + 1])
            w = p[f"w{i}"]
            if not i:
                acts[0] = x.astype(w.dtype)
            z = acts[-1] @ w + p[f"b{i}"]
        acts.append(array_namespace(z).tanh(z) if i < n - 1 else z)
    return acts


def backward_layers(model: Any, acts: list[Any], dlogits: Any, on_grad: Callable[[str, Any], None] | None = None,
                    prefetch: bool = True) -> None:
    """Backward pass, last layer first; each gradient goes to ``on_grad`` (default
    ``model.mark_grad_ready``) as soon as it is known."""
    units = _layer_units(model)
    mark = on_grad or model.mark_grad_ready
    delta = dlogits
    for i in reversed(range(len(units))):
        with model.unshard(units[i]) as p:
            if prefetch and i:
                model.prefetch(units[i - 1])
            dw, db = acts[i].T @ delta, delta.sum(axis=0)
            if i:
                delta = (delta @ p[f"w{i}"].T) * (1 - acts[i] ** 2)
        mark(f"w{i}", dw)
        mark(f"b{i}", db)


# --------------------------------------------------------------------------- one process
#: The single-process reference is the library's (:class:`meshkit.parallel.LocalStrategy`); this
#: name stays for the scripts that still say ``mlp.Plain`` (benchmarks/sharded.py).
Plain = LocalStrategy


def build(strategy: str, *, hidden: Sequence[int] = (64, 64), dtype: Any = np.float64, optimizer: str = "sgd",
          lr: float = 0.05, bucket_cap_mb: float = 25.0, hsdp_mesh: tuple[int, int] | None = None,
          comm_hook: Any = None, comm_state: Any = None, device: str = "cpu") -> Any:
    """``strategy`` over all ranks of the default world (collective: every rank calls it).

    Args:
        strategy: one of :data:`STRATEGIES`.
        hidden, dtype: the MLP (:func:`init_params`; every rank starts from the same parameters).
        optimizer, lr: :func:`make_optimizer`'s.
        bucket_cap_mb: DDP's and ZeRO's bucket cap; the first bucket is capped at
            ``min(1, bucket_cap_mb)`` MB, as torch's DDP does.
        hsdp_mesh: ``(replicate, shard)`` degrees of hsdp's 2-D mesh, their product the world
            size (hsdp only).
        comm_hook, comm_state: DDP's communication hook and its state (ddp only).
        device: ``"cpu"`` (NumPy parameters) or ``"cuda"`` (CuPy parameters on each rank's GPU,
            copied there once; the mesh is a cuda mesh).

    Raises:
        ValueError: an unknown strategy, or an option the strategy does not take.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
    if comm_hook is not None and strategy != "ddp":
        raise ValueError(f"comm_hook applies to strategy 'ddp' only, got strategy {strategy!r}")
    if (hsdp_mesh is None) != (strategy != "hsdp"):
        raise ValueError(f"hsdp_mesh is needed by strategy 'hsdp' and by no other, got {hsdp_mesh!r} "
                         f"for strategy {strategy!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; valid: cpu, cuda")
    params = to_device(init_params(hidden, dtype=np.dtype(dtype)), device)
    opt = make_optimizer(optimizer, lr)
    if strategy == "hsdp":
        mesh = meshkit.init_device_mesh(device, tuple(hsdp_mesh), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = meshkit.init_device_mesh(device, (meshkit.get_world_size(),), mesh_dim_names=("dp",))
    options: dict[str, Any] = {}
    if strategy in ("ddp", "zero1", "zero2"):
        options = {"bucket_cap_mb": bucket_cap_mb, "first_bucket_cap_mb": min(1.0, bucket_cap_mb)}
    if strategy == "ddp":
        options.update(comm_hook=comm_hook, comm_state=comm_state)
    n_layers = layer_count(params)
    units = [[f"w{i}", f"b{i}"] for i in range(n_layers)]  # one unit per layer (gathered alone by FSDP)
    return data_parallel(params, mesh, strategy, optimizer=opt, units=units, **options)
