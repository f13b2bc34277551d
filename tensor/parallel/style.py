"""Tensor-parallel styles: how a layer's parameters are cut over a 1-D ``tp`` mesh, and how its
activations are converted at the layer's boundaries (torch's ``ColwiseParallel``,
``RowwiseParallel``, ``SequenceParallel``).

meshkit's layers compute ``x @ W + b`` with ``W`` of shape ``(in, out)`` (torch's ``Linear``
stores ``(out, in)``), so the array dims are the transpose of torch's:

=====================  ===================  =================  ==================  ==================
style                  2-D weight (in, out)  1-D bias (out,)   input (default)     output (default)
=====================  ===================  =================  ==================  ==================
``ColwiseParallel``    ``Shard(1)``          ``Shard(0)``      ``Replicate()``     ``Shard(-1)``
``RowwiseParallel``    ``Shard(0)``          ``Replicate()``   ``Shard(-1)``       ``Replicate()``
``SequenceParallel``   ``Replicate()``       ``Replicate()``   ``Shard(1)``        ``Shard(1)``
=====================  ===================  =================  ==================  ==================

An embedding table ``(vocab, dim)`` has the weight's layout: colwise cuts the embedding dim,
rowwise the vocabulary, as torch does for ``nn.Embedding``.

Porting from torch (a trap: the style names match, the weight placements do not). torch's
``ColwiseParallel`` puts ``nn.Linear.weight`` ``(out, in)`` on ``Shard(0)`` and its
``RowwiseParallel`` on ``Shard(1)``; here the weight is ``(in, out)``, so colwise is ``Shard(1)``
and rowwise ``Shard(0)`` (biases agree: ``Shard(0)`` and ``Replicate()``). Keep torch's plan (the
same style for the same layer) and transpose the weights once: ``w = linear.weight.detach().numpy().T``
(and ``.T`` again to load a meshkit weight into torch); a weight placed by hand with torch's
``Shard(0)`` for colwise would cut the input features instead, which computes without an error
and gives the wrong layer. Activations agree: ``Shard(-1)`` is the feature dim in both.

Worked example, 2 ranks on mesh ``[0, 1]``, ``W`` of shape ``(4, 6)``, ``b`` of shape ``(6,)``:
``ColwiseParallel`` gives rank 0 ``W[:, 0:3]`` and ``b[0:3]``, rank 1 ``W[:, 3:6]`` and
``b[3:6]``; ``RowwiseParallel`` gives rank 0 ``W[0:2]``, rank 1 ``W[2:4]``, both the whole ``b``.
Sizes that do not divide are cut as ``torch.chunk`` cuts them (6 over 4 ranks: 2, 2, 2, 0).

There are no modules to hook, so a style also hands the user's forward pass the conversions
torch's module hooks do: :meth:`~ParallelStyle.prepare_input` (a plain array is taken as laid out
by ``input_layouts``, then redistributed to what the layer needs) and
:meth:`~ParallelStyle.prepare_output` (redistributed to ``output_layouts``; this rank's block
when ``use_local_output``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

from ...mesh import DeviceMesh
from .. import errors
from ..dtensor import DTensor
from ..placements import Placement, Replicate, Shard

__all__ = ["ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel"]


def _one_placement(style: str, arg: str, value: Any, default: Placement) -> Placement:
    """``value`` as one Placement (a Placement or a 1-sequence of one); ``default`` for None."""
    if value is None:
        return default
    if isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 1:
        value = value[0]
    if not isinstance(value, Placement):
        raise errors.type_error(style, f"{arg} must be a Placement (Shard, Replicate or Partial) for the 1-D tp "
                                       f"mesh, got {value!r}")
    return value


class ParallelStyle:
    """Base of the tensor-parallel styles: a parameter's placement and the boundary conversions.

    Subclasses set ``input_layouts``, ``output_layouts``, ``use_local_output`` and define
    :meth:`param_placement` and ``_desired_input`` (what the layer computes on).
    """

    input_layouts: Placement
    output_layouts: Placement
    use_local_output: bool

    def param_placement(self, name: str, shape: Sequence[int]) -> Placement:
        """The placement of parameter ``name`` (of global ``shape``) on the 1-D tp mesh."""
        raise NotImplementedError

    def _desired_input(self) -> Placement:
        raise NotImplementedError

    def prepare_input(self, x: Any, device_mesh: DeviceMesh | None = None, *,
                      shape: Sequence[int] | None = None) -> DTensor:
        """The layer's input as the DTensor the layer computes on (torch's input hook).

        Args:
            x: a DTensor (used as it is laid out), or this rank's plain array, taken as laid out
                by ``input_layouts`` (``DTensor.from_local``).
            device_mesh: the tp mesh; needed for a plain ``x``, else it must be ``x``'s mesh.
            shape: the global shape of a plain ``x`` (the same on every rank). Without it, a
                Shard input's block sizes are gathered (``DTensor.from_local``: one all-gather
                of 67 int64), so uneven blocks are right; pass it to skip that collective.

        Returns:
            ``x`` redistributed to the layer's input placement (logged at DEBUG when it moves):
            ``Replicate()`` for colwise, ``Shard(-1)`` for rowwise, ``Shard(sequence_dim)`` for
            sequence parallel.

        Example (2 ranks, ``ColwiseParallel(input_layouts=Shard(0))``, each rank's batch
        block ``x_r`` of shape ``(4, 8)``): returns a ``Replicate()`` DTensor of shape
        ``(8, 8)``, the two blocks stacked (an all-gather).
        """
        op = f"{type(self).__name__}.prepare_input"
        if isinstance(x, DTensor):
            if device_mesh is not None and device_mesh != x.device_mesh:
                raise errors.value_error(op, f"x is on mesh {x.device_mesh!r}, not device_mesh {device_mesh!r}")
            if x.device_mesh.ndim != 1:
                raise errors.value_error(op, f"x is on a {x.device_mesh.ndim}-D mesh; tensor-parallel styles work on "
                                             "a 1-D tp mesh (e.g. mesh['tp'])")
        else:
            if device_mesh is None:
                raise errors.value_error(op, f"x is a plain {type(x).__name__}: pass the tp device_mesh to lay it out "
                                             f"as input_layouts={self.input_layouts!r}")
            x = DTensor.from_local(x, device_mesh, [self.input_layouts], shape=shape)
        return x.redistribute(placements=[self._desired_input()])

    def prepare_output(self, y: DTensor) -> Any:
        """The layer's output redistributed to ``output_layouts`` (torch's output hook).

        Returns this rank's block (``to_local()``) when ``use_local_output``, else the DTensor.
        Example (``RowwiseParallel()``): ``y = x @ W`` is ``Partial(sum)``; this all-reduces it
        to ``Replicate()``; with ``output_layouts=Shard(0)`` it reduce-scatters the rows instead.
        """
        op = f"{type(self).__name__}.prepare_output"
        if not isinstance(y, DTensor):
            raise errors.type_error(op, f"y must be the layer's DTensor output, got {type(y).__name__}")
        y = y.redistribute(placements=[self.output_layouts])
        return y.to_local() if self.use_local_output else y

    def _weight_or_bias(self, name: str, shape: Sequence[int], weight: Placement, bias: Placement) -> Placement:
        if len(shape) == 2:
            return weight
        if len(shape) == 1:
            return bias
        raise errors.value_error(f"{type(self).__name__}.param_placement", f"parameter {name!r} has shape {tuple(shape)}; this style "
                                 f"lays out a 2-D weight (in, out) as {weight!r} and a 1-D bias (out,) as {bias!r}, "
                                 "nothing else")


def _check_flag(style: str, use_local_output: Any) -> None:
    if not isinstance(use_local_output, bool):
        raise errors.type_error(style, f"use_local_output must be a bool, got {use_local_output!r}")


@dataclass(frozen=True, kw_only=True)
class _LinearStyle(ParallelStyle):
    """What colwise and rowwise share: torch's three keyword arguments, checked and defaulted."""

    input_layouts: Any = None
    output_layouts: Any = None
    use_local_output: bool = True

    #: (default input_layouts, default output_layouts, 2-D weight, 1-D bias, what the layer computes on)
    _LAYOUT: ClassVar[tuple[Placement, Placement, Placement, Placement, Placement]]

    def __post_init__(self) -> None:
        name = type(self).__name__
        default_in, default_out = self._LAYOUT[:2]
        object.__setattr__(self, "input_layouts", _one_placement(name, "input_layouts", self.input_layouts,
                                                                 default_in))
        object.__setattr__(self, "output_layouts", _one_placement(name, "output_layouts", self.output_layouts,
                                                                  default_out))
        _check_flag(name, self.use_local_output)

    def param_placement(self, name: str, shape: Sequence[int]) -> Placement:
        return self._weight_or_bias(name, shape, self._LAYOUT[2], self._LAYOUT[3])

    def _desired_input(self) -> Placement:
        return self._LAYOUT[4]


