"""Train one transformer block (attention, then a mixture of experts) on a mesh of named dimensions.

    meshkit-run -n 4 examples/train_transformer.py --mesh dp=2,tp=2 --check
    meshkit-run -n 4 examples/train_transformer.py --mesh tp=2,dp=2 --no-causal --check
    meshkit-run -n 4 examples/train_transformer.py --mesh pp=2,dp=2 --schedule zbh1 --microbatches 4 --check
    meshkit-run -n 2 examples/train_transformer.py --mesh tp=2 --heads 2 --check
    python examples/train_transformer.py --mesh dp=1 --steps 10 --check      # a world of one

The model is ``transformer.py``'s (beside this file): ``h = x + attention(x)``, ``out = h + moe(h)``,
a mean squared error against a teacher block's output, and a hand-written backward pass. The
``--mesh`` flag names the degree of each dimension, in the order of the mesh's dimensions
(outermost first: ``dp=2,tp=2`` puts tp's ranks next to each other); a missing one is 1 and
their product is the world size:

* ``dp``: the global batch split over ranks (each takes a contiguous, equal share);
* ``tp``: attention's heads and each expert's hidden units split over ranks (Megatron: one
  all-reduce after the attention's output projection and one after the experts);
* ``pp``: two pipeline stages, the attention and the experts, run by ``--schedule``
  (gpipe, 1f1b, zbh1: the backward split into input and weight gradients) over
  ``--microbatches``.

Every step's data depends on the step alone (``transformer.batch_indices``), so the run equals
single-process training on the global batch whatever the mesh: ``--check`` trains that
reference and compares the final parameters (float64, 1e-10). The parameters are DTensors (tp's
blocks); DDP averages the attention's and the router's gradients over the ranks holding other
tokens and, separately, each expert's over the ranks holding the same expert; checkpoints
(``--checkpoint-dir``, ``--save-every``, ``--resume``) resume on another ``--mesh``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from typing import Any, Sequence

import numpy as np

import meshkit
import loop  # the examples' one training loop, beside this file
import train_mlp  # flag types, checkpoint flags, --check's verdict
import transformer as model_math  # the model, beside this file
from meshkit.checkpoint import CheckpointManager, get_state_dict, set_state_dict
from meshkit.parallel import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleZBH1, data_parallel
from meshkit.tensor import DTensor, Replicate, Shard, distribute_tensor

#: The mesh dimensions ``--mesh`` knows.
DIMS = ("dp", "cp", "tp", "ep", "pp")
#: The dimensions this example runs today (cp, ep and pp come with their layers).
SUPPORTED = ("dp", "tp", "pp")


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
#: Parameters every rank holding other tokens has a copy of (their gradients averaged over them all).
DENSE = ("wq", "wk", "wv", "wo", "router")


def placement_of(name: str) -> Any:
    """Each parameter's placement on the ``(tp,)`` mesh: heads split for attention, each expert's
    hidden units split for the MoE, the router replicated."""
    return {"wq": Shard(1), "wk": Shard(1), "wv": Shard(1), "wo": Shard(0), "router": Replicate(),
            "w1": Shard(2), "w2": Shard(1)}[name]


class Together:
    """Several strategies of the data-parallel protocol as one (the loop's ``model``): a name's
    calls go to the strategy holding it. Here: one for the dense parameters (averaged over the
    ranks holding other tokens) and one for the experts (over the ranks holding the same experts)."""

    def __init__(self, strategies: Sequence[Any]) -> None:
        self.strategies = [s for s in strategies if s is not None]
        self.owner = {name: s for s in self.strategies for name in s.params}
        self._units = [(s, u) for s in self.strategies for u in range(len(s.units))]
        self.units = [s.units[u] for s, u in self._units]

    @property
    def params(self) -> dict[str, Any]:
        return {name: s.params[name] for name, s in self.owner.items()}

    def zero_grad(self) -> None:
        for s in self.strategies:
            s.zero_grad()

    def mark_grad_ready(self, name: str, grad: Any) -> None:
        self.owner[name].mark_grad_ready(name, grad)

    def step(self) -> None:
        for s in self.strategies:
            s.step()

    def unshard(self, unit: int) -> Any:
        strategy, inner = self._units[unit]
        return strategy.unshard(inner)

    def prefetch(self, unit: int) -> None:
        strategy, inner = self._units[unit]
        strategy.prefetch(inner)

    def full_state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {"params": {}}
        for s in self.strategies:
            merged["params"].update(s.full_state_dict()["params"])
        return merged


def build(args: argparse.Namespace, mesh: meshkit.DeviceMesh, stage: int | None) -> Together:
    """This rank's parameters (all, or its pipeline stage's) as DTensors over tp, in a DDP for the
    dense ones and one for the experts (collective over the mesh)."""
    full = model_math.init_params(config(args))
    tp = mesh["tp"]
    mine = [n for s, names in enumerate(STAGE_PARAMS) if stage in (None, s) for n in names]
    tensors = {n: distribute_tensor(full[n], tp, [placement_of(n)], src_data_rank=None) for n in mine}
    dense = {n: t for n, t in tensors.items() if n in DENSE}
    experts = {n: t for n, t in tensors.items() if n not in DENSE}
    make = lambda: train_mlp.mlp.make_optimizer(args.optimizer, args.lr)  # noqa: E731
    return Together([data_parallel(dense, mesh["tokens"], "ddp", optimizer=make()) if dense else None,
                     data_parallel(experts, mesh["tokens"], "ddp", optimizer=make()) if experts else None])


def config(args: argparse.Namespace) -> model_math.Config:
    return model_math.Config(dim=args.dim, heads=args.heads, head_dim=args.head_dim, experts=args.experts,
                             ffn=args.ffn, top_k=args.top_k, causal=args.causal)


# --------------------------------------------------------------------------- the two stages
class AttentionStage:
    """``h = x + attention(x)`` on this rank's heads (tp: the partial outputs summed once)."""

    names = STAGE_PARAMS[0]

    def __init__(self, cfg: model_math.Config, tp: Any) -> None:
        self.cfg, self.tp = cfg, tp
        self.params: dict[str, np.ndarray] = {}
        self.grads: dict[str, np.ndarray] = {}

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        attn, cache = model_math.attention_forward(x, self.params, self.cfg.causal)
        meshkit.all_reduce(attn, group=self.tp)  # Megatron's rowwise output projection
        return x + attn, cache

    def backward_input(self, cache: Any, dh: np.ndarray) -> tuple[np.ndarray, Any]:
        """B: nothing before this stage needs the input's gradient; W gets what it needs."""
        return dh, (cache, dh)

    def backward_weight(self, kept: Any) -> None:
        cache, dh = kept
        _, grads = model_math.attention_backward(dh, cache, self.params)
        for name, g in grads.items():
            self.grads[name] += g


