"""Predict a configuration's per-rank memory and step time from a model and a machine.

Memory (``params``, ``grads``, ``optimizer_state``, ``comm_buffers``) is the strategies' own
arithmetic, byte for byte what their ``memory_report()`` says after a training step (the tests
build each strategy and compare integers): the flat layouts of
:mod:`~meshkit.parallel.data_parallelism.flat` (one per dtype, or per unit and dtype for FSDP,
padded to a multiple of the shard group), DDP's buckets (``assign_buckets``: no padding), ZeRO-2's
bucket pool (simulated: buffers are made when no free one fits and at most ``ZERO2_BUFFERED_BUCKETS``
are held), and the optimizer's state (AdamW: two arrays the size of what it updates; SGD: one
with momentum, none without).

Time is a model, not a measurement:

* the optimizer's step over the parameters this rank updates (all of them for ddp, a shard for
  zero and fsdp), at the machine's calibrated ``update_rate`` (left out, the model
  ranked ddp above zero1 while zero1 measured faster, benchmarks/scaling.py);
* compute: ``3 x forward flops x samples per data-parallel rank / tp / flop rate`` plus the
  activations' elements over the machine's pointwise rate, of the slowest stage, over
  ``1 - bubble_fraction(schedule, pp, microbatches)`` when pipelined;
* each collective of the step as the flight recorder lists it (op, bytes, mesh dimension:
  :func:`step_collectives`, tensor parallelism's all-reduces, pipeline sends and receives and the
  data-parallel strategy's, checked entry by entry against examples/train_3d.py's real step),
  timed by the machine's alpha-beta for its kind on the level that holds its dimension;
* overlap: (scaled by the machine's ``overlap``, the fraction of compute a collective can hide
  under: benchmarks/scaling.py measured the 2-core host's ranks overlapping nothing) a stream of collectives that runs beside a compute window ``W`` (DDP/ZeRO buckets beside
  the backward; FSDP's gathers beside the forward, its gathers and reduce-scatters beside the
  backward) exposes ``max(t_one, sum(t) - W)``, ``t_one`` being the collective that cannot overlap
  (the last bucket; the first gather). Everything else (the per-sync agreement, ZeRO's parameter
  all-gather after the step, tensor parallelism's all-reduces, pipeline sends and receives, and
  with ``loop="whole"`` FSDP's gathers before the pass and reductions after it) is exposed;
* each collective's buffer costs one pass through memory at the machine's ``copy_rate`` (the
  strategies pack gradients into buckets, gathered shards into units). At one rank, where the
  links cost nothing, FSDP measured 10-25% over DDP; most of that was page faults of buffers glibc
  had unmapped when freed, which meshkit-run's malloc settings remove, not the copies;
* each collective of the step adds the machine's ``sync_cost`` (ranks reach it from computation:
  uneven arrival, and on an oversubscribed host a peer waiting for a core: 4-rank steps on 2 cores
  took 1.3-3x the model without it, more for strategies with more calls).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import numpy as np

from ..parallel import bubble_fraction
from ..parallel._seams import (agreement_size, MB, ZERO2_BUFFERED_BUCKETS, Action, assign_buckets, gpipe_order,
                               interleaved_order, one_f_one_b_order, zb_h1_order, zbv_order)
from .machine import Machine
from .model import Config, Layer, Model

__all__ = ["Collective", "Breakdown", "estimate", "stage_layers", "rank_chunks", "local_shapes", "predict_memory",
           "predict_collectives", "step_collectives"]


class _DType(NamedTuple):
    """What ``assign_buckets`` reads of a dtype (numpy has no bfloat16)."""
    name: str
    itemsize: int


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a step: ``op`` as the flight recorder names it, ``nbytes`` (the full
    buffer: an all-gather's output, a reduce-scatter's input), the mesh dimension ``dim``, and its
    predicted ``seconds``; ``shared``: its buffer is one the strategy asks of the group
    (``ProcessGroup.shared_buffer``: DDP's and ZeRO-1's buckets, ZeRO's parameters, FSDP's gradient
    slots), so where the group's ranks share a node it runs in place in shared memory, priced at the
    level's ``"shm"`` path cost where it has one (:class:`~meshkit.plan.machine.Level`)."""
    op: str
    nbytes: int
    dim: str
    seconds: float = 0.0
    shared: bool = False


