"""NumPy dtypes and meshkit's ReduceOps as MPI sees them: the datatype and op of each, cached.

Kept apart from the engine because it is a translation table, not communication: every
collective asks it once per dtype (the engine's ``all_reduce`` reads the cache directly, its
hottest line). Dtypes MPI does not know travel as opaque elements reduced by NumPy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from ..reduce_op import ReduceOp, combine_into

__all__ = ["spec", "specs"]

_BOOL_OPS = {ReduceOp.MIN: MPI.LAND, ReduceOp.MAX: MPI.LOR, ReduceOp.BAND: MPI.LAND, ReduceOp.BOR: MPI.LOR,
             ReduceOp.BXOR: MPI.LXOR}
_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.AVG: MPI.SUM, ReduceOp.PRODUCT: MPI.PROD, ReduceOp.MIN: MPI.MIN,
        ReduceOp.MAX: MPI.MAX, ReduceOp.BAND: MPI.BAND, ReduceOp.BOR: MPI.BOR, ReduceOp.BXOR: MPI.BXOR}
#: dtype -> what :func:`spec` answers for it, filled by :func:`spec`.
specs: dict[np.dtype, tuple[MPI.Datatype, dict[ReduceOp, MPI.Op]]] = {}


def spec(dtype: np.dtype) -> tuple[MPI.Datatype, dict[ReduceOp, MPI.Op]]:
    """The MPI datatype of ``dtype`` and the MPI op of every ReduceOp for it (cached per dtype).

    Dtypes MPI does not know (e.g. float16 on an MPI without MPIX_C_FLOAT16) travel as opaque
    elements of their size, reduced by NumPy user ops; booleans reduce with MPI's logical ops.
    """
    found = specs.get(dtype)
    if found is None:
        try:
            datatype = MPI.Datatype.fromcode(dtype.char)
            ops = _BOOL_OPS if dtype.kind == "b" else _OPS
        except (ValueError, KeyError):
            datatype = MPI.BYTE.Create_contiguous(dtype.itemsize).Commit()
            ops = {op: _user_op(op, dtype) for op in ReduceOp}
        found = specs[dtype] = (datatype, ops)
    return found


def _user_op(op: ReduceOp, dtype: np.dtype) -> MPI.Op:
    def combine(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        combine_into(op, np.frombuffer(inoutbuf, dtype), np.frombuffer(inbuf, dtype))
    return MPI.Op.Create(combine, commute=True)