class ColwiseParallel(_LinearStyle):
    """Cut a linear layer's output features: weight ``(in, out)`` ``Shard(1)``, bias ``Shard(0)``.

    torch's ``ColwiseParallel`` puts its ``(out, in)`` weight on ``Shard(0)``: a port transposes
    the weight (``W = torch_weight.T``) and keeps the plan (the module docstring has the details).

    The layer computes on a ``Replicate()`` input and gives a ``Shard(-1)`` output with no
    communication (Megatron's first GEMM). Args (keyword-only, torch's):

    * ``input_layouts``: how a plain input array is laid out (default ``Replicate()``).
    * ``output_layouts``: where :meth:`prepare_output` puts the output (default ``Shard(-1)``).
    * ``use_local_output``: :meth:`prepare_output` returns this rank's block (default True, as
      torch); pass False to keep computing on DTensors.
    """

    _LAYOUT = (Replicate(), Shard(-1), Shard(1), Shard(0), Replicate())


class RowwiseParallel(_LinearStyle):
    """Cut a linear layer's input features: weight ``(in, out)`` ``Shard(0)``, bias ``Replicate()``.

    torch's ``RowwiseParallel`` puts its ``(out, in)`` weight on ``Shard(1)``: a port transposes
    the weight (``W = torch_weight.T``) and keeps the plan.

    The layer computes on a ``Shard(-1)`` input; ``x @ W`` is ``Partial(sum)``, which
    :meth:`prepare_output` all-reduces to ``Replicate()`` (Megatron's one forward all-reduce) or
    reduce-scatters to a ``Shard``. Args (keyword-only, torch's): ``input_layouts`` (default
    ``Shard(-1)``), ``output_layouts`` (default ``Replicate()``), ``use_local_output`` (default
    True).
    """

    _LAYOUT = (Shard(-1), Replicate(), Shard(0), Replicate(), Shard(-1))


