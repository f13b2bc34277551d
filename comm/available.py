"""Which backends this installation can run: torch.distributed's ``is_*_available()``.

Each answers without starting anything: no MPI_Init, no CUDA context. Importing ``mpi4py.MPI``
initializes MPI (mpi4py does it at import), so :func:`is_mpi_available` only *finds* the module:
mpi4py 4's import finder picks the extension for the MPI library it can load (``dlopen``, no
MPI call), and fails when there is none.
"""

from __future__ import annotations

import importlib.util
import sys

from .engines.cuda_runtime import runtime

__all__ = ["is_available", "is_mpi_available", "is_nccl_available"]


def is_available() -> bool:
    """True: meshkit's distributed package is always there (torch's answers whether it was built
    with ``torch.distributed``)."""
    return True


def is_mpi_available() -> bool:
    """Whether the ``mpi`` backend can run here: mpi4py is installed and finds an MPI library.

    Does not initialize MPI: ``mpi4py.MPI`` is located, not imported. Never raises.
    """
    if sys.modules.get("mpi4py.MPI") is not None:  # already imported (and so initialized)
        return True
    try:
        # Imports the mpi4py package (which starts nothing); mpi4py 4 resolves the MPI library
        # here and raises RuntimeError("cannot load MPI library") where there is none.
        return importlib.util.find_spec("mpi4py.MPI") is not None
    except Exception:  # no mpi4py, no MPI library, a broken install: all mean "not available"
        return False


def is_nccl_available() -> bool:
    """Whether the ``nccl`` backend can run here: CuPy and its NCCL bindings import (a GPU is
    not needed for True, as in torch; ``init_process_group("nccl")`` still needs one). Never
    raises: without CuPy it is False."""
    try:
        runtime()  # imports cupy and cupy.cuda.nccl; DistBackendError where either is missing
    except Exception:  # ImportError inside CuPy, a CUDA library it cannot load...: not available
        return False
    return True
