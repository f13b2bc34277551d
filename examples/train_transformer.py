"""Train one transformer block (attention, then a mixture of experts) on a mesh of named dimensions.

    meshkit-run -n 4 examples/train_transformer.py --mesh dp=2,tp=2 --check
    meshkit-run -n 4 examples/train_transformer.py --mesh tp=2,dp=2 --no-causal --check
    meshkit-run -n 4 examples/train_transformer.py --mesh pp=2,dp=2 --schedule zbh1 --microbatches 4 --check
    meshkit-run -n 4 examples/train_transformer.py --mesh dp=2,ep=2 --experts 4 --top-k 2 --check
    meshkit-run -n 4 examples/train_transformer.py --mesh cp=2,tp=2 --seq 16 --check
    meshkit-run -n 8 examples/train_transformer.py --mesh pp=2,cp=2,ep=2 --check  # three dimensions at once
    meshkit-run -n 2 examples/train_transformer.py --mesh tp=2 --heads 2 --check
    python examples/train_transformer.py --mesh dp=1 --steps 10 --check      # a world of one

The model is ``transformer.py``'s (beside this file): ``h = x + attention(x)``, ``out = h + moe(h)``,
a mean squared error against a teacher block's output, and a hand-written backward pass. The
``--mesh`` flag names the degree of each dimension, in the order of the mesh's dimensions
(outermost first: ``dp=2,tp=2`` puts tp's ranks next to each other); a missing one is 1 and
their product is the world size:

* ``dp``: the global batch split over ranks (each takes a contiguous, equal share);
* ``cp``: each sequence split over ranks (head-tail balanced when causal), attention by
  :func:`meshkit.parallel.ring_attention`, K and V passed around the ring;
* ``tp``: attention's heads and each expert's hidden units split over ranks (Megatron: one
  all-reduce after the attention's output projection and one after the experts);
* ``ep``: the experts split over ranks (:class:`meshkit.parallel.MoE`: each token dispatched to
  its experts' ranks and combined back with ``all_to_all_single``), which also hold other
  sequences, as data parallelism does (torchtitan's ep borrowing dp);
* ``pp``: two pipeline stages, the attention and the experts, run by ``--schedule``
  (gpipe, 1f1b, zbh1: the backward split into input and weight gradients) over
  ``--microbatches``.

Every step's data depends on the step alone (``transformer.batch_indices``), so the run equals
single-process training on the global batch whatever the mesh: ``--check`` trains that
reference and compares the final parameters (float64, 1e-10). The attention's parameters are
DTensors (tp's blocks) whose gradients DDP averages over the ranks holding other tokens; the
router's and the experts' gradients come out of the MoE layer reduced over the ranks sharing
them; the library's recipe (``parallelize_model``) makes the loop's one model of the two (a
``Composite`` of a DDP and an ``ExpertStrategy``), so nothing here builds or adapts a strategy or
dispatches on its class. Checkpoints (``--checkpoint-dir``, ``--save-every``, ``--resume``) resume on another
``--mesh``. The experts compute ``silu(h w1) w2`` (the library layer's), dropless.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Sequence

import numpy as np

import meshkit
import loop  # the examples' one training loop, beside this file
import train_mlp  # flag types, checkpoint flags, --check's verdict
import transformer as model_math  # the model, beside this file
from meshkit.checkpoint import CheckpointManager
from meshkit.parallel import (MoE, PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleZBH1, Strategy, parallelize_model,
                              ring_attention, ring_attention_backward, shard_experts, shard_sequence)
from meshkit.state import ShardedArray
from meshkit.tensor import DTensor, Replicate, Shard

#: The mesh dimensions ``--mesh`` knows.
DIMS = ("dp", "cp", "tp", "ep", "pp")


# --------------------------------------------------------------------------- the mesh flag
def parse_mesh(text: str) -> dict[str, int]:
    """``dp=2,tp=2`` -> ``{"dp": 2, "tp": 2}`` in the order given (argparse type)."""
    degrees: dict[str, int] = {}
    for part in text.split(","):
        name, eq, value = part.strip().partition("=")
        if not eq or name not in DIMS:
            raise argparse.ArgumentTypeError(f"expected NAME=DEGREE items with NAME among {', '.join(DIMS)}, "
                                             f"e.g. dp=2,tp=2; got {part.strip()!r} in {text!r}")
        if name in degrees:
            raise argparse.ArgumentTypeError(f"{name} is given twice in {text!r}")
        if not value.strip().isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(f"{name}'s degree must be an integer >= 1, got {value!r} in {text!r}")
        degrees[name] = int(value)
    return degrees


def full_mesh(degrees: dict[str, int]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Every dimension's name and size: those given in their order, then the missing ones (1)."""
    names = (*degrees, *(d for d in DIMS if d not in degrees))
    return names, tuple(degrees.get(d, 1) for d in names)


