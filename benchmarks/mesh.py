"""Device-mesh construction cost versus world size: wall time, collective splits, world collectives.

Run it by hand (it is a measurement, not a test; nothing here asserts on timings)::

    # in-process engine: world sizes 1, 2, 4, ..., 64 as threads of this process
    python benchmarks/mesh.py --engine local --max-world 64 --plot

    # MPI engine: one run per world size (each writes benchmarks/results/mesh-mpi-n{N}.json),
    # then one plot over all of them
    for n in 1 2 4; do meshkit-run -n $n benchmarks/mesh.py --engine mpi; done
    python benchmarks/mesh.py --plot-from benchmarks/results/mesh-mpi-n{1,2,4}.json

With the pip-installed ``mpich`` wheel in a venv, use the venv's tools, e.g.
``/tmp/venv/bin/meshkit-run -n 4 benchmarks/mesh.py --engine mpi``. On a 2-core machine
4 ranks are oversubscribed, so MPI times at N=4 include scheduling noise.

What is measured, for each world size ``n`` and each mesh of 1, 2 and 3 dimensions that fits:

* Shapes, given with ``-1`` inference as a user would: 1-D ``(-1,)``; 2-D ``(2, -1)`` when
  ``n`` is even, else ``(1, -1)``; 3-D ``(2, 2, -1)`` when ``n`` is a multiple of 4.
* **first build**: ``init_device_mesh`` on a fresh world (``destroy_process_group`` then
  ``init_process_group`` before every repeat, so no group is cached). **cached rebuild**: the
  same call again on that world, after the first build; meshkit caches groups by rank set, so
  it creates no communicator, but it still takes part in the collective splits.
* Counts, as deltas over the one call: ``splits`` (``World.split_count``: group-creating
  collective splits), ``colls`` (``world.default_group.queue.seq``: every collective issued on the
  world group, splits included) and ``groups`` (new entries in ``World.groups``, i.e. new
  communicators on this rank). On the MPI engine one split is one ``Ibarrier`` plus one
  ``Comm.Split``; on the local engine one rendezvous of all ranks. A dimension whose group is
  the whole world reuses the world group and costs no split (so a 1-D mesh costs none).
* Time: a barrier before each timed call; a call's time is the MAX over ranks of each rank's
  wall time; the reported time is the median over ``--repeats`` repeats, after ``--warmup``
  untimed ones. ``cpu``: the same for the CPU time of the calling thread
  (``time.thread_time``), i.e. meshkit's own work on one rank without the waiting.
* The local engine's ranks are threads sharing one GIL: a rank's wall time includes the other
  ranks' work (serialized) and GIL hand-offs (``sys.getswitchinterval()``, 5 ms), so its wall
  times are noisy (even a call with no collective can take ms at 64 ranks) and grow with the
  world size for that reason alone; ``cpu`` is the stable number there. It measures meshkit's
  Python work and rendezvous, not a network.
* MPI engine only, ``mpi4py``: the floor, raw ``Comm.Split`` calls (one per dimension that
  meshkit splits, same colors) on a duplicate of ``COMM_WORLD``, timed the same way.

Rank 0 prints a table, writes JSON (default ``benchmarks/results/mesh-local.json`` or
``mesh-mpi-n{N}.json``) and, with ``--plot``, a PNG of time against world size, one line per
number of dimensions, each point labelled with its number of splits. ``--plot-from`` draws
that PNG from JSON files of earlier runs (e.g. the MPI runs at N = 1, 2, 4) without measuring.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
from _common import (LOG, Progress, add_output_args, barrier, host_metadata, load_result, matplotlib_missing,
                     max_over_ranks, median, parse_checked, png_path, print0, require_pyplot, run_metadata,
                     save_figure, setup_logging, write_json)

import meshkit
from meshkit.comm._seams import current_world

if TYPE_CHECKING:
    from mpi4py import MPI

RESULTS = Path(__file__).resolve().parent / "results"

#: Dimension names of the meshes, by number of dimensions.
DIM_NAMES = {1: ("world",), 2: ("dp", "tp"), 3: ("pp", "dp", "tp")}

#: Environment variables that give the size of an MPI job (meshkit-run, MPICH's hydra, Open MPI, Slurm).
SIZE_ENV_VARS = ("MESHKIT_WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")


# --------------------------------------------------------------------------- shapes
@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """One mesh to build: the shape as requested (with -1) and as inferred for ``world_size``."""

    world_size: int
    request: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.request)

    @property
    def shape(self) -> tuple[int, ...]:
        known = math.prod(s for s in self.request if s != -1)
        return tuple(self.world_size // known if s == -1 else s for s in self.request)

    @property
    def names(self) -> tuple[str, ...]:
        return DIM_NAMES[self.ndim]


def mesh_specs(n: int, ndims: list[int]) -> list[MeshSpec]:
    """The meshes measured at world size ``n``: 1-D always, 2-D always, 3-D when 4 divides ``n``."""
    requests = {1: (-1,), 2: (2, -1) if n % 2 == 0 else (1, -1), 3: (2, 2, -1) if n % 4 == 0 else None}
    return [MeshSpec(n, requests[d]) for d in ndims if requests[d] is not None]


def split_colors(shape: tuple[int, ...]) -> list[np.ndarray]:
    """Per dimension that meshkit splits, the color of every rank (the index of its group).

    Mirrors meshkit's rule: a dimension whose group is the whole world, or whose partition an
    earlier dimension already built, needs no split.
    """
    n = math.prod(shape)
    ranks = np.arange(n).reshape(shape)
    seen: set[frozenset[frozenset[int]]] = set()
    out = []
    for d, size in enumerate(shape):
        parts = np.moveaxis(ranks, d, -1).reshape(-1, size)
        key = frozenset(frozenset(p) for p in parts.tolist())
        if size == n or key in seen:
            continue
        seen.add(key)
        colors = np.empty(n, dtype=np.int64)
        colors[parts] = np.arange(len(parts))[:, None]
        out.append(colors)
    return out


# --------------------------------------------------------------------------- one rank's measurement
COUNT_KEYS = ("splits", "collectives", "new_groups")


def timed_build(spec: MeshSpec, sync: Callable[[], object]) -> tuple[float, float, tuple[int, int, int]]:
    """Wall and CPU seconds of one ``init_device_mesh`` on this rank, and its (splits, collectives, new groups)."""
    world = current_world()
    sync()
    group = world.default_group
    assert group is not None
    s0, c0, g0 = world.split_count, group.queue.seq, len(world.groups)
    start, cpu_start = time.perf_counter(), time.thread_time()
    mesh = meshkit.init_device_mesh("cpu", spec.request, mesh_dim_names=spec.names)
    seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
    if mesh.shape != spec.shape:
        raise RuntimeError(f"meshkit.bench: rank {world.rank}: init_device_mesh{spec.request} built shape "
                           f"{mesh.shape}, expected {spec.shape}")
    return seconds, cpu, (world.split_count - s0, group.queue.seq - c0, len(world.groups) - g0)


@dataclasses.dataclass
class Sample:
    """One repeat on one rank: wall seconds, CPU seconds and counts of the first build and the cached rebuild."""

    first_s: float
    first_cpu: float
    first_counts: tuple[int, int, int]
    cached_s: float
    cached_cpu: float
    cached_counts: tuple[int, int, int]
    raw_s: float | None = None


def measure_rank(spec: MeshSpec, *, repeats: int, warmup: int, fresh_world: Callable[[], None],
                 sync: Callable[[], object], raw: Callable[[], float] | None = None) -> list[Sample]:
    """This rank's samples of ``spec`` (collective: every rank calls it with the same arguments).

    Each repeat: a fresh world, the first build, the cached rebuild, then ``raw()`` if given
    (before the meshkit builds on odd repeats, so that neither is always first).
    """
    samples = []
    for i in range(warmup + repeats):
        raw_s = raw() if raw is not None and i % 2 else None
        fresh_world()
        first = timed_build(spec, sync)
        cached = timed_build(spec, sync)
        if raw is not None and not i % 2:
            raw_s = raw()
        if i >= warmup:
            samples.append(Sample(*first, *cached, raw_s))
    return samples


# --------------------------------------------------------------------------- rows
def make_row(engine: str, spec: MeshSpec, wall: dict[str, list[float]], cpu: dict[str, list[float]],
             counts: dict[str, list[tuple[int, int, int]]], raw_s: list[float] | None,
             raw_splits: int | None) -> dict[str, Any]:
    """One result row.

    ``wall`` and ``cpu``: per kind (``first``, ``cached``), seconds per repeat, already the MAX
    over ranks; ``counts``: per kind, the counts of every (rank, repeat).
    """
    row: dict[str, Any] = {"engine": engine, "world_size": spec.world_size, "ndim": spec.ndim,
                           "request": list(spec.request), "shape": list(spec.shape), "dim_names": list(spec.names)}
    for kind in ("first", "cached"):
        times = wall[kind]
        seen = sorted(set(counts[kind]))
        if len(seen) > 1:
            LOG.warning("%s %s: counts (splits, collectives, new groups) of the %s build differ between "
                        "ranks or repeats: %s; reporting the largest", spec.shape, engine, kind, seen)
        prefix = "" if kind == "first" else "cached_"
        for i, key in enumerate(COUNT_KEYS):
            row[prefix + key] = max(c[i] for c in seen)
        row[prefix + "counts_consistent"] = len(seen) == 1
        row[prefix + "time_ms"] = median(times) * 1e3
        row[prefix + "time_ms_min"] = min(times) * 1e3
        row[prefix + "time_ms_repeats"] = [t * 1e3 for t in times]
        row[prefix + "cpu_ms"] = median(cpu[kind]) * 1e3
    row["mpi4py_splits"] = raw_splits
    row["mpi4py_time_ms"] = median(raw_s) * 1e3 if raw_s else None
    row["mpi4py_time_ms_repeats"] = [t * 1e3 for t in raw_s] if raw_s else None
    return row


def table_header(engine: str, repeats: int) -> str:
    top = (f"# mesh construction, engine {engine}: time (wall) and cpu (this rank's thread CPU) = max over "
           f"ranks, median of {repeats} repeats;\n# splits/colls/groups = collective splits, world-group "
           "collectives and new communicators of one init_device_mesh call")
    cols = (f"{'world':>5} {'dims':>4} {'shape':<10} | {'splits':>6} {'colls':>5} {'groups':>6} {'time ms':>8} "
            f"{'cpu ms':>7} | {'cached splits':>13} {'colls':>5} {'groups':>6} {'time ms':>8} {'cpu ms':>7}")
    if engine == "mpi":
        cols += f" | {'mpi4py Split ms':>15}"
    return "\n".join([top, cols, "-" * len(cols)])


def table_line(r: dict[str, Any]) -> str:
    shape = "(" + ", ".join(map(str, r["shape"])) + ("," if len(r["shape"]) == 1 else "") + ")"
    line = (f"{r['world_size']:>5} {r['ndim']:>4} {shape:<10} | {r['splits']:>6} {r['collectives']:>5} "
            f"{r['new_groups']:>6} {r['time_ms']:>8.3f} {r['cpu_ms']:>7.3f} | {r['cached_splits']:>13} "
            f"{r['cached_collectives']:>5} {r['cached_new_groups']:>6} {r['cached_time_ms']:>8.3f} "
            f"{r['cached_cpu_ms']:>7.3f}")
    if r["engine"] == "mpi":
        raw = r["mpi4py_time_ms"]
        line += f" | {raw:>15.3f}" if raw is not None and r["mpi4py_splits"] else f" | {'- (no split)':>15}"
    return line


def summary_lines(rows: list[dict[str, Any]]) -> list[str]:
    """What the counts say, derived from the rows (not assumed)."""
    lines = []
    for ndim in sorted({r["ndim"] for r in rows}):
        of = [r for r in rows if r["ndim"] == ndim]
        splits = sorted({r["splits"] for r in of})
        lines.append(f"# {ndim}-D: {'/'.join(map(str, splits))} split(s) per first build at world sizes "
                     f"{sorted({r['world_size'] for r in of})}")
    no_groups = all(r["cached_new_groups"] == 0 for r in rows)
    same_splits = sum(r["cached_splits"] == r["splits"] for r in rows)
    lines.append(f"# cached rebuilds: {'no' if no_groups else 'SOME'} new communicators; same number of "
                 f"collective splits as the first build in {same_splits}/{len(rows)} cases")
    if not all(r["counts_consistent"] and r["cached_counts_consistent"] for r in rows):
        lines.append("# WARNING: some counts differed between ranks or repeats (see the log)")
    return lines


# --------------------------------------------------------------------------- engines
def run_local(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (world size, mesh) on the in-process engine, one ``local.run`` each."""
    from meshkit.comm import local

    def rank_fn(spec: MeshSpec) -> list[Sample]:
        def fresh_world() -> None:
            meshkit.destroy_process_group()
            meshkit.init_process_group("local", timeout=args.timeout)
        return measure_rank(spec, repeats=args.repeats, warmup=args.warmup, fresh_world=fresh_world,
                            sync=meshkit.barrier)

    cases = [spec for n in args.world_sizes for spec in mesh_specs(n, args.ndims)]
    rows = []
    with Progress(len(cases), enabled=not args.no_progress, unit="mesh") as progress:
        emit = progress.write if not args.no_progress else functools.partial(print, flush=True)
        emit(table_header("local", args.repeats))
        for spec in cases:
            progress.start_group(f"world {spec.world_size} {spec.shape}")
            per_rank: list[list[Sample]] = local.run(rank_fn, spec.world_size, spec, timeout=args.timeout)
            by_repeat = list(zip(*per_rank))  # [repeat][rank]
            wall = {kind: [max(getattr(s, f"{kind}_s") for s in rep) for rep in by_repeat]
                    for kind in ("first", "cached")}
            cpu = {kind: [max(getattr(s, f"{kind}_cpu") for s in rep) for rep in by_repeat]
                   for kind in ("first", "cached")}
            counts = {kind: [getattr(s, f"{kind}_counts") for rank in per_rank for s in rank]
                      for kind in ("first", "cached")}
            row = make_row("local", spec, wall, cpu, counts, None, None)
            rows.append(row)
            emit(table_line(row))
            progress.step(f"{spec.shape}: {row['time_ms']:.2f} ms")
        for line in summary_lines(rows):
            emit(line)
    return rows


