"""Pipeline parallelism: stages that exchange activations point to point, driven by a schedule.

A :class:`PipelineStage` wraps the user's ``forward(x) -> (y, ctx)`` and ``backward(ctx, dy) ->
dx`` of one contiguous slice of a model. Stage ``i`` of ``num_stages`` lives on group rank
``i % group.size()`` (one stage per rank, or several: Megatron's virtual stages), or in a V
(``placement="v"``, ZB-V: rank ``r`` holds stages ``r`` and ``2p - 1 - r``). The schedules
(:class:`ScheduleGPipe`, :class:`Schedule1F1B`, :class:`ScheduleInterleaved1F1B`, and the
zero-bubble :class:`ScheduleZBH1` and :class:`ScheduleZBVZeroBubble`, which run a stage's
backward as two passes, B and W, given as ``backward_input`` and ``backward_weight``) split a
batch into microbatches along axis 0 and run the per-rank action lists of :mod:`.schedules`.

Transfers: activations go forward and gradients backward with ``isend``/``irecv`` on the stage
group, tagged by (kind, receiving stage), so that messages between the same two ranks never
match the wrong receive, and in microbatch order per tag. The first activation a stage sends
is preceded by a small header (shape and dtype), from which the receiver learns its input and
allocates its buffers; every later transfer goes into a buffer from a pool that is refilled as
microbatches finish. A buffer goes back to its pool only once every send reading it completed:
a stage may return the arrays it was given (an identity layer's ``y = x`` or ``dx = dy``, a
backward writing ``dx`` into its saved input), and MPI reads a large message when the receiver
takes it, not at the ``isend`` (the local engine copies at once, which would hide a reuse).
Sends never block, and each rank posts a receive only when its next action needs it, so the
orders of :mod:`.schedules` (checked by a simulation in the tests) cannot deadlock.

Failures: a stage whose forward, backward or loss raises, or whose output changes shape or
dtype (checked where it leaves the stage, also towards a stage of the same rank), raises
:class:`PipelineError` naming the stage and microbatch, and aborts the stage group
(:meth:`~meshkit.comm.ProcessGroup.abort`), so that the other ranks' waits fail at once
instead of hanging until the timeout. The first step checks, in one collective over the group,
that every rank built the same schedule with the same ``num_stages`` and ``n_microbatches``
(ranks that differ would scale gradients wrongly or wait for transfers that never come), and
that the last stage's ``target`` has as many samples as the first stage's ``x`` (on every
rank: the collective carries both); later steps check ``target`` against that batch.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import numpy as np

from ...comm import DistError, DistValueError, ProcessGroup, Work, all_reduce
from ...comm._seams import agree, is_device_array, resolve_group
from ...mesh import DeviceMesh
from ..arrays import array_namespace, is_array
from .schedules import Action, gpipe_order, interleaved_order, one_f_one_b_order, zb_h1_order, zbv_order

__all__ = ["PipelineStage", "PipelineError", "PipelineSchedule", "ScheduleGPipe", "Schedule1F1B",
           "ScheduleInterleaved1F1B", "ScheduleZBH1", "ScheduleZBVZeroBubble"]

ACTIVATION, GRADIENT, HEADER = 0, 1, 2
_HEADER_SLOTS = 19  # dtype (16 bytes as 2 int64), ndim, on a device (CuPy), up to 15 dims


class PipelineError(DistError):
    """A pipeline stage failed: names the stage, the microbatch and the pass."""


def _tag(kind: int, stage: int) -> int:
    return 3 * stage + kind


def _integer(value: Any) -> int | None:
    """``value`` as an int if it is an integer (NumPy's too, through ``__index__``), else None."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _batch(a: Any) -> int | None:
    """The size of ``a``'s batch axis (axis 0), or None for what has none (refused later)."""
    shape = getattr(a, "shape", None)
    return int(shape[0]) if shape else None


def _shared_uses(gathered: list[Any]) -> dict[str, list[tuple[int, Any]]]:
    """Each shared gradient's name -> ``(stage, (shape, dtype, on a device))`` of every stage using it,
    from every rank's part of the first step's agreement."""
    specs: dict[str, list[tuple[int, Any]]] = {}
    for (stage, name), spec in sorted(kv for *_, sh in gathered for kv in sh.items()):
        specs.setdefault(name, []).append((stage, spec))
    return specs


def _rank(group: ProcessGroup) -> str:
    """``rank 3 (pp rank 1)``: this process's global rank, and its rank in the pipeline group
    unless that group is the world (where the two are the same)."""
    if group.rank == group.global_rank and group.size == group.world.size:
        return f"rank {group.rank}"
    return f"rank {group.global_rank} ({group.name} rank {group.rank})"


class PipelineStage:
    """One stage of a pipeline: the user's forward and backward, and its place in the group.

    Args:
        forward: ``forward(x) -> (y, ctx)``; ``ctx`` is kept until the microbatch's backward.
        backward: ``backward(ctx, dy) -> dx``; it accumulates its own parameter gradients
            (the schedule scales ``dy`` so that the sum over microbatches is the gradient of
            the mean loss over the whole batch). The first stage's ``dx`` is ignored. None
            when the stage gives ``backward_input`` and ``backward_weight`` instead.
        stage_index: this stage's position, ``0 <= stage_index < num_stages``.
        num_stages: stages in the pipeline (a multiple of the group's size).
        group: the ranks of the pipeline: a ProcessGroup or a 1-D mesh (``mesh["pp"]``); default:
            the world.
            Stage ``i`` lives on group rank ``i % group.size()``.
        input_spec: ``(shape, dtype)`` of one microbatch's input, if known: checked against
            what the previous stage sends first (a mismatch names both), instead of learned.
        backward_input: the backward split in two, as the zero-bubble schedules need (with
            ``backward_weight``, instead of ``backward``): ``backward_input(ctx, dy) -> (dx,
            wctx)`` computes the input gradient only (the pass ``B``), ``wctx`` being what the
            weight gradient needs; it is kept until ``backward_weight(wctx)`` (the pass ``W``)
            accumulates the parameter gradients, maybe much later, then freed. The other
            schedules run the two back to back.
        backward_weight: see ``backward_input``.
        placement: which rank holds stage ``i``: ``"loop"`` (rank ``i % p``; GPipe, 1F1B,
            ZB-H1, interleaved) or ``"v"`` (ScheduleZBVZeroBubble, ``num_stages == 2 p``: rank
            ``i`` for ``i < p``, else rank ``2 p - 1 - i``).
        shared: ``{name: grad}`` for parameters this stage shares with another stage (tied
            embeddings): ``grad`` is the array its backward accumulates that parameter's gradient
            into. At the end of each step the schedule sums every stage's contribution of a
            name once (an array given by two stages of one rank counts once) and adds the sum
            to each holder's array, so every copy holds the gradient of all uses.

    Raises:
        DistValueError: a stage index out of range, or a stage that does not live on this rank.
    """

    def __init__(self, forward: Callable[[Any], tuple[Any, Any]], backward: Callable[[Any, Any], Any] | None,
                 stage_index: int, num_stages: int, *, group: ProcessGroup | DeviceMesh | None = None,
                 input_spec: tuple[Sequence[int], Any] | None = None,
                 backward_input: Callable[[Any, Any], tuple[Any, Any]] | None = None,
                 backward_weight: Callable[[Any], Any] | None = None, placement: str = "loop",
                 shared: dict[str, Any] | None = None) -> None:
        if isinstance(group, DeviceMesh):
            if group.ndim != 1:
                raise DistValueError(f"meshkit.parallel: PipelineStage: group must be a ProcessGroup or a 1-D mesh "
                                     f"(e.g. mesh['pp']), got a {group.ndim}-D mesh {group.mesh_dim_names}")
            group = group.get_group()
        self.group = resolve_group(group)
        p, rank = self.group.size, self.group.rank
        head = f"meshkit.parallel: {_rank(self.group)}: PipelineStage"
        for name, value in (("stage_index", stage_index), ("num_stages", num_stages)):
            if _integer(value) is None:
                raise DistValueError(f"{head}: {name} must be an int, got {value!r}")
        stage_index, num_stages = _integer(stage_index), _integer(num_stages)
        if num_stages < 1 or num_stages % p:
            raise DistValueError(f"{head}: num_stages must be a positive multiple of the group's {p} ranks, "
                                 f"got {num_stages}")
        if not 0 <= stage_index < num_stages:
            raise DistValueError(f"{head}: stage_index {stage_index} is out of range for {num_stages} stages "
                                 f"(valid: 0..{num_stages - 1})")
        if placement not in ("loop", "v"):
            raise DistValueError(f"{head}: placement must be 'loop' or 'v', got {placement!r}")
        if placement == "v" and num_stages != 2 * p:
            raise DistValueError(f"{head}: placement 'v' needs num_stages == 2 * the group's {p} ranks, got "
                                 f"{num_stages}")
        where = _placement(placement, p)
        if where(stage_index) != rank:
            rule = f"stage i on rank i % {p}" if placement == "loop" else f"stage i on rank i, or {2 * p - 1} - i"
            raise DistValueError(f"{head}: stage {stage_index} of {num_stages} lives on group rank "
                                 f"{where(stage_index)} ({rule}), not on this rank (group rank {rank})")
        split = (backward_input, backward_weight)
        if (split[0] is None) != (split[1] is None):
            raise DistValueError(f"{head}: stage {stage_index}: pass both backward_input and backward_weight (the "
                                 "split backward), or neither")
        if backward is not None and split[0] is not None:
            raise DistValueError(f"{head}: stage {stage_index}: pass backward or backward_input and backward_weight, "
                                 "not both")
        if not callable(forward) or not all(callable(f) for f in ([backward] if split[0] is None else split)):
            raise DistValueError(f"{head}: forward and backward (or backward_input and backward_weight) must be "
                                 "callables")
        if shared is not None and (not isinstance(shared, dict) or
                                   not all(isinstance(k, str) and is_array(v) for k, v in shared.items())):
            raise DistValueError(f"{head}: stage {stage_index}: shared must be a dict of name -> gradient array, "
                                 f"got {shared!r}")
        self.forward_fn, self.backward_fn = forward, backward
        self.backward_input_fn, self.backward_weight_fn = split
        self.placement, self.shared = placement, dict(shared or {})
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.prev_rank = where(stage_index - 1) if stage_index else where(num_stages - 1)  # neighbours' group ranks
        self.next_rank = where(stage_index + 1) if stage_index < num_stages - 1 else where(0)
        self.expected_input = None if input_spec is None else (tuple(int(d) for d in input_spec[0]),
                                                               np.dtype(input_spec[1]))
        self.input_spec: tuple[tuple[int, ...], np.dtype] | None = None   # learned from the first activation
        self.output_spec: tuple[tuple[int, ...], np.dtype] | None = None
        self._xp: Any = None
        self._ctx: dict[int, Any] = {}
        self._wctx: dict[int, Any] = {}  # split backward: what W needs, from B until W
        self._inputs: dict[int, Any] = {}  # received buffers, back to their pools after the backward
        self._grads: dict[int, Any] = {}
        self._pool_in: list[Any] = []
        self._pool_grad: list[Any] = []
        self._sending: list[tuple[Work, Any]] = []  # sends in flight and the arrays they read
        self._parked: list[tuple[Any, list[Any]]] = []  # (buffer, its pool): read by a send in flight
        #: microbatches whose activations are alive now (forward context, or what W needs), and the most so far
        self.live_activations = 0
        self.peak_live_activations = 0

    def __repr__(self) -> str:
        return f"PipelineStage({self.stage_index} of {self.num_stages}, group rank {self.group.rank})"

    # ----------------------------------------------------------------- passes
    def run_forward(self, mb: int, x: Any) -> Any:
        """Forward of microbatch ``mb``; keeps its context; returns the output."""
        out = self._call("forward", mb, self.forward_fn, x)
        if not isinstance(out, tuple) or len(out) != 2:
            self.fail(f"stage {self.stage_index}: forward of microbatch {mb} returned a {type(out).__name__}; it "
                      "must return (y, ctx), ctx being what its backward needs")
        y, ctx = out
        if not is_array(y):
            self.fail(f"stage {self.stage_index}: forward of microbatch {mb} returned y of type {type(y).__name__}; "
                      "y must be a NumPy or CuPy array")
        if mb in self._ctx or mb in self._wctx:
            self.fail(f"stage {self.stage_index}: forward of microbatch {mb} ran twice without its backward")
        self._ctx[mb] = ctx
        self._count_live()
        return y

    @property
    def split_backward(self) -> bool:
        """Whether this stage's backward comes in two parts (``backward_input``, ``backward_weight``)."""
        return self.backward_input_fn is not None

    def _count_live(self) -> None:
        # a microbatch's activations are held from its F until its backward (W when split)
        self.live_activations = len(self._ctx) + len(self._wctx)
        self.peak_live_activations = max(self.peak_live_activations, self.live_activations)

    def run_backward(self, mb: int, dy: Any) -> Any:
        """Backward of microbatch ``mb``; frees its context; returns ``dx``. Its buffers go back
        to their pools with :meth:`release`, once ``dx`` (which may be one of them) is sent. A
        split stage runs its input then its weight gradient here, back to back."""
        if self.split_backward:
            dx = self.run_backward_input(mb, dy)
            self.run_backward_weight(mb)
            return dx
        ctx = self._ctx.pop(mb)
        dx = self._call("backward", mb, self.backward_fn, ctx, dy)
        self._count_live()
        return dx

    def run_backward_input(self, mb: int, dy: Any) -> Any:
        """The pass B of microbatch ``mb``: ``dx``; keeps what ``backward_weight`` needs until W."""
        ctx = self._ctx.pop(mb)
        out = self._call("backward_input", mb, self.backward_input_fn, ctx, dy)
        if not isinstance(out, tuple) or len(out) != 2:
            self.fail(f"stage {self.stage_index}: backward_input of microbatch {mb} returned a {type(out).__name__}; "
                      "it must return (dx, wctx), wctx being what backward_weight needs")
        self._wctx[mb] = out[1]
        self._count_live()
        return out[0]

    def run_backward_weight(self, mb: int) -> None:
        """The pass W of microbatch ``mb``: its weight gradients; frees what B kept for it."""
        self._call("backward_weight", mb, self.backward_weight_fn, self._wctx.pop(mb))
        self._count_live()

    def release(self, mb: int) -> None:
        """Microbatch ``mb``'s received buffers go back to their pools, each once no send reads it."""
        for bufs, pool in ((self._inputs, self._pool_in), (self._grads, self._pool_grad)):
            buf = bufs.pop(mb, None)
            if buf is not None:
                self._parked.append((buf, pool))
        self._recycle()

    def _recycle(self) -> None:
        self._sending = [(w, a) for w, a in self._sending if not w.is_completed()]
        parked = []
        for buf, pool in self._parked:
            if any(_overlap(buf, a) for _, a in self._sending):
                parked.append((buf, pool))
            else:
                pool.append(buf)
        self._parked = parked

    def _take(self, pool: list[Any], spec: tuple[tuple[int, ...], np.dtype]) -> Any:
        """A buffer from ``pool`` that no send reads, or a new one (never waits for a send)."""
        if self._parked:
            self._recycle()
        return pool.pop() if pool else self._xp.empty(*spec)

    def _send(self, a: Any, dst: int, tag: int) -> Work:
        work = self.group.isend(a, dst, tag)
        self._sending.append((work, a))
        return work

    def _call(self, what: str, mb: int, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            self.fail(f"stage {self.stage_index}: {what} of microbatch {mb} raised {type(exc).__name__}: {exc}",
                      exc)

    def fail(self, why: str, cause: BaseException | None = None) -> None:
        """Abort the stage group (the other stages stop waiting) and raise :class:`PipelineError`."""
        text = f"meshkit.parallel: {_rank(self.group)}: pipeline {why}"
        self.group.abort(text)
        raise PipelineError(text) from cause

    # ----------------------------------------------------------------- transfers
    def check_output(self, mb: int, y: Any) -> bool:
        """Learn the output's shape and dtype from the first microbatch (True then), or fail,
        naming this stage, if ``y`` has others: checked here, where the activation leaves the
        stage, whether it crosses to another rank or to a stage of this rank."""
        spec = (tuple(y.shape), np.dtype(y.dtype))
        if self.output_spec is None:
            self.output_spec = spec
            self._xp = array_namespace(y)
            return True
        if spec != self.output_spec:
            self.fail(f"stage {self.stage_index}: the output of microbatch {mb} has shape {spec[0]} and dtype "
                      f"{spec[1]}; the first microbatch's had {self.output_spec[0]} and {self.output_spec[1]} "
                      "(activations crossing a stage boundary must keep their shape)")
        return False

    def check_input_gradient(self, mb: int, dx: Any) -> None:
        """``dx`` must be shaped as the input it is the gradient of (fails naming this stage)."""
        if dx is None or tuple(dx.shape) != self.input_spec[0] or np.dtype(dx.dtype) != self.input_spec[1]:
            got = "None" if dx is None else f"shape {tuple(dx.shape)} and dtype {dx.dtype}"
            self.fail(f"stage {self.stage_index}: backward of microbatch {mb} returned dx with {got}; the input "
                      f"had shape {self.input_spec[0]} and dtype {self.input_spec[1]}")

    def send_activation(self, mb: int, y: Any) -> list[Work]:
        """Start sending ``y`` (microbatch ``mb``'s output) to the next stage."""
        works = []
        if self.check_output(mb, y):
            header = _header(self.output_spec, on_device=self._xp is not np)
            works.append(self.group.isend(header, self.next_rank, _tag(HEADER, self.stage_index + 1)))
        self._check_engine(y)
        y = y if y.flags.c_contiguous else self._xp.ascontiguousarray(y)
        works.append(self._send(y, self.next_rank, _tag(ACTIVATION, self.stage_index + 1)))
        return works

    def recv_activation(self, mb: int) -> Any:
        """Receive microbatch ``mb``'s input from the previous stage (blocking; group timeout)."""
        if self.input_spec is None:
            header = np.empty(_HEADER_SLOTS, np.int64)
            self.group.irecv(header, self.prev_rank, _tag(HEADER, self.stage_index)).wait()
            self.input_spec, on_device = _read_header(header)
            if self.expected_input is not None and self.input_spec != self.expected_input:
                self.fail(f"stage {self.stage_index}: the previous stage sends inputs of shape {self.input_spec[0]} "
                          f"and dtype {self.input_spec[1]}; input_spec says shape {self.expected_input[0]} and dtype "
                          f"{self.expected_input[1]}")
            if on_device:
                import cupy  # the previous stage runs on a GPU: so does this one

                self._xp = cupy
            else:
                self._xp = np
        buf = self._take(self._pool_in, self.input_spec)
        self.group.irecv(buf, self.prev_rank, _tag(ACTIVATION, self.stage_index)).wait()
        self._inputs[mb] = buf
        return buf

    def send_gradient(self, mb: int, dx: Any) -> list[Work]:
        """Start sending ``dx`` (the gradient of microbatch ``mb``'s input) to the previous stage."""
        self.check_input_gradient(mb, dx)
        self._check_engine(dx)
        dx = dx if dx.flags.c_contiguous else self._xp.ascontiguousarray(dx)
        return [self._send(dx, self.prev_rank, _tag(GRADIENT, self.stage_index - 1))]

    def _check_engine(self, a: Any) -> None:
        """Device arrays cannot cross stages over NCCL yet: its sends and receives match by order
        on one stream per group, so 1F1B's crossing send and receive would wait on each other (a
        deadlock) unless fused with ``batch_isend_irecv``, which this executor does not do yet."""
        if self.group.backend == "nccl" and is_device_array(a):
            self.fail(f"stage {self.stage_index}: device arrays cannot cross pipeline stages over the NCCL engine yet "
                      "(its sends and receives match by order on one stream: 1F1B would deadlock); run the job with "
                      "init_process_group('mpi'), whose engine takes CuPy arrays (CUDA-aware or staged)")

    def recv_gradient(self, mb: int) -> Any:
        """Receive the gradient of microbatch ``mb``'s output from the next stage (blocking)."""
        buf = self._take(self._pool_grad, self.output_spec)
        self.group.irecv(buf, self.next_rank, _tag(GRADIENT, self.stage_index)).wait()
        self._grads[mb] = buf
        return buf


def _placement(placement: str, p: int) -> Callable[[int], int]:
    """Stage index -> group rank: ``i % p`` ("loop"), or the V of ZB-V (rank ``i`` holds stages
    ``i`` and ``2 p - 1 - i``)."""
    if placement == "v":
        return lambda i: i if i < p else 2 * p - 1 - i
    return lambda i: i % p


def _overlap(a: Any, b: Any) -> bool:
    """Whether two C-contiguous arrays (NumPy or CuPy) share memory."""
    def span(x: Any) -> tuple[int, int]:
        start = (x.__cuda_array_interface__ if hasattr(x, "__cuda_array_interface__") else
                 x.__array_interface__)["data"][0]
        return start, start + x.nbytes
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _header(spec: tuple[tuple[int, ...], np.dtype], *, on_device: bool) -> np.ndarray:
    shape, dtype = spec
    if len(shape) > _HEADER_SLOTS - 4:
        raise DistValueError(f"meshkit.parallel: pipeline activations have at most {_HEADER_SLOTS - 4} dims, got "
                             f"shape {shape}")
    h = np.zeros(_HEADER_SLOTS, np.int64)
    h[:2] = np.frombuffer(dtype.str.encode().ljust(16), np.int64)
    h[2], h[3] = len(shape), int(on_device)
    h[4:4 + len(shape)] = shape
    return h


def _read_header(h: np.ndarray) -> tuple[tuple[tuple[int, ...], np.dtype], bool]:
    dtype = np.dtype(h[:2].tobytes().decode().strip())
    return (tuple(int(s) for s in h[4:4 + int(h[2])]), dtype), bool(h[3])


# --------------------------------------------------------------------------- schedules
class PipelineSchedule:
    """Runs one batch through this rank's stages in the order of a schedule (see subclasses).

    Args:
        stages: this rank's stages (one, or ``v`` for the interleaved schedule).
        n_microbatches: microbatches a batch is split into, along axis 0.
        loss_fn: ``loss_fn(output, target) -> (loss, d_output)`` of one microbatch, the loss a
            mean over it; run on the last stage.
    """

    #: whether the order splits each backward into B (input gradient) and W (weight gradient)
    zero_bubble = False
    #: the stages' placement this schedule runs (PipelineStage's ``placement``)
    placement = "loop"

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int,
                 loss_fn: Callable[[Any, Any], tuple[Any, Any]]) -> None:
        self.stages = list(stages)
        group = self.stages[0].group
        head = f"meshkit.parallel: {_rank(group)}: {type(self).__name__}"
        if _integer(n_microbatches) is None or n_microbatches < 1:
            raise DistValueError(f"{head}: n_microbatches must be an int >= 1, got {n_microbatches!r}")
        n_microbatches = _integer(n_microbatches)
        if not callable(loss_fn):
            raise DistValueError(f"{head}: loss_fn must be a callable (output, target) -> (loss, d_output)")
        if any(s.group is not group or s.num_stages != self.stages[0].num_stages for s in self.stages):
            raise DistValueError(f"{head}: all stages of a rank must share one group and num_stages")
        wrong = [s for s in self.stages if s.placement != self.placement]
        if wrong:
            raise DistValueError(f"{head}: runs stages placed {self.placement!r}; stage {wrong[0].stage_index} was "
                                 f"built with placement={wrong[0].placement!r}: pass placement={self.placement!r} to "
                                 "its PipelineStage")
        self.group, self.head = group, head
        self.n_microbatches, self.loss_fn = n_microbatches, loss_fn
        self.num_stages = self.stages[0].num_stages
        self._by_index = {s.stage_index: s for s in self.stages}
        self._mail: dict[tuple[int, int, int], Any] = {}  # transfers between two stages of this rank
        self.actions = self._order()
        self._agreed = False
        self._batch: int | None = None  # x's batch size at the first step (see _agree)
        #: every rank's shared names: shape, dtype, on a device (see _agree)
        self._shared_specs: dict[str, tuple[tuple[int, ...], str, bool]] = {}

    def _order(self) -> list[Action]:
        raise NotImplementedError

    def step(self, x: Any = None, *, target: Any = None) -> list[Any] | None:
        """Run one batch: ``x`` on the rank of the first stage, ``target`` on the last's.

        Returns:
            The per-microbatch losses on the rank of the last stage, None elsewhere.

        Raises:
            PipelineError: a stage failed here (on the other ranks, their next wait fails at once).
            DistValueError: a batch that does not split into ``n_microbatches``; at the first
                step on every rank, ranks whose schedule, ``num_stages`` or ``n_microbatches`` differ.
        """
        if not self._agreed:
            self._agree(x, target)
        try:
            before = self._snapshot_shared()
            losses = self._run(x, target)
            self._sum_shared(before)
            return losses
        except PipelineError:
            raise  # the stage aborted the group already
        except BaseException as exc:  # bad input, or a transfer failed: the other ranks must not wait
            self.group.abort(f"{self.head}.step failed: {type(exc).__name__}: {exc}")
            raise

    def _agree(self, x: Any, target: Any) -> None:
        """At the first step, every rank checks that all build the same pipeline (one collective):
        ranks with other microbatch counts would scale gradients wrongly or wait forever. The same
        collective brings x's batch size (from the first stage's rank) to every rank, so that a
        target of another batch size fails on every rank: ``loss_fn`` would otherwise pair each
        microbatch with a slice of another size, and NumPy broadcasting can hide that."""
        mine = {"schedule": type(self).__name__, "num_stages": self.num_stages, "n_microbatches": self.n_microbatches}
        held = (_batch(x) if 0 in self._by_index else None,
                _batch(target) if self.num_stages - 1 in self._by_index else None)
        unsplit = [s.stage_index for s in self.stages if self.zero_bubble and not s.split_backward]
        shared = {(s.stage_index, name): (tuple(g.shape), np.dtype(g.dtype).str, is_device_array(g))
                  for s in self.stages for name, g in s.shared.items()}
        gathered = agree(self.group, (mine, held, unsplit, shared), compare=self._disagreement,
                         error=DistValueError)
        ranks = self.group.ranks
        self._shared_specs = {name: uses[0][1] for name, uses in _shared_uses(gathered).items()}
        x_at = next(((ranks[i], h[0]) for i, (_, h, *_) in enumerate(gathered) if h[0] is not None), None)
        self._batch = None if x_at is None else x_at[1]
        self._agreed = True

    def _disagreement(self, group: ProcessGroup, gathered: list[Any]) -> str | None:
        """What is wrong with every rank's ``(config, held batch sizes, unsplit stages, shared specs)``
        (the same on every rank), or None."""
        everyone = [config for config, *_ in gathered]
        ranks = group.ranks
        for i, theirs in enumerate(everyone[1:], start=1):
            if theirs != everyone[0]:
                keys = [k for k in everyone[0] if theirs[k] != everyone[0][k]]
                return (f"{self.head}.step: the ranks of the pipeline disagree: rank {ranks[0]} has "
                        f"{', '.join(f'{k}={everyone[0][k]!r}' for k in keys)} and rank {ranks[i]} "
                        f"{', '.join(f'{k}={theirs[k]!r}' for k in keys)}; every rank must build the "
                        "same schedule with the same num_stages and n_microbatches")
        unsplit = [(s, ranks[i]) for i, (*_, no, _) in enumerate(gathered) for s in no]
        if unsplit:
            s, at = unsplit[0]
            return (f"{self.head}.step: {type(self).__name__} splits each backward into its input and "
                    f"weight gradients, but stage {s} (on rank {at}) has a single backward; pass "
                    "backward_input=(ctx, dy) -> (dx, wctx) and backward_weight=(wctx) -> None to its "
                    "PipelineStage instead of backward"
                    + (f" (stages {[s for s, _ in unsplit]} have none)" if len(unsplit) > 1 else ""))
        for name, uses in _shared_uses(gathered).items():
            if len({spec for _, spec in uses}) > 1:
                return (f"{self.head}.step: the stages sharing {name!r} declare gradients of different "
                        "shapes, dtypes or devices: " + ", ".join(
                            f"stage {s}: {sp[0]} {np.dtype(sp[1])}{' (device)' if sp[2] else ''}" for s, sp in uses))
        x_at = next(((ranks[i], h[0]) for i, (_, h, *_) in enumerate(gathered) if h[0] is not None), None)
        t_at = next(((ranks[i], h[1]) for i, (_, h, *_) in enumerate(gathered) if h[1] is not None), None)
        if x_at is not None and t_at is not None and x_at[1] != t_at[1]:
            return self._batch_mismatch(t_at, x_at)
        return None

    def _snapshot_shared(self) -> list[tuple[str, Any, Any]]:
        """(name, array, copy) for each distinct shared gradient array of this rank (by identity:
        two stages of this rank accumulating into one array count it once)."""
        seen: dict[int, tuple[str, Any, Any]] = {}
        for s in self.stages:
            for name, g in s.shared.items():
                seen.setdefault(id(g), (name, g, g.copy()))
        return list(seen.values())

    def _sum_shared(self, before: list[tuple[str, Any, Any]]) -> None:
        """Each shared name's gradient = what it held before the step + every use's contribution
        of this step, each counted once: the contributions are the arrays' increments (one per
        distinct array), summed over this rank's arrays and then over the ranks (one all-reduce
        per name, in name order, every rank taking part)."""
        for name in sorted(self._shared_specs):
            mine = [(g, old) for n, g, old in before if n == name]
            if mine:
                delta = sum(g - old for g, old in mine)
            else:  # a rank holding no use adds zeros, on the device where the holders' arrays are
                shape, dtype, on_device = self._shared_specs[name]
                if on_device:
                    import cupy

                    delta = cupy.zeros(shape, np.dtype(dtype))
                else:
                    delta = np.zeros(shape, np.dtype(dtype))
            if self.group.size > 1:
                all_reduce(delta, group=self.group)
            for g, old in mine:
                g[...] = old + delta

    def _batch_mismatch(self, t_at: tuple[int, int], x_at: tuple[int, int], *, earlier: bool = False) -> str:
        x_was = f"had {x_at[1]} at the first step" if earlier else f"has {x_at[1]}"
        return (f"{self.head}.step: target has {t_at[1]} samples along axis 0 (on rank {t_at[0]}, the last stage's) "
                f"but x {x_was} (on rank {x_at[0]}, the first stage's); each microbatch's target must be that "
                f"microbatch's: pass a target of {x_at[1]} samples")

    def _run(self, x: Any, target: Any) -> list[Any] | None:
        first, last = self._by_index.get(0), self._by_index.get(self.num_stages - 1)
        xs = self._split("x", x) if first is not None else None
        ts = self._split("target", target) if last is not None else None
        if last is not None:  # after the first step: against x here, or x's batch at the first step
            x_at = (self.group.global_rank, x.shape[0]) if first is not None else (self.group.ranks[0], self._batch)
            if self._batch is not None and target.shape[0] != x_at[1]:
                raise DistValueError(self._batch_mismatch((self.group.global_rank, target.shape[0]), x_at,
                                                          earlier=first is None))
        losses: list[Any] = [None] * self.n_microbatches
        pending: dict[int, Any] = {}  # last stage: microbatch -> scaled d_output
        sends: list[Work] = []
        scale = 1.0 / self.n_microbatches
        for action in self.actions:
            stage = self._by_index[action.stage]
            mb = action.microbatch
            if action.kind == "F":
                inp = xs[mb] if stage.is_first else self._receive_input(stage, mb)
                y = stage.run_forward(mb, inp)
                if stage.is_last:
                    loss, dy = self._loss(stage, mb, y, ts[mb])
                    losses[mb] = loss
                    pending[mb] = dy * scale
                else:
                    sends += self._forward_output(stage, mb, y)
            elif action.kind == "B":
                dy = pending.pop(mb) if stage.is_last else self._receive_grad(stage, mb)
                dx = stage.run_backward_input(mb, dy) if self.zero_bubble else stage.run_backward(mb, dy)
                if not stage.is_first:
                    sends += self._backward_output(stage, mb, dx)
                if not self.zero_bubble:
                    stage.release(mb)  # after the send of dx, which may be one of the buffers
            else:  # "W": what B kept may be the received buffers (x, dy): they go back only now
                stage.run_backward_weight(mb)
                stage.release(mb)
            sends = [w for w in sends if not w.is_completed()]
        for w in sends:
            w.wait()
        for stage in self.stages:
            stage._recycle()  # every send completed: every buffer back in its pool
        return losses if last is not None else None

    def _loss(self, stage: PipelineStage, mb: int, y: Any, t: Any) -> tuple[Any, Any]:
        """``loss_fn`` on the last stage; its ``d_output`` must match the output (never broadcast)."""
        out = stage._call("loss_fn", mb, self.loss_fn, y, t)
        head = f"stage {stage.stage_index}: loss_fn of microbatch {mb} returned"
        if not isinstance(out, tuple) or len(out) != 2:
            stage.fail(f"{head} a {type(out).__name__}; it must return (loss, d_output)")
        dy = out[1]
        if not is_array(dy):
            stage.fail(f"{head} d_output of type {type(dy).__name__}; it must be an array like the output")
        if tuple(dy.shape) != tuple(y.shape) or dy.dtype != y.dtype:
            stage.fail(f"{head} d_output of shape {tuple(dy.shape)} and dtype {dy.dtype}; the output has shape "
                       f"{tuple(y.shape)} and dtype {y.dtype}, and d_output (the loss's gradient with respect to it) "
                       "must have the same")
        return out

    def _split(self, what: str, a: Any) -> list[Any]:
        m = self.n_microbatches
        if a is None or not hasattr(a, "shape") or not a.shape:
            raise DistValueError(f"{self.head}.step: {what} must be an array with a batch axis on this rank (it "
                                 f"holds stage {0 if what == 'x' else self.num_stages - 1}), got {type(a).__name__}")
        if a.shape[0] % m:
            raise DistValueError(f"{self.head}.step: {what} has {a.shape[0]} samples along axis 0, which do not "
                                 f"split into {m} equal microbatches; use a batch that is a multiple of {m}")
        size = a.shape[0] // m
        return [a[i * size:(i + 1) * size] for i in range(m)]

    # Transfers between two stages of this rank go through memory, not the group.
    def _local_next(self, stage: PipelineStage) -> PipelineStage | None:
        return self._by_index.get(stage.stage_index + 1) if stage.next_rank == self.group.rank else None

    def _forward_output(self, stage: PipelineStage, mb: int, y: Any) -> list[Work]:
        nxt = self._local_next(stage)
        if nxt is None:
            return stage.send_activation(mb, y)
        if stage.check_output(mb, y):  # as a send would: a changed output names this stage, not the next
            nxt.input_spec = stage.output_spec
        self._mail[(ACTIVATION, nxt.stage_index, mb)] = y
        return []

    def _backward_output(self, stage: PipelineStage, mb: int, dx: Any) -> list[Work]:
        prev = self._by_index.get(stage.stage_index - 1) if stage.prev_rank == self.group.rank else None
        if prev is None:
            return stage.send_gradient(mb, dx)
        stage.check_input_gradient(mb, dx)
        self._mail[(GRADIENT, prev.stage_index, mb)] = dx
        return []

    def _receive_input(self, stage: PipelineStage, mb: int) -> Any:
        key = (ACTIVATION, stage.stage_index, mb)
        return self._mail.pop(key) if key in self._mail else stage.recv_activation(mb)

    def _receive_grad(self, stage: PipelineStage, mb: int) -> Any:
        key = (GRADIENT, stage.stage_index, mb)
        if key in self._mail:
            return self._mail.pop(key)
        return stage.recv_gradient(mb)


class _OneStagePerRank(PipelineSchedule):
    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Callable[[Any, Any], tuple[Any, Any]]
                 ) -> None:
        if not isinstance(stage, PipelineStage):
            raise DistValueError(f"meshkit.parallel: {type(self).__name__} takes one PipelineStage, got "
                                 f"{type(stage).__name__} (ScheduleInterleaved1F1B takes several)")
        if stage.num_stages != stage.group.size:
            raise DistValueError(f"meshkit.parallel: {_rank(stage.group)}: {type(self).__name__} runs one stage per "
                                 f"rank: num_stages {stage.num_stages} != the group's {stage.group.size} ranks")
        super().__init__([stage], n_microbatches, loss_fn)


