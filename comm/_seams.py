"""comm's seams: what the other meshkit packages need of comm that is not user API.

A user calls the names of :data:`meshkit.comm.__all__`; ``mesh``, ``tensor``, ``parallel`` and
``checkpoint`` also need the one way every rank agrees on its arguments (:func:`agree`: all raise
the same error or none does) and names ranks in a message (:func:`name_ranks`, :func:`by_ranks`),
the world (:func:`current_world`), a group argument's default
(:func:`resolve_group`), one split making many groups (:func:`create_groups`), the fingerprint of a
group's calls that a per-step agreement compares (:func:`stamp_fingerprint`, :func:`verify_fingerprint`,
:data:`FINGERPRINT_SLOTS`: comm/call_fingerprint.py), prepared
collectives (:class:`PreparedCollective`) and the NumPy/CuPy rule (:func:`array_namespace`,
:func:`is_device_array`, :func:`is_array`, :func:`to_host`). They import those from here, a module
named as private as torch's
``torch.distributed._*`` are: the names may change between releases without a deprecation.

:func:`moved_names` is the one way a package keeps a name it took out of its ``__all__`` importable
for one release.
"""

from __future__ import annotations

import sys
import warnings
from importlib import import_module
from typing import Any, Callable, Mapping

from .agree import agree
from .naming import by_ranks, name_ranks
from .backends import backend_devices
from .milestones import FIRST_STEP, IMPORTED, RESTORED, milestone
from .arrays import array_namespace, is_array, is_device_array, to_host
from .prepared import PREPARED_OPS, PreparedCollective, prepare_collective
from .registry import create_groups, resolve_group
from .call_fingerprint import SLOTS as FINGERPRINT_SLOTS, stamp as stamp_fingerprint, verify as verify_fingerprint
from .files import NotRegular, TooLarge, open_regular, read_bounded  # files read back (debug, checkpoint)
from .env import positive_number as positive_setting  # a bound's MESHKIT_* variable, checked (debug, checkpoint)
from .world import RECORD_FORMAT, current_world, flight_document, inflight_document

__all__ = ["agree", "by_ranks", "name_ranks", "backend_devices", "array_namespace", "is_device_array", "is_array", "to_host", "PREPARED_OPS", "PreparedCollective",
           "prepare_collective",
           "create_groups", "resolve_group", "current_world", "flight_document", "inflight_document", "RECORD_FORMAT",
           "moved_names", "milestone", "IMPORTED", "RESTORED", "FIRST_STEP", "positive_setting", "read_bounded",
           "open_regular", "NotRegular", "TooLarge", "FINGERPRINT_SLOTS", "stamp_fingerprint", "verify_fingerprint"]


def moved_names(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that still serves names ``package`` took out of its public API.

    ``names`` maps each old name to the module that holds it now. Reading ``package.NAME`` (or
    ``from package import NAME``) returns the object and warns with a ``DeprecationWarning`` naming
    the new place; the names go in the release after (they were documented as public in 0.1).
    """
    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        new = names[name]
        # ``from package import NAME`` asks twice: importlib's hasattr (in _handle_fromlist), then
        # the import statement itself; warn once, at the user's line.
        if sys._getframe(1).f_code.co_name != "_handle_fromlist":
            warnings.warn(f"{package}.{name} is not public API and goes in the next release: "
                          f"import it from {new} ({new}.{name})", DeprecationWarning, stacklevel=2)
        return getattr(import_module(new), name)

    return __getattr__
