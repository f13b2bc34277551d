"""A host engine over a key-value store: what the NCCL engine needs of its host in a job that no
MPI process manager started (``init_process_group("nccl", init_method="env://")`` under
torchrun-style launchers or ``srun``).

The NCCL engine moves device arrays itself; of its host engine it needs small-object exchanges
(the unique id, each rank's GPU, detail-mode checks, monitored barriers, splits), a barrier,
notices between ranks, and the node-local rank. :class:`StoreEngine` does these through store
keys, namespaced per group and numbered per call, under the group's deadline, naming the ranks
that did not arrive. It moves no arrays: host (NumPy) arrays on such a world are a
:class:`~meshkit.comm.errors.DistTypeError` saying which launcher or backend serves them
(``host_arrays = False``; object collectives take the exchange instead, see
:mod:`meshkit.comm.objects`).

Keys (under the world's prefix, :data:`~meshkit.comm.setup.init_methods.PREFIX`):

* ``g<ns>/x<c>/<r>``: rank r's part of exchange number c of group ``ns``; group rank 0 reads
  them all and answers with ``g<ns>/x<c>/all`` (every value, or the ranks that did not arrive),
  as the MPI engine's exchange does; the last reader deletes it;
* ``g<ns>/b<c>/<r>``: rank r reached barrier number c; the last rank to see all of them deletes them;
* ``n/<r>/count`` and ``n/<r>/<i>``: notice i to global rank r (a counter, then the notice);
* ``left``: how many ranks left the world (the last deletes the world's keys).

Whoever can write the store (anyone who reaches a TCPStore's port without the job's secret, or
writes a file:// file) can write these keys, so their values are never unpickled: notices,
exchange payloads and answers travel in the typed format of :mod:`~meshkit.comm.control`. A
value that is not one (a pickle, garbage, an answer of the wrong shape) is a
:class:`~meshkit.comm.control.ControlMessageError` naming the key and the rank that should have
written it; a payload is refused by group rank 0, whose answer makes every member raise it.
Whether object collectives may unpickle on this world is the store's answer
(``Store.authenticated``: the job's secret; ``capabilities.authenticated_peers``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any, Callable, Sequence

from .. import env
from ..control import ControlMessageError, decode, decode_notice, encode
from .engine import DeadlineExceeded, EngineCapabilities
from ..errors import DistBackendError, DistStoreError, DistTypeError, DistValueError
from ..notices import LEFT, WATCH_INTERVAL, Notice
from ..stores import Store

__all__ = ["StoreEngine", "create_world_engine", "HOST_ARRAYS_MESSAGE"]

logger = logging.getLogger("meshkit")

#: Seconds between reads of the notices while a wait stalls (each read is a store round trip):
#: a rank that left is named within this, not at the timeout.
_WATCH_SLICE_S = max(WATCH_INTERVAL, 0.05)
#: Extra seconds a non-root rank waits for group rank 0's verdict, which rank 0 gives only at its
#: own deadline (as the MPI engine's exchange, comm/engines/mpi.py _VERDICT_GRACE).
_VERDICT_GRACE_S = 5.0
#: What a host-array collective on a store-bootstrapped world says (the rest names the operation).
HOST_ARRAYS_MESSAGE = ("host (NumPy) arrays need a host engine, and this nccl world was started without MPI "
                       "(its host side is the rendezvous store, which moves no arrays): pass device (CuPy) "
                       "arrays, or start the job with meshkit-run/mpiexec (the nccl backend then moves host "
                       "arrays over MPI), or use the mpi backend under meshkit-run/mpiexec")


#: Seconds a rank waits for a notice whose counter was raised but whose key is not there yet: its
#: sender writes the key right after raising the counter (one store round trip, well under a
#: millisecond on a host, a few over a network), so a key missing for this long was never posted
#: (the counter was raised by someone else), and the rank does not wait on it for the store's timeout.
_NOTICE_GRACE_S = 2.0
#: What a malformed value read from the store adds to its error: who may have written it.
_OUTSIDER = "; a process outside this job may have written to the rendezvous store"


class _Channel:
    """What the engines of one world share: the store, this process's global rank, the notices."""

    def __init__(self, store: Store, rank: int, size: int, local_rank: int | None, owned: Store | None,
                 rendezvous_keys: Sequence[str] = ()) -> None:
        self.store, self.rank, self.size, self.owned = store, rank, size, owned
        self.rendezvous_keys = tuple(rendezvous_keys)  # the rendezvous's keys, deleted by the last rank to leave
        self.local_rank = local_rank
        self.read = 0  # notices to this rank read so far
        self.kept: list[Notice] = []  # notices read beside a malformed one, returned at the next read
        self.lock = threading.Lock()
        self.left = False
        # Whether only the job's processes can write the store (it proves the job's secret); read once.
        self.authenticated = store.authenticated is True

    def notify(self, ranks: list[int], notice: Notice) -> None:
        data = encode(notice)
        for r in ranks:
            if r == self.rank:
                continue
            try:
                n = self.store.add(f"n/{r}/count", 1)
                self.store.set(f"n/{r}/{n}", data)
            except Exception:  # noqa: BLE001 (a store gone at the end of a job: nobody left to tell)
                logger.debug("meshkit: rank %d could not post a notice to rank %d", self.rank, r, exc_info=True)

    def notices(self) -> list[Notice]:
        """The notices posted to this rank since the last call. A value that is no notice is a
        ControlMessageError naming its key (the notices read with it come at the next call)."""
        with self.lock:
            got, self.kept = self.kept, []
            bad: ControlMessageError | None = None
            try:
                counter = f"n/{self.rank}/count"
                count = self.store.add(counter, 0)
                for i in range(self.read + 1, count + 1):
                    key = f"n/{self.rank}/{i}"
                    if not self._posted(key):  # a counter raised by someone who posts nothing: skip its range
                        self.read = count
                        bad = bad or ControlMessageError(
                            f"meshkit.comm: rank {self.rank}: the notice counter {counter!r} says {count}, but key "
                            f"{key!r} was not written within {_NOTICE_GRACE_S:g} s of it (a rank that posts a "
                            "notice writes it right after raising the counter)")
                        break
                    data = self.store.get(key)
                    self.store.delete_key(key)
                    self.read = i
                    try:
                        got.append(decode_notice(data, what=f"rank {self.rank}: the notice in rendezvous store key "
                                                            f"{key!r} (posted by another rank of this world)"))
                    except ControlMessageError as exc:
                        bad = bad or exc
            except DistStoreError as exc:
                raise DistBackendError(f"meshkit.comm: rank {self.rank}: the rendezvous store failed while this rank "
                                       f"read its notices ({exc}); did rank 0, which serves a TCPStore, end?") from None
            if bad is not None:
                self.kept = got
                raise ControlMessageError(f"{bad}{_OUTSIDER}")
            return got


    def _posted(self, key: str) -> bool:
        """Whether notice ``key`` is there, or comes within :data:`_NOTICE_GRACE_S`."""
        if self.store.check([key]):
            return True
        try:
            self.store.wait([key], timeout=_NOTICE_GRACE_S)
        except DistStoreError as exc:
            if not exc.keys:  # the store itself failed
                raise
            return False
        return True


