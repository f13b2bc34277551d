"""``data_parallel``: any data-parallel strategy by name, all trained by the loop of
:mod:`~meshkit.parallel.data_parallelism.protocol`."""

from __future__ import annotations

import inspect
from typing import Any, Sequence

from ...comm import DistTypeError, DistValueError
from ...mesh import DeviceMesh
from ..strategy import Strategy
from .ddp import DistributedDataParallel
from .fsdp import FullyShardedDataParallel
from .zero import ZeroRedundancyOptimizer

__all__ = ["data_parallel", "STRATEGIES"]

#: The strategies :func:`data_parallel` builds.
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "hsdp")


def _options(cls: type, taken: set[str]) -> list[str]:
    """The keyword options of ``cls``'s constructor that :func:`data_parallel` passes through."""
    return [name for name, p in inspect.signature(cls.__init__).parameters.items()
            if p.kind is p.KEYWORD_ONLY and name not in taken]


def data_parallel(params: dict[str, Any], mesh: DeviceMesh, strategy: str = "ddp", *, optimizer: Any,
                  units: Sequence[Sequence[str]] | None = None, **options: Any) -> Strategy:
    """Build a data-parallel strategy over ``mesh``: any of them trains with the same loop
    (a :class:`~meshkit.parallel.strategy.Strategy`).

    Args:
        params: ordered ``dict[str, array]`` (arrays or DTensors over another mesh dimension).
        mesh: 1-D data-parallel mesh; 2-D ``(replicate, shard)`` for ``"hsdp"``.
        strategy: ``"ddp"`` (:class:`DistributedDataParallel`), ``"zero1"``/``"zero2"``
            (:class:`ZeroRedundancyOptimizer` stage 1/2), ``"fsdp"``
            (:class:`FullyShardedDataParallel` on a 1-D mesh) or ``"hsdp"`` (the same on a 2-D mesh).
        optimizer: an :class:`~meshkit.parallel.optim.optimizers.Optimizer`; the strategy's from now on.
        units: lists of parameter names (e.g. one per layer); default one unit of everything.
        options: the strategy's own keyword options (e.g. ``bucket_cap_mb``, ``comm_hook`` for
            DDP, ``reshard_after_forward`` for FSDP).

    Raises:
        ValueError: an unknown strategy, or a mesh of the wrong dimensionality (naming the valid ones).
        TypeError: an option the strategy does not take (naming the ones it takes).
    """
    head = "meshkit.parallel.data_parallel"
    if strategy not in STRATEGIES:
        raise DistValueError(f"{head}: unknown strategy {strategy!r}; valid strategies are {', '.join(STRATEGIES)}")
    cls = {"ddp": DistributedDataParallel, "fsdp": FullyShardedDataParallel,
           "hsdp": FullyShardedDataParallel}.get(strategy, ZeroRedundancyOptimizer)
    valid = _options(cls, {"mesh", "group", "optimizer", "units", "stage"})
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise DistTypeError(f"{head}: strategy {strategy!r} takes no option(s) {unknown}; its options are "
                            f"{', '.join(valid)}")
    ndim = 2 if strategy == "hsdp" else 1
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != ndim:
        got = f"a {mesh.ndim}-D mesh with dims {mesh.mesh_dim_names}" if isinstance(mesh, DeviceMesh) else \
            type(mesh).__name__
        need = "a 2-D DeviceMesh (replicate, shard)" if ndim == 2 else "a 1-D DeviceMesh (e.g. mesh['dp'])"
        raise DistValueError(f"{head}: strategy {strategy!r} needs {need}, got {got}")
    if cls is ZeroRedundancyOptimizer:
        options["stage"] = int(strategy[-1])
    return cls(params, mesh=mesh, optimizer=optimizer, units=units, **options)
