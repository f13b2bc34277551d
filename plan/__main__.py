"""``python -m meshkit.plan MODEL.json --world-size N [--machine calib.json] [--memory-cap BYTES]
[--top K] [--strategies ddp,fsdp] [--optimizer sgd] [--json]``: the ranked configurations for a model file (format: meshkit.plan.model's docstring).

Without ``--machine`` the machine is a described one (:data:`DEFAULT_MACHINE`): 8 GPUs per node
on NVLink, InfiniBand across nodes (the numbers are stated in docs/planner.md).
"""

from __future__ import annotations

import argparse
import json
import sys

from .machine import Machine
from .model import OPTIMIZERS, STRATEGIES, Model
from .search import search

#: H100-like nodes (docs/planner.md gives the sources): NVLink 450 GB/s per direction and 3 us,
#: InfiniBand NDR 50 GB/s per GPU and 10 us, 80 GiB, 400 Tflop/s bf16-dense-ish float32 matmul.
DEFAULT_MACHINE = dict(gpus_per_node=8, nodes=2048, intra_bw=450e9, intra_latency=3e-6, inter_bw=50e9,
                       inter_latency=10e-6, memory_bytes=80 << 30, flops=400e12, name="h100-cluster")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshkit.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="model description (JSON: dtype, batch, layers)")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--machine", help="a Machine JSON (meshkit.plan.calibrate(...).save(path)); "
                        "default a described cluster of 8-GPU nodes")
    parser.add_argument("--memory-cap", type=int, default=None, help="bytes per rank")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated, default all")
    parser.add_argument("--optimizer", default="adamw", help="adamw or sgd")
    parser.add_argument("--json", action="store_true", help="print the breakdowns as JSON")
    args = parser.parse_args(argv)
    try:
        if args.world_size < 1 or args.top < 1 or (args.memory_cap is not None and args.memory_cap < 0):
            raise ValueError(f"--world-size and --top must be >= 1 and --memory-cap >= 0, got "
                             f"{args.world_size}, {args.top}, {args.memory_cap}")
        model = Model.load(args.model)
        machine = Machine.load(args.machine) if args.machine else Machine.describe_cluster(**DEFAULT_MACHINE)
        strategies = [x for x in args.strategies.split(",") if x]
        bad = [x for x in strategies if x not in STRATEGIES] or ([] if strategies else ["(none)"])
        if bad:
            raise ValueError(f"--strategies: unknown strategy {bad[0]!r}; valid strategies are {', '.join(STRATEGIES)}")
        if args.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {args.optimizer!r}")
        ranked = search(model, args.world_size, machine, args.memory_cap, strategies=strategies,
                        optimizer=args.optimizer)
    except (ValueError, OSError, json.JSONDecodeError) as e:
        parser.print_usage(sys.stderr)
        print(f"python -m meshkit.plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([b.to_dict() for b in ranked[:args.top]], indent=1))
        return 0
    print(f"{len(ranked)} configurations of {args.world_size} ranks on {machine.name}; fastest first")
    # step = compute + bubble + exposed + optimizer + copy (comm: all of it, hidden or not)
    print(f"{'config':34} {'step ms':>9} {'compute':>9} {'bubble':>8} {'exposed':>8} {'optim':>8} {'copy':>8} "
          f"{'comm':>8} {'MiB/rank':>9}")
    for b in ranked[:args.top]:
        print(f"{b.config.name():34} {b.step_s * 1e3:9.3f} {b.compute_s * 1e3:9.3f} {b.bubble_s * 1e3:8.3f} "
              f"{b.exposed_comm_s * 1e3:8.3f} {b.optimizer_s * 1e3:8.3f} {b.copy_s * 1e3:8.3f} {b.comm_s * 1e3:8.3f} "
              f"{b.memory_total / 2**20:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
