"""The gradients DDP and ZeRO hold (``self.reducer``): write gradients, mark them ready, sync.

Arrays have no autograd, so the backward pass tells the strategy when each gradient is final
(the protocol of :mod:`~meshkit.parallel.data_parallelism.protocol`, which FSDP implements too)::

    model.zero_grad()
    for name, grad in backward():              # layer by layer, last layer first
        model.mark_grad_ready(name, grad)      # adds grad to model.grads[name]; when its bucket is
                                               # complete, the bucket's reduction starts
    model.step()                               # wait for every bucket, run the optimizer

``finish_gradient_sync()`` (deprecated: ``step()`` calls it) waits for every bucket alone.

:class:`GradientReducer` is a part, not a base class: DDP and ZeRO each hold one and forward its
interface as their own (``model.mark_grad_ready`` is the reducer's bound method, declared with
:class:`~meshkit.parallel.forwarding.forward_to`, so the hot path has no frame of the strategy's);
what it asks of them is declared, :class:`ReducerOwner` (zeroing and assigning gradients where the
strategy keeps them, and what to do after a sync).

Gradients accumulate like torch's ``.grad``: ``zero_grad()`` zeroes them, a pass writes or adds.
Under ``with model.no_sync():`` nothing is communicated, so micro-batches add up locally and the
next synchronized pass reduces the sum.

No gradient passes as averaged when it is not:

- Reading or writing ``grads[name]`` before marking it is how a gradient is filled. Once it is
  marked in a synchronized pass it is being reduced, and only ``finish_gradient_sync()`` (or
  ``sync_gradients()``) ends the pass: reading it before that raises, naming the gradient (and
  the unmarked ones, if any) and ``finish_gradient_sync()``, and changes nothing. Reading never
  communicates, so a rank that reads (to log a norm, say) cannot run a collective the others do
  not, and the explicit finish that follows is always the one that ends the pass (a
  read that finished the pass left the next finish to refuse and zero the averages). ZeRO's
  ``step()``, ``grad_shards()`` and ``clip_grad_norm_()`` refuse alike.
- A sync fails on every rank or on none. A rank whose pass is incomplete still launches every
  bucket, so the ranks' collectives stay aligned; then one small all-reduce per sync tells
  every rank whether any rank failed, and all raise, naming the failing ranks and the gradients
  they did not mark. The gradients of a failed pass are zeroed on every rank, and reading them
  raises until ``zero_grad()`` or the next synchronized pass.
- The strategy owns a snapshot of the parameters' names, shapes and dtypes: gradients are
  checked against it, whatever happens to the caller's dict later.

These are the protocol's rules, which FSDP enforces alike (written once, in
:mod:`~meshkit.parallel.data_parallelism.protocol`): the gradient's shape and dtype, one mark per
pass, buckets reduced in one order whatever order ranks mark them, and a pass whose every
gradient is marked ended by ``step()``: ``zero_grad()`` on it discards it on every rank (an error
on every rank, naming the rank, if others stepped on it), and a mark on it fails it on every rank.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Mapping
from typing import Any, Iterator, Protocol

from ...comm import CollectiveMismatchError, DistValueError, ProcessGroup
from ...tensor import DTensor
from .buckets import BucketManager
from .construction import snapshot
from ..checks import where
from .dtensors import BlockLayout, block_of
from ..strategy import Steps
from .protocol import (DISCARD, USE, PassAgreement, check_gradient, deprecated, failed_sync, marked_after_complete,
                       marked_twice, refused_after_failure)

__all__ = ["GradientReducer", "ReducerOwner", "Gradients", "DTensorGradients"]


class Gradients(Mapping):
    """``grads`` of a :class:`GradientReducer`: ``name -> gradient array``, guarded while reduced.

    ``arrays`` holds the arrays handed out (bucket views, or arrays of the caller's own).
    """

    __slots__ = ("_reducer", "_arrays", "_location")

    def __init__(self, reducer: GradientReducer, arrays: dict[str, Any]) -> None:
        self._reducer, self._arrays, self._location = reducer, arrays, reducer._buckets.location

    def __getitem__(self, name: str) -> Any:
        reducer = self._reducer
        if self._location[name].ready or reducer._failed is not None:  # KeyError for unknown names
            reducer._before_read(name, "grads")
        return self._arrays[name]

    def __setitem__(self, name: str, value: Any) -> None:
        reducer = self._reducer
        if name in self._location[name].ready and reducer._sync:
            raise DistValueError(f"{reducer._where('grads')}: gradient {name!r} was already marked ready and is "
                                 "being reduced; assign it before mark_grad_ready()")
        reducer.owner._assign_grad(name, value)

    def __contains__(self, name: object) -> bool:
        return name in self._location

    def __iter__(self) -> Iterator[str]:
        return iter(self._reducer._specs)

    def __len__(self) -> int:
        return len(self._reducer._specs)

    def __reversed__(self) -> Iterator[str]:
        return reversed(self._reducer._specs)

    def __repr__(self) -> str:
        return f"<{self._reducer._strategy} gradients {list(self._reducer._specs)}>"


class DTensorGradients(Gradients):
    """``grads`` of a reducer with DTensor parameters: the gradient of a DTensor parameter is a
    DTensor laid out as it, wrapping the reducer's own array (made at each access: the arrays
    behind it change, bucket views being rebuilt or, at ZeRO-2, taken from a pool)."""

    __slots__ = ("_block_layouts",)

    def __init__(self, reducer: GradientReducer, arrays: dict[str, Any]) -> None:
        super().__init__(reducer, arrays)
        self._block_layouts = reducer._block_layouts

    def __getitem__(self, name: str) -> Any:
        grad = super().__getitem__(name)
        layout = self._block_layouts.get(name)
        return grad if layout is None else layout.wrap(grad)

    def __setitem__(self, name: str, value: Any) -> None:
        if isinstance(value, DTensor):
            value = block_of(self._reducer._where("grads"), f"gradient {name!r}", name, value,
                               self._block_layouts.get(name))
        super().__setitem__(name, value)


class ReducerOwner(Protocol):
    """What a :class:`GradientReducer` asks of the strategy that holds it (DDP, ZeRO): where the
    gradients live beside the buckets, which the strategy alone knows (DDP's copies when not
    ``gradient_as_bucket_view``, ZeRO's flat gradients and gradient shards)."""

    def _zero_grads(self) -> None:
        """Set every gradient to zero: the buckets (``BucketManager.zero``) and whatever else holds them."""

    def _assign_grad(self, name: str, value: Any) -> None:
        """``grads[name] = value`` outside a reduction: keep the caller's array in the reducer's
        ``arrays`` (it is checked and copied in when marked), or copy it in now."""

    def _after_sync(self, ready_order: list[str]) -> None:
        """A synchronized pass completed (every bucket reduced, every rank agreed); ``ready_order``
        is the order its gradients were marked in while :attr:`GradientReducer.record_order`."""


class GradientReducer:
    """The gradients of a strategy that reduces them bucket by bucket during the backward pass.

    The part DDP and ZeRO hold (``self.reducer``), and whose gradient interface they forward as
    their own (``mark_grad_ready``, ``zero_grad``, ``no_sync``, ``sync_gradients``, ``grads``...:
    :mod:`~meshkit.parallel.forwarding`, so that ``ddp.mark_grad_ready`` is this class's bound
    method and the five frames from DDP to MPI start here, with no frame of the strategy's). What it
    asks of the strategy is declared, :class:`ReducerOwner`; everything else it is given.

    Args:
        owner: the strategy holding it (a :class:`ReducerOwner`).
        strategy: the strategy's name, for messages (``"DistributedDataParallel"``).
        group: the group gradients are reduced over.
        blocks: this rank's parameter arrays (a DTensor parameter's block), ``name -> array``:
            gradients are checked against a snapshot of their names, shapes and dtypes (see
            :func:`~meshkit.parallel.data_parallelism.construction.snapshot`) and array library.
        block_layouts: the :class:`~meshkit.parallel.data_parallelism.dtensors.BlockLayout` of each
            DTensor parameter (whose gradient is a DTensor laid out as it).
        buckets: the :class:`BucketManager` reducing the gradients.
        arrays: the gradient arrays handed out as ``grads`` (bucket views, or arrays of the
            caller's own), the owner's dict too.
        find_unused_parameters: allow passes where some gradients are never marked ready (reduced as they are).
        restore_views: an array of the caller's, copied into its bucket when marked, is replaced
            in ``arrays`` by the bucket's view (False where bucket buffers come and go: ZeRO-2).
        record_order: passes record the order gradients are marked in, for the owner's
            ``_after_sync`` (DDP, until it rebuilt its buckets in that order; it then sets
            :attr:`record_order` False).

    With DTensor parameters, ``grads`` gives DTensors laid out as their parameters
    (:class:`DTensorGradients`), and ``mark_grad_ready`` takes a DTensor gradient laid out as its
    parameter, or this rank's block: buckets only ever see blocks.
    """

    def __init__(self, owner: ReducerOwner, *, strategy: str, group: ProcessGroup, blocks: dict[str, Any],
                 block_layouts: dict[str, BlockLayout], buckets: BucketManager, arrays: dict[str, Any],
                 find_unused_parameters: bool, restore_views: bool = True, record_order: bool = False) -> None:
        self.owner, self._strategy, self.group = owner, strategy, group
        self._specs = snapshot(blocks)
        self._block_layouts, self._buckets, self._arrays = block_layouts, buckets, arrays
        self.find_unused_parameters = find_unused_parameters
        self._restore_views = restore_views
        self.record_order = record_order  # whether passes record the ready order (given to _after_sync)
        self._sync = True
        self._ready_order: list[str] = []  # kept while record_order
        self._touched: set[str] = set()  # marked ready in no_sync() passes since the last synchronized finish
        self._failed: str | None = None  # why the last synchronized pass failed, until zero_grad() or the next
        self._location = buckets.location
        self._param = next(iter(blocks.values()))  # every gradient's array library
        self._agreement = PassAgreement([group], self._param, f"{strategy}'s gradient sync")  # the per-sync agreement (protocol.py)
        self.steps = Steps()  # optimizer steps taken (the owner's step()), compared in the agreement
        self.grads = (DTensorGradients if block_layouts else Gradients)(self, arrays)
        self.iteration = 0
        self._averaged = False  # whether the gradients are the result of a synchronized pass
        self._bulk = False  # sync_gradients() marking the caller's arrays (no deprecation warning)
        self._warned_mark = False  # whether mark_grad_ready(name) without a gradient has warned

    def _where(self, op: str) -> str:
        return where(f"{self._strategy}.{op}", self.group)

    # ------------------------------------------------------------------ the interface
    def zero_grad(self) -> None:
        """Set every gradient to zero (they accumulate otherwise, as torch's ``.grad``).

        A synchronized pass that ``step()`` would end (every gradient marked; any pass with
        ``find_unused_parameters``) is discarded: collective, as the ``step()`` it replaces, so
        that a rank which skipped ``step()`` meets its peers' (rule 4 of
        :mod:`~meshkit.parallel.data_parallelism.protocol`). Every rank discarding it skips the step alike.

        Raises:
            DistValueError: inside a synchronized pass with gradients left to mark (they are being
                reduced: mark the rest and finish it first; nothing changes); on every rank, when
                some ranks discarded the pass while others stepped on it (naming the ranks that
                skipped ``step()``): the gradients are zeroed on every rank all the same.
        """
        marked = self._marked()
        if marked and self._sync:
            if self.find_unused_parameters or not self._buckets.unready():
                try:
                    self._finish_sync("zero_grad", DISCARD)
                finally:
                    self._reset_gradients()
                return
            raise DistValueError(f"{self._where('zero_grad')}: gradients {marked} were marked ready in a pass that "
                                 "was not finished and are being reduced; call finish_gradient_sync() first")
        self._reset_gradients()

    def _reset_gradients(self) -> None:
        """Zero the gradients and forget what the last pass left: they are no averages, and a failed
        sync no longer applies (without either, step() stepped on zeros, or raised on)."""
        self.owner._zero_grads()
        self._averaged = False
        self._failed = None
        self._touched.clear()

    def mark_grad_ready(self, name: str, grad: Any = None) -> None:
        """Declare ``grads[name]`` final for this backward pass (adding ``grad`` to it first, if given).

        When every gradient of a bucket is ready its reduction starts asynchronously, in bucket
        order. Raises for an unknown name, a gradient marked twice in one pass, or a gradient of
        the wrong shape or dtype.
        """
        # Called once per gradient per step (1000s of times): one dict lookup for the bucket, one
        # for the gradient, an identity test against the bucket's own view, a set insertion.
        try:
            bucket = self._location[name]
        except (KeyError, TypeError):
            raise DistValueError(f"{self._where('mark_grad_ready')}: unknown parameter {name!r}; valid names "
                                 f"are {list(self._specs)}") from None
        ready = bucket.ready
        if name in ready and self._sync:  # under no_sync() a second mark is the next micro-batch's
            self._second_mark(name)
        current = self._arrays[name]
        if grad is None:
            if not self._bulk and not self._warned_mark:  # once per strategy: warnings.warn costs us per call
                self._warned_mark = True
                deprecated("mark_grad_ready(name) after writing into grads[name]",
                           "pass the gradient: mark_grad_ready(name, grad)")
        else:
            if isinstance(grad, DTensor):  # unwrapped here, so that buckets only ever see blocks
                grad = block_of(self._where("mark_grad_ready"), f"gradient {name!r}", name, grad,
                                  self._block_layouts.get(name))
            self.check_grad(name, grad)
            current += grad
        if current is not bucket.views.get(name):
            view = bucket.view(name)  # made now, or the caller's own array: check and copy it in
            if current is not view:
                self.check_grad(name, current)
                view[...] = current
                if self._restore_views:
                    self._arrays[name] = view
        ready.add(name)
        if self.record_order:
            self._ready_order.append(name)
        if self._sync:
            marked = len(ready)
            if marked == bucket.count:
                bucket.launch()
            elif not marked & 31:  # every 32 marks: let an earlier bucket's reduction move on
                self.group.progress()

    def _second_mark(self, name: str) -> None:
        """``name`` is marked again in this synchronized pass (rules 2 and 4): refused, changing
        nothing; once every gradient is marked it is a second mark or a skipped ``step()``, and
        the pass fails on every rank (this rank meets its peers' ``step()`` in the sync)."""
        if not self._buckets.unready():
            self._finish_sync("mark_grad_ready", problem=marked_after_complete(name))  # raises on every rank
        raise marked_twice(self._where("mark_grad_ready"), name)

    def check_grad(self, name: str, grad: Any) -> None:
        """Refuse a gradient of ``name`` that is not its parameter's (shape, dtype, array library; rule 1
        of :mod:`~meshkit.parallel.data_parallelism.protocol`): also what ZeRO-2 checks ``grads[name] = value`` by."""
        shape, dtype = self._specs[name]
        # the common case first, without building the message head: building it made 1000 marks of
        # 4 KB gradients half again as slow (benchmarks/ddp.py measures the marks)
        if grad.__class__ is self._param.__class__ and grad.shape == shape and grad.dtype == dtype:
            return
        check_gradient(self._where("mark_grad_ready"), name, grad, shape, dtype, self._param, "the parameters",
                       block=name in self._block_layouts)

    def finish_gradient_sync(self) -> None:
        """Deprecated: :meth:`step` finishes the sync and runs the optimizer (see :meth:`_finish_sync`)."""
        deprecated("finish_gradient_sync()", "step() finishes the gradient sync and runs the optimizer")
        self._finish_sync("finish_gradient_sync")

    def _finish_sync(self, op: str, code: int = USE, problem: str | None = None) -> None:
        """Wait for every bucket's reduction. Inside ``no_sync()`` it only ends the backward pass.

        Collective: every rank launches every bucket and then learns, in one small all-reduce
        (:class:`~meshkit.parallel.data_parallelism.protocol.PassAgreement`), whether every rank ended
        the pass alike; if not, every rank raises (naming ``op``) and this pass's gradients are
        zeroed on every rank.

        Args:
            op: the call that ends the pass, for messages.
            code: ``USE`` (the gradients are averaged for use) or ``DISCARD`` (``zero_grad()``).
            problem: what is wrong with the pass on this rank, if anything.

        Raises:
            DistValueError: on every rank, when some rank did not mark all its gradients ready
                and ``find_unused_parameters`` is False, or had another problem, or discarded
                the pass while others used it, or took another number of steps (naming the ranks).
        """
        if not self._sync:
            self._end_pass()
            return
        unready = self._buckets.unready()
        if unready and not self.find_unused_parameters and problem is None:
            problem = (f"gradients {unready} were not marked ready in this backward pass; mark every gradient (or "
                       "call sync_gradients()), or pass find_unused_parameters=True if some parameters are unused")
        for name in unready:  # reduced as they are: zero if unused in every micro-batch
            bucket = self._location[name]
            if problem or name not in self._touched:
                view = bucket.view(name)
                view[...] = 0
                if self._restore_views:
                    self._arrays[name] = view
            bucket.ready.add(name)
        self._buckets.launch_ready()
        order = self._ready_order
        try:
            self._buckets.wait_all()
        except BaseException as exc:
            self._end_pass()
            self._failed = f"the last gradient sync raised {type(exc).__name__}: {exc}"
            raise
        self._end_pass()
        self._agree(op, code, problem)
        if code == DISCARD:  # every rank discarded it alike: zero_grad() zeroes the gradients
            return
        self._averaged = True
        self._failed = None
        self._touched.clear()
        self.iteration += 1
        self.owner._after_sync(order)

    def _agree(self, op: str, code: int, problem: str | None) -> None:
        """One small all-reduce per sync: did every rank end the pass alike? If not, every rank
        raises, naming the ranks, and the pass's gradients are zeroed (garbage on every rank)."""
        try:
            failure = self._agreement(code, self.steps.count, problem)
        except CollectiveMismatchError as exc:
            failure = f"the gradient sync found a collective mismatch: {exc}"
            mismatch: BaseException | None = exc
        else:
            mismatch = None
        if failure is None:
            return
        self.owner._zero_grads()
        self._averaged = False
        self._touched.clear()
        self._failed = failure
        if mismatch is not None:
            raise mismatch
        raise failed_sync(self._where(op), failure)

    def _marked(self) -> list[str]:
        """Names marked ready in the current pass."""
        return [n for bucket in self._buckets.buckets for n in bucket.names if n in bucket.ready]

    def _before_read(self, name: str | None, op: str) -> None:
        """Before gradients are used as averaged (``grads[name]``, ZeRO's step...): raise if a
        synchronized pass is not finished or the last sync failed. Changes nothing (no collective)."""
        if self._failed is not None:
            raise refused_after_failure(self._where(op), self._failed)
        if not self._sync or (name is not None and name not in self._location[name].ready):
            return
        if name is None and not self._marked():
            return
        unready = self._buckets.unready()
        what = f"gradient {name!r} is" if name is not None else "gradients are"
        if unready:
            raise DistValueError(
                f"{self._where(op)}: {what} being reduced and the backward pass is not finished: gradients "
                f"{unready} are not marked ready; mark them and call finish_gradient_sync() before using gradients "
                "(with find_unused_parameters=True, finish_gradient_sync() reduces unmarked ones as they are)")
        raise DistValueError(
            f"{self._where(op)}: {what} being reduced: every gradient is marked ready but the sync is not "
            "finished; step() or clip_grad_norm_() finish it (or the deprecated finish_gradient_sync()) before "
            "gradients are used; reading them does not finish it")

    def ready_for_step(self, op: str) -> None:
        """Before ``step()`` (or DDP's ``clip_grad_norm_()``: ``op``): finish a synchronized pass in
        progress (every gradient marked, or ``find_unused_parameters``), then check that the
        gradients are averaged.

        A pass this rank left incomplete is refused here, locally, and stays open (mark the rest,
        then ``step()`` again), as ZeRO's ``step()`` always did; if other ranks completed theirs,
        they wait in the sync until this one completes it (or the group's timeout).
        """
        self.finish_complete_pass(op)
        self.check_averaged(op)
        if not self._averaged:
            raise DistValueError(f"{self._where(op)}: no synchronized gradient pass since zero_grad() (or "
                                 "construction), so the gradients are not averaged; mark the gradients ready "
                                 f"(mark_grad_ready(name, grad), outside no_sync()) before {op}()")

    def finish_complete_pass(self, op: str) -> None:
        """Finish a synchronized pass in progress whose every gradient is marked (or any pass in
        progress, with ``find_unused_parameters``): what the collective calls that end a backward
        pass (``step()``, ``clip_grad_norm_()``) do first. A read never does."""
        if self._sync and self._failed is None and self._marked() and (
                self.find_unused_parameters or not self._buckets.unready()):
            self._finish_sync(op)

    def check_averaged(self, op: str) -> None:
        """Gradients are about to be used as averaged: refuse unless a synchronized pass finished."""
        self._before_read(None, op)
        if self._marked():  # inside no_sync(): _before_read leaves those
            raise DistValueError(f"{self._where(op)}: gradients marked ready inside no_sync() are local sums, not "
                                 "averages; run the last micro-batch outside no_sync(), then step() (or "
                                 "finish_gradient_sync())")
        if self._touched:
            raise DistValueError(f"{self._where(op)}: gradients {sorted(self._touched)} were accumulated under "
                                 "no_sync() but never synchronized; run the last micro-batch outside no_sync(), "
                                 "then step() (or finish_gradient_sync())")

    def sync_gradients(self) -> None:
        """Mark every gradient not yet marked ready, then :meth:`finish_gradient_sync`.

        Gradients still in their bucket's own view are marked in bulk, a bucket at a time (no
        per-gradient checks are needed: they are the bucket); others go through
        :meth:`mark_grad_ready`, which checks and copies them in.
        """
        arrays = self._arrays
        for bucket in self._buckets.buckets:
            ready = bucket.ready
            pending = [n for n in bucket.names if n not in ready] if ready else bucket.names
            views = bucket.views
            # Every pending gradient still the bucket's own view, compared in C (map over the two
            # lookups): a Python generator over 1000 names cost a sizeable share of a 4 MB sync.
            if bucket.buffer is not None and all(map(operator.is_, map(arrays.get, pending), map(views.get, pending))):
                bucket.ready.update(pending)
                if self.record_order:
                    self._ready_order.extend(pending)
            else:
                self._bulk = True  # the caller's arrays, checked and copied in: not the deprecated spelling
                try:
                    for name in pending:
                        self.mark_grad_ready(name)
                finally:
                    self._bulk = False
        if self._sync:
            self._buckets.launch_ready()
        self._finish_sync("sync_gradients")

    def _end_pass(self) -> None:
        if not self._sync:  # a no_sync() pass: remember what it touched, for find_unused_parameters
            for bucket in self._buckets.buckets:
                self._touched.update(bucket.ready)
        self._buckets.reset()
        self._ready_order = []

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: no communication until the context exits.

        Leaving the context ends its backward pass(es) (as ``finish_gradient_sync()`` inside it
        did): the gradients marked in it are local sums, to which the next synchronized pass adds.
        Inside it, marking a gradient again is the next micro-batch's.
        """
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            if previous and self._marked():
                self._end_pass()
            self._sync = previous

    @property
    def buckets(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [list(b.names) for b in self._buckets.buckets]