class ScheduleGPipe(_OneStagePerRank):
    """GPipe: every microbatch's forward, then every backward (one stage per rank)."""

    def _order(self) -> list[Action]:
        return gpipe_order(self.stages[0].stage_index, self.num_stages, self.n_microbatches)


class Schedule1F1B(_OneStagePerRank):
    """1F1B: warm-up forwards, then one forward one backward; at most ``num_stages -
    stage_index`` microbatches' activations alive on a stage (one stage per rank)."""

    def _order(self) -> list[Action]:
        return one_f_one_b_order(self.stages[0].stage_index, self.num_stages, self.n_microbatches)


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Megatron-LM's interleaved 1F1B: this rank's stages ``r, r + p, ...`` (``v`` per rank).

    Needs ``n_microbatches`` a multiple of the group's size ``p`` (microbatches go through a
    rank's stages in rounds of ``p``, as in Megatron-LM).
    """

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int,
                 loss_fn: Callable[[Any, Any], tuple[Any, Any]]) -> None:
        stages = sorted(stages, key=lambda s: s.stage_index) if isinstance(stages, (list, tuple)) else stages
        if not isinstance(stages, list) or not stages or not all(isinstance(s, PipelineStage) for s in stages):
            raise DistValueError("meshkit.parallel: ScheduleInterleaved1F1B takes a non-empty list of PipelineStage")
        g = stages[0].group
        p, v = g.size, stages[0].num_stages // g.size
        want = [g.rank + i * p for i in range(v)]
        if [s.stage_index for s in stages] != want:
            raise DistValueError(f"meshkit.parallel: {_rank(g)}: ScheduleInterleaved1F1B needs this rank's stages "
                                 f"{want} of {stages[0].num_stages}, got {[s.stage_index for s in stages]}")
        if _integer(n_microbatches) is not None and n_microbatches % p:
            raise DistValueError(f"meshkit.parallel: {_rank(g)}: ScheduleInterleaved1F1B needs n_microbatches a "
                                 f"multiple of the {p} pipeline ranks, got {n_microbatches}")
        self.virtual = v
        super().__init__(stages, n_microbatches, loss_fn)

    def _order(self) -> list[Action]:
        return interleaved_order(self.group.rank, self.group.size, self.virtual, self.n_microbatches)


class ScheduleZBH1(_OneStagePerRank):
    """ZB-H1 (Qi et al., 2024): 1F1B with each backward split into B (input gradient) and W
    (weight gradient), W run later, in what 1F1B leaves idle. With equal F, B and W times the
    bubble is about a third of 1F1B's (:func:`~.schedules.bubble_fraction` "zbh1"), and no stage
    holds more microbatches (F done, W not yet) than 1F1B's first stage: ``min(p, m)``. Its
    stage must give ``backward_input`` and ``backward_weight`` (checked at the first step, on
    every rank). Any ``n_microbatches``."""

    zero_bubble = True

    def _order(self) -> list[Action]:
        return zb_h1_order(self.stages[0].stage_index, self.num_stages, self.n_microbatches)


class ScheduleZBVZeroBubble(PipelineSchedule):
    """ZB-V (Qi et al., 2024; torch's ``ScheduleZBVZeroBubble``): two stages per rank in a V,
    rank ``r`` holding stages ``r`` and ``2 p - 1 - r`` (build them with ``placement="v"``),
    each backward split into B and W. With equal pass times its bubble is about a sixth of
    1F1B's once ``2 m >= 3 p - 1`` (:func:`~.schedules.bubble_fraction` "zbv"). Any
    ``n_microbatches``; the stages must give ``backward_input`` and ``backward_weight``."""

    zero_bubble = True
    placement = "v"

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int,
                 loss_fn: Callable[[Any, Any], tuple[Any, Any]]) -> None:
        stages = sorted(stages, key=lambda s: s.stage_index) if isinstance(stages, (list, tuple)) else stages
        if not isinstance(stages, list) or not stages or not all(isinstance(s, PipelineStage) for s in stages):
            raise DistValueError("meshkit.parallel: ScheduleZBVZeroBubble takes a list of this rank's two "
                                 "PipelineStage")
        g = stages[0].group
        p = g.size
        want = [g.rank, 2 * p - 1 - g.rank]
        if [s.stage_index for s in stages] != want or stages[0].num_stages != 2 * p:
            raise DistValueError(f"meshkit.parallel: {_rank(g)}: ScheduleZBVZeroBubble needs this rank's stages "
                                 f"{want} of {2 * p} (rank r holds stages r and 2p - 1 - r, placement='v'), got "
                                 f"{[s.stage_index for s in stages]} of {stages[0].num_stages}")
        super().__init__(stages, n_microbatches, loss_fn)

    def _order(self) -> list[Action]:
        return zbv_order(self.group.rank, self.group.size, self.n_microbatches)