@dataclasses.dataclass
class Breakdown:
    """A prediction: per-rank memory (the stage holding the most; per stage in ``stage_memory``),
    the collectives of one step of the slowest pipeline rank (the one with the most compute, whose
    time is the step's) and the step time's parts: ``step_s = compute_s + bubble_s +
    exposed_comm_s + optimizer_s + copy_s`` (``comm_s``: all of the communication, hidden or not)."""
    config: Config
    memory: dict[str, int]
    stage_memory: list[dict[str, int]]
    activation_bytes: int
    collectives: list[Collective]
    compute_s: float
    bubble_s: float
    comm_s: float
    exposed_comm_s: float
    step_s: float
    optimizer_s: float = 0.0
    copy_s: float = 0.0

    @property
    def memory_total(self) -> int:
        held = sum(v for k, v in self.memory.items() if k != "peak_transient")
        return held + max(self.memory["peak_transient"] - self.memory["comm_buffers"], 0) + self.activation_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.name(), "memory": self.memory, "activation_bytes": self.activation_bytes,
                "stage_memory": self.stage_memory, "compute_s": self.compute_s, "bubble_s": self.bubble_s,
                "comm_s": self.comm_s, "exposed_comm_s": self.exposed_comm_s, "step_s": self.step_s,
                "optimizer_s": self.optimizer_s, "copy_s": self.copy_s,
                "collectives": [dataclasses.asdict(c) for c in self.collectives]}


def stage_layers(model: Model, pp: int) -> list[list[Layer]]:
    """Contiguous runs of layers per pipeline stage (``numpy.array_split``'s rule)."""
    if pp > len(model.layers):
        raise ValueError(f"meshkit.plan: pp={pp} stages need at least {pp} layers, the model has {len(model.layers)}")
    return [list(part) for part in np.array_split(np.array(model.layers, dtype=object), pp)]


def _virtual(config: Config) -> int:
    """Stages a rank holds: two with ``interleaved`` (train_3d.py's default ``--virtual 2``) and ``zbv`` (its V)."""
    return 2 if config.schedule in ("interleaved", "zbv") else 1


def rank_chunks(model: Model, config: Config, stage: int = 0) -> list[tuple[int, list[Layer]]]:
    """The pipeline stages pipeline rank ``stage`` holds, as (stage index, its layers): stage
    ``stage`` of ``pp``; with ``interleaved``, stages ``stage + k pp`` of ``2 pp``; with ``zbv``,
    stages ``stage`` and ``2 pp - 1 - stage`` (the V). Its data-parallel strategy holds their
    layers in this order (examples/train_3d.py)."""
    v, p = _virtual(config), config.pp
    if v > 1 and p * v > len(model.layers):
        raise ValueError(f"meshkit.plan: schedule {config.schedule!r} holds {v} stages a rank: pp={p} needs at least "
                         f"{p * v} layers, the model has {len(model.layers)}")
    parts = stage_layers(model, p * v)
    mine = [stage] if v == 1 else [stage, 2 * p - 1 - stage] if config.schedule == "zbv" else [stage + p * k
                                                                                                 for k in range(v)]
    return [(s, parts[s]) for s in mine]


def _rank_layers(model: Model, config: Config, stage: int) -> list[Layer]:
    return [layer for _, layers in rank_chunks(model, config, stage) for layer in layers]


