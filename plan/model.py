"""What the planner plans for: a model described by its layers, and a configuration (mesh degrees,
strategy, optimizer, pipeline schedule).

Model file format (JSON), used by ``python -m meshkit.plan``::

    {"dtype": "float32", "batch": 64,
     "layers": [{"name": "fc1", "params": {"w": [1024, 4096], "b": [4096]},
                 "activation_bytes": 16384, "flops": 8388608, "pointwise": 4096, "tp_dim": {"w": 1, "b": 0}}, ...]}

``activation_bytes``, ``flops`` and ``pointwise`` are per sample, of the layer's forward pass (its
output's bytes, its multiply-adds times 2, and the elements its activation function computes); a
training step counts forward + backward as 3x the forward's flops (backward = 2x forward, the usual
rule: Kaplan et al. 2020, sec. 2.1) and the activation's forward and backward at the machine's
``pointwise_rate`` (on a host, NumPy's ``tanh`` costs as much as a 512-wide layer's matmul:
benchmarks/scaling.py). ``tp_dim`` (optional) names the dimension tensor parallelism
shards each parameter along.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from pathlib import Path
from typing import Any

__all__ = ["Layer", "Model", "Config", "STRATEGIES", "OPTIMIZERS", "SCHEDULES"]

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "hsdp")
OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbh1", "zbv")
LOOPS = ("per_layer", "whole")
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def _bad(field: str, value: Any, valid: str) -> ValueError:
    return ValueError(f"meshkit.plan: {field} must be {valid}, got {value!r}")


def _count(field: str, value: Any, minimum: int = 0) -> int:
    """``value`` as an int (NumPy's integers too: a flop count is often ``np.prod`` of a shape)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise _bad(field, value, f"an integer >= {minimum}")
    return int(value)


def _as_int(value: Any) -> Any:
    """A NumPy integer as an int; anything else as it is (validate names what is wrong)."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer: ``params`` (name -> shape, in the order the model registers them), forward
    ``activation_bytes`` and ``flops`` per sample, ``tp_dim`` (param name -> dimension tensor
    parallelism shards; parameters left out are replicated over tp), ``pointwise`` (elements per
    sample its activation function computes, e.g. ``tanh`` of its output: 0 for none)."""

    name: str
    params: dict[str, tuple[int, ...]]
    activation_bytes: int = 0
    flops: int = 0
    tp_dim: dict[str, int] = dataclasses.field(default_factory=dict)
    input_bytes: int = 0
    pointwise: int = 0

    def __post_init__(self) -> None:
        # NumPy integers become ints (np.int64 flop counts were refused), so that
        # the arithmetic, JSON and messages see plain ints
        for field in ("activation_bytes", "flops", "input_bytes", "pointwise"):
            object.__setattr__(self, field, _as_int(getattr(self, field)))
        if isinstance(self.params, dict):
            object.__setattr__(self, "params", {p: tuple(_as_int(d) for d in shape) if isinstance(shape, tuple) else
                                                shape for p, shape in self.params.items()})
        if isinstance(self.tp_dim, dict):
            object.__setattr__(self, "tp_dim", {p: _as_int(d) for p, d in self.tp_dim.items()})

    @property
    def tp_style(self) -> str:
        """How tensor parallelism cuts the layer, read off its 2-D parameters' ``tp_dim`` (weights
        ``(fan_in, fan_out)``, as Megatron-LM's linear layers): ``"colwise"`` (split along dim 1:
        its input gradient all-reduced in the backward), ``"rowwise"`` (dim 0: its output
        all-reduced in the forward), ``"block"`` (both inside one layer: both all-reduces) or
        ``"replicated"`` (no 2-D parameter split: no communication)."""
        dims = {d for p, d in self.tp_dim.items() if len(self.params[p]) == 2}
        return {frozenset({1}): "colwise", frozenset({0}): "rowwise",
                frozenset({0, 1}): "block"}.get(frozenset(dims), "replicated")

    def validate(self, where: str) -> None:
        for pname, shape in self.params.items():
            if not isinstance(shape, tuple):
                raise _bad(f"{where}.params[{pname!r}]", shape, "a list of sizes")
            for d, s in enumerate(shape):
                _count(f"{where}.params[{pname!r}][{d}]", s)
        _count(f"{where}.activation_bytes", self.activation_bytes)
        _count(f"{where}.flops", self.flops)
        _count(f"{where}.pointwise", self.pointwise)
        _count(f"{where}.input_bytes", self.input_bytes)
        for pname, dim in self.tp_dim.items():
            if pname not in self.params:
                raise _bad(f"{where}.tp_dim", pname, f"one of the layer's parameters {list(self.params)}")
            if _count(f"{where}.tp_dim[{pname!r}]", dim) >= len(self.params[pname]):
                raise _bad(f"{where}.tp_dim[{pname!r}]", dim, f"a dimension of {self.params[pname]}")


@dataclasses.dataclass
class Model:
    """Layers in forward order, the global batch (samples per step) and the parameters' dtype."""

    layers: list[Layer]
    batch: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not self.layers:
            raise _bad("Model.layers", self.layers, "a non-empty list of layers")
        first: dict[str, int] = {}
        for i, layer in enumerate(self.layers):
            layer.validate(f"Model.layers[{i}]")
            j = first.setdefault(layer.name, i)
            if j != i:  # parameters and activations are keyed by the layer's name
                raise _bad(f"Model.layers[{i}].name", layer.name, f"unique among the layers (Model.layers[{j}] is "
                           "named so too)")
        _count("Model.batch", self.batch, 1)
        if self.dtype not in _ITEMSIZE:
            raise _bad("Model.dtype", self.dtype, f"one of {', '.join(_ITEMSIZE)}")

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for layer in self.layers for s in layer.params.values())

    @classmethod
    def from_dict(cls, data: Any) -> Model:
        if not isinstance(data, dict) or not isinstance(data.get("layers"), list):
            raise ValueError("meshkit.plan: a model description must be a JSON object with a 'layers' list")
        layers = []
        unknown = sorted(set(data) - {"layers", "batch", "dtype"})
        if unknown:
            raise _bad("Model", unknown, "keys among layers, batch, dtype (unknown keys)")
        for i, lv in enumerate(data["layers"]):
            if not isinstance(lv, dict) or not isinstance(lv.get("params"), dict):
                raise _bad(f"Model.layers[{i}]", lv, "an object with 'params' (name -> shape)")
            unknown = sorted(set(lv) - {"name", "params", "activation_bytes", "flops", "tp_dim", "input_bytes",
                                        "pointwise"})
            if unknown:
                raise _bad(f"Model.layers[{i}]", unknown, "keys among name, params, activation_bytes, flops, tp_dim, "
                           "input_bytes, pointwise (unknown keys)")
            params = {}
            for p, shape in lv["params"].items():
                if not isinstance(shape, list):
                    raise _bad(f"Model.layers[{i}].params[{p!r}]", shape, "a list of sizes")
                params[p] = tuple(shape)
            layers.append(Layer(str(lv.get("name", f"layer{i}")), params, lv.get("activation_bytes", 0),
                                lv.get("flops", 0), dict(lv.get("tp_dim", {})), lv.get("input_bytes", 0),
                                lv.get("pointwise", 0)))
        return cls(layers, data.get("batch", 1), data.get("dtype", "float32"))

    @classmethod
    def load(cls, path: str | Path) -> Model:
        return cls.from_dict(json.loads(Path(path).read_text()))