# --------------------------------------------------------------------------- parameters as DTensors
#: Each stage's parameters: the attention's (stage 0), the router's and the experts' (stage 1).
STAGE_PARAMS = (("wq", "wk", "wv", "wo"), ("router", "w1", "w2"))
#: Parameters in DDP: every rank holding other tokens has a copy (gradients averaged over them all).
DENSE = ("wq", "wk", "wv", "wo")


def placement_of(name: str) -> Any:
    """Each parameter's placement on the ``(tp,)`` mesh: heads split for attention, each expert's
    hidden units split for the MoE, the router replicated."""
    return {"wq": Shard(1), "wk": Shard(1), "wv": Shard(1), "wo": Shard(0), "router": Replicate(),
            "w1": Shard(2), "w2": Shard(1)}[name]


def build(args: argparse.Namespace, mesh: meshkit.DeviceMesh, stage: int | None) -> Strategy:
    """The library's recipe (:func:`~meshkit.parallel.parallelize_model`, torchtitan's ``parallelize``:
    tensor, then context, then data parallelism): this rank's parameters (all, or its pipeline
    stage's), the attention's as DTensors over tp in a DDP over the ranks holding other tokens, the
    router's and the experts' blocks trained as their MoE reduced them (collective over the mesh)."""
    full = model_math.init_params(config(args))
    return parallelize_model({n: full[n] for n in DENSE} if stage in (None, 0) else {}, mesh,
                             optimizer=lambda: train_mlp.mlp.make_optimizer(args.optimizer, args.lr),
                             tp_plan={n: placement_of(n) for n in DENSE}, context_parallel=args.mesh.get("cp", 1) > 1,
                             dp_dims=("dp", "ep"), strategy="ddp", pp_dim="pp", src_data_rank=None,
                             experts=expert_boxes(full, mesh) if stage in (None, 1) else None)


