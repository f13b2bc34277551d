"""Creating and destroying the world: ``init_process_group`` picks the engine and builds it.

This is the one module that knows every engine. It sits above them: the engines import
nothing of it, and it imports each engine only when that backend is chosen (importing
``mpi4py.MPI`` initializes MPI, which a local job must not do).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import sys
import time
from typing import Any

from ...launch_protocol import SPARES_ENV
from .. import env
from ..agree import agree
from ..naming import by_ranks
from .backends import RULES, Backend, BackendOptions, check_name, create_engine, register_backend
from ..engines import shm_settings
from ..engines.cuda_runtime import gpu_available, runtime
from ..debug import DebugLevel, FlightRecorder
from ..engines.engine import DeadlineExceeded
from ..errors import CollectiveTimeout, DistBackendError, DistError, DistValueError
from ..groups.group import ProcessGroup
from .init_methods import Requested, agreement, mpi_launched, rendezvous, rendezvous_keys, requested
from ..level_state import requested_level
from ..milestones import IMPORTED, RENDEZVOUS, milestone
from ..notices import LEFT, Notice
from ..groups.progress import ProgressAgent
from ..stores import Store
from ..timeouts import resolve_timeout
from ..job_end import abort_job
from ..groups.world import World, current_world, is_initialized, local_context, set_world

__all__ = ["init_process_group", "destroy_process_group", "install_world", "survivors_engine"]

logger = logging.getLogger("meshkit")

#: The number of init_process_group's exchange of levels (not a call of the world group; other
#: unnumbered exchanges use -1 to -4: comm/engines/local_engine.py's split, comm/engines/nccl_creation.py's bootstrap).
_INIT_SEQ = -5


def _agree_on_levels(group: Any) -> None:
    """At ``init_process_group``: every rank's level must be the same (a rank in detail mode and
    one not in it would wait in different exchanges at the first collective). One exchange of the
    world's engine, not numbered (no call of the world group is spent); DistValueError on every
    rank naming each rank's level if they differ."""
    if group.size == 1:
        return
    deadline = time.monotonic() + group.timeout
    me = group.world.rank

    def exchange(g: Any, payload: Any) -> list[Any]:
        try:
            return g.engine.exchange(payload, _INIT_SEQ, deadline)
        except DeadlineExceeded as exc:
            raise CollectiveTimeout(f"meshkit.comm: rank {me}: init_process_group: the ranks' debug levels were not "
                                    f"all compared within {group.timeout:.1f} s; ranks that did not arrive: "
                                    f"{exc.missing}", op="init_process_group", group=group.name,
                                    missing=exc.missing) from None

    def differ(g: Any, levels: list[int]) -> str | None:
        if len(set(levels)) == 1:
            return None
        listing = by_ranks((rank, DebugLevel(value).name) for rank, value in zip(g.ranks, levels))
        return (f"the ranks' debug levels differ ({listing}); set MESHKIT_DEBUG (or call set_debug_level) alike on "
                "every rank")

    agree(group, int(group.world.debug), compare=differ, exchange=exchange,
          error=lambda message: DistValueError(f"meshkit.comm: rank {me}: init_process_group: {message}"))


def _resolve_backend(backend: str) -> str:
    """A registered backend's name (comm/setup/backends.py) for ``backend``, or the one "auto"/"gloo" pick.

    "gloo" is torch's CPU backend, taken as meshkit's: "mpi" in a process, "local" inside
    local.run. So a ported script's init_process_group("gloo") runs unchanged; get_backend()
    names the engine that runs ("mpi"), as code branching on it must know (docs/clusters.md).
    """
    name = str(Backend(backend))  # case-insensitive, as torch's; a non-str is a DistTypeError
    if name not in RULES:
        return check_name(name)
    if local_context() is not None:
        return "local"
    return Backend.MPI if name == Backend.GLOO or not gpu_available() else Backend.NCCL


def _world_engine(backend: str, timeout: float, device_id: int | None = None,
                  host: object | None = None) -> object:
    return create_engine(backend, BackendOptions(timeout=timeout, device_id=device_id, host=host))


