"""Device meshes: N-dimensional arrangements of ranks with one process group per dimension.

This module is the package's boundary: other packages import only the names below, and the
mesh package imports only ``meshkit.comm``'s public names and its seams
(:mod:`meshkit.comm._seams`). Inside: ``layout`` is the one place
of rank arithmetic (pure, no communication); ``device_mesh`` turns it into groups;
``agreement`` checks that every rank passed the same arguments to a construction; ``errors``
gives every mesh error its ``meshkit.mesh: rank R: op:`` prefix; ``parallel_dims`` is
``ParallelDims``.
"""

from ..comm._seams import moved_names
from . import layout
from .device_mesh import DeviceMesh, init_device_mesh
from .parallel_dims import ParallelDims

__all__ = ["DeviceMesh", "init_device_mesh", "ParallelDims", "layout"]

#: Was in ``__all__`` in 0.1 (init_device_mesh's host check, not a user call): one more release, with a warning.
__getattr__ = moved_names(__name__, {"host_names": "meshkit.mesh.device_mesh"})
