"""A machine as the planner sees it: levels of links with an alpha-beta cost per collective kind,
device memory and compute rate.

A collective of ``S`` bytes over ``n`` ranks costs ``alpha + bus_bytes(kind, S, n) * beta``
(alpha: latency in seconds; beta: seconds per byte of *bus* traffic). Bus bytes follow NCCL's
convention (nccl-tests ``doc/PERFORMANCE.md``, "algbw/busbw"): the bytes one rank's link carries
in a bandwidth-optimal (ring) algorithm, so one ``beta`` per link serves every group size:

======================  ===========================  ==========================================
kind                    ``S`` is                     bus bytes
======================  ===========================  ==========================================
all_reduce              the buffer                   ``2 (n - 1) / n * S``
all_gather              the gathered (full) output   ``(n - 1) / n * S``
reduce_scatter          the full input               ``(n - 1) / n * S``
all_to_all              one rank's send buffer       ``(n - 1) / n * S``
broadcast, reduce       the buffer                   ``S``
send_recv               the message                  ``S``
======================  ===========================  ==========================================

A machine may be calibrated (:func:`meshkit.plan.calibrate`) or described: e.g. a cluster of
nodes of 8 GPUs on NVLink and InfiniBand across nodes is two levels, ``Level("node", 8, ...)``
and ``Level("cluster", 10**6, ...)``; a mesh dimension whose ranks (with the dimensions inside
it) fit in a level's ``size`` uses that level's links.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any, Sequence

__all__ = ["KINDS", "PATHS", "LinkCost", "Level", "Machine", "bus_bytes"]

#: Collective kinds a level has a cost for.
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "send_recv")
#: Paths a level may price apart from its links (``Level.paths``): ``"shm"``, collectives of buffers
#: in a group's shared memory (comm/engines/shm.py), which run in place at any size.
PATHS = ("shm",)


def bus_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes one rank's link carries for ``kind`` of ``nbytes`` over ``n`` ranks (table above)."""
    if kind not in KINDS:
        raise ValueError(f"meshkit.plan: unknown collective kind {kind!r}; valid kinds are {', '.join(KINDS)}")
    if n <= 1 and kind != "send_recv":
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n * nbytes
    return float(nbytes)


