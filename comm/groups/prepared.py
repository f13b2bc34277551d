"""Prepared collectives: one group, one input shape and dtype, validated once; each call returns a new array.

A library that issues the same collective on the same shapes over and over (DTensor's
redistribution programs) pays the public methods' argument checks on every call: a noticeable
share of what a small collective takes. A :class:`PreparedCollective` does those checks once,
when it is made, as MPI's persistent collectives and torch's functional collectives (the ones
DTensor is built on) do; a call then compares the input's shape and dtype with what was
prepared (a strided input is copied to a contiguous one first, as it is only read), allocates the output (on the input's device) and starts the
collective on the same path as the public method: numbered, in the flight recorder, under the
group's timeout, checked across ranks in ``MESHKIT_DEBUG=detail``. An input of another shape or
dtype is refused, naming both, and the group's other members are told (their matching call
fails too), as the public methods do with bad arguments.
"""

from __future__ import annotations

from threading import get_ident as _get_ident
from typing import Any

import numpy as np

from ..arrays import array_namespace
from ..checks import check_member, where
from ..errors import DistTypeError, DistValueError
from .group import ProcessGroup
from ..reduce_op import ReduceOp, check_op_dtype, valid_op_dtypes

__all__ = ["PreparedCollective", "prepare_collective", "PREPARED_OPS", "all_reduce_owned"]

#: The collectives that can be prepared, and what each returns for an input of shape ``(m, *rest)``.
PREPARED_OPS = {
    "all_gather_into_tensor": "(size * m, *rest): every rank's input, in rank order",
    "reduce_scatter_tensor": "(m // size, *rest): this rank's chunk of the reduction",
    "all_to_all_single": "(m, *rest): row block j from rank j (m rows in size equal blocks)",
    "all_reduce": "(m, *rest): the reduction (the input is left alone)",
}

_NDARRAY = np.ndarray
_AVG = ReduceOp.AVG  # (an Enum member read from its class costs 0.07 us a call on Python 3.11)
_REDUCING = ("reduce_scatter_tensor", "all_reduce")


