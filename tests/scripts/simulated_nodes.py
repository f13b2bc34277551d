"""What follows host boundaries, as a rank of ``meshkit-run [--simulate-nodes K]`` sees it.

Every rank prints the environment the bootstrap, hydra and the launcher set, and the size of
MPI's shared-memory split (MPICH's own idea of a node). argv[1]: "env": only that; "hosts": the
world group's host name and the MPI engine's node-local rank, then ``describe()`` of a 2x2 mesh
in the launch order and of one whose later dimension crosses the hosts; "named": the rank names
its host itself (``box{rank // 2}``) and removes ``LOCAL_RANK``, then prints the MPI engine's
node-local rank (the names decide); "devices N...": the NCCL engine's device choice on the double
with N GPUs, once per N in order (N:S sets NCCL_MULTI_RANK_GPU_ENABLE=S first) (only the selection runs: the double's communicators cannot span processes).
"""

import os
import sys
import time

from doubles import nccl_double as double
import numpy as np
from mpi4py import MPI

import meshkit
from meshkit.comm.engines import cuda_runtime, nccl_creation as nccl
from meshkit.mesh import DeviceMesh, init_device_mesh

case = sys.argv[1]
meshkit.init_process_group("mpi", timeout=30)
rank = meshkit.get_rank()
world = meshkit.comm._seams.current_world().default_group
names = ("MESHKIT_HOST_NAME", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MPI_LOCALRANKID", "UCX_TLS")
seen = {k: os.environ.get(k) for k in names}
print(f"env {seen}", flush=True)
node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)  # MPICH's own idea of this rank's node
print(f"MPI shared-memory node of {node.Get_size()} ranks", flush=True)
node.Free()
if case == "hosts":
    print(f"host {world.host_name()} local rank {world.engine.local_rank()}", flush=True)
    text = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")).describe()
    crossed = DeviceMesh("cpu", np.arange(4).reshape(2, 2).T, mesh_dim_names=("tp", "dp")).describe()
    if rank == 0:
        print(f"describe:\n{text}\nend", flush=True)
        print(f"transposed:\n{crossed}\nend", flush=True)
    # the world spans the 2 simulated nodes: shared memory within each, MPI between their leaders
    big = np.arange(1 << 16, dtype=np.float64) * (rank + 1)
    meshkit.all_reduce(big)
    assert np.array_equal(big, np.arange(1 << 16) * 10.0)
    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")).get_group("tp")  # within a node
    meshkit.all_reduce(np.ones(1 << 16), group=tp)
    print(f"paths {[e['path'] for e in meshkit.flight_record() if e['op'] == 'all_reduce'][-2:]}", flush=True)
elif case == "named":  # hosts named by the user under plain mpiexec: hydra's MPI_LOCALRANKID counts the machine
    os.environ.pop("LOCAL_RANK", None)
    os.environ["MESHKIT_HOST_NAME"] = f"box{rank // 2}"
    print(f"named host {world.host_name()} local rank {world.engine.local_rank()}", flush=True)
elif case == "devices":
    for spec in sys.argv[2:]:  # N, or N:S with NCCL_MULTI_RANK_GPU_ENABLE=S for that choice
        gpus, _, share = spec.partition(":")
        if share:
            os.environ[nccl.SHARE_ENV] = share
        rt = double.FakeRuntime(devices=int(gpus))
        cuda_runtime.set_runtime(rt)
        try:
            device = nccl.select_device(world.engine, rt, time.monotonic() + 20)
            print(f"device {device} ({rt.pci_bus_id(device)})", flush=True)
        except Exception as exc:  # noqa: BLE001 (the line names what was raised)
            print(f"{type(exc).__name__}: {exc}", flush=True)
meshkit.barrier()
meshkit.destroy_process_group()
