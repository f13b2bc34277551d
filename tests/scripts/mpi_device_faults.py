"""Device arrays over the MPI engine when an operation fails (the double as the runtime, staged).

argv[1]: "timeout": rank 1 skips an async all_reduce and a send; rank 0's device outputs
must keep their contents and nothing is copied back ("chunked-timeout": the same for an
all_reduce in 4 chunks). "bad-env": MESHKIT_CUDA_AWARE_MPI=yes is an error naming the variable
and the valid values. "copy-back-fails": rank 0's copy back to the
device raises; its Work fails and its output keeps its contents. Prints one line per check.
"""

import os
import sys

from doubles import nccl_double as double
import numpy as np
from mpi4py import MPI

import meshkit
from meshkit.comm.engines import cuda_runtime

case = sys.argv[1]
rt = double.FakeRuntime()
cuda_runtime.set_runtime(rt)
meshkit.init_process_group("mpi", timeout=1.5)
rank = meshkit.get_rank()


def report(what, fn):
    try:
        fn()
        print(f"{what}: no error", flush=True)
    except meshkit.DistError as exc:
        print(f"{what}: {type(exc).__name__}: {exc}", flush=True)


if case == "timeout":
    if rank == 0:
        # the receive first: a timed-out collective breaks the group, whose sends and receives then
        # fail before they start
        r = double.to_device(np.full(2, 7.0))
        report("recv", lambda: meshkit.irecv(r, src=1).wait(timeout=1.0))
        print("recv output", r.get().tolist(), "copies back", rt.copies_to_device, flush=True)
        x = double.to_device(np.arange(4, dtype=np.float32))
        report("all_reduce", lambda: meshkit.all_reduce(x, async_op=True).wait())
        print("all_reduce output", x.get().tolist(), "copies back", rt.copies_to_device, flush=True)
elif case == "chunked-timeout":
    # As above, chunked (4 chunks): chunks that completed are not copied back either.
    from meshkit.comm.engines import mpi_staging

    mpi_staging.CHUNK_BYTES = 4
    if rank == 0:
        x = double.to_device(np.arange(4, dtype=np.float32))
        report("chunked all_reduce", lambda: meshkit.all_reduce(x, async_op=True).wait())
        print("chunked all_reduce output", x.get().tolist(), "copies to host", rt.copies_to_host, "back",
              rt.copies_to_device, flush=True)
elif case == "copy-back-fails":
    # Rank 0's copy back fails: its Work must fail, not complete, and its output keep its contents.
    def broken(src, dst, stream):
        raise double.FakeNcclError("double: copy_to_device failed (injected)")
    if rank == 0:
        rt.copy_to_device = broken
    x = double.to_device(np.arange(4, dtype=np.float32))
    work = meshkit.all_reduce(x, async_op=True)
    try:
        work.wait()
        print("copy-back: no error", flush=True)
    except Exception as exc:  # noqa: BLE001 (printed for the test)
        print(f"copy-back: {type(exc).__name__}: {exc}", flush=True)
    print("copy-back completed", work.is_completed(), "success", work.is_success(), "output", x.get().tolist(),
          flush=True)
elif case == "bad-env":
    os.environ["MESHKIT_CUDA_AWARE_MPI"] = "yes"
    report("bad-env", lambda: meshkit.all_reduce(double.to_device(np.ones(2))))
MPI.COMM_WORLD.Barrier()
sys.stdout.flush()
os._exit(0)  # a timed-out operation is still pending inside MPI: leave without finalizing
