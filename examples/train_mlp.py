"""Train a NumPy MLP classifier with data parallelism on meshkit.

    meshkit-run -n 4 examples/train_mlp.py                 # DDP, 200 steps, progress bar
    meshkit-run -n 4 examples/train_mlp.py --check         # ... and compare with one process
    meshkit-run -n 4 examples/train_mlp.py --strategy zero2 --optimizer adamw --check
    meshkit-run -n 4 examples/train_mlp.py --strategy fsdp --check      # one unit per layer
    meshkit-run -n 4 examples/train_mlp.py --strategy hsdp --mesh 2x2 --check
    meshkit-run -n 4 examples/train_mlp.py --hook fp16 --check          # DDP, float16 communication
    python examples/train_mlp.py --steps 50                # a world of one
    meshkit-run -n 2 examples/train_mlp.py --device cuda --check       # CuPy arrays, NCCL, one GPU per rank
    meshkit-run -n 4 examples/train_mlp.py --strategy fsdp --checkpoint-dir ckpt --save-every 50
    meshkit-run -n 2 examples/train_mlp.py --strategy zero2 --checkpoint-dir ckpt --resume --check
    meshkit-run -n 2:4 --max-restarts 3 examples/train_mlp.py --checkpoint-dir ckpt --save-every 10 --resume --check

The model (``mlp.py`` beside this file) is a tanh MLP with a softmax cross-entropy loss and a
hand-written backward pass that hands each layer's gradients to the strategy as soon as they
are computed. DDP and ZeRO-1/2 keep full parameters on every rank; FSDP (ZeRO-3) and hybrid
sharding gather each layer only while it runs (prefetching the next) and reduce-scatter its
gradients at once. Every step draws the same global batch on every rank, and each rank trains
on its contiguous share, so the run is comparable, step for step, with single-process training
on the global batch. ``--check`` trains that reference and compares, at the tolerance the run
promises (see :func:`compare`): exact averaging, the final parameters to 1e-10 (float64) or
1e-5 (float32); ``--hook fp16``, every step's loss to what float16 rounding allows;
``--hook powersgd`` (an approximation), the warm-up steps exactly and the final loss to 10% of
the loss decrease. Rank 0 shows a progress bar (tqdm) and prints the results.

``--device cuda`` trains CuPy arrays on one GPU per rank (the NCCL engine, which ``auto`` picks
where CuPy sees a GPU): the data is copied to the device once, and each step brings one scalar
(its loss) back to the host. Without a GPU it is a usage error (exit 2).

``--checkpoint-dir DIR --save-every K`` saves a sharded checkpoint (:mod:`meshkit.checkpoint`)
every K steps, each rank writing its own shard (``--max-to-keep K`` keeps only the K newest);
``--resume`` continues from the newest complete one, with any strategy on any number of ranks
(the checkpoint is resharded on load), and ``--check`` still compares with uninterrupted
single-process training. Under ``meshkit-run --max-restarts`` the same command line resumes each
restart, on however many ranks it gets, to the same result: the data of a step depends on the
step alone (``mlp.batch_indices``), and each rank takes a contiguous, equal share of it
(docs/elastic.md, "The rule that keeps the result exact").
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, Sequence

import numpy as np

import meshkit
import loop  # the examples' one training loop, beside this file
import mlp  # the model, beside this file
from meshkit.comm.engines.cuda_runtime import gpu_available
from meshkit.checkpoint import CheckpointError, CheckpointManager, get_state_dict, set_state_dict
from meshkit import elastic
from meshkit.comm import RankFailedError
from meshkit.parallel import LocalStrategy, PowerSGDState, array_namespace, fp16_compress_hook, powersgd_hook, survive

#: Default learning rate per optimizer. AdamW moves every element by about lr whatever its
#: gradient; at 0.05 this model's training amplifies rounding (4 ranks, 200 steps: float32 sums
#: in another order than one process end 6e-3 apart, float64 2e-11); at 0.01, 1e-6 and 1e-15.
DEFAULT_LR = {"sgd": 0.05, "adamw": 0.01}
HOOKS = ("allreduce", "fp16", "powersgd")
#: DDP's and ZeRO's bucket cap (torch's default); the first bucket is capped at min(1, cap).
DEFAULT_BUCKET_CAP_MB = 25.0
#: PowerSGD's settings in this example: rank-2 approximations after 10 steps of plain averaging.
POWERSGD_RANK, POWERSGD_START = 2, 10
#: ``--hook powersgd --check``: the final loss within this fraction of exact training's decrease.
POWERSGD_LOSS_TOL = 0.1
#: float16's unit roundoff (10 stored mantissa bits).
FLOAT16_UNIT = 2.0 ** -11


# --------------------------------------------------------------------------- training
def train_reference(args: argparse.Namespace, hidden: Sequence[int] = (64, 64)
                    ) -> tuple[dict[str, np.ndarray], list[float]]:
    """Single-process training on the global batch: what every strategy must reproduce."""
    x, y = mlp.make_data(args.samples)
    params = mlp.init_params(hidden, dtype=np.dtype(args.dtype))
    model = LocalStrategy(params, optimizer=mlp.make_optimizer(args.optimizer, args.lr))  # the library's reference
    losses = loop.train(model, range(args.steps),
                        lambda model, step: mlp_pass(model, x, y, mlp.batch_indices(step, args.samples, args.batch)),
                        global_loss=float)
    return model.params, losses


def mlp_pass(model: Any, x: Any, y: Any, idx: Any) -> float:
    """The MLP's forward and backward pass on samples ``idx`` (the loop's ``run_pass``): each
    layer's unit unsharded while it runs, each gradient marked ready as soon as it is known."""
    acts = mlp.forward_layers(model, x[idx])
    loss, dlogits = mlp.loss_and_grad_logits(acts[-1], y[idx])
    mlp.backward_layers(model, acts, dlogits)
    return loss