def run_mpi(args: argparse.Namespace, comm: MPI.Intracomm) -> list[dict[str, Any]]:
    """Every mesh that fits this job's world size, on the MPI engine (collective over ``comm``)."""
    from mpi4py import MPI

    rank, n = comm.Get_rank(), comm.Get_size()

    def fresh_world() -> None:
        if meshkit.is_initialized():
            meshkit.destroy_process_group()
        meshkit.init_process_group("mpi", timeout=args.timeout)

    specs = mesh_specs(n, args.ndims)
    rows = []
    show = rank == 0 and not args.no_progress
    with Progress(len(specs), enabled=show, unit="mesh") as progress:
        def emit(text: str) -> None:
            if show:
                progress.write(text)
            else:
                print0(rank, text)
        emit(table_header("mpi", args.repeats))
        for spec in specs:
            progress.start_group(f"world {n} {spec.shape}")
            colors = split_colors(spec.shape)

            def raw() -> float:
                barrier(comm)
                start = time.perf_counter()
                subs = [comm.Split(int(c[rank]), rank) for c in colors]
                seconds = time.perf_counter() - start
                for sub in subs:
                    sub.Free()
                return seconds

            samples = measure_rank(spec, repeats=args.repeats, warmup=args.warmup, fresh_world=fresh_world,
                                   sync=lambda: barrier(comm), raw=raw)
            wall = {kind: max_over_ranks(comm, [getattr(s, f"{kind}_s") for s in samples])
                    for kind in ("first", "cached")}
            cpu = {kind: max_over_ranks(comm, [getattr(s, f"{kind}_cpu") for s in samples])
                   for kind in ("first", "cached")}
            raw_s = max_over_ranks(comm, [s.raw_s for s in samples])  # type: ignore[misc]
            # counts: every rank's (repeat, kind, key) values; MIN and MAX over ranks show disagreement
            mine = np.array([[*s.first_counts, *s.cached_counts] for s in samples], dtype=np.int64)
            lo, hi = mine.copy(), mine.copy()
            comm.Allreduce(MPI.IN_PLACE, lo, op=MPI.MIN)
            comm.Allreduce(MPI.IN_PLACE, hi, op=MPI.MAX)
            both = np.concatenate([lo, hi])
            counts = {"first": [tuple(map(int, c[:3])) for c in both],
                      "cached": [tuple(map(int, c[3:])) for c in both]}
            row = make_row("mpi", spec, wall, cpu, counts, raw_s, len(colors))
            if row["splits"] != len(colors):
                LOG.warning("%s: meshkit made %d splits where the mpi4py baseline makes %d; the baseline "
                            "mirrors an older rule of meshkit's", spec.shape, row["splits"], len(colors))
            rows.append(row)
            emit(table_line(row))
            progress.step(f"{spec.shape}: {row['time_ms']:.2f} ms")
        for line in summary_lines(rows):
            emit(line)
    if meshkit.is_initialized():
        meshkit.destroy_process_group()
    return rows


