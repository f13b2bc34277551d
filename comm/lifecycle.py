"""Creating and destroying the world: ``init_process_group`` picks the engine and builds it.

This is the one module that knows every engine. It sits above them: the engines import
nothing of it, and it imports each engine only when that backend is chosen (importing
``mpi4py.MPI`` initializes MPI, which a local job must not do).
"""

from __future__ import annotations

import datetime
import logging

from .debug import DebugLevel, FlightRecorder, debug_level_from_env
from .errors import DistBackendError, DistError, DistValueError
from .group import ProcessGroup
from .progress import ProgressAgent
from .timeouts import resolve_timeout
from .world import World, current_world, is_initialized, local_context, set_world

__all__ = ["init_process_group", "destroy_process_group", "BACKENDS"]

logger = logging.getLogger("meshkit")

BACKENDS = ("auto", "mpi", "local", "nccl")


def _resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise DistValueError(f"meshkit.comm: unknown backend {backend!r}; valid backends are {list(BACKENDS)}")
    if backend != "auto":
        return backend
    return "local" if local_context() is not None else "mpi"


def _world_engine(backend: str) -> object:
    if backend == "local":
        context = local_context()
        if context is None:
            raise DistBackendError("meshkit.comm: backend 'local' runs inside meshkit.comm.local.run(fn, "
                                   "world_size); use 'mpi' (or 'auto') in a normal process")
        from .local_engine import create_world_engine as create_local
        return create_local(context)
    if backend == "mpi":
        from .mpi import create_world_engine as create_mpi
        return create_mpi()
    raise DistBackendError("meshkit.comm: the 'nccl' backend is not available in this build; "
                           "use 'mpi' or 'auto'")


def init_process_group(backend: str = "auto", *, timeout: float | datetime.timedelta | None = None) -> None:
    """Create the default process group (the world) on this rank.

    Args:
        backend: ``"mpi"`` (mpi4py; under ``meshkit-run``/``mpiexec`` or, with plain ``python``,
            a world of one), ``"local"`` (inside :func:`meshkit.comm.local.run`), or
            ``"auto"``: ``local`` inside ``local.run``, else ``mpi``.
        timeout: seconds (or a timedelta) every blocking call of every group waits at most;
            default ``MESHKIT_TIMEOUT`` or 300 s.

    Raises:
        DistError: already initialized on this rank.
        DistValueError: unknown backend or a bad timeout.
    """
    if is_initialized():
        world = current_world()
        raise DistError(f"meshkit.comm: rank {world.rank}: init_process_group was already called "
                        f"(backend {world.backend!r}); call destroy_process_group() first")
    name = _resolve_backend(backend)
    limit = resolve_timeout(timeout)
    engine = _world_engine(name)
    world = World(backend=name, timeout=limit, debug=debug_level_from_env(), recorder=FlightRecorder(),
                  progress=ProgressAgent("meshkit-progress"))
    group = ProcessGroup(engine, world=world, ranks=range(engine.size), group_rank=engine.rank, name="world",
                         timeout=limit)
    world.rank, world.size, world.default_group = engine.rank, engine.size, group
    world.groups[frozenset(group.ranks)] = group
    set_world(world)
    if world.debug >= DebugLevel.INFO:
        logger.info("meshkit: rank %d/%d initialized backend %s, timeout %.0f s, debug %s",
                    world.rank, world.size, world.backend, world.timeout, world.debug.name)


def destroy_process_group() -> None:
    """Tear down every group of this rank and the world; ``init_process_group`` may follow."""
    world = current_world()
    for group in world.groups.values():
        group.shutdown()
    world.groups.clear()
    world.progress.close()
    world.destroyed = True
    set_world(None)
