"""The protocol's one training loop on real processes: every strategy, SGD momentum, against one process."""

import test_strategy_protocol as cases

import meshkit

meshkit.init_process_group("mpi", timeout=60)
for strategy in ("ddp", "zero1", "zero2", "fsdp") + (("hsdp",) if meshkit.get_world_size() % 2 == 0 else ()):
    for opt_name in ("sgd", "adamw"):
        cases.assert_matches(cases.train(cases.factory(strategy, opt_name)), cases.REFERENCES[opt_name])
print(f"rank {meshkit.get_rank()}: protocol OK", flush=True)
meshkit.destroy_process_group()
