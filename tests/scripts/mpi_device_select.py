"""The NCCL engine's device selection over the MPI engine as host, on the double (issue 24, point 4).

argv[1]: "local-rank": each rank prints its node-local rank (the launcher's variable if set);
"split": the same without any launcher variable (MPI's shared-memory split); "per-task": each rank sees one GPU of its own (as
CUDA_VISIBLE_DEVICES per task) and prints the device chosen; "one-gpu": both ranks see the
same single GPU, and every rank must refuse, naming both. Only the selection runs here: the
double's communicators cannot span processes.
"""

import os
import sys
import time

from doubles import nccl_double as double

import meshkit
from meshkit.comm import cuda_runtime, mpi, nccl

case = sys.argv[1]
rt = double.FakeRuntime(devices=1)
cuda_runtime.set_runtime(rt)
meshkit.init_process_group("mpi", timeout=20)
rank = meshkit.get_rank()
host = meshkit.comm._seams.current_world().default_group.engine
try:
    if case == "local-rank":
        if "TEST_LOCAL_RANK" in os.environ:  # meshkit-run sets LOCAL_RANK itself: the test's value goes in here
            os.environ["LOCAL_RANK"] = os.environ["TEST_LOCAL_RANK"]
        print(f"local rank {host.local_rank()}", flush=True)
    elif case == "split":  # no launcher variable: MPI's shared-memory split
        for name in mpi.LOCAL_RANK_ENVS:
            os.environ.pop(name, None)
        print(f"split local rank {host.local_rank()}", flush=True)
    else:
        if case == "per-task":
            double.visible_devices([rank])
        device = nccl.select_device(host, rt, time.monotonic() + 20)
        print(f"device {device} ({rt.pci_bus_id(device)})", flush=True)
except Exception as exc:  # noqa: BLE001 (the line names what was raised)
    print(f"{type(exc).__name__}: {exc}", flush=True)
meshkit.barrier()
meshkit.destroy_process_group()
