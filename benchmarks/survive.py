"""``meshkit-run --survive``: a step when nothing fails, side by side with a plain run, and the way back from a failure.

Run it by hand with plain ``python`` (it starts the jobs itself; a measurement, not a test)::

    python benchmarks/survive.py                        # 4 ranks, DDP, MLP 256x256, 60 steps, 3 repeats
    python benchmarks/survive.py --strategy fsdp        # sharded: the buddy copies' cost too
    python benchmarks/survive.py --hidden 512 --repeats 5 --json benchmarks/results/survive.json
    python benchmarks/survive.py --strategy fsdp --nproc 2 --no-killed --repeats 9   # the 5% bar: paired ratios
    python benchmarks/survive.py --pool results/s-*.json   # several --json runs' pairs pooled, with intervals
    python benchmarks/survive.py --strategy fsdp --spares 1   # a spare takes the lost rank's place (--spares)

Each repeat runs the same training (``--strategy``, DDP by default; examples/mlp.py's MLP, AdamW, float64) under
``meshkit-run -n N`` three times, in an order rotating from repeat to repeat:

* **plain**: MPICH, as every job without ``--survive``;
* **survive**: ``--survive 1`` (Open MPI's wheel with ULFM, over TCP), nothing failing;
* **killed**: ``--survive 1``, rank N-1 SIGKILLed as step ``--kill-at`` starts; the survivors
  shrink and redo the step, and each recovery is reported by phase: detection (the death, by the
  dying rank's clock, to rank 0's RankFailedError), shrink (``meshkit.comm.shrink_world``), state
  (the agreement on the source, its broadcast, the new DDP and its load; for a sharded strategy the
  all-gather of every survivor's shards and buddy copies, the assembly, the new strategy, its load
  and its first buddy copy), redo (the first step after it), replay (the further steps until the
  step that failed is done again: a sharded strategy rolls back to its last buddy renewal, so
  ``--kill-at`` just below a multiple of ``MESHKIT_BUDDY_EVERY`` is the worst case), total (the
  failure to the failed step done).

A sharded strategy under ``--survive`` renews its buddy copy every ``MESHKIT_BUDDY_EVERY`` steps
(unset: 8 while it measures, then the cadence chosen from the measured renewal and step;
:mod:`meshkit.parallel.buddy`): the run reports the cadence it ended with, its bytes
(``memory_report()["buddy"]``), the mean wall time of one renewal and its share of a step (the
renewals' time over the steps), and, in runs without a failure, how far a renewing step's median
stands above the other steps' (the write into a slot last written 2K steps before, cold in the
cache). ``--variant k8:MESHKIT_BUDDY_EVERY=8`` measures a fixed cadence beside it.

``--variant NAME:VAR=VALUE[,VAR=VALUE]`` adds a ``--survive 1`` run per repeat with those variables
(``old:MESHKIT_SHM=0,MESHKIT_BUDDY_SHM=0`` is ``--survive`` before the shared-memory path and the
shared-memory buddy copies), in the same rotation.

The step time is the training loop's wall time over the steps (after a barrier, the import and
set-up excluded; its first step, which connects and maps what the run uses, included); each run
also reports its steady mean, median and fastest step (the first left out), the last two the
figures a loaded machine disturbs least. Every run checks its final parameters against single-process training (1e-10).
The machine may be loaded: say so beside any figure taken from it.

``--pool FILE...`` reads the ``--json`` files of earlier invocations (no job is run) and pools their
pairs per strategy and rank count: for each of the mean, median and fastest step, the median of
every (``--survive`` run / the plain run beside it) ratio, its interquartile range, and a 95%
bootstrap interval of that median (2000 resamples of the pairs, seeded: the same files print the
same figures). On 2 cores, where one pair's ratio ranges over +-30%, a 5% bar is decided by the
interval, not by one invocation's figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import positive_int

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("detection", "shrink", "state", "redo", "replay", "total")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="survive.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=positive_int, default=4, help="ranks (default: %(default)s)")
    parser.add_argument("--hidden", type=positive_int, default=256, help="the MLP's two hidden widths (default: %(default)s)")
    parser.add_argument("--steps", type=positive_int, default=60, help="default: %(default)s")
    parser.add_argument("--kill-at", type=positive_int, default=20, help="the killed run's failure step (default: %(default)s)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="default: %(default)s")
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "zero1", "zero2", "fsdp", "hsdp"],
                        help="examples/mlp.py's strategy (hsdp: 2 x N/2 for an even N, else 1 x N; default: %(default)s)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:VAR=VALUE[,VAR=VALUE]",
                        help="one more --survive run (nothing failing) per repeat, with these variables set, e.g. "
                             "sm:MESHKIT_SURVIVE_TRANSPORT=sm or noshm:MESHKIT_SHM=0 (repeatable)")
    parser.add_argument("--spares", type=int, default=0, metavar="N",
                        help="the --survive runs with meshkit-run --spares N: the lost rank's place taken (default: none)")
    parser.add_argument("--no-killed", action="store_true",
                        help="no killed runs: only the no-failure comparison, so more repeats fit in the time")
    parser.add_argument("--json", type=Path, default=None, help="write the measurements here")
    parser.add_argument("--pool", type=Path, nargs="+", default=None, metavar="FILE",
                        help="pool the pairs of these --json files (runs nothing)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a rank of one run
    return parser.parse_args(argv)


# --------------------------------------------------------------------------- a rank of one run

def worker(args: argparse.Namespace) -> int:
    """One rank: DDP training with the documented recovery loop; rank 0 prints the figures as JSON."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "examples"))
    import mlp

    import meshkit
    from meshkit.comm import RankFailedError
    from meshkit.parallel import LocalStrategy, survive

    hidden, lr, samples, batch = (args.hidden,) * 2, 0.05, 240, 120
    log, victim = os.environ.get("SURVIVE_BENCH_DIR"), args.nproc - 1

    def build() -> Any:
        world = meshkit.get_world_size()
        mesh = ((2, world // 2) if world % 2 == 0 else (1, world)) if args.strategy == "hsdp" else None
        return mlp.build(args.strategy, hidden=hidden, optimizer="adamw", lr=lr, hsdp_mesh=mesh)

    def train_step(model: Any, step: int) -> None:
        rank, world = meshkit.get_rank(), meshkit.get_world_size()
        if log and step == args.kill_at and rank == victim and not Path(log, "died").exists():  # once (a spare
            # that took its place may redo this step)
            Path(log, "died").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        model.zero_grad()
        idx = np.array_split(mlp.batch_indices(step, samples, batch), world)[rank]
        acts = mlp.forward_layers(model, x[idx])
        _, dlogits = mlp.loss_and_grad_logits(acts[-1], y[idx])
        mlp.backward_layers(model, acts, dlogits)
        model.step()

    meshkit.init_process_group("mpi")
    x, y = mlp.make_data(samples)
    model, step = survive.start(build)  # build(); a spare that took a lost rank's place: the survivors' state
    if survive.last_recovery() is None:  # (a spare that joined meets the survivors in their recovery instead)
        meshkit.barrier()
    started, phases, redo, times = time.perf_counter(), {}, None, []
    failed_step, replayed = None, 0
    while step < args.steps:
        try:
            began = time.perf_counter()
            train_step(model, step)
            times.append(time.perf_counter() - began)
            step += 1
            if redo is not None and "redo" not in phases:
                phases["redo"] = time.time() - redo  # the first step after the recovery
            if redo is not None and step > failed_step:  # the step that failed, done: the replay's end
                phases["replay"], redo = time.time() - redo - phases["redo"], None
        except RankFailedError:
            failed_at, failed_step = time.time(), step
            model, step = survive.shrink(model, build)
            redo, recovery, replayed = time.time(), survive.last_recovery(), failed_step - step
            phases = {"detection": failed_at - float(Path(log, "died").read_text()),
                      "shrink": recovery.shrink, "state": recovery.state}
    elapsed = time.perf_counter() - started
    final = model.full_state_dict()["model"]
    if meshkit.get_rank() == 0:
        ref = LocalStrategy(mlp.init_params(hidden), optimizer=mlp.make_optimizer("adamw", lr))
        for s in range(args.steps):
            ref.zero_grad()
            idx = mlp.batch_indices(s, samples, batch)
            acts = mlp.forward_layers(ref, x[idx])
            _, dl = mlp.loss_and_grad_logits(acts[-1], y[idx])
            mlp.backward_layers(ref, acts, dl)
            ref.step()
        diff = max(float(np.max(np.abs(final[k] - ref.params[k]))) for k in ref.params)
        if diff >= 1e-10:
            print(f"survive.py: final parameters differ from single-process training by {diff:.3g}", flush=True)
            return 1
        if phases:
            phases["total"] = sum(phases.values())
        copy = getattr(getattr(model, "shards", None), "buddy", None)
        buddy = {} if copy is None else {"buddy_bytes": model.memory_report()["buddy"],
                                          "buddy_s": copy.seconds / max(copy.refreshes - copy.setups, 1),
                                          "buddy_setup_s": copy.setup_seconds,
                                          "buddy_every": copy.every, "buddy_step_s": (copy.seconds + copy.setup_seconds) / args.steps,
                                          "replayed": replayed}
        if copy is not None and not phases:  # no failure: times[i] is step i, after which the count is i + 1
            renewed = set(copy.renewed)  # the counts renewed at (the cadence may be chosen on the way)
            renewing = [t for i, t in enumerate(times) if i and i + 1 in renewed]
            others = [t for i, t in enumerate(times) if i and i + 1 not in renewed]
            if renewing and others:  # a renewing step's median over the other steps' (the cold slot's write)
                buddy["renew_excess_s"] = statistics.median(renewing) - statistics.median(others)
        steady = sorted(times[1:])  # (the first step allocates: not a steady one)
        print("RESULT " + json.dumps({"step_s": elapsed / args.steps, "step_min_s": steady[0],
                                      "step_median_s": statistics.median(steady), "steady_mean_s": statistics.fmean(steady),
                                      "first_step_s": times[0], "phases": phases, "diff": diff,
                                      **buddy}),
              flush=True)
    meshkit.destroy_process_group()
    return 0


# --------------------------------------------------------------------------- the driver

def variants(specs: list[str]) -> dict[str, dict[str, str]]:
    """``--variant`` specs by name: the variables each sets."""
    out: dict[str, dict[str, str]] = {}
    for spec in specs:
        name, _, rest = spec.partition(":")
        pairs = [p.partition("=") for p in rest.split(",") if p]
        if not name or name in ("plain", "survive", "killed") or name in out or not pairs or any(not k or not e for k, e, _ in pairs):
            raise SystemExit(f"survive.py: --variant {spec!r} is not NAME:VAR=VALUE[,VAR=VALUE] with a new NAME")
        out[name] = {k: v for k, _, v in pairs}
    return out


def run(args: argparse.Namespace, kind: str, extra: dict[str, str] | None = None) -> dict[str, Any]:
    """One job of ``kind`` (plain, survive, killed, or a variant: survive with ``extra`` variables); rank 0's figures."""
    options = [] if kind == "plain" else ["--survive", "1", *(["--spares", str(args.spares)] if args.spares else [])]
    with tempfile.TemporaryDirectory(prefix="survive-bench-") as log:
        env = {**os.environ, **({"SURVIVE_BENCH_DIR": log} if kind == "killed" else {}), **(extra or {})}
        command = [sys.executable, "-m", "meshkit.launch", "-n", str(args.nproc), *options, __file__, "--worker",
                   "--nproc", str(args.nproc), "--hidden", str(args.hidden), "--steps", str(args.steps),
                   "--kill-at", str(args.kill_at), "--strategy", args.strategy]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    found = re.search(r"RESULT (\{.*\})", done.stdout)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"survive.py: the {kind} run failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    return json.loads(found.group(1))


def _cell(values: list[float], scale: float = 1.0) -> str:
    if not values:
        return f"{'-':>8} {'-':>8} {'-':>8}"
    return " ".join(f"{v * scale:8.3f}" for v in (statistics.median(values), min(values), max(values)))


def _paired(results: dict[str, list[dict[str, Any]]], kind: str, key: str) -> str:
    ratios = [r[key] / p[key] for r, p in zip(results[kind], results["plain"])]
    return f"{statistics.median(ratios):.3f}x [{min(ratios):.3f}, {max(ratios):.3f}]"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    if args.pool:
        print(pooled(args.pool))
        return 0
    if args.kill_at >= args.steps:
        raise SystemExit(f"survive.py: --kill-at {args.kill_at} must be below --steps {args.steps}")
    extra = variants(args.variant)
    kinds = ("plain", "survive", *(() if args.no_killed else ("killed",)), *extra)
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for repeat in range(args.repeats):
        turn = repeat % len(kinds)
        for kind in kinds[turn:] + kinds[:turn]:
            results[kind].append(run(args, kind, extra.get(kind)))
        print(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(
            f"{k} {results[k][-1]['step_s'] * 1e3:.2f} ms a step" for k in kinds), flush=True)
    print(f"\n# {args.strategy} on {args.nproc} ranks, MLP {args.hidden}x{args.hidden}, {args.steps} steps, {args.repeats} repeats")
    print(f"{'ms a step':>22} {'median':>8} {'min':>8} {'max':>8}")
    for key, what in STATISTICS:
        print(f"{what + ' step, ms':>22}")
        for kind in ("plain", "survive", *extra):
            print(f"{kind:>22} {_cell([r[key] for r in results[kind]], 1e3)}")
    for key, what in STATISTICS:
        plain = statistics.median(r[key] for r in results["plain"])
        print(f"{what} step / plain's: " + ", ".join(
            f"{kind} {statistics.median(r[key] for r in results[kind]) / plain:.3f}x" for kind in ("survive", *extra)))
    print("(each run's mean (all steps: the first's set-up included), steady mean (the first left out), median and "
          "fastest step; the table's median, min and max over the repeats; the ratios "
          "median over median. On a loaded machine the fastest step is the least disturbed figure.)")
    # paired: each repeat's run over the plain run of the same repeat (run next to it), so a slow spell of the
    # machine moves both; the median of those ratios and their spread
    for key, what in STATISTICS:
        print(f"paired {what} step / plain's, median [min, max] over repeats: " + ", ".join(
            f"{kind} {_paired(results, kind, key)}" for kind in ("survive", *extra)))
    for kind in ("survive", *extra):
        copies = [r for r in results[kind] if "buddy_s" in r]
        if copies:
            print(f"buddy copy{'' if kind == 'survive' else f' ({kind})'}: {copies[0]['buddy_bytes']} bytes a rank; one "
                  f"exchange {_cell([r['buddy_s'] for r in copies], 1e3)} ms (median min max; the first, which maps "
                  f"the segments, apart: {_cell([r['buddy_setup_s'] for r in copies], 1e3)} ms); renewed every "
                  f"{copies[0]['buddy_every']} steps: a step's share {_cell([r['buddy_step_s'] for r in copies], 1e3)} "
                  "ms, the first included")
            excess = [r["renew_excess_s"] for r in copies if "renew_excess_s" in r]
            if excess:
                print(f"  a renewing step over the median of the others, ms (median min max): {_cell(excess, 1e3)}")
    if args.no_killed:
        return _write(args, results)
    replays = sorted({r.get("replayed", 0) for r in results["killed"]})
    print(f"\n# rank {args.nproc - 1} SIGKILLed as step {args.kill_at} starts: failure -> the failed step done again, "
          f"seconds (steps replayed before it: {replays})")
    print(f"{'phase':>22} {'median':>8} {'min':>8} {'max':>8}")
    for phase in PHASES:
        print(f"{phase:>22} {_cell([r['phases'][phase] for r in results['killed'] if phase in r['phases']])}")
    return _write(args, results)


#: Each run's statistics of a step, by their key in its RESULT: the mean over all steps (the first,
#: which sets up, included), the mean, median and minimum of the others.
STATISTICS = (("step_s", "mean"), ("steady_mean_s", "steady mean"), ("step_median_s", "median"),
              ("step_min_s", "fastest"))

def pooled(files: list[Path], resamples: int = 2000) -> str:
    """The pairs of ``files`` (``--json`` outputs) pooled per (strategy, ranks): each statistic's
    median ratio ``--survive`` / plain, its quartiles and a 95% bootstrap interval of the median."""
    groups: dict[tuple[str, str], list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for file in files:
        try:
            doc = json.loads(file.read_text())
            key = (doc["args"]["strategy"], doc["args"]["nproc"])
            pairs = list(zip(doc["plain"], doc["survive"], strict=True))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"survive.py: --pool {file}: not a --json output of this benchmark ({exc})") from None
        groups.setdefault(key, []).extend(pairs)
    lines = ["# --survive step / plain step, every pair of the files pooled: median [quartiles] (95% interval of the "
             "median, bootstrap)"]
    rng = random.Random(0)
    for (strategy, nproc), pairs in sorted(groups.items()):
        cells = []
        for key, what in STATISTICS:
            if not all(key in p and key in s for p, s in pairs):  # (files of earlier versions lack some)
                continue
            ratios = [s[key] / p[key] for p, s in pairs]
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
            boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
            low, high = boot[int(0.025 * resamples)], boot[int(0.975 * resamples) - 1]
            cells.append(f"{what} {statistics.median(ratios):.3f} [{q[0]:.2f}-{q[-1]:.2f}] ({low:.3f}-{high:.3f})")
        lines.append(f"{strategy} on {nproc} ranks, {len(pairs)} pairs: " + "; ".join(cells))
    return "\n".join(lines)


def _write(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> int:
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
