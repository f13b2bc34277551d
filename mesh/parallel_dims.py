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

_DEGREES = ("dp_replicate", "dp_shard", "tp", "cp", "pp")
#: The degrees whose product is the world size, in the order of the mesh's dimensions.
_MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """Degrees of each kind of parallelism: replicated and sharded data parallelism, context
    (sequence) parallelism, tensor parallelism, pipeline parallelism, and expert parallelism.

    ``pp * dp_replicate * dp_shard * cp * tp`` is the world size; at most one of them may be -1
    (inferred). ``ep`` is not a factor of its own: as in torchtitan, experts borrow the ranks of
    ``dp_shard x cp`` (the ranks that hold different tokens of one model replica), so ``ep`` must
    be a multiple of ``cp`` and divide ``dp_shard * cp``: ``ep = dp_shard_in_ep * cp`` and
    ``dp_shard = dp_shard_mod_ep * dp_shard_in_ep``. Size-1 degrees are fine.

    Example (8 ranks)::

        dims = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, world_size=8)   # dp_shard -> 2
        mesh = dims.build_mesh("cpu")
        mesh.mesh_dim_names      # ("dp_replicate", "dp_shard", "tp")
        mesh["dp"].mesh          # rank 0: [0, 2, 4, 6]  (dp_replicate x dp_shard, flattened)

        dims = ParallelDims(dp_shard=4, ep=2, world_size=4)   # 2 groups of 2 ranks share experts
        mesh = dims.build_mesh("cpu")
        mesh["ep"].mesh          # rank 0: [0, 1]; mesh["dp_shard_mod_ep"]: [0, 2] (expert replicas)
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    world_size: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        head = errors.prefix(None)
        for name in (*_DEGREES, "ep", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise DistTypeError(f"{head}ParallelDims.{name} must be an int, got {value!r} "
                                    f"({type(value).__name__})")
        if self.world_size < 1:
            raise DistValueError(f"{head}ParallelDims.world_size must be >= 1, got {self.world_size}")
        if self.ep < 1:
            raise DistValueError(f"{head}ParallelDims.ep must be >= 1 (experts borrow dp_shard x cp; it is never "
                                 f"inferred), got {self.ep}")
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
            shown = {n: v for n, v in degrees.items() if v != 1 or n in ("dp_replicate", "dp_shard", "tp")}
            raise DistValueError(f"{head}ParallelDims degrees {shown} multiply to {known}, but world_size "
                             f"is {self.world_size}")
        if self.ep > 1 and (self.ep % self.cp or (self.dp_shard * self.cp) % self.ep):
            raise DistValueError(
                f"{head}ParallelDims.ep {self.ep} must borrow whole ranks of dp_shard x cp "
                f"({self.dp_shard} x {self.cp}): it must be a multiple of cp {self.cp} and divide "
                f"dp_shard * cp = {self.dp_shard * self.cp} (torchtitan's rule: ep = dp_shard_in_ep * cp)")

    @property
    def dp(self) -> int:
        """Total data-parallel degree: ``dp_replicate * dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_in_ep(self) -> int:
        """The part of ``dp_shard`` inside an expert group: ``ep // cp``."""
        return self.ep // self.cp

    @property
    def dp_shard_mod_ep(self) -> int:
        """The part of ``dp_shard`` across expert groups (ranks holding the same experts): ``dp_shard * cp // ep``."""
        return self.dp_shard * self.cp // self.ep

    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """The mesh of these degrees, with the groups each parallelism needs flattened on it.

        Dimensions, outermost first: ``pp`` (if > 1), ``dp_replicate``, ``dp_shard`` (split into
        ``dp_shard_mod_ep``, ``dp_shard_in_ep`` when ``ep > 1``), ``cp`` (if > 1), ``tp``; with
        ``dp_replicate``, ``dp_shard`` and ``tp`` always present, a mesh without cp, pp or ep is
        the 3-D ``("dp_replicate", "dp_shard", "tp")``. Flattened on it: ``"dp"``
        (dp_replicate x dp_shard, the batch split), and where they exist ``"dp_shard"`` (its two
        parts), ``"dp_cp"`` (dp x cp: the ranks that average gradients of parameters
        replicated over cp), ``"ep"`` (dp_shard_in_ep x cp) and ``"dp_mod_ep"``
        (dp_replicate x dp_shard_mod_ep: the ranks that hold the same experts and average
        their gradients). Collective over the world: one split per dimension plus one per
        flattened group that is not a dimension already.
        """
        ep = self.ep > 1
        sizes: list[int] = []
        names: list[str] = []
        for name in _MESH_ORDER:
            size = getattr(self, name)
            if name in ("pp", "cp") and size == 1:
                continue
            if name == "dp_shard" and ep:
                sizes += [self.dp_shard_mod_ep, self.dp_shard_in_ep]
                names += ["dp_shard_mod_ep", "dp_shard_in_ep"]
                continue
            sizes.append(size)
            names.append(name)
        mesh = init_device_mesh(device_type, tuple(sizes), mesh_dim_names=tuple(names))
        shard = ("dp_shard_mod_ep", "dp_shard_in_ep") if ep else ("dp_shard",)
        if ep:
            mesh[shard].flatten("dp_shard")
        mesh[("dp_replicate", *shard)].flatten("dp")
        if self.cp > 1:
            mesh[("dp_replicate", *shard, "cp")].flatten("dp_cp")
        if ep:
            mesh[("dp_shard_in_ep", "cp") if self.cp > 1 else ("dp_shard_in_ep",)].flatten("ep")
            mesh["dp_replicate", "dp_shard_mod_ep"].flatten("dp_mod_ep")
        return mesh
