"""The array library of an array (NumPy or CuPy), so tensor code runs on both.

A few lines of its own rather than an import from ``parallel`` (which sits above ``tensor``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["namespace_of"]


def namespace_of(a: Any) -> Any:
    """``cupy`` for CuPy arrays, else ``numpy`` (CuPy is imported only when one exists)."""
    if type(a).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np
