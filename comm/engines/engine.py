"""The engine interface: what a collective library (MPI, the in-process hub, NCCL) provides.

A :class:`~meshkit.comm.groups.group.ProcessGroup` *holds* an engine (composition, not subclassing):
it checks arguments, numbers and records each operation, and calls one engine method, which
starts the operation and returns a :class:`Request` at once. The group then waits for the
request (synchronous calls) or hands it to a :class:`~meshkit.comm.groups.work.Work` (``async_op``).
So every collective, synchronous or not, takes the same path::

    ProcessGroup.all_reduce -> engine.all_reduce (e.g. MPI's Iallreduce) -> Request

What an engine can do beyond the common operations it declares once, as its ``capabilities``
(an :class:`EngineCapabilities`); the group and its parts read those flags, never probe the engine
with ``getattr``/``hasattr``. A flag gates methods that only the engines setting it have (see
:class:`EngineCapabilities`): ``announce(tag)`` (``checks_calls``), ``defer(request)``
(``defers``), ``abandon(why)`` (``abandons``), ``rank_failure(exc, what)`` (``survives``),
``start_coalescing()``/``end_coalescing()``
(``coalesces``), ``abort(code)`` (``aborts_job``). A device engine (``device`` not None: NCCL)
also has ``use_device()`` (make the group's GPU current on the calling thread: a ``run_async``
task on the communication thread, the progress agent before it touches a work) and
``drain(op, deadline)`` (wait for all device work, before ``destroy_process_group`` frees the
engine). ``local_rank()`` (the rank's index on its node) is asked of a host engine by the NCCL
engine to pick a GPU; ``world_ranks`` (each group rank's global rank) by the engines and the
NCCL engine of its host. Each of these is declared as a :class:`typing.Protocol` below
(:data:`GATED` maps each flag to its Protocol; ``check_engine`` in comm/setup/backends.py
checks a registered engine against them), so a caller asks the flag and calls the method, never
probes. The requests of the types in ``capabilities.watched_requests`` (NCCL's device work) are
watched by the progress agent until they complete, even after ``Work.wait()`` returned. A receive's
request is a :class:`Received`: ``source``, ``count`` and ``dtype`` (None where the engine does
not know the sender's dtype) once complete.

Which thread an engine call runs on is declared here too (:data:`thread_role`,
:func:`in_background`): the group's communication thread marks itself, and an engine's wait
reads whether anyone waits for it, with no import of the group's machinery.

Engines see only checked, C-contiguous arrays and group ranks. Reduce ops arrive as
:class:`~meshkit.comm.reduce_op.ReduceOp`; an engine without a native average reduces
``AVG`` as a sum and sets ``native_avg = False`` (the group divides once, as NCCL's AVG does).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol

__all__ = ["Engine", "EngineCapabilities", "Request", "Received", "DeadlineExceeded", "CallsDiffer", "ChecksCalls",
           "Defers", "Abandons", "Survives", "Coalesces", "AbortsJob", "ReportsPath", "SharesMemory",
           "DeviceEngine", "HostEngine", "GATED", "DEVICE",
           "methods", "thread_role", "in_background"]


class DeadlineExceeded(Exception):
    """An engine step passed its deadline. ``missing``: global ranks known not to have arrived."""

    def __init__(self, missing: list[int] | None = None, detail: str = "") -> None:
        super().__init__(detail)
        self.missing = missing
        self.detail = detail


class CallsDiffer(Exception):
    """The members of an operation called different ones (an engine that compares them, the
    local one, found it). ``entries``: each group rank's ``(operation number, Call)``; the group
    turns it into a :class:`~meshkit.comm.errors.CollectiveMismatchError`."""

    def __init__(self, entries: list[Any]) -> None:
        super().__init__("the members called different operations")
        self.entries = entries


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine does beyond the operations every engine has (see the module docstring).

    Each flag that names a method says the engine has it; an engine without the flag need not.

    Attributes:
        checks_calls: ``announce(tag)``: the group's next engine call, made right after, is ``tag``,
            ``(seq, Call)``, which travels with the operation's data; every member compares the tags
            before it computes anything, and all raise :class:`CallsDiffer` if they differ (detail
            mode's check, for free; the local engine).
        reports_dtype: a receive's request knows the sender's dtype (local), so detail mode's
            point-to-point header is not needed.
        needs_progress: nonblocking operations move only while the engine is called (MPI): the
            progress agent tests them while nobody waits.
        queues: the group holds an async collective back until the one before it completed
            (False: the engine orders them itself and each starts at once; NCCL's stream).
        defers: ``defer(request) -> bool``: ``Work.wait()`` of an async call orders the caller's
            device stream after the request instead of blocking the host (NCCL).
        abandons: ``abandon(why)``: the group broke: stop everything the engine started, so that
            nothing waits for a missing rank forever (NCCL's ``ncclCommAbort``).
        coalesces: ``start_coalescing``/``end_coalescing`` post a list of sends and receives as
            one group (NCCL).
        aborts_job: ``abort(code)`` ends the whole job (MPI_Abort; NCCL through its host engine;
            the store engine ends its own process after telling the others it left).
        host_arrays: the engine moves host (NumPy) arrays; False: the store engine, whose group
            refuses NumPy collectives and takes its object collectives through ``exchange``.
        watched_requests: the request types the progress agent watches until they complete, even
            after ``Work.wait()`` returned (NCCL's device work: a failure after the wait still
            breaks the group); an ``isinstance`` check, so an MPI request needs no field of its own.
        authenticated_peers: every byte the engine receives comes from a process of this job: MPI
            (its process manager started the peers), local (threads of this process), a store
            engine whose store proves the job's secret (``Store.authenticated``), NCCL (its host
            engine's answer). Object collectives unpickle only on such a group; elsewhere they
            carry objects in the typed format of :mod:`~meshkit.comm.control` (comm/objects.py).
            False by default: an engine says so only if it knows.
        survives: ``rank_failure(exc, what, request)``: the engine's error ``exc`` in call ``what`` stands for
            a dead peer under ``meshkit-run --survive`` (MPI's ULFM): it returns the
            :class:`~meshkit.comm.errors.RankFailedError` naming the dead, or None (MPI).
        reports_path: ``path(request) -> str``: the way a started operation's data goes (the shared-
            memory engine: ``"shm"`` or ``"mpi"``), written into its flight-recorder entry; and
            ``paths() -> str``: which calls take which way, in words.
        shares_memory: ``shared_buffer(nbytes, deadline)``: collective over the group: a zeroed
            buffer of this rank's inside memory every member maps (the shared-memory engine), which
            ``all_reduce`` reduces in place, with no copy in or out.
    """

    checks_calls: bool = False
    reports_dtype: bool = False
    needs_progress: bool = False
    queues: bool = True
    defers: bool = False
    abandons: bool = False
    coalesces: bool = False
    aborts_job: bool = False
    host_arrays: bool = True
    authenticated_peers: bool = False
    survives: bool = False
    reports_path: bool = False
    shares_memory: bool = False
    watched_requests: tuple[type, ...] = ()