def expert_boxes(full: dict[str, np.ndarray], mesh: meshkit.DeviceMesh) -> dict[str, ShardedArray]:
    """This rank's blocks of the router (all of it) and the experts (``ep``: which experts; ``tp``:
    which hidden units) as boxes of the global arrays; where other ranks hold the same block, only
    the first of them saves it (the router: one rank of the stage)."""
    ep, tp = mesh["ep"], mesh["tp"]
    e, h = full["w1"].shape[0], full["w1"].shape[2]
    w1, w2 = shard_experts(full["w1"], full["w2"], ep.get_local_rank(), ep.size(), tp.get_local_rank(), tp.size())
    first, hs = ep.get_local_rank() * (e // ep.size()), tp.get_local_rank() * (h // tp.size())
    replica = any(mesh[d].get_local_rank() for d in ("dp", "cp"))
    return {"router": ShardedArray(full["router"].copy(), full["router"].shape, (0, 0),
                                   replica=any(mesh[d].get_local_rank() for d in ("dp", "cp", "ep", "tp"))),
            "w1": ShardedArray(w1, full["w1"].shape, (first, 0, hs), replica=replica),
            "w2": ShardedArray(w2, full["w2"].shape, (first, hs, 0), replica=replica)}


def config(args: argparse.Namespace) -> model_math.Config:
    return model_math.Config(dim=args.dim, heads=args.heads, head_dim=args.head_dim, experts=args.experts,
                             ffn=args.ffn, top_k=args.top_k, causal=args.causal)


# --------------------------------------------------------------------------- the two stages
class AttentionStage:
    """``h = x + attention(x)`` on this rank's heads (tp: the partial outputs summed once) and its
    tokens of each sequence (cp: :func:`meshkit.parallel.ring_attention` passes K and V around the
    ring; head-tail balanced when causal)."""

    names = STAGE_PARAMS[0]

    def __init__(self, cfg: model_math.Config, tp: Any, cp: Any) -> None:
        self.cfg, self.tp, self.cp = cfg, tp, cp
        self.params: dict[str, np.ndarray] = {}
        self.grads: dict[str, np.ndarray] = {}

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        p = self.params
        q, k, v = (np.einsum("bsd,dhe->bhse", x, p[n]) for n in ("wq", "wk", "wv"))
        ctx, ring = ring_attention(q, k, v, self.cp, causal=self.cfg.causal, balanced=self.cfg.causal)
        attn = np.einsum("bhse,hed->bsd", ctx, p["wo"])
        meshkit.all_reduce(attn, group=self.tp)  # Megatron's rowwise output projection
        return x + attn, (x, ctx, ring)

    def backward_input(self, cache: Any, dh: np.ndarray) -> tuple[np.ndarray, Any]:
        """B: nothing before this stage needs the input's gradient; W gets what it needs."""
        return dh, (cache, dh)

    def backward_weight(self, kept: Any) -> None:
        """W: the ring's backward (collective over cp), then the projections' weight gradients."""
        (x, ctx, ring), dh = kept
        p = self.params
        self.grads["wo"] += np.einsum("bhse,bsd->hed", ctx, dh)
        dq, dk, dv = ring_attention_backward(ring, np.einsum("bsd,hed->bhse", dh, p["wo"]))
        for name, d in (("wq", dq), ("wk", dk), ("wv", dv)):
            self.grads[name] += np.einsum("bsd,bhse->dhe", x, d)


class MoEStage:
    """``out = h + moe(h)`` by :class:`meshkit.parallel.MoE`: tokens dispatched to their experts'
    ranks over ``ep``, each expert's hidden units split over ``tp``; its gradients come out reduced."""

    names = STAGE_PARAMS[1]

    def __init__(self, cfg: model_math.Config, tp: Any, p: Any, mesh: meshkit.DeviceMesh) -> None:
        self.layer = MoE(p["router"], p["w1"], p["w2"], top_k=cfg.top_k, ep_group=mesh["ep"], tp_group=tp,
                         dp_group=mesh["replicas"])
        self.params: dict[str, np.ndarray] = {}
        self.grads: dict[str, np.ndarray] = {}

    def forward(self, h: np.ndarray) -> tuple[np.ndarray, Any]:
        b, s, d = h.shape
        y, ctx = self.layer.forward(np.ascontiguousarray(h.reshape(b * s, d)))
        return h + y.reshape(b, s, d), ctx

    def backward_input(self, ctx: Any, dout: np.ndarray) -> tuple[np.ndarray, Any]:
        """B: the input's gradient; the weights' (reduced over the ranks sharing them) wait for W."""
        dx, grads = self.layer.backward(ctx, np.ascontiguousarray(dout.reshape(-1, dout.shape[-1])))
        return dout + dx.reshape(dout.shape), grads

    def backward_weight(self, grads: dict[str, np.ndarray]) -> None:
        for name, g in grads.items():
            self.grads[name] += g


def loss_fn(out: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """The mean squared error over one (micro)batch's elements, and its gradient."""
    diff = out - y
    return 0.5 * float(np.mean(diff ** 2)), diff / diff.size


def run_stages(model: Strategy, stages: list[Any], run: Any) -> Any:
    """Give the stages the parameters' local blocks for one pass (``run()``), then hand each
    accumulated gradient to ``model.mark_grad_ready`` as a DTensor laid out as its parameter."""
    with loop.unsharded(model) as params:
        for st in stages:
            st.params = {n: params[n].to_local() if isinstance(params[n], DTensor) else params[n] for n in st.names}
            st.grads = {n: np.zeros_like(st.params[n]) for n in st.names}
        try:
            result = run()
            for st in stages:
                for name, g in st.grads.items():
                    p = params[name]
                    if isinstance(p, DTensor):
                        g = DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape)
                    model.mark_grad_ready(name, g)
        finally:
            for st in stages:
                st.params, st.grads = {}, {}
    return result


def one_pass(stages: list[Any], x: np.ndarray, y: np.ndarray) -> list[float]:
    """Both stages on this rank, one after the other (no pipeline): the step's pass."""
    attention, moe = stages
    h, c0 = attention.forward(x)
    out, c1 = moe.forward(h)
    loss, dout = loss_fn(out, y)
    dh, kept1 = moe.backward_input(c1, dout)
    moe.backward_weight(kept1)
    _, kept0 = attention.backward_input(c0, dh)
    attention.backward_weight(kept0)
    return [loss]


# --------------------------------------------------------------------------- training
def build_mesh(args: argparse.Namespace) -> meshkit.DeviceMesh:
    names, sizes = full_mesh(args.mesh)
    mesh = meshkit.init_device_mesh("cpu", sizes, mesh_dim_names=names)
    mesh[tuple(d for d in names if d in ("dp", "ep", "cp"))].flatten("tokens")  # different tokens, one model
    mesh[tuple(d for d in names if d in ("dp", "ep"))].flatten("batch")  # different sequences
    mesh[tuple(d for d in names if d in ("dp", "cp"))].flatten("replicas")  # different tokens, the same experts
    mesh[tuple(d for d in names if d != "pp")].flatten("stage")  # one pipeline stage's ranks
    return mesh


SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "zbh1": ScheduleZBH1}


