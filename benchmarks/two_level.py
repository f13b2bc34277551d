"""Two levels on one machine: 4 ranks as 2 simulated nodes of 2, a two-level machine
calibrated over a host-aware mesh, and the planner's predictions for flat and hybrid meshes beside
measured step times and beside a one-level machine's.

Run it by hand with plain ``python`` (it starts one ``meshkit-run -n 4 --simulate-nodes 2`` job)::

    python benchmarks/two_level.py                      # a few minutes on 2 cores
    python benchmarks/two_level.py --rounds 5 --json out.json

``meshkit-run --simulate-nodes 2`` names the ranks' hosts ``HOST-sim0`` and ``HOST-sim1`` and sets
``UCX_TLS=tcp,self``, so MPICH sends the messages between the two "nodes" over TCP and those within
one through shared memory. The job:

1. builds a 2-D mesh ``("node", "local")`` from the ranks' host names (:func:`host_mesh`: meshkit
   has no host-aware mesh builder; the rows are the hosts, in the order of their lowest rank, so
   ``local`` stays within a host whatever the rank order) and calibrates it: two levels, ``local``
   (size 2, shared memory) and ``node`` (size 4, its groups cross the hosts);
2. calibrates the same 4 ranks as a flat 1-D mesh ``("dp",)``: one level of size 4, the
   collectives of every size timed across the hosts (the one-level machine);
3. trains examples/mlp.py's MLP (benchmarks/scaling.py's ``_build`` and ``_timed``) for ddp,
   zero1, zero2 and fsdp over all 4 ranks (flat: their collectives cross the nodes) and hsdp 2x2
   (replicate across the nodes, shard within), 1x4 and 4x1, strong and weak scaling, in
   ``--rounds`` rounds; a round builds every configuration and interleaves their steps (one step
   of each in turn), so the shared machine's slow spells spread over all of them; measured is the
   median over rounds of each round's median step (slowest rank);
4. prints each beside the two-level and the one-level machine's ``estimate``, Spearman's rank
   correlation of predicted and measured step times over the flat and the hybrid configurations,
   and whether the configuration each machine's planner ranks first is within 10% of the fastest
   measured; writes ``benchmarks/results/two_level.json``.

4 ranks on this machine's 2 cores oversubscribe them (compute and communication contend, which the
model does not know): the output says so beside the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (_cores, add_output_args, host_metadata, limit_blas_threads, matplotlib_missing,  # noqa: E402
                     png_path, require_pyplot, save_figure, write_json)
from scaling import (KINDS, ROOT, _build, _ints, _timed, configurations, plan_model, run_worker,  # noqa: E402
                     spearman)

DEFAULT_JSON = ROOT / "benchmarks" / "results" / "two_level.json"
RANKS, NODES = 4, 2
MODES = ("strong", "weak")
FLAT = ("ddp", "zero1", "zero2", "fsdp")
#: Calibration sizes: calibrate's four (1 KiB-1 MiB) and the powers of 4 between them. 4 ranks on 2
#: cores time a 4 KiB all_reduce up to an order of magnitude apart from run to run (the partner rank
#: descheduled or not); more points and repeats (--calib-repeats, 15) steady the fit, at the cost of a
#: longer calibration per mesh.
CALIB_SIZES = tuple(1 << k for k in range(10, 21, 2))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="two_level.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=_ints, default=[512, 512, 512], help="MLP hidden sizes (default: 512,512,512)")
    parser.add_argument("--batch", type=int, default=256,
                        help="strong: the global batch; weak: samples per rank (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="steps before timing, per round (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: %(default)s)")
    parser.add_argument("--calib-repeats", type=int, default=15, help="calibrate's repeats (default: %(default)s)")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)  # the job's own records
    add_output_args(parser, json_help=f"result file (default: {DEFAULT_JSON.relative_to(ROOT)})", plot_from_help=None)
    args = parser.parse_args(argv)
    if min(args.steps, args.rounds, args.calib_repeats) < 1 or args.warmup < 0 or args.batch < 1:
        parser.error(f"--steps, --rounds, --calib-repeats and --batch must be >= 1 and --warmup >= 0, got "
                     f"steps={args.steps} rounds={args.rounds} calib-repeats={args.calib_repeats} "
                     f"batch={args.batch} warmup={args.warmup}")
    error = matplotlib_missing(args)
    if error:
        parser.error(error)
    return args


# --------------------------------------------------------------------------- the job (under meshkit-run)
def host_mesh(names: tuple[str, str] = ("node", "local")) -> Any:
    """A 2-D ``DeviceMesh`` of every rank of the world: one row per host (in the order of each
    host's lowest rank), the ranks of that host along the row; collective over the world.

    The inner dimension stays within a host whatever order the launcher gave the ranks, because
    the host names (``ProcessGroup.host_name()``: the simulated ones under ``meshkit-run
    --simulate-nodes``) decide, not the rank numbers.

    Raises:
        ValueError: the hosts hold different numbers of ranks (no 2-D mesh has such rows).
    """
    import numpy as np

    import meshkit
    world = meshkit.init_device_mesh("cpu", (meshkit.get_world_size(),)).get_group()
    hosts: list[Any] = [None] * world.size
    meshkit.all_gather_object(hosts, world.host_name())
    rows: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        rows.setdefault(host, []).append(rank)
    if len({len(r) for r in rows.values()}) != 1:
        raise ValueError(f"two_level.py: rank {world.rank}: host_mesh needs the same number of ranks on every host, "
                         f"got {({h: len(r) for h, r in rows.items()})}")
    return meshkit.DeviceMesh("cpu", np.array(list(rows.values())), mesh_dim_names=names)


def worker(args: argparse.Namespace) -> int:
    limit_blas_threads(1)  # one BLAS thread per rank: the ranks share the cores (benchmarks/_common.py)
    import meshkit
    from meshkit.plan import calibrate, estimate
    meshkit.init_process_group("mpi", timeout=300)
    rank, n = meshkit.get_rank(), meshkit.get_world_size()
    two = host_mesh()
    described = two.describe()  # collective; printed by rank 0
    blocks = [list(range(i, i + n // NODES)) for i in range(0, n, n // NODES)]
    if two.mesh.tolist() != blocks:  # mlp.build's hsdp mesh is init_device_mesh((r, s)): rank order
        raise RuntimeError(f"two_level.py: rank {rank}: the hosts hold ranks {two.mesh.tolist()}, not the blocks "
                           f"{blocks} that examples/mlp.py's hsdp mesh assumes; its shard groups would cross hosts")
    flat = meshkit.init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
    options = {"sizes": CALIB_SIZES, "repeats": args.calib_repeats, "kinds": KINDS}
    machine2 = calibrate(two, name="two-level", **options)
    machine1 = calibrate(flat, name="one-level", **options)
    if rank == 0:
        for m in (machine2, machine1):
            for lv in m.levels:
                c = lv.cost("all_reduce")
                print(f"{m.name}: level {lv.name!r} size {lv.size}: all_reduce alpha {c.alpha * 1e6:.1f} us, "
                      f"busbw {1 / c.beta / 1e9 if c.beta else float('inf'):.2f} GB/s; 4 KiB all_reduce "
                      f"{m.collective_time('all_reduce', 4096, 2, lv.size) * 1e6:.1f} us at 2 ranks (fit error "
                      f"{m.fit_error[f'{lv.name}.all_reduce']:.2f})", flush=True)
        inner, outer = machine2.levels[0].size, machine2.levels[-1].size
        for size in (4096, 1 << 20):
            ratio = (machine2.collective_time("all_reduce", size, 2, outer)
                     / max(machine2.collective_time("all_reduce", size, 2, inner), 1e-12))
            print(f"two-level: a {size // 1024} KiB all_reduce at 2 ranks across the nodes takes {ratio:.1f}x its "
                  f"time within one (fitted)", flush=True)
    configs = configurations(n, [*FLAT, "hsdp"])
    samples: dict[tuple[str, str], list[float]] = {}
    held: dict[tuple[str, str], int] = {}
    runs = [(mode, args.batch if mode == "strong" else args.batch * n, config) for mode in MODES for config in configs]
    for r in range(args.rounds):  # every configuration built afresh, their steps interleaved (scaling._timed)
        built = [_build(config, args.hidden, global_batch) for _, global_batch, config in runs]
        for (mode, _, config), (measured, bytes_) in zip(runs, _timed(built, args.steps, args.warmup,
                                                                       first=r % len(runs))):
            samples.setdefault((mode, config.name()), []).append(measured)
            held[(mode, config.name())] = bytes_
        del built
        if rank == 0:
            print(f"round {r + 1} of {args.rounds} done", flush=True)
    records = []
    for mode in MODES:
        global_batch = args.batch if mode == "strong" else args.batch * n
        model = plan_model(args.hidden, global_batch)
        for config in configs:
            b2, b1 = estimate(config, model, machine2), estimate(config, model, machine1)
            rounds = samples[(mode, config.name())]
            records.append({"config": config.name(), "strategy": config.strategy, "mode": mode, "ranks": n,
                            "nodes": NODES, "hybrid": config.strategy == "hsdp",
                            "dp_replicate": config.dp_replicate, "dp_shard": config.dp_shard,
                            "global_batch": global_batch, "measured_step_s": statistics.median(rounds),
                            "measured_rounds_s": rounds, "predicted_step_s": b2.step_s,
                            "predicted_one_level_s": b1.step_s, "predicted_comm_s": b2.comm_s,
                            "predicted_one_level_comm_s": b1.comm_s, "predicted_compute_s": b2.compute_s,
                            "measured_bytes": held[(mode, config.name())],
                            "predicted_bytes": b2.memory["params"] + b2.memory["grads"] + b2.memory["optimizer_state"],
                            "oversubscribed": n > _cores()})
    if rank == 0:
        args.worker.write_text(json.dumps({"records": records, "describe": described,
                                           "two_level": machine2.to_dict(), "one_level": machine1.to_dict()}))
    meshkit.destroy_process_group()
    return 0


# --------------------------------------------------------------------------- the figures
def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Spearman over the flat, the hybrid and all configurations for each machine; the picks."""
    out: dict[str, Any] = {}
    for key, field in (("two_level", "predicted_step_s"), ("one_level", "predicted_one_level_s")):
        for part, chosen in (("flat", [r for r in rows if not r["hybrid"]]), ("hybrid", [r for r in rows if r["hybrid"]]),
                             ("all", rows)):
            out[f"spearman_{part}_{key}"] = spearman([r[field] for r in chosen], [r["measured_step_s"] for r in chosen])
        picks = []
        for mode in sorted({r["mode"] for r in rows}):
            group = [r for r in rows if r["mode"] == mode]
            pick, fastest = min(group, key=lambda r: r[field]), min(group, key=lambda r: r["measured_step_s"])
            picks.append({"mode": mode, "pick": pick["config"], "fastest": fastest["config"],
                          "ratio": pick["measured_step_s"] / fastest["measured_step_s"]})
        out[f"picks_{key}"] = picks
        out[f"picks_within_10pct_{key}"] = sum(p["ratio"] <= 1.10 for p in picks)
    # The pair the second level is for: the same sharding, over 4 ranks across the nodes (fsdp dp4)
    # or over the 2 ranks of a node and replicated across (hsdp 2x2). One level prices them alike.
    pairs = []
    for mode in sorted({r["mode"] for r in rows}):
        by = {r["config"].split(" tp")[0]: r for r in rows if r["mode"] == mode}
        if "hsdp dp2x2" in by and "fsdp dp4" in by:
            h, f = by["hsdp dp2x2"], by["fsdp dp4"]
            pairs.append({"mode": mode, **{k: h[field] / f[field] for k, field in (
                ("measured", "measured_step_s"), ("two_level", "predicted_step_s"),
                ("one_level", "predicted_one_level_s"))},
                # hsdp 1x4 is fsdp dp4 (one replica): how far apart they measure is this run's noise
                "noise": by["hsdp dp1x4"]["measured_step_s"] / f["measured_step_s"] if "hsdp dp1x4" in by else None})
    out["hsdp2x2_over_fsdp4"] = pairs
    out["records"] = len(rows)
    out["memory_mismatches"] = sum(r["measured_bytes"] != r["predicted_bytes"] for r in rows)
    out["oversubscribed"] = any(r["oversubscribed"] for r in rows)
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'mode':6} {'config':26} {'measured ms':>12} {'two-level ms':>13} {'one-level ms':>13}")
    for r in rows:
        print(f"{r['mode']:6} {r['config']:26} {r['measured_step_s'] * 1e3:12.2f} {r['predicted_step_s'] * 1e3:13.2f} "
              f"{r['predicted_one_level_s'] * 1e3:13.2f}")


