"""meshkit: device meshes, process groups and data-parallel training for NumPy and CuPy.

The process-group and mesh API is re-exported here (``meshkit.all_reduce``,
``meshkit.init_device_mesh``...); every package is an attribute (``meshkit.tensor.DTensor``,
``meshkit.parallel.DistributedDataParallel``, ``from meshkit import checkpoint as dcp``). Each
package's docstring is its map, a line for each of its modules:

- ``meshkit.comm``: process groups, collectives, engines (MPI, NCCL, local threads), stores; nothing of meshes.
- ``meshkit.mesh``: ``DeviceMesh``, one process group per dimension, and ``ParallelDims``.
- ``meshkit.tensor``: ``DTensor`` (placements, redistribution, NumPy ops) and tensor parallelism.
- ``meshkit.state``: the vocabulary of state dicts (sharded boxes, step counts).
- ``meshkit.parallel``: the strategies by family (data, pipeline, context, expert) and the optimizers.
- ``meshkit.checkpoint``: sharded, resharding, crash-safe, checksummed checkpoints.
- ``meshkit.plan``: the planner (calibrate a machine, estimate a configuration, search them).
- ``meshkit.debug``: Chrome traces, the hang analyzer, the debug server.
- ``meshkit.launch``: ``meshkit-run`` (mpiexec underneath) and ``spawn``; imports nothing of meshkit but
  ``meshkit.launch_protocol``, the launcher-to-rank names (standard library only; not user API).
- ``meshkit.elastic``: what a restarted script learns of its attempt.

Every package, and every name re-exported here, is imported on first use (PEP 562): ``import
meshkit`` itself imports nothing of meshkit, so ``meshkit-run`` and a script that uses only the
process groups do not pay for DTensor, the strategies and the checkpoints
(``import meshkit`` took 0.5-0.85 s for 156 modules; the launcher's ``meshkit.launch.cli`` alone
0.1 s, measured on this 2-core machine with ``python -X importtime``).

``__all__`` is torch.distributed's surface as meshkit has it, the mesh, ``spawn`` and the packages;
``breakpoint`` is left out of it, so that ``from meshkit import *`` keeps the builtin
(``meshkit.breakpoint`` is torch's ``dist.breakpoint``).

Public and private, as torch draws the line:

- A package's ``__all__`` is its user API: what a training script calls. Nothing else of it is
  promised.
- A seam is what one meshkit package needs of another that is not user API (the world, group
  resolution, prepared collectives, DTensor block arithmetic, a strategy's sharded state). The
  package that offers seams lists them in its ``_seams`` module (:mod:`meshkit.comm._seams`,
  :mod:`meshkit.tensor._seams`, :mod:`meshkit.state._seams`, :mod:`meshkit.parallel._seams`); a name
  there may change without a deprecation.
- A package imports another only as ``from ..comm import NAME`` (``NAME`` in its ``__all__``) or
  ``from ..comm._seams import NAME``; never another package's inner modules
  (``tests/test_structure.py`` checks it). Tests reach into inner modules only to test them.
- A name taken out of an ``__all__`` stays importable from its old place for one release, with a
  ``DeprecationWarning`` naming the new one (:func:`meshkit.comm._seams.moved_names`).
"""

import importlib as _importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy attributes below give, for type checkers and editors
    from . import checkpoint, comm, debug, elastic, launch, mesh, parallel, plan, state, tensor
    from .comm import *  # noqa: F401,F403
    from .launch import ProcessExitedException, ProcessRaisedException, spawn
    from .mesh import DeviceMesh, ParallelDims, init_device_mesh

__version__ = "0.1.0"

#: The packages, each an attribute imported on first use.
_PACKAGES = ("comm", "mesh", "tensor", "state", "parallel", "checkpoint", "plan", "debug", "launch", "elastic")
#: The names re-exported from a package other than comm, by package.
_FROM = {"DeviceMesh": "mesh", "init_device_mesh": "mesh", "ParallelDims": "mesh", "spawn": "launch",
         "ProcessRaisedException": "launch", "ProcessExitedException": "launch"}


def _public() -> list[str]:
    comm = _importlib.import_module(f"{__name__}.comm")
    return [*(name for name in comm.__all__ if name != "breakpoint"), *_FROM, *_PACKAGES]


def __getattr__(name: str) -> Any:
    """A package (``meshkit.tensor``), a re-exported name (``meshkit.all_reduce``, comm's ``__all__`` and
    :data:`_FROM`'s) or ``__all__``, imported now and kept; a name comm took out of its public API
    still served with a warning (:func:`meshkit.comm._seams.moved_names`)."""
    if name in _PACKAGES:
        return _importlib.import_module(f"{__name__}.{name}")  # the import makes it an attribute
    if name.startswith("__") and name != "__all__":  # dunders Python probes (__path__ is set; __file__...)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name == "__all__":
        value: Any = _public()
    elif name in _FROM:
        value = getattr(_importlib.import_module(f"{__name__}.{_FROM[name]}"), name)
    else:
        comm = _importlib.import_module(f"{__name__}.comm")
        if name not in comm.__all__:
            seams = _importlib.import_module(f"{__name__}.comm._seams")
            return seams.moved_names(__name__, comm._MOVED, behind=1)(name)  # warns, or raises AttributeError
        value = getattr(comm, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_public(), "breakpoint"})  # breakpoint: served, but kept out of __all__
