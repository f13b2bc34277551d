"""Distributed arrays (DTensor) over a DeviceMesh, with torch's names.

``placements`` (Shard, Replicate, Partial), ``chunks`` (the torch.chunk shard arithmetic, pure,
shared with checkpoints), ``dtensor`` (the DTensor type), ``redistribute`` (one collective per
changing mesh dim), ``distribute`` (distribute_tensor), ``dispatch`` (the NumPy protocol tables the op
modules fill), ``propagation`` (what the op rules share), the op rules ``ufuncs``, ``matmul``,
``reductions`` (and ``logsumexp``), ``shape_ops``, ``einsum``, ``joins`` (concatenate, split, take) and
``local_ops`` (copies, casts), ``indexing`` (the plan of basic indexing, no communication),
``selection`` (indexing that moves data, fancy and boolean keys, and writes),
``statistics`` (var, std, average, count_nonzero, any, all, prod, argmax, argmin, median),
``scans`` (cumsum, cumprod), ``sorting`` (sort, argsort), ``movement`` (diff, roll, flip, pad),
``linalg`` (norm, outer, trace, tensordot, dot), ``coverage`` (the table of supported operations
by placement, generated from the dispatch tables), ``verify`` (collective construction checks);
``parallel`` (tensor-parallel styles and ``parallelize``).
Depends on ``comm`` and ``mesh`` only. ``__all__`` is the user API; what ``parallel`` and
``checkpoint`` need beyond it is in :mod:`meshkit.tensor._seams`.

Modules besides those above: ``reduction_plan.py`` (a reduction's layout facts, worked out once per
layout and kept), ``errors.py`` (the ``meshkit.tensor: rank R:`` prefix), ``_seams.py``.
"""

from ..comm._seams import moved_names
# the op modules are imported for what they do: they register the NumPy op rules
from . import (einsum, joins, linalg, local_ops, matmul, movement, reductions, scans, selection,  # noqa: F401
               shape_ops, sorting, statistics, ufuncs)
from .distribute import distribute_tensor
from .dtensor import DTensor
from .parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel, parallelize
from .placements import Partial, Placement, Replicate, Shard
from .reductions import logsumexp

__all__ = ["DTensor", "distribute_tensor", "Placement", "Shard", "Replicate", "Partial",
           "parallelize", "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "logsumexp"]

#: Was in ``__all__`` in 0.1: a seam (``parallel`` and ``checkpoint`` use it), importable here one more release.
__getattr__ = moved_names(__name__, {"local_shape_and_offset": "meshkit.tensor._seams"})
