"""Train the example MLP with tensor parallelism over ``tp`` and data parallelism over ``dp``.

    meshkit-run -n 4 examples/train_tp.py --mesh 2x2 --check     # 2 replicas of a 2-way split model
    meshkit-run -n 4 examples/train_tp.py --mesh 1x4 --check     # tensor parallel only
    meshkit-run -n 2 examples/train_tp.py --mesh 2x1 --check     # data parallel only
    meshkit-run -n 4 examples/train_tp.py --mesh 2x2 --dp fsdp --check   # ZeRO-3 over dp of the TP blocks
    meshkit-run -n 4 examples/train_tp.py --mesh 2x2 --device cuda --check   # CuPy blocks, NCCL, one GPU per rank

The model is ``mlp.py``'s (beside this file: its data, its initial parameters, its optimizers):
``logits = tanh(tanh(x @ w0 + b0) @ w1 + b1) @ w2 + b2``. The parameters become DTensors on the
``tp`` dim of a ``dp x tp`` mesh by a plan, Megatron-LM's: the first layer colwise (``w0``
``Shard(1)``, ``b0`` ``Shard(0)``), the second rowwise (``w1`` ``Shard(0)``, ``b1`` replicated);
``w2`` and ``b2``, in no rule, are replicated. The forward pass, the loss and the hand-written
backward pass are plain NumPy on those DTensors: the ops propagate the placements, so the first
hidden layer runs on each rank's columns without communication, the second layer's output is
all-reduced once (the style's ``prepare_output``), and every gradient comes out with its
parameter's placements. DDP takes the DTensors as they are and averages each rank's blocks over
``dp`` (its ``params`` and ``grads`` are DTensors laid out alike), and the optimizer (``SGD`` or
``AdamW``) updates them in place; ``--dp zero1|zero2`` shards the blocks' optimizer state (and
gradients) over ``dp`` instead, taking the DTensors too, and ``--dp fsdp`` the parameters as well
(``dp_shard x tp``; FSDP takes the DTensors, gathers each layer's blocks as DTensors laid out as
the plan says, and takes their gradients as they come out).

``--device cuda`` puts the parameters' blocks, the data and every activation on one GPU per rank
(a ``cuda`` mesh: the NCCL engine, which ``auto`` picks where CuPy sees a GPU); each step brings
one scalar (its loss) back to the host. Without a GPU it is a usage error (exit 2).

``--check`` trains the same model in one process on the global batch (``train_mlp.py``'s
reference) and compares the final parameters to 1e-10 in float64 (1e-5 in float32).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Sequence

import numpy as np

import meshkit
import loop  # the examples' one training loop, beside this file
import mlp  # the model, beside this file
import train_mlp  # its reference training, --check's comparison and flag types
from meshkit.parallel import Optimizer, array_namespace, data_parallel
from meshkit.tensor import ColwiseParallel, DTensor, Replicate, RowwiseParallel, distribute_tensor, parallelize

#: The Megatron block: layer 0 colwise, layer 1 rowwise; DTensors in and out (no local outputs).
COLWISE = ColwiseParallel(use_local_output=False)
ROWWISE = RowwiseParallel(use_local_output=False)
PLAN = {"[wb]0": COLWISE, "[wb]1": ROWWISE}
#: How the TP blocks are data-parallel over dp (see build).
DP_STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
#: The model's hidden widths (mlp.py's default): three layers, the plan's two and a replicated head.
HIDDEN = (64, 64)


# --------------------------------------------------------------------------- the model on DTensors
def forward(params: dict[str, DTensor], x: Any, tp: meshkit.DeviceMesh) -> list[DTensor]:
    """Activations (input first, logits last): plain NumPy on DTensors, Megatron's collectives."""
    x = COLWISE.prepare_input(x, tp)                            # Replicate over tp
    h0 = np.tanh(x @ params["w0"] + params["b0"])               # Shard(1): each rank's columns, no communication
    h0 = ROWWISE.prepare_input(h0)                              # already Shard(-1): nothing moves
    z1 = ROWWISE.prepare_output(h0 @ params["w1"]) + params["b1"]   # Partial -> Replicate: the one all-reduce
    h1 = np.tanh(z1)
    return [x, h0, h1, h1 @ params["w2"] + params["b2"]]        # the head is replicated


