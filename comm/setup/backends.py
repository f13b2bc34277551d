"""Backends by name: the registry ``init_process_group(backend)`` looks names up in, and ``Backend``.

A backend is a name and a *factory* that builds this rank's world engine: an object implementing
:class:`~meshkit.comm.engines.engine.Engine`, which the world's :class:`~meshkit.comm.groups.group.ProcessGroup`
holds. The built-in ``mpi``, ``local`` and ``nccl`` register here as a third-party engine does
(:mod:`meshkit.comm.setup.lifecycle` registers them), so ``init_process_group`` knows no engine by name:
it resolves ``"auto"`` and ``"gloo"`` (rules, not engines) and asks the registry for the rest.

A factory is called as ``factory(options)`` with one :class:`BackendOptions`, on the rank that
initializes (inside :func:`meshkit.comm.local.run`, on that rank's thread), and returns the world
engine: it finds its own rank and world size (MPI's world, the ``local.run`` job), as meshkit's
engines do. Its engine is checked against the declared interface before a group holds it
(:func:`check_engine`): what the group would otherwise find missing in the middle of a collective
is an error at ``init_process_group``, naming the backend and what is missing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ..engines.engine import DEVICE, GATED, Engine, EngineCapabilities, methods as engine_methods
from ..errors import DistBackendError, DistTypeError, DistValueError

__all__ = ["Backend", "BackendOptions", "register_backend", "registered_backends", "backend_devices",
           "create_engine", "check_name", "check_engine", "RULES", "DEVICES"]

#: Names ``init_process_group`` resolves itself, to a registered backend; never registrable.
RULES = ("auto", "gloo")
#: The device types a backend may declare (``devices=``), as ``init_device_mesh`` takes them.
DEVICES = ("cpu", "cuda")
#: A name is a lowercase identifier: ``Backend.NAME`` is set for it, as torch does.
_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class BackendOptions:
    """What ``init_process_group`` hands a backend's factory. Fields may be added; a factory reads
    the ones it needs.

    Attributes:
        timeout: seconds every blocking call of the world waits at most (building the engine too).
        device_id: the GPU index ``init_process_group(device_id=...)`` was given, else None.
        host: the host engine of a world whose ranks met through a store (an init method in a
            job no MPI launcher started: comm/engines/store_engine.py), which ``nccl`` builds on; else None.
    """

    timeout: float
    device_id: int | None = None
    host: Any = None


@dataclass(frozen=True)
class _Plugin:
    factory: Callable[[BackendOptions], Any]
    devices: tuple[str, ...]


_plugins: dict[str, _Plugin] = {}


class Backend(str):
    """A backend name, as torch's ``Backend``: ``Backend("MPI") == "mpi"`` (names are lowercase).

    The constants name meshkit's engines and torch's CPU backend (``GLOO``, taken as ``mpi``);
    :meth:`register_backend` adds ``Backend.<NAME>`` for each backend it registers. A name is
    checked when ``init_process_group`` looks it up, not here (as in torch).
    """

    UNDEFINED = "undefined"
    GLOO = "gloo"
    MPI = "mpi"
    NCCL = "nccl"
    LOCAL = "local"

    def __new__(cls, name: str) -> Backend:
        if not isinstance(name, str):
            raise DistTypeError(f"meshkit.comm: Backend(name): name must be a str, got {type(name).__name__} "
                                f"{name!r}")
        return super().__new__(cls, name.lower())

    @classmethod
    def register_backend(cls, name: str, func: Callable[[BackendOptions], Any], extended_api: bool = False,
                         devices: str | Iterable[str] | None = None) -> None:
        """torch's ``Backend.register_backend``: :func:`register_backend` under torch's signature.

        ``func`` is meshkit's factory, ``func(options: BackendOptions) -> Engine`` (one calling
        convention: ``extended_api`` is accepted for torch's signature and changes nothing, as a
        torch creator function returns a c10d ProcessGroup, which no meshkit group could hold).
        """
        if not isinstance(extended_api, bool):
            raise DistTypeError(f"meshkit.comm: Backend.register_backend: extended_api must be a bool, got "
                                f"{extended_api!r}")
        register_backend(name, func, devices=devices)


def register_backend(name: str, factory: Callable[[BackendOptions], Any], *,
                     devices: str | Iterable[str] | None = None, override: bool = False) -> None:
    """Make ``init_process_group(name)`` build its engine with ``factory(options)``.

    Args:
        name: the backend's name, case-insensitive (stored lowercase, as ``Backend(name)``), a
            letter then letters, digits or ``_``; not ``"auto"``/``"gloo"`` (rules of
            ``init_process_group``) nor ``"undefined"``.
        factory: called as ``factory(BackendOptions(timeout, device_id))`` on each rank at
            ``init_process_group``; returns that rank's world engine, an object implementing
            :class:`~meshkit.comm.engines.engine.Engine` with ``backend == name`` (checked there).
        devices: the device types a mesh over this backend may have: ``"cpu"`` (default; host
            arrays) and/or ``"cuda"`` (the engine moves device arrays as a GPU engine; as torch's
            ``devices``).
        override: replace a backend of that name (a built-in too); without it, a name already
            registered is an error.

    Raises:
        DistTypeError: ``name`` not a str, ``factory`` not callable.
        DistValueError: a malformed or reserved name, a name taken (without ``override``), an
            unknown device type.
    """
    if not isinstance(name, str):
        raise DistTypeError(f"meshkit.comm: register_backend: name must be a str, got {type(name).__name__} {name!r}")
    key = name.lower()
    if not _NAME.fullmatch(key):
        raise DistValueError(f"meshkit.comm: register_backend: name {name!r} is not valid; a backend name is a "
                             f"letter followed by letters, digits or '_' (e.g. 'mybackend')")
    if key in RULES or key == Backend.UNDEFINED:
        raise DistValueError(f"meshkit.comm: register_backend: name {name!r} is reserved: init_process_group "
                             f"resolves {list(RULES)} itself, and 'undefined' is Backend.UNDEFINED")
    if not callable(factory):
        raise DistTypeError(f"meshkit.comm: register_backend({name!r}): factory must be callable "
                            f"(factory(options) -> engine), got {type(factory).__name__} {factory!r}")
    if key in _plugins and not override:
        raise DistValueError(f"meshkit.comm: register_backend: backend {key!r} is already registered; pass "
                             f"override=True to replace it (registered: {sorted(_plugins)})")
    _plugins[key] = _Plugin(factory, _devices(key, devices))
    setattr(Backend, key.upper(), key)


def _devices(name: str, devices: str | Iterable[str] | None) -> tuple[str, ...]:
    if devices is None:
        return ("cpu",)
    listed = (devices,) if isinstance(devices, str) else tuple(devices)
    wrong = [d for d in listed if d not in DEVICES]
    if wrong or not listed:
        raise DistValueError(f"meshkit.comm: register_backend({name!r}): devices must name some of {list(DEVICES)}, "
                             f"got {devices!r}")
    return tuple(d for d in DEVICES if d in listed)


def registered_backends() -> dict[str, Callable[[BackendOptions], Any]]:
    """Each registered name (what ``init_process_group`` accepts besides ``"auto"`` and ``"gloo"``)
    with its factory, in registration order: a built-in's factory can be wrapped and registered
    again with ``override=True`` (to instrument its engine, say)."""
    return {name: plugin.factory for name, plugin in _plugins.items()}


def backend_devices(name: str) -> tuple[str, ...]:
    """The device types ``name`` was registered with (``("cpu",)`` for a name not registered)."""
    plugin = _plugins.get(str(name).lower())
    return plugin.devices if plugin is not None else ("cpu",)


def create_engine(name: str, options: BackendOptions) -> Any:
    """Build this rank's world engine for the registered backend ``name``, checked (:func:`check_engine`).

    Raises:
        DistValueError: ``name`` is not registered (the message lists what is).
        DistBackendError: the factory's engine does not implement the interface.
    """
    return check_engine(name, _plugins[check_name(name)].factory(options))


def check_name(name: str) -> str:
    """``name`` if it is a registered backend, else a :class:`DistValueError` listing the valid names."""
    if name not in _plugins:
        raise DistValueError(f"meshkit.comm: unknown backend {name!r}; valid backends are "
                             f"{[RULES[0], *_plugins, *RULES[1:]]}")
    return name


#: Attributes of the Engine protocol (comm/engines/engine.py) with the types they must have; ``watch`` (set by
#: the group) and ``device`` (None or a GPU index) are checked on their own.
_ATTRIBUTES = {"backend": str, "rank": int, "size": int, "max_tag": int, "native_avg": bool,
               "capabilities": EngineCapabilities}
#: Methods an engine has only where its capabilities say so (EngineCapabilities' docstring).
_MISSING = object()


def check_engine(name: str, engine: Any) -> Any:
    """``engine`` if it implements :class:`~meshkit.comm.engines.engine.Engine` for backend ``name``, else a
    :class:`DistBackendError` naming the backend and everything missing or wrong.

    This is the one place meshkit asks an engine what it has: the group and its parts then read only
    what the protocol declares (tests/test_structure.py).
    """
    if engine is None or isinstance(engine, (bool, int, float, str, bytes)):
        raise DistBackendError(f"meshkit.comm: backend {name!r}: its factory returned {engine!r}, not an engine "
                               f"(an object implementing meshkit.comm.engines.engine.Engine)")
    problems = []
    values = {attr: getattr(engine, attr, _MISSING) for attr in (*_ATTRIBUTES, "watch", "device")}
    absent = [attr for attr, value in values.items() if value is _MISSING]
    if absent:
        problems.append(f"missing attributes {absent}")
    for attr, kind in _ATTRIBUTES.items():
        value = values[attr]
        if value is not _MISSING and (not isinstance(value, kind) or kind is int and isinstance(value, bool)):
            article = "an" if kind.__name__[0] in "AEIOUaeiou" else "a"
            problems.append(f"{attr} is {value!r} (a {type(value).__name__}), expected {article} {kind.__name__}")
    device = values["device"]
    if device is not _MISSING and device is not None and (isinstance(device, bool) or not isinstance(device, int)):
        problems.append(f"device is {device!r}, not None or a GPU index")
    rank, size = values["rank"], values["size"]
    if all(type(v) is int for v in (rank, size)) and not 0 <= rank < size:
        problems.append(f"rank {rank} is not in range(size) with size {size}")
    if type(values["backend"]) is str and values["backend"] != name:
        problems.append(f"backend is {values['backend']!r}, not {name!r} (get_backend() reports it)")
    methods = list(engine_methods(Engine))
    capabilities = values["capabilities"]
    if isinstance(capabilities, EngineCapabilities):
        methods += [m for flag, gated in GATED.items() if getattr(capabilities, flag) for m in engine_methods(gated)]
    if isinstance(device, int) and not isinstance(device, bool):
        methods += engine_methods(DEVICE)
    uncallable = [m for m in methods if not callable(getattr(engine, m, None))]
    if uncallable:
        problems.append(f"missing methods {uncallable}")
    if problems:
        where = f" (rank {rank})" if type(rank) is int else ""
        raise DistBackendError(f"meshkit.comm: backend {name!r}{where}: its factory returned a "
                               f"{type(engine).__name__} that does not implement meshkit.comm.engines.engine.Engine: "
                               + "; ".join(problems))
    return engine
