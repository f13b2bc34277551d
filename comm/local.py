"""Run a function on N ranks of one process: meshkit's in-process jobs, for tests and dry runs.

:func:`run` starts one thread per rank, each with its own world on the ``local`` engine
(:mod:`meshkit.comm.engines.local_engine`), and returns each rank's result. A rank that raises wakes
all the others, and :func:`run` re-raises the first rank's exception in the caller: a local
job never hangs.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from .errors import DistValueError, RankFailedError
from .setup.lifecycle import destroy_process_group, init_process_group
from .engines.local_engine import Hub, RankContext
from .groups.world import is_initialized, set_local_context

__all__ = ["run"]

#: Seconds ``run`` waits for the other ranks to stop after one has failed.
_STOP_GRACE = 10.0


def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float | None = None, init: bool = True,
        **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks, each a thread; return their results.

    Args:
        fn: the per-rank function; inside it meshkit's API works as in a real job.
        world_size: number of ranks (>= 1).
        timeout: the world's timeout in seconds (default: ``MESHKIT_TIMEOUT`` or 300).
        init: call ``init_process_group("local")`` before ``fn`` and destroy it after; with
            False, ``fn`` initializes itself (e.g. a script's ``main`` calling
            ``init_process_group("auto")``, which picks ``local`` here).

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        The first failing rank's exception (the others are woken and stopped).

    Example::

        def step():
            x = np.full(2, float(meshkit.get_rank()))
            meshkit.all_reduce(x)
            return x

        run(step, 3)   # [array([3., 3.]), array([3., 3.]), array([3., 3.])]
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise DistValueError(f"meshkit.comm.local.run: world_size must be a positive int, got {world_size!r}")
    hub = Hub(world_size)
    results: list[Any] = [None] * world_size
    failures: list[tuple[float, int, BaseException]] = []

    def rank_main(rank: int) -> None:
        set_local_context(RankContext(hub, rank))
        try:
            if init:
                init_process_group("local", timeout=timeout)
            results[rank] = fn(*args, **kwargs)
        except BaseException as exc:  # reported to the caller, and wakes the other ranks
            failures.append((time.monotonic(), rank, exc))
            hub.fail(rank, exc)
        finally:
            try:
                if is_initialized():
                    destroy_process_group()
            except BaseException as exc:  # reported like the body's errors, never lost in a thread
                if not any(r == rank for _, r, _ in failures):
                    failures.append((time.monotonic(), rank, exc))
            finally:
                set_local_context(None)

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"meshkit-local-rank{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.05)
            if hub.failure is not None:
                t.join(_STOP_GRACE)
                break
    if failures:
        # The root cause is the earliest failure that is not a consequence of another rank's.
        causes = [f for f in failures if not isinstance(f[2], RankFailedError)] or failures
        _, rank, exc = min(causes, key=lambda f: f[0])
        if hasattr(exc, "add_note"):
            exc.add_note(f"(raised on rank {rank} of a meshkit local job of {world_size} ranks)")
        raise exc
    return results