# --------------------------------------------------------------------------- plot
def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Time vs world size, one color per number of dims; left: first build (and mpi4py), right: cached.

    Solid: wall time (max over ranks); dash-dot: CPU time; dotted, hollow: raw mpi4py
    ``Comm.Split`` (only where meshkit splits). Each wall point is labelled with its splits.
    """
    plt = require_pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
    engines = sorted({r["engine"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(10.5, 4.8), sharey=True)
    colors = {1: "tab:blue", 2: "tab:orange", 3: "tab:green"}
    label_dy = {1: 4, 2: -11, 3: 4}  # 2-D and 3-D times are close: labels on opposite sides
    markers = {"local": "o", "mpi": "s"}
    sizes = sorted({r["world_size"] for r in rows})
    ndims = sorted({r["ndim"] for r in rows})
    has_raw = False
    for engine in engines:
        for ndim in sorted({r["ndim"] for r in rows if r["engine"] == engine}):
            of = sorted((r for r in rows if r["engine"] == engine and r["ndim"] == ndim),
                        key=lambda r: r["world_size"])
            color, marker = colors.get(ndim, "gray"), markers.get(engine, "o")
            xs = [r["world_size"] for r in of]
            for ax, prefix in ((axes[0], ""), (axes[1], "cached_")):
                ax.plot(xs, [r[prefix + "time_ms"] for r in of], marker=marker, color=color)
                ax.plot(xs, [r[prefix + "cpu_ms"] for r in of], linestyle="-.", linewidth=0.9, alpha=0.6,
                        color=color)
                for r in of:
                    ax.annotate(str(r[prefix + "splits"]), (r["world_size"], r[prefix + "time_ms"]),
                                textcoords="offset points", xytext=(5, label_dy.get(ndim, 4)), fontsize=8,
                                color=color)
            raw = [(r["world_size"], r["mpi4py_time_ms"]) for r in of
                   if r.get("mpi4py_time_ms") is not None and r.get("mpi4py_splits")]
            if raw:
                has_raw = True
                axes[0].plot(*zip(*raw), marker=marker, markerfacecolor="none", linestyle=":", color=color)
    axes[0].set_title("first build, fresh world", fontsize="medium")
    axes[1].set_title("rebuild, groups cached (no new communicator)", fontsize="medium")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(sizes))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        if len(sizes) == 1:
            ax.set_xlim(sizes[0] / 1.5, sizes[0] * 1.5)
        ax.set_yscale("log")
        ax.grid(True, which="major", alpha=0.3)
        ax.set_xlabel("world size (ranks)")
    axes[0].set_ylabel("init_device_mesh time (ms, max over ranks)")
    handles = [Line2D([], [], color=colors.get(d, "gray"), linewidth=6, label=f"{d}-D mesh") for d in ndims]
    one_marker = markers.get(engines[0], "o") if len(engines) == 1 else "o"
    handles += [Line2D([], [], color="black", marker=one_marker, label="meshkit wall time"),
                Line2D([], [], color="black", linestyle="-.", linewidth=0.9, alpha=0.6, label="meshkit CPU time")]
    if has_raw:
        handles.append(Line2D([], [], color="black", linestyle=":", marker=one_marker, markerfacecolor="none",
                              label="raw mpi4py Comm.Split"))
    if len(engines) > 1:
        handles += [Line2D([], [], color="gray", marker=markers.get(e, "o"), linestyle="", label=e)
                    for e in engines]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize="small", frameon=False,
               bbox_to_anchor=(0.5, 0.045))
    fig.text(0.5, 0.01, "number at each point: collective splits on the world group during that call",
             ha="center", fontsize="small", color="dimgray")
    save_figure(fig, path, title, rect=(0, 0.1, 1, 1))


def plot_title(meta: dict[str, Any], engines: list[str], world_sizes: list[int]) -> str:
    engine = "/".join(engines)
    library = f", {meta['mpi_library'][:40]}" if meta.get("mpi_library") and "mpi" in engines else ""
    return (f"meshkit mesh construction: engine {engine}, world sizes {world_sizes}, "
            f"median of {meta.get('repeats', '?')}, {meta.get('hostname', '?')}{library}")


def plot_from(paths: list[Path], out: Path | None) -> None:
    """Draw the PNG from JSON files of earlier runs (rows merged; one metadata for the title)."""
    rows: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    for path in paths:
        data = load_result(path, "mesh")
        meta = meta or data["metadata"]
        rows += data["rows"]
    engines = sorted({r["engine"] for r in rows})
    png = out if out not in (None, Path()) else RESULTS / f"mesh-{'-'.join(engines)}.png"
    plot(rows, png, plot_title(meta, engines, sorted({r["world_size"] for r in rows})))
    LOG.info("wrote %s", png)


# --------------------------------------------------------------------------- command line
def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid list {text!r}; write comma-separated integers, e.g. 1,2,4") from None
    if not values:
        raise argparse.ArgumentTypeError(f"invalid list {text!r}: it is empty")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--engine", choices=("local", "mpi"), default="local",
                   help="local: world sizes as threads of this process; mpi: this job's ranks (meshkit-run -n N)")
    p.add_argument("--max-world", type=int, default=None,
                   help="local engine: world sizes 1, 2, 4, ... up to this (default 64)")
    p.add_argument("--world-sizes", type=_int_list, default=None,
                   help="local engine: comma-separated world sizes instead of the powers of two")
    p.add_argument("--ndims", type=_int_list, default=[1, 2, 3], help="mesh dimensions to measure, from 1,2,3")
    p.add_argument("--repeats", type=int, default=11, help="timed repeats per mesh; the median is reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed repeats per mesh first")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any blocking call waits at most")
    add_output_args(p, json_help="result file (default: benchmarks/results/mesh-local.json or mesh-mpi-n{N}.json)",
                    plot_from_nargs="+",
                    plot_from_help="measure nothing: plot these result files (e.g. mesh-mpi-n1.json "
                                   "mesh-mpi-n2.json) into --plot (default benchmarks/results/mesh-{engine}.png)")
    return p


def _job_size() -> int:
    """Ranks of the MPI job this process was started in, from the environment (1 if none)."""
    for name in SIZE_ENV_VARS:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 1


def _invalid(args: argparse.Namespace) -> str | None:
    """The first problem with ``args`` that argparse cannot see, or None."""
    error = matplotlib_missing(args)
    if error or args.plot_from is not None:
        return error
    if args.engine == "mpi" and (args.max_world is not None or args.world_sizes is not None):
        return ("--max-world and --world-sizes apply to --engine local only; with --engine mpi the world size "
                "is the job's (meshkit-run -n N)")
    if args.engine == "local" and _job_size() > 1:
        return (f"--engine local runs its ranks as threads of one process, but this is one of {_job_size()} "
                "MPI ranks; run it with plain python, or use --engine mpi under meshkit-run")
    if args.max_world is not None and args.world_sizes is not None:
        return "give --max-world or --world-sizes, not both"
    if args.max_world is not None and args.max_world < 1:
        return f"invalid --max-world {args.max_world}; it must be >= 1"
    if args.world_sizes is not None and min(args.world_sizes) < 1:
        return f"invalid --world-sizes {args.world_sizes}; every size must be >= 1"
    bad = [d for d in args.ndims if d not in DIM_NAMES]
    if bad:
        return f"invalid --ndims {bad}; valid numbers of dimensions are {sorted(DIM_NAMES)}"
    if args.repeats < 1:
        return f"invalid --repeats {args.repeats}; it must be >= 1"
    if args.warmup < 0:
        return f"invalid --warmup {args.warmup}; it must be >= 0"
    if not args.timeout > 0:
        return f"invalid --timeout {args.timeout}; it must be > 0"
    return None


def parse_args(rank: int, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate the command line (identically on every rank; rank 0 prints errors)."""
    args = parse_checked(build_parser(), rank, argv, _invalid)
    args.ndims = sorted(set(args.ndims))
    if args.engine == "local":
        if args.world_sizes is not None:
            args.world_sizes = sorted(set(args.world_sizes))
        else:
            top = args.max_world if args.max_world is not None else 64
            args.world_sizes = [1 << k for k in range(top.bit_length()) if 1 << k <= top]
    return args