def train(args: argparse.Namespace, progress: bool = True) -> tuple[dict[str, np.ndarray], list[float]]:
    """Train on ``--mesh``; returns the full final parameters (on every rank) and each step's global loss."""
    mesh = build_mesh(args)
    cfg = config(args)
    x, y = model_math.make_data(args.samples, args.seq, cfg)
    pp, tp, batch_ranks = mesh["pp"], mesh["tp"].get_group(), mesh["batch"]
    piped = pp.size() > 1
    stage = pp.get_local_rank() if piped else None
    model = build(args, mesh, stage)
    stages = ([AttentionStage(cfg, tp, mesh["cp"])] if stage in (None, 0) else []) + \
             ([MoEStage(cfg, tp, model.params, mesh)] if stage in (None, 1) else [])
    schedule = None
    if piped:
        pipe = PipelineStage(stages[0].forward, None, stage, 2, group=pp, backward_input=stages[0].backward_input,
                             backward_weight=stages[0].backward_weight)
        schedule = SCHEDULES[args.schedule](pipe, args.microbatches, loss_fn)
    manager = CheckpointManager(args.checkpoint_dir, max_to_keep=args.max_to_keep) if args.checkpoint_dir else None
    start = resume(manager, model, args) if args.resume else 0

    def run_pass(model: Strategy, step: int) -> list[float] | None:
        batch = model_math.batch_indices(step, args.samples, args.batch)
        idx = np.array_split(batch, batch_ranks.size())[batch_ranks.get_local_rank()]  # a contiguous share
        xs, ys = (shard_sequence(a[idx], mesh["cp"], balanced=cfg.causal, axis=1) for a in (x, y))  # cp's tokens
        if schedule is None:
            return run_stages(model, stages, lambda: one_pass(stages, xs, ys))
        return run_stages(model, stages, lambda: schedule.step(xs if stage == 0 else None,
                                                                target=ys if stage == 1 else None))

    def global_loss(losses: list[float] | None) -> float:
        mean = np.array([float(np.mean(losses)) if losses is not None else 0.0])
        meshkit.all_reduce(mean, meshkit.ReduceOp.MAX, group=pp.get_group())  # from the last stage (losses >= 0)
        meshkit.all_reduce(mean, meshkit.ReduceOp.AVG, group=mesh["tokens"].get_group())
        return float(mean[0])

    losses = loop.train(model, range(start, args.steps), run_pass, global_loss=global_loss,
                        progress=progress and meshkit.get_rank() == 0, after_step=saver(manager, model, args))
    params = model.full_state_dict()["model"]
    if piped:  # each stage's parameters, to every rank
        parts: list[Any] = [None] * pp.size()
        meshkit.all_gather_object(parts, params, group=pp.get_group())
        params = {name: value for part in parts for name, value in part.items()}
    return params, losses


