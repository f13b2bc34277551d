"""DTensor on real processes (world size 4): every redistribution pair on a 1-D and a 2x2 mesh,
uneven shapes, checked bit for bit with the collectives read from the flight recorder; and the
Megatron MLP (one all-reduce each way)."""

import tensor_cases

import meshkit

meshkit.init_process_group("mpi", timeout=60)
size = meshkit.get_world_size()
assert size == 4, size
assert tensor_cases.check_all_pairs((4,), (5, 3)) == 16
assert tensor_cases.check_all_pairs((2, 2), (3, 5)) == 256
tensor_cases.check_megatron(size)
print("TENSOR OK", flush=True)
meshkit.destroy_process_group()