def _save(args: argparse.Namespace, meta: dict[str, Any], rows: list[dict[str, Any]], default: Path) -> None:
    path = args.json or default
    write_json(path, meta, rows)
    LOG.info("wrote %s", path)
    if args.plot is not None:
        png = png_path(args.plot, path)
        engine = meta["engine"]
        plot(rows, png, plot_title(meta, [engine], sorted({r["world_size"] for r in rows})))
        LOG.info("wrote %s", png)


def main(argv: list[str] | None = None) -> int:
    rank = int(next((os.environ[v] for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK") if v in os.environ), 0))
    args = parse_args(rank, argv)
    if args.plot_from is not None:
        setup_logging(0, args.verbose)
        plot_from(args.plot_from, args.plot)
        return 0
    extra = dict(benchmark="mesh", engine=args.engine, repeats=args.repeats, warmup=args.warmup,
                 ndims=args.ndims, timeout=args.timeout,
                 load_average_1m=os.getloadavg()[0] if hasattr(os, "getloadavg") else None)
    if args.engine == "local":
        setup_logging(0, args.verbose)
        rows = run_local(args)
        meta = host_metadata(world_sizes=args.world_sizes, **extra)
        _save(args, meta, rows, RESULTS / "mesh-local.json")
        return 0
    from mpi4py import MPI
    comm = MPI.COMM_WORLD.Dup()  # barriers, time reductions and the raw baseline: never in meshkit's way
    rank, n = comm.Get_rank(), comm.Get_size()
    setup_logging(rank, args.verbose)
    rows = run_mpi(args, comm)
    meta = run_metadata(comm, **extra)  # collective (it gathers every rank's host)
    if rank == 0:
        _save(args, meta, rows, RESULTS / f"mesh-mpi-n{n}.json")
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
