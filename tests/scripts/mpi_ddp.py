"""DDP against single-process training on real processes."""

import ddp_cases

import meshkit

meshkit.init_process_group("mpi", timeout=60)
ref = ddp_cases.reference()
for view in (True, False):
    params, _ = ddp_cases.train(gradient_as_bucket_view=view)
    ddp_cases.assert_matches_reference(params, ref)
print("DDP OK", flush=True)
meshkit.destroy_process_group()
