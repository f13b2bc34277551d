"""meshkit.plan.calibrate on real processes: rank 0 saves the Machine to argv[1] and prints its fit errors
(``FIT dp.shm.kind``: the shared-memory path's, where the group's ranks share a node: ``SHARES True``)."""

import sys

import meshkit
from meshkit.plan import calibrate

meshkit.init_process_group("mpi", timeout=60)
mesh = meshkit.init_device_mesh("cpu", (meshkit.get_world_size(),), mesh_dim_names=("dp",))
machine = calibrate(mesh, sizes=(1 << 10, 1 << 13, 1 << 16, 1 << 19), repeats=int(sys.argv[2]))
if meshkit.get_rank() == 0:
    machine.save(sys.argv[1])
    print("SHARES", mesh.get_group().shares_memory(), flush=True)
    for key, err in sorted(machine.fit_error.items()):
        parts = key.split(".")  # dim.kind, or dim.path.kind
        cost = machine.levels[0].cost(parts[-1], path=parts[1] if len(parts) == 3 else None)
        print(f"FIT {key} alpha={cost.alpha * 1e6:.1f}us busbw={1 / cost.beta / 1e9 if cost.beta else 0:.2f}GB/s "
              f"err={err:.3f}", flush=True)
    print("FLOPS", machine.flops, flush=True)
meshkit.destroy_process_group()