# The built-in engines, registered as a third-party one is (register_backend): each factory takes
# the BackendOptions and imports its engine only when chosen (mpi4py initializes MPI at import).
def _local_engine(options: BackendOptions) -> object:
    context = local_context()
    if context is None:
        raise DistBackendError("meshkit.comm: backend 'local' runs inside meshkit.comm.local.run(fn, "
                               "world_size); use 'mpi' (or 'auto') in a normal process")
    from ..engines.local_engine import create_world_engine as create_local
    return create_local(context)


def _mpi_engine(options: BackendOptions) -> object:
    from ..engines.mpi import create_world_engine as create_mpi
    from ..engines.shm import over  # the shared-memory path, where the ranks share a node (MESHKIT_SHM)
    return over(create_mpi(options.timeout), time.monotonic() + options.timeout)


def _nccl_engine(options: BackendOptions) -> object:
    # over the host engine of the same ranks: MPI, the hub inside local.run (with a double
    # runtime), or given (the store the ranks met in, in a job no MPI process manager started)
    rt = runtime()  # raises DistBackendError without CuPy
    host = options.host
    if host is None:
        host = create_engine("local" if local_context() is not None else "mpi", options)
    from ..engines.nccl_creation import create_world_engine as create_nccl
    try:
        return create_nccl(host, rt, time.monotonic() + options.timeout, options.device_id)
    except BaseException:
        host.free()
        raise


register_backend(Backend.MPI, _mpi_engine)
register_backend(Backend.LOCAL, _local_engine)
register_backend(Backend.NCCL, _nccl_engine, devices=("cpu", "cuda"))


def _launched_world(name: str, asked: Requested, limit: float, device_id: int | None) -> object:
    """The world a launcher (or local.run) made. What ``asked`` says must agree with it on every
    rank: each rank's verdict is exchanged, so all raise or none does."""
    host_name = name if name != "nccl" else ("local" if local_context() is not None else "mpi")
    host = _world_engine(host_name, limit)
    if asked.explicit:
        verdict = agreement(asked, host.rank, host.size,
                            "meshkit.comm.local.run" if local_context() is not None else None)
        verdicts = host.exchange(verdict, _AGREE_SEQ, time.monotonic() + limit)
        bad = [r for r, v in enumerate(verdicts) if v is not None]
        if bad:
            host.free()
            raise DistValueError(verdicts[host.rank] or f"meshkit.comm: rank {host.rank}: init_process_group: ranks "
                                 f"{bad} disagree with the world: {verdicts[bad[0]]}")
    return _world_engine(name, limit, device_id, host) if name == "nccl" else host


def _store_world(name: str, asked: Requested, limit: float, device_id: int | None) -> object:
    """A world whose ranks meet through the store of ``asked`` (no MPI process manager started them)."""
    if name == "local":
        raise DistBackendError("meshkit.comm: backend 'local' runs inside meshkit.comm.local.run(fn, world_size); "
                               f"it cannot meet through {asked.source}")
    if name == "mpi":
        if asked.world_size > 1:
            raise DistBackendError(
                f"meshkit.comm: backend 'mpi' cannot form a world of {asked.world_size} from {asked.source}: MPI's "
                f"world comes from its process manager, not from an init method. Start the job with meshkit-run -n "
                f"{asked.world_size} script.py (or mpiexec, or srun with MPI), or use the nccl backend, which meets "
                "through the init method's store")
        return _world_engine("mpi", limit)  # a world of one (rank 0, checked): MPI's singleton
    met = rendezvous(asked, limit)
    from ..engines.store_engine import create_world_engine as create_store_engine
    host = create_store_engine(met.store, met.rank, met.world_size, met.local_rank,
                               met.base if met.owned else None, rendezvous_keys(met.world_size))
    return _world_engine(name, limit, device_id, host)  # nccl over it; a registered backend may use it


def _torchrun_env() -> bool:
    """Whether a torchrun-style launcher started this process (torch's default init method, env://, applies)."""
    return all(os.environ.get(name, "").strip() for name in ("RANK", "WORLD_SIZE"))