def build(args: argparse.Namespace, comm_hook: Any = None, comm_state: Any = None) -> Any:
    """The strategy of ``args`` over all ranks (collective)."""
    return mlp.build(args.strategy, dtype=args.dtype, optimizer=args.optimizer, lr=args.lr,
                     bucket_cap_mb=args.bucket_cap_mb or DEFAULT_BUCKET_CAP_MB,
                     hsdp_mesh=args.mesh if args.strategy == "hsdp" else None,
                     comm_hook=comm_hook, comm_state=comm_state, device=args.device)


def train(args: argparse.Namespace, comm_hook: Any = None, comm_state: Any = None,
          progress: bool = True) -> tuple[dict[str, np.ndarray], list[float]]:
    """Train with ``--strategy``: each rank takes its share of every global batch.

    Returns the full final parameters (NumPy arrays: a GPU run's are copied to the host once, at
    the end) and every step's loss over the global batch.
    """
    rank, world = meshkit.get_rank(), meshkit.get_world_size()
    if args.batch % world:
        raise ValueError(f"train_mlp: rank {rank}: --batch {args.batch} does not divide over {world} ranks")
    x, y = mlp.to_device(mlp.make_data(args.samples), args.device)  # once; batches are gathered there
    xp = array_namespace(x)
    # build(); or, on a spare of meshkit-run --spares that took a failed rank's place, the survivors' state and step
    model, start = survive.start(lambda: build(args, comm_hook, comm_state))
    joined = survive.last_recovery() is not None
    manager = CheckpointManager(args.checkpoint_dir, max_to_keep=args.max_to_keep) if args.checkpoint_dir else None
    if args.resume and not joined:
        start = resume(manager, model, args)  # the strategy holds its optimizer

    def run_pass(model: Any, step: int) -> float:
        # the rank and world size of now: under meshkit-run --survive a failure shrinks the world
        rank, world = meshkit.get_rank(), meshkit.get_world_size()
        idx = np.array_split(mlp.batch_indices(step, args.samples, args.batch), world)[rank]
        return mlp_pass(model, x, y, xp.asarray(idx))  # on a GPU: the indices go to the device (a small copy)

    losses: list[float] = []  # every step's, whichever world took it

    def global_loss(loss: float) -> float:
        mean = np.array([loss])
        meshkit.all_reduce(mean, meshkit.ReduceOp.AVG)
        losses.append(float(mean[0]))
        return losses[-1]

    step = start
    if joined:  # the losses so far, as the survivors share them after a shrink (below)
        box: list[Any] = [None]
        meshkit.broadcast_object_list(box, src=survive.last_recovery().source)
        losses[:] = box[0]
        start = step - len(losses)  # where the survivors began: their next recovery slices the losses alike
    while True:
        try:
            loop.train(model, range(step, args.steps), run_pass, global_loss=global_loss,
                       progress=progress and rank == 0, after_step=saver(manager, model, args))
            break
        except RankFailedError:
            if not elastic.survive_budget():
                raise
            # meshkit-run --survive: the world, mesh, groups and state on the survivors; redo the step
            model, step = survive.shrink(model, lambda: build(shrunk_args(args), comm_hook, comm_state))
            box = [losses[:step - start]]  # the source took the step: its losses count
            meshkit.broadcast_object_list(box, src=survive.last_recovery().source)
            losses[:] = box[0]
    return model.full_state_dict()["model"], losses  # NumPy arrays, full size, on every rank


