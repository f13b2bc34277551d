"""``PrefixStore``: a namespace (``prefix/``) inside another store."""

from __future__ import annotations

from ..errors import DistTypeError
from .store import Store, check_key

__all__ = ["PrefixStore"]


class PrefixStore(Store):
    """The keys of ``store`` under ``prefix + "/"`` (torch's ``PrefixStore``): ``set("k")`` sets
    ``"prefix/k"`` in ``store``.

    Unlike torch's (which asks the underlying store), ``num_keys`` counts this prefix's keys only,
    so a group's store reports that group's keys whatever else shares the server (and ``list_keys``
    lists them, without the prefix). The timeout is the underlying store's when made, then its own
    (``set_timeout`` changes only this view); ``close`` closes the view, not the underlying store
    (but a clone's, which is its own).
    """

    def __init__(self, prefix: str, store: Store) -> None:
        check_key(prefix, "prefix")
        if not isinstance(store, Store):
            raise DistTypeError(f"PrefixStore(prefix, store): store must be a meshkit Store, got "
                                f"{type(store).__name__} {store!r}")
        super().__init__(store.timeout)
        self._prefix = prefix + "/"
        self._store = store
        self._owned = False  # a clone's underlying store is its own (clone())

    @property
    def underlying_store(self) -> Store:
        """The store the keys live in."""
        return self._store

    @property
    def authenticated(self) -> bool:
        """The underlying store's."""
        return self._store.authenticated

    def _where(self) -> str:
        return f" (prefix {self._prefix!r} of {type(self._store).__name__}{self._store._where()})"

    def _check_open(self, op: str) -> None:
        super()._check_open(op)
        self._store._check_open(op)

    def _set(self, key: str, value: bytes) -> None:
        self._store._set(self._prefix + key, value)

    def _get(self, key: str, timeout: float) -> bytes | None:
        return self._store._get(self._prefix + key, timeout)

    def _add(self, key: str, amount: int) -> int:
        return self._store._add(self._prefix + key, amount)

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._store._compare_set(self._prefix + key, expected, desired)

    def _strip(self, keys: list[str]) -> list[str]:
        return [k[len(self._prefix):] for k in keys]

    def _missing(self, keys: list[str]) -> list[str]:
        return self._strip(self._store._missing([self._prefix + k for k in keys]))

    def _wait(self, keys: list[str], timeout: float) -> list[str]:
        return self._strip(self._store._wait([self._prefix + k for k in keys], timeout))

    def _delete(self, key: str) -> bool:
        return self._store._delete(self._prefix + key)

    def _count(self, prefix: str) -> int:
        return self._store._count(self._prefix + prefix)

    def _multi_get(self, keys: list[str], timeout: float) -> tuple[list[bytes] | None, list[str]]:
        values, missing = self._store._multi_get([self._prefix + k for k in keys], timeout)
        return values, self._strip(missing)

    def _multi_set(self, pairs: list[tuple[str, bytes]]) -> None:
        self._store._multi_set([(self._prefix + k, v) for k, v in pairs])

    def _append(self, key: str, value: bytes) -> None:
        self._store._append(self._prefix + key, value)

    def _push(self, key: str, value: bytes) -> None:
        self._store._push(self._prefix + key, value)

    def _pop(self, key: str, timeout: float) -> bytes | None:
        return self._store._pop(self._prefix + key, timeout)

    def _queue_len(self, key: str) -> int:
        return self._store._queue_len(self._prefix + key)

    def _list(self, prefix: str) -> list[str]:
        return self._strip(self._store._list(self._prefix + prefix))

    def _clone(self) -> "PrefixStore":
        """A view of a clone of the underlying store, which it owns: closing the clone closes it."""
        other = PrefixStore(self._prefix[:-1], self._store.clone())
        other._owned = True
        return other

    def close(self) -> None:
        """Close the view (and the underlying store where the view is a clone's, which owns it)."""
        super().close()
        if self._owned:
            self._store.close()
