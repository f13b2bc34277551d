"""ParallelDims: the degrees of each kind of parallelism, validated, and the mesh they make.

In the style of torchtitan's ``ParallelDims``: a small frozen dataclass, ``-1`` meaning "infer
this degree from the world size", checked in ``__post_init__``, with ``build_mesh``.
"""

from __future__ import annotations

import dataclasses
import math

from ..comm import DistTypeError, DistValueError
from . import errors
from .device_mesh import DeviceMesh, init_device_mesh

__all__ = ["ParallelDims"]

_DEGREES = ("dp_replicate", "dp_shard", "tp")


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """Degrees of replicated data parallelism, sharded data parallelism and tensor parallelism.

    Their product is the world size; at most one may be -1 (inferred). Size-1 degrees are fine.

    Example (8 ranks)::

        dims = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, world_size=8)   # dp_shard -> 2
        mesh = dims.build_mesh("cpu")
        mesh.mesh_dim_names      # ("dp_replicate", "dp_shard", "tp")
        mesh["dp"].mesh          # rank 0: [0, 2, 4, 6]  (dp_replicate x dp_shard, flattened)
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    world_size: int = 1

    def __post_init__(self) -> None:
        head = errors.prefix(None)
        for name in (*_DEGREES, "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise DistTypeError(f"{head}ParallelDims.{name} must be an int, got {value!r} "
                                    f"({type(value).__name__})")
        if self.world_size < 1:
            raise DistValueError(f"{head}ParallelDims.world_size must be >= 1, got {self.world_size}")
        degrees = {name: getattr(self, name) for name in _DEGREES}
        bad = {n: v for n, v in degrees.items() if v < 1 and v != -1}
        if bad:
            raise DistValueError(f"{head}ParallelDims degrees must be >= 1 or -1 (infer), got {bad}")
        inferred = [n for n, v in degrees.items() if v == -1]
        if len(inferred) > 1:
            raise DistValueError(f"{head}ParallelDims can infer one degree, but {inferred} are all -1")
        known = math.prod(v for v in degrees.values() if v != -1)
        if inferred:
            if self.world_size % known:
                raise DistValueError(f"{head}ParallelDims cannot infer {inferred[0]}: world_size "
                                 f"{self.world_size} is not divisible by the other degrees' product {known}")
            object.__setattr__(self, inferred[0], self.world_size // known)
        elif known != self.world_size:
            raise DistValueError(f"{head}ParallelDims degrees {degrees} multiply to {known}, but world_size "
                             f"is {self.world_size}")

    @property
    def dp(self) -> int:
        """Total data-parallel degree: ``dp_replicate * dp_shard``."""
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """The 3-D mesh ``("dp_replicate", "dp_shard", "tp")``, with ``"dp"`` flattened on it.

        Collective over the world; costs one split per dimension plus one for ``"dp"`` (none
        when one of the two dp degrees is 1, since ``"dp"`` then equals an existing dimension).
        """
        mesh = init_device_mesh(device_type, (self.dp_replicate, self.dp_shard, self.tp), mesh_dim_names=_DEGREES)
        mesh["dp_replicate", "dp_shard"].flatten("dp")
        return mesh
