"""The data-parallel strategies over dp of DTensor parameters on real processes (4 ranks): DDP,
ZeRO and FSDP on a 2x2 dp x tp mesh, HSDP on a 2x1x2 replicate x shard x tp one; each equal to
single-process training, every gradient (FSDP: every gathered parameter) a DTensor laid out as
its parameter."""

import sys

import dp_tp_cases

import meshkit

meshkit.init_process_group("mpi", timeout=60)
assert meshkit.get_world_size() == 4, meshkit.get_world_size()
for strategy in sys.argv[1:] or ["ddp"]:
    dp_tp_cases.check((2, 1, 2) if strategy == "hsdp" else (2, 2), strategy)
    print(f"DP TP {strategy} OK", flush=True)
meshkit.destroy_process_group()
