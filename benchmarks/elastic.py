"""What a lost rank costs an elastic job: the time from the failure to the first step after the restart.

Run it by hand with plain ``python`` (it starts the jobs itself; a measurement, not a test)::

    python benchmarks/elastic.py                              # 4 ranks, fsdp, 3 repeats
    python benchmarks/elastic.py --nproc 2 --strategy ddp --repeats 5
    python benchmarks/elastic.py --json benchmarks/results/elastic.json

Each repeat runs ``examples/train_mlp.py --checkpoint-dir DIR --save-every K --resume --check``
under ``meshkit-run -n N`` twice, in an order alternating from repeat to repeat:

* **uninterrupted**: no failure;
* **killed**: ``--max-restarts 1 --restart-report FILE``; once the checkpoint of step
  ``--kill-after`` is complete, this script SIGKILLs one rank's process from outside (as the
  kernel's OOM killer would: the rank's pid read from the launcher's status directory), and the
  job restarts and resumes from that checkpoint.

Both must end with ``--check`` passing (their final parameters equal single-process training to
1e-10). The table shows, per phase of the way back (:mod:`meshkit.launch.restarts`: detection,
teardown, delay, relaunch, imports, rendezvous, checkpoint load, first step), the median, min and
max over repeats as the launcher reported them, and the job's wall time killed vs uninterrupted
(their ratio: what the failure cost, including the steps redone since the checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
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
TRAIN = ROOT / "examples" / "train_mlp.py"
PHASES = ("detection_s", "teardown_s", "delay_s", "relaunch_s", "imports_s", "rendezvous_s", "checkpoint_load_s",
          "first_step_s", "total_s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="elastic.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=positive_int, default=4, help="ranks (default: %(default)s)")
    parser.add_argument("--strategy", default="fsdp", choices=("ddp", "zero1", "zero2", "fsdp", "hsdp"),
                        help="train_mlp's --strategy (default: %(default)s)")
    parser.add_argument("--steps", type=positive_int, default=60, help="default: %(default)s")
    parser.add_argument("--save-every", type=positive_int, default=10, help="default: %(default)s")
    parser.add_argument("--kill-after", type=positive_int, default=20,
                        help="kill a rank once this step's checkpoint is complete (default: %(default)s)")
    parser.add_argument("--victim", type=int, default=None, help="the rank to kill (default: the last)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="default: %(default)s")
    parser.add_argument("--json", type=Path, default=None, help="write the measurements here")
    args = parser.parse_args(argv)
    if args.kill_after % args.save_every or args.kill_after >= args.steps:
        parser.error(f"argument --kill-after: {args.kill_after} must be a multiple of --save-every {args.save_every} "
                     f"below --steps {args.steps}")
    args.victim = args.nproc - 1 if args.victim is None else args.victim
    if not 0 <= args.victim < args.nproc:
        parser.error(f"argument --victim: {args.victim} is not a rank of {args.nproc}")
    return args


def _launcher(args: argparse.Namespace, workdir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "meshkit.launch", "-n", str(args.nproc), *extra, str(TRAIN),
            "--strategy", args.strategy, "--steps", str(args.steps), "--checkpoint-dir", str(workdir / "ckpt"),
            "--save-every", str(args.save_every), "--resume", "--check"]


def _finish(proc: subprocess.Popen[str], what: str) -> float:
    out, err = proc.communicate(timeout=600)
    if proc.returncode != 0 or "check against single-process training: OK" not in out:
        raise SystemExit(f"elastic.py: the {what} run failed (exit {proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}")
    return time.monotonic()


def uninterrupted(args: argparse.Namespace) -> float:
    with tempfile.TemporaryDirectory(prefix="meshkit-elastic-") as tmp:
        start = time.monotonic()
        proc = subprocess.Popen(_launcher(args, Path(tmp)), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        return _finish(proc, "uninterrupted") - start


def _victim_pid(status_root: Path, rank: int, deadline: float) -> int:
    """The pid of ``rank``'s process, from the launcher's status directory (``start.{rank}``)."""
    while time.monotonic() < deadline:
        for folder in status_root.glob("meshkit-run-*"):
            start = folder / f"start.{rank}"
            if start.exists():
                return int(start.read_text().split()[0])
        time.sleep(0.01)
    raise SystemExit(f"elastic.py: rank {rank} never started")


def killed(args: argparse.Namespace) -> tuple[float, dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="meshkit-elastic-") as tmp:
        work = Path(tmp)
        status_root = work / "status"
        status_root.mkdir()
        report = work / "restarts.json"
        env = {**os.environ, "TMPDIR": str(status_root)}  # where the launcher makes its status directory
        start = time.monotonic()
        proc = subprocess.Popen(_launcher(args, work, "--max-restarts", "1", "--restart-report", str(report)),
                                text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        deadline = time.monotonic() + 300
        pid = _victim_pid(status_root, args.victim, deadline)
        while not (work / "ckpt" / f"step_{args.kill_after}" / "metadata.json").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"elastic.py: the job ended before the checkpoint of step {args.kill_after}: "
                                 f"{proc.communicate()[1][-3000:]}")
            time.sleep(0.002)
        os.kill(pid, signal.SIGKILL)
        end = _finish(proc, "killed")
        (entry,) = json.loads(report.read_text())
        return end - start, entry


def _cell(values: list[float]) -> str:
    if not values:
        return f"{'n/a':>8} {'':>8} {'':>8}"
    return f"{statistics.median(values):8.3f} {min(values):8.3f} {max(values):8.3f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plain: list[float] = []
    failed: list[float] = []
    entries: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        order = ("plain", "killed") if repeat % 2 == 0 else ("killed", "plain")
        for kind in order:
            if kind == "plain":
                plain.append(uninterrupted(args))
            else:
                wall, entry = killed(args)
                failed.append(wall)
                entries.append(entry)
        print(f"repeat {repeat + 1}/{args.repeats}: uninterrupted {plain[-1]:.2f} s, killed {failed[-1]:.2f} s "
              f"({entries[-1]['total_s']:.2f} s from the failure to the first step)", flush=True)
    print(f"\n# {args.strategy} on {args.nproc} ranks, rank {args.victim} SIGKILLed after the checkpoint of step "
          f"{args.kill_after} of {args.steps}; {args.repeats} repeats; seconds")
    print(f"{'phase':>18} {'median':>8} {'min':>8} {'max':>8}")
    for phase in PHASES:
        values = [e[phase] for e in entries if e.get(phase) is not None]
        print(f"{phase[:-2].replace('_', ' '):>18} {_cell(values)}")
    print(f"{'job, uninterrupted':>18} {_cell(plain)}")
    print(f"{'job, killed':>18} {_cell(failed)}")
    ratio = statistics.median(failed) / statistics.median(plain)
    print(f"killed / uninterrupted wall time: {ratio:.2f}x (median over median; the failure's cost, the steps "
          f"since step {args.kill_after} redone included)")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "uninterrupted_s": plain,
                                         "killed_s": failed, "restarts": entries}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
