"""``HashStore``: a store in this process's memory, for threads (the ``local`` engine's ranks)."""

from __future__ import annotations

import threading

from .store import KeyTable, Store

__all__ = ["HashStore"]


class HashStore(Store):
    """A thread-safe store held in this process (torch's ``HashStore``): ranks that are threads of one
    process (``meshkit.comm.local``) rendezvous through it; other processes cannot see it."""

    def __init__(self) -> None:
        super().__init__()
        self._table = KeyTable()
        self._changed = threading.Condition()

    @property
    def authenticated(self) -> bool:
        """True: only this process's threads reach it."""
        return True

    def _set(self, key: str, value: bytes) -> None:
        with self._changed:
            self._table.set(key, value)
            self._changed.notify_all()

    def _get(self, key: str, timeout: float) -> bytes | None:
        data = self._table.data
        with self._changed:
            self._changed.wait_for(lambda: key in data, timeout)
            return data.get(key)

    def _multi_get(self, keys: list[str], timeout: float) -> tuple[list[bytes] | None, list[str]]:
        table = self._table
        with self._changed:
            self._changed.wait_for(lambda: not table.absent(keys), timeout)
            missing = table.absent(keys)
            return (None, missing) if missing else ([table.data[k] for k in keys], [])

    def _multi_set(self, pairs: list[tuple[str, bytes]]) -> None:
        with self._changed:
            for key, value in pairs:
                self._table.set(key, value)
            self._changed.notify_all()

    def _append(self, key: str, value: bytes) -> None:
        with self._changed:
            self._table.append(key, value)
            self._changed.notify_all()

    def _push(self, key: str, value: bytes) -> None:
        with self._changed:
            self._table.push(key, value)
            self._changed.notify_all()

    def _pop(self, key: str, timeout: float) -> bytes | None:
        table = self._table
        with self._changed:
            self._changed.wait_for(lambda: table.queue_len(key) > 0, timeout)
            return table.pop(key)

    def _queue_len(self, key: str) -> int:
        with self._changed:
            return self._table.queue_len(key)

    def _list(self, prefix: str) -> list[str]:
        with self._changed:
            return self._table.keys(prefix)

    def _clone(self) -> "HashStore":
        """Another handle on the same table (this process's threads share it anyway)."""
        other = HashStore()
        other._table, other._changed = self._table, self._changed
        return other

    def _add(self, key: str, amount: int) -> int:
        with self._changed:
            total = self._table.add(key, amount)
            self._changed.notify_all()
            return total

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._changed:
            held = self._table.compare_set(key, expected, desired)
            self._changed.notify_all()
            return held

    def _missing(self, keys: list[str]) -> list[str]:
        with self._changed:
            return self._table.missing(keys)

    def _wait(self, keys: list[str], timeout: float) -> list[str]:
        with self._changed:
            self._changed.wait_for(lambda: not self._table.missing(keys), timeout)
            return self._table.missing(keys)

    def _delete(self, key: str) -> bool:
        with self._changed:
            return self._table.delete(key)

    def _count(self, prefix: str) -> int:
        with self._changed:
            return self._table.count(prefix)
