"""meshkit: device meshes, process groups and data-parallel training for NumPy and CuPy.

The process-group and mesh API is re-exported here (``meshkit.all_reduce``,
``meshkit.init_device_mesh``...); every package is an attribute: ``meshkit.comm``,
``meshkit.mesh``, ``meshkit.tensor``, ``meshkit.state``, ``meshkit.parallel``, ``meshkit.checkpoint``, ``meshkit.debug``
(``meshkit.tensor.DTensor``, ``meshkit.parallel.DistributedDataParallel``,
``from meshkit import checkpoint as dcp``).

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

from . import checkpoint, comm, debug, elastic, mesh, parallel, state, tensor
from .comm import *  # noqa: F401,F403
from .comm import __all__ as _comm_all
from .comm import _seams as _comm_seams
from .comm._seams import moved_names
from .launch import ProcessExitedException, ProcessRaisedException, spawn
from .mesh import DeviceMesh, ParallelDims, init_device_mesh

__version__ = "0.1.0"

__all__ = [*_comm_all, "DeviceMesh", "init_device_mesh", "ParallelDims", "spawn", "ProcessRaisedException",
           "ProcessExitedException", "comm", "mesh", "tensor", "state", "parallel", "checkpoint", "debug", "elastic"]

_comm_seams.milestone(_comm_seams.IMPORTED)  # meshkit-run times a restart's imports by it

#: comm's seams were re-exported here in 0.1: one more release, with a warning.
__getattr__ = moved_names(__name__, comm._MOVED)
