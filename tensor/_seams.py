"""tensor's seams: what ``parallel`` and ``checkpoint`` need of the tensor package that is not user API.

:func:`local_shape_and_offset` (the block a mesh coordinate holds, ``torch.chunk``'s arithmetic)
is how DTensor blocks become data-parallel shards and checkpoint boxes; torch keeps its own
(``compute_local_shape_and_global_offset``) in the private ``torch.distributed.tensor._utils``.

:func:`block_like` wraps state built beside a DTensor parameter (its optimizer state) as the
parameter is laid out, carrying what the parameter still has to check across ranks.
"""

from .chunks import local_shape_and_offset
from .dtensor import block_like

__all__ = ["local_shape_and_offset", "block_like"]
