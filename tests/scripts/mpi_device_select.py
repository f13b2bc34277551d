"""The NCCL engine's device selection over the MPI engine as host, on the double.

argv[1:]: the cases, run in order in one job. "local-rank": each rank prints its node-local rank (the
launcher's variable; "local-rank=V": with LOCAL_RANK=V instead); "split": the same without any launcher
variable (MPI's shared-memory split); "per-task": each rank sees one GPU of its own (as
CUDA_VISIBLE_DEVICES per task) and prints the device chosen; "one-gpu": both ranks see the
same single GPU, and every rank must refuse, naming both. Only the selection runs here: the
double's communicators cannot span processes.
"""

import os
import sys
import time

from doubles import nccl_double as double

import meshkit
from meshkit.comm.engines import cuda_runtime, mpi, nccl_creation as nccl

rt = double.FakeRuntime(devices=1)
cuda_runtime.set_runtime(rt)
meshkit.init_process_group("mpi", timeout=20)
rank = meshkit.get_rank()
host = meshkit.comm._seams.current_world().default_group.engine
for case in sys.argv[1:]:
    try:
        if case.startswith("local-rank"):
            if "=" in case:  # meshkit-run sets LOCAL_RANK itself: the test's value goes in here
                os.environ["LOCAL_RANK"] = case.split("=", 1)[1]
            print(f"local rank {host.local_rank()}", flush=True)
        elif case == "split":  # no launcher variable: MPI's shared-memory split
            for name in mpi.LOCAL_RANK_ENVS:
                os.environ.pop(name, None)
            print(f"split local rank {host.local_rank()}", flush=True)
        else:
            double.visible_devices([rank] if case == "per-task" else None)  # "one-gpu": the one GPU there is
            device = nccl.select_device(host, rt, time.monotonic() + 20)
            print(f"device {device} ({rt.pci_bus_id(device)})", flush=True)
    except Exception as exc:  # noqa: BLE001 (the line names what was raised)
        print(f"{type(exc).__name__}: {exc}", flush=True)
meshkit.barrier()
meshkit.destroy_process_group()
