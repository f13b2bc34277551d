"""Mesh errors: every message reads ``meshkit.mesh: rank R: DeviceMesh.op: what, value, what is valid``.

`layout` is pure and raises plain ``ValueError``/``TypeError``/``KeyError``/``IndexError`` with
no rank; `convert` turns them into meshkit's errors with the prefix where a mesh function calls it.
Every class here is a ``ValueError`` or ``TypeError``, as every bad argument in meshkit is;
``KeyError`` for an unknown dim name and ``IndexError`` for a dim index out of range stay what
torch's DeviceMesh raises too.
"""

from __future__ import annotations

from ..comm import CollectiveMismatchError, DistError, DistTypeError, DistValueError, is_initialized
from ..comm._seams import current_world

__all__ = ["MeshKeyError", "MeshIndexError", "MeshMismatchError", "prefix", "convert"]


class MeshKeyError(DistValueError, KeyError):
    """A mesh dim name the mesh does not have (a ``KeyError`` as in torch, and a ``ValueError``)."""

    __str__ = BaseException.__str__  # KeyError's own str() would quote the message


class MeshIndexError(DistValueError, IndexError):
    """A mesh dim index out of range (an ``IndexError``, and a ``ValueError``)."""


class MeshMismatchError(CollectiveMismatchError, DistValueError):
    """Ranks passed different arguments to a collective mesh construction.

    ``calls`` holds what each global rank passed, ``{rank: description}``.
    """


def prefix(op: str | None) -> str:
    """``"meshkit.mesh: rank R: op: "`` (no rank before ``init_process_group``; no op for None)."""
    rank = f"rank {current_world().rank}: " if is_initialized() else ""
    return f"meshkit.mesh: {rank}{op}: " if op else f"meshkit.mesh: {rank}"


def _text(exc: BaseException) -> str:
    return str(exc.args[0]) if exc.args else str(exc)


def convert(op: str, exc: Exception, context: str = "") -> DistError:
    """``exc`` (a plain error from `layout` or a check) as a meshkit error prefixed for ``op``.

    ``context`` goes between the prefix and the message, e.g. ``"dims ('dp', 'pp'): "``.
    """
    message = prefix(op) + context + _text(exc)
    if isinstance(exc, KeyError):
        return MeshKeyError(message)
    if isinstance(exc, IndexError):
        return MeshIndexError(message)
    if isinstance(exc, TypeError):
        return DistTypeError(message)
    return DistValueError(message)
