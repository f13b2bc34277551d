"""The debug level's state below comm's rooms: the level the next ``init_process_group`` uses,
and what a rank sends when the level switches.

:mod:`~meshkit.comm.levels` (``set_debug_level``, user-facing, above the rooms) writes the request
and makes the switch; set-up (``init_process_group``) reads the request, and the control channel
(:mod:`~meshkit.comm.control`) carries the switch. Both sit below the user-facing modules, so what
they share of the level lives here, in a leaf that imports only other leaves.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import env
from .debug import DebugLevel

__all__ = ["Switch", "requested_level", "request_level"]


@dataclasses.dataclass(frozen=True)
class Switch:
    """What each rank sends in a level switch (a class, not a tuple: an exchange of detail mode's
    fingerprints carries tuples, and a rank in one must not take this for one)."""

    level: DebugLevel
    counts: tuple[tuple[tuple[int, ...], int], ...]


# Before init_process_group: the level the next one uses (per thread inside local.run).
_process_request: DebugLevel | None = None


def requested_level(context: Any) -> DebugLevel:
    """The level ``init_process_group`` gives the world: ``set_debug_level``'s, else ``MESHKIT_DEBUG``.

    Args:
        context: the in-process job this thread is a rank of (``local_context()``), or None: a
            request is kept on it (one per rank thread), else for the process.
    """
    requested = getattr(context, "debug_level", None) if context is not None else _process_request
    return env.debug_level() if requested is None else requested


def request_level(context: Any, level: DebugLevel) -> None:
    """Keep ``level`` for the next ``init_process_group`` of this rank (``context`` as above)."""
    global _process_request
    if context is not None:
        context.debug_level = level
    else:
        _process_request = level
