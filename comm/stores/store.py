"""The key-value store API every meshkit store shares (torch.distributed's ``Store``) and the one
semantics of its operations over a dict (:class:`KeyTable`).

HashStore, FileStore and TCPStore's server all apply their operations through ``KeyTable``, and
every public method's argument checks and timeout errors live in :class:`Store`: one
implementation, so the four stores cannot answer differently (torch's do).
"""

from __future__ import annotations

import collections
import math
import numbers
import os
import re
import time
from datetime import timedelta
from typing import Iterable

from ..errors import DistStoreError, DistTypeError, DistValueError
from .wire import MAX_VALUE_BYTES

__all__ = ["Store", "KeyTable", "NotAnInteger", "ValueTooLong", "QueueEmptyError", "DEFAULT_TIMEOUT", "as_seconds",
           "store_timeout"]

#: torch's default store timeout (``kDefaultTimeout``, c10d/Store.hpp): 300 s.
DEFAULT_TIMEOUT = timedelta(seconds=300)

_INTEGER = re.compile(rb"-?[0-9]+\Z")


def as_seconds(timeout: timedelta | float | int, what: str = "timeout") -> float:
    """``timeout`` (a ``timedelta``, or seconds as a number) in seconds; finite and not negative."""
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise DistTypeError(f"{what} must be a datetime.timedelta (or seconds as a number), got "
                            f"{type(timeout).__name__} {timeout!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise DistValueError(f"{what} must be finite and >= 0 seconds, got {timeout!r}")
    return seconds


def store_timeout(timeout: timedelta | float, what: str = "timeout") -> float:
    """A store's own timeout (its constructor's, ``set_timeout``'s) in seconds: positive.

    torch reads 0 as "wait without limit" (``kNoTimeout``); meshkit's stores bound every wait
    (nothing hangs), so 0 is refused, naming what to give instead, rather than taken to mean
    "fail at once" (meshkit once did) or "forever" (torch).
    """
    seconds = as_seconds(timeout, what)
    if seconds == 0:
        raise DistValueError(f"{what} must be positive, got {timeout!r}: torch reads 0 as 'wait without limit', and "
                             "meshkit's stores bound every wait; give the longest wait you accept (e.g. "
                             "timedelta(hours=1))")
    return seconds


def check_key(key: object, what: str = "key") -> str:
    if not isinstance(key, str):
        raise DistTypeError(f"{what} must be a str, got {type(key).__name__} {key!r}")
    return key


def check_keys(keys: object) -> list[str]:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise DistTypeError(f"keys must be a list of str, got {type(keys).__name__} {keys!r}")
    return [check_key(k, "each of keys") for k in keys]


def as_value(value: object, what: str = "value") -> bytes:
    """``value`` as the bytes the store holds: ``str`` is UTF-8 encoded, bytes-like kept."""
    if isinstance(value, str):
        data = value.encode()
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
    else:
        raise DistTypeError(f"{what} must be str or bytes, got {type(value).__name__} {value!r}")
    if len(data) > MAX_VALUE_BYTES:
        raise DistValueError(f"{what} of {len(data)} bytes is over the stores' limit of {MAX_VALUE_BYTES} bytes "
                             f"(meshkit.comm.stores.wire.MAX_VALUE_BYTES): a store carries rendezvous data, "
                             f"send arrays through a collective")
    return data


class NotAnInteger(ValueError):
    """``add`` met a value that is not a decimal integer; :meth:`Store.add` names the user's key."""

    def __init__(self, held: bytes) -> None:
        super().__init__(held)
        self.held = held


class ValueTooLong(ValueError):
    """``append`` would make a value longer than :data:`~.wire.MAX_VALUE_BYTES`; :meth:`Store.append`
    names the user's key."""

    def __init__(self, held: int) -> None:
        super().__init__(held)
        self.held = held


class QueueEmptyError(DistStoreError):
    """``queue_pop(key, block=False)`` of an empty queue (torch's ``dist.QueueEmptyError``, also a
    ``DistStoreError``)."""


class KeyTable:
    """The user's keys and their values, the queues, and what each operation does to them (torch's
    HashStore rules). Not locked: its owner (a store, the TCP server's loop) serializes calls.

    A queue (``queue_push``/``queue_pop``) lives beside the keys, under its own name: ``get``,
    ``num_keys`` and ``list_keys`` see keys only, while ``check`` and ``wait`` see a non-empty
    queue as set, as torch's stores do (a consumer may ``wait`` for a queue, then pop it).
    """

    def __init__(self, data: dict[str, bytes] | None = None,
                 queues: dict[str, collections.deque[bytes]] | None = None) -> None:
        self.data: dict[str, bytes] = {} if data is None else data
        self.queues: dict[str, collections.deque[bytes]] = {} if queues is None else queues

    def set(self, key: str, value: bytes) -> None:
        self.data[key] = value

    def add(self, key: str, amount: int) -> int:
        """The counter ``key`` plus ``amount`` (a missing key counts from 0); ValueError on a non-integer."""
        held = self.data.get(key)
        if held is not None and not _INTEGER.match(held):
            raise NotAnInteger(held[:40])
        total = (int(held) if held is not None else 0) + amount
        self.data[key] = str(total).encode()
        return total

    def sets(self, key: str, expected: bytes) -> bool:
        """Whether ``compare_set(key, expected, ...)`` sets: torch's rule, ``key`` holds ``expected``
        or is missing and ``expected`` is empty."""
        held = self.data.get(key)
        return (held is None and not expected) or held == expected

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Set ``desired`` where :meth:`sets`; the reply is the value now held, or ``expected`` for a
        missing key left unset."""
        if self.sets(key, expected):
            self.data[key] = desired
            return desired
        held = self.data.get(key)
        return expected if held is None else held

    def missing(self, keys: Iterable[str]) -> list[str]:
        """The keys neither set nor a non-empty queue (what ``check`` and ``wait`` wait for)."""
        return [k for k in keys if k not in self.data and k not in self.queues]

    def absent(self, keys: Iterable[str]) -> list[str]:
        """The keys not set (what ``get`` and ``multi_get`` wait for)."""
        return [k for k in keys if k not in self.data]

    def append(self, key: str, value: bytes) -> None:
        """``value`` appended to ``key``'s (a missing key is created); ValueTooLong past the stores' limit."""
        held = self.data.get(key, b"")
        if len(held) + len(value) > MAX_VALUE_BYTES:
            raise ValueTooLong(len(held))
        self.data[key] = held + value

    def push(self, key: str, value: bytes) -> None:
        self.queues.setdefault(key, collections.deque()).append(value)

    def pop(self, key: str) -> bytes | None:
        """The oldest value of queue ``key``, removed; None if it is empty (an empty queue is no entry)."""
        queue = self.queues.get(key)
        if not queue:
            return None
        value = queue.popleft()
        if not queue:
            del self.queues[key]
        return value

    def queue_len(self, key: str) -> int:
        queue = self.queues.get(key)
        return len(queue) if queue else 0

    def keys(self, prefix: str = "") -> list[str]:
        """The keys starting with ``prefix``, sorted."""
        return sorted(k for k in self.data if k.startswith(prefix))

    def delete(self, key: str) -> bool:
        return self.data.pop(key, None) is not None

    def count(self, prefix: str = "") -> int:
        if not prefix:
            return len(self.data)
        return sum(1 for k in self.data if k.startswith(prefix))


class Store:
    """A key-value store shared by the processes (or threads) of a job, torch.distributed's ``Store``.

    Every method behaves the same on every meshkit store (:class:`HashStore`, :class:`FileStore`,
    :class:`TCPStore`, :class:`PrefixStore`): ``get`` and ``wait`` block up to the timeout, then raise
    :class:`DistStoreError` naming the missing keys and the time waited; ``add`` on a value that is not
    a decimal integer raises ``ValueError``; ``num_keys`` counts the user's keys only; a second
    ``delete_key`` of one key returns ``False``. Methods are safe to call from several threads.

    torch 2.13's later methods too: ``multi_get``, ``multi_set``, ``append``, the queues
    (``queue_push``, ``queue_pop``, ``queue_len``), ``list_keys``, ``clone`` and ``barrier``.

    A subclass implements the primitives ``_set``, ``_get``, ``_add``, ``_compare_set``, ``_missing``,
    ``_wait``, ``_delete``, ``_count``, ``_multi_get``, ``_multi_set``, ``_append``, ``_push``,
    ``_pop``, ``_queue_len``, ``_list`` and ``_clone`` on checked arguments.
    """

    def __init__(self, timeout: timedelta | float = DEFAULT_TIMEOUT) -> None:
        self._timeout_s = store_timeout(timeout)
        self._closed = False

    # ------------------------------------------------------------------ public API (torch's names)
    def set(self, key: str, value: str | bytes) -> None:
        """Hold ``value`` under ``key`` (replacing what was there); wakes whoever waits for ``key``."""
        key, value = check_key(key), as_value(value)
        self._check_open("set")
        self._set(key, value)

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the store's timeout for it to be set."""
        key = check_key(key)
        self._check_open("get")
        start, timeout = time.monotonic(), self._timeout_s
        value = self._get(key, timeout)
        if value is None:
            raise self._timed_out("get", [key], start, timeout)
        return value

    def try_get(self, key: str, timeout: timedelta | float) -> bytes | None:
        """The value of ``key``, waiting up to ``timeout``; None if no one set it by then (where
        :meth:`get` raises): one round trip for a waiter that does something else between tries."""
        key, seconds = check_key(key), as_seconds(timeout)
        self._check_open("try_get")
        return self._get(key, seconds)

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer counter ``key`` (created at ``amount``) and return the new value."""
        key = check_key(key)
        if isinstance(amount, bool) or not isinstance(amount, numbers.Integral):
            raise DistTypeError(f"add({key!r}, amount): amount must be an int, got {type(amount).__name__} {amount!r}")
        self._check_open("add")
        try:
            return self._add(key, int(amount))
        except NotAnInteger as exc:
            raise DistValueError(f"{type(self).__name__}.add({key!r}, {amount}): key {key!r} holds {exc.held!r}, not "
                                 f"an integer; add counts only on a key that add created or that holds a decimal "
                                 f"integer") from None

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value`` (or is missing and
        ``expected_value`` is empty); return the value now held (``expected_value`` for a missing
        key left unset, as torch does)."""
        key = check_key(key)
        expected, desired = as_value(expected_value, "expected_value"), as_value(desired_value, "desired_value")
        self._check_open("compare_set")
        return self._compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` is set, now (does not wait)."""
        keys = check_keys(keys)
        self._check_open("check")
        return not self._missing(keys) if keys else True

    def wait(self, keys: list[str], timeout: timedelta | float | None = None) -> None:
        """Wait until every one of ``keys`` is set, up to ``timeout`` (default: the store's)."""
        keys = check_keys(keys)
        seconds = self._timeout_s if timeout is None else as_seconds(timeout)
        self._check_open("wait")
        if not keys:
            return
        start = time.monotonic()
        missing = self._wait(keys, seconds)
        if missing:
            raise self._timed_out("wait", missing, start, seconds)

    def delete_key(self, key: str) -> bool:
        """Remove ``key``; ``True`` if it was there, ``False`` if not (a second delete included)."""
        key = check_key(key)
        self._check_open("delete_key")
        return self._delete(key)

    def num_keys(self) -> int:
        """How many keys the user set (internal bookkeeping not counted)."""
        self._check_open("num_keys")
        return self._count("")

    def set_timeout(self, timeout: timedelta | float) -> None:
        """The timeout of later ``get``/``wait`` calls (and of TCPStore's connects and replies).

        Raises:
            DistValueError: ``timeout`` is 0 (torch's "wait without limit": meshkit bounds every
                wait), negative or not finite.
        """
        self._timeout_s = store_timeout(timeout)

    # ------------------------------------------------------------------ torch 2.13's later methods
    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys``, in order, waiting up to the store's timeout until all are set
        (read together: no key changes between the first value and the last)."""
        keys = check_keys(keys)
        self._check_open("multi_get")
        if not keys:
            return []
        start, timeout = time.monotonic(), self._timeout_s
        values, missing = self._multi_get(keys, timeout)
        if values is None:
            raise self._timed_out("multi_get", missing, start, timeout)
        return values

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """Set each of ``keys`` to the value at its index in ``values``, all at once (a waiter sees
        all of them or none; of a key given twice, the last value)."""
        keys = check_keys(keys)
        if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
            raise DistTypeError(f"multi_set(keys, values): values must be a list of str or bytes, got "
                                f"{type(values).__name__} {values!r}")
        data = [as_value(v, "each of values") for v in values]
        if len(data) != len(keys):
            raise DistValueError(f"multi_set(keys, values): {len(keys)} keys but {len(data)} values; give one value "
                                 "per key")
        self._check_open("multi_set")
        if keys:
            self._multi_set(list(zip(keys, data)))

    def append(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to ``key``'s value (a missing key is created holding ``value``)."""
        key, data = check_key(key), as_value(value)
        self._check_open("append")
        try:
            self._append(key, data)
        except ValueTooLong as exc:
            raise DistValueError(f"{type(self).__name__}.append({key!r}, ...): {key!r} holds {exc.held} bytes, and "
                                 f"{len(data)} more would pass the stores' limit of {MAX_VALUE_BYTES} bytes a value "
                                 "(meshkit.comm.stores.wire.MAX_VALUE_BYTES)") from None

    def queue_push(self, key: str, value: str | bytes) -> None:
        """Push ``value`` onto the queue ``key`` (a queue lives beside the keys: see :class:`KeyTable`);
        wakes whoever waits to pop it, or waits for it with ``wait``."""
        key, data = check_key(key), as_value(value)
        self._check_open("queue_push")
        self._push(key, data)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """The oldest value of the queue ``key``, removed; with ``block`` (the default) waiting up to
        the store's timeout for one to be pushed.

        Raises:
            QueueEmptyError: ``block`` is False and the queue is empty (torch's ``QueueEmptyError``).
            DistStoreError: nothing was pushed within the timeout.
        """
        key = check_key(key)
        if not isinstance(block, bool):
            raise DistTypeError(f"queue_pop({key!r}, block): block must be True or False, got {block!r}")
        self._check_open("queue_pop")
        start, timeout = time.monotonic(), self._timeout_s if block else 0.0
        value = self._pop(key, timeout)
        if value is None:
            if not block:
                raise QueueEmptyError(f"{type(self).__name__}{self._where()}: queue_pop({key!r}, block=False): the "
                                      "queue is empty", keys=[key], waited=0.0)
            raise self._timed_out("queue_pop", [key], start, timeout, "no one pushed onto it in time")
        return value

    def queue_len(self, key: str) -> int:
        """How many values the queue ``key`` holds now (0 for one never pushed to)."""
        key = check_key(key)
        self._check_open("queue_len")
        return self._queue_len(key)

    def list_keys(self) -> list[str]:
        """The user's keys, sorted (those ``num_keys`` counts: queues are not keys)."""
        self._check_open("list_keys")
        return self._list("")

    def clone(self) -> "Store":
        """Another handle on the same store, for another thread (torch's ``clone``): a TCPStore's is
        a client of its own (connections of its own; never the server), a FileStore's opens the
        file again, a PrefixStore's views a clone of its store, a HashStore's shares the table.
        It has this store's timeout; closing either leaves the other open."""
        self._check_open("clone")
        other = self._clone()
        other._timeout_s = self._timeout_s
        return other

    def barrier(self, key: str, world_size: int, timeout: timedelta | float | None = None) -> None:
        """Wait until ``world_size`` callers have called ``barrier(key, world_size)``, up to
        ``timeout`` (default: the store's); the same key serves again for the next round.

        Each caller counts itself in with ``add("<key>/arrived", 1)``; the last of a round sets
        ``"<key>/done/<round>"`` (and removes the previous round's), for which the others wait.
        After a timeout the key's count is off: use another key.

        Raises:
            DistStoreError: the others did not all arrive within the timeout (naming how many did).
        """
        key = check_key(key)
        if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
            raise DistValueError(f"barrier({key!r}, world_size): world_size must be an int >= 1, got {world_size!r}")
        seconds = self._timeout_s if timeout is None else as_seconds(timeout, "barrier(timeout)")
        self._check_open("barrier")
        start = time.monotonic()
        arrived = self._add(f"{key}/arrived", 1)
        round_, position = divmod(arrived - 1, int(world_size))
        done = f"{key}/done/{round_}"
        if position == world_size - 1:  # the last of this round: every caller of the last round has left it
            self._set(done, b"1")
            if round_:
                self._delete(f"{key}/done/{round_ - 1}")
            return
        if self._wait([done], seconds):
            here = self._add(f"{key}/arrived", 0) - round_ * int(world_size)
            waited = time.monotonic() - start
            raise DistStoreError(f"{type(self).__name__}{self._where()}: barrier({key!r}, world_size={world_size}) "
                                 f"timed out after waiting {waited:.3f} s (timeout {seconds:g} s; pid {os.getpid()}): "
                                 f"{min(here, int(world_size))} of {world_size} callers arrived; the others never "
                                 "called it (the key's count is now off: use another key)", keys=[done], waited=waited)

    def has_extended_api(self) -> bool:
        """True: every meshkit store has the methods above (torch's ``has_extended_api``)."""
        return True

    @property
    def timeout(self) -> timedelta:
        """The store's timeout."""
        return timedelta(seconds=self._timeout_s)

    @property
    def authenticated(self) -> bool:
        """Whether only the job (its ranks and its user) can read or write this store's keys: a
        HashStore (one process), a FileStore (a private file of this job), a TCPStore with the job's
        secret. Object collectives unpickle what came through a store only where this holds."""
        return False

    def close(self) -> None:
        """Release what the store holds (connections, the server, a FileStore's use of its file)."""
        self._closed = True

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ for subclasses
    def _where(self) -> str:
        """Where the store is, for messages (``" at host:port"``)."""
        return ""

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise DistStoreError(f"{type(self).__name__}{self._where()}: {op} on a closed store")

    def _timed_out(self, op: str, missing: list[str], start: float, timeout: float,
                   why: str = "no one set them in time") -> DistStoreError:
        waited = time.monotonic() - start
        shown = ", ".join(repr(k) for k in missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        return DistStoreError(
            f"{type(self).__name__}{self._where()}: {op} timed out after waiting {waited:.3f} s for key(s) {shown} "
            f"(timeout {timeout:g} s; pid {os.getpid()}): {why}; set_timeout() or wait(timeout=) waits longer",
            keys=missing, waited=waited)

    def _set(self, key: str, value: bytes) -> None:
        raise NotImplementedError

    def _get(self, key: str, timeout: float) -> bytes | None:
        """The value, or ``None`` if it was not set within ``timeout`` seconds."""
        raise NotImplementedError

    def _add(self, key: str, amount: int) -> int:
        raise NotImplementedError

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        raise NotImplementedError

    def _missing(self, keys: list[str]) -> list[str]:
        raise NotImplementedError

    def _wait(self, keys: list[str], timeout: float) -> list[str]:
        """The keys still missing after waiting up to ``timeout`` seconds (empty: all set)."""
        raise NotImplementedError

    def _delete(self, key: str) -> bool:
        raise NotImplementedError

    def _count(self, prefix: str) -> int:
        raise NotImplementedError

    def _multi_get(self, keys: list[str], timeout: float) -> tuple[list[bytes] | None, list[str]]:
        """``(values, [])`` once all of ``keys`` are set within ``timeout``, else ``(None, missing)``."""
        raise NotImplementedError

    def _multi_set(self, pairs: list[tuple[str, bytes]]) -> None:
        raise NotImplementedError

    def _append(self, key: str, value: bytes) -> None:
        """ValueTooLong past the stores' limit (nothing appended)."""
        raise NotImplementedError

    def _push(self, key: str, value: bytes) -> None:
        raise NotImplementedError

    def _pop(self, key: str, timeout: float) -> bytes | None:
        """The oldest value of queue ``key``, waiting up to ``timeout``; None if there was none."""
        raise NotImplementedError

    def _queue_len(self, key: str) -> int:
        raise NotImplementedError

    def _list(self, prefix: str) -> list[str]:
        """The keys starting with ``prefix``, sorted."""
        raise NotImplementedError

    def _clone(self) -> "Store":
        raise NotImplementedError
