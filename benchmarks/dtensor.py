"""DTensor's cost: each redistribution beside its collective (alone, and with the caller's work), and per-op overhead.

Run it by hand (a measurement, not a test; nothing here asserts on timings)::

    meshkit-run -n 4 benchmarks/dtensor.py                 # tables on rank 0
    meshkit-run -n 4 benchmarks/dtensor.py --plot          # ... and benchmarks/results/dtensor-n4.png
    meshkit-run -n 2 benchmarks/dtensor.py --max-bytes 1M --rounds 3
    python benchmarks/dtensor.py --plot-from benchmarks/results/dtensor-n4.json   # redraw only

With the pip-installed ``mpich`` wheel in a venv, use the venv's launcher (``.venv/bin/meshkit-run``).

What is measured, on a 1-D mesh over all N ranks, float64:

* ``redistribute``: for each transition (``S0->R`` all-gather, ``P->R`` all-reduce, ``P->S0``
  reduce-scatter, ``S0->S1`` all-to-all, ``R->S0`` a local slice, copied) and each global array size
  (``rows x 64`` float64, rows a multiple of N so no padding is needed), the time of
  ``DTensor.redistribute`` beside two baselines, timed in the same rounds:

  - ``collective (reused)``: the meshkit collective it issues (``ProcessGroup.all_gather_into_tensor``
    ...) on buffers allocated once, outside the timed calls, and nothing else; for ``S0->S1`` the
    send buffer is packed once, before timing. The lowest time the engine allows, and what the
    issue's "within 10% of the bare collective" literally compares against.
  - ``collective + caller's work`` (the floor): the same collective plus what any caller that
    wants the redistributed array must do: allocate the result (``np.empty`` each call; ``P->R``
    copies its term first, the all-reduce being in place), and for ``S0->S1`` pack the send
    buffer the cheapest way NumPy has (``np.empty`` and one ``np.copyto`` from a reshaped,
    transposed view; no unpack: the received buffer is the result). ``R->S0``: the slice, copied.

  Why the floor is the fair one for a functional ``redistribute``: it returns a new array (torch's
  does too), so it cannot write into a buffer the caller reuses, and an all-to-all moves
  contiguous chunks, so a block sharded on dim 0 must be transposed into them; the reused-buffer
  baseline skips both. The gap between the two baselines is not DTensor's: it is the
  allocation and the pack, which any implementation pays. One trap of the allocator, paid by the
  floor as by redistribute: on glibc, when two large blocks are freed together (``S0->S1``'s
  send buffer and a dropped result), ``free`` may give the top of the heap back to the kernel
  (``M_TRIM_THRESHOLD``), so the next call faults both in again (plain NumPy, two 512 KB
  ``np.ones`` per iteration: 224 page faults per iteration, and many times the time, against
  none for one). Run with ``MALLOC_TRIM_THRESHOLD_=268435456 MALLOC_MMAP_THRESHOLD_=67108864`` to
  see the loop without it. Both ratios are printed; the second is DTensor's layer: the program
  lookup, its copies, the wrapping. All three results are compared before timing (a wrong answer
  aborts the run).
* ``checks``: what the construction checks add per call, for a block of each
  ``--check-shapes`` per rank (global ``N`` times as many rows, ``[Shard(0)]``): ``distribute_tensor``
  (the all-gather of a fingerprint per mesh dim) beside the same construction without it, with
  ``src_data_rank=None`` (beside the local cut and copy alone) and with 0 (beside the scatter
  alone); ``from_local`` without ``shape=`` (the all-gather of the block sizes) beside it with
  ``shape=`` (no communication); ``from_local`` with ``shape=`` and the first ``redistribute``
  to Replicate (the check of the trusted shape, an all-gather of a fingerprint per mesh dim,
  then the data's all-gather) beside the same redistribution of a DTensor known to agree.
  ``added_us`` is the difference, ``ratio`` checked / unchecked.
* ``reductions``: issue 40's reductions on a ``[Shard(0)]`` array of each ``--reduce-shapes``
  block per rank (``var``/``std`` along axis 0 and whole, ``argmax`` whole and along axis 0,
  ``prod`` and ``cumsum`` along axis 0, ``linalg.norm``, ``count_nonzero`` of a boolean DTensor
  completed by ``full_tensor()``, and ``count(d>0)``: the comparison, the count and
  ``full_tensor()``, three DTensor ops), each beside its fair floor: the collective it needs on the group plus the
  local NumPy work, written by hand (:func:`reduction_pairs`), checked to agree before timing.
  The target: ratio within 1.20. Beside them, the closure the rule compiled for the request,
  called directly (``closure``: the cost without NumPy's ``__array_function__`` dispatch and the
  rule's lookup), and ``paired``: the median over rounds of each round's own ratio (the two
  calls of a round share its spell of the machine), steadier than a ratio of two picks.
* ``overhead``: for small arrays (``--op-shape``, default 8x8 per rank), the time of a DTensor
  op (``a + b``, ``np.tanh``, ``a @ w``, ``np.sum(axis=1)``, ``.T``, ``reshape``) minus the time
  of the same NumPy call on the local blocks, in microseconds: the cost of dispatch, placement
  rules and wrapping when no communication is needed (the project's target: under 20 us).

Timing follows ``collectives.py``: interleaved rounds (``--rounds``, default 5; the order of the
candidates rotates), in each a barrier then ``iters`` timed calls per candidate (adapted to
about 0.05 s unless ``--iters``); a call's time is the MAX over ranks of the per-call average,
reported as the median over rounds (``--stat min``: the fastest round, steadier on a loaded
machine). Rank 0 prints both tables and writes JSON (``benchmarks/results/dtensor-n{N}.json``)
and, with ``--plot``, a PNG: redistribute's time over each baseline against size, and the
per-op overhead bars.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from _common import (Progress, add_output_args, barrier, calibrate_iters, choice_list, format_size,
                     log2_size_axis, matplotlib_missing, max_over_ranks, median, parse_checked, parse_size,
                     print0, redraw, require_pyplot, run_metadata, save_figure, save_results, setup_logging,
                     size_sweep, time_calls)
from mpi4py import MPI

import meshkit
from meshkit.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from meshkit.tensor.distribute import _from_source
from meshkit.tensor.chunks import local_slices
from meshkit.tensor import reduction_plan as _plans

RESULTS = Path(__file__).resolve().parent / "results"
COLUMNS = 64  # float64 columns of the redistributed arrays
TRANSITIONS = ("S0->R", "P->R", "P->S0", "S0->S1", "R->S0")
OPS = ("add", "tanh", "matmul", "sum", "transpose", "reshape")
REDUCTIONS = ("var0", "varall", "std0", "argmax", "argmax0", "prod0", "cumsum0", "norm", "count_nonzero", "count(d>0)")
_PLACEMENT = {"S0": Shard(0), "S1": Shard(1), "R": Replicate(), "P": Partial()}


# --------------------------------------------------------------------------- candidates
def redistribution(name: str, rows: int, mesh: meshkit.DeviceMesh) -> tuple[Callable[[], Any], ...]:
    """``(redistribute, collective on reused buffers, collective + caller's work)`` for one
    transition, checked to agree (see the module docstring)."""
    src, dst = (_PLACEMENT[p] for p in name.split("->"))
    group, n, r = mesh.get_group(0), mesh.size(), mesh.get_local_rank(0)
    if src.is_replicate():  # every rank holds the same array
        d = distribute_tensor(np.random.default_rng(0).standard_normal((rows, COLUMNS)), mesh, [src], src_data_rank=None)
    else:  # this rank's term (Partial) or block (Shard)
        a = np.random.default_rng(r).standard_normal((rows if src.is_partial() else rows // n, COLUMNS))
        d = DTensor.from_local(a, mesh, [src], shape=(rows, COLUMNS))
    local = d.to_local()
    block = (rows // n, COLUMNS)
    if name == "S0->R":
        out = np.empty((rows, COLUMNS))
        bare = lambda: group.all_gather_into_tensor(out, local)  # noqa: E731

        def floor() -> Any:
            result = np.empty((rows, COLUMNS))
            group.all_gather_into_tensor(result, local)
            return result
    elif name == "P->R":
        out = local.copy()
        bare = lambda: group.all_reduce(out)  # noqa: E731 (in place on one buffer)

        def floor() -> Any:
            result = local.copy()  # the all-reduce is in place: keeping the term takes a copy
            group.all_reduce(result)
            return result
    elif name == "P->S0":
        out = np.empty(block)
        bare = lambda: group.reduce_scatter_tensor(out, local)  # noqa: E731

        def floor() -> Any:
            result = np.empty(block)
            group.reduce_scatter_tensor(result, local)
            return result
    elif name == "S0->S1":
        pieces = (n, rows // n, COLUMNS // n)  # [j]: my rows, rank j's columns
        chunks = local.reshape(rows // n, n, COLUMNS // n).transpose(1, 0, 2)  # a view
        send = np.ascontiguousarray(chunks)  # packed once, outside the timed calls
        out = np.empty(pieces)
        bare = lambda: group.all_to_all_single(out, send)  # noqa: E731

        def floor() -> Any:
            packed = np.empty(pieces)
            np.copyto(packed, chunks)  # the pack: one copy from the transposed view
            result = np.empty(pieces)
            group.all_to_all_single(result, packed)
            return result.reshape(rows, COLUMNS // n)  # [i]: rank i's rows, my columns: no unpack
    else:  # R->S0: no collective; the result is the slice, copied (into a reused buffer, or fresh)
        out = np.empty(block)
        mine = local[r * (rows // n):(r + 1) * (rows // n)]
        bare = lambda: np.copyto(out, mine)  # noqa: E731
        floor = mine.copy
    redistribute = lambda: d.redistribute(placements=[dst])  # noqa: E731
    got = redistribute().to_local()
    floor_got = floor()
    bare()
    if name == "P->R":
        out = local.copy()
        group.all_reduce(out)
        want = out
    elif name == "S0->S1":
        want = out.reshape(rows, COLUMNS // n)
    else:
        want = out
    if not (np.array_equal(got, want) and np.array_equal(floor_got, want)):
        raise SystemExit(f"meshkit.bench: rank {meshkit.get_rank()}: {name}: redistribute and the bare "
                         "collective disagree")
    return redistribute, bare, floor


def op_pairs(shape: tuple[int, int], mesh: meshkit.DeviceMesh
             ) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """``{op: (DTensor call, the same NumPy call on the local blocks)}``, none communicating."""
    n = mesh.size()
    rng = np.random.default_rng(1)
    g = rng.standard_normal((shape[0] * n, shape[1]))
    w = rng.standard_normal((shape[1], shape[1] * n))
    a, b = (distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for v in (g, g * 2))  # the same g everywhere
    x = distribute_tensor(g[: shape[0]], mesh, [Replicate()], src_data_rank=None)
    wd = distribute_tensor(w, mesh, [Shard(1)], src_data_rank=None)
    la, lb, lx, lw = a.to_local(), b.to_local(), x.to_local(), wd.to_local()
    return {
        "add": (lambda: a + b, lambda: la + lb),
        "tanh": (lambda: np.tanh(a), lambda: np.tanh(la)),
        "matmul": (lambda: x @ wd, lambda: lx @ lw),
        "sum": (lambda: np.sum(a, axis=1), lambda: np.sum(la, axis=1)),
        "transpose": (lambda: a.T, lambda: la.T),
        "reshape": (lambda: a.reshape(shape[0] * n, shape[1] // 2, 2),
                    lambda: la.reshape(shape[0], shape[1] // 2, 2)),
    }


def reduction_pairs(block: tuple[int, int], mesh: meshkit.DeviceMesh
                    ) -> dict[str, tuple[Callable[[], Any], ...]]:
    """``{reduction: (the DTensor call, its fair floor[, its compiled closure called directly])}`` on a ``[Shard(0)]`` array of ``block`` per
    rank, each checked to agree before timing. The floor is the collective the reduction needs on
    the group, written by hand with the cheapest NumPy on the block (methods, not the ``np.``
    wrappers; results computed into the buffer the collective sends) and the public group
    collectives a user has (the DTensor rules may use meshkit's prepared ones, which check their
    arguments once; the bytes and the collective are the same): ``var`` the local mean and M2 in
    one packed buffer, one all-gather of it and Chan's merge (equal weights: the blocks are equal
    here); ``argmax`` the local argmax and max (the value there) packed with the global index, one
    all-gather and the pick (along an axis by indexing each column's winner: ``np.take_along_axis``
    took several times as long on small blocks, so the floor no longer uses it); ``prod`` the local
    product and one all-reduce PRODUCT; ``cumsum`` the local scan, one all-gather of the last rows
    and the add; ``norm`` the local sum of squares, one all-reduce and the root;
    ``count_nonzero`` of a boolean DTensor (its Partial completed: ``.full_tensor()``) the local
    count and one all-reduce; ``count(d>0)`` the same with the comparison first (one DTensor op
    more, ``d > 0``, against ``x > 0``): the count as a user writes it."""
    group, n, r = mesh.get_group(0), mesh.size(), mesh.get_local_rank(0)
    rows, cols = block
    g = np.random.default_rng(3).standard_normal((rows * n, cols))
    d = distribute_tensor(g, mesh, [Shard(0)], src_data_rank=None)
    x = d.to_local()

    def var_floor(axis: Any) -> Any:
        # the cheapest NumPy by hand: (mean, M2) computed into one packed buffer (the mean as a sum
        # and a division, which is what np.mean does), one all-gather of it, Chan's merge with
        # equal weights (the blocks are equal here; the DTensor rule weighs them by their counts)
        count = x.size if axis is None else x.shape[0]
        mine = np.empty((2, *(1 if axis is None or d == axis else s for d, s in enumerate(x.shape))))
        x.sum(axis=axis, keepdims=True, out=mine[0])
        mine[0] /= count
        dev = x - mine[0]
        np.multiply(dev, dev, out=dev)
        dev.sum(axis=axis, keepdims=True, out=mine[1])
        every = np.empty((n, *mine.shape))
        group.all_gather_into_tensor(every, mine[None])
        means = every[:, 0]
        m = means.sum(axis=0)
        m /= n
        delta = means - m
        delta *= delta
        m2 = every[:, 1].sum(axis=0)
        m2 += delta.sum(axis=0) * count
        m2 /= count * n
        return m2.reshape(-1) if axis is not None else m2.reshape(())

    lines = np.arange(cols)

    def argmax_floor(axis: Any) -> Any:
        k = x.argmax(axis=axis)
        if axis is None:  # (value, global index) packed in one buffer for the one all-gather
            mine = np.empty(2)
            mine[0] = x.item(k)
            mine[1] = k + r * x.size
        else:
            mine = np.empty((2, cols))
            x.max(axis=0, out=mine[0])  # the value at the first maximum
            mine[1] = k
            mine[1] += r * rows
        every = np.empty((n, *mine.shape))
        group.all_gather_into_tensor(every, mine[None])
        if axis is None:
            return np.intp(every[every[:, 0].argmax(), 1])
        return every[every[:, 0].argmax(axis=0), 1, lines].astype(np.intp)  # each column's pick, by indexing

    def prod_floor() -> Any:
        out = x.prod(axis=0)
        group.all_reduce(out, meshkit.ReduceOp.PRODUCT)
        return out

    def cumsum_floor() -> Any:
        out = x.cumsum(axis=0)
        last = np.empty((n, cols))
        group.all_gather_into_tensor(last, out[-1:])
        if r:
            out += last[:r].sum(axis=0)
        return out

    def norm_floor() -> Any:
        out = np.array(np.dot(x.reshape(-1), x.reshape(-1)))
        group.all_reduce(out)
        return np.sqrt(out)

    mask, m = x > 0, d > 0  # count_nonzero's input: a boolean DTensor (the comparison is an op of its own)

    def count_floor() -> Any:
        out = np.array(np.count_nonzero(mask), dtype=np.intp)
        group.all_reduce(out)
        return out

    def chain_floor() -> Any:
        out = np.array(np.count_nonzero(x > 0), dtype=np.intp)
        group.all_reduce(out)
        return out

    pairs = {
        "var0": (lambda: np.var(d, axis=0), lambda: var_floor(0)),
        "varall": (lambda: np.var(d), lambda: var_floor(None)),
        "std0": (lambda: np.std(d, axis=0), lambda: np.sqrt(var_floor(0))),
        "argmax": (lambda: np.argmax(d), lambda: argmax_floor(None)),
        "argmax0": (lambda: np.argmax(d, axis=0), lambda: argmax_floor(0)),
        "prod0": (lambda: np.prod(d, axis=0), prod_floor),
        "cumsum0": (lambda: np.cumsum(d, axis=0), cumsum_floor),
        "norm": (lambda: np.linalg.norm(d), norm_floor),
        "count_nonzero": (lambda: np.count_nonzero(m).full_tensor(), count_floor),
        "count(d>0)": (lambda: np.count_nonzero(d > 0).full_tensor(), chain_floor),
    }
    out: dict[str, tuple[Callable[[], Any], ...]] = {}
    for name, (dt, floor) in pairs.items():
        before = set(_plans._compiled)
        got, want = dt(), floor()
        got = got.to_local() if isinstance(got, DTensor) else got
        if not np.allclose(got, want, rtol=1e-9, atol=1e-12, equal_nan=True):
            raise SystemExit(f"meshkit.bench: rank {meshkit.get_rank()}: {name}: the DTensor op and its floor disagree")
        made = [k for k in _plans._compiled if k not in before]
        # the closure the rule compiled for this request, called directly: what the op costs without
        # NumPy's __array_function__ dispatch and the rule's lookup (the counts are two or three
        # DTensor ops, `>`, the count and full_tensor, so they have no one closure to show)
        closure = _plans._compiled[made[0]][1] if len(made) == 1 and not name.startswith("count") else None
        out[name] = (dt, floor) if closure is None else (dt, floor, lambda c=closure: c(d))
    return out


def check_pairs(block: tuple[int, int], mesh: meshkit.DeviceMesh
                ) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """``{case: (checked construction, the same without the check)}`` for a ``block`` per rank."""
    n, coordinate, pl = mesh.size(), mesh.get_coordinate(), (Shard(0),)
    g = np.random.default_rng(2).standard_normal((block[0] * n, block[1]))
    mine = np.ascontiguousarray(g[local_slices(g.shape, mesh.shape, coordinate, pl)])
    return {
        "distribute_tensor(src_data_rank=None)": (
            lambda: distribute_tensor(g, mesh, pl, src_data_rank=None),
            lambda: DTensor(g[local_slices(g.shape, mesh.shape, coordinate, pl)].copy(), mesh, pl, shape=g.shape)),
        "distribute_tensor(src_data_rank=0)": (
            lambda: distribute_tensor(g, mesh, pl),
            lambda: DTensor(_from_source(g, mesh, coordinate, pl, 0), mesh, pl, shape=g.shape)),
        "from_local(no shape=)": (
            lambda: DTensor.from_local(mine, mesh, pl),
            lambda: DTensor.from_local(mine, mesh, pl, shape=g.shape)),
        # shape= is trusted; the first redistribution of the DTensor (or of one computed from it)
        # checks it, once: beside the same all-gather of a DTensor known to agree
        "from_local(shape=) + first redistribute": (
            lambda: DTensor.from_local(mine, mesh, pl, shape=g.shape).redistribute(placements=[Replicate()]),
            lambda: _agreed(DTensor.from_local(mine, mesh, pl, shape=g.shape)).redistribute(placements=[Replicate()])),
    }


def _agreed(d: DTensor) -> DTensor:
    """``d`` marked as known to agree (the check skipped), for the baseline beside the check."""
    for claim in d._claims or ():
        claim.settle()
    d._claims = None
    return d


# --------------------------------------------------------------------------- timing
def time_rounds(fns: tuple[Callable[[], Any], ...], args: argparse.Namespace, comm: MPI.Comm) -> list[list[float]]:
    """Each callable's MAX-over-ranks per-call seconds in every round, the callables interleaved."""
    iters = [args.iters or calibrate_iters(fn, comm, budget_s=0.05 / args.rounds, min_iters=5) for fn in fns]
    iters = [max(i, 1) for i in max_over_ranks(comm, iters)]
    samples: list[list[float]] = [[] for _ in fns]
    for rnd in range(args.rounds):
        for k in (*range(rnd % len(fns), len(fns)), *range(rnd % len(fns))):  # none always first
            for _ in range(args.warmup):
                fns[k]()
            barrier(comm)
            samples[k].append(time_calls(fns[k], int(iters[k])))
    flat = max_over_ranks(comm, [t for mine in samples for t in mine])
    return [flat[k * args.rounds:(k + 1) * args.rounds] for k in range(len(fns))]


