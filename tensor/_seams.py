"""tensor's seams: what ``parallel`` and ``checkpoint`` need of the tensor package that is not user API.

:func:`local_shape_and_offset` (the block a mesh coordinate holds, ``torch.chunk``'s arithmetic)
is how DTensor blocks become data-parallel shards and checkpoint boxes; torch keeps its own
(``compute_local_shape_and_global_offset``) in the private ``torch.distributed.tensor._utils``.
"""

from .chunks import local_shape_and_offset

__all__ = ["local_shape_and_offset"]
