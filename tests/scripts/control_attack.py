"""One rank of tests/test_control_messages.py's env:// world that an outsider attacks.

    control_attack.py DIR

RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT come from the plain launcher (no MPI, no job secret:
the rendezvous TCPStore admits anyone who reaches its port). Each rank first checks the object
collectives of such a world: plain objects travel (``OBJECTS ok``) and an object of its own class
is refused on every rank (``REFUSED <type> <message>``). Then rank 0 writes ``DIR/ready`` and
waits for ``DIR/attacked`` (the test, as the outsider, posts a pickled notice to rank 1 through
the store) and joins the next barrier late, so that rank 1 reads its notices while it waits
there. Each rank prints what its next two barriers did (``BARRIER2/3 <type> <message>``), then
makes a second world on the same port (``WORLD2``). The device side is
tests/doubles/nccl_process_double.py's.
"""

import os
import sys
import time
from pathlib import Path

from doubles.nccl_process_double import ProcessRuntime

import meshkit
from meshkit.comm.engines import cuda_runtime


class Mine:
    """An object the typed format does not carry."""


def outcome(name: str, fn) -> None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 (reported to the test, which reads it)
        print(f"{name} {type(exc).__name__} {exc}".replace("\n", " "), flush=True)
    else:
        print(f"{name} ok", flush=True)


def main() -> None:
    folder, rank = Path(sys.argv[1]), int(os.environ["RANK"])
    cuda_runtime.set_runtime(ProcessRuntime())
    meshkit.init_process_group("nccl", init_method="env://", timeout=20)
    everyone = [None] * meshkit.get_world_size()
    meshkit.all_gather_object(everyone, {"rank": rank, "pid": os.getpid()})
    print(f"OBJECTS {'ok' if [e['rank'] for e in everyone] == [0, 1] else everyone}", flush=True)
    outcome("REFUSED", lambda: meshkit.all_gather_object([None] * 2, Mine() if rank == 1 else rank))
    meshkit.barrier()
    if rank == 0:
        (folder / "ready").touch()
        deadline = time.monotonic() + 20
        while not (folder / "attacked").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)  # rank 1 waits in the next barrier meanwhile, reading its notices
    outcome("BARRIER2", meshkit.barrier)
    outcome("BARRIER3", meshkit.barrier)
    meshkit.destroy_process_group()
    # The world failed; its destroy still closes rank 0's TCPStore server, so a next world of the
    # same processes meets on the same MASTER_PORT (it found the old server there before).
    def again() -> None:
        meshkit.init_process_group("nccl", init_method="env://", timeout=20)
        meshkit.barrier()
        meshkit.destroy_process_group()
    outcome("WORLD2", again)

if __name__ == "__main__":
    main()
