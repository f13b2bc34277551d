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

from . import checkpoint, comm, debug, elastic, launch, mesh, parallel, plan, state, tensor
from .comm import *  # noqa: F401,F403
from .comm import __all__ as _comm_all
from .comm import _seams as _comm_seams
from .comm._seams import moved_names
from .launch import ProcessExitedException, ProcessRaisedException, spawn
from .mesh import DeviceMesh, ParallelDims, init_device_mesh

__version__ = "0.1.0"

__all__ = [*(name for name in _comm_all if name != "breakpoint"), "DeviceMesh", "init_device_mesh", "ParallelDims",
           "spawn", "ProcessRaisedException", "ProcessExitedException", "comm", "mesh", "tensor", "state", "parallel",
           "checkpoint", "plan", "debug", "launch", "elastic"]

_comm_seams.milestone(_comm_seams.IMPORTED)  # meshkit-run times a restart's imports by it

#: comm's seams were re-exported here in 0.1: one more release, with a warning.
__getattr__ = moved_names(__name__, comm._MOVED)