@dataclass(frozen=True, kw_only=True)
class SequenceParallel(ParallelStyle):
    """Replicated parameters, activations cut along the sequence dim (norms, dropout; torch's).

    Every parameter (any shape) is ``Replicate()``; the input and output are
    ``Shard(sequence_dim)``: a plain input array is taken as already cut along it, a DTensor is
    redistributed to it. Args (keyword-only, torch's): ``sequence_dim`` (default 1, for
    ``(batch, sequence, hidden)`` activations), ``use_local_output`` (default False, as torch).
    """

    sequence_dim: int = 1
    use_local_output: bool = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        if isinstance(self.sequence_dim, bool) or not isinstance(self.sequence_dim, int):
            raise errors.type_error(name, f"sequence_dim must be an int, got {self.sequence_dim!r}")
        _check_flag(name, self.use_local_output)

    @property
    def input_layouts(self) -> Placement:  # type: ignore[override]
        """``Shard(sequence_dim)``."""
        return Shard(self.sequence_dim)

    @property
    def output_layouts(self) -> Placement:  # type: ignore[override]
        """``Shard(sequence_dim)``."""
        return Shard(self.sequence_dim)

    def param_placement(self, name: str, shape: Sequence[int]) -> Placement:
        return Replicate()

    def _desired_input(self) -> Placement:
        return Shard(self.sequence_dim)