def init_process_group(backend: str = "auto", init_method: str | None = None,
                       timeout: float | datetime.timedelta | None = None, world_size: int = -1, rank: int = -1,
                       store: Store | None = None, *, device_id: int | None = None) -> None:
    """Create the default process group (the world) on this rank.

    Where the world comes from (docs/clusters.md, "Launchers"): under ``meshkit-run``, ``mpiexec``
    or ``meshkit.spawn`` (an MPI world), MPI's world is the world, and an ``init_method``,
    ``world_size`` or ``rank`` that disagrees with it is an error naming both, on every rank.
    Otherwise the ranks meet through ``init_method`` or ``store``, as in torch; with neither, a
    process given ``world_size``/``rank`` or started by a torchrun-style launcher (``RANK`` and
    ``WORLD_SIZE`` set) meets by ``env://`` (torch's default), and a plain ``python`` process is
    a world of one.

    Args:
        backend: ``"mpi"`` (mpi4py; under ``meshkit-run``/``mpiexec`` or, with plain ``python``,
            a world of one), ``"nccl"`` (device arrays over NCCL through CuPy, host arrays and
            objects over MPI; one GPU per rank, see ``device_id``; in a job started without MPI
            it bootstraps through the init method's store, and moves device arrays and objects,
            not host arrays), ``"local"`` (inside :func:`meshkit.comm.local.run`), or ``"auto"``:
            ``local`` inside ``local.run``, else ``nccl`` where CuPy sees a GPU, else ``mpi``.
            ``"gloo"`` (torch's CPU backend) is taken as ``mpi`` (``local`` inside
            ``local.run``); :func:`get_backend` then reports ``"mpi"``. Case-insensitive, as
            :class:`~meshkit.comm.setup.backends.Backend`; a name given to
            :func:`~meshkit.comm.setup.backends.register_backend` builds that backend's engine.
        init_method: ``"env://"`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
            ``LOCAL_RANK``; Slurm's ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` where those
            are what is set), ``"tcp://host:port"`` (rank 0 serves a TCPStore there) or
            ``"file:///path"`` (a FileStore); the last two need ``world_size`` and ``rank``.
        timeout: seconds (or a timedelta) every blocking call of every group waits at most, the
            rendezvous included; default ``MESHKIT_TIMEOUT`` or 300 s.
        world_size: the number of ranks (-1: from the init method or the launcher).
        rank: this process's rank (-1: from the init method or the launcher).
        store: a :class:`~meshkit.comm.stores.Store` every rank reaches, instead of ``init_method``
            (with ``world_size`` and ``rank``); left open at ``destroy_process_group``. Inside
            ``local.run`` it makes the nccl backend meet through it, as a job without MPI does.
        device_id: the index of this rank's GPU among those the process sees (``nccl`` only; as
            torch's ``device_id``); default ``MESHKIT_DEVICE_ID``, else the node-local rank
            modulo the visible GPUs (see :func:`meshkit.comm.engines.nccl_creation.select_device`).

    Raises:
        DistError: already initialized on this rank.
        DistValueError: unknown backend (the message lists the registered ones), a bad timeout,
            a malformed init method, a rank out of range, two processes claiming one rank, or an
            init method that disagrees with the launcher's world.
        DistBackendError: the backend's engine cannot be built here (``mpi`` asked to form a
            world of several from an init method: only an MPI launcher can), or a registered
            factory's engine does not implement :class:`~meshkit.comm.engines.engine.Engine`.
        DistStoreError: not every rank arrived within the timeout (naming how many did).
    """
    if is_initialized():
        world = current_world()
        raise DistError(f"meshkit.comm: rank {world.rank}: init_process_group was already called "
                        f"(backend {world.backend!r}); call destroy_process_group() first")
    if local_context() is None:
        # the script's imports are done when it first meets the others (``import meshkit`` itself
        # imports nothing: its packages load on first use); meshkit-run times a restart's imports by it
        milestone(IMPORTED)
    env.check_all()  # every MESHKIT_* setting, so that a typo is an error now, not ignored until used
    shm_settings.check_all()  # (the shared-memory path's sizes, whose defaults live with the path)
    name = _resolve_backend(backend)
    limit = resolve_timeout(timeout)
    asked = requested(init_method, world_size, rank, store)
    inside_local = local_context() is not None
    if inside_local and not (asked.scheme == "store" and name == "nccl") or not inside_local and mpi_launched():
        engine = _launched_world(name, asked, limit, device_id)
    elif asked.scheme is not None:
        engine = _store_world(name, asked, limit, device_id)
    elif asked.explicit or _torchrun_env():  # torch's default init method
        engine = _store_world(name, requested("env://", world_size, rank, None), limit, device_id)
    else:
        engine = _world_engine(name, limit, device_id)
    world = install_world(name, engine, limit)
    taken = joined_spare() if name == "mpi" and not inside_local else None
    if taken is not None:  # a spare that took a lost rank's place: its script's next call is survive.start's
        world.default_group.failures.reason = (
            f"this process is a spare of meshkit-run --spares that took rank {taken.rank}'s place; the survivors "
            "wait for it in their recovery: call meshkit.parallel.survive.start(build) right after "
            "init_process_group, before any other collective (docs/elastic.md \"Spares\")")


