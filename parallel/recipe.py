"""``parallelize_model``: the recipe that composes a model's strategies on a mesh of named dimensions.

torchtitan's ``parallelize`` applies tensor parallelism, then context parallelism, then data
parallelism (FSDP or DDP), each to the model the previous one left; this is that recipe for a
model given as named arrays, so that a training script states *what* goes where (a plan, the
mesh's dimension names, a strategy name) and never builds, adapts or dispatches on strategies
itself::

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    model = parallelize_model(params, mesh, optimizer=lambda: AdamW(lr=1e-3),
                              tp_plan={"w*": Shard(1)}, context_parallel=True, strategy="fsdp")
    loop.train(model, ...)                        # one Strategy, whatever the mesh

What each step does to the dense parameters (``params``, full arrays, the same on every rank):

1. tensor parallel (``tp_plan``): every parameter becomes a DTensor over ``mesh[tp_dim]``
   (:func:`meshkit.tensor.parallelize`; a plan's value may also be a bare ``Placement``);
2. context parallel: the ranks of ``cp_dim`` hold other tokens of the same sequences, so they
   join the data-parallel ranks (torchtitan's ``dp_shard_cp``): their gradients are averaged too;
3. data parallel (``strategy``, any of :data:`~meshkit.parallel.STRATEGIES`) over ``dp_dims``
   (and ``cp_dim``) flattened into one dimension, in the mesh's order.

Parameters whose gradients come out of their own layer already reduced (a mixture of experts'
router and experts, as :class:`~meshkit.parallel.MoE` computes them) are given as ``experts``
(``{name: ShardedArray}`` of this rank's blocks) and trained by an
:class:`~meshkit.parallel.ExpertStrategy` over the mesh's ranks outside ``pp_dim``. Where a rank
holds both kinds, the result is one :class:`~meshkit.parallel.Composite` of the two; where it
holds one kind (a pipeline stage's ranks), that strategy alone.

The call is collective over the whole mesh (flattening a mesh is): every rank calls it with the
same dimension names and strategy, also a rank whose pipeline stage holds no dense parameters
(``params={}``) or no experts (``experts=None``). It flattens the data-parallel dimensions and the
dimensions outside ``pp_dim`` (the experts' ranks) on every rank, as no rank knows whether another
holds experts; a flattening over ranks that already have a group (the world's, or a mesh's
dimension) reuses its communicator.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..comm import DistTypeError, DistValueError
from ..mesh import DeviceMesh
from ..state import ShardedArray
from ..tensor import ParallelStyle, Placement, parallelize
from .checks import where
from .composite import Composite
from .data_parallelism.factory import STRATEGIES, data_parallel
from .expert_parallelism.expert_strategy import ExpertStrategy
from .optim.optimizers import Optimizer
from .strategy import Strategy

__all__ = ["parallelize_model"]

_OP = "parallelize_model"


class _Placed(ParallelStyle):
    """A plan entry given as a bare ``Placement``: the parameter's placement on the tp mesh as it is
    (for parameters that are not a 2-D linear weight or a 1-D bias, e.g. attention's ``(d, heads,
    head_dim)``)."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement

    def param_placement(self, name: str, shape: Sequence[int]) -> Placement:
        return self.placement

    def __eq__(self, other: object) -> bool:  # two globs giving one name the same placement agree
        return isinstance(other, _Placed) and other.placement == self.placement

    def __hash__(self) -> int:
        return hash(self.placement)

    def __repr__(self) -> str:
        return repr(self.placement)


def _dim(mesh: DeviceMesh, arg: str, name: Any) -> str:
    if not isinstance(name, str):
        raise DistTypeError(f"{where(_OP)}: {arg} must be a mesh dimension's name (a str), got "
                            f"{type(name).__name__} {name!r}")
    if name not in mesh.mesh_dim_names:
        raise DistValueError(f"{where(_OP)}: {arg} {name!r} is not a dimension of the mesh; its dimensions are "
                             f"{list(mesh.mesh_dim_names)}")
    return name


def _one_dim(mesh: DeviceMesh, dims: Sequence[str]) -> DeviceMesh:
    """``dims`` (in the mesh's order) as one 1-D mesh: the dimension itself, or their flattening
    (collective over the root mesh; the same ranks reuse their communicator)."""
    ordered = tuple(d for d in mesh.mesh_dim_names if d in dims)
    return mesh[ordered[0]] if len(ordered) == 1 else mesh[ordered].flatten()


def _optimizers(optimizer: Any) -> Callable[[], Optimizer]:
    """One new optimizer for each part: the factory's, or the given one then fresh ones like it."""
    if isinstance(optimizer, Optimizer):
        given = [optimizer]
        return lambda: given.pop() if given else type(optimizer)(**optimizer.hyper)
    if callable(optimizer):
        def make() -> Optimizer:
            made = optimizer()
            if not isinstance(made, Optimizer):
                raise DistTypeError(f"{where(_OP)}: optimizer() must return a meshkit.parallel.Optimizer, got "
                                    f"{type(made).__name__}")
            return made
        return make
    raise DistTypeError(f"{where(_OP)}: optimizer must be a meshkit.parallel.Optimizer or a function making one, "
                        f"got {type(optimizer).__name__}")