class Request(Protocol):
    """A started operation. ``Test()`` returns True once it completed (never blocks).

    Receives also carry ``source`` (the sender's group rank) and ``count`` (elements
    received, or -1 if the message did not fit the buffer) once complete.
    """

    def Test(self) -> bool: ...  # noqa: N802 (MPI's name: an MPI.Request is a Request as it is)


class Received(Request, Protocol):
    """A receive's request: once ``Test()`` returned True, ``source`` is the sender's group rank,
    ``count`` the elements received (-1: the message did not fit the buffer; a fraction: its
    bytes do not divide into elements) and ``dtype`` the sender's dtype, or None where the engine
    does not know it (``EngineCapabilities.reports_dtype`` False: only the size is checked)."""

    source: int
    count: int | float
    dtype: Any


class ChecksCalls(Protocol):
    """``EngineCapabilities.checks_calls``: the group's next engine call carries ``tag``."""

    def announce(self, tag: tuple[int, Any]) -> None: ...


class Defers(Protocol):
    """``EngineCapabilities.defers``: order the caller's device stream after ``request`` (True),
    or say that it cannot (False: the caller blocks)."""

    def defer(self, request: Request) -> bool: ...


class Abandons(Protocol):
    """``EngineCapabilities.abandons``: the group broke: stop everything the engine started."""

    def abandon(self, why: str) -> None: ...


class Survives(Protocol):
    """``EngineCapabilities.survives``: an engine error that stands for a dead peer, as a RankFailedError."""

    def rank_failure(self, exc: BaseException, what: str, request: Any = None) -> BaseException | None: ...


class Coalesces(Protocol):
    """``EngineCapabilities.coalesces``: the sends and receives between the two calls are one group."""

    def start_coalescing(self) -> None: ...
    def end_coalescing(self) -> None: ...


class AbortsJob(Protocol):
    """``EngineCapabilities.aborts_job``: end the whole job with exit status ``code``."""

    def abort(self, code: int) -> None: ...


class ReportsPath(Protocol):
    """``EngineCapabilities.reports_path``: the way ``request``'s data goes (``"shm"``, ``"mpi"``)."""

    def path(self, request: Request) -> str: ...

    def paths(self) -> str:
        """Which calls take which path, in words (``DeviceMesh.describe`` shows it)."""
        ...

    def mapped_bytes(self) -> int:
        """Bytes of shared memory this rank maps for the group (its segment and shared buffers)."""
        ...


class SharesMemory(Protocol):
    """``EngineCapabilities.shares_memory``: a buffer inside memory every member maps."""

    def shared_buffer(self, nbytes: int, deadline: float) -> Any: ...


class DeviceEngine(Protocol):
    """An engine whose ``device`` is not None (NCCL)."""

    def use_device(self) -> None:
        """Make the engine's GPU current on the calling thread."""
        ...

    def drain(self, op: str, deadline: float) -> None:
        """Wait for all device work the engine started (``op`` names the caller in errors)."""
        ...


