"""The tables through which NumPy calls on DTensors reach their rules (NEP 13 / NEP 18).

``DTensor.__array_ufunc__`` and ``__array_function__`` look the called ufunc or function up
here; the op modules (``ops_*.py``) fill the tables when ``meshkit.tensor`` is imported. Kept
apart from ``dtensor`` so that the op modules can import the DTensor class without a cycle.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["FUNCTIONS", "UFUNCS", "UFUNC_METHODS", "INDEXING", "implements", "implements_ufunc"]

#: NumPy function (``np.sum``, ``np.transpose``...) -> rule taking the call's ``*args, **kwargs``
FUNCTIONS: dict[Callable[..., Any], Callable[..., Any]] = {}
#: ufunc (``np.matmul``) -> rule of its own for ``__call__``, taking ``(*inputs, **kwargs)``
UFUNCS: dict[Any, Callable[..., Any]] = {}
#: ufunc method name (``"__call__"``, ``"reduce"``) -> rule taking ``(ufunc, *inputs, **kwargs)``
UFUNC_METHODS: dict[str, Callable[..., Any]] = {}
#: ``"getitem"`` -> ``(d, key)`` and ``"setitem"`` -> ``(d, key, value)``: the indexing that moves data
#: (:mod:`.selection`), for the keys :mod:`.indexing`'s plan refuses, and every write
INDEXING: dict[str, Callable[..., Any]] = {}


def implements(*funcs: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register a rule for NumPy functions ``funcs``."""
    def register(rule: Callable[..., Any]) -> Callable[..., Any]:
        for f in funcs:
            FUNCTIONS[f] = rule
        return rule
    return register


def implements_ufunc(method: str, ufunc: Any = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register the rule for every ufunc called through ``method`` (or for one ``ufunc``)."""
    def register(rule: Callable[..., Any]) -> Callable[..., Any]:
        if ufunc is not None:
            UFUNCS[ufunc] = rule
        else:
            UFUNC_METHODS[method] = rule
        return rule
    return register
