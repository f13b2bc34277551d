"""How ``init_process_group`` finds the other ranks: ``init_method`` URLs, the launcher's
variables, an existing MPI world, and the rendezvous through a store.

torch.distributed's init methods (its "Initialization" docs), with every input checked:

* ``env://``: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (``LOCAL_RANK``), as a
  torchrun-style launcher sets them; Slurm's ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``
  stand in for the first two and ``LOCAL_RANK`` where those are what is set (``srun``). The
  ``rank``/``world_size`` arguments, when given, win over the variables, as in torch;
* ``tcp://host:port`` with explicit ``world_size`` and ``rank``: rank 0 serves a
  :class:`~meshkit.comm.stores.TCPStore` at that address, the others connect to it;
* ``file:///path`` with explicit ``world_size`` and ``rank``: a
  :class:`~meshkit.comm.stores.FileStore` on a file every rank sees;
* ``store=`` with explicit ``world_size`` and ``rank``: the caller's store.

Under ``mpiexec``/``meshkit-run``/``meshkit.spawn`` the MPI world exists (:func:`mpi_launched`),
and it is the world: an init method or ``world_size``/``rank`` that disagrees with it is an
error naming both (:func:`agreement`), checked on every rank so that all of them raise.

The rendezvous (:func:`rendezvous`) claims this rank in the store (``compare_set``: two processes
claiming one rank both fail, naming the rank and both processes), counts the arrivals, and waits
for all of them under the timeout, naming how many arrived and which ranks did not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import numbers
import os
import time
import urllib.parse
import uuid
from typing import Any

from .. import env
from ..errors import DistBackendError, DistStoreError, DistTypeError, DistValueError
from ..stores import FileStore, PrefixStore, Store, TCPStore

__all__ = ["Rendezvous", "Requested", "requested", "mpi_launched", "launcher_name", "agreement", "rendezvous",
           "MPI_RANK_ENVS", "SCHEMES", "PREFIX", "rendezvous_keys"]

logger = logging.getLogger("meshkit")

SCHEMES = ("env://", "tcp://host:port", "file:///path")
#: Variables by which an MPI process manager announces a rank (MPICH's Hydra, Open MPI, PMIx):
#: set, they mean ``MPI_Init`` will join a world of several processes (launch/bootstrap.py reads
#: the same). Slurm's SLURM_PROCID alone does not: ``srun`` without an MPI plugin starts
#: independent processes, which an init method joins.
MPI_RANK_ENVS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
#: ``env://``'s variables, each with the Slurm variable that stands in for it when it is not set.
_ENV_FALLBACK = {"RANK": "SLURM_PROCID", "WORLD_SIZE": "SLURM_NTASKS", "LOCAL_RANK": "SLURM_LOCALID"}
#: The keys of a world in its store. The last rank to leave the world deletes them (the store engine's
#: ``flush``), so that a store given to init_process_group again starts clean.
PREFIX = "meshkit/world"
#: Seconds between a rank's tries to reach rank 0's TCPStore of this world while the previous one closes.
_REOPEN_PAUSE_S = 0.05
#: Seconds at most a failed rendezvous' store owner waits for the others to read the verdict.
_LINGER_S = 2.0
#: Extra seconds a rank waits for the verdict of a rendezvous another rank has timed out.
_VERDICT_GRACE_S = 2.0


def _here() -> str:
    return f"pid {os.getpid()} on host {env.this_host()}"  # the store engine's local_rank() reads the host


@dataclasses.dataclass
class Requested:
    """What the caller asked for: the init method, and the rank and world size it gives (-1: not
    given), with ``source`` saying where they came from (for messages)."""

    init_method: str | None
    scheme: str | None  # "env", "tcp", "file", "store", or None (nothing asked)
    rank: int
    world_size: int
    local_rank: int | None
    source: str  # "init_method env:// says RANK=3, WORLD_SIZE=4", ...
    host: str = ""
    port: int = 0
    path: str = ""
    store: Store | None = None

    @property
    def explicit(self) -> bool:
        """Whether anything at all was asked (else the launcher's world, or a world of one)."""
        return self.scheme is not None or self.rank != -1 or self.world_size != -1


@dataclasses.dataclass
class Rendezvous:
    """A rendezvous that completed: this rank, the world size, the world's keys (``store``, under
    :data:`PREFIX` of ``base``, the store every rank reached), and whether meshkit made ``base``
    (and closes it at destroy)."""

    store: Store
    base: Store
    rank: int
    world_size: int
    local_rank: int | None
    owned: bool
    where: str


def _int_arg(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise DistTypeError(f"meshkit.comm: init_process_group({name}={value!r}): {name} must be an int "
                            f"(-1: not given), got {type(value).__name__}")
    value = int(value)
    if value != -1 and value < minimum:
        raise DistValueError(f"meshkit.comm: init_process_group({name}={value}): {name} must be -1 (not given) or "
                             f">= {minimum}")
    return value


def _env_int(name: str, minimum: int, method: str) -> int | None:
    """The integer in ``name`` (or its Slurm stand-in); None where neither is set."""
    used = name if os.environ.get(name, "").strip() else _ENV_FALLBACK.get(name)
    raw = os.environ.get(used or name, "").strip()
    if not raw:
        return None
    if not raw.lstrip("-").isdigit() or int(raw) < minimum:
        raise DistValueError(f"meshkit.comm: init_method {method} reads {used}={raw!r}, which is not valid; "
                             f"{used} must be an integer >= {minimum}")
    return int(raw)


def _check_rank(rank: int, world_size: int, source: str) -> None:
    if not 0 <= rank < world_size:
        raise DistValueError(f"meshkit.comm: {source}: rank {rank} is out of range for a world of {world_size} "
                             f"ranks (valid ranks: 0..{world_size - 1})")


def requested(init_method: str | None, world_size: Any, rank: Any, store: Any) -> Requested:
    """Parse and check what ``init_process_group`` was given; nothing is connected yet.

    Raises:
        DistValueError: a malformed URL, an unknown scheme, a bad port, a variable that is not an
            integer, a rank out of range, a store together with an init method, a missing
            ``world_size``/``rank`` where the method needs them.
        DistTypeError: arguments of the wrong type.
    """
    world_size = _int_arg("world_size", world_size, 1)
    rank = _int_arg("rank", rank, 0)
    args = f"init_process_group(world_size={world_size}, rank={rank})"
    if store is not None:
        if init_method is not None:
            raise DistValueError(f"meshkit.comm: init_process_group: store and init_method={init_method!r} were both "
                                 "given; give one of them (the store is the rendezvous, as in torch)")
        if not isinstance(store, Store):
            raise DistTypeError(f"meshkit.comm: init_process_group(store=...): store must be a meshkit Store "
                                f"(TCPStore, FileStore, HashStore, PrefixStore), got {type(store).__name__}")
        _need_both("store=", world_size, rank)
        _check_rank(rank, world_size, args)
        return Requested(None, "store", rank, world_size, None, f"store= with {args}", store=store)
    if init_method is None:
        if world_size != -1 and rank != -1:
            _check_rank(rank, world_size, args)
        return Requested(None, None, rank, world_size, None, args)
    if not isinstance(init_method, str):
        raise DistTypeError(f"meshkit.comm: init_process_group(init_method={init_method!r}): init_method must be a "
                            f"URL string, one of {list(SCHEMES)}")
    scheme, sep, rest = init_method.partition("://")
    if not sep:
        raise DistValueError(f"meshkit.comm: init_process_group(init_method={init_method!r}) is not a URL; valid "
                             f"init methods are {list(SCHEMES)}")
    scheme = scheme.lower()
    if scheme == "env":
        return _env_method(init_method, rest, world_size, rank)
    if scheme == "tcp":
        host, port = _tcp_address(init_method)
        _need_both(init_method, world_size, rank)
        _check_rank(rank, world_size, args)
        return Requested(init_method, "tcp", rank, world_size, None, f"init_method {init_method} with {args}",
                         host=host, port=port)
    if scheme == "file":
        path = _file_path(init_method)
        _need_both(init_method, world_size, rank)
        _check_rank(rank, world_size, args)
        return Requested(init_method, "file", rank, world_size, None, f"init_method {init_method} with {args}",
                         path=path)
    raise DistValueError(f"meshkit.comm: init_process_group(init_method={init_method!r}): unknown scheme "
                         f"{scheme + '://'!r}; valid init methods are {list(SCHEMES)}")


def _need_both(what: str, world_size: int, rank: int) -> None:
    missing = [name for name, v in (("world_size", world_size), ("rank", rank)) if v == -1]
    if missing:
        raise DistValueError(f"meshkit.comm: init_process_group with {what} needs world_size and rank; "
                             f"{' and '.join(missing)} not given (-1)")


def _env_method(url: str, rest: str, world_size: int, rank: int) -> Requested:
    if rest:
        raise DistValueError(f"meshkit.comm: init_process_group(init_method={url!r}): env:// takes nothing after "
                             "the '//' (it reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)")
    env_rank = _env_int("RANK", 0, url)
    env_size = _env_int("WORLD_SIZE", 1, url)
    local = _env_int("LOCAL_RANK", 0, url)
    size = world_size if world_size != -1 else env_size
    me = rank if rank != -1 else env_rank
    missing = [name for name, v in (("RANK", me), ("WORLD_SIZE", size)) if v is None]
    if missing:
        raise DistValueError(f"meshkit.comm: init_method env:// needs {' and '.join(missing)} in the environment "
                             "(a torchrun-style launcher sets them; Slurm's SLURM_PROCID/SLURM_NTASKS stand in), "
                             "or the rank/world_size arguments; none was set")
    source = f"init_method env:// says RANK={me}, WORLD_SIZE={size}"
    _check_rank(me, size, source)
    return Requested(url, "env", me, size, local, source)


def _master() -> tuple[str, int]:
    """``MASTER_ADDR`` and ``MASTER_PORT``, checked."""
    addr = os.environ.get("MASTER_ADDR", "").strip()
    port = os.environ.get("MASTER_PORT", "").strip()
    missing = [n for n, v in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if not v]
    if missing:
        raise DistValueError(f"meshkit.comm: init_method env:// needs {' and '.join(missing)} in the environment "
                             "(the address and port where rank 0 serves the rendezvous store), not set")
    return addr, _port(port, f"init_method env:// reads MASTER_PORT={port!r}")


def _port(raw: str, source: str) -> int:
    if not raw.isdigit() or not 1 <= int(raw) <= 65535:
        raise DistValueError(f"meshkit.comm: {source}: the port must be an integer in 1..65535")
    return int(raw)


def _tcp_address(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url)
    if parts.path not in ("", "/") or parts.query or parts.fragment or "@" in parts.netloc:
        raise DistValueError(f"meshkit.comm: init_process_group(init_method={url!r}): a tcp:// URL is "
                             "tcp://host:port and nothing else (world_size and rank are arguments)")
    netloc = parts.netloc
    if netloc.startswith("["):  # an IPv6 address: tcp://[::1]:29500
        host, _, rest = netloc[1:].partition("]")
        sep, port = rest[:1], rest[1:]
    else:
        host, sep, port = netloc.rpartition(":")
    if sep != ":" or not host or (":" in host and not netloc.startswith("[")):
        raise DistValueError(f"meshkit.comm: init_process_group(init_method={url!r}): a tcp:// URL names a host "
                             "and a port: tcp://host:port (an IPv6 address in brackets: tcp://[::1]:29500)")
    return host, _port(port, f"init_process_group(init_method={url!r}) has port {port!r}")


def _file_path(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    path = urllib.parse.unquote(parts.path)
    if parts.netloc not in ("", "localhost") or not path.startswith("/") or path.endswith("/"):
        raise DistValueError(f"meshkit.comm: init_process_group(init_method={url!r}): a file:// URL names a file by "
                             "its absolute path, file:///path/to/file (three slashes), on a file system every rank "
                             "sees")
    return path


# --------------------------------------------------------------------------- an existing MPI world
def mpi_launched() -> bool:
    """Whether an MPI process manager started this process (``mpiexec``, ``meshkit-run``,
    ``meshkit.spawn``, ``srun`` with an MPI plugin): then MPI's world is the world."""
    return any(os.environ.get(name, "").strip() for name in MPI_RANK_ENVS) or \
        os.environ.get(env.LAUNCHED, "").strip() == "1"


def launcher_name() -> str:
    return "meshkit-run" if os.environ.get(env.LAUNCHED, "").strip() == "1" else "mpiexec"


def agreement(asked: Requested, rank: int, size: int, launcher: str | None = None) -> str | None:
    """Where ``asked`` disagrees with the world ``launcher`` (default: :func:`launcher_name`) made,
    ``rank`` of ``size``: the message, naming both; None where they agree."""
    launcher = launcher or launcher_name()
    differs = (asked.world_size != -1 and asked.world_size != size) or (asked.rank != -1 and asked.rank != rank)
    if not differs:
        return None
    said = asked.source
    if asked.scheme not in ("env",):
        said = f"init_process_group(world_size={asked.world_size}, rank={asked.rank})"
        if asked.scheme is not None:
            said += f" with {asked.init_method or 'store='}"
        said += " says"
        if asked.world_size != -1:
            said += f" WORLD_SIZE={asked.world_size}"
        if asked.rank != -1:
            said += f"{',' if asked.world_size != -1 else ''} RANK={asked.rank}"
    return (f"meshkit.comm: {said} but {launcher} started this process as rank {rank} of {size}; the world "
            f"{launcher} made is the world: drop the init method and world_size/rank, or make them agree")


# --------------------------------------------------------------------------- the store and the rendezvous
def open_store(asked: Requested, timeout: float) -> tuple[Store, bool, str]:
    """The store of ``asked`` (made here, or the caller's), whether meshkit owns it, and where it is."""
    if asked.scheme == "store":
        return asked.store, False, "store="
    if asked.scheme == "file":
        if env.job_identity() is None:
            raise DistValueError(
                f"meshkit.comm: rank {asked.rank}: init_process_group over {asked.init_method} needs the job's "
                f"identity, so that two jobs on one path never form one world: set {env.JOB_SECRET} to the same "
                "secret on every rank before starting them (e.g. export "
                f"{env.JOB_SECRET}=$(python -c 'import secrets; print(secrets.token_hex(32))')), or start the "
                "ranks with a launcher that names its job (meshkit-run, Slurm, torchrun with --rdzv-id)")
        return FileStore(asked.path, asked.world_size), True, asked.init_method
    host, port = (asked.host, asked.port) if asked.scheme == "tcp" else _master()
    where = asked.init_method if asked.scheme == "tcp" else f"env:// (MASTER_ADDR={host}, MASTER_PORT={port})"
    store = TCPStore(host, port, world_size=asked.world_size, is_master=asked.rank == 0, timeout=timeout,
                     wait_for_workers=False)
    if not store.authenticated:
        _warn_open(where)
    return store, True, where


_warned_open = False


def _warn_open(where: str) -> None:
    """Say once per process that the rendezvous store admits anyone who reaches it."""
    global _warned_open
    if not _warned_open:
        _warned_open = True
        logger.warning("meshkit: the rendezvous store over %s is not authenticated (%s is not set): any process "
                       "that reaches its port can read and write the world's keys (nothing read from it is "
                       "unpickled, so no code runs, but a world can be disrupted). Set %s to the same secret on "
                       "every rank; see docs/security.md", where, env.JOB_SECRET, env.JOB_SECRET)


def rendezvous(asked: Requested, timeout: float) -> Rendezvous:
    """Meet the other ``world_size - 1`` ranks through the store of ``asked`` within ``timeout``.

    Raises:
        DistValueError: another process claimed this rank (both raise, naming the rank and both
            processes; every other rank raises too, naming them).
        DistStoreError: not every rank arrived within the timeout (naming how many did and which
            ranks did not).
    """
    store, owned, where = open_store(asked, timeout)
    keys = PrefixStore(PREFIX, store)
    try:
        _meet(keys, asked, timeout, where, isinstance(store, TCPStore))
    except BaseException:
        if owned:
            _linger(keys)
            store.close()
        raise
    return Rendezvous(keys, store, asked.rank, asked.world_size, asked.local_rank, owned, where)


def _meet(keys: Store, asked: Requested, timeout: float, where: str, tcp: bool) -> None:
    rank, size = asked.rank, asked.world_size
    deadline = time.monotonic() + timeout
    if tcp:
        _opened(keys, rank, deadline, timeout, where)
    mine = f"{_here()} ({uuid.uuid4().hex[:8]})"
    keys.add("came", 1)
    held = keys.compare_set(f"rank/{rank}", "", mine).decode(errors="replace")
    if held != mine:
        message = (f"meshkit.comm: init_process_group over {where}: rank {rank} was claimed by two processes: "
                   f"{held.rsplit(' (', 1)[0]} and {_here()}; every rank needs its own rank (check RANK or the rank "
                   "argument of each process; a file:// store left by an earlier job holds its claims: delete it)")
        keys.compare_set("go", "", "fail " + message)
        _told(keys)
        raise DistValueError(message)
    if keys.add("arrived", 1) == size:
        keys.compare_set("go", "", "ok")
    verdict = _await_go(keys, deadline, rank, size, timeout, where)
    if verdict != "ok":
        _told(keys)
        raise DistValueError(verdict.removeprefix("fail ")) if verdict.startswith("fail ") else \
            DistStoreError(verdict.removeprefix("timeout "))


def _told(keys: Store) -> None:
    """This process has read the rendezvous' failing verdict (counted for :func:`_linger`)."""
    with contextlib.suppress(Exception):  # the verdict's own error is what the caller raises
        keys.add("told", 1)


def _linger(keys: Store) -> None:
    """The owner of the store (rank 0, whose process serves a TCPStore) failed the rendezvous: keep
    the store up until every process that came has read the verdict (at most ``_LINGER_S``), or
    the others fail on a closed connection instead of the verdict (a duplicate rank, seen in CI)."""
    end = time.monotonic() + _LINGER_S
    with contextlib.suppress(Exception):
        while time.monotonic() < end and keys.add("told", 0) < keys.add("came", 0):
            time.sleep(_REOPEN_PAUSE_S)


#: The mark of the last world this process met at each address (``where``): a rank of a next world on
#: the same port that finds this mark there has reached the old world's server, still up because
#: its rank 0 has not left yet (a failed world's rank 0 may still wait in a collective), and waits.
_met_worlds: dict[str, str] = {}


def _opened(keys: Store, rank: int, deadline: float, timeout: float, where: str) -> None:
    """Rank 0 marks its TCPStore open for this world (``open``, a token of this world; it deletes
    the mark as it leaves the world); the others wait for the mark. A rank that reaches the server
    of the previous world on the same port (its master still closing it, or still in that world)
    so waits, reconnects once that server is gone, and never joins the old world's keys."""
    if rank == 0:
        token = uuid.uuid4().hex
        keys.set("open", token)
        _met_worlds[where] = token
        return
    old = _met_worlds.get(where)
    while True:
        try:
            keys.wait(["open"], timeout=max(deadline - time.monotonic(), 0.0))
            token = keys.get("open").decode(errors="replace")
            if token != old:
                _met_worlds[where] = token
                return
        except DistStoreError as exc:
            if exc.keys:
                raise DistStoreError(f"meshkit.comm: rank {rank}: init_process_group over {where}: rank 0 did not open "
                                     f"the rendezvous within the timeout of {timeout:g} s (a server answers there, "
                                     "but not rank 0's of this world)") from None
        if time.monotonic() > deadline:
            raise DistStoreError(f"meshkit.comm: rank {rank}: init_process_group over {where}: no server of rank 0 "
                                 f"of this world answered within the timeout of {timeout:g} s (the previous world's "
                                 "did: has its rank 0 left it?)")
        time.sleep(_REOPEN_PAUSE_S)  # the old world's server: the next request finds it gone, or the mark changed


def rendezvous_keys(size: int) -> list[str]:
    """The keys a rendezvous of ``size`` ranks leaves (under :data:`PREFIX`)."""
    return [*(f"rank/{r}" for r in range(size)), "arrived", "go", "open", "came", "told"]


def _await_go(keys: Store, deadline: float, rank: int, size: int, timeout: float, where: str) -> str:
    try:
        keys.wait(["go"], timeout=max(deadline - time.monotonic(), 0.0))
    except DistStoreError as exc:
        if not exc.keys:  # the store itself failed (its server is gone), not a timeout
            raise DistBackendError(f"meshkit.comm: rank {rank}: init_process_group over {where}: the store "
                                   f"failed: {exc}") from None
        arrived = keys.add("arrived", 0)
        absent = [r for r in range(size) if not keys.check([f"rank/{r}"])]
        message = (f"timeout meshkit.comm: init_process_group over {where}: {arrived} of {size} ranks "
                   f"arrived within the timeout of {timeout:g} s; ranks {absent} never did (were they started, with "
                   "the same address and world size?)")
        keys.compare_set("go", "", message)  # a rank arriving later fails at once, not at its own timeout
        try:
            keys.wait(["go"], timeout=_VERDICT_GRACE_S)
        except DistStoreError:
            return message
    return keys.get("go").decode(errors="replace")
