"""The training-loop protocol every data-parallel strategy implements (issue 25.1).

One loop trains DDP, ZeRO-1/2, FSDP and HSDP alike::

    model = data_parallel(params, mesh["dp"], "fsdp", optimizer=AdamW(lr=1e-3),
                          units=[["w0", "b0"], ["w1", "b1"]])
    for x, y in batches:
        model.zero_grad()
        for i in range(len(model.units)):            # forward, unit by unit
            with model.unshard(i) as p:              # {name: full parameter} while it runs
                ...
        for i in reversed(range(len(model.units))):  # backward, last unit first
            with model.unshard(i) as p:
                ...
            model.mark_grad_ready("w1", dw1)         # final: reduction starts when its bucket/unit is complete
        model.step()                                 # finish the sync, run the optimizer

:func:`~meshkit.parallel.data_parallelism.factory.data_parallel` builds any of them. ``unshard(i)`` yields the
parameters themselves under DDP and ZeRO (nothing is gathered) and gathers unit ``i`` under FSDP;
``prefetch(i)`` starts that gather early (a no-op where nothing is gathered). Under
``with model.no_sync():`` gradients add up locally for gradient accumulation; the next
synchronized pass reduces the sum. ``full_state_dict()`` is ``{"params": ..., "optim": ...}``
gathered to full size as NumPy arrays on every rank, ``memory_report()`` the bytes held.

:class:`ReplicatedUnits` gives DDP and ZeRO the unit half of the protocol; :func:`deprecated`
is how an old spelling says which new one replaces it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Sequence

from ...comm import DistValueError

__all__ = ["ReplicatedUnits", "check_units", "deprecated"]


def deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated in favour of ``new`` (a DeprecationWarning at the caller's
    line: Python's default filters show it once per call site)."""
    warnings.warn(f"meshkit.parallel: {old} is deprecated; {new}", DeprecationWarning, stacklevel=stacklevel)


def check_units(params: Mapping[str, Any], units: Sequence[Sequence[str]] | None
                ) -> tuple[list[list[str]] | None, str | None]:
    """The units as lists (default: one unit of every parameter), and what is wrong with them (or None)."""
    if units is None:
        return [list(params)], None
    try:
        units = [list(u) for u in units]
    except TypeError:
        return None, f"units must be a list of lists of parameter names, got {units!r}"
    seen = [n for u in units for n in u]
    unknown = [n for n in seen if n not in params]
    twice = sorted({n for n in seen if seen.count(n) > 1})
    missing = [n for n in params if n not in seen]
    if unknown or twice or missing or any(not u for u in units):
        return None, (f"units must put every parameter in exactly one non-empty unit; unknown names {unknown}, "
                      f"in several units {twice}, in none {missing}; valid names are {list(params)}")
    return units, None


class ReplicatedUnits:
    """``units``, ``unshard`` and ``prefetch`` of a strategy whose every rank holds the full
    parameters (DDP, ZeRO): ``unshard(i)`` yields unit ``i``'s entries of ``params``, the
    parameters themselves, without communication."""

    units: list[list[str]]
    params: Mapping[str, Any]
    _where: Callable[[str], str]  # the strategy's error prefix (GradientReducer's)

    def _unit(self, unit: Any, op: str) -> int:
        if isinstance(unit, bool) or not isinstance(unit, int) or not 0 <= unit < len(self.units):
            raise DistValueError(f"{self._where(op)}: unknown unit {unit!r}; valid units are 0..{len(self.units) - 1}")
        return unit

    def prefetch(self, unit: int) -> None:
        """Nothing to gather: every rank holds the full parameters (checks ``unit``)."""
        self._unit(unit, "prefetch")

    @contextlib.contextmanager
    def unshard(self, unit: int) -> Iterator[dict[str, Any]]:
        """Yield ``{name: parameter}`` of ``unit``: the parameters themselves (no communication)."""
        u = self._unit(unit, "unshard")
        params = self.params
        yield {name: params[name] for name in self.units[u]}
