"""One process of tests/test_init_methods.py's jobs started without MPI (a plain launcher).

    init_world.py METHOD[,METHOD...] [TIMEOUT]

Each METHOD in turn makes a world, checks it and destroys it (so the same processes also show
that a world can be made again). METHOD is ``env`` (``init_method="env://"``: RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT from the launcher), ``default`` (no init_method: torch's default,
env://), ``leave`` (env://; rank 1 leaves at once), ``tcp``, ``file`` (the URL in ``$TCP_URL``/``$FILE_URL``), or ``store`` (a TCPStore at
MASTER_ADDR:STORE_PORT made here). RANK and
WORLD_SIZE come from the environment. The nccl backend runs over a communicator that crosses
processes (tests/doubles/nccl_process_double.py). Each rank checks device all_reduce on the world and on a
sub-group, barrier, object collectives and the error for host arrays, then prints ``OK``. An
error is printed as ``ERROR <type>: <message>`` (exit 3), for the tests that expect one.
"""

import os
import sys
import time
from datetime import timedelta

from doubles import nccl_double as double
import numpy as np
from doubles.nccl_process_double import ProcessRuntime

import meshkit
from meshkit.comm.engines import cuda_runtime


def main() -> None:
    timeout = float(sys.argv[2]) if len(sys.argv) > 2 else 30.0
    cuda_runtime.set_runtime(ProcessRuntime())
    for method in sys.argv[1].split(","):
        world(method, timeout)


def world(method: str, timeout: float) -> None:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if method in ("env", "leave"):
        meshkit.init_process_group("nccl", init_method="env://", timeout=timeout)
    elif method == "default":
        meshkit.init_process_group("nccl", timeout=timeout)
    elif method in ("tcp", "file"):
        meshkit.init_process_group("nccl", init_method=os.environ[f"{method.upper()}_URL"], world_size=size,
                                   rank=rank, timeout=timeout)
    else:
        store = meshkit.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["STORE_PORT"]), world_size=size,
                                 is_master=rank == 0, timeout=timedelta(seconds=timeout))
        meshkit.init_process_group("nccl", store=store, world_size=size, rank=rank, timeout=timeout)
    assert (meshkit.get_rank(), meshkit.get_world_size(), meshkit.get_backend()) == (rank, size, "nccl")
    if method == "leave":  # rank 1's script ends at once; the others learn it in their barrier
        if rank == 1:
            sys.exit(2)
        began = time.monotonic()
        try:
            meshkit.barrier()
        except meshkit.RankFailedError as exc:
            print(f"LEFT after {time.monotonic() - began:.1f} s: {exc}")
        return

    x = double.to_device(np.arange(4.0) + rank)
    meshkit.all_reduce(x)
    expected = sum(np.arange(4.0) + r for r in range(size))
    assert np.array_equal(double.to_host(x), expected), double.to_host(x)

    evens = meshkit.new_group(list(range(0, size, 2)))
    if rank % 2 == 0:
        y = double.to_device(np.full(3, float(rank)))
        meshkit.all_reduce(y, group=evens)
        assert np.array_equal(double.to_host(y), np.full(3, float(sum(range(0, size, 2))))), double.to_host(y)
    meshkit.barrier()

    gathered = [None] * size
    meshkit.all_gather_object(gathered, {"rank": rank, "pid": os.getpid()})
    assert [g["rank"] for g in gathered] == list(range(size)), gathered
    assert len({g["pid"] for g in gathered}) == size  # really separate processes
    sent = [f"from {size - 1}"] if rank == size - 1 else [None]
    meshkit.broadcast_object_list(sent, src=size - 1)
    assert sent == [f"from {size - 1}"], sent

    try:
        meshkit.all_reduce(np.ones(2))
    except meshkit.DistTypeError as exc:
        host_error = str(exc)
    else:
        raise AssertionError("a host array on a store-bootstrapped nccl world did not raise")
    meshkit.monitored_barrier(timeout=timeout)
    meshkit.destroy_process_group()
    if method == "store":
        store.close()
    print(f"OK {method} rank {rank} of {size} pids {sorted(g['pid'] for g in gathered)}")
    print(f"HOST {host_error}")


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:  # noqa: BLE001 (reported to the test, which matches the text)
        print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
        sys.exit(3)
