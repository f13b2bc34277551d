"""Device arrays over the MPI engine from every thread, on the double.

argv[1]: "devices": every rank computes on GPU 1 (as a rank does on GPU k of its node): an
async all_reduce settled by the progress agent (the caller sleeps instead of waiting), and a
``run_async`` task that allocates, writes and reduces on the group's communication thread;
"latency": a 1.5 s kernel queued on the caller's stream before ``all_reduce(x, async_op=True)``:
the call must return at once (it used to synchronize the stream, or drain the staging copy),
and the result must follow the kernel's write. Prints one line per check. The staging mode
comes from MESHKIT_CUDA_AWARE_MPI.
"""

import sys
import time

from doubles import nccl_double as double
import numpy as np

import meshkit
from meshkit.comm.engines import cuda_runtime

case = sys.argv[1]
rt = double.FakeRuntime()
cuda_runtime.set_runtime(rt)
meshkit.init_process_group("mpi", timeout=20)
rank, n = meshkit.get_rank(), meshkit.get_world_size()


def report(what, fn):
    try:
        print(f"{what}: {fn()}", flush=True)
    except Exception as exc:  # noqa: BLE001 (the line names what was raised)
        print(f"{what}: {type(exc).__name__}: {exc}", flush=True)


if case == "devices":
    rt.use_device(1)  # this rank's GPU, before any device array exists
    x = double.to_device(np.full(4, rank + 1.0))
    work = meshkit.all_reduce(x, async_op=True)
    time.sleep(0.2)  # nobody waits: the progress agent completes it (copy back, its event)

    def settled():
        work.wait()
        return x.get().tolist()
    report("agent-settled all_reduce", settled)
    group = meshkit.comm._seams.current_world().default_group

    def task():
        y = double.to_device(np.full(3, float(rank)))  # allocated on the communication thread
        y += 1  # a kernel there
        group.all_reduce(y)
        return y.get().tolist(), f"on device {y.device_id}"

    def on_thread():
        work = group.run_async(task, "task")
        time.sleep(0.2)  # a waiter would run the task itself: let the communication thread take it
        work.wait()
        return work.result()
    report("run_async task", on_thread)
elif case == "latency":
    x = double.to_device(np.full(1024, rank + 1.0))
    double.TimedKernel(1.5, writes=(x,), effect=lambda: x.view(np.ndarray).__imul__(10))
    began = time.monotonic()
    work = meshkit.all_reduce(x, async_op=True)
    issued = time.monotonic() - began
    print(f"issue latency {issued * 1e3:.1f} ms", flush=True)
    work.wait()
    print(f"result {x.get()[:2].tolist()}", flush=True)
meshkit.barrier()
meshkit.destroy_process_group()
