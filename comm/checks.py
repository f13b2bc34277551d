"""Argument checks shared by every engine: cheap on success, specific on failure.

Messages follow one form: ``meshkit.comm: rank R: OP: ARG ...: what is wrong; what is valid``.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np

from .arrays import is_device_array
from .errors import DistError, DistTypeError, DistValueError

__all__ = ["where", "check_member", "check_array", "check_like", "check_list", "check_root", "check_split_sizes"]

class CheckedGroup(Protocol):
    """What the checks read of a group (the real class imports this module, not the reverse)."""

    global_rank: int
    size: int
    name: str


# Dtype kinds a buffer collective moves: bool, signed/unsigned integers, floats, complex; and
# ml_dtypes' bfloat16 (kind 'V'), CuPy 14's bfloat16 and NCCL's NCCL_BFLOAT16.
_KINDS = "biufc"


def where(op: str, group: CheckedGroup) -> str:
    """``"meshkit.comm: rank R: op"``, R the global rank: what was called, then on which group, as
    every package's ``where`` (``meshkit.parallel``'s: ``where(who, group)``)."""
    return f"meshkit.comm: rank {group.global_rank}: {op}"


def check_member(group: Any, op: str) -> None:
    """This rank is a member of ``group`` (a ProcessGroup) and the world is not destroyed."""
    if group.rank < 0:
        raise DistValueError(
            f"{where(op, group)}: this rank is not a member of group {group.name} "
            f"(ranks {list(group.ranks)}); only members may call collectives on it")
    if group.world.destroyed:
        raise DistError(f"{where(op, group)}: the process group was destroyed; call "
                        "init_process_group() again first")


def check_array(group: CheckedGroup, op: str, arg: str, x: Any, *, writable: bool = True) -> None:
    """A C-contiguous NumPy array of a numeric or bool dtype (writable when it is an output)."""
    # The success path reads each property once (this runs on every collective call).
    if isinstance(x, np.ndarray):
        flags = x.flags
        if flags.c_contiguous and (x.dtype.kind in _KINDS or x.dtype.name == "bfloat16") and (
                flags.writeable or not writable):
            return
    elif is_device_array(x) and x.flags.c_contiguous and (x.dtype.kind in _KINDS or x.dtype.name == "bfloat16"):
        return  # CuPy: always writable
    _array_error(group, op, arg, x, writable)


def _where_is(x: Any) -> str:
    kind = "device" if is_device_array(x) else "host"
    return f"{type(x).__module__}.{type(x).__name__} ({kind})"


def _array_error(group: CheckedGroup, op: str, arg: str, x: Any, writable: bool) -> None:
    if not isinstance(x, np.ndarray) and not is_device_array(x):
        raise DistTypeError(f"{where(op, group)}: {arg} must be a numpy.ndarray, got {type(x).__name__} "
                            "(device arrays with __cuda_array_interface__, e.g. cupy.ndarray, are accepted too)")
    if x.dtype.kind not in _KINDS and x.dtype.name != "bfloat16":
        raise DistTypeError(f"{where(op, group)}: {arg} has dtype {x.dtype}, which cannot be communicated; "
                            "valid dtypes are bool, integers, floats, complex and bfloat16 (ml_dtypes)")
    if not x.flags.c_contiguous:
        raise DistValueError(
            f"{where(op, group)}: {arg} is not C-contiguous (shape {x.shape}, strides {x.strides}); "
            f"pass np.ascontiguousarray({arg}) or a contiguous buffer")
    raise DistValueError(f"{where(op, group)}: {arg} is read-only but is written by {op}")


def check_like(group: CheckedGroup, op: str, arg: str, x: np.ndarray, ref: np.ndarray, ref_arg: str,
               *, size: int | None = None, shape: tuple[int, ...] | None = None) -> None:
    """``x`` has ``ref``'s dtype, lives where ``ref`` does (host or device) and has the expected
    ``size`` (elements) or ``shape``."""
    if type(x) is not type(ref) and is_device_array(x) != is_device_array(ref):
        raise DistTypeError(f"{where(op, group)}: {arg} is {_where_is(x)} but {ref_arg} is {_where_is(ref)}; "
                            "pass both on the host (NumPy) or both on the device")
    if x.dtype != ref.dtype:
        raise DistTypeError(f"{where(op, group)}: {arg} has dtype {x.dtype} but {ref_arg} has dtype "
                            f"{ref.dtype}; they must match")
    if shape is not None and x.shape != shape:
        raise DistValueError(f"{where(op, group)}: {arg} has shape {x.shape}, expected {shape}")
    if size is not None and x.size != size:
        raise DistValueError(f"{where(op, group)}: {arg} has {x.size} elements (shape {x.shape}), "
                             f"expected {size}")


def check_list(group: CheckedGroup, op: str, arg: str, xs: Any, ref: np.ndarray, ref_arg: str,
               *, writable: bool, same_shape: bool = True) -> list[np.ndarray]:
    """A list of ``group.size`` arrays, each like ``ref`` (same dtype; same shape if asked)."""
    if not isinstance(xs, (list, tuple)):
        raise DistTypeError(f"{where(op, group)}: {arg} must be a list of {group.size} arrays, "
                            f"got {type(xs).__name__}")
    if len(xs) != group.size:
        raise DistValueError(f"{where(op, group)}: {arg} has {len(xs)} arrays, expected one per rank of "
                             f"the group ({group.size})")
    for i, x in enumerate(xs):
        check_array(group, op, f"{arg}[{i}]", x, writable=writable)
        check_like(group, op, f"{arg}[{i}]", x, ref, ref_arg, shape=ref.shape if same_shape else None)
    return list(xs)


def check_root(group: CheckedGroup, op: str, arg: str, group_rank: int) -> int:
    """A group rank in range (the caller translated a global rank already)."""
    if not isinstance(group_rank, (int, np.integer)) or isinstance(group_rank, bool):
        raise DistTypeError(f"{where(op, group)}: {arg} must be an int rank, got {group_rank!r}")
    if not 0 <= group_rank < group.size:
        raise DistValueError(f"{where(op, group)}: {arg}={group_rank} is out of range for group "
                             f"{group.name} of size {group.size} (valid: 0..{group.size - 1})")
    return int(group_rank)


def check_split_sizes(group: CheckedGroup, op: str, arg: str, splits: Sequence[int] | None,
                      rows: int) -> list[int]:
    """Split sizes along dim 0: one per rank, non-negative, summing to ``rows``."""
    n = group.size
    if splits is None:
        if rows % n:
            raise DistValueError(f"{where(op, group)}: dim 0 of length {rows} does not divide into "
                                 f"{n} equal parts; pass {arg}")
        return [rows // n] * n
    splits = [int(s) for s in splits]
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != rows:
        raise DistValueError(f"{where(op, group)}: {arg}={splits} must hold {n} non-negative sizes "
                             f"summing to dim 0 of the array ({rows})")
    return splits
