"""comm's seams: what the other meshkit packages need of comm that is not user API.

A user calls the names of :data:`meshkit.comm.__all__`; ``mesh``, ``tensor``, ``parallel`` and
``checkpoint`` also need the one way every rank agrees on its arguments (:func:`agree`: all raise
the same error or none does) and names ranks in a message (:func:`name_ranks`, :func:`by_ranks`),
the world (:func:`current_world`), a group argument's default
(:func:`resolve_group`), one split making many groups (:func:`create_groups`), the fingerprint of a
group's calls that a per-step agreement compares (:func:`stamp_fingerprint`, :func:`verify_fingerprint`,
:data:`FINGERPRINT_SLOTS`: comm/groups/call_fingerprint.py), prepared
collectives (:class:`PreparedCollective`; :func:`all_reduce_owned`, the public all-reduce without the
argument checks an array the caller just made passes by construction) and the NumPy/CuPy rule (:func:`array_namespace`,
:func:`is_device_array`, :func:`is_array`, :func:`to_host`). They import those from here, a module
named as private as torch's
``torch.distributed._*`` are: the names may change between releases without a deprecation.
``parallel``'s sharded strategies also read the job's ``--survive`` budget (:func:`survive_budget`), and
its recovery tells the launcher when it passed each point (:func:`survived`, for ``meshkit-run``'s report).
keep their buddy copies in POSIX shared-memory segments (:func:`create_segment`, :func:`attach_segment`:
comm/engines/shm_segment.py, which needs no MPI).

:func:`moved_names` is the one way a package keeps a name it took out of its ``__all__`` importable
for one release.
"""

from __future__ import annotations

import importlib.abc
import os
import importlib.machinery
import sys
import types
import warnings
from importlib import import_module
from typing import Any, Callable, Mapping, Sequence

from ..launch_protocol import SURVIVE_ENV
from .agree import agree
from .naming import by_ranks, name_ranks
from .setup.backends import backend_devices
from .milestones import FIRST_STEP, IMPORTED, RESTORED, milestone, recoveries, spare_joined, survived
from .arrays import array_namespace, is_array, is_device_array, to_host
from .groups.prepared import PREPARED_OPS, PreparedCollective, all_reduce_owned, prepare_collective
from .setup.registry import create_groups, resolve_group
from .setup.lifecycle import joined_spare, launched_ranks, spare_joining  # a spare of meshkit-run --spares, where it joined
from .groups.call_fingerprint import SLOTS as FINGERPRINT_SLOTS, stamp as stamp_fingerprint, verify as verify_fingerprint
from .files import NotRegular, TooLarge, open_regular, read_bounded  # files read back (debug, checkpoint)
from .env import positive_number as positive_setting  # a bound's MESHKIT_* variable, checked (debug, checkpoint)
from .groups.world import RECORD_FORMAT, current_world, flight_document, inflight_document
from .engines.shm_segment import NAME_BYTES as SEGMENT_NAME_BYTES, Segment, attach as attach_segment, create as create_segment

__all__ = ["agree", "by_ranks", "name_ranks", "backend_devices", "array_namespace", "is_device_array", "is_array", "to_host", "PREPARED_OPS", "PreparedCollective", "all_reduce_owned",
           "prepare_collective",
           "create_groups", "resolve_group", "current_world", "flight_document", "inflight_document", "RECORD_FORMAT",
           "moved_names", "milestone", "survived", "spare_joined", "recoveries", "IMPORTED", "RESTORED", "FIRST_STEP", "positive_setting",
           "read_bounded",
           "open_regular", "NotRegular", "TooLarge", "FINGERPRINT_SLOTS", "stamp_fingerprint", "verify_fingerprint",
           "moved_modules", "survive_budget", "joined_spare", "launched_ranks", "spare_joining", "Segment", "create_segment", "attach_segment", "SEGMENT_NAME_BYTES"]


def survive_budget() -> int:
    """K of ``meshkit-run --survive K`` (``MESHKIT_SURVIVE``, set by the launcher), 0 in a plain run, read
    as the ULFM engine reads it (:func:`meshkit.comm.engines.mpi_ulfm.budget`) but without importing MPI:
    the sharded strategies ask at construction whether to keep buddy copies (parallel/buddy.py)."""
    text = os.environ.get(SURVIVE_ENV, "").strip()
    return int(text) if text.isdigit() else 0


def moved_names(package: str, names: Mapping[str, str], modules: Mapping[str, str] | None = None, *,
                behind: int = 0) -> Callable[[str], Any]:
    """A module ``__getattr__`` that still serves names ``package`` took out of its public API.

    ``names`` maps each old name to the module that holds it now. Reading ``package.NAME`` (or
    ``from package import NAME``) returns the object and warns with a ``DeprecationWarning`` naming
    the new place; the names go in the release after (they were documented as public in 0.1).
    ``modules`` (old full module name to new, as :func:`moved_modules` takes) serves
    ``package.MODULE`` read as an attribute: it imports the old path, which warns. ``behind``: the
    frames of the package's own ``__getattr__`` between the import system and the function returned
    (which it calls), so that the warning still points at the user's line.
    """
    def __getattr__(name: str) -> Any:
        if modules and f"{package}.{name}" in modules:
            return import_module(f"{package}.{name}")
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        new = names[name]
        # ``from package import NAME`` asks twice: importlib's hasattr (in _handle_fromlist), then
        # the import statement itself; warn once, at the user's line.
        if sys._getframe(1 + behind).f_code.co_name != "_handle_fromlist":
            warnings.warn(f"{package}.{name} is not public API and goes in the next release: "
                          f"import it from {new} ({new}.{name})", DeprecationWarning, stacklevel=2 + behind)
        return getattr(import_module(new), name)

    return __getattr__


def _warn_at_importer(message: str, skip: set[str]) -> None:
    """A ``DeprecationWarning`` at the line that imported: the first frame outside the import system
    and the modules of ``skip`` (``stacklevel`` cannot say it: how many frames importlib adds varies)."""
    frame = sys._getframe(1)
    while frame.f_back is not None and (frame.f_globals.get("__name__", "") in skip
                                        or frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib"))):
        frame = frame.f_back
    globals_ = frame.f_globals
    warnings.warn_explicit(message, DeprecationWarning, frame.f_code.co_filename, frame.f_lineno,
                           module=globals_.get("__name__", "<unknown>"),
                           registry=globals_.setdefault("__warningregistry__", {}))


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds each old module path of :func:`moved_modules` and loads it as the module it moved to."""

    def __init__(self, names: Mapping[str, str]) -> None:
        self.names = dict(names)
        self.specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = self.names[spec.name]
        _warn_at_importer(f"{spec.name} moved to {new}: import it from there; the old path goes in the next release",
                          skip={__name__, spec.name.rpartition(".")[0]})
        module = import_module(new)
        # the import system sets ``__spec__`` on what this returns: exec_module puts the module's own back
        self.specs[new] = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = self.specs[module.__name__]


def moved_modules(names: Mapping[str, str]) -> None:
    """Keep each old module path of ``names`` (old dotted name to new) importable for one release.

    ``import meshkit.comm.mpi`` (or ``from meshkit.comm import mpi``) then gives the module that
    is ``meshkit.comm.engines.mpi`` now, the same object (so a monkeypatch through either name
    patches both), with a ``DeprecationWarning`` naming the new path. No file stays at the old
    path, so ``git log --follow`` and merges follow each move.
    """
    sys.meta_path.append(_MovedModules(names))
