"""meshkit: device meshes, process groups and data-parallel training for NumPy and CuPy.

The process-group and mesh API is re-exported here (``meshkit.all_reduce``,
``meshkit.init_device_mesh``...); every package is an attribute: ``meshkit.comm``,
``meshkit.mesh``, ``meshkit.tensor``, ``meshkit.parallel``, ``meshkit.checkpoint``.
"""

from . import checkpoint, comm, mesh, parallel, tensor
from .comm import *  # noqa: F401,F403
from .comm import __all__ as _comm_all
from .mesh import DeviceMesh, ParallelDims, init_device_mesh

__version__ = "0.1.0"

__all__ = [*_comm_all, "DeviceMesh", "init_device_mesh", "ParallelDims", "comm", "mesh", "tensor", "parallel", "checkpoint"]
