"""Train the example MLP on a 3-D ``pp x dp x tp`` mesh: pipeline, data and tensor parallel at once.

    meshkit-run -n 4 examples/train_3d.py --mesh 2x2x1 --check     # 2 pipeline stages x 2 replicas
    meshkit-run -n 4 examples/train_3d.py --mesh 2x1x2 --check     # 2 stages, each split over 2 tp ranks
    meshkit-run -n 8 examples/train_3d.py --mesh 2x2x2 --check     # all three
    meshkit-run -n 2 examples/train_3d.py --mesh 2x1x1 --schedule interleaved --check
    meshkit-run -n 4 examples/train_3d.py --mesh 2x1x2 --schedule zbv --check   # zero bubble, V: 2 stages a rank
    meshkit-run -n 4 examples/train_3d.py --mesh 2x2x1 --dp zero2 --check   # ZeRO-2 over dp instead of DDP
    meshkit-run -n 4 examples/train_3d.py --mesh 1x2x2 --dp fsdp --check    # FSDP (ZeRO-3) over dp
    python examples/train_3d.py --mesh 1x1x1 --check               # a world of one
    meshkit-run -n 4 examples/train_3d.py --mesh 2x2x1 --device cuda --check   # CuPy arrays over MPI
    meshkit-run -n 4 examples/train_3d.py --mesh 2x2x1 --steps 30 --checkpoint-dir ckpt --save-every 10
    meshkit-run -n 4 examples/train_3d.py --mesh 1x2x2 --steps 50 --checkpoint-dir ckpt --resume --check

The model is ``mlp.py``'s tanh MLP with ``--hidden`` layers (default 64,64,64: four layers). Its
layers are cut into ``pp`` contiguous stages (``np.array_split``; ``pp x --virtual`` stages with
``--schedule interleaved``), each a :class:`~meshkit.parallel.PipelineStage` on the ``pp``
group; a batch runs as ``--microbatches`` microbatches under ``--schedule gpipe|1f1b|interleaved|zbh1|zbv``
(the zero-bubble ZB-H1 and ZB-V run each stage's backward as two passes, input then weight
gradients; ZB-V puts two stages on each rank, in a V).
Inside a stage, consecutive layers are Megatron-LM blocks over ``tp``: a colwise layer (``w``
``Shard(1)``) then a rowwise one (``w`` ``Shard(0)``, its output all-reduced); a layer left
without a partner is replicated, so every stage boundary carries a replicated activation. The
forward and backward passes are plain NumPy on DTensors (one all-reduce forward and one backward
per block). Each ``dp`` replica trains on its share of every global batch, a stage adding up its
gradients over the microbatches.

``--dp`` says how the stages' blocks are data-parallel over ``dp`` (``meshkit.parallel.data_parallel``;
the loop is the same for every strategy): ``ddp``
(the default) takes the stages' DTensors and averages each rank's blocks after the pipeline step,
and its ``step()`` runs the optimizer on DDP's ``params`` and ``grads`` (DTensors laid out as the
stages' parameters, over the same blocks); ``zero1``/``zero2`` take the DTensors too, shard each block's
optimizer state (and, at stage 2, its gradient) over ``dp`` and step themselves, the stages
running on ZeRO's ``params`` (DTensors over its own buffers); ``fsdp`` takes the DTensors with one
unit per layer and flat-shards the blocks over ``dp``, as torchtitan combines FSDP with pipelining:
every unit of a rank's stages is all-gathered once per step, before the schedule runs, and stays
gathered through every microbatch's forward and backward (the stages run on the DTensors
``unshard`` yields); the stages' gradients, added up over the microbatches, are reduce-scattered
once per unit, the gathered parameters and the gradients are freed, and FSDP steps its shards.
Between steps a rank holds only its shards of the parameters, gradients and optimizer state
(ZeRO-3's memory); during a step, its stages' layers whole (gathering each layer per microbatch
instead would cost 2 x ``--microbatches`` all-gathers of it a step).

``--device cuda`` puts the blocks, the data, every activation and gradient on a GPU: over the
MPI engine (device arrays as they are where MPI is CUDA-aware, else staged through pinned host
buffers), since NCCL cannot carry 1F1B's crossing sends and receives yet; rank r uses GPU
r mod the GPUs it sees (ranks may share one). Without a GPU it is a usage error (exit 2).

``--checkpoint-dir DIR --save-every K`` saves a sharded checkpoint every K steps (``--max-to-keep
K`` keeps the K newest), as train_mlp.py does: each rank saves its stages' layers under their
global names (``model.w3``, the optimizer's state under the same names) and the step, so the
keys do not depend on the split. ``--resume`` continues from the newest complete one on any
``--mesh``, ``--schedule``, ``--virtual`` or ``--dp``: each rank loads the layers it holds now,
resharded to its tp placements (and, with ZeRO or FSDP, to its shard over ``dp``).

``plan_model`` describes the model as ``meshkit.plan`` layers for a given mesh and schedule
(tp's pairing included); the planner's ``step_collectives`` lists a step of this script's,
collective by collective, as its flight record does (tests/test_plan_estimate.py).

``--check`` trains the same model in one process on the global batch and compares the final
parameters to 1e-10 in float64 (1e-5 in float32); after ``--resume``, with uninterrupted
training of all ``--steps``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

import numpy as np

import meshkit
import loop  # the examples' one training loop, beside this file
import mlp  # the model, beside this file
import train_mlp  # its reference training, --check's comparison, flag types and checkpoint helpers
from meshkit.checkpoint import CheckpointManager
from meshkit.comm.engines.cuda_runtime import runtime
from meshkit.parallel import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleZBH1,
                              ScheduleZBVZeroBubble, array_namespace, data_parallel)
from meshkit.tensor import DTensor, Replicate, Shard, distribute_tensor

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbh1", "zbv")
#: How the stages' blocks are data-parallel over dp (see data_parallel, and the module docstring for fsdp).
DP_STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
REPLICATED, COLWISE, ROWWISE = "replicated", "colwise", "rowwise"


# --------------------------------------------------------------------------- one stage's layers on DTensors
def layer_kinds(n: int, tp: int) -> list[str]:
    """How each of a stage's ``n`` layers is cut over ``tp``: colwise/rowwise pairs, a lone one replicated."""
    if tp == 1:
        return [REPLICATED] * n
    return [COLWISE, ROWWISE] * (n // 2) + [REPLICATED] * (n % 2)


def placements_of(kind: str) -> dict[str, list[Any]]:
    return {COLWISE: {"w": [Shard(1)], "b": [Shard(0)]}, ROWWISE: {"w": [Shard(0)], "b": [Replicate()]},
            REPLICATED: {"w": [Replicate()], "b": [Replicate()]}}[kind]


class Stage:
    """Layers ``layers`` of the MLP as DTensors over ``tp``; forward and backward for a PipelineStage."""

    def __init__(self, full: dict[str, np.ndarray], layers: Sequence[int], n_layers: int, tp: meshkit.DeviceMesh):
        self.layers, self.n_layers, self.tp = list(layers), n_layers, tp
        self.kinds = dict(zip(self.layers, layer_kinds(len(self.layers), tp.size())))
        # every rank built the same `full` (one seed): each cuts its own block, no data sent; the
        # block is a C-contiguous copy (DDP and the optimizer take each block as one flat buffer)
        self.params = {f"{k}{i}": distribute_tensor(full[f"{k}{i}"], tp, placements_of(self.kinds[i])[k],
                                                    src_data_rank=None)
                       for i in self.layers for k in "wb"}
        self.names = list(self.params)  # the stage's parameters, also while it holds none (--dp fsdp between steps)
        self.grads: dict[str, Any] = {}  # this rank's block of each gradient, added up over the microbatches
        self.zero_grad()

    def zero_grad(self) -> None:
        """Zero the gradient blocks, or allocate them like the parameters' blocks where they were dropped."""
        if self.grads.keys() != self.params.keys():
            self.grads = {n: array_namespace(p.to_local()).zeros_like(p.to_local()) for n, p in self.params.items()}
            return
        for g in self.grads.values():
            g[...] = 0

    def forward(self, x: Any) -> tuple[Any, Any]:
        h = DTensor.from_local(x, self.tp, [Replicate()])  # every tp rank received the same activation
        ins, outs = [], []
        for i in self.layers:
            ins.append(h)
            z = h @ self.params[f"w{i}"]
            if z.placements[0].is_partial():  # rowwise: Megatron's one all-reduce forward
                z = z.redistribute(placements=[Replicate()])
            z = z + self.params[f"b{i}"]
            h = np.tanh(z) if i < self.n_layers - 1 else z
            outs.append(h)
        return h.to_local(), (ins, outs)

    def backward(self, ctx: Any, dy: Any) -> Any:
        dx, wctx = self.backward_input(ctx, dy)
        self.backward_weight(wctx)
        return dx

    def backward_input(self, ctx: Any, dy: Any) -> tuple[Any, Any]:
        """The input gradient (the zero-bubble schedules' B), and each layer's (input, delta),
        which is all its weight gradient needs (W, maybe later)."""
        ins, outs = ctx
        delta = DTensor.from_local(dy, self.tp, [Replicate()])
        kept = []
        for i, h_in, h_out in zip(reversed(self.layers), reversed(ins), reversed(outs)):
            if i < self.n_layers - 1:
                delta = delta * (1 - h_out ** 2)  # through tanh
            kept.append((i, h_in, delta))
            delta = delta @ self.params[f"w{i}"].T
            if delta.placements[0].is_partial():  # colwise: Megatron's one all-reduce backward
                delta = delta.redistribute(placements=[Replicate()])
        return delta.to_local(), kept

    def backward_weight(self, kept: Any) -> None:
        """The weight gradients (W): local matmuls of what B kept, no communication."""
        for i, h_in, delta in kept:
            self.grads[f"w{i}"] += (h_in.T @ delta).to_local()
            self.grads[f"b{i}"] += delta.sum(axis=0).to_local()


# --------------------------------------------------------------------------- as meshkit.plan sees it
def plan_model(hidden: Sequence[int], batch: int, *, pp: int = 1, tp: int = 1, schedule: str = "1f1b",
               virtual: int = 2, dtype: str = "float64") -> Any:
    """This MLP as ``meshkit.plan`` layers for a run on a ``pp x dp x tp`` mesh: each layer's exact
    parameter shapes, and how tp cuts it (``tp_dim``: colwise ``w`` dim 1 and ``b``, rowwise ``w``
    dim 0, a lone layer replicated: the pairing within each stage that :class:`Stage` makes, so it
    depends on the cut into stages); per sample, forward flops ``2 x fan_in x fan_out``, the output
    (``activation_bytes``) and the input (``input_bytes``, which a colwise layer's backward all-reduces),
    and its ``tanh`` (``pointwise``: every layer but the last)."""
    from meshkit.plan import Layer, Model
    sizes = (mlp.FEATURES, *hidden, mlp.CLASSES)
    it = np.dtype(dtype).itemsize
    per_rank = virtual if schedule == "interleaved" else 2 if schedule == "zbv" else 1
    kinds = [k for cut in np.array_split(np.arange(len(sizes) - 1), pp * per_rank)
             for k in layer_kinds(len(cut), tp)]
    tp_dims = {COLWISE: {"w": 1, "b": 0}, ROWWISE: {"w": 0}, REPLICATED: {}}
    last = len(sizes) - 2  # every layer but the last applies tanh to its output
    return Model([Layer(f"l{i}", {"w": (a, b), "b": (b,)}, activation_bytes=it * b, flops=2 * a * b,
                        tp_dim=tp_dims[kind], input_bytes=it * a, pointwise=b if i < last else 0)
                  for i, (a, b, kind) in enumerate(zip(sizes[:-1], sizes[1:], kinds))], batch=batch, dtype=dtype)


# --------------------------------------------------------------------------- training
def build_mesh(shape: tuple[int, int, int]) -> meshkit.DeviceMesh:
    return meshkit.init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp", "tp"))


def pipeline_pass(model: Any, stages: list[Stage], schedule: Any, x: Any, y: Any) -> list[float] | None:
    """One step's forward and backward pass (the loop's ``run_pass``): every unit unsharded once,
    for every microbatch (DDP's and ZeRO's own DTensors; FSDP's gathered, all prefetched
    together), the schedule run on them, the stages' gradients (added up over the microbatches)
    handed to ``model.mark_grad_ready`` (DDP and ZeRO average each bucket over ``dp`` once complete,
    FSDP reduce-scatters each unit); on exit the stages drop the parameters and their gradient
    blocks and every unit is resharded. What is pipeline-specific stays here: which stage runs
    which parameters, and gradients added up over microbatches before they are marked ready.
    Returns the last stage's microbatch losses (None on other stages)."""
    with loop.unsharded(model) as params:
        for st in stages:
            st.params = {name: params[name] for name in st.names}
            st.zero_grad()
        try:
            losses = schedule.step(x, target=y)
            for st in stages:
                for name, g in st.grads.items():
                    model.mark_grad_ready(name, g)
        finally:
            for st in stages:
                st.params, st.grads = {}, {}
    return losses


def setup(args: argparse.Namespace) -> tuple[meshkit.DeviceMesh, Any, Any]:
    """The ``--mesh``, the strategy over the stages' blocks and the loop's ``run_pass(model, step)``
    (one step's pipelined forward and backward on this rank's share of the batch): what
    :func:`train` trains with (and benchmarks/scaling.py times, step by step)."""
    mesh = build_mesh(args.mesh)
    pp, dp, tp = mesh["pp"], mesh["dp"], mesh["tp"]
    p, v = pp.size(), stages_per_rank(args)
    full = mlp.to_device(mlp.init_params(args.hidden, dtype=np.dtype(args.dtype)), args.device)
    n_layers = mlp.layer_count(full)
    cuts = np.array_split(np.arange(n_layers), p * v)
    r = pp.get_local_rank()
    mine = [r, 2 * p - 1 - r] if args.schedule == "zbv" else [r + k * p for k in range(v)]  # ZB-V: a V
    stages = [Stage(full, cuts[s], n_layers, tp) for s in mine]
    del full  # the stages hold their blocks; no rank keeps the whole model
    # the backward split in two (input, weight gradients): the zero-bubble schedules run W later,
    # the others run the two back to back
    pipes = [PipelineStage(st.forward, None, s, p * v, group=pp, backward_input=st.backward_input,
                           backward_weight=st.backward_weight, placement="v" if args.schedule == "zbv" else "loop")
             for s, st in zip(mine, stages)]
    if args.schedule == "interleaved":
        schedule: Any = ScheduleInterleaved1F1B(pipes, args.microbatches, loss_fn)
    elif args.schedule in ("zbh1", "zbv"):
        schedule = (ScheduleZBH1(pipes[0], args.microbatches, loss_fn) if args.schedule == "zbh1" else
                    ScheduleZBVZeroBubble(pipes, args.microbatches, loss_fn))
    else:
        schedule = (ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B)(pipes[0], args.microbatches, loss_fn)
    blocks = {name: t for st in stages for name, t in st.params.items()}
    units = [[f"w{i}", f"b{i}"] for i in dict.fromkeys(name[1:] for name in blocks)]  # one per layer, in order
    # DDP averages the same blocks, ZeRO and FSDP copy them into their buffers and shards
    strategy = data_parallel(blocks, dp, args.dp, optimizer=mlp.make_optimizer(args.optimizer, args.lr), units=units)
    for st in stages:  # the stages run on what the strategy's unshard yields (pipeline_pass), step by step
        st.params, st.grads = {}, {}
    first, last = 0 in mine, p * v - 1 in mine
    x, y = mlp.to_device(mlp.make_data(args.samples), args.device)  # once; batches are gathered there
    xp = array_namespace(x)

    def run_pass(model: Any, step: int) -> list[float] | None:
        idx = np.array_split(mlp.batch_indices(step, args.samples, args.batch), dp.size())[dp.get_local_rank()]
        idx = xp.asarray(idx)  # on a GPU: the indices go to the device (a small copy per step)
        return pipeline_pass(model, stages, schedule, x[idx].astype(args.dtype) if first else None,
                             y[idx] if last else None)

    return mesh, strategy, run_pass


def train(args: argparse.Namespace, progress: bool = True) -> tuple[dict[str, np.ndarray], list[float]]:
    """Train on the ``--mesh``; returns every parameter gathered whole and each step's global loss."""
    mesh, strategy, run_pass = setup(args)
    # each rank saves and loads the layers it holds (strategy.params, by their global names) and their optimizer state
    manager = CheckpointManager(args.checkpoint_dir, max_to_keep=args.max_to_keep) if args.checkpoint_dir else None
    start = train_mlp.resume(manager, strategy, args) if args.resume else 0

    # step(): DDP the optimizer on its DTensors; ZeRO its shard, then all-gathers; FSDP its shards
    losses = loop.train(strategy, range(start, args.steps), run_pass, global_loss=lambda mb: global_loss(mb, mesh),
                        progress=progress and meshkit.get_rank() == 0,
                        after_step=train_mlp.saver(manager, strategy, args))
    return gather_params(strategy, mesh), losses


def loss_fn(logits: Any, y: Any) -> tuple[float, Any]:
    """The last stage's loss: mlp.py's mean softmax cross-entropy of one microbatch."""
    return mlp.loss_and_grad_logits(logits, y)


def global_loss(mb_losses: list[float] | None, mesh: meshkit.DeviceMesh) -> float:
    """The step's loss over the global batch, on every rank (two small all-reduces)."""
    mine = np.array([float(np.mean(mb_losses)) if mb_losses is not None else 0.0])
    meshkit.all_reduce(mine, meshkit.ReduceOp.MAX, group=mesh["pp"].get_group())  # losses >= 0: from the last stage
    meshkit.all_reduce(mine, meshkit.ReduceOp.AVG, group=mesh["dp"].get_group())
    return float(mine[0])


def gather_params(strategy: Any, mesh: meshkit.DeviceMesh) -> dict[str, np.ndarray]:
    """Every parameter whole on every rank, as NumPy arrays: the strategy's full state dict (its
    stages' layers, gathered over dp and tp, on the host), then an object all-gather over pp."""
    mine = strategy.full_state_dict()["model"]
    every: list[Any] = [None] * mesh["pp"].size()
    meshkit.all_gather_object(every, dict(mine), group=mesh["pp"].get_group())
    return {name: a for part in every for name, a in part.items()}


# --------------------------------------------------------------------------- command line
def mesh3(text: str) -> tuple[int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(q.strip().isdigit() and int(q) >= 1 for q in parts):
        raise argparse.ArgumentTypeError(f"expected PPxDPxTP with three integers >= 1, e.g. 2x2x1, got {text!r}")
    return int(parts[0]), int(parts[1]), int(parts[2])


def widths(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(w) for w in text.split(","))
    except ValueError:
        out = ()
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated widths >= 1, e.g. 64,64,64, got {text!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="train_3d.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mesh", type=mesh3, default=None, metavar="PPxDPxTP",
                        help="pipeline x data x tensor degrees, their product the number of ranks N (default: Nx1x1)")
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="default: %(default)s")
    parser.add_argument("--dp", default="ddp", choices=DP_STRATEGIES,
                        help="how each stage's blocks are data-parallel over DP: ddp, zero1 (optimizer state sharded "
                             "over DP), zero2 (optimizer state and gradients sharded) or fsdp (parameters too, "
                             "gathered once a step for every microbatch) (default: %(default)s)")
    parser.add_argument("--microbatches", type=train_mlp.int_at_least(1), default=4, help="default: %(default)s")
    parser.add_argument("--virtual", type=train_mlp.int_at_least(1), default=2,
                        help="stages per pipeline rank with --schedule interleaved (default: %(default)s)")
    parser.add_argument("--hidden", type=widths, default=(64, 64, 64), help="hidden widths (default: 64,64,64)")
    parser.add_argument("--steps", type=train_mlp.int_at_least(1), default=50, help="default: %(default)s")
    parser.add_argument("--batch", type=train_mlp.int_at_least(1), default=96,
                        help="global batch (default: %(default)s)")
    parser.add_argument("--samples", type=train_mlp.int_at_least(1), default=4096, help="default: %(default)s")
    parser.add_argument("--lr", type=train_mlp.positive_float, default=None,
                        help="learning rate (default: 0.05 for sgd, 0.01 for adamw)")
    parser.add_argument("--optimizer", default="sgd", choices=tuple(train_mlp.DEFAULT_LR), help="default: %(default)s")
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"], help="default: %(default)s")
    train_mlp.add_device_flag(parser, "cuda: CuPy arrays, a GPU per rank, over the MPI engine")
    train_mlp.add_checkpoint_flags(parser, saved_by="a run on any --mesh, --schedule, --virtual or --dp")
    parser.add_argument("--check", action="store_true",
                        help="train in one process on the global batch too (all --steps, also after --resume) "
                             "and compare the final parameters (1e-10 in float64, 1e-5 in float32)")
    return parser


def stages_per_rank(args: argparse.Namespace) -> int:
    """``--virtual`` with the interleaved schedule, 2 with ZB-V (its V), else 1."""
    return args.virtual if args.schedule == "interleaved" else 2 if args.schedule == "zbv" else 1


def _problem(args: argparse.Namespace, world_size: int) -> str | None:
    pp, dp, tp = args.mesh
    if pp * dp * tp != world_size:
        return (f"argument --mesh: {pp}x{dp}x{tp} is a mesh of {pp * dp * tp} ranks; this run has {world_size}: "
                f"use PPxDPxTP with PP x DP x TP = {world_size}")
    stages = pp * stages_per_rank(args)
    layers = len(args.hidden) + 1
    if stages > layers:
        return (f"argument --mesh: {stages} pipeline stages for a model of {layers} layers; use at most {layers} "
                "stages, or more --hidden layers")
    if args.schedule == "interleaved" and args.microbatches % pp:
        return (f"argument --microbatches: {args.microbatches} is not a multiple of the {pp} pipeline ranks, which "
                "--schedule interleaved needs")
    if args.batch % dp or (args.batch // dp) % args.microbatches:
        return (f"argument --batch: {args.batch} does not split into {dp} data-parallel shares of "
                f"{args.microbatches} equal microbatches; use a multiple of {dp * args.microbatches}")
    if args.batch > args.samples:
        return f"argument --batch: {args.batch} is larger than --samples {args.samples}"
    return train_mlp.device_problem(args) or train_mlp.checkpoint_problem(args)


def parse_args(argv: Sequence[str] | None = None, *, rank: int = 0, world_size: int = 1) -> argparse.Namespace:
    """Parse and check the command line on ``world_size`` ranks (usage errors from rank 0 only, exit 2 everywhere)."""
    return train_mlp.parse_for_world(build_parser(), argv, rank=rank, world_size=world_size, problem=_problem,
                                     default_mesh=lambda n: (n, 1, 1))


def main(argv: list[str] | None = None) -> int:
    meshkit.init_process_group("mpi")
    rank, world = meshkit.get_rank(), meshkit.get_world_size()
    try:
        args = parse_args(argv, rank=rank, world_size=world)
    except SystemExit:
        meshkit.destroy_process_group()
        raise
    if args.device == "cuda":
        runtime().use_device(rank % runtime().device_count())  # before any device array exists
    params, losses = train(args)
    pp, dp, tp = args.mesh
    if rank == 0:
        span = f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "no steps left to train"
        print(f"{args.schedule} pipeline on a {pp}x{dp}x{tp} pp x dp x tp mesh ({args.dp} over dp): {span}",
              flush=True)
    status = 0
    if args.check:
        reference, _ = train_mlp.train_reference(args, args.hidden)
        ok = train_mlp.agreed([train_mlp.compare_params(args.dtype, params, reference)], args.dtype)
        status = 0 if ok else 1
    meshkit.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
