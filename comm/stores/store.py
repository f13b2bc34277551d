"""The key-value store API every meshkit store shares (torch.distributed's ``Store``) and the one
semantics of its operations over a dict (:class:`KeyTable`).

HashStore, FileStore and TCPStore's server all apply their operations through ``KeyTable``, and
every public method's argument checks and timeout errors live in :class:`Store`: one
implementation, so the four stores cannot answer differently (torch's do: issue 26).
"""

from __future__ import annotations

import math
import numbers
import os
import re
import time
from datetime import timedelta
from typing import Iterable

from ..errors import DistStoreError, DistTypeError, DistValueError
from .wire import MAX_VALUE_BYTES

__all__ = ["Store", "KeyTable", "NotAnInteger", "DEFAULT_TIMEOUT", "as_seconds"]

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


class KeyTable:
    """The user's keys and their values, and what each operation does to them (torch's HashStore
    rules). Not locked: its owner (a store, the TCP server's loop) serializes calls."""

    def __init__(self, data: dict[str, bytes] | None = None) -> None:
        self.data: dict[str, bytes] = {} if data is None else data

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
        return [k for k in keys if k not in self.data]

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

    A subclass implements the primitives ``_set``, ``_get``, ``_add``, ``_compare_set``, ``_missing``,
    ``_wait``, ``_delete`` and ``_count`` on checked arguments.
    """

    def __init__(self, timeout: timedelta | float = DEFAULT_TIMEOUT) -> None:
        self._timeout_s = as_seconds(timeout)
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
        """The timeout of later ``get``/``wait`` calls (and of TCPStore's connects and replies)."""
        self._timeout_s = as_seconds(timeout)

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

    def _timed_out(self, op: str, missing: list[str], start: float, timeout: float) -> DistStoreError:
        waited = time.monotonic() - start
        shown = ", ".join(repr(k) for k in missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        return DistStoreError(
            f"{type(self).__name__}{self._where()}: {op} timed out after waiting {waited:.3f} s for key(s) {shown} "
            f"(timeout {timeout:g} s; pid {os.getpid()}): no one set them in time; set_timeout() or wait(timeout=) waits longer",
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
