"""A training step with the shared-memory path off and on, side by side in one run.

Run it by hand (a measurement, not a test; nothing here asserts on timings)::

    python benchmarks/shm_step.py                                   # fsdp at 2 ranks, 3 rounds
    python benchmarks/shm_step.py -n 2 --strategies fsdp,zero1,ddp --rounds 5 --hidden 1024,1024,1024

The path is chosen when a group is created (``MESHKIT_SHM``, comm/engines/shm_settings.py), so one
job cannot time both: each round runs ``benchmarks/sharded.py`` (its model, its steps, its timing:
a step's time is the MAX over ranks after a barrier) once with ``MESHKIT_SHM=0`` and once with
``MESHKIT_SHM=1``, in an order alternating from round to round, so that a shared machine's drift
hits both alike. With the path on, ZeRO's and FSDP's flat buffers and DDP's buckets lie in the
group's shared memory and their collectives run in place (docs/collectives.md); with it off, every
collective is MPI's. Each job also checks its strategies against single-process training first.

Rank 0 of each job writes its JSON under a temporary folder; this driver prints, per strategy, the
median step (ms) with the path off and on over every round's steps, their 25th-75th percentiles,
the fastest step and off / on (of the medians), and writes ``benchmarks/results/shm-step-n{N}.json`` (``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "fsdp-noprefetch")


def strategies(text: str) -> list[str]:
    names = [s for s in text.split(",") if s]
    bad = [s for s in names if s not in STRATEGIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown strategies {bad or [text]}; valid: {','.join(STRATEGIES)}")
    return names


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=positive, default=2, help="ranks (meshkit-run -n)")
    p.add_argument("--strategies", type=strategies, default=["fsdp"], help="comma-separated, of " + ",".join(STRATEGIES))
    p.add_argument("--rounds", type=positive, default=3, help="rounds, each one job per setting")
    p.add_argument("--steps", type=positive, default=8,
                   help="timed steps per strategy per sharded.py round (each job runs enough rounds for 10 steps)")
    p.add_argument("--warmup", type=positive, default=2, help="untimed steps per strategy per job")
    p.add_argument("--hidden", default="512,512,512", help="hidden layer widths (sharded.py's --hidden)")
    p.add_argument("--timeout", type=positive, default=600, help="seconds one job may take")
    p.add_argument("--json", type=Path, default=None, help="result file (default benchmarks/results/shm-step-nN.json)")
    return p


def run_job(args: argparse.Namespace, shm: str, out: Path) -> dict[str, list[float]]:
    """One ``sharded.py`` job with ``MESHKIT_SHM=shm``: each strategy's step times (ms)."""
    cmd = [sys.executable, "-m", "meshkit.launch", "-n", str(args.n), str(HERE / "sharded.py"), "--strategies",
           ",".join(args.strategies), "--rounds", str(-(-10 // args.steps)), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--hidden", args.hidden, "--no-progress", "--json", str(out)]
    proc = subprocess.run(cmd, env={**os.environ, "MESHKIT_SHM": shm}, capture_output=True, text=True,
                          timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"shm_step: MESHKIT_SHM={shm}: {' '.join(cmd)} exited {proc.returncode}\n"
                         f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    rows = json.loads(out.read_text())["rows"]
    return {r["strategy"]: r["step_ms_all"] for r in rows if r.get("section") == "step"}


def summarize(times: dict[str, dict[str, list[float]]], names: list[str]) -> list[dict[str, Any]]:
    """Per strategy: the median and quartiles of every step with the path off (``"0"``) and on (``"1"``)."""
    rows = []
    for name in names:
        row: dict[str, Any] = {"strategy": name}
        for shm, label in (("0", "off"), ("1", "on")):
            ms = sorted(times[shm][name])
            q = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0], ms[0], ms[0]]
            row.update({f"{label}_ms": statistics.median(ms), f"{label}_p25_ms": q[0], f"{label}_p75_ms": q[2],
                        f"{label}_min_ms": ms[0], f"{label}_steps": len(ms)})
        row["off_over_on"] = row["off_ms"] / row["on_ms"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    times: dict[str, dict[str, list[float]]] = {"0": {s: [] for s in args.strategies},
                                                "1": {s: [] for s in args.strategies}}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="meshkit-shm-step-") as tmp:
        for round_ in range(args.rounds):
            for shm in (("0", "1") if round_ % 2 == 0 else ("1", "0")):
                got = run_job(args, shm, Path(tmp) / f"shm{shm}-round{round_}.json")
                for name in args.strategies:
                    times[shm][name] += got[name]
                print(f"round {round_ + 1}/{args.rounds} MESHKIT_SHM={shm} done", file=sys.stderr, flush=True)
    rows = summarize(times, args.strategies)
    print(f"step time at {args.n} ranks, hidden {args.hidden}, {args.rounds} rounds x {args.steps} steps "
          f"(load average {os.getloadavg()[0]:.1f})")
    print(f"{'strategy':<16} {'MESHKIT_SHM=0 ms: median [p25-p75] min':>40} {'MESHKIT_SHM=1 ms':>40} {'off/on':>7}")
    for r in rows:
        print(f"{r['strategy']:<16} {r['off_ms']:>12.2f} [{r['off_p25_ms']:.2f}-{r['off_p75_ms']:.2f}] "
              f"{r['off_min_ms']:.2f} {r['on_ms']:>20.2f} [{r['on_p25_ms']:.2f}-{r['on_p75_ms']:.2f}] "
              f"{r['on_min_ms']:.2f} {r['off_over_on']:>7.2f}")
    path = args.json or RESULTS / f"shm-step-n{args.n}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"benchmark": "shm_step", "ranks": args.n, "hidden": args.hidden, "strategies": args.strategies,
            "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
            "seconds": time.perf_counter() - started, "load_average_1m": os.getloadavg()[0], "argv": sys.argv}
    path.write_text(json.dumps({"metadata": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