def shrunk_args(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` for the world after a shrink (``--survive``): hsdp's default mesh adapts as on a restart
    (:func:`default_hsdp_mesh`); a ``--mesh`` given on the command line that no longer fits ends the job."""
    world = meshkit.get_world_size()
    if args.strategy != "hsdp" or args.mesh[0] * args.mesh[1] == world:
        return args
    if args.mesh_given:
        raise ValueError(f"train_mlp: rank {meshkit.get_rank()}: argument --mesh: {args.mesh[0]}x{args.mesh[1]} "
                         f"cannot shrink to the {world} ranks left after a failure; leave --mesh out to let hsdp's "
                         "mesh adapt (2 x N/2 for an even N, else 1 x N)")
    return argparse.Namespace(**{**vars(args), "mesh": default_hsdp_mesh(world)})


def default_hsdp_mesh(world_size: int) -> tuple[int, int]:
    """hsdp's mesh without ``--mesh``: 2 x N/2 for an even N, else 1 x N (restarts and shrinks take it again)."""
    return (2, world_size // 2) if world_size % 2 == 0 else (1, world_size)


def saver(manager: CheckpointManager | None, model: Any, args: argparse.Namespace) -> Callable[[int], None] | None:
    """The loop's ``after_step``: save a checkpoint of ``model`` every ``--save-every`` steps (or None)."""
    if manager is None or not args.save_every:
        return None

    def save(done: int) -> None:
        if done % args.save_every == 0:
            manager.save(done, state_dict(model, done, args))
    return save


#: The flags that decide a run's trajectory besides the model: a checkpoint records them, and
#: ``--resume --check`` refuses a run that differs (its reference trains every step with this
#: run's flags, so it would not be the run that was interrupted).
RUN_FLAGS = ("samples", "batch", "lr", "optimizer", "dtype")


def state_dict(model: Any, step: int, args: argparse.Namespace) -> dict[str, Any]:
    """The checkpoint's contents: the model and optimizer state (views) of ``model``, a strategy
    (its optimizer is its own, :func:`~meshkit.checkpoint.get_state_dict`), the step, and the
    run's :data:`RUN_FLAGS`."""
    model_sd, optim_sd = get_state_dict(model)
    return {"model": model_sd, "optim": optim_sd, "step": step, "run": _run_flags(args)}


def _run_flags(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in RUN_FLAGS}


def resume(manager: CheckpointManager, model: Any, args: argparse.Namespace) -> int:
    """Load the newest complete checkpoint into ``model`` (resharded to this run); the step it
    was saved after, or 0 (and a note) if there is none.

    A checkpoint past ``--steps`` is a usage error (status 2 on every rank, printed by rank 0):
    the run cannot end at step ``--steps``, and ``--check`` would compare it with that many steps
    of training. With ``--check``, so is a checkpoint saved with other :data:`RUN_FLAGS`, naming
    each flag with its saved and current value.
    """
    rank = meshkit.get_rank()
    sd = state_dict(model, 0, args)
    del sd["run"]  # read apart: checkpoints written before the record existed still load
    step = manager.restore(sd)
    if step is None:
        if rank == 0:
            print(f"--resume: no checkpoint in {manager.directory}; starting at step 0", flush=True)
        return 0
    if step > args.steps:  # every rank restored the same step (rank 0's view of the directory decides)
        compared = f", and --check would compare it with {args.steps} steps of training" if args.check else ""
        usage_error(f"argument --steps: {args.steps} is below the step of the checkpoint in {manager.directory} "
                    f"(step {step}): no steps are left to train{compared}; give --steps {step} or more (or "
                    "another --checkpoint-dir)")
    if args.check:
        saved = {"run": {name: None for name in RUN_FLAGS}}
        try:
            manager.load(step, saved)  # collective: every rank gets the same answer
        except CheckpointError:
            saved = None  # an older checkpoint, without the record
        now = _run_flags(args)
        differ = [] if saved is None else [
            f"--{name.replace('_', '-')} {saved['run'][name]} (this run: {now[name]})"
            for name in RUN_FLAGS if saved["run"][name] != now[name]]
        if differ:
            usage_error(f"argument --check: the checkpoint of step {step} in {manager.directory} was saved with "
                        f"{', '.join(differ)}; --check trains every step with this run's flags, so give the saved "
                        "ones (or leave out --check)")
    set_state_dict(model, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    if rank == 0:
        print(f"resumed from step {sd['step']} of {manager.directory}", flush=True)
    return int(sd["step"])


def usage_error(text: str) -> NoReturn:
    """A usage error found after parsing (every rank found it): printed by rank 0, exit 2 everywhere."""
    if meshkit.get_rank() == 0:
        print(f"{sys.argv[0]}: error: {text}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def make_hook(name: str) -> tuple[Any, Any]:
    """DDP's ``(comm_hook, comm_state)`` for ``--hook``: one state per rank (PowerSGD's error feedback)."""
    if name == "fp16":
        return fp16_compress_hook, None
    if name == "powersgd":
        return powersgd_hook, PowerSGDState(rank=POWERSGD_RANK, start_iter=POWERSGD_START)
    return None, None


# --------------------------------------------------------------------------- --check
@dataclass(frozen=True)
class CheckResult:
    """One comparison of ``--check``: what was compared, how far apart, the tolerance and its reason."""

    what: str
    difference: float
    tolerance: float
    why: str

    @property
    def ok(self) -> bool:
        return self.difference <= self.tolerance  # NaN fails

    def line(self) -> str:
        verdict = "OK    " if self.ok else "FAILED"
        relation = "<=" if self.ok else "> "
        return f"  {verdict} {self.what}: {self.difference:.2e} {relation} tolerance {self.tolerance:.2e} ({self.why})"


def exact_tolerance(dtype: str) -> float:
    """Relative tolerance of exact averaging: N ranks sum in another order than one process,
    which float64 keeps within 1e-10 and float32 within 1e-5 over short runs."""
    return 1e-10 if dtype == "float64" else 1e-5


def compare(args: argparse.Namespace, world: int, params: dict[str, np.ndarray], losses: Sequence[float],
            reference: dict[str, np.ndarray], ref_losses: Sequence[float]) -> list[CheckResult]:
    """What ``--check`` compares for ``args`` on ``world`` ranks, at the tolerance the run promises.

    * Exact averaging (every strategy; DDP with ``--hook allreduce``): the final parameters, to
      :func:`exact_tolerance` of each parameter's scale.
    * ``--hook fp16``: each step's gradient goes through float16 (unit roundoff 2^-11): one
      rounding to float16, one for the division by N and N - 1 for the sum, so it is off by up
      to (N + 1) * 2^-11 of itself. To first order, a gradient off by that fraction moves the
      loss by about that fraction of its decrease, which is below the initial loss: every
      step's loss must be within (N + 1) * 2^-11 * (initial loss) of the reference's
      (measured over 1000 steps on 4 ranks: 0.4 of that with AdamW, 0.01 with SGD). Parameters
      are not compared: training amplifies per-step differences (AdamW most), so their
      distance says little about the hook.
    * ``--hook powersgd``: an approximation with error feedback, which promises to train about
      as well, not along the same path. The first ``POWERSGD_START`` steps average exactly, so
      their losses must match to the exact tolerance; the final loss (mean over the last 10% of
      steps) must be within ``POWERSGD_LOSS_TOL`` of the loss decrease exact training achieves
      (measured over 30-1000 steps on 2-4 ranks: 0.01-0.04 of the decrease).
    """
    exact = exact_tolerance(args.dtype)
    losses, ref_losses = np.asarray(losses), np.asarray(ref_losses)
    if args.hook == "fp16":
        return [CheckResult(f"every step's loss vs the reference's, largest difference over {args.steps} steps",
                            float(np.max(np.abs(losses - ref_losses))),
                            float((world + 1) * FLOAT16_UNIT * ref_losses[0]),
                            f"({world} + 1) float16 roundings x 2^-11 x initial loss {ref_losses[0]:.4f}")]
    if args.hook == "powersgd":
        warm = min(args.steps, POWERSGD_START)
        tail = max(1, args.steps // 10)
        final, ref_final = float(losses[-tail:].mean()), float(ref_losses[-tail:].mean())
        decrease = max(float(ref_losses[0]) - ref_final, 0.0)
        return [
            CheckResult(f"losses of the {warm} warm-up steps (plain averaging) vs the reference's, largest "
                        "relative difference",
                        float(np.max(np.abs(losses[:warm] - ref_losses[:warm]) / np.abs(ref_losses[:warm]))),
                        exact, f"exact averaging in {args.dtype}"),
            CheckResult(f"final loss {final:.4f} vs the reference's {ref_final:.4f} (means over the last {tail} "
                        "steps), difference", abs(final - ref_final), POWERSGD_LOSS_TOL * decrease,
                        f"{POWERSGD_LOSS_TOL:g} x the reference's loss decrease {decrease:.4f}"),
        ]
    return [compare_params(args.dtype, params, reference)]


def compare_params(dtype: str, params: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> CheckResult:
    """The final parameters against the reference's, to :func:`exact_tolerance` of each one's scale
    (an element near zero is not held to 1e-10 of itself)."""
    errors = {n: float(np.max(np.abs(params[n] - reference[n]))) / (float(np.max(np.abs(reference[n]))) or 1.0)
              for n in reference}
    worst = max(errors, key=errors.__getitem__)
    return CheckResult(f"final parameters vs the reference's, largest difference relative to the parameter's "
                       f"scale (in {worst!r})", errors[worst], exact_tolerance(dtype), f"exact averaging in {dtype}")


def agreed(results: Sequence[CheckResult], title: str) -> bool:
    """Whether every rank's results are OK (one all-reduce: rank 0 speaks for every rank); rank 0
    prints ``title``, the verdict and each result."""
    agree = np.array([float(all(r.ok for r in results))])
    meshkit.all_reduce(agree, meshkit.ReduceOp.MIN)
    ok = bool(agree[0])
    if meshkit.get_rank() == 0:
        print(f"check against single-process training: {'OK' if ok else 'FAILED'} ({title})")
        for r in results:
            print(r.line())
        sys.stdout.flush()
    return ok


# --------------------------------------------------------------------------- command line
def int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value
    return parse


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def mesh_shape(form: str) -> Callable[[str], tuple[int, int]]:
    """The argparse type of a 2-D mesh flag written ``form`` (``REPLICATExSHARD``, ``DPxTP``)."""
    def parse(text: str) -> tuple[int, int]:
        parts = text.lower().split("x")
        if len(parts) != 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
            raise argparse.ArgumentTypeError(f"expected {form} with two integers >= 1, e.g. 2x2, got {text!r}")
        return int(parts[0]), int(parts[1])
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="train_mlp.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="ddp", choices=mlp.STRATEGIES, help="default: %(default)s")
    parser.add_argument("--mesh", type=mesh_shape("REPLICATExSHARD"), default=None, metavar="RxS",
                        help="replicate x shard degrees of hsdp's 2-D mesh, their product the number of ranks N "
                             "(hsdp only; default: 2x(N/2) for an even N, else 1xN)")
    parser.add_argument("--steps", type=int_at_least(1), default=200, help="default: %(default)s")
    parser.add_argument("--batch", type=int_at_least(1), default=120,
                        help="global batch, a multiple of N and at most --samples (default: %(default)s)")
    parser.add_argument("--samples", type=int_at_least(1), default=4096,
                        help="size of the synthetic data set (default: %(default)s)")
    lr_defaults = ", ".join(f"{lr:g} for {name}" for name, lr in DEFAULT_LR.items())
    parser.add_argument("--lr", type=positive_float, default=None, help=f"learning rate (default: {lr_defaults})")
    parser.add_argument("--optimizer", default="sgd", choices=tuple(DEFAULT_LR), help="default: %(default)s")
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"], help="default: %(default)s")
    parser.add_argument("--bucket-cap-mb", type=positive_float, default=None, metavar="MB",
                        help="bucket cap of ddp, zero1 and zero2 (only), the first bucket capped at min(1, MB) "
                             f"(default: {DEFAULT_BUCKET_CAP_MB:g})")
    parser.add_argument("--hook", default=None, choices=HOOKS,
                        help="ddp's communication hook (ddp only; default: allreduce)")
    add_device_flag(parser, "cuda: CuPy arrays, one GPU per rank (the NCCL engine)")
    add_checkpoint_flags(parser, saved_by="any strategy on any number of ranks")
    parser.add_argument("--check", action="store_true",
                        help="train in one process on the global batch too and compare: exact averaging, the "
                             "final parameters to 1e-10 in float64 or 1e-5 in float32; fp16 and powersgd, the "
                             "losses at the tolerance each promises")
    return parser


def _problem(args: argparse.Namespace, world_size: int) -> str | None:
    """The first problem of ``args`` on ``world_size`` ranks that argparse cannot see, or None."""
    if args.hook is not None and args.strategy != "ddp":
        return (f"argument --hook: {args.hook} applies to --strategy ddp only (ZeRO and FSDP take no "
                f"communication hook), got --strategy {args.strategy}")
    if args.bucket_cap_mb is not None and args.strategy not in ("ddp", "zero1", "zero2"):
        return (f"argument --bucket-cap-mb: {args.bucket_cap_mb:g} applies to --strategy ddp, zero1 or zero2 only "
                f"(FSDP communicates per layer, without buckets), got --strategy {args.strategy}")
    if args.mesh is not None:
        if args.strategy != "hsdp":
            return (f"argument --mesh: {args.mesh[0]}x{args.mesh[1]} applies to --strategy hsdp only, got --strategy "
                    f"{args.strategy}")
        if args.mesh[0] * args.mesh[1] != world_size:
            return (f"argument --mesh: {args.mesh[0]}x{args.mesh[1]} is a mesh of {args.mesh[0] * args.mesh[1]} "
                    f"ranks; this run has {world_size}: use REPLICATExSHARD with REPLICATE x SHARD = {world_size}")
    if args.batch % world_size:
        return (f"argument --batch: {args.batch} does not divide evenly over {world_size} ranks; use a multiple "
                f"of {world_size}")
    device = device_problem(args)
    if device:
        return device
    checkpoint = checkpoint_problem(args)
    if checkpoint:
        return checkpoint
    if args.resume and args.hook in ("fp16", "powersgd"):
        return (f"argument --resume: --hook {args.hook} is checked step by step from step 0 (and PowerSGD's error "
                "feedback is not in the checkpoint); resume with the default allreduce hook")
    if args.batch > args.samples:
        return (f"argument --batch: {args.batch} is larger than --samples {args.samples} (a batch draws distinct "
                "samples); use at most --samples")
    return None


def add_device_flag(parser: argparse.ArgumentParser, cuda: str) -> None:
    """``--device cpu|cuda`` (every example's): ``cuda`` says what runs on the GPUs."""
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help=f"cpu: NumPy arrays; {cuda} (default: %(default)s)")


def device_problem(args: argparse.Namespace) -> str | None:
    """``--device cuda`` without a GPU, as a usage error (every example's check), or None."""
    if args.device == "cuda" and not gpu_available():
        return ("argument --device: cuda needs CuPy with a visible GPU; CuPy (or its driver) sees none here: "
                "use --device cpu, or pip install 'meshkit[cuda12]' on a machine with a GPU")
    return None


def add_checkpoint_flags(parser: argparse.ArgumentParser, *, saved_by: str) -> None:
    """``--checkpoint-dir``, ``--save-every``, ``--max-to-keep`` and ``--resume`` (train_mlp's and
    train_3d's); ``saved_by`` says which runs' checkpoints ``--resume`` takes."""
    parser.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                        help="where --save-every saves and --resume looks (step_<n> checkpoints)")
    parser.add_argument("--save-every", type=int_at_least(1), default=None, metavar="K",
                        help="save a sharded checkpoint every K steps (needs --checkpoint-dir)")
    parser.add_argument("--max-to-keep", type=int_at_least(1), default=None, metavar="K",
                        help="keep only the K newest checkpoints in --checkpoint-dir (default: all)")
    parser.add_argument("--resume", action="store_true",
                        help=f"continue from the newest complete checkpoint in --checkpoint-dir, saved by {saved_by}")


def checkpoint_problem(args: argparse.Namespace) -> str | None:
    """A checkpoint flag without ``--checkpoint-dir``, as a usage error (train_mlp's and train_3d's), or None."""
    if (args.save_every or args.resume or args.max_to_keep) and not args.checkpoint_dir:
        flag = "--save-every" if args.save_every else "--resume" if args.resume else "--max-to-keep"
        return f"argument {flag}: needs --checkpoint-dir DIR"
    return None


def parse_args(argv: Sequence[str] | None = None, *, rank: int = 0, world_size: int = 1) -> argparse.Namespace:
    """Parse and check the command line for a run on ``world_size`` ranks; fill in the defaults.

    Every rank parses the same command line and reaches the same verdict: on a bad flag every
    rank exits with status 2 (``SystemExit``), and only rank 0 prints the usage error (and
    ``--help``).
    """
    parser = build_parser()
    quiet = contextlib.nullcontext() if rank == 0 else silenced()
    with quiet:
        args = parser.parse_args(argv)
        problem = _problem(args, world_size)
        if problem:
            parser.error(problem)
    if args.lr is None:
        args.lr = DEFAULT_LR[args.optimizer]
    if args.hook is None:
        args.hook = "allreduce"
    args.mesh_given = args.mesh is not None
    if args.strategy == "hsdp" and args.mesh is None:
        args.mesh = default_hsdp_mesh(world_size)
    return args


def parse_for_world(parser: argparse.ArgumentParser, argv: Sequence[str] | None, *, rank: int, world_size: int,
                    default_mesh: Callable[[int], Any], problem: Callable[[argparse.Namespace, int], str | None]
                    ) -> argparse.Namespace:
    """The other examples' parse: ``--mesh`` defaulted by ``default_mesh(world_size)``, then
    ``problem(args, world_size)`` as a usage error (printed by rank 0 only, exit 2 everywhere),
    then the optimizer's default learning rate."""
    with contextlib.nullcontext() if rank == 0 else silenced():
        args = parser.parse_args(argv)
        if args.mesh is None:
            args.mesh = default_mesh(world_size)
        error = problem(args, world_size)
        if error:
            parser.error(error)
    if args.lr is None:
        args.lr = DEFAULT_LR[args.optimizer]
    return args


@contextlib.contextmanager
def silenced() -> Any:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def main(argv: list[str] | None = None) -> int:
    meshkit.init_process_group("auto")
    rank, world = meshkit.get_rank(), meshkit.get_world_size()
    try:
        args = parse_args(argv, rank=rank, world_size=world)
    except SystemExit:  # a usage error or --help: the same on every rank
        meshkit.destroy_process_group()
        raise
    params, losses = train(args, *make_hook(args.hook))
    rank, world = meshkit.get_rank(), meshkit.get_world_size()  # fewer after failures under --survive
    status = 0
    if rank == 0:
        ranks = f"{world} rank{'s' if world > 1 else ''}"
        span = f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "no steps left to train"
        print(f"{args.strategy} on {ranks}: {span}", flush=True)
    if args.check:
        results = compare(args, world, params, losses, *train_reference(args))
        hook = f", --hook {args.hook}" if args.strategy == "ddp" else ""
        ok = agreed(results, f"{args.dtype}{hook}")
        if rank == 0:
            if not ok and args.dtype == "float32" and args.hook == "allreduce":
                print("note: in float32, N ranks sum gradients in another order than one process; the "
                      "rounding differences compound over many steps at a high learning rate. The 1e-5 "
                      "bar holds for short runs (a few dozen steps); --dtype float64 checks exactly.")
            sys.stdout.flush()
        status = 0 if ok else 1
    meshkit.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