def loss_and_grad_logits(logits: DTensor, onehot: DTensor) -> tuple[DTensor, DTensor]:
    """Mean softmax cross-entropy and its gradient; the log-sum-exp form (no log of a tiny probability)."""
    shifted = logits - np.max(logits, axis=1, keepdims=True)
    exp = np.exp(shifted)
    total = np.sum(exp, axis=1, keepdims=True)
    n = logits.shape[0]
    loss = np.mean(np.log(total) - np.sum(onehot * shifted, axis=1, keepdims=True))
    return loss, (exp / total - onehot) / n


def backward(params: dict[str, DTensor], acts: list[DTensor], dlogits: DTensor,
             on_grad: Callable[[str, DTensor], None]) -> None:
    """Back-propagate, last layer first, calling ``on_grad(name, grad)`` as each gradient is final
    (the same loop as ``mlp.backward``); each gradient has its parameter's placements."""
    delta = dlogits
    for i in reversed(range(len(acts) - 1)):
        on_grad(f"w{i}", acts[i].T @ delta)
        on_grad(f"b{i}", delta.sum(axis=0))
        if i:
            delta = (delta @ params[f"w{i}"].T) * (1 - acts[i] ** 2)


# --------------------------------------------------------------------------- training
def build_mesh(shape: tuple[int, int], device: str = "cpu") -> meshkit.DeviceMesh:
    """The ``dp x tp`` mesh over every rank (collective)."""
    return meshkit.init_device_mesh(device, shape, mesh_dim_names=("dp", "tp"))


def build(dp_strategy: str, full: dict[str, Any], mesh: meshkit.DeviceMesh, optimizer: Optimizer) -> Any:
    """The model's parameters as DTensors over ``tp`` (the plan), data-parallel over ``dp`` by
    ``dp_strategy`` (collective over the mesh), one unit per layer:

    * ``ddp``: DDP takes the DTensors and averages each rank's blocks over ``dp``; its ``step()``
      runs the optimizer on its ``params`` and ``grads``, DTensors laid out as the plan says.
    * ``zero1``/``zero2``: ZeRO takes the DTensors and shards each block's optimizer state (and,
      at stage 2, its gradient) over ``dp``; its ``params`` are DTensors over its buffers.
    * ``fsdp``: ZeRO-3 over ``dp`` of the TP blocks (``dp_shard x tp``): FSDP takes the DTensors
      and flat-shards each rank's blocks over ``dp``; every unit is gathered for the step
      (``unshard`` yields DTensors laid out as the plan says), each unit's DTensor gradients
      reduce-scattered once the backward pass has them all.
    """
    units = [[f"w{i}", f"b{i}"] for i in range(mlp.layer_count(full))]
    return data_parallel(parallelize(full, mesh["tp"], PLAN), mesh["dp"], dp_strategy, optimizer=optimizer,
                         units=units)


def tp_pass(model: Any, x: Any, onehot: DTensor, tp: meshkit.DeviceMesh) -> DTensor:
    """One forward and backward pass (the loop's ``run_pass``) on every unit at once: DDP's and
    ZeRO's own DTensors, FSDP's gathered; each gradient, which must come out with its
    parameter's placements, handed to ``model.mark_grad_ready``. Returns the loss."""
    with loop.unsharded(model) as params:
        def mark(name: str, grad: DTensor) -> None:
            if grad.placements != params[name].placements:
                raise RuntimeError(f"train_tp: gradient {name!r} came out {grad.placements!r}, its parameter is "
                                   f"{params[name].placements!r}")
            model.mark_grad_ready(name, grad)

        acts = forward(params, x, tp)
        loss, dlogits = loss_and_grad_logits(acts[-1], onehot)
        backward(params, acts, dlogits, mark)
    return loss


def train(args: argparse.Namespace, progress: bool = True) -> tuple[dict[str, np.ndarray], list[float]]:
    """Train on the ``--mesh``: each dp rank takes its share of every global batch.

    Returns the full final parameters (gathered over tp) and every step's loss over the global batch.
    """
    mesh = build_mesh(args.mesh, args.device)
    dp, tp = mesh["dp"], mesh["tp"]
    x, y = mlp.to_device(mlp.make_data(args.samples), args.device)  # once; batches are gathered there
    xp = array_namespace(x)
    full = mlp.to_device(mlp.init_params(HIDDEN, dtype=np.dtype(args.dtype)), args.device)
    model = build(args.dp, full, mesh, mlp.make_optimizer(args.optimizer, args.lr))

    def run_pass(model: Any, step: int) -> DTensor:
        idx = np.array_split(mlp.batch_indices(step, args.samples, args.batch), dp.size())[dp.get_local_rank()]
        idx = xp.asarray(idx)  # on a GPU: the indices go to the device (a small copy per step)
        # every tp rank drew the same batch: each keeps its own copy, no data sent (src_data_rank=None)
        onehot = distribute_tensor(xp.eye(mlp.CLASSES, dtype=args.dtype)[y[idx]], tp, [Replicate()],
                                   src_data_rank=None)
        return tp_pass(model, x[idx].astype(args.dtype), onehot, tp)

    def global_loss(loss: DTensor) -> float:
        mean = np.array([float(loss.to_local())])
        meshkit.all_reduce(mean, meshkit.ReduceOp.AVG, group=dp.get_group())
        return float(mean[0])

    losses = loop.train(model, range(args.steps), run_pass, global_loss=global_loss,
                        progress=progress and meshkit.get_rank() == 0)
    return model.full_state_dict()["model"], losses  # the global arrays (gathered over tp), NumPy


