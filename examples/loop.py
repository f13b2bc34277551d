"""The examples' training loop, written once against the data-parallel protocol.

``train_mlp.py``, ``train_tp.py`` and ``train_3d.py`` train through :func:`train`, and so does
train_mlp's single-process reference (the library's ``meshkit.parallel.LocalStrategy``). A step is the
protocol's (:mod:`meshkit.parallel.data_parallelism.protocol`), whatever the strategy::

    model.zero_grad()
    loss = run_pass(model, step)   # forward and backward: unshard units, mark_grad_ready(name, grad)
    model.step()                   # finish the gradient sync, run the optimizer

``run_pass`` is the example's own model code: ``mlp.forward_layers``/``backward_layers`` unshard
one layer's unit at a time (prefetching the next); train_tp's and train_3d's passes take every
unit at once with :func:`unsharded`, and train_3d's runs its pipeline schedule inside it. Any
strategy that :func:`meshkit.parallel.data_parallel` builds fits, so no example dispatches on a
strategy's kind or class.

Like ``mlp.py`` it is not part of the installed package: a script beside it imports it as ``loop``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from tqdm import tqdm

from meshkit.parallel import Strategy

__all__ = ["train", "unsharded", "progress_bar"]


def train(model: Strategy, steps: range, run_pass: Callable[[Any, int], Any], *, global_loss: Callable[[Any], float],
          progress: bool = False, after_step: Callable[[int], None] | None = None) -> list[float]:
    """Train ``model`` (any strategy of the protocol) for ``steps``; return each step's global loss.

    Args:
        model: any ``meshkit.parallel.Strategy`` (one :func:`meshkit.parallel.data_parallel` built, a
            ``LocalStrategy``, a ``Composite``).
        steps: the steps to run (``range(start, total)`` after a resume).
        run_pass: ``run_pass(model, step) -> loss``: the step's forward and backward pass on this
            rank's share of its batch, handing every gradient to ``model.mark_grad_ready``.
        global_loss: this rank's loss (what ``run_pass`` returned) -> the step's loss over the
            global batch (e.g. an all-reduce over the data-parallel ranks).
        progress: show a progress bar with the loss (on rank 0, say).
        after_step: called with the number of steps done after each step (e.g. to save a checkpoint).
    """
    losses: list[float] = []
    with progress_bar(len(steps), enabled=progress) as show:
        for step in steps:
            model.zero_grad()
            loss = run_pass(model, step)
            model.step()
            losses.append(global_loss(loss))
            show(losses[-1])
            if after_step is not None:
                after_step(step + 1)
    return losses


@contextlib.contextmanager
def unsharded(model: Strategy) -> Iterator[dict[str, Any]]:
    """Every unit of ``model`` unsharded for one pass, as ``{name: parameter}``: all prefetched
    first, entered in order, resharded in reverse order on exit. DDP's and ZeRO's are their own
    parameters (nothing is gathered); FSDP's are gathered (collective over its mesh) and freed on exit."""
    with contextlib.ExitStack() as stack:
        for unit in range(len(model.units)):
            model.prefetch(unit)
        params: dict[str, Any] = {}
        for unit in range(len(model.units)):
            params.update(stack.enter_context(model.unshard(unit)))
        yield params


@contextlib.contextmanager
def progress_bar(total: int, *, enabled: bool) -> Iterator[Callable[[float], None]]:
    """Yield ``show(loss)``, which advances a tqdm bar (on stderr) showing the loss; a no-op when disabled."""
    if not enabled:
        yield lambda loss: None
        return
    with tqdm(total=total, desc="train", unit="step", mininterval=0.5, dynamic_ncols=True) as bar:
        def show(loss: float) -> None:
            bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            bar.update()
        yield show
