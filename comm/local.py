"""The in-process engine: N ranks as threads of one process, for tests and dry runs.

:func:`run` starts one thread per rank, each with its own thread-local world, and returns each
rank's result. Every collective is one rendezvous (:meth:`_Hub.exchange`): each rank deposits
a copy of its contribution, waits until all have, then computes its own output from the same
list, in rank order, so results are deterministic and equal NumPy's reference. A rank that
raises wakes all the others (they raise :class:`RankFailedError`), and :func:`run` re-raises
the first rank's exception in the caller: a local job never hangs.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import numpy as np

from .errors import DistValueError, RankFailedError
from .engine import DeadlineExceeded, P2PHandle
from .group import ProcessGroup
from .reduce_op import ReduceOp, combine_into
from .world import World, _thread_state, destroy_process_group, init_process_group, is_initialized

__all__ = ["run", "LocalGroup"]

#: Seconds ``run`` waits for the other ranks to stop after one has failed.
_STOP_GRACE = 10.0


class _RankContext:
    """What a rank thread of a local job knows: its hub, its rank, its world generation."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        self.hub, self.rank, self.generation = hub, rank, 0


class _Slot:
    __slots__ = ("values", "arrived", "readers")

    def __init__(self, n: int) -> None:
        self.values: list[Any] = [None] * n
        self.arrived: set[int] = set()
        self.readers = 0


class _Hub:
    """State shared by the ranks of one local job, guarded by one condition variable."""

    def __init__(self, world_size: int) -> None:
        self.size = world_size
        self.cond = threading.Condition()
        self.slots: dict[tuple, _Slot] = {}
        self.mail: dict[tuple, list[tuple[int, np.ndarray]]] = {}
        self.receivers: dict[tuple, list[_LocalRecv]] = {}
        self.failure: tuple[int, BaseException] | None = None

    def fail(self, rank: int, exc: BaseException) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = (rank, exc)
            self.cond.notify_all()

    def check(self, rank: int) -> None:
        if self.failure is not None and self.failure[0] != rank:
            failed, exc = self.failure
            raise RankFailedError(f"meshkit.comm.local: rank {failed} failed with {type(exc).__name__}: {exc}; "
                                  f"rank {rank} stops")

    def wait_until(self, ready: Callable[[], bool], deadline: float, rank: int) -> bool:
        """Wait (holding ``cond``) until ``ready()``; False at the deadline."""
        while not ready():
            self.check(rank)
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.cond.wait(left)
        return True

    def exchange(self, key: tuple, ranks: tuple[int, ...], index: int, value: Any, deadline: float,
                 rank: int) -> list[Any]:
        """Every member deposits ``value``; each gets the list of all, in group-rank order."""
        n = len(ranks)
        with self.cond:
            slot = self.slots.get(key)
            if slot is None:
                slot = self.slots[key] = _Slot(n)
            slot.values[index] = value
            slot.arrived.add(index)
            if len(slot.arrived) == n:
                self.cond.notify_all()
            elif not self.wait_until(lambda: len(slot.arrived) == n, deadline, rank):
                raise DeadlineExceeded([ranks[i] for i in range(n) if i not in slot.arrived])
            slot.readers += 1
            if slot.readers == n:
                del self.slots[key]
            return slot.values


class _LocalSend(P2PHandle):
    """Sends are buffered (the data is copied at once), so they complete immediately."""

    def test(self) -> bool:
        return True

    def wait(self, deadline: float) -> bool:
        return True


class _LocalRecv(P2PHandle):
    def __init__(self, hub: _Hub, buf: np.ndarray, src: int | None, rank: int) -> None:
        self.hub, self.buf, self.src, self.rank = hub, buf, src, rank
        self.done = False
        self.error: BaseException | None = None

    def deliver(self, source: int, data: np.ndarray) -> None:
        if data.size != self.buf.size:
            self.error = DistValueError(
                f"meshkit.comm: rank {self.rank}: recv buffer has {self.buf.size} elements but the message "
                f"from group rank {source} has {data.size}")
        else:
            self.buf.reshape(-1)[...] = data.reshape(-1)
        self.source, self.done = source, True

    def test(self) -> bool:
        return self.done

    def wait(self, deadline: float) -> bool:
        with self.hub.cond:
            ok = self.hub.wait_until(lambda: self.done, deadline, self.rank)
        if self.error is not None:
            raise self.error
        return ok


