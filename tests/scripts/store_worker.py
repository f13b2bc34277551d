"""One process of tests/test_stores.py's cross-process tests (a TCPStore client or a FileStore user).

    store_worker.py tcp PORT RANK NPROCS CLIENTS ADDS   CLIENTS TCPStore clients in threads, ADDS adds each
    store_worker.py file PATH RANK NPROCS ADDS            one FileStore(PATH, world_size=NPROCS), ADDS adds

Each then rendezvouses with the others (sets ``rank/RANK``, waits for every ``rank/*``), reads the
counter (every add is done before its rank key), prints ``rank R saw N`` and leaves.
"""

import os
import sys
import threading
from datetime import timedelta

import meshkit


def main() -> None:
    kind, where, rank, nprocs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if kind == "tcp":
        clients, adds = int(sys.argv[5]), int(sys.argv[6])
        stores = [meshkit.TCPStore("127.0.0.1", int(where), timeout=timedelta(seconds=60)) for _ in range(clients)]
    else:
        adds = int(sys.argv[5])
        stores = [meshkit.FileStore(where, world_size=nprocs)]
        stores[0].set_timeout(timedelta(seconds=60))

    def work(store: meshkit.Store) -> None:
        for _ in range(adds):
            store.add("count", 1)

    threads = [threading.Thread(target=work, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store = stores[0]
    store.set(f"rank/{rank}", str(os.getpid()))
    store.wait([f"rank/{r}" for r in range(nprocs)])
    print(f"rank {rank} saw {int(store.get('count'))}", flush=True)
    if store.add("finished", 1) == nprocs:
        store.set("all_finished", "1")
    for s in stores:
        s.close()


if __name__ == "__main__":
    main()
