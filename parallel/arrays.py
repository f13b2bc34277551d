"""Which array library an array belongs to (NumPy or CuPy), and conversions between them.

Parallel code never calls ``np.*`` on user arrays: it asks :func:`array_namespace` for the
array's own module, so the same code runs on NumPy and CuPy, and CuPy stays optional. The rule
(a device array, one with ``__cuda_array_interface__``, is CuPy's) is comm's
(:mod:`meshkit.comm.arrays`), re-exported here: the engines and this layer never disagree on
where an array lives. Flat
buffers, bucket buffers, shards and optimizer state are made with the parameters' library, so
a CuPy model keeps all of them on its GPU.

Device-to-host transfers are explicit: :func:`to_host` (comm's, like the rule) is the one door
(``.get()`` on CuPy), used
only for scalars the host must branch on (a norm for clipping, the per-sync agreement flag) and
off the hot path (state dict digests). Arrays of the two libraries never meet silently:
:func:`check_same_library` raises ``TypeError`` naming both types; conversions happen only where
documented (:func:`convert`: loading state dicts, optimizer state following its parameter).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..comm import DistTypeError
from ..comm._seams import array_namespace, is_array, to_host

__all__ = ["array_namespace", "is_array", "convert", "to_host", "type_name", "check_same_library"]


def convert(arr: Any, like: Any) -> Any:
    """``arr`` as an array of ``like``'s library and dtype (a new array unless already so)."""
    src, dst = array_namespace(arr), array_namespace(like)
    if src is dst:
        return arr if arr.dtype == like.dtype else arr.astype(like.dtype)
    if dst is np:  # CuPy -> NumPy
        return arr.get().astype(like.dtype, copy=False)
    return dst.asarray(arr, dtype=like.dtype)  # NumPy -> CuPy


def type_name(a: Any) -> str:
    """``"numpy.ndarray"``, ``"cupy.ndarray"``...: the full name of ``a``'s type, for messages."""
    return f"{type(a).__module__}.{type(a).__qualname__}"


def check_same_library(head: str, arg: str, a: Any, ref: Any, ref_arg: str, *, ref_plural: bool = False) -> None:
    """TypeError unless ``a`` belongs to ``ref``'s array library (NumPy vs CuPy), naming both.

    Args:
        head: the message prefix (``"meshkit.parallel: rank R: OP"``).
        arg, ref_arg: how the message names ``a`` and ``ref``.
        ref_plural: ``ref_arg`` names several arrays (``"the parameters"``), of which ``ref`` is one.
    """
    if array_namespace(a) is not array_namespace(ref):
        are = "are" if ref_plural else "is a"
        raise DistTypeError(f"{head}: {arg} is a {type_name(a)} but {ref_arg} {are} {type_name(ref)}; arrays of one "
                            "call must all be NumPy (host) or all CuPy (device): convert explicitly "
                            "(cupy.asarray(x) to the device, x.get() to the host)")
