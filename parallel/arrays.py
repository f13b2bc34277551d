"""Which array library an array belongs to (NumPy or CuPy), and conversions between them.

Parallel code never calls ``np.*`` on user arrays: it asks :func:`array_namespace` for the
array's own module, so the same code runs on NumPy and CuPy, and CuPy stays optional.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["array_namespace", "is_array", "convert"]


def array_namespace(a: Any) -> Any:
    """The array library of ``a``: the ``cupy`` module for CuPy arrays, else ``numpy``.

    Args:
        a: an array (or anything; only CuPy types are told apart).

    Returns:
        ``cupy`` if ``type(a).__module__`` starts with ``"cupy"``, else ``numpy``.
    """
    if type(a).__module__.startswith("cupy"):
        import cupy  # imported only when a CuPy array exists, so CuPy stays optional

        return cupy
    return np


def is_array(a: Any) -> bool:
    """True for anything shaped like an array (NumPy, CuPy)."""
    return hasattr(a, "dtype") and hasattr(a, "shape") and hasattr(a, "reshape")


def convert(arr: Any, like: Any) -> Any:
    """``arr`` as an array of ``like``'s library and dtype (a new array unless already so)."""
    src, dst = array_namespace(arr), array_namespace(like)
    if src is dst:
        return arr if arr.dtype == like.dtype else arr.astype(like.dtype)
    if dst is np:  # CuPy -> NumPy
        return arr.get().astype(like.dtype, copy=False)
    return dst.asarray(arr, dtype=like.dtype)  # NumPy -> CuPy
