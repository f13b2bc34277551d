"""Host or device, NumPy or CuPy: the one rule every layer asks.

An array is a *device array* when it exports ``__cuda_array_interface__`` (CuPy, Numba, torch
and JAX arrays on a GPU; the tests' doubles); anything else is a host array. The array library
of a device array is CuPy (the device library meshkit computes with, imported only once a
device array exists, so CuPy stays optional), of a host array NumPy. The engines ask
:func:`is_device_array` (device memory goes to NCCL, or to MPI as it is or staged), the parallel
and tensor layers :func:`array_namespace` (which module makes their buffers): one rule, so an
array is never a device array to one layer and a NumPy array to another.

The question is asked on every collective call, so a NumPy array answers with one type
compare; torch's CPU tensors, whose class has the attribute but raise ``AttributeError`` on
reading it, are host arrays because the attribute is read from the array itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["is_device_array", "array_namespace", "is_array", "to_host"]

_NDARRAY = np.ndarray


def is_device_array(x: Any) -> bool:
    """True for an array in device memory: it exports ``__cuda_array_interface__``.

    Args:
        x: anything (None and scalars are host values).

    Returns:
        False for a NumPy array (one type compare) and anything without the interface.
    """
    return x.__class__ is not _NDARRAY and hasattr(x, "__cuda_array_interface__")


def array_namespace(x: Any) -> Any:
    """The array library of ``x``: the ``cupy`` module for a device array, else ``numpy``.

    Args:
        x: an array (or anything: only device arrays are told apart).

    Returns:
        ``cupy`` if :func:`is_device_array` (imported here, on first use), else ``numpy``.

    Example::

        xp = array_namespace(grad)   # numpy on the host, cupy on a GPU
        buf = xp.zeros(n, grad.dtype)
    """
    if x.__class__ is _NDARRAY or not hasattr(x, "__cuda_array_interface__"):
        return np
    import cupy  # only once a device array exists: CuPy stays optional

    return cupy


def is_array(a: Any) -> bool:
    """True for anything shaped like an array (NumPy, CuPy)."""
    return hasattr(a, "dtype") and hasattr(a, "shape") and hasattr(a, "reshape")


def to_host(a: Any) -> np.ndarray:
    """``a`` as a NumPy array: itself if it is one, else the explicit device-to-host copy
    (``.get()``, which waits for the current stream). The one place device data reaches the host
    (here, below every package, so that checkpoint's file I/O and the strategies share it)."""
    return a if array_namespace(a) is np else a.get()