def pick(args: argparse.Namespace, rounds: list[float]) -> float:
    """A call's time from its rounds: the fastest (``--stat min``) or the median."""
    return min(rounds) if args.stat == "min" else median(rounds)


def time_each(fns: tuple[Callable[[], Any], ...], args: argparse.Namespace, comm: MPI.Comm) -> list[float]:
    """Each callable's per-call seconds over interleaved rounds (:func:`pick`)."""
    return [pick(args, rounds) for rounds in time_rounds(fns, args, comm)]


def run(args: argparse.Namespace, comm: MPI.Comm, rank: int, n: int) -> list[dict[str, Any]]:
    mesh = meshkit.init_device_mesh("cpu", (n,))
    sizes = size_sweep(args.min_bytes, args.max_bytes)
    rows_list = sorted({max(n, (size // (8 * COLUMNS)) // n * n) for size in sizes})
    pairs = op_pairs((args.op_shape[0], args.op_shape[1]), mesh)
    out: list[dict[str, Any]] = []
    checks = [(shape, check_pairs(shape, mesh)) for shape in args.check_shapes]
    reductions = [(shape, reduction_pairs(shape, mesh)) for shape in args.reduce_shapes]
    total = len(args.transitions) * len(rows_list) + len(args.ops) + sum(len(c) for _, c in checks) + \
        len(args.reductions) * len(reductions)
    with Progress(total, enabled=rank == 0 and not args.no_progress, unit="case") as progress:
        for name in args.transitions:
            progress.start_group(name)
            for rows in rows_list:
                t_dt, t_bare, t_floor = time_each(redistribution(name, rows, mesh), args, comm)
                local_step = name == "R->S0"  # no collective: the baselines are a NumPy slice, copied
                out.append({"section": "redistribute", "transition": name, "bytes": rows * COLUMNS * 8,
                            "redistribute_us": 1e6 * t_dt, "collective_us": 1e6 * t_bare,
                            "floor_us": 1e6 * t_floor,
                            "ratio": None if local_step or t_bare <= 0 else t_dt / t_bare,
                            "ratio_floor": None if t_floor <= 0 else t_dt / t_floor})
                progress.step(format_size(rows * COLUMNS * 8))
        progress.start_group("ops")
        for op in args.ops:
            t_dt, t_np = time_each(pairs[op], args, comm)
            out.append({"section": "overhead", "op": op, "dtensor_us": 1e6 * t_dt, "numpy_us": 1e6 * t_np,
                        "overhead_us": 1e6 * (t_dt - t_np)})
            progress.step(op)
        progress.start_group("reductions")
        for shape, cases in reductions:
            for name in args.reductions:
                rounds = time_rounds(cases[name], args, comm)
                t_dt, t_floor, *t_closure = (pick(args, r) for r in rounds)
                closure = t_closure[0] if t_closure else None
                row = {"section": "reductions", "op": name, "block": list(shape), "dtensor_us": 1e6 * t_dt,
                       "floor_us": 1e6 * t_floor, "ratio": t_dt / t_floor if t_floor > 0 else None,
                       "closure_us": None if closure is None else 1e6 * closure,
                       "closure_ratio": None if closure is None or t_floor <= 0 else closure / t_floor,
                       # the median over rounds of each round's own ratio: the two timed side by side in
                       # one round share its spell of the machine (steadier than a ratio of two picks)
                       "paired_ratio": median([a / b for a, b in zip(rounds[0], rounds[1]) if b > 0])}
                if closure is not None:
                    row["paired_closure_ratio"] = median([a / b for a, b in zip(rounds[2], rounds[1]) if b > 0])
                out.append(row)
                progress.step(name)
        progress.start_group("checks")
        for shape, cases in checks:
            for case, pair in cases.items():
                t_checked, t_bare = time_each(pair, args, comm)
                out.append({"section": "checks", "case": case, "block": list(shape), "checked_us": 1e6 * t_checked,
                            "unchecked_us": 1e6 * t_bare, "added_us": 1e6 * (t_checked - t_bare),
                            "ratio": t_checked / t_bare if t_bare > 0 else None})
                progress.step(case)
    return out


# --------------------------------------------------------------------------- output
def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["redistribute beside the collective on reused buffers, and beside the collective plus what any",
             "caller must do (allocate the result; S0->S1: pack the send buffer): the fair floor of a",
             "functional redistribute (see the module docstring). Target: ratio within 1.10.",
             f"{'transition':<10} {'size':>8} {'redistribute us':>16} {'collective us':>14} {'ratio':>7} "
             f"{'coll+caller us':>15} {'ratio':>7}"]
    for r in rows:
        if r["section"] == "redistribute":
            ratio = "local" if r["ratio"] is None else f"{r['ratio']:.3f}"
            floor = "-" if r.get("ratio_floor") is None else f"{r['ratio_floor']:.3f}"
            lines.append(f"{r['transition']:<10} {format_size(r['bytes']):>8} {r['redistribute_us']:>16.2f} "
                         f"{r['collective_us']:>14.2f} {ratio:>7} {r.get('floor_us', float('nan')):>15.2f} {floor:>7}")
    lines.append("")
    lines.append(f"{'op':<10} {'DTensor us':>11} {'NumPy us':>9} {'overhead us':>12}   (target: overhead < 20 us)")
    for r in rows:
        if r["section"] == "overhead":
            lines.append(f"{r['op']:<10} {r['dtensor_us']:>11.2f} {r['numpy_us']:>9.2f} {r['overhead_us']:>12.2f}")
    reductions = [r for r in rows if r["section"] == "reductions"]
    if reductions:
        lines.append("")
        lines.append("reductions on [Shard(0)] beside their fair floor (the collective they need + the local "
                     "work, by hand). Target: ratio within 1.20")
        lines.append("(closure: the call the rule compiled for the request, called directly: the ratio without "
                     "NumPy's dispatch and the rule's lookup)")
        lines.append("(paired: the median over rounds of each round's DTensor / floor, and closure / floor)")
        lines.append(f"{'op':<14} {'block':>9} {'DTensor us':>11} {'floor us':>9} {'ratio':>7} {'closure us':>11} "
                     f"{'ratio':>7} {'paired':>7} {'paired':>7}")

        def cell(value: Any, spec: str) -> str:
            return "-" if value is None else format(value, spec)
        for r in reductions:
            lines.append(f"{r['op']:<14} {'x'.join(map(str, r['block'])):>9} {r['dtensor_us']:>11.2f} "
                         f"{r['floor_us']:>9.2f} {cell(r['ratio'], '.2f'):>7} {cell(r.get('closure_us'), '.2f'):>11} "
                         f"{cell(r.get('closure_ratio'), '.2f'):>7} {cell(r.get('paired_ratio'), '.2f'):>7} "
                         f"{cell(r.get('paired_closure_ratio'), '.2f'):>7}")
    checks = [r for r in rows if r["section"] == "checks"]
    if checks:
        lines.append("")
        lines.append("construction checks: checked beside the same construction without the check")
        lines.append(f"{'case':<40} {'block':>9} {'checked us':>11} {'unchecked us':>13} {'added us':>9} {'ratio':>7}")
        for r in checks:
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
            lines.append(f"{r['case']:<40} {'x'.join(map(str, r['block'])):>9} {r['checked_us']:>11.2f} "
                         f"{r['unchecked_us']:>13.2f} {r['added_us']:>9.2f} {ratio:>7}")
    return lines


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = require_pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    # transitions with a collective (R->S0, a local slice, is in the table only)
    redis = [r for r in rows if r["section"] == "redistribute" and r["ratio"] is not None]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, name in enumerate(dict.fromkeys(r["transition"] for r in redis)):
        mine = [r for r in redis if r["transition"] == name]
        color = colors[k % len(colors)]
        left.plot([r["bytes"] for r in mine], [r["ratio"] for r in mine], marker="o", ls=":", color=color, alpha=0.6)
        floor = [r for r in mine if r.get("ratio_floor") is not None]
        left.plot([r["bytes"] for r in floor], [r["ratio_floor"] for r in floor], marker="o", color=color, label=name)
    if redis:
        log2_size_axis(left, [r["bytes"] for r in redis])
    left.axhline(1.10, color="tab:red", ls="--", lw=1, label="target 1.10")
    left.axhline(1.0, color="gray", lw=0.8)
    left.set_xlabel("global array bytes")
    left.set_ylabel("redistribute time / baseline time")
    left.set_title("solid: vs collective + caller's work; dotted: vs collective on reused buffers", fontsize="small")
    left.legend(fontsize="small")
    left.grid(True, alpha=0.3)
    ops = [r for r in rows if r["section"] == "overhead"]
    right.bar(range(len(ops)), [r["overhead_us"] for r in ops], color="tab:blue", alpha=0.85)
    right.set_xticks(range(len(ops)), [r["op"] for r in ops])
    right.axhline(20, color="tab:red", ls="--", lw=1, label="target 20 us")
    right.set_ylabel("DTensor overhead per op (us)")
    right.legend(fontsize="small")
    right.grid(True, axis="y", alpha=0.3)
    save_figure(fig, path, title)


def plot_title(meta: dict[str, Any]) -> str:
    return (f"meshkit DTensor: {meta.get('world_size')} ranks, {meta.get('cores_per_host')} cores/host, "
            f"float64, 1-D mesh")


# --------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--min-bytes", type=parse_size, default=parse_size("4K"), help="smallest global array")
    p.add_argument("--max-bytes", type=parse_size, default=parse_size("16M"), help="largest global array")
    p.add_argument("--transitions", type=choice_list(TRANSITIONS, "transitions"), default=list(TRANSITIONS))
    p.add_argument("--ops", type=choice_list(OPS, "ops"), default=list(OPS))
    p.add_argument("--op-shape", default="8x8", help="per-rank block of the overhead ops, ROWSxCOLS (COLS even)")
    p.add_argument("--check-shapes", default="8x8,1024x128",
                   help="per-rank blocks of the construction checks' timing, ROWSxCOLS,... ('' for none)")
    p.add_argument("--reductions", type=choice_list(REDUCTIONS, "reductions"), default=list(REDUCTIONS))
    p.add_argument("--reduce-shapes", default="8x8,1024x64",
                   help="per-rank blocks of the reductions beside their floor, ROWSxCOLS,... ('' for none)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--stat", default="median", choices=("median", "min"),
                   help="how a call's time is taken from its rounds: the median, or the fastest round (min: "
                        "steadier on a machine others load, where a round's median moves by 2x and more)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per round (default: adapted)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before each timed block")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any blocking meshkit call waits at most")
    add_output_args(p, json_help="result file (default benchmarks/results/dtensor-n{N}.json)")
    return p


def _invalid(args: argparse.Namespace, n: int) -> str | None:
    if args.rounds < 1 or args.warmup < 0 or (args.iters is not None and args.iters < 1):
        return "--rounds and --iters must be >= 1 and --warmup >= 0"
    if args.min_bytes < 1 or args.max_bytes < args.min_bytes:
        return f"invalid sizes: --min-bytes {args.min_bytes} must be >= 1 and <= --max-bytes {args.max_bytes}"
    try:
        args.op_shape = tuple(int(v) for v in args.op_shape.lower().split("x"))
    except ValueError:
        args.op_shape = ()
    if len(args.op_shape) != 2 or min(args.op_shape) < 1 or args.op_shape[1] % 2:
        return "invalid --op-shape: write ROWSxCOLS with positive sizes and COLS even, e.g. 8x8"
    try:
        args.check_shapes = [tuple(int(v) for v in item.lower().split("x")) for item in args.check_shapes.split(",")
                             if item.strip()]
    except ValueError:
        args.check_shapes = [()]
    if any(len(shape) != 2 or min(shape) < 1 for shape in args.check_shapes):
        return "invalid --check-shapes: write ROWSxCOLS[,ROWSxCOLS...] with positive sizes, e.g. 8x8,1024x128"
    try:
        args.reduce_shapes = [tuple(int(v) for v in item.lower().split("x")) for item in args.reduce_shapes.split(",")
                              if item.strip()]
    except ValueError:
        args.reduce_shapes = [()]
    if any(len(shape) != 2 or min(shape) < 1 for shape in args.reduce_shapes):
        return "invalid --reduce-shapes: write ROWSxCOLS[,ROWSxCOLS...] with positive sizes, e.g. 8x8,1024x64"
    if "S0->S1" in args.transitions and COLUMNS % n:
        return f"S0->S1 needs {COLUMNS} columns to divide over the {n} ranks"
    return matplotlib_missing(args)


def main(argv: list[str] | None = None) -> int:
    comm = MPI.COMM_WORLD.Dup()  # barriers and time reductions: never in meshkit's way
    rank, n = comm.Get_rank(), comm.Get_size()
    args = parse_checked(build_parser(), rank, argv, lambda a: _invalid(a, n))
    setup_logging(rank, args.verbose)
    if args.plot_from is not None:
        if rank == 0:
            redraw(args, "dtensor", plot, plot_title)
        comm.Free()
        return 0
    meshkit.init_process_group("mpi", timeout=args.timeout)
    started = time.perf_counter()
    try:
        rows = run(args, comm, rank, n)
    finally:
        meshkit.destroy_process_group()
    meta = run_metadata(comm, benchmark="dtensor", columns=COLUMNS, transitions=args.transitions, ops=args.ops,
                        op_shape=list(args.op_shape), check_shapes=[list(s) for s in args.check_shapes],
                        reductions=args.reductions, reduce_shapes=[list(s) for s in args.reduce_shapes],
                        rounds=args.rounds, iters=args.iters, warmup=args.warmup, stat=args.stat,
                        seconds=time.perf_counter() - started,
                        load_average_1m=os.getloadavg()[0] if hasattr(os, "getloadavg") else None)
    if rank == 0:
        for line in table(rows):
            print0(rank, line)
        save_results(args, RESULTS / f"dtensor-n{n}.json", meta, rows, lambda png: plot(rows, png, plot_title(meta)))
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