def parallelize_model(params: Mapping[str, Any] | None, mesh: DeviceMesh, *,
                      optimizer: Optimizer | Callable[[], Optimizer],
                      tp_plan: Mapping[str, ParallelStyle | Placement] | None = None, tp_dim: str = "tp",
                      context_parallel: bool = False, cp_dim: str = "cp", dp_dims: Sequence[str] = ("dp",),
                      strategy: str = "ddp", experts: Mapping[str, ShardedArray] | None = None,
                      pp_dim: str | None = None, src_data_rank: int | None = 0,
                      units: Sequence[Sequence[str]] | None = None, **options: Any) -> Strategy:
    """Tensor parallel, then context parallel, then data parallel: one Strategy of the whole model.

    Args:
        params: ``{name: full array}`` of the dense parameters (this rank's pipeline stage's; empty
            or None where it holds none).
        mesh: the root mesh, with dimension names.
        optimizer: an :class:`~meshkit.parallel.Optimizer` (the dense part's; the experts get a new
            one of the same class and hyperparameters) or a function making one for each part.
        tp_plan: ``{name or glob: ParallelStyle or Placement}`` over ``mesh[tp_dim]``
            (:func:`meshkit.tensor.parallelize`); None: no tensor parallelism, plain arrays.
        tp_dim: the tensor-parallel dimension's name.
        context_parallel: whether ``cp_dim``'s ranks hold other tokens of the same sequences
            (their gradients are then averaged with ``dp_dims``').
        cp_dim: the context-parallel dimension's name.
        dp_dims: the names of the dimensions whose ranks hold other sequences (e.g. ``("dp",
            "ep")``: expert parallelism borrowing data parallelism); ``"hsdp"`` takes two,
            ``(replicate, shard)``.
        strategy: the data-parallel strategy, one of :data:`~meshkit.parallel.STRATEGIES`.
        experts: ``{name: ShardedArray}``: this rank's blocks of parameters reduced by their own
            layer (an :class:`~meshkit.parallel.ExpertStrategy`), or None.
        pp_dim: the pipeline dimension's name, if any: the experts' ranks are those of one stage.
        src_data_rank: :func:`meshkit.tensor.parallelize`'s (None: every rank passes the same
            values and cuts its block locally, sending nothing).
        units, options: the data-parallel strategy's (:func:`~meshkit.parallel.data_parallel`).

    Returns:
        The :class:`~meshkit.parallel.Strategy`: a :class:`~meshkit.parallel.Composite` of the
        dense part and the experts, or the one of them this rank holds.

    Raises:
        DistTypeError: the mesh is not a named ``DeviceMesh``, a dimension name is not a str, the
            optimizer is not one (each naming the argument).
        DistValueError: a dimension name not in the mesh, an unknown strategy, ``"hsdp"`` without
            two ``dp_dims``, a dimension named twice, or nothing to parallelize (each naming the
            argument).
    """
    if not isinstance(mesh, DeviceMesh) or not mesh.mesh_dim_names:
        got = "a mesh without dimension names" if isinstance(mesh, DeviceMesh) else type(mesh).__name__
        raise DistTypeError(f"{where(_OP)}: mesh must be a DeviceMesh with mesh_dim_names, got {got}")
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise DistValueError(f"{where(_OP)}: strategy {strategy!r} is unknown; valid strategies are "
                             f"{', '.join(STRATEGIES)}")
    if isinstance(dp_dims, str) or not isinstance(dp_dims, Sequence) or not dp_dims:
        raise DistTypeError(f"{where(_OP)}: dp_dims must be a non-empty sequence of dimension names, got {dp_dims!r}")
    data = [_dim(mesh, "dp_dims", d) for d in dp_dims]
    if context_parallel:
        data.append(_dim(mesh, "cp_dim", cp_dim))
    tp = _dim(mesh, "tp_dim", tp_dim) if tp_plan is not None else None
    pp = _dim(mesh, "pp_dim", pp_dim) if pp_dim is not None else None
    named = data + [d for d in (tp, pp) if d is not None]
    twice = sorted({d for d in named if named.count(d) > 1})
    if twice:
        raise DistValueError(f"{where(_OP)}: dimension(s) {twice} named twice among dp_dims, cp_dim, tp_dim and "
                             "pp_dim; each dimension plays one part")
    if strategy == "hsdp" and (len(dp_dims) != 2 or context_parallel):
        raise DistValueError(f"{where(_OP)}: strategy 'hsdp' takes dp_dims=(replicate, shard), two names, and no "
                             f"context_parallel; got dp_dims={tuple(dp_dims)!r}, context_parallel={context_parallel}")
    if tp_plan is not None and not isinstance(tp_plan, Mapping):
        raise DistTypeError(f"{where(_OP)}: tp_plan must be a dict of name or glob -> ParallelStyle or Placement, got "
                            f"{type(tp_plan).__name__}")
    if params is not None and not isinstance(params, Mapping):
        raise DistTypeError(f"{where(_OP)}: params must be a dict of name -> array (or None), got "
                            f"{type(params).__name__}")
    if not params and experts is None:
        raise DistValueError(f"{where(_OP)}: nothing to parallelize: params is empty and experts is None")
    make = _optimizers(optimizer)

    # Every rank builds the meshes (flattening is collective over the root), used or not.
    if strategy == "hsdp":
        data_mesh = mesh[tuple(dp_dims)]
    else:
        data_mesh = _one_dim(mesh, data)
    stage_mesh = _one_dim(mesh, tuple(d for d in mesh.mesh_dim_names if d != pp))  # the experts' ranks

    parts: list[Strategy] = []
    if params:
        dense = dict(params)
        if tp_plan is not None:  # 1. tensor parallel
            plan = {k: _Placed(v) if isinstance(v, Placement) else v for k, v in tp_plan.items()}
            dense = parallelize(dense, mesh[tp], plan, src_data_rank=src_data_rank)
        # 2. context parallel: cp's ranks are among data_mesh's; 3. data parallel over them all.
        parts.append(data_parallel(dense, data_mesh, strategy, optimizer=make(), units=units, **options))
    if experts is not None:
        parts.append(ExpertStrategy(experts, optimizer=make(), group=stage_mesh.get_group()))
    return parts[0] if len(parts) == 1 else Composite(parts)