def train_reference(args: argparse.Namespace) -> tuple[dict[str, np.ndarray], list[float]]:
    """Single-process training on the global batch, in plain NumPy (``transformer.loss_and_grads``)."""
    cfg = config(args)
    x, y = model_math.make_data(args.samples, args.seq, cfg)
    params = model_math.init_params(cfg)
    optimizer = train_mlp.mlp.make_optimizer(args.optimizer, args.lr)
    losses = []
    for step in range(args.steps):
        idx = model_math.batch_indices(step, args.samples, args.batch)
        loss, grads = model_math.loss_and_grads(params, x[idx], y[idx], cfg)
        optimizer.step(params, grads)
        losses.append(loss)
    return params, losses


def state_dict(model: Strategy, step: int) -> dict[str, Any]:
    """This rank's parameters and optimizer state (views; keys by global name, so any mesh loads them)."""
    return {**model.state_dict(), "step": step}


def saver(manager: CheckpointManager | None, model: Strategy, args: argparse.Namespace) -> Any:
    if manager is None or not args.save_every:
        return None

    def save(done: int) -> None:
        if done % args.save_every == 0:
            manager.save(done, state_dict(model, done))
    return save


def resume(manager: CheckpointManager, model: Strategy, args: argparse.Namespace) -> int:
    sd = state_dict(model, 0)
    step = manager.restore(sd)
    if step is None:
        if meshkit.get_rank() == 0:
            print(f"--resume: no checkpoint in {manager.directory}; starting at step 0", flush=True)
        return 0
    if step > args.steps:
        train_mlp.usage_error(f"argument --steps: {args.steps} is below the step of the checkpoint in "
                              f"{manager.directory} (step {step}); give --steps {step} or more")
    model.load_state_dict(sd)  # what was loaded in place (views) is not copied again
    if meshkit.get_rank() == 0:
        print(f"resumed from step {sd['step']} of {manager.directory}", flush=True)
    return int(sd["step"])


# --------------------------------------------------------------------------- the command line
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="train_transformer.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mesh", type=parse_mesh, default=None, metavar="NAME=N,...",
                        help=f"the degree of each dimension among {', '.join(DIMS)}, outermost first, their "
                             "product the number of ranks (default: dp=N)")
    parser.add_argument("--steps", type=train_mlp.int_at_least(1), default=20, help="default: %(default)s")
    parser.add_argument("--batch", type=train_mlp.int_at_least(1), default=8,
                        help="global batch of sequences, divisible by dp (default: %(default)s)")
    parser.add_argument("--samples", type=train_mlp.int_at_least(1), default=64, help="default: %(default)s")
    parser.add_argument("--seq", type=train_mlp.int_at_least(1), default=8, help="sequence length (default: %(default)s)")
    parser.add_argument("--dim", type=train_mlp.int_at_least(1), default=16, help="model width (default: %(default)s)")
    parser.add_argument("--heads", type=train_mlp.int_at_least(1), default=4, help="divisible by tp (default: %(default)s)")
    parser.add_argument("--head-dim", type=train_mlp.int_at_least(1), default=4, help="default: %(default)s")
    parser.add_argument("--experts", type=train_mlp.int_at_least(1), default=4, help="default: %(default)s")
    parser.add_argument("--ffn", type=train_mlp.int_at_least(1), default=8,
                        help="each expert's hidden units, divisible by tp (default: %(default)s)")
    parser.add_argument("--top-k", type=train_mlp.int_at_least(1), default=2,
                        help="experts per token, at most --experts (default: %(default)s)")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True,
                        help="causal attention (default: %(default)s)")
    lr_defaults = ", ".join(f"{lr:g} for {name}" for name, lr in train_mlp.DEFAULT_LR.items())
    parser.add_argument("--lr", type=train_mlp.positive_float, default=None,
                        help=f"learning rate (default: {lr_defaults})")
    parser.add_argument("--optimizer", default="adamw", choices=tuple(train_mlp.DEFAULT_LR), help="default: %(default)s")
    parser.add_argument("--schedule", default="1f1b", choices=tuple(SCHEDULES),
                        help="the pipeline schedule when pp=2 (default: %(default)s)")
    parser.add_argument("--microbatches", type=train_mlp.int_at_least(1), default=2,
                        help="microbatches per step when pp=2, dividing each dp rank's batch (default: %(default)s)")
    train_mlp.add_checkpoint_flags(parser, saved_by="a run on any --mesh")
    parser.add_argument("--check", action="store_true",
                        help="train in one process on the global batch too (plain NumPy) and compare the final "
                             "parameters to 1e-10")
    return parser