def print_summary(s: dict[str, Any], cores: int) -> None:
    note = (f"  ({RANKS} ranks on {cores} cores oversubscribe them: compute and communication contend, which the "
            f"model does not know; this machine cannot say more)" if s["oversubscribed"] else "")
    for key, label in (("two_level", "two-level machine"), ("one_level", "one-level machine (flat calibration)")):
        print(f"\n{label}: Spearman(predicted, measured) flat {s[f'spearman_flat_{key}']:.3f}, hybrid "
              f"{s[f'spearman_hybrid_{key}']:.3f}, all {s[f'spearman_all_{key}']:.3f}{note}")
        for p in s[f"picks_{key}"]:
            print(f"  {p['mode']:6}: planner picks {p['pick']!r}, fastest measured {p['fastest']!r}: {p['ratio']:.2f}x")
        print(f"  planner's pick within 10% of the fastest measured: {s[f'picks_within_10pct_{key}']} of "
              f"{len(s[f'picks_{key}'])}")
    for p in s["hsdp2x2_over_fsdp4"]:
        print(f"{p['mode']:6}: hsdp 2x2 / fsdp dp4 step time: measured {p['measured']:.2f}, two-level machine "
              f"{p['two_level']:.2f}, one-level machine {p['one_level']:.2f}"
              + (f" (noise: hsdp 1x4, the same configuration as fsdp dp4, measured {p['noise']:.2f}x it)" if p["noise"] else ""))
    print(f"memory mismatches (params + grads + optimizer state, bytes): {s['memory_mismatches']}")


