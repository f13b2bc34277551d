"""Whether the MPI library reads device memory (CUDA-aware MPI), asked once per engine.

The answer decides how the engine hands a device array to MPI (as it is, or staged through
host memory: :mod:`~meshkit.comm.engines.mpi_staging`). It is its own module because finding it out is
a matter of the MPI *library*, not of communication: ``MESHKIT_CUDA_AWARE_MPI=1`` or ``0``
decides; without it, mpi4py's ``MPI.Query_cuda_support()`` where mpi4py has it, else the
library's ``MPIX_Query_cuda_support()`` / ``MPIX_GPU_query_support()`` through ctypes, else
staging (always correct, slower). Imports ``mpi4py.MPI`` (the rank in an error message, mpi4py's
query), so it initializes MPI as the engine does.
"""

from __future__ import annotations

import os
from typing import Any

from mpi4py import MPI

from .. import env

__all__ = ["cuda_aware_mpi", "CUDA_AWARE_ENV"]

#: The environment variable that says whether MPI reads device memory (1) or not (0).
CUDA_AWARE_ENV = env.CUDA_AWARE_MPI

#: ``MPIX_GPU_SUPPORT_CUDA`` in MPICH's mpi.h: the ``gpu_type`` of ``MPIX_GPU_query_support``.
_MPIX_GPU_SUPPORT_CUDA = 0


def cuda_aware_mpi() -> bool:
    """Whether device arrays go to MPI directly.

    In order: :data:`CUDA_AWARE_ENV` when set; mpi4py's ``MPI.Query_cuda_support()`` where
    mpi4py has it; else the MPI library's own extension, asked through ctypes
    (``MPIX_Query_cuda_support()``: MPICH and Open MPI; ``MPIX_GPU_query_support``: MPICH);
    else False (stage through host memory: always correct, slower).

    Raises:
        DistValueError: :data:`CUDA_AWARE_ENV` is set to something other than 0 or 1.
    """
    forced = env.cuda_aware_mpi(MPI.COMM_WORLD.Get_rank())
    if forced is not None:
        return forced
    query = getattr(MPI, "Query_cuda_support", None)  # mpi4py 4.1 has none (MPIX is not its API)
    if query is not None:
        return bool(query())
    lib = _libmpi()
    return lib is not None and _mpix_cuda_support(lib)


def _libmpi() -> Any | None:
    """The MPI library mpi4py loaded, for the MPIX queries mpi4py does not wrap; None if not found.

    mpi4py dlopens libmpi with ``RTLD_LOCAL`` (the ``mpich`` wheel's ``lib/libmpi.so.12``), so its
    symbols are not global: the library is found by path among this process's mappings and
    opened again with ``RTLD_NOLOAD`` (the same handle, never a second MPI). A libmpi linked into
    the executable or loaded ``RTLD_GLOBAL`` is found first, through the global namespace.
    """
    import ctypes

    try:
        lib = ctypes.CDLL(None)
        lib.MPI_Get_version  # noqa: B018 (a lookup: AttributeError where the symbols are not global)
        return lib
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/maps") as maps:  # Linux; elsewhere MESHKIT_CUDA_AWARE_MPI decides
            fields = [line.split(None, 5) for line in maps if "libmpi" in line]
    except OSError:
        return None
    paths = sorted({f[5].strip() for f in fields if len(f) == 6})  # address perms offset dev inode path
    for path in paths:
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            lib.MPI_Get_version  # noqa: B018
            return lib
        except (OSError, AttributeError):
            continue
    return None


def _mpix_cuda_support(lib: Any) -> bool:
    """What ``lib`` says of CUDA support: ``MPIX_Query_cuda_support()`` (Open MPI, MPICH), else
    ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)`` (MPICH); False if it has neither."""
    import ctypes

    query = getattr(lib, "MPIX_Query_cuda_support", None)
    if query is not None:
        query.restype, query.argtypes = ctypes.c_int, []
        return bool(query())
    query = getattr(lib, "MPIX_GPU_query_support", None)
    if query is not None:
        query.restype, query.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        flag = ctypes.c_int(0)
        return query(_MPIX_GPU_SUPPORT_CUDA, ctypes.pointer(flag)) == 0 and bool(flag.value)  # 0: MPI_SUCCESS
    return False