def install_world(name: str, engine: Any, limit: float, *, first: bool = True) -> World:
    """Make ``engine`` (a world's) the default group of this rank: ``init_process_group``'s last
    part, and :func:`~meshkit.comm.setup.survivors.shrink_world`'s over the survivors' engine."""
    world = World(backend=name, timeout=limit, debug=requested_level(local_context()), recorder=FlightRecorder(),
                  progress=ProgressAgent("meshkit-progress"))
    group = ProcessGroup(engine, world=world, ranks=range(engine.size), group_rank=engine.rank, name="world",
                         timeout=limit)
    world.rank, world.size, world.default_group = engine.rank, engine.size, group
    world.groups[frozenset(group.ranks)] = group
    _agree_on_levels(group)  # a rank in detail mode and one not in it would wait in different exchanges
    set_world(world)
    if first and local_context() is None:
        milestone(RENDEZVOUS)  # meshkit-run times a restart's rendezvous by it
    global _exit_hook_registered
    if not _exit_hook_registered and local_context() is None:
        atexit.register(_at_exit)  # after mpi4py's own (registered at import): runs before MPI_Finalize
        _exit_hook_registered = True
    if engine.capabilities.aborts_job and local_context() is None and not env.launched():
        _abort_hook.install(world)  # meshkit-run's bootstrap ends the job its own way (and prints through the hook)
    if world.debug >= DebugLevel.INFO:
        logger.info("meshkit: rank %d/%d initialized backend %s, timeout %.0f s, debug %s",
                    world.rank, world.size, world.backend, world.timeout, world.debug.name)
    return world


def survivors_engine(world: World) -> tuple[Any, dict[int, int]]:
    """The engine of the world over the survivors of ``world`` (MPI's ULFM under ``meshkit-run
    --survive``) and each survivor's new rank by its old one; see
    :func:`meshkit.comm.engines.mpi.survivors_engine` (imported here, when asked, as every engine).
    Every MPI communicator of the old world's groups is revoked (those under their shared-memory
    engines too) and their segments unmapped; the new world has the shared-memory path where it
    applies (``over``: a new segment over the survivors)."""
    from ..engines.mpi import MPIEngine, survivors_engine as shrink_mpi
    from ..engines.shm import drop_shared, over, parts
    engines = [g.engine for g in world.groups.values() if g.engine is not None]
    hosts = [p for e in engines for p in parts(e) if isinstance(p, MPIEngine)]
    world_host = next(p for p in parts(world.default_group.engine) if isinstance(p, MPIEngine))
    engine, new_ranks = shrink_mpi(world_host, hosts)
    for old in engines:
        drop_shared(old)
    return over(engine, time.monotonic() + world.timeout), new_ranks


def joined_spare() -> Any:
    """On a spare of ``meshkit-run --spares N`` that took a failed rank's place: what it took
    (:class:`meshkit.comm.engines.mpi_spares.Joined`); None elsewhere (MPI imported only in a job with spares)."""
    if not _spares_asked():
        return None
    from ..engines.mpi_spares import joined
    return joined()


def _spares_asked() -> bool:
    """Whether the launcher started spares (``meshkit-run --spares N``: ``MESHKIT_SPARES``), read
    without importing MPI."""
    return os.environ.get(SPARES_ENV, "").strip() not in ("", "0")


def spare_joining() -> None:
    """A spare that joined: its world group usable again, for :func:`meshkit.parallel.survive.start`'s
    exchange with the survivors (until then every collective on it raises, naming that call)."""
    current_world().default_group.failures.reason = None