class HostEngine(Protocol):
    """What the NCCL engine asks of the host engine beside it (MPI, store)."""

    @property
    def world_ranks(self) -> list[int]:
        """The global rank of each group rank."""
        ...

    def local_rank(self) -> int:
        """This rank's index among the ranks of its node (to pick a GPU)."""
        ...


#: Each capability flag that gates methods, and the Protocol that declares them.
GATED: dict[str, type] = {"checks_calls": ChecksCalls, "defers": Defers, "abandons": Abandons,
                          "survives": Survives, "coalesces": Coalesces, "aborts_job": AbortsJob,
                          "reports_path": ReportsPath, "shares_memory": SharesMemory}
#: The Protocol of an engine whose ``device`` is not None.
DEVICE = DeviceEngine


def methods(protocol: type) -> tuple[str, ...]:
    """The methods ``protocol`` declares, in the order it declares them."""
    return tuple(name for name, value in vars(protocol).items() if not name.startswith("_") and callable(value))


class _ThreadRole(threading.local):
    #: Set on a group's communication thread to what it serves: an object whose ``waiters`` counts
    #: the callers blocked on it (a ``CommThread``); None on every other thread.
    queue: Any = None


#: The calling thread's role: a group's communication thread sets ``thread_role.queue`` once.
thread_role = _ThreadRole()


def in_background() -> bool:
    """True on a communication thread that nobody is waiting for.

    Engines use it to choose how to wait: a caller that blocks may spin on the network, as MPI's
    blocking calls do, and so may a communication thread once a caller blocks in ``Work.wait``
    on its queue; otherwise it runs beside the caller's computation and gives the core away
    between polls.
    """
    queue = thread_role.queue
    return queue is not None and queue.waiters == 0


class Engine(Protocol):
    """The operations a group needs from its engine, on group ranks and checked arrays.

    Nonblocking methods start the operation and return a :class:`Request`; they are called
    in the same order on every rank of the group (the group's program order), which is what
    MPI and NCCL require of collectives. ``wait`` and the blocking methods take a
    ``deadline`` (a ``time.monotonic()`` value) and raise :class:`DeadlineExceeded` past it.
    """

    backend: str          # "mpi", "local", "nccl"
    rank: int             # this process's rank in the engine's communicator
    size: int
    max_tag: int          # the largest tag send/recv accept
    native_avg: bool      # True if ReduceOp.AVG is averaged by the engine itself
    watch: Callable[[], None] | None  # set by the group: called while a wait stalls, to read notices
    capabilities: EngineCapabilities  # what it does beyond the operations below
    device: int | None    # the GPU its collectives run on (NCCL), None on host engines

    def all_reduce(self, buf: Any, op: Any) -> Request: ...
    def reduce(self, buf: Any, op: Any, root: int) -> Request: ...
    def broadcast(self, buf: Any, root: int) -> Request: ...
    def all_gather(self, out: Any, inp: Any) -> Request: ...
    def reduce_scatter(self, out: Any, inp: Any, op: Any) -> Request: ...
    def gather(self, out: Any | None, inp: Any, root: int) -> Request: ...
    def scatter(self, out: Any, inp: Any | None, root: int) -> Request: ...
    def all_to_all(self, out: Any, recv_counts: list[int], inp: Any, send_counts: list[int]) -> Request: ...
    def barrier(self) -> Request: ...
    def send(self, buf: Any, dst: int, tag: int) -> Request: ...
    def recv(self, buf: Any, src: int | None, tag: int) -> Received: ...

    def wait(self, request: Request, deadline: float) -> None:
        """Block until ``request`` completes; :class:`DeadlineExceeded` (naming the ranks that
        did not arrive, where the engine knows) once the deadline passes."""
        ...

    def exchange(self, payload: Any, seq: int, deadline: float, *, watched: bool = False) -> list[Any]:
        """Blocking, monitored all-gather of a small object (detail-mode checks, monitored
        barrier). :class:`DeadlineExceeded` names the ranks that did not arrive. ``watched``:
        read notices while waiting (``watch``), as a collective's wait does."""
        ...

    def split(self, color: int | None, ranks: tuple[int, ...], deadline: float) -> Engine | None:
        """Collective: ranks passing the same ``color`` get a new engine over ``ranks``
        (global ranks, ascending); None where ``color`` is None."""
        ...

    def notify(self, ranks: list[int], notice: Any) -> None:
        """Send a :class:`~meshkit.comm.notices.Notice` to ``ranks`` (global ranks) without
        blocking: how a rank that rejects a call, breaks a group or leaves tells the others."""
        ...

    def notices(self) -> list[Any]:
        """The notices received since the last call (empty if none)."""
        ...

    def host_name(self) -> str: ...

    def flush(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until the notices this rank sent have left."""
        ...

    def free(self) -> None:
        """Release the communicator (once, at ``destroy_process_group``)."""
        ...