class MoEStage:
    """``out = h + moe(h)`` with this rank's hidden units of every expert (tp: partial outputs summed once)."""

    names = STAGE_PARAMS[1]

    def __init__(self, cfg: model_math.Config, tp: Any) -> None:
        self.cfg, self.tp = cfg, tp
        self.params: dict[str, np.ndarray] = {}
        self.grads: dict[str, np.ndarray] = {}

    def forward(self, h: np.ndarray) -> tuple[np.ndarray, Any]:
        b, s, d = h.shape
        moe, cache = model_math.moe_forward(h.reshape(b * s, d), self.params, self.cfg.top_k)
        meshkit.all_reduce(moe, group=self.tp)
        return h + moe.reshape(b, s, d), cache

    def backward_input(self, cache: Any, dout: np.ndarray) -> tuple[np.ndarray, Any]:
        """B: the input's gradient, which needs the experts' whole outputs (summed over tp) for the
        gates; the weights' gradients come out of the same pass and wait for W."""
        h, experts, gates, rcache, per_expert, contributions = cache
        full = contributions.copy()
        meshkit.all_reduce(full, group=self.tp)
        shape = dout.shape
        flat = dout.reshape(-1, shape[-1])
        cache = (h, experts, gates, rcache, per_expert, full)
        dh, grads = model_math.moe_backward(flat, cache, self.params)
        router_path = model_math.router_input_grad(flat, cache, self.params)  # the same on every tp rank
        experts_path = dh - router_path
        meshkit.all_reduce(experts_path, group=self.tp)  # each rank's hidden units' share
        return dout + (experts_path + router_path).reshape(shape), grads

    def backward_weight(self, grads: dict[str, np.ndarray]) -> None:
        for name, g in grads.items():
            self.grads[name] += g


def loss_fn(out: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """The mean squared error over one (micro)batch's elements, and its gradient."""
    diff = out - y
    return 0.5 * float(np.mean(diff ** 2)), diff / diff.size


def run_stages(model: Together, stages: list[Any], run: Any) -> Any:
    """Give the stages the parameters' local blocks for one pass (``run()``), then hand each
    accumulated gradient to ``model.mark_grad_ready`` as a DTensor laid out as its parameter."""
    with loop.unsharded(model) as params:
        for st in stages:
            st.params = {n: params[n].to_local() for n in st.names}
            st.grads = {n: np.zeros_like(st.params[n]) for n in st.names}
        try:
            result = run()
            for st in stages:
                for name, g in st.grads.items():
                    p = params[name]
                    model.mark_grad_ready(name, DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape))
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
    mesh[tuple(d for d in names if d in ("dp", "ep", "cp"))].flatten("tokens")
    return mesh


SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "zbh1": ScheduleZBH1}