class _Barrier:
    """A barrier in flight: complete once every member's key of call ``base`` is set."""

    __slots__ = ("engine", "keys", "done")
    source, count, dtype = -1, -1, None

    def __init__(self, engine: StoreEngine, keys: list[str]) -> None:
        self.engine, self.keys, self.done = engine, keys, False

    def Test(self) -> bool:  # noqa: N802 (the Request protocol's name)
        if not self.done and self.engine.store.check(self.keys):
            self.complete()
        return self.done

    def complete(self) -> None:
        """Every member's key is set: done (the last member to see it deletes the keys)."""
        self.done = True
        self.engine.seen(self.keys, self.keys[0].rpartition("/")[0] + "/seen")


class StoreEngine:
    """The host engine of a group whose ranks met through a store (no MPI)."""

    backend = "store"
    native_avg = False
    # A barrier completes as the others set their keys: nothing to drive (no needs_progress). It
    # moves no arrays: object collectives use exchange (comm/objects.py). abort ends this process
    # after telling the others it left.
    capabilities = EngineCapabilities(host_arrays=False, aborts_job=True)
    device = None
    max_tag = 0

    def __init__(self, channel: _Channel, ns: str, world_ranks: tuple[int, ...], rank: int) -> None:
        self.channel, self.store, self.ns = channel, channel.store, ns
        # Object collectives unpickle only where the store admits the job's processes alone.
        self.capabilities = dataclasses.replace(StoreEngine.capabilities, authenticated_peers=channel.authenticated)
        self._world_ranks = world_ranks
        self.rank, self.size = rank, len(world_ranks)
        self.watch: Callable[[], None] | None = None
        self._calls = 0

    @property
    def world_ranks(self) -> list[int]:
        return list(self._world_ranks)

    @property
    def _me(self) -> int:
        return self._world_ranks[self.rank]

    def _next(self) -> int:
        self._calls += 1
        return self._calls

    # ----------------------------------------------------------------- waiting on keys
    def _await(self, keys: list[str], deadline: float, watched: bool) -> bool:
        """Wait until every one of ``keys`` is set (True) or the deadline passes (False), reading
        notices between slices when ``watched``."""
        watch = self.watch if watched else None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return self.store.check(keys)
            try:
                self.store.wait(keys, timeout=min(left, _WATCH_SLICE_S) if watch is not None else left)
                return True
            except DistStoreError as exc:
                if not exc.keys:  # not a timeout: the store itself failed
                    raise DistBackendError(f"meshkit.comm: rank {self._me}: the rendezvous store failed: "
                                           f"{exc}") from None
            if watch is not None:
                watch()

    def _fetch(self, key: str, deadline: float, watched: bool) -> bytes | None:
        """The value of ``key`` once set (None: not by the deadline), reading notices between
        slices when ``watched``: one round trip where a wait and a get would be two."""
        watch = self.watch if watched else None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                value = self.store.try_get(key, min(left, _WATCH_SLICE_S) if watch is not None else left)
            except DistStoreError as exc:  # the store itself failed (a timeout is None, not an error)
                raise DistBackendError(f"meshkit.comm: rank {self._me}: the rendezvous store failed: {exc}") from None
            if value is not None:
                return value
            if watch is not None:
                watch()

    def _absent(self, keys: list[str]) -> list[int]:
        return [self._world_ranks[i] for i, key in enumerate(keys) if not self.store.check([key])]

    def seen(self, keys: list[str], counter: str) -> None:
        """This rank is done with ``keys``: the last of the group to be deletes them."""
        if self.store.add(counter, 1) == self.size:
            for key in (*keys, counter):
                self.store.delete_key(key)

    # ----------------------------------------------------------------- what the NCCL engine asks
    def exchange(self, payload: Any, seq: int, deadline: float, *, watched: bool = False) -> list[Any]:
        """Every member's ``payload``, in group rank order; DeadlineExceeded names the ranks that
        did not arrive. Group rank 0 collects and answers, as the MPI engine's exchange.

        Payloads and answers are control messages (:mod:`~meshkit.comm.control`). A payload that
        is not one makes group rank 0 answer with an error naming its key and sender, which every
        member raises; an answer that is not one is raised by the member that read it (its group
        then breaks, and its notice fails the others' next wait)."""
        if self.size == 1:
            return [payload]
        base = f"g{self.ns}/x{self._next()}"
        answer = f"{base}/all"
        if self.rank != 0:
            self.store.set(f"{base}/{self.rank}", encode(payload))
            data = self._fetch(answer, deadline + _VERDICT_GRACE_S, watched)
            if data is None:
                raise DeadlineExceeded([self._world_ranks[0]], "group rank 0 never answered the exchange")
            if self.store.add(f"{base}/read", 1) == self.size - 1:
                self.store.delete_key(answer)
                self.store.delete_key(f"{base}/read")
            kind, value = self._answer(data, answer)
            if kind == "timeout":
                raise DeadlineExceeded(value)
            if kind == "error":
                raise DistBackendError(value)
            return value
        keys = [f"{base}/{r}" for r in range(1, self.size)]
        if not self._await(keys, deadline, watched):
            missing = [self._world_ranks[i + 1] for i, key in enumerate(keys) if not self.store.check([key])]
            self.store.set(answer, encode(("timeout", missing)))
            raise DeadlineExceeded(missing)
        values = [payload]
        refused = None
        for r, key in enumerate(keys, start=1):
            data = self.store.get(key)
            self.store.delete_key(key)
            try:
                values.append(decode(data, what=f"rank {self._me}: the payload of exchange {base} in rendezvous "
                                                f"store key {key!r} (written by group rank {r}, rank "
                                                f"{self._world_ranks[r]})"))
            except ControlMessageError as exc:
                refused = refused or f"{exc}{_OUTSIDER}"
        if refused is not None:  # every member raises it: the answer says so
            self.store.set(answer, encode(("error", refused)))
            raise ControlMessageError(refused)
        try:
            self.store.set(answer, encode(("ok", values)))
        except (DistValueError, DistTypeError) as exc:  # too large for the store: every member raises
            message = f"meshkit.comm: exchange over the rendezvous store failed on group rank 0: {exc}"
            self.store.set(answer, encode(("error", message)))
            raise DistBackendError(message) from None
        return values

    def _answer(self, data: bytes, key: str) -> tuple[str, Any]:
        """Group rank 0's answer read from ``key``: ``("ok", one value per member)``, ``("timeout",
        missing ranks)`` or ``("error", message)``; anything else is a ControlMessageError."""
        what = (f"rank {self._me}: the answer of exchange {key.rpartition('/')[0]} in rendezvous store key {key!r} "
                f"(written by group rank 0, rank {self._world_ranks[0]})")
        try:
            got = decode(data, what=what)
        except ControlMessageError as exc:
            raise ControlMessageError(f"{exc}{_OUTSIDER}") from None
        if type(got) is tuple and len(got) == 2:
            kind, value = got
            if (kind == "ok" and type(value) is list and len(value) == self.size
                    or kind == "timeout" and type(value) is list and all(type(r) is int for r in value)
                    or kind == "error" and type(value) is str):
                return kind, value
        shown = repr(got)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise ControlMessageError(f"meshkit.comm: {what}: {shown} is not an answer of a group of {self.size} "
                                  f"(('ok', [one value per member]), ('timeout', [ranks]) or ('error', text))"
                                  f"{_OUTSIDER}")

    def barrier(self) -> _Barrier:
        base = f"g{self.ns}/b{self._next()}"
        self.store.set(f"{base}/{self.rank}", b"1")
        return _Barrier(self, [f"{base}/{r}" for r in range(self.size)])

    def wait(self, request: Any, deadline: float) -> None:
        if not isinstance(request, _Barrier):
            raise DistTypeError(f"meshkit.comm: rank {self._me}: the store engine cannot wait for {request!r}")
        if request.done:
            return
        # One wait (it returns at once where every key is set already), not a check before and
        # after it: each is a store round trip on the barrier's path.
        if self._await(request.keys, deadline, True):
            request.complete()
        elif not request.Test():
            raise DeadlineExceeded(self._absent(request.keys))

    def split(self, color: int | None, ranks: tuple[int, ...], deadline: float) -> StoreEngine | None:
        parts = self.exchange((color, self._me), -1, deadline, watched=True)
        call = self._calls
        if color is None:
            return None
        members = tuple(sorted(g for c, g in parts if c == color))
        if members != tuple(ranks):
            raise DistValueError(f"meshkit.comm: rank {self._me}: split: ranks disagree on group {list(ranks)}: "
                                 f"the split gave {list(members)}")
        return StoreEngine(self.channel, f"{self.ns}.{call}.{color}", members, members.index(self._me))

    def notify(self, ranks: list[int], notice: Notice) -> None:
        self.channel.notify(ranks, notice)

    def notices(self) -> list[Notice]:
        return self.channel.notices()

    def flush(self, timeout: float) -> None:
        """This rank leaves the world. Rank 0, which serves a TCPStore, waits (up to ``timeout``)
        for the others to leave too, so that their last notices find the server; the last rank to
        leave deletes the world's keys, so that a store given to init_process_group again starts clean."""
        channel = self.channel
        if channel.left:
            return
        channel.left = True
        try:
            if channel.rank == 0:  # no rank of a next world on the same port joins this one (init_methods._opened)
                self.store.delete_key("open")
            if self.store.add("left", 1) == channel.size:
                for key in (*channel.rendezvous_keys, "left"):
                    self.store.delete_key(key)
                for r in range(channel.size):  # notices never read (the LEFT notices of this very leaving)
                    # The unread ones are the last: from the counter down to the first missing key,
                    # so a counter raised by someone else costs one delete, not one per number.
                    for i in range(self.store.add(f"n/{r}/count", 0), 0, -1):
                        if not self.store.delete_key(f"n/{r}/{i}"):
                            break
                    self.store.delete_key(f"n/{r}/count")
                self.store.set("all-left", b"1")
            if channel.rank == 0 and channel.size > 1:
                try:
                    self.store.wait(["all-left"], timeout=timeout)
                except DistStoreError:
                    pass
            if channel.rank == 0:
                self.store.delete_key("all-left")
        except Exception:  # noqa: BLE001 (leaving must not fail on a store already gone)
            logger.debug("meshkit: rank %d could not record its leaving in the store", channel.rank, exc_info=True)

    def abort(self, code: int) -> None:
        """End this process, after telling every other rank that it left (so that none waits for
        it until the timeout): a store cannot end other processes as ``MPI_Abort`` does."""
        others = [r for r in range(self.channel.size) if r != self.channel.rank]
        self.channel.notify(others, Notice(LEFT, self.channel.rank, detail=f"it aborted the job (exit code {code})"))
        os._exit(code)

    def host_name(self) -> str:
        return env.this_host()

    def local_rank(self) -> int:
        """This rank's index on its node: the launcher's ``LOCAL_RANK`` (or ``SLURM_LOCALID``), else
        its place among the ranks that claimed their rank from this host name (``MESHKIT_HOST_NAME``
        where set: simulated nodes)."""
        if self.channel.local_rank is not None:
            return self.channel.local_rank
        hosts = [self.store.get(f"rank/{r}").decode(errors="replace").rsplit(" (", 1)[0].partition(" on host ")[2]
                 for r in range(self.channel.size)]
        mine = hosts[self.channel.rank]
        return sum(1 for h in hosts[:self.channel.rank] if h == mine)

    def free(self) -> None:
        if self.ns == "w" and self.channel.owned is not None:
            self.channel.owned.close()

    # ----------------------------------------------------------------- no arrays
    def _no_arrays(self, op: str) -> Any:
        raise DistTypeError(f"meshkit.comm: rank {self._me}: {op}: {HOST_ARRAYS_MESSAGE}")

    def all_reduce(self, buf: Any, op: Any) -> Any:
        return self._no_arrays("all_reduce")

    def reduce(self, buf: Any, op: Any, root: int) -> Any:
        return self._no_arrays("reduce")

    def broadcast(self, buf: Any, root: int) -> Any:
        return self._no_arrays("broadcast")

    def all_gather(self, out: Any, inp: Any) -> Any:
        return self._no_arrays("all_gather")

    def reduce_scatter(self, out: Any, inp: Any, op: Any) -> Any:
        return self._no_arrays("reduce_scatter")

    def gather(self, out: Any, inp: Any, root: int) -> Any:
        return self._no_arrays("gather")

    def scatter(self, out: Any, inp: Any, root: int) -> Any:
        return self._no_arrays("scatter")

    def all_to_all(self, out: Any, recv_counts: list[int], inp: Any, send_counts: list[int]) -> Any:
        return self._no_arrays("all_to_all")

    def send(self, buf: Any, dst: int, tag: int) -> Any:
        return self._no_arrays("send")

    def recv(self, buf: Any, src: int | None, tag: int) -> Any:
        return self._no_arrays("recv")


def create_world_engine(store: Store, rank: int, size: int, local_rank: int | None,
                        owned: Store | None = None, rendezvous_keys: Sequence[str] = ()) -> StoreEngine:
    """The world's store engine, over the keys of a rendezvous (:mod:`~meshkit.comm.setup.init_methods`);
    ``owned``: the store meshkit made for it, closed with the world; ``rendezvous_keys``: the keys
    that rendezvous left, deleted with the world's own by the last rank to leave (the set-up
    room names them, so that this engine imports nothing of it)."""
    return StoreEngine(_Channel(store, rank, size, local_rank, owned, rendezvous_keys), "w", tuple(range(size)), rank)