def draw(rows: list[dict[str, Any]], png: Path, title: str) -> None:
    """Per mode, each configuration's measured step time beside both machines' predictions."""
    plt = require_pyplot()
    modes = sorted({r["mode"] for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(7 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        group = [r for r in rows if r["mode"] == mode]
        xs = range(len(group))
        for offset, (field, label) in enumerate((("measured_step_s", "measured"), ("predicted_step_s", "two-level"),
                                                  ("predicted_one_level_s", "one-level"))):
            ax.bar([x + (offset - 1) * 0.27 for x in xs], [r[field] * 1e3 for r in group], 0.27, label=label)
        ax.set_xticks(list(xs), [r["config"].split(" tp")[0] for r in group], rotation=30, ha="right")
        ax.set(title=f"{mode} scaling, 4 ranks on 2 simulated nodes", ylabel="ms per step")
        ax.legend()
    save_figure(fig, png, title)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args)
    out = args.json or DEFAULT_JSON
    forwarded = ["--hidden", ",".join(map(str, args.hidden)), "--batch", str(args.batch), "--steps", str(args.steps),
                 "--warmup", str(args.warmup), "--rounds", str(args.rounds), "--calib-repeats", str(args.calib_repeats)]
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="meshkit-two-level-") as tmp:
        job = run_worker(__file__, RANKS, forwarded, Path(tmp), launch=("--simulate-nodes", str(NODES)))
    rows = job["records"]
    s = summary(rows)
    print_table(rows)
    print_summary(s, _cores())
    print(f"({time.monotonic() - start:.0f} s)")
    meta = host_metadata(benchmark="two_level", summary=s, describe=job["describe"], two_level=job["two_level"],
                         one_level=job["one_level"], args={k: str(v) for k, v in vars(args).items()})
    write_json(out, meta, rows)
    if args.plot is not None:
        draw(rows, png_path(args.plot, out), f"two levels: MLP {args.hidden}, batch {args.batch} (oversubscribed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