class PreparedCollective:
    """A collective prepared for one group, input shape and dtype (see the module docstring).

    Call it with this rank's input; it returns a new array. Every rank of the group calls it in
    the same order as its other collectives on the group, as with the public methods.
    """

    __slots__ = ("group", "op", "shape", "dtype", "out_shape", "reduce_op", "_engine", "_shapes", "_counts",
                 "_dtypes")

    def __init__(self, group: ProcessGroup, op: str, shape: tuple[int, ...], dtype: np.dtype | None,
                 reduce_op: ReduceOp) -> None:
        self.group, self.op, self.shape, self.dtype, self.reduce_op = group, op, shape, dtype, reduce_op
        self._dtypes: set[Any] = set() if dtype is None else {dtype}
        n = group.size
        rest = shape[1:]
        if op == "all_gather_into_tensor":
            self.out_shape = (n * shape[0], *rest)
        elif op == "reduce_scatter_tensor":
            self.out_shape = (shape[0] // n, *rest)
        else:
            self.out_shape = shape
        self._engine = group.engine
        self._shapes = (shape, self.out_shape)
        row = int(np.prod(rest, dtype=np.int64))
        self._counts = [shape[0] // n * row] * n if op == "all_to_all_single" else None

    def __call__(self, input: Any) -> Any:
        group = self.group
        try:
            shape, dtype = input.shape, input.dtype
        except AttributeError:
            shape = dtype = None
        if (shape != self.shape or (dtype is not self.dtype and not self._accepts(dtype))
                or group.rank < 0 or group.world.destroyed):
            self._refuse(input)  # names what differs, on every rank
        op = self.op
        if not input.flags.c_contiguous:  # an input: only read, so a contiguous copy is as good
            input = array_namespace(input).ascontiguousarray(input)  # on the input's device
        if input.__class__ is _NDARRAY:
            out = np.empty(self.out_shape, dtype=dtype)
        else:  # a device array: the output lives on its device
            out = np.empty_like(input, shape=self.out_shape)
        engine, queue = self._engine, group.queue
        if op == "all_gather_into_tensor":
            queue.run(op, lambda: engine.all_gather(out, input), False, self._shapes, input, None)
        elif op == "reduce_scatter_tensor":
            reduce_op = self.reduce_op
            epilogue = queue.averaged(out) if reduce_op is _AVG and queue.divides else None
            queue.run(op, lambda: engine.reduce_scatter(out, input, reduce_op), False, self._shapes, input, epilogue,
                      reduce_op)
        elif op == "all_to_all_single":
            counts = self._counts
            queue.run(op, lambda: engine.all_to_all(out, counts, input, counts), False, self._shapes, None, None,
                      None, {"dtype": dtype, "counts": (tuple(counts), tuple(counts))})
        else:
            out[...] = input
            all_reduce_owned(group, out, self.reduce_op)  # ours: made here, C-contiguous, checked dtype
        return out

    def _accepts(self, dtype: Any) -> bool:
        """Whether ``dtype`` may be communicated by this collective (checked once per dtype)."""
        if dtype in self._dtypes:
            return True
        if self.dtype is not None or dtype.kind not in "biufc":  # prepared for another one, or not a number
            return False
        if self.op in _REDUCING:
            try:
                check_op_dtype(self.reduce_op, dtype, lambda: where(self.op, self.group))
            except (DistTypeError, DistValueError):
                return False
        self._dtypes.add(dtype)
        return True

    def _refuse(self, input: Any) -> None:
        """The input is not the prepared one: refuse it on this rank, naming what differs, and
        tell the group's other members (so that their matching call fails too, instead of
        running with mismatched sizes or waiting out the timeout)."""
        group, op = self.group, self.op
        check_member(group, op)  # not a member, or destroyed
        if not hasattr(input, "shape") or not hasattr(input, "dtype") or not hasattr(input, "flags"):  # not an array
            exc: Exception = DistTypeError(f"{where(op, group)}: input must be an array, got {type(input).__name__}")
        elif input.shape != self.shape:
            exc = DistValueError(f"{where(op, group)}: input has shape {tuple(input.shape)} but this collective was "
                                 f"prepared for shape {self.shape}")
        else:
            prepared = "any communicable dtype" if self.dtype is None else f"dtype {self.dtype}"
            exc = DistTypeError(f"{where(op, group)}: input has dtype {input.dtype} but this collective was prepared "
                                f"for {prepared}" + ("" if self.reduce_op is None or op not in _REDUCING
                                                     else f" and {self.reduce_op!r}"))
        raise group.queue.reject(op, exc)

    def __repr__(self) -> str:
        return (f"PreparedCollective({self.op}, group={self.group.name}, shape={self.shape}, "
                f"dtype={self.dtype}, reduce_op={self.reduce_op.name})")


def prepare_collective(group: ProcessGroup, op: str, shape: tuple[int, ...], dtype: Any = None, *,
                       reduce_op: ReduceOp = ReduceOp.SUM) -> PreparedCollective:
    """``op`` (a key of :data:`PREPARED_OPS`) on ``group`` for inputs of ``shape`` and ``dtype``.

    Checked here, once: membership, the op, the shape (at least 1-D; for ``reduce_scatter_tensor``
    and ``all_to_all_single`` its first dim a multiple of the group size), the dtype and the
    reduction. ``dtype=None`` accepts any dtype the collective can carry, each checked the first
    time it is seen. Local: no communication.
    """
    name = f"prepare_collective({op!r})"
    if not isinstance(group, ProcessGroup):
        raise DistTypeError(f"meshkit.comm: {name}: group must be a ProcessGroup, got {type(group).__name__}")
    check_member(group, name)
    if op not in PREPARED_OPS:
        raise DistValueError(f"{where(name, group)}: op must be one of {sorted(PREPARED_OPS)}, got {op!r}")
    shape = tuple(shape)
    if not shape or any(not isinstance(s, (int, np.integer)) or s < 0 for s in shape):
        raise DistValueError(f"{where(name, group)}: shape must be a non-empty tuple of sizes >= 0, got {shape!r}")
    shape = tuple(int(s) for s in shape)
    if op in ("reduce_scatter_tensor", "all_to_all_single") and shape[0] % group.size:
        raise DistValueError(f"{where(name, group)}: shape[0] = {shape[0]} must be a multiple of the group size "
                             f"{group.size} for {op}")
    if dtype is not None:
        try:
            dtype = np.dtype(dtype)
        except TypeError:
            raise DistTypeError(f"{where(name, group)}: dtype {dtype!r} is not a NumPy dtype") from None
        if dtype.kind not in "biufc":
            raise DistTypeError(f"{where(name, group)}: dtype {dtype} cannot be communicated; valid dtypes are "
                                "bool, integers, floats and complex")
    if op in ("reduce_scatter_tensor", "all_reduce"):
        if dtype is not None:
            reduce_op = check_op_dtype(reduce_op, dtype, lambda: where(name, group))
        elif reduce_op.__class__ is not ReduceOp:  # a name; whether it suits a dtype is checked at its first call
            try:
                reduce_op = ReduceOp[str(reduce_op).upper()]
            except KeyError:
                raise DistTypeError(f"{where(name, group)}: reduce_op={reduce_op!r} is not a ReduceOp; valid ops are "
                                    f"{[o.name for o in ReduceOp]}") from None
    return PreparedCollective(group, op, shape, dtype, reduce_op)


def all_reduce_owned(group: ProcessGroup, tensor: Any, op: ReduceOp = ReduceOp.SUM) -> None:
    """``group.all_reduce(tensor, op)`` (blocking) for a ``tensor`` the caller made itself: a new
    C-contiguous, writable NumPy array, such as a reduction's result that a compiled DTensor rule
    all-reduces in place. Its argument checks (0.3-0.5 us a call, a twentieth of a small
    collective) are the ones such an array passes by construction, so this runs the phases every
    collective takes (:meth:`CollectiveQueue.run`'s: numbered, recorded, under the group's timeout,
    checked across ranks in ``MESHKIT_DEBUG=detail``) without them: 1.8-1.9 us a call in a world of one
    where ``group.all_reduce`` took 2.1. Anything else (another array
    type, a (op, dtype) pair not yet validated, a group this rank left) takes the public method,
    which checks it and raises its errors."""
    if (tensor.__class__ is not _NDARRAY or op.__class__ is not ReduceOp or group.rank < 0
            or group.world.destroyed or (op, tensor.dtype) not in valid_op_dtypes):
        group.all_reduce(tensor, op)
        return
    # the public method's phases after its checks (ProcessGroup.all_reduce, blocking: never queued),
    # written out here as there: through CollectiveQueue.run's closure it took longer than the checks saved
    queue = group.queue
    thread = queue.thread
    if thread.pending and thread.runner != _get_ident():
        group.all_reduce(tensor, op)
        return
    seq, _ = queue.issue("all_reduce", tensor, False, op)
    epilogue = queue.averaged(tensor) if op is _AVG and queue.divides else None
    shapes = (tensor.shape,)
    try:
        request = group.engine.all_reduce(tensor, op)
    except BaseException as exc:
        raise queue.start_failed("all_reduce", seq, shapes, tensor.dtype, exc) from None
    queue.started("all_reduce", seq, shapes, tensor.dtype, request, epilogue, False)