def train(args: argparse.Namespace, progress: bool = True) -> tuple[dict[str, np.ndarray], list[float]]:
    """Train on ``--mesh``; returns the full final parameters (on every rank) and each step's global loss."""
    mesh = build_mesh(args)
    cfg = config(args)
    x, y = model_math.make_data(args.samples, args.seq, cfg)
    pp, dp, tp = mesh["pp"], mesh["dp"], mesh["tp"].get_group()
    piped = pp.size() > 1
    stage = pp.get_local_rank() if piped else None
    model = build(args, mesh, stage)
    classes = (AttentionStage, MoEStage)
    stages = [classes[s](cfg, tp) for s in range(2) if stage in (None, s)]
    schedule = None
    if piped:
        pipe = PipelineStage(stages[0].forward, None, stage, 2, group=pp, backward_input=stages[0].backward_input,
                             backward_weight=stages[0].backward_weight)
        schedule = SCHEDULES[args.schedule](pipe, args.microbatches, loss_fn)
    manager = CheckpointManager(args.checkpoint_dir, max_to_keep=args.max_to_keep) if args.checkpoint_dir else None
    start = resume(manager, model, args) if args.resume else 0

    def run_pass(model: Together, step: int) -> list[float] | None:
        idx = np.array_split(model_math.batch_indices(step, args.samples, args.batch), dp.size())[dp.get_local_rank()]
        if schedule is None:
            return run_stages(model, stages, lambda: one_pass(stages, x[idx], y[idx]))
        return run_stages(model, stages, lambda: schedule.step(x[idx] if stage == 0 else None,
                                                                target=y[idx] if stage == 1 else None))

    def global_loss(losses: list[float] | None) -> float:
        mean = np.array([float(np.mean(losses)) if losses is not None else 0.0])
        meshkit.all_reduce(mean, meshkit.ReduceOp.MAX, group=pp.get_group())  # from the last stage (losses >= 0)
        meshkit.all_reduce(mean, meshkit.ReduceOp.AVG, group=mesh["tokens"].get_group())
        return float(mean[0])

    losses = loop.train(model, range(start, args.steps), run_pass, global_loss=global_loss,
                        progress=progress and meshkit.get_rank() == 0, after_step=saver(manager, model, args))
    params = model.full_state_dict()["params"]
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


def state_dict(model: Together, step: int) -> dict[str, Any]:
    """This rank's parameters and optimizer state (views; keys by global name, so any mesh loads them)."""
    merged: dict[str, Any] = {"model": {}, "optim": {"state": {}, "step": {}}, "step": step}
    for strategy in model.strategies:
        model_sd, optim_sd = get_state_dict(strategy)
        merged["model"].update(model_sd)
        for key in ("state", "step"):
            merged["optim"][key].update(optim_sd[key])
    return merged


def saver(manager: CheckpointManager | None, model: Together, args: argparse.Namespace) -> Any:
    if manager is None or not args.save_every:
        return None

    def save(done: int) -> None:
        if done % args.save_every == 0:
            manager.save(done, state_dict(model, done))
    return save


def resume(manager: CheckpointManager, model: Together, args: argparse.Namespace) -> int:
    sd = state_dict(model, 0)
    step = manager.restore(sd)
    if step is None:
        if meshkit.get_rank() == 0:
            print(f"--resume: no checkpoint in {manager.directory}; starting at step 0", flush=True)
        return 0
    if step > args.steps:
        train_mlp.usage_error(f"argument --steps: {args.steps} is below the step of the checkpoint in "
                              f"{manager.directory} (step {step}); give --steps {step} or more")
    for strategy in model.strategies:
        names = set(strategy.params)
        set_state_dict(strategy, model_state_dict={n: v for n, v in sd["model"].items() if n in names},
                       optim_state_dict={key: {n: v for n, v in sd["optim"][key].items() if n in names}
                                         for key in ("state", "step")})
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
    later = [d for d, n in args.mesh.items() if d not in SUPPORTED and n > 1]
    if later:
        return f"argument --mesh: {', '.join(later)} > 1 is not supported by this example yet (it runs {SUPPORTED})"
    dp, tp, pp = args.mesh.get("dp", 1), args.mesh.get("tp", 1), args.mesh.get("pp", 1)
    if pp > 2:
        return f"argument --mesh: pp={pp}, but the block has two stages (attention, the experts): use pp=1 or pp=2"
    if args.batch % dp:
        return f"argument --batch: {args.batch} does not divide over dp={dp}; use a multiple of {dp}"
    if pp == 2 and (args.batch // dp) % args.microbatches:
        return (f"argument --microbatches: {args.microbatches} does not divide each dp rank's batch of "
                f"{args.batch // dp} sequences")
    if args.heads % tp:
        return f"argument --heads: {args.heads} does not divide over tp={tp}; use a multiple of {tp}"
    if args.ffn % tp:
        return f"argument --ffn: {args.ffn} does not divide over tp={tp}; use a multiple of {tp}"
    if args.top_k > args.experts:
        return f"argument --top-k: {args.top_k} is larger than --experts {args.experts}"
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
