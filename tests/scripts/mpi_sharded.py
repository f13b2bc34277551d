"""Every sharded strategy and HSDP on real processes, against single-process training."""

import sharded_cases as cases

import meshkit

meshkit.init_process_group("mpi", timeout=120)
for kind in ("adamw", "sgd"):
    for config in cases.CONFIGS:
        ref = cases.reference(kind, config)
        for name, train in cases.STRATEGIES.items():
            cases.assert_matches(train(kind, config)[0]["model"], ref, f"{name}/{kind}/{config}")
        if meshkit.get_world_size() == 4:
            cases.assert_matches(cases.train_fsdp(kind, config, (2, 2))[0]["model"], ref, f"hsdp/{kind}/{config}")
print("SHARDED OK", flush=True)
meshkit.destroy_process_group()
