"""Tensor parallelism for NumPy models without autograd (torch's ``torch.distributed.tensor.parallel``).

``style`` (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``: a parameter's
placement and the activation conversions at a layer's boundaries) and ``apply_plan`` (``parallelize``:
a dict of parameters to DTensors by a ``{name or glob: style}`` plan).

A Megatron MLP block on a ``dp x tp`` mesh, plain NumPy on DTensors::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    params = parallelize(params, mesh["tp"], {"[wb]0": ColwiseParallel(use_local_output=False),
                                              "[wb]1": RowwiseParallel(use_local_output=False)})
    x = plan0.prepare_input(x_local, mesh["tp"])          # Replicate over tp
    h = np.tanh(x @ params["w0"] + params["b0"])         # Shard(1): no communication
    y = plan1.prepare_output(h @ params["w1"] + params["b1"])   # one all-reduce

The hand-written backward gives every gradient its parameter's placements (``h.T @ dy`` is
``Shard(0)`` like ``w1``), so :class:`~meshkit.parallel.SGD`, :class:`~meshkit.parallel.AdamW` and
:func:`~meshkit.parallel.clip_grad_norm_` take the DTensor dicts directly, and so do the
data-parallel strategies over ``dp``: give :class:`~meshkit.parallel.DistributedDataParallel`
(or :class:`~meshkit.parallel.ZeroRedundancyOptimizer`, :class:`~meshkit.parallel.FullyShardedDataParallel`)
the DTensor dict as it is, ``DistributedDataParallel(params, mesh=mesh["dp"])``, and hand it each
gradient as a DTensor laid out as its parameter; ``ddp.params`` and ``ddp.grads`` are DTensors with the parameters' placements
(see ``examples/train_tp.py``).
"""

from .apply_plan import parallelize, plan_placements
from .style import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

__all__ = ["parallelize", "plan_placements", "ParallelStyle", "ColwiseParallel", "RowwiseParallel",
           "SequenceParallel"]
