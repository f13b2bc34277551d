"""What authentication costs the stores: a round trip, the rendezvous, the store engine's collectives.

Run it by hand with plain ``python`` (it starts its processes itself; a measurement, not a test)::

    python benchmarks/stores.py --plot                 # against the commit before authentication
    python benchmarks/stores.py --baseline HEAD~3 --rounds 7 --json /tmp/stores.json

Side by side in one run, in interleaved rounds (each round runs every configuration, from a
rotating start), three configurations of the same measurements:

* **baseline**: meshkit at ``--baseline`` (a git ref; default the commit before authentication), its
  store open and its control messages pickled;
* **open**: this tree without a secret (open store, typed control messages);
* **secret**: this tree with ``MESHKIT_JOB_SECRET`` (each connection authenticated, every frame
  tagged).

The measurements, each in fresh processes of the configuration's meshkit:

* ``set``/``get``/``add`` of a 16-byte value and ``get`` of a 1 MiB value: the median round trip
  of one client process against a master in another;
* ``rendezvous``: ``--nproc`` processes meeting through ``env://`` (rank 0 serves the TCPStore,
  started 50 ms before the others), the time from the others' start to the last rank's keys;
* ``exchange``/``barrier``: the store engine's collectives over that world (what an nccl world
  started without MPI does on its host side), median per call, slowest rank.

The table prints each figure and its ratio to the baseline (the issue's bar: within 1.1x).
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

from _common import Progress, add_output_args, host_metadata, require_pyplot, save_figure, save_results, setup_logging

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: The last commit before authentication and typed control messages changed the stores.
DEFAULT_BASELINE = "4d2e322"
CONFIGS = ("baseline", "open", "secret")
SECRET = "b" * 64

# One worker, run with the configuration's meshkit first on sys.path; prints one JSON line.
WORKER = r'''
import json, os, statistics, sys, time
from datetime import timedelta
mode, args = sys.argv[1], sys.argv[2:]
cores = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cores[int(os.environ["BENCH_CORE"]) % len(cores)]})  # the same placement every run
from meshkit.comm.stores import TCPStore
T = timedelta(seconds=60)

def med(fn, n):
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return statistics.median(times)

if mode == "serve":
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=T)
    print(store.port, flush=True)
    sys.stdin.read()
elif mode == "client":
    store = TCPStore("127.0.0.1", int(args[0]), timeout=T)
    n = int(args[1])
    small, big = b"x" * 16, os.urandom(1 << 20)
    store.set("small", small); store.set("big", big)
    out = {"set": med(lambda: store.set("s", small), n), "get": med(lambda: store.get("small"), n),
           "add": med(lambda: store.add("a", 1), n), "get 1 MiB": med(lambda: store.get("big"), max(n // 20, 5))}
    print(json.dumps(out))
else:  # a rank: the rendezvous, then the store engine's collectives
    try:
        from meshkit.comm.setup import init_methods
        from meshkit.comm.engines import store_engine
    except ImportError:  # a baseline from before comm's rooms
        from meshkit.comm import init_methods, store_engine
    rank, size, n, start_at = int(args[0]), int(args[1]), int(args[2]), float(args[3])
    # Rank 0 (the server) starts 50 ms early, the others at once, imports done: the figure is from
    # then to the last rank's keys (the protocol, not the 10 ms connect retries of a client that
    # comes before its server listens, which made the figure bimodal: with or without a retry)
    time.sleep(max(0.0, start_at - (0.05 if rank == 0 else 0.0) - time.time()))
    rv = init_methods.rendezvous(init_methods.requested("env://", size, rank, None), 60)
    took = time.time() - start_at
    engine = store_engine.create_world_engine(rv.store, rank, size, None, rv.base)
    seq = [0]
    def exchange():
        seq[0] += 1
        engine.exchange((seq[0], "all_reduce", (4,), "float64"), seq[0], time.monotonic() + 60)
    def barrier():
        engine.wait(engine.barrier(), time.monotonic() + 60)
    out = {"rendezvous": took, "exchange": med(exchange, n), "barrier": med(barrier, n)}
    engine.flush(10)
    engine.free()
    print(json.dumps(out))
'''


def _tree(baseline: str, work: Path) -> dict[str, Path]:
    """A folder per configuration holding ``meshkit`` (a link to its tree) for ``PYTHONPATH``."""
    old = work / "baseline-tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), baseline], check=True,
                   capture_output=True)
    paths = {}
    for name, tree in (("baseline", old), ("current", ROOT)):
        holder = work / f"path-{name}"
        holder.mkdir()
        (holder / "meshkit").symlink_to(tree, target_is_directory=True)
        paths[name] = holder
    return paths


def _env(config: str, paths: dict[str, Path], port: int | None = None, core: int = 0) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MESHKIT_JOB_SECRET", "PYTHONPATH")}
    env["BENCH_CORE"] = str(core)  # each process pinned to one core, the same in every run: placement is noise
    env["PYTHONPATH"] = str(paths["baseline" if config == "baseline" else "current"])
    if config == "secret":
        env["MESHKIT_JOB_SECRET"] = SECRET
    if port is not None:
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _round_trips(config: str, paths: dict[str, Path], calls: int) -> dict[str, float]:
    server = subprocess.Popen([sys.executable, "-c", WORKER, "serve"], env=_env(config, paths, core=0),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = server.stdout.readline().strip()
        client = subprocess.run([sys.executable, "-c", WORKER, "client", port, str(calls)],
                                env=_env(config, paths, core=1), capture_output=True, text=True, timeout=300)
        if client.returncode:
            raise SystemExit(f"{config}: the client failed:\n{client.stderr}")
        return json.loads(client.stdout.strip().splitlines()[-1])
    finally:
        server.stdin.close()
        server.wait(timeout=30)


def _world(config: str, paths: dict[str, Path], nproc: int, calls: int) -> dict[str, float]:
    port = _free_port()
    start_at = time.time() + 2.0  # after every rank's imports, with room for a loaded machine
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, "rank", str(r), str(nproc), str(calls), str(start_at)],
                              env=_env(config, paths, port, core=r), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(nproc)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        if p.returncode:
            raise SystemExit(f"{config}: a rank failed:\n{err}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return {k: max(o[k] for o in outs) for k in outs[0]}


def draw(rows: list[dict[str, Any]], png: Path, title: str) -> None:
    """Each figure's open and secret time as a ratio of the baseline's: a bar per configuration,
    each round's ratio as a dot (the spread is this shared machine's noise)."""
    plt = require_pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, config in enumerate(("open", "secret")):
        xs = [j + (i - 0.5) * 0.35 for j in range(len(rows))]
        ax.bar(xs, [r[f"{config}_ratio"] for r in rows], width=0.35, label=config)
        for x, r in zip(xs, rows):
            ax.plot([x] * len(r[f"{config}_rounds_s"]),
                    [v / b for v, b in zip(r[f"{config}_rounds_s"], r["baseline_rounds_s"])], "k.", markersize=3)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.axhline(1.1, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xticks(range(len(rows)), [r["figure"] for r in rows])
    ax.set_ylabel("time / baseline's (median of rounds)")
    ax.legend()
    save_figure(fig, png, title)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stores.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help="git ref of the baseline (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=11, help="interleaved rounds (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=3000, help="timed calls per figure (default: %(default)s)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the rendezvous (default: %(default)s)")
    add_output_args(parser, json_help="result file (default: benchmarks/results/stores.json)", plot_from_help=None)
    opts = parser.parse_args(argv)
    setup_logging(0, opts.verbose)
    results: dict[str, dict[str, list[float]]] = {c: {} for c in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="meshkit-bench-stores-") as tmp:
        paths = _tree(opts.baseline, Path(tmp))
        try:
            with Progress(opts.rounds * len(CONFIGS), enabled=not opts.no_progress, unit="run") as progress:
                for r in range(opts.rounds):
                    progress.start_group(f"round {r + 1} of {opts.rounds}")
                    for config in CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]:  # a rotating start
                        figures = {**_round_trips(config, paths, opts.calls),
                                   **_world(config, paths, opts.nproc, max(opts.calls // 10, 20))}
                        for k, v in figures.items():
                            results[config].setdefault(k, []).append(v)
                        progress.step(config)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(Path(tmp) / "baseline-tree")],
                           capture_output=True)
    rows: list[dict[str, Any]] = []
    print(f"{'figure':<12} {'baseline':>12} {'open':>12} {'secret':>12} {'open/base':>10} {'secret/base':>12}")
    for figure in results["baseline"]:
        med = {c: statistics.median(results[c][figure]) for c in CONFIGS}
        rows.append({"figure": figure, **{f"{c}_s": med[c] for c in CONFIGS},
                     **{f"{c}_rounds_s": results[c][figure] for c in CONFIGS},
                     "open_ratio": med["open"] / med["baseline"], "secret_ratio": med["secret"] / med["baseline"]})
        unit, scale = ("ms", 1e3) if med["baseline"] > 1e-3 else ("us", 1e6)
        print(f"{figure:<12} " + " ".join(f"{med[c] * scale:>9.1f} {unit}" for c in CONFIGS)
              + f" {med['open'] / med['baseline']:>10.2f} {med['secret'] / med['baseline']:>12.2f}")
    metadata = host_metadata(benchmark="stores", baseline=opts.baseline, rounds=opts.rounds, calls=opts.calls,
                             nproc=opts.nproc)
    title = f"stores: open and secret vs {opts.baseline} ({opts.rounds} rounds, {opts.nproc} ranks)"
    save_results(opts, RESULTS / "stores.json", metadata, rows, lambda png: draw(rows, png, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