def launched_ranks() -> list[int]:
    """Each world rank's rank as launched (MPI_COMM_WORLD's: a spare's that joined among them), where
    spares joined the world; the MPI engine's to say."""
    from ..engines.mpi_spares import launched_ranks as launched
    return launched()


def destroy_process_group() -> None:
    """Tear down every group of this rank and the world; ``init_process_group`` may follow.

    The other ranks are told how many calls this rank made on each group (a LEFT notice), so
    that any of them still waiting for a call this rank will never make fails at once, naming
    this rank, instead of waiting for the timeout.
    """
    world = current_world()
    _leave(world, "it destroyed its process group")
    for group in world.groups.values():
        group.shutdown()
    world.groups.clear()
    world.progress.close()
    world.destroyed = True
    set_world(None)
    if _abort_hook.installed_for is world:
        _abort_hook.uninstall()


def _leave(world: World, how: str) -> None:
    group = world.default_group
    # Asynchronous collectives still in flight (DDP's buckets at a sys.exit) complete first if the
    # others are in them; those that do not are not counted: the others waiting in them are
    # told at once that they wait in vain, instead of waiting for the timeout.
    deadline = time.monotonic() + _LEAVE_INFLIGHT_SECONDS
    members = [g for g in world.groups.values() if g.is_member]
    unfinished = sum(g.finish_inflight(deadline) for g in members)
    counts = tuple(g.counts() for g in members)
    detail = f"{how}, after {dict(counts).get(group.ranks, 0)} calls on the world group"
    if unfinished:
        detail += f", leaving {unfinished} asynchronous collective(s) unfinished"
    group.failures.tell(Notice(LEFT, world.rank, detail=detail, counts=counts))
    if group.engine is not None:
        group.engine.flush(_LEAVE_FLUSH_SECONDS)
    if world.backend == "mpi" and local_context() is None and _spares_asked():
        from ..engines.mpi_spares import release
        release()  # world rank 0 tells the idle spares of meshkit-run --spares that the job needs them no more


def _at_exit() -> None:
    """The script ends with the world still initialized: tell the others this rank left."""
    if is_initialized():
        try:
            _leave(current_world(), "its script ended")
        except Exception:  # never mask the interpreter's own exit
            logger.debug("meshkit: could not send the leave notices at exit", exc_info=True)


class _AbortHook:
    """``sys.excepthook`` for MPI jobs: print the traceback, then abort the whole job.

    Under plain ``mpiexec``/``srun`` an uncaught exception ends one rank's interpreter, which
    then waits in MPI_Finalize while the others wait for it in a collective until the timeout.
    As ``python -m mpi4py`` does, meshkit aborts the job instead (``MPI_Abort``), so it ends in
    seconds. ``meshkit-run``'s rank bootstrap catches the exception before this hook runs and
    ends the job its own way.
    """

    def __init__(self) -> None:
        self.installed_for: World | None = None
        self._previous: Any = None

    def install(self, world: World) -> None:
        if self.installed_for is None:
            self._previous = sys.excepthook
            sys.excepthook = self._hook
        self.installed_for = world

    def uninstall(self) -> None:
        if self.installed_for is not None and sys.excepthook == self._hook:
            sys.excepthook = self._previous
        self.installed_for = None

    def _hook(self, kind: type[BaseException], value: BaseException, tb: Any) -> None:
        (self._previous or sys.__excepthook__)(kind, value, tb)
        world = self.installed_for
        if world is None or world.size <= 1 or kind is KeyboardInterrupt:
            return
        abort_job(world, f"meshkit: rank {world.rank}: uncaught {kind.__name__}: aborting the MPI job")


_abort_hook = _AbortHook()
#: The exchange number of init_process_group's agreement check (the NCCL engine's use -3 and -4).
_AGREE_SEQ = -6
_exit_hook_registered = False
#: Seconds a leaving rank waits for its notices to leave (they are small, sent eagerly).
_LEAVE_FLUSH_SECONDS = 1.0
#: Seconds a leaving rank gives its asynchronous collectives to complete: members already in them
#: complete them within milliseconds; a member not there yet learns from the notice instead.
_LEAVE_INFLIGHT_SECONDS = 1.0
