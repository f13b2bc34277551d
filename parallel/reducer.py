"""The gradient interface shared by DDP and ZeRO: write gradients, mark them ready, sync.

Arrays have no autograd, so the backward pass tells the strategy when each gradient is final::

    model.zero_grad()
    for name, grad in backward():              # layer by layer, last layer first
        model.mark_grad_ready(name, grad)      # adds grad to model.grads[name]; when its bucket is
                                               # complete, the bucket's reduction starts
    model.finish_gradient_sync()               # wait for every bucket

Gradients accumulate like torch's ``.grad``: ``zero_grad()`` zeroes them, a pass writes or adds.
Under ``with model.no_sync():`` nothing is communicated, so micro-batches add up locally and the
next synchronized pass reduces the sum. A complete bucket launches its own reduction (see
:mod:`~meshkit.parallel.buckets`); subclasses decide what happens after a synchronized pass
(``_after_sync``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from ..comm import DistValueError, ProcessGroup
from .buckets import BucketManager

__all__ = ["GradientReducer"]


class GradientReducer:
    """Base of strategies whose gradients are reduced bucket by bucket during the backward pass.

    Subclasses set ``group``, ``params``, ``grads`` (a mapping ``name -> gradient array``),
    ``_buckets`` (a :class:`BucketManager` whose buckets reduce themselves) and
    ``find_unused_parameters``, then call :meth:`_init_reducer`.
    """

    group: ProcessGroup
    params: dict[str, Any]
    grads: Any
    _buckets: BucketManager
    find_unused_parameters: bool
    _strategy = "GradientReducer"
    #: whether passes record the order gradients became ready in (given to ``_after_sync``)
    _record_order = False

    def _init_reducer(self) -> None:
        self._sync = True
        self._ready_order: list[str] = []  # kept while _record_order (DDP, until it rebuilt its buckets)
        self._touched: set[str] = set()  # marked ready in no_sync() passes since the last synchronized finish
        self.iteration = 0

    # ------------------------------------------------------------------ subclass hooks
    def _after_sync(self, ready_order: list[str]) -> None:
        """After a synchronized pass completed (every bucket reduced)."""

    def _zero(self) -> None:
        self._buckets.zero()

    def _where(self, op: str) -> str:
        return f"meshkit.parallel: rank {self.group.global_rank}: {self._strategy}.{op}"

    # ------------------------------------------------------------------ the interface
    def zero_grad(self) -> None:
        """Set every gradient to zero (they accumulate otherwise, as torch's ``.grad``)."""
        self._zero()

    def mark_grad_ready(self, name: str, grad: Any = None) -> None:
        """Declare ``grads[name]`` final for this backward pass (adding ``grad`` to it first, if given).

        When every gradient of a bucket is ready its reduction starts asynchronously, in bucket
        order. Raises for an unknown name, a gradient marked twice in one pass, or a gradient of
        the wrong shape or dtype.
        """
        # Called once per gradient per step (1000s of times): one dict lookup for the bucket, one
        # for the gradient, an identity test against the bucket's own view, a set insertion.
        try:
            bucket = self._buckets.location[name]
        except (KeyError, TypeError):
            raise DistValueError(f"{self._where('mark_grad_ready')}: unknown parameter {name!r}; valid names "
                                 f"are {list(self.params)}") from None
        ready = bucket.ready
        if name in ready:
            raise DistValueError(f"{self._where('mark_grad_ready')}: gradient {name!r} was already marked ready "
                                 "in this backward pass")
        current = self.grads[name]
        if grad is not None:
            self._check_grad(name, grad)
            current += grad
        if current is not bucket.views.get(name):
            view = bucket.view(name)  # made now, or the user's own array: check and copy it in
            if current is not view:
                self._check_grad(name, current)
                view[...] = current
                self._replaced(name, view)
        ready.add(name)
        if self._record_order:
            self._ready_order.append(name)
        if self._sync and len(ready) == bucket.count:
            bucket.launch()

    def _replaced(self, name: str, view: Any) -> None:
        """``grads[name]`` was not the bucket's view (copied in); subclasses may restore the view."""

    def _check_grad(self, name: str, grad: Any) -> None:
        p = self.params[name]
        if getattr(grad, "shape", None) != p.shape or getattr(grad, "dtype", None) != p.dtype:
            raise DistValueError(
                f"{self._where('mark_grad_ready')}: gradient {name!r} has shape {getattr(grad, 'shape', None)} "
                f"and dtype {getattr(grad, 'dtype', None)}; expected the parameter's shape {p.shape} and dtype "
                f"{p.dtype}")

    def finish_gradient_sync(self) -> None:
        """Wait for every bucket's reduction. Inside ``no_sync()`` it only ends the backward pass.

        Raises:
            DistValueError: some gradients were never marked ready and
                ``find_unused_parameters`` is False (they are named).
        """
        if not self._sync:
            self._end_pass()
            return
        unready = self._buckets.unready()
        if unready and not self.find_unused_parameters:
            self._buckets.wait_all()
            self._end_pass()
            raise DistValueError(
                f"{self._where('finish_gradient_sync')}: gradients {unready} were not marked ready in this "
                "backward pass; mark every gradient (or call sync_gradients()), or pass "
                "find_unused_parameters=True if some parameters are unused")
        for name in unready:
            if name not in self._touched:
                self.grads[name][...] = 0  # unused in every micro-batch: its gradient is zero
            self._buckets.location[name].ready.add(name)
        self._buckets.launch_ready()
        self._buckets.wait_all()
        order = self._ready_order
        self._end_pass()
        self._touched.clear()
        self.iteration += 1
        self._after_sync(order)

    def sync_gradients(self) -> None:
        """Mark every gradient not yet marked ready, then :meth:`finish_gradient_sync`.

        Gradients still in their bucket's own view are marked in bulk, a bucket at a time (no
        per-gradient checks are needed: they are the bucket); others go through
        :meth:`mark_grad_ready`, which checks and copies them in.
        """
        grads = self.grads
        for bucket in self._buckets.buckets:
            pending = [n for n in bucket.names if n not in bucket.ready]
            views = bucket.views
            if bucket.buffer is not None and all(grads[n] is views.get(n) for n in pending):
                bucket.ready.update(pending)
                if self._record_order:
                    self._ready_order.extend(pending)
            else:
                for name in pending:
                    self.mark_grad_ready(name)
        if self._sync:
            self._buckets.launch_ready()
        self.finish_gradient_sync()

    def _end_pass(self) -> None:
        if not self._sync:  # a no_sync() pass: remember what it touched, for find_unused_parameters
            for bucket in self._buckets.buckets:
                self._touched.update(bucket.ready)
        self._buckets.reset()
        self._ready_order = []

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: no communication until the context exits."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @property
    def buckets(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [list(b.names) for b in self._buckets.buckets]