@dataclasses.dataclass(frozen=True)
class Config:
    """A parallel configuration.

    ``dp_shard`` is the data-parallel group's size for ddp, zero1, zero2 and fsdp (``dp_replicate``
    must then be 1); hsdp shards over ``dp_shard`` and replicates over ``dp_replicate``. Pipeline
    stages take contiguous runs of layers (``numpy.array_split`` of the layer list: the first
    stages get one more layer when ``pp`` does not divide them; ``interleaved`` and ``zbv`` cut
    ``2 x pp`` stages, two a rank, as examples/train_3d.py by default). FSDP's units are the layers.

    ``loop`` says how the training loop drives the data-parallel strategy: ``"per_layer"``
    (examples/mlp.py: each layer's gradients handed over as the backward makes them, last layer
    first; FSDP's units unsharded one at a time in the forward and again in the backward) or
    ``"whole"`` (examples/train_3d.py, as torchtitan runs FSDP with pipelining: every unit
    unsharded once before the forward and backward pass and held through it, every gradient
    handed over after it, first layer first: DDP then rebuilds its buckets in that order, and
    FSDP holds every unit at once but gathers each once a step).
    """

    strategy: str = "ddp"
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    optimizer: str = "adamw"
    momentum: float = 0.0
    schedule: str = "1f1b"
    microbatches: int = 1
    bucket_cap_mb: float = 25
    first_bucket_cap_mb: float = 1
    loop: str = "per_layer"

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise _bad("Config.strategy", self.strategy, f"one of {', '.join(STRATEGIES)}")
        if self.optimizer not in OPTIMIZERS:
            raise _bad("Config.optimizer", self.optimizer, f"one of {', '.join(OPTIMIZERS)}")
        if self.schedule not in SCHEDULES:
            raise _bad("Config.schedule", self.schedule, f"one of {', '.join(SCHEDULES)}")
        if self.loop not in LOOPS:
            raise _bad("Config.loop", self.loop, f"one of {', '.join(LOOPS)}")
        for field in ("dp_replicate", "dp_shard", "tp", "pp", "microbatches"):
            _count(f"Config.{field}", getattr(self, field), 1)
        if self.strategy != "hsdp" and self.dp_replicate != 1:
            raise _bad("Config.dp_replicate", self.dp_replicate, f"1 for strategy {self.strategy!r} (only hsdp "
                       "replicates over a second dimension; dp_shard is the data-parallel size)")
        if self.momentum < 0 or self.bucket_cap_mb <= 0 or self.first_bucket_cap_mb <= 0:
            raise _bad("Config.momentum/bucket caps", (self.momentum, self.bucket_cap_mb, self.first_bucket_cap_mb),
                       "momentum >= 0 and caps > 0")

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def name(self) -> str:
        mesh = f"dp{self.dp_replicate}x{self.dp_shard}" if self.strategy == "hsdp" else f"dp{self.dp_shard}"
        out = f"{self.strategy} {mesh} tp{self.tp} pp{self.pp}"
        out += f" {self.schedule} mb{self.microbatches}" if self.pp > 1 else ""
        return out + (" whole-pass" if self.loop == "whole" else "")