class LocalGroup(ProcessGroup):
    """A process group whose ranks are threads of this process."""

    backend = "local"

    def __init__(self, *, hub: _Hub, generation: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._hub = hub
        self._uid = (generation, self.ranks)
        self._generation = generation
        self._ops = 0  # engine steps so far; the same sequence on every member

    def _x(self, value: Any, deadline: float) -> list[Any]:
        self._ops += 1
        return self._hub.exchange((self._uid, self._ops), self.ranks, self.rank, value, deadline, self.global_rank)

    def _reduced(self, op: ReduceOp, parts: list[np.ndarray]) -> np.ndarray:
        out = parts[0].copy()
        for part in parts[1:]:
            combine_into(op, out, part)  # AVG sums here; ProcessGroup divides once
        return out

    def _e_all_reduce(self, buf: np.ndarray, op: ReduceOp, deadline: float) -> None:
        buf[...] = self._reduced(op, self._x(buf.copy(), deadline))

    def _e_reduce(self, buf: np.ndarray, op: ReduceOp, root: int, deadline: float) -> None:
        parts = self._x(buf.copy(), deadline)
        if self.rank == root:
            buf[...] = self._reduced(op, parts)

    def _e_broadcast(self, buf: np.ndarray, root: int, deadline: float) -> None:
        parts = self._x(buf.copy() if self.rank == root else None, deadline)
        if self.rank != root:
            buf[...] = parts[root]

    def _e_all_gather(self, out: np.ndarray, inp: np.ndarray, deadline: float) -> None:
        parts = self._x(inp.copy(), deadline)
        rows = out.reshape(self.size, -1)
        for i, part in enumerate(parts):
            rows[i] = part.reshape(-1)

    def _e_reduce_scatter(self, out: np.ndarray, inp: np.ndarray, op: ReduceOp, deadline: float) -> None:
        parts = self._x(inp.copy(), deadline)
        mine = [p.reshape(self.size, -1)[self.rank] for p in parts]
        out.reshape(-1)[...] = self._reduced(op, mine)

    def _e_gather(self, out: np.ndarray | None, inp: np.ndarray, root: int, deadline: float) -> None:
        parts = self._x(inp.copy(), deadline)
        if out is not None:
            out[...] = np.stack(parts)

    def _e_scatter(self, out: np.ndarray, inp: np.ndarray | None, root: int, deadline: float) -> None:
        parts = self._x(inp.copy() if inp is not None else None, deadline)
        out.reshape(-1)[...] = parts[root].reshape(self.size, -1)[self.rank]

    def _e_all_to_all(self, out: np.ndarray, recv_counts: list[int], inp: np.ndarray, send_counts: list[int],
                      deadline: float) -> None:
        parts = self._x((inp.reshape(-1).copy(), send_counts), deadline)
        flat = out.reshape(-1)
        start = 0
        for j, (data, counts) in enumerate(parts):
            if counts[self.rank] != recv_counts[j]:
                raise DistValueError(
                    f"meshkit.comm: rank {self.global_rank}: all_to_all: rank {self.ranks[j]} sends "
                    f"{counts[self.rank]} elements but this rank expects {recv_counts[j]} from it")
            offset = sum(counts[:self.rank])
            flat[start:start + recv_counts[j]] = data[offset:offset + recv_counts[j]]
            start += recv_counts[j]

    def _e_barrier(self, deadline: float) -> None:
        self._x(None, deadline)

    def _e_exchange(self, payload: Any, seq: int, deadline: float) -> list[Any]:
        return self._x(payload, deadline)

    def _e_split(self, color: int | None, ranks: tuple[int, ...], name: str, deadline: float) -> LocalGroup | None:
        parts = self._x((color, self.global_rank), deadline)
        if color is None:
            return None
        members = tuple(sorted(g for c, g in parts if c == color))
        if members != ranks:
            raise DistValueError(f"meshkit.comm: rank {self.global_rank}: split: ranks disagree on group "
                                 f"{name}: expected {list(ranks)}, the split gave {list(members)}")
        return LocalGroup(hub=self._hub, generation=self._generation, world=self.world, ranks=members,
                          group_rank=members.index(self.global_rank), name=name, timeout=self.world.timeout)

    def _e_isend(self, buf: np.ndarray, dst: int, tag: int) -> P2PHandle:
        key = (self._uid, dst, tag)
        hub = self._hub
        with hub.cond:
            waiting = hub.receivers.get(key, [])
            for i, receiver in enumerate(waiting):
                if receiver.src is None or receiver.src == self.rank:
                    del waiting[i]
                    receiver.deliver(self.rank, buf)
                    hub.cond.notify_all()
                    break
            else:
                hub.mail.setdefault(key, []).append((self.rank, buf.copy()))
        return _LocalSend()

    def _e_irecv(self, buf: np.ndarray, src: int | None, tag: int) -> P2PHandle:
        key = (self._uid, self.rank, tag)
        hub = self._hub
        receiver = _LocalRecv(hub, buf, src, self.global_rank)
        with hub.cond:
            queued = hub.mail.get(key, [])
            for i, (source, data) in enumerate(queued):
                if src is None or src == source:
                    del queued[i]
                    receiver.deliver(source, data)
                    break
            else:
                hub.receivers.setdefault(key, []).append(receiver)
        return receiver


def create_world_group(world: World, ctx: _RankContext) -> LocalGroup:
    """The default group of a rank of a local job (called by ``init_process_group``)."""
    ctx.generation += 1
    ranks = tuple(range(ctx.hub.size))
    return LocalGroup(hub=ctx.hub, generation=ctx.generation, world=world, ranks=ranks, group_rank=ctx.rank,
                      name="world", timeout=world.timeout)


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
    hub = _Hub(world_size)
    results: list[Any] = [None] * world_size
    failures: list[tuple[float, int, BaseException]] = []

    def rank_main(rank: int) -> None:
        _thread_state.local = _RankContext(hub, rank)
        _thread_state.world = None
        try:
            if init:
                init_process_group("local", timeout=timeout)
            results[rank] = fn(*args, **kwargs)
        except BaseException as exc:  # reported to the caller, and wakes the other ranks
            failures.append((time.monotonic(), rank, exc))
            hub.fail(rank, exc)
        finally:
            if is_initialized():
                destroy_process_group()
            _thread_state.local = None

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
