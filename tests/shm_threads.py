"""Threads as the ranks of one shared-memory mapping: the in-process tests of the path's protocol
(tests/test_shm_layout.py, tests/test_shm_small.py) poll their requests the same way."""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable


def finish(request: Any, rank: int, timeout: float) -> None:
    """Poll ``request`` until it completes, yielding between polls; ``TimeoutError`` naming the
    ranks it still waits for after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not request.Test():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank} waits for {request.missing_ranks}")
        os.sched_yield()


def on_threads(n: int, body: Callable[[int], None]) -> list:
    """``body(r)`` on a thread per rank ``r`` of ``n``; each rank's exception, or None."""
    errors: list = [None] * n

    def rank(r: int) -> None:
        try:
            body(r)
        except BaseException as exc:  # noqa: BLE001 (returned to the test)
            errors[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors
