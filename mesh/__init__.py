"""Device meshes: N-dimensional arrangements of ranks with one process group per dimension.

``layout`` is the pure rank arithmetic (no communication); ``DeviceMesh`` turns it into groups.
"""

from . import layout
from .device_mesh import DeviceMesh, host_names, init_device_mesh
from .parallel_dims import ParallelDims

__all__ = ["DeviceMesh", "init_device_mesh", "ParallelDims", "host_names", "layout"]
