"""Whether MPI is CUDA-aware (``meshkit.comm.engines.mpi_cuda_aware.cuda_aware_mpi``): the real library, then fakes.

Run with plain ``python`` (an MPI singleton). The real answer comes first, from the library
mpi4py loaded; then fake libraries (objects with MPICH's MPIX functions, as ctypes gives them)
stand in for it, and mpi4py's ``Query_cuda_support`` and ``MESHKIT_CUDA_AWARE_MPI`` are put in
front of them. Prints one line per case: ``CASE -> ANSWER``.
"""

import ctypes
import os

from mpi4py import MPI

from meshkit.comm.engines import mpi_cuda_aware

lib = mpi_cuda_aware._libmpi()
print(f"real library {os.path.basename(lib._name) if lib is not None else None} -> {mpi_cuda_aware.cuda_aware_mpi()}")


class Query:
    """``int MPIX_Query_cuda_support(void)`` answering ``answer``."""

    def __init__(self, answer):
        self.answer, self.restype, self.argtypes = answer, None, None

    def __call__(self):
        assert (self.restype, self.argtypes) == (ctypes.c_int, []), (self.restype, self.argtypes)
        return self.answer


class GpuQuery:
    """``int MPIX_GPU_query_support(int gpu_type, int *is_supported)``: ``answer`` for CUDA (0)."""

    def __init__(self, answer, error=0):
        self.answer, self.error, self.restype, self.argtypes = answer, error, None, None

    def __call__(self, gpu_type, flag):
        assert self.restype is ctypes.c_int and self.argtypes == [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        flag.contents.value = self.answer if gpu_type == 0 else 0  # MPIX_GPU_SUPPORT_CUDA in MPICH's mpi.h
        return self.error


class Library:
    def __init__(self, **functions):
        self.__dict__.update(functions)


cases = {
    "MPIX_Query_cuda_support 1": Library(MPIX_Query_cuda_support=Query(1)),
    "MPIX_Query_cuda_support 0": Library(MPIX_Query_cuda_support=Query(0)),
    "MPIX_GPU_query_support 1": Library(MPIX_GPU_query_support=GpuQuery(1)),
    "MPIX_GPU_query_support 0": Library(MPIX_GPU_query_support=GpuQuery(0)),
    "MPIX_GPU_query_support failing": Library(MPIX_GPU_query_support=GpuQuery(1, error=1)),
    "neither": Library(),
    "no library": None,
}
for name, fake in cases.items():
    mpi_cuda_aware._libmpi = lambda fake=fake: fake
    print(f"{name} -> {mpi_cuda_aware.cuda_aware_mpi()}")

mpi_cuda_aware._libmpi = lambda: Library(MPIX_Query_cuda_support=Query(0))
MPI.Query_cuda_support = lambda: True  # mpi4py's own query (mpi4py builds with MPIX) comes before the library's
print(f"mpi4py Query_cuda_support 1, library 0 -> {mpi_cuda_aware.cuda_aware_mpi()}")
del MPI.Query_cuda_support
mpi_cuda_aware._libmpi = lambda: Library(MPIX_Query_cuda_support=Query(1))
for value in ("0", "1"):
    os.environ[mpi_cuda_aware.CUDA_AWARE_ENV] = value
    print(f"{mpi_cuda_aware.CUDA_AWARE_ENV}={value}, library 1 -> {mpi_cuda_aware.cuda_aware_mpi()}")
