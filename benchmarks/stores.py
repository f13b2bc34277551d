"""What authentication costs the stores: a round trip, the rendezvous, the store engine's collectives.

Run it by hand with plain ``python`` (it starts its processes itself; a measurement, not a test)::

    python benchmarks/stores.py                        # against the commit before issue 35
    python benchmarks/stores.py --baseline HEAD~3 --rounds 7 --json benchmarks/results/stores.json

Side by side in one run, in interleaved rounds (each round runs every configuration, from a
rotating start), three configurations of the same measurements:

* **baseline**: meshkit at ``--baseline`` (a git ref; default the commit before issue 35), its
  store open and its control messages pickled;
* **open**: this tree without a secret (open store, typed control messages);
* **secret**: this tree with ``MESHKIT_JOB_SECRET`` (each connection authenticated, every frame
  tagged).

The measurements, each in fresh processes of the configuration's meshkit:

* ``set``/``get``/``add`` of a 16-byte value and ``get`` of a 1 MiB value: the median round trip
  of one client process against a master in another;
* ``rendezvous``: ``--nproc`` processes meeting through ``env://`` (rank 0 serves the TCPStore),
  the slowest rank's time from its first call to its world's keys;
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

ROOT = Path(__file__).resolve().parents[1]
#: The last commit before issue 35 changed the stores and the control messages.
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
    from meshkit.comm import init_methods, store_engine
    rank, size, n = int(args[0]), int(args[1]), int(args[2])
    start = time.perf_counter()
    rv = init_methods.rendezvous(init_methods.requested("env://", size, rank, None), 60)
    took = time.perf_counter() - start
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
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, "rank", str(r), str(nproc), str(calls)],
                              env=_env(config, paths, port, core=r), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(nproc)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        if p.returncode:
            raise SystemExit(f"{config}: a rank failed:\n{err}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return {k: max(o[k] for o in outs) for k in outs[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stores.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help="git ref of the baseline (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per figure (default: %(default)s)")
    parser.add_argument("--nproc", type=int, default=4, help="ranks of the rendezvous (default: %(default)s)")
    parser.add_argument("--json", help="write the rows here")
    opts = parser.parse_args(argv)
    results: dict[str, dict[str, list[float]]] = {c: {} for c in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="meshkit-bench-stores-") as tmp:
        paths = _tree(opts.baseline, Path(tmp))
        try:
            for r in range(opts.rounds):
                order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
                for config in order:
                    figures = {**_round_trips(config, paths, opts.calls),
                               **_world(config, paths, opts.nproc, max(opts.calls // 10, 20))}
                    for k, v in figures.items():
                        results[config].setdefault(k, []).append(v)
                print(f"round {r + 1} of {opts.rounds} done", file=sys.stderr, flush=True)
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
    if opts.json:
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.json).write_text(json.dumps({"metadata": {"baseline": opts.baseline, "rounds": opts.rounds,
                                                            "calls": opts.calls, "nproc": opts.nproc,
                                                            "time": time.time()}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