def local_shapes(layers: list[Layer], tp: int, tp_rank: int = 0) -> dict[str, tuple[int, ...]]:
    """``layer.param -> shape`` on tensor-parallel rank ``tp_rank``: a ``tp_dim`` split as
    ``Shard`` splits (torch.chunk: chunks of ``ceil(size / tp)``, the last ones shorter or empty)."""
    out = {}
    for layer in layers:
        for p, shape in layer.params.items():
            dim = layer.tp_dim.get(p)
            if tp > 1 and dim is not None:
                chunk = -(-shape[dim] // tp)
                shape = shape[:dim] + (max(0, min(chunk, shape[dim] - chunk * tp_rank)),) + shape[dim + 1:]
            out[f"{layer.name}.{p}"] = shape
    return out


def _state_arrays(config: Config) -> int:
    if config.optimizer == "adamw":
        return 2
    return 1 if config.momentum else 0


def _buckets(shapes: dict[str, tuple[int, ...]], dtype: _DType, config: Config, ready: bool = False) -> list[int]:
    """Element counts of the buckets, in launch order (the reverse of registration; with ``ready``,
    the order the loop makes gradients ready in, into which DDP rebuilds its buckets after the
    first step: ddp.py's ``_rebuild``, as torch's reducer)."""
    order = list(shapes) if ready and config.loop == "whole" else list(reversed(shapes))
    groups = assign_buckets([(n, shapes[n], dtype) for n in order], bucket_cap_bytes=int(config.bucket_cap_mb * MB),
                            first_bucket_cap_bytes=int(config.first_bucket_cap_mb * MB))
    return [sum(math.prod(shapes[n]) for n in names) for names in groups]


def _pool_bytes(sizes: list[int], itemsize: int, limit: int = ZERO2_BUFFERED_BUCKETS) -> tuple[int, int]:
    """ZeRO-2's BufferPool footprint and peak live bytes when buckets fill and launch in order
    (pool.py's rule: the smallest free buffer that fits, else a new one, after waiting for the
    oldest launched holder while ``limit`` are held)."""
    free: list[int] = []
    made = peak = 0
    # The pool lives across steps: a later step finds free buffers that fit and so does not wait
    # (the limit applies only when none fits), holding more at once than the first step. Three
    # steps reach the steady state: from the second on, every step starts with every buffer free.
    for _ in range(3):
        holders: list[int] = []
        for size in sizes:
            while not any(b >= size for b in free) and len(holders) >= limit:
                free.append(holders.pop(0))  # the oldest holder is launched: wait and release it
            fits = [b for b in free if b >= size]
            if fits:
                buf = min(fits)
                free.remove(buf)
            else:
                buf = size
                made += size * itemsize
            holders.append(buf)
            peak = max(peak, sum(holders) * itemsize)
        free.extend(reversed(holders))  # the step waits for the rest, last bucket first
    return made, peak


def predict_memory(model: Model, config: Config, stage: int = 0, tp_rank: int = 0) -> dict[str, int]:
    """``memory_report()`` after a step on pipeline ``stage``'s tensor-parallel rank ``tp_rank``:
    params, grads, optimizer_state, comm_buffers (held between steps) and peak_transient (the most
    communication buffers held at once, not counted in the total)."""
    layers = _rank_layers(model, config, stage)
    shapes = local_shapes(layers, config.tp, tp_rank)
    it, k = model.itemsize, _state_arrays(config)
    numel = sum(math.prod(s) for s in shapes.values())
    n = config.dp_shard
    if config.strategy == "ddp":
        return {"params": numel * it, "grads": numel * it, "optimizer_state": k * numel * it, "comm_buffers": 0,
                "peak_transient": 0}
    if config.strategy in ("zero1", "zero2"):
        padded = -(-numel // n) * n if numel else 0
        shard = padded // n
        if config.strategy == "zero1":
            return {"params": padded * it, "grads": padded * it, "optimizer_state": k * shard * it, "comm_buffers": 0,
                    "peak_transient": 0}
        pool, peak = _pool_bytes(_buckets(shapes, _DType(model.dtype, it), config), it)
        return {"params": padded * it, "grads": shard * it, "optimizer_state": k * shard * it, "comm_buffers": pool,
                "peak_transient": peak}
    # fsdp / hsdp: one flat layout per unit (a layer with parameters), each padded to dp_shard; the
    # peak is the largest unit unsharded (a loop that unshards one unit at a time, no prefetch), or
    # every unit at once (loop="whole")
    units = [sum(math.prod(shapes[f"{layer.name}.{p}"]) for p in layer.params) for layer in layers if layer.params]
    shard = sum(-(-u // n) for u in units)
    padded = [-(-u // n) * n for u in units]
    peak = (sum(padded) if config.loop == "whole" else max(padded, default=0)) * it
    return {"params": shard * it, "grads": shard * it, "optimizer_state": k * shard * it, "comm_buffers": 0,
            "peak_transient": peak}


def predict_collectives(model: Model, config: Config, stage: int = 0, tp_rank: int = 0) -> list[Collective]:
    """The collectives of one steady-state training step of pipeline ``stage``'s data-parallel
    strategy, in the order its flight record lists them (seconds left 0: see :func:`estimate`).

    DDP/ZeRO: buckets of the gradients in backward order (the reverse of registration; DDP's,
    with ``loop="whole"``, in forward order, the order that loop marks them in); FSDP
    (``loop="per_layer"``): each unit unsharded in the forward, then, in reverse, unsharded
    again (``reshard_after_forward``, the default) and its gradients reduced; (``loop="whole"``)
    every unit unsharded, then every unit's gradients reduced, last unit first (the order FSDP
    reduces units in, whatever order they are marked in); then the per-pass agreement. The whole step,
    tensor and pipeline parallelism's too: :func:`step_collectives`.
    """
    before, after = _dp_collectives(model, config, stage, tp_rank)
    return before + after


def _dp_collectives(model: Model, config: Config, stage: int, tp_rank: int
                    ) -> tuple[list[Collective], list[Collective]]:
    """The data-parallel strategy's collectives: those before the forward and backward pass
    (FSDP's forward gathers) and those after them."""
    layers = _rank_layers(model, config, stage)
    shapes = local_shapes(layers, config.tp, tp_rank)
    it = model.itemsize
    n = config.dp_shard
    out: list[Collective] = []
    if config.strategy in ("ddp", "zero1", "zero2"):
        sizes = _buckets(shapes, _DType(model.dtype, it), config, ready=config.strategy == "ddp")
        numel = sum(sizes)
        padded = -(-numel // n) * n
        # issued at one rank too: the strategies do not special-case a group of one; buckets are
        # launched in bucket order whatever the order gradients are marked in (reducer.py)
        start = 0
        for size in sizes:
            if config.strategy == "zero2":  # one reduce per owner's piece of the bucket (zero.py)
                shard = padded // n
                for owner in range(n):
                    lo, hi = max(start, owner * shard), min(start + size, (owner + 1) * shard)
                    if lo < hi:
                        out.append(Collective("reduce", (hi - lo) * it, "dp"))
            else:
                out.append(Collective("all_reduce", size * it, "dp", shared=True))
            start += size
        out.append(Collective("all_reduce", 4 * agreement_size(n), "dp"))  # the per-sync agreement (int32 rows)
        if config.strategy != "ddp":
            out.append(Collective("all_gather", padded * it, "dp", shared=True))
        return [], out
    units = [sum(math.prod(shapes[f"{layer.name}.{p}"]) for p in layer.params) for layer in layers if layer.params]
    padded = [-(-u // n) * n for u in units]
    shard_dim = "dp_shard" if config.strategy == "hsdp" else "dp"
    before = [Collective("all_gather", p * it, shard_dim) for p in padded]
    for p in reversed(padded):  # units are reduced last unit first, whatever order they are marked in
        if config.loop == "per_layer":
            out.append(Collective("all_gather", p * it, shard_dim))
        out.append(Collective("reduce_scatter", p * it, shard_dim, shared=True))
        if config.strategy == "hsdp":
            out.append(Collective("all_reduce", p // n * it, "dp_replicate"))
    out.append(Collective("all_reduce", 4 * agreement_size(n), shard_dim))  # the per-pass agreement (fsdp.py)
    if config.strategy == "hsdp":
        out.append(Collective("all_reduce", 4 * agreement_size(config.dp_replicate), "dp_replicate"))
    return before, out


def _order(config: Config, stage: int) -> list[Action]:
    """Pipeline rank ``stage``'s passes in its schedule's order (meshkit.parallel's own orders)."""
    p, m = config.pp, config.microbatches
    if config.schedule == "interleaved":
        return interleaved_order(stage, p, _virtual(config), m)
    if config.schedule == "zbv":
        return zbv_order(stage, p, m)
    return {"gpipe": gpipe_order, "1f1b": one_f_one_b_order, "zbh1": zb_h1_order}[config.schedule](stage, p, m)


def _input_bytes(model: Model) -> dict[str, int]:
    """Each layer's input bytes per sample: its ``input_bytes``, else the previous layer's output."""
    out, prev = {}, model.layers[0].activation_bytes
    for layer in model.layers:
        out[layer.name] = layer.input_bytes or prev
        prev = layer.activation_bytes
    return out


def step_collectives(model: Model, config: Config, stage: int = 0, tp_rank: int = 0) -> list[Collective]:
    """Every collective of one steady-state training step on pipeline rank ``stage``, tensor-parallel
    rank ``tp_rank``, in the order the flight recorder lists them (``op``, ``nbytes``, ``dim``;
    seconds left 0), for a step run as examples/train_3d.py runs it: the stages' passes in the
    schedule's order (:func:`rank_chunks`), then the data-parallel strategy's collectives
    (:func:`predict_collectives`; FSDP's gathers before the passes).

    Each forward pass of a stage (a microbatch of ``batch / dp / microbatches`` samples): ``recv``
    of its input (but on the first stage, or from a stage on this rank), one ``tp`` all-reduce of
    the output of each rowwise (and block) layer, ``send`` of its output (but on the last stage).
    Each backward pass (the zero-bubble schedules' B; W issues nothing): ``recv`` of the output's
    gradient, one ``tp`` all-reduce of the input gradient of each colwise (and block) layer, last
    layer first (the first stage's too), ``send`` of the input's gradient. Tensor parallelism's
    all-reduces only where ``tp > 1`` (:attr:`Layer.tp_style`)."""
    if model.batch % (config.dp * config.microbatches):
        raise ValueError(f"meshkit.plan: batch {model.batch} does not split over {config.dp} data-parallel ranks "
                         f"into {config.microbatches} microbatches each")
    mb = model.batch // config.dp // config.microbatches
    p, v = config.pp, _virtual(config)
    n = p * v
    mine = dict(rank_chunks(model, config, stage))
    out_bytes = [layers[-1].activation_bytes * mb for layers in stage_layers(model, n)]
    held_by = (lambda s: s if s < p else 2 * p - 1 - s) if config.schedule == "zbv" else (lambda s: s % p)
    inputs = _input_bytes(model)
    tp = config.tp > 1

    def pp(op: str, s: int, nbytes: int) -> list[Collective]:  # a transfer to or from stage s, unless held here
        return [Collective(op, nbytes, "pp")] if 0 <= s < n and held_by(s) != stage else []

    passes: list[Collective] = []
    for a in _order(config, stage):
        s, layers = a.stage, mine[a.stage]
        if a.kind == "F":
            passes += pp("recv", s - 1, out_bytes[s - 1] if s else 0)
            passes += [Collective("all_reduce", layer.activation_bytes * mb, "tp") for layer in layers
                       if tp and layer.tp_style in ("rowwise", "block")]
            passes += pp("send", s + 1, out_bytes[s])
        elif a.kind == "B":
            passes += pp("recv", s + 1, out_bytes[s])
            passes += [Collective("all_reduce", inputs[layer.name] * mb, "tp") for layer in reversed(layers)
                       if tp and layer.tp_style in ("colwise", "block")]
            passes += pp("send", s - 1, out_bytes[s - 1] if s else 0)
    before, after = _dp_collectives(model, config, stage, tp_rank)
    return before + passes + after


def _spans(config: Config) -> dict[str, tuple[int, int]]:
    """Mesh dimension -> (its size, ranks it spans with the dimensions inside it); the mesh is
    ``(pp, dp_replicate, dp_shard, tp)``, tp innermost (on the fastest links)."""
    tp, s, r = config.tp, config.dp_shard, config.dp_replicate
    return {"tp": (tp, tp), "dp": (s, s * tp), "dp_shard": (s, s * tp), "dp_replicate": (r, r * s * tp),
            "pp": (config.pp, config.world_size)}


def _kind(op: str) -> str:
    return {"send": "send_recv", "recv": "send_recv"}.get(op, op)


def _exposed(times: list[float], window: float, unhidden: float) -> float:
    """A stream of collectives beside ``window`` seconds of compute exposes ``max(unhidden, sum - window)``."""
    return max(unhidden, sum(times) - window) if times else 0.0


def _compute_time(layers: list[Layer], samples: int, config: Config, model: Model, machine: Machine) -> float:
    """A pipeline rank's forward and backward over ``samples``: ``3 x`` the matmul flops at the
    machine's flop rate, plus the activations' elements at its pointwise rate. A layer split over
    tp does its share of the flops (a replicated one all of them) and, colwise, its share of the
    activation; a rowwise or block layer's output is all-reduced, whole on every tp rank, and so is
    its activation (examples/train_3d.py)."""
    tp = config.tp
    flops = 3 * sum(layer.flops / (1 if layer.tp_style == "replicated" else tp) for layer in layers) * samples
    pointwise = sum(layer.pointwise / (tp if layer.tp_style == "colwise" else 1) for layer in layers) * samples
    return machine.compute_time(flops, model.dtype) + machine.pointwise_time(pointwise, model.dtype)


def estimate(config: Config, model: Model, machine: Machine) -> Breakdown:
    """Predict ``config``'s per-rank memory and step time for ``model`` on ``machine``."""
    if not isinstance(config, Config) or not isinstance(model, Model) or not isinstance(machine, Machine):
        raise TypeError(f"meshkit.plan: estimate(config, model, machine) takes a Config, a Model and a Machine, got "
                        f"{type(config).__name__}, {type(model).__name__}, {type(machine).__name__}")
    if model.batch % config.dp:
        raise ValueError(f"meshkit.plan: batch {model.batch} does not divide over {config.dp} data-parallel ranks")
    local_batch = model.batch // config.dp
    if local_batch % config.microbatches:
        raise ValueError(f"meshkit.plan: {local_batch} samples per data-parallel rank do not split into "
                         f"{config.microbatches} microbatches")
    spans = _spans(config)
    stages = stage_layers(model, config.pp)
    stage_memory = [predict_memory(model, config, s) for s in range(config.pp)]
    computes = [_compute_time(_rank_layers(model, config, s), local_batch, config, model, machine)
                for s in range(config.pp)]
    busiest = int(np.argmax([sum(m.values()) - m["peak_transient"] for m in stage_memory]))
    slowest = int(np.argmax(computes))
    compute = computes[slowest]
    bubble = bubble_fraction(config.schedule, config.pp, config.microbatches) if config.pp > 1 else 0.0
    bubble_s = compute * bubble / (1 - bubble)
    colls = []
    for c in step_collectives(model, config, slowest):
        size, span = spans[c.dim]
        path = "shm" if c.shared else None
        colls.append(dataclasses.replace(c, seconds=machine.collective_time(_kind(c.op), c.nbytes, size, span, path)))
    forward, backward = compute / 3, 2 * compute / 3
    comm = sum(c.seconds for c in colls)
    if config.strategy in ("ddp", "zero1", "zero2"):
        grads = [c.seconds for c in colls if c.op in ("all_reduce", "reduce") and c.dim == "dp"][:-1]
        # loop="whole" hands every gradient over after the pass: no backward left to hide under
        window = backward * machine.overlap if config.loop == "per_layer" else 0.0
        hidden = _exposed(grads, window, grads[-1] if grads else 0.0)
        rest = sum(c.seconds for c in colls) - sum(grads)
    elif config.loop == "whole":  # every gather before the passes, every reduction after: nothing beside them
        hidden = 0.0
        rest = comm
    else:
        # the per-pass agreement, the step's last collective(s) (HSDP: over both dims), follows the
        # backward pass: nothing beside it
        agreed = 2 if config.strategy == "hsdp" else 1
        streamed, agreement = colls[:-agreed], colls[-agreed:]
        gathers = [c.seconds for c in streamed if c.op == "all_gather"]
        fwd, bwd_g = gathers[:len(gathers) // 2], gathers[len(gathers) // 2:]
        bwd = bwd_g + [c.seconds for c in streamed if c.op == "reduce_scatter" or c.dim == "dp_replicate"]
        hidden = (_exposed(fwd, forward * machine.overlap, fwd[0] if fwd else 0.0)
                  + _exposed(bwd, backward * machine.overlap, bwd[-1] if bwd else 0.0))
        rest = sum(c.seconds for c in streamed if c.dim in ("tp", "pp")) + sum(c.seconds for c in agreement)
    # every collective of the step is reached from computation: the machine's sync cost each
    exposed = hidden + rest + machine.sync_cost * len(colls)
    layers = stages[busiest]
    in_flight = 1 if config.pp == 1 else (config.microbatches if config.schedule == "gpipe"
                                          else min(config.pp, config.microbatches))
    acts = sum(layer.activation_bytes for layer in layers) * (local_batch // config.microbatches) * in_flight
    acts //= config.tp
    held = stage_memory[slowest]["params"] // model.itemsize
    updated = -(-held // config.dp_shard) if config.strategy in ("zero1", "zero2") else held
    optimizer_s = machine.update_time(config.optimizer, updated, model.itemsize)
    # every collective's buffer is packed or unpacked on this rank once (gradients into a bucket, a
    # shard into an unsharded unit, a received activation into its array): a pass through memory,
    # at one rank too, where the collectives still run
    copy_s = machine.copy_time(sum(c.nbytes for c in colls))
    return Breakdown(config, stage_memory[busiest], stage_memory, acts, colls, compute, bubble_s, comm, exposed,
                     compute + bubble_s + exposed + optimizer_s + copy_s, optimizer_s, copy_s)