def _problem(args: argparse.Namespace, world_size: int) -> str | None:
    product = math.prod(args.mesh.values())
    if product != world_size:
        return (f"argument --mesh: {','.join(f'{k}={v}' for k, v in args.mesh.items())} is a mesh of {product} ranks; "
                f"this run has {world_size}")
    dp, tp, pp, ep = (args.mesh.get(d, 1) for d in ("dp", "tp", "pp", "ep"))
    if pp > 2:
        return f"argument --mesh: pp={pp}, but the block has two stages (attention, the experts): use pp=1 or pp=2"
    if args.batch % (dp * ep):
        return (f"argument --batch: {args.batch} does not divide over dp x ep = {dp * ep} ranks holding other "
                f"sequences; use a multiple of {dp * ep}")
    cp = args.mesh.get("cp", 1)
    chunks = 2 * cp if args.causal else cp  # causal: head-tail balanced, two chunks a rank
    if args.seq % chunks:
        return (f"argument --seq: {args.seq} does not split into {chunks} equal chunks over cp={cp}"
                f"{' (head-tail balanced: two a rank)' if args.causal else ''}; use a multiple of {chunks}")
    if args.experts % ep:
        return f"argument --experts: {args.experts} does not divide over ep={ep}; use a multiple of {ep}"
    if pp == 2 and (args.batch // (dp * ep)) % args.microbatches:
        return (f"argument --microbatches: {args.microbatches} does not divide each rank's batch of "
                f"{args.batch // (dp * ep)} sequences")
    if args.heads % tp:
        return f"argument --heads: {args.heads} does not divide over tp={tp}; use a multiple of {tp}"
    if args.ffn % tp:
        return f"argument --ffn: {args.ffn} does not divide over tp={tp}; use a multiple of {tp}"
    if args.top_k > args.experts:
        return f"argument --top-k: {args.top_k} is larger than --experts {args.experts}"
    if args.check and args.top_k == 1 and args.optimizer == "adamw":
        # Measured (dp=2,ep=2, 20 steps): the router 7.1e-11 of its scale off the reference with
        # AdamW, 4.5e-18 with SGD, every other parameter below 6e-16; 30 steps pass 1e-10.
        return ("argument --check: with --top-k 1 every token's gate is 1, so the router's gradient is 0 but for "
                "rounding (about 1e-17), and AdamW divides it by its own running size into steps of up to the "
                "learning rate: the router then follows each run's rounding (7e-11 of its scale off the reference "
                "after 20 steps, growing with the steps), not its training, and no tolerance tells that from a "
                "bug; check --top-k 1 with --optimizer sgd, or --top-k 2 or more with adamw (the router does not "
                "train with --top-k 1 either way)")
    if args.batch > args.samples:
        return f"argument --batch: {args.batch} is larger than --samples {args.samples}"
    return train_mlp.checkpoint_problem(args)


def parse_args(argv: Sequence[str] | None = None, *, rank: int = 0, world_size: int = 1) -> argparse.Namespace:
    return train_mlp.parse_for_world(build_parser(), argv, rank=rank, world_size=world_size,
                                     default_mesh=lambda n: {"dp": n}, problem=_problem)


def main(argv: list[str] | None = None) -> int:
    meshkit.init_process_group("auto")
    rank, world = meshkit.get_rank(), meshkit.get_world_size()
    try:
        args = parse_args(argv, rank=rank, world_size=world)
    except SystemExit:
        meshkit.destroy_process_group()
        raise
    params, losses = train(args)
    status = 0
    if rank == 0:
        mesh = ",".join(f"{k}={v}" for k, v in args.mesh.items())
        span = f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "no steps left to train"
        print(f"transformer block on {mesh} ({world} rank{'s' if world > 1 else ''}): {span}", flush=True)
    if args.check:
        reference, _ = train_reference(args)
        results = [train_mlp.compare_params("float64", params, reference)]
        status = 0 if train_mlp.agreed(results, "float64") else 1
    meshkit.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
