"""Stream order of the MPI engine's staging copies, on the double (staged: MESHKIT_CUDA_AWARE_MPI=0).

argv[1:]: the cases, run in order in one job. "overlap": an async all_reduce completes while the
caller's stream is still busy with work queued after it (a gate that opens only once the Work is done), and the copies
follow writes queued before it; "no-event-wait": the staging stream ignores ``wait_event`` (an
engine that forgot it), and the double refuses its copies; "chunks": with 16-byte chunks, every
collective (all_reduce, reduce and broadcast chunked) against NumPy, and the copies counted.
Prints one line per check. "chunks" leaves the chunk size at 16 bytes: name it last.
"""

import sys

import collective_cases as cases
from doubles import nccl_double as double
import numpy as np

import meshkit
from meshkit.comm.engines import cuda_runtime

double.DOUBLE_TIMEOUT = 5.0  # a copy stuck behind the gate fails in seconds, not half a minute
rt = double.FakeRuntime()
cuda_runtime.set_runtime(rt)
meshkit.init_process_group("mpi", timeout=20)
rank, n = meshkit.get_rank(), meshkit.get_world_size()


def report(what, fn):
    try:
        print(f"{what}: {fn()}", flush=True)
    except Exception as exc:  # noqa: BLE001 (the line names what was raised)
        print(f"{what}: {type(exc).__name__}: {exc}", flush=True)


for case in sys.argv[1:]:
    if case == "overlap":
        x = double.to_device(np.full(4, rank + 1.0))
        x[0] = 10.0 * (rank + 1)  # queued on the caller's stream before the all_reduce: the copy must see it
        work = meshkit.all_reduce(x, async_op=True)
        gate = double.Gate(rt.current_stream())  # the caller queues a long kernel after the all_reduce
        later = double.to_device(np.zeros(2))  # and writes elsewhere: no hazard for the copy back
        report("wait with the caller's stream busy", lambda: work.wait())
        gate.open()
        print(f"result {x.get().tolist()}", flush=True)
        y = double.to_device(np.full(3, -1.0))  # broadcast's receivers only write: the copy back still
        meshkit.broadcast(y if rank else double.to_device(np.arange(3.0)), src=0)  # follows their earlier writes
        print(f"broadcast {y.get().tolist() if rank else 'root'}", flush=True)
    elif case == "no-event-wait":  # rank 1's engine forgot the wait; rank 0's is sound
        if rank == 1:
            new_stream = rt.new_stream

            def forgetful():
                stream = new_stream()
                stream.wait_event = lambda event: None  # the dependency the engine must ask for, dropped
                return stream
            rt.new_stream = forgetful
            y = double.to_device(np.full(3, -1.0))  # written before the receive: the copy back must follow
            report("recv", lambda: meshkit.recv(y, src=0))
            report("send", lambda: meshkit.send(double.to_device(np.ones(2)), dst=0))
        else:
            meshkit.send(double.to_device(np.arange(3.0)), dst=1)
            print("sent", flush=True)
    elif case == "chunks":
        from meshkit.comm.engines import mpi_staging

        mpi_staging.CHUNK_BYTES = 16
        total = sum(cases.check_all(dtype, dev=double.to_device, host=double.to_host)
                    for dtype in (np.float64, np.float32, np.int64, np.complex128, np.bool_, np.float16))
        print(f"checks {total}", flush=True)
        x = double.to_device(np.arange(1001.0) + rank)
        before = (rt.copies_to_host, rt.copies_to_device)
        meshkit.all_reduce(x)
        assert np.array_equal(x.get(), n * np.arange(1001.0) + n * (n - 1) / 2), x.get()[:4]
        print(f"all_reduce 1001 float64: {rt.copies_to_host - before[0]} copies to host, "
              f"{rt.copies_to_device - before[1]} back", flush=True)
        before = (rt.copies_to_host, rt.copies_to_device)
        y = double.to_device(np.full(5, float(rank)))
        meshkit.broadcast(y, src=1)
        assert y.get().tolist() == [1.0] * 5, y.get()
        print(f"broadcast 5 float64: {rt.copies_to_host - before[0]} copies to host, "
              f"{rt.copies_to_device - before[1]} back", flush=True)
    if case in ("overlap", "chunks"):
        meshkit.barrier()
