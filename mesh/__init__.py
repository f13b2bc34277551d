"""Device meshes: N-dimensional arrangements of ranks with one process group per dimension.

This module is the package's boundary: other packages import only the names below, and the
mesh package imports only ``meshkit.comm``'s public names. Inside: ``layout`` is the one place
of rank arithmetic (pure, no communication); ``device_mesh`` turns it into groups;
``agreement`` checks that every rank passed the same arguments to a construction; ``errors``
gives every mesh error its ``meshkit.mesh: rank R: op:`` prefix; ``parallel_dims`` is
``ParallelDims``.
"""

from . import layout
from .device_mesh import DeviceMesh, host_names, init_device_mesh
from .parallel_dims import ParallelDims

__all__ = ["DeviceMesh", "init_device_mesh", "ParallelDims", "host_names", "layout"]