def _number(where: str, field: str, value: Any, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"meshkit.plan: {where}: {field} must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"meshkit.plan: {where}: {field} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return value


def _costs_dict(costs: dict[str, LinkCost]) -> dict[str, dict[str, float]]:
    return {k: {"alpha": c.alpha, "beta": c.beta} for k, c in costs.items()}


def _costs_from(table: dict[str, Any], where: str) -> dict[str, LinkCost]:
    costs = {}
    for kind, c in table.items():
        if not isinstance(c, dict) or set(c) != {"alpha", "beta"}:
            raise ValueError(f"meshkit.plan: {where}[{kind!r}] must be {{'alpha': seconds, 'beta': seconds per byte}}, "
                             f"got {c!r}")
        costs[kind] = LinkCost(c["alpha"], c["beta"])
    return costs


@dataclasses.dataclass(frozen=True)
class LinkCost:
    """``alpha`` seconds of latency plus ``beta`` seconds per bus byte."""

    alpha: float
    beta: float

    def validate(self, where: str) -> None:
        _number(where, "alpha", self.alpha)
        _number(where, "beta", self.beta)


@dataclasses.dataclass(frozen=True)
class Level:
    """Links among groups of up to ``size`` ranks (``"node"``: the ranks of one host) with a cost
    per collective kind (a kind left out costs what ``all_reduce``'s link costs).

    ``sized`` holds costs fitted on groups of one size (group size -> kind -> cost), used for a
    collective over exactly that many ranks: a group of 4 ranks on 2 nodes keeps part of its
    traffic within a node (MPICH's algorithms are not NCCL's rings), so its cost per bus byte is
    not the 2-rank cross-node groups' (priced with those, flat data parallelism over
    2 simulated nodes was predicted about twice as slow as hsdp 2x2; measured 0.72-0.96x it).

    ``paths`` holds costs of another path than the level's links (path -> kind -> cost): ``"shm"``,
    a collective of a buffer in its group's shared memory (the strategies' buckets and flat buffers
    where the group's ranks share a node: comm/engines/shm.py), which takes that path at every
    size, while an ordinary buffer takes it only above ``MESHKIT_SHM_MIN_BYTES`` (32 MiB), beyond
    what calibration times; a level without it prices every collective on its links."""

    name: str
    size: int
    costs: dict[str, LinkCost]
    sized: dict[int, dict[str, LinkCost]] = dataclasses.field(default_factory=dict)
    paths: dict[str, dict[str, LinkCost]] = dataclasses.field(default_factory=dict)

    def cost(self, kind: str, n: int | None = None, path: str | None = None) -> LinkCost:
        """The cost of ``kind`` over ``n`` ranks: on ``path`` where the level has a cost of it for
        ``kind``, else the fit on groups of ``n`` where there is one, else the level's own."""
        found = self.paths.get(path, {}).get(kind) if path else None
        if found:
            return found
        for costs in (self.sized.get(n, {}), self.costs):
            if costs:
                found = costs.get(kind) or costs.get("all_reduce")
                if found:
                    return found
        return next(iter(self.costs.values()))


@dataclasses.dataclass
class Machine:
    """Levels of links (innermost first), device memory per rank and matmul-like compute rates.

    Args:
        levels: innermost first (e.g. node, then cluster); sizes non-decreasing.
        memory_bytes: memory of one rank's device (bytes); 0 means unknown (no cap from it).
        flops: ``dtype name -> flop/s`` of one rank for matmul-like work (``"float32"``...).
        fit_error: ``"level.kind" -> relative error`` of a calibration's fit (empty when described).
        update_rate: ``optimizer name -> float64 parameters per second`` its step updates on one
            rank (memory-bound: a dtype of half the bytes goes twice as fast); empty leaves the
            optimizer's step out of the step time (a described cluster).
        overlap: the fraction of a compute window that collectives launched beside it can hide
            under (1: a GPU's separate streams; near 0 on a host whose ranks have a core each and
            MPI progresses only inside its calls; calibrate measures it).
        sync_cost: seconds each collective of a step costs beyond its alpha-beta because ranks
            reach it from computation (uneven arrival, a descheduled peer): measured by calibrate
            (about 0.1 ms at 2 ranks on this 2-core host, 1.5 ms at 4, where a peer must wait for
            a core); 0 for a described cluster.
        copy_rate: bytes per second a rank copies into a newly allocated array (``array.copy()``
            of 4 MiB), the pass a strategy makes over each collective's buffer; 0 leaves it out
            (a described cluster: on a GPU it runs at HBM speed, beside the links' cost).
        pointwise_rate: ``dtype name -> elements per second`` of an activation function's forward
            and backward (``tanh`` and its derivative's product) on one rank; empty leaves
            activations out of the compute time (a described cluster, where they are fused into
            the matmuls' epilogues and cost little beside them).
    """

    levels: list[Level]
    memory_bytes: int = 0
    flops: dict[str, float] = dataclasses.field(default_factory=dict)
    name: str = "machine"
    fit_error: dict[str, float] = dataclasses.field(default_factory=dict)
    update_rate: dict[str, float] = dataclasses.field(default_factory=dict)
    overlap: float = 1.0
    pointwise_rate: dict[str, float] = dataclasses.field(default_factory=dict)
    sync_cost: float = 0.0
    copy_rate: float = 0.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if not isinstance(self.levels, list) or not self.levels:
            raise ValueError(f"meshkit.plan: Machine: levels must be a non-empty list of Level, got {self.levels!r}")
        previous = 0
        for i, level in enumerate(self.levels):
            where = f"Machine.levels[{i}]"
            if not isinstance(level, Level):
                raise ValueError(f"meshkit.plan: {where} must be a Level, got {type(level).__name__}")
            if isinstance(level.size, bool) or not isinstance(level.size, int) or level.size < 1:
                raise ValueError(f"meshkit.plan: {where}: size must be an integer >= 1, got {level.size!r}")
            if level.size < previous:
                raise ValueError(f"meshkit.plan: {where}: size {level.size} is below the level inside it ({previous})")
            previous = level.size
            if not level.costs:
                raise ValueError(f"meshkit.plan: {where}: costs must name at least one kind of {', '.join(KINDS)}")
            tables = [(f"{where}.costs", level.costs)]
            for n, costs in level.sized.items():
                if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= level.size:
                    raise ValueError(f"meshkit.plan: {where}.sized: a group size must be an integer in [2, "
                                     f"{level.size}] (the level's size), got {n!r}")
                tables.append((f"{where}.sized[{n}]", costs))
            for path, costs in level.paths.items():
                if path not in PATHS:
                    raise ValueError(f"meshkit.plan: {where}.paths: unknown path {path!r}; valid paths are "
                                     f"{', '.join(PATHS)}")
                tables.append((f"{where}.paths[{path}]", costs))
            for table, costs in tables:
                for kind, cost in costs.items():
                    if kind not in KINDS:
                        raise ValueError(f"meshkit.plan: {table}: unknown collective kind {kind!r}; valid kinds are "
                                         f"{', '.join(KINDS)}")
                    cost.validate(f"{table}[{kind!r}]")
        if isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int) or self.memory_bytes < 0:
            raise ValueError(f"meshkit.plan: Machine: memory_bytes must be an integer >= 0, got {self.memory_bytes!r}")
        for dtype, rate in self.flops.items():
            _number("Machine", f"flops[{dtype!r}]", rate, positive=True)
        if isinstance(self.overlap, bool) or not isinstance(self.overlap, (int, float)) or not 0 <= self.overlap <= 1:
            raise ValueError(f"meshkit.plan: Machine: overlap must be a number in [0, 1], got {self.overlap!r}")
        for opt, rate in self.update_rate.items():
            _number("Machine", f"update_rate[{opt!r}]", rate, positive=True)
        for dtype, rate in self.pointwise_rate.items():
            _number("Machine", f"pointwise_rate[{dtype!r}]", rate, positive=True)
        _number("Machine", "sync_cost", self.sync_cost)
        _number("Machine", "copy_rate", self.copy_rate)

    # ------------------------------------------------------------------ costs
    def level_for(self, span: int) -> Level:
        """The innermost level whose groups hold ``span`` ranks (a mesh dimension with the ones inside it)."""
        for level in self.levels:
            if span <= level.size:
                return level
        return self.levels[-1]

    def collective_time(self, kind: str, nbytes: float, n: int, span: int | None = None,
                        path: str | None = None) -> float:
        """Seconds for ``kind`` of ``nbytes`` over ``n`` ranks on the level holding ``span`` ranks
        (``path="shm"``: of a buffer in the group's shared memory, at that path's cost where the
        level has one: :class:`Level`)."""
        if n <= 1 and kind != "send_recv":
            return 0.0
        cost = self.level_for(span or n).cost(kind, n, path)
        return cost.alpha + bus_bytes(kind, nbytes, n) * cost.beta

    def compute_time(self, flops: float, dtype: str) -> float:
        rate = self.flops.get(dtype) or self.flops.get("float32")
        if not rate:
            raise ValueError(f"meshkit.plan: Machine {self.name!r} has no compute rate for {dtype!r} "
                             f"(flops has {sorted(self.flops)})")
        return flops / rate

    def pointwise_time(self, elements: float, dtype: str) -> float:
        """Seconds of an activation's forward and backward over ``elements`` values (0 when unknown)."""
        rate = self.pointwise_rate.get(dtype)
        return elements / rate if rate else 0.0

    def copy_time(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` on one rank (0 when the rate is unknown)."""
        return nbytes / self.copy_rate if self.copy_rate else 0.0

    def update_time(self, optimizer: str, elements: float, itemsize: int) -> float:
        """Seconds of ``optimizer``'s step over ``elements`` parameters (0 when its rate is unknown)."""
        rate = self.update_rate.get(optimizer)
        return elements * itemsize / (8 * rate) if rate else 0.0

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "memory_bytes": self.memory_bytes, "flops": dict(self.flops),
                "fit_error": dict(self.fit_error), "update_rate": dict(self.update_rate),
                "overlap": self.overlap, "pointwise_rate": dict(self.pointwise_rate), "sync_cost": self.sync_cost,
                "copy_rate": self.copy_rate,
                "levels": [{"name": lv.name, "size": lv.size, "costs": _costs_dict(lv.costs),
                            **({"sized": {str(n): _costs_dict(c) for n, c in lv.sized.items()}} if lv.sized else {}),
                            **({"paths": {p: _costs_dict(c) for p, c in lv.paths.items()}} if lv.paths else {})}
                           for lv in self.levels]}

    @classmethod
    def from_dict(cls, data: Any) -> Machine:
        """A machine from :meth:`to_dict`'s form; a missing or bad field raises ValueError naming it."""
        if not isinstance(data, dict) or not isinstance(data.get("levels"), list):
            raise ValueError("meshkit.plan: a machine description must be a JSON object with a 'levels' list")
        levels = []
        for i, lv in enumerate(data["levels"]):
            if not isinstance(lv, dict) or not isinstance(lv.get("costs"), dict):
                raise ValueError(f"meshkit.plan: Machine.levels[{i}] must be an object with 'name', 'size', 'costs'")
            costs = _costs_from(lv["costs"], f"Machine.levels[{i}].costs")
            sized = lv.get("sized", {})
            if not isinstance(sized, dict):
                raise ValueError(f"meshkit.plan: Machine.levels[{i}].sized must be an object (group size -> costs)")
            by_size = {}
            for n, table in sized.items():
                if not str(n).isdigit() or not isinstance(table, dict):
                    raise ValueError(f"meshkit.plan: Machine.levels[{i}].sized: keys must be group sizes and values "
                                     f"costs, got {n!r}: {table!r}")
                by_size[int(n)] = _costs_from(table, f"Machine.levels[{i}].sized[{n}]")
            paths = lv.get("paths", {})
            if not isinstance(paths, dict) or not all(isinstance(t, dict) for t in paths.values()):
                raise ValueError(f"meshkit.plan: Machine.levels[{i}].paths must be an object (path -> costs), "
                                 f"got {paths!r}")
            by_path = {str(p): _costs_from(t, f"Machine.levels[{i}].paths[{p}]") for p, t in paths.items()}
            levels.append(Level(str(lv.get("name", f"level{i}")), lv.get("size"), costs, by_size, by_path))
        return cls(levels, data.get("memory_bytes", 0), dict(data.get("flops", {})), str(data.get("name", "machine")),
                   dict(data.get("fit_error", {})), dict(data.get("update_rate", {})), data.get("overlap", 1.0),
                   dict(data.get("pointwise_rate", {})), data.get("sync_cost", 0.0), data.get("copy_rate", 0.0))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Machine:
        return cls.from_dict(json.loads(Path(path).read_text()))

    @classmethod
    def median(cls, machines: Sequence[Machine], name: str | None = None) -> Machine:
        """One machine whose every cost and rate is the median of ``machines``' (calibrations of
        the same mesh, e.g. taken at intervals through a long benchmark: a shared host's speed
        drifts by 10-30% over minutes, and one calibration then mis-scales every prediction made
        with it). The machines must have the same levels, kinds and rate keys; ValueError names
        the first that differs."""
        machines = list(machines)
        if not machines or not all(isinstance(m, Machine) for m in machines):
            raise ValueError("meshkit.plan: Machine.median: needs one or more Machine, got "
                             f"{[type(m).__name__ for m in machines]}")
        first = machines[0]

        def shape(m: Machine) -> Any:
            return ([(lv.name, lv.size, sorted(lv.costs), {n: sorted(c) for n, c in lv.sized.items()},
                      {p: sorted(c) for p, c in lv.paths.items()})
                     for lv in m.levels], sorted(m.flops), sorted(m.update_rate), sorted(m.pointwise_rate))

        for i, m in enumerate(machines[1:], 1):
            if shape(m) != shape(first):
                raise ValueError(f"meshkit.plan: Machine.median: machines[{i}] ({m.name!r}) does not have the levels, "
                                 f"kinds and rates of machines[0] ({first.name!r}): {shape(m)} vs {shape(first)}")

        def mid(values: Sequence[float]) -> float:
            return float(statistics.median(values))

        def costs(tables: Sequence[dict[str, LinkCost]]) -> dict[str, LinkCost]:
            return {k: LinkCost(mid([t[k].alpha for t in tables]), mid([t[k].beta for t in tables]))
                    for k in tables[0]}

        def rates(field: str) -> dict[str, float]:
            return {k: mid([getattr(m, field)[k] for m in machines]) for k in getattr(first, field)}

        levels = [Level(lv.name, lv.size, costs([m.levels[i].costs for m in machines]),
                        {n: costs([m.levels[i].sized[n] for m in machines]) for n in lv.sized},
                        {p: costs([m.levels[i].paths[p] for m in machines]) for p in lv.paths})
                  for i, lv in enumerate(first.levels)]
        errors = {k: mid([m.fit_error[k] for m in machines if k in m.fit_error])
                  for k in dict.fromkeys(k for m in machines for k in m.fit_error)}
        return cls(levels, int(mid([m.memory_bytes for m in machines])), rates("flops"),
                   name if name is not None else first.name, errors, rates("update_rate"),
                   mid([m.overlap for m in machines]), rates("pointwise_rate"), mid([m.sync_cost for m in machines]),
                   mid([m.copy_rate for m in machines]))

    @classmethod
    def describe_cluster(cls, *, gpus_per_node: int, nodes: int, intra_bw: float, intra_latency: float,
                         inter_bw: float, inter_latency: float, memory_bytes: int, flops: float,
                         name: str = "cluster") -> Machine:
        """A two-level cluster from link bandwidths (bytes/s) and latencies (s): e.g. 8 GPUs on
        NVLink (450e9 B/s, 3e-6 s) per node, InfiniBand (50e9 B/s, 10e-6 s) across nodes."""
        _number(name, "intra_bw", intra_bw, positive=True)
        _number(name, "inter_bw", inter_bw, positive=True)
        inner = {k: LinkCost(intra_latency, 1 / intra_bw) for k in KINDS}
        outer = {k: LinkCost(inter_latency, 1 / inter_bw) for k in KINDS}
        return cls([Level("node", gpus_per_node, inner), Level("cluster", gpus_per_node * nodes, outer)],
                   memory_bytes, {"float32": flops, "float64": flops / 2, "bfloat16": 2 * flops, "float16": 2 * flops},
                   name)