# --------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="train_tp.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mesh", type=train_mlp.mesh_shape("DPxTP"), default=None, metavar="DPxTP",
                        help="data-parallel x tensor-parallel degrees, their product the number of ranks N "
                             "(default: 2x(N/2) for an even N, else 1xN)")
    parser.add_argument("--dp", default="ddp", choices=DP_STRATEGIES,
                        help="how the TP blocks are data-parallel over DP: ddp, zero1, zero2 or fsdp (ZeRO-3, "
                             "dp_shard x tp) (default: %(default)s)")
    parser.add_argument("--steps", type=train_mlp.int_at_least(1), default=100, help="default: %(default)s")
    parser.add_argument("--batch", type=train_mlp.int_at_least(1), default=120,
                        help="global batch, a multiple of DP and at most --samples (default: %(default)s)")
    parser.add_argument("--samples", type=train_mlp.int_at_least(1), default=4096,
                        help="size of the synthetic data set (default: %(default)s)")
    lr_defaults = ", ".join(f"{lr:g} for {name}" for name, lr in train_mlp.DEFAULT_LR.items())
    parser.add_argument("--lr", type=train_mlp.positive_float, default=None,
                        help=f"learning rate (default: {lr_defaults})")
    parser.add_argument("--optimizer", default="sgd", choices=tuple(train_mlp.DEFAULT_LR), help="default: %(default)s")
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"], help="default: %(default)s")
    train_mlp.add_device_flag(parser, "cuda: CuPy blocks, one GPU per rank (a cuda mesh: the NCCL engine)")
    parser.add_argument("--check", action="store_true",
                        help="train in one process on the global batch too and compare the final parameters: "
                             "to 1e-10 in float64, 1e-5 in float32")
    return parser


def _problem(args: argparse.Namespace, world_size: int) -> str | None:
    """The first problem of ``args`` on ``world_size`` ranks that argparse cannot see, or None."""
    dp, tp = args.mesh
    if dp * tp != world_size:
        return (f"argument --mesh: {dp}x{tp} is a mesh of {dp * tp} ranks; this run has {world_size}: use DPxTP "
                f"with DP x TP = {world_size}")
    if args.batch % dp:
        return f"argument --batch: {args.batch} does not divide evenly over DP={dp} replicas; use a multiple of {dp}"
    if args.batch > args.samples:
        return (f"argument --batch: {args.batch} is larger than --samples {args.samples} (a batch draws distinct "
                "samples); use at most --samples")
    return train_mlp.device_problem(args)


def parse_args(argv: Sequence[str] | None = None, *, rank: int = 0, world_size: int = 1) -> argparse.Namespace:
    """Parse and check the command line for ``world_size`` ranks; fill in the defaults.

    On a bad flag every rank exits with status 2 (``SystemExit``); only rank 0 prints the usage
    error (and ``--help``).
    """
    return train_mlp.parse_for_world(build_parser(), argv, rank=rank, world_size=world_size, problem=_problem,
                                     default_mesh=lambda n: (2, n // 2) if n % 2 == 0 else (1, n))


def main(argv: list[str] | None = None) -> int:
    meshkit.init_process_group("auto")
    rank = meshkit.get_rank()
    try:
        args = parse_args(argv, rank=rank, world_size=meshkit.get_world_size())
    except SystemExit:  # a usage error or --help: the same on every rank
        meshkit.destroy_process_group()
        raise
    params, losses = train(args)
    if rank == 0:
        print(f"dp x tp = {args.mesh[0]} x {args.mesh[1]} ({args.dp} over dp): "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    status = 0
    if args.check:
        reference, _ = train_mlp.train_reference(args)
        ok = train_mlp.agreed([train_mlp.compare_params(args.dtype, params, reference)], args.dtype)
        status = 0 if ok else 1
    meshkit.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
