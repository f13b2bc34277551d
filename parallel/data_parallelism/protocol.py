"""The training-loop protocol every data-parallel strategy implements.

One loop trains DDP, ZeRO-1/2, FSDP and HSDP alike::

    model = data_parallel(params, mesh["dp"], "fsdp", optimizer=AdamW(lr=1e-3),
                          units=[["w0", "b0"], ["w1", "b1"]])
    for x, y in batches:
        model.zero_grad()
        for i in range(len(model.units)):            # forward, unit by unit
            with model.unshard(i) as p:              # {name: full parameter} while it runs
                ...
        for i in reversed(range(len(model.units))):  # backward, last unit first
            with model.unshard(i) as p:
                ...
            model.mark_grad_ready("w1", dw1)         # final: reduction starts when its bucket/unit is complete
        model.step()                                 # finish the sync, run the optimizer

:func:`~meshkit.parallel.data_parallelism.factory.data_parallel` builds any of them. ``unshard(i)`` yields the
parameters themselves under DDP and ZeRO (nothing is gathered) and gathers unit ``i`` under FSDP;
``prefetch(i)`` starts that gather early (a no-op where nothing is gathered). Under
``with model.no_sync():`` gradients add up locally for gradient accumulation; the next
synchronized pass reduces the sum. ``full_state_dict()`` is ``{"model": ..., "optim": ...}``
gathered to full size as NumPy arrays on every rank (``state_dict()``'s shape, views of this
rank's pieces), ``memory_report()`` the bytes held.

:class:`ReplicatedUnits` is the part DDP and ZeRO hold for the unit half of the protocol;
:func:`deprecated` is how an old spelling says which new one replaces it. The protocol itself is
a type, :class:`~meshkit.parallel.strategy.Strategy`.

The rules, written once here for every strategy: DDP and ZeRO-1/2
(:class:`~meshkit.parallel.data_parallelism.reducer.GradientReducer`) and FSDP/HSDP
(:class:`~meshkit.parallel.data_parallelism.fsdp.FullyShardedDataParallel`) hold gradients
differently (buckets, unit shards) but take the loop by the same rules, checked here with the same
words, so that no strategy forgives what another refuses:

1. **A gradient is its parameter's**: its shape, its dtype (FSDP: the dtype ``unshard`` yields,
   ``param_dtype`` if set) and its array library. Nothing is cast silently (float32 gradients of
   float64 parameters carry float32 rounding into float64 training: 2.7e-9 off after 3 steps in
   one measured case, outside the 1e-10 that float64 holds). :func:`check_gradient` refuses it on
   the rank that passes it, and nothing changes.
2. **One mark per gradient per synchronized backward pass**: a second one is refused
   (:func:`marked_twice`) and changes nothing. Under ``no_sync()`` each mark is a micro-batch's.
3. **The reduction does not depend on the order ranks mark gradients**: reductions are issued in
   one fixed order on every rank (DDP, ZeRO: bucket order; FSDP: last unit first), a bucket or unit
   complete early waiting for those before it. Collectives pair by order, so a rank-dependent
   order averaged one unit's gradients with another's (0.16-0.29 off after 3 steps).
4. **A synchronized pass ends with ``step()``** (or ``clip_grad_norm_()``, which ends it first).
   ``zero_grad()`` on a pass that ``step()`` would end discards it (:data:`DISCARD`); a mark on a
   pass whose every gradient is marked is a second mark or a skipped ``step()``
   (:func:`marked_after_complete`). Both end the pass collectively, as the peers' ``step()`` does,
   so the ranks' collectives stay paired and the agreement below decides.
5. **A pass fails on every rank or on none** (:class:`PassAgreement`): one small all-reduce per ended
   pass tells every rank what each did with it and how many optimizer steps each has taken. Every
   rank using it, or every rank discarding it (a step skipped everywhere alike), passes; a problem
   on any rank, ranks discarding while others step (a rank that skipped ``step()`` and carried on),
   or step counts that differ (one that skipped ``step()`` after ``clip_grad_norm_()``) raise on
   every rank, naming the ranks, before any of them applies the pass. The same all-reduce
   compares each group's call fingerprint (comm/groups/call_fingerprint.py): a collective mismatch during
   the pass raises ``CollectiveMismatchError`` on every rank, and nothing is applied.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ...comm import CollectiveMismatchError, DistValueError, ProcessGroup, ReduceOp
from ...comm._seams import FINGERPRINT_SLOTS, agree, stamp_fingerprint, verify_fingerprint
from ..arrays import array_namespace, check_same_library, to_host
from ..checks import on_ranks, where

__all__ = ["ReplicatedUnits", "check_units", "deprecated", "old_optimizer_argument", "split_state_dict", "USE", "FAILED", "DISCARD", "PassAgreement", "agreement_size", "MISMATCH", "check_gradient",
           "marked_twice", "marked_after_complete", "discarded_pass", "refused_after_failure", "failed_sync"]


def deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated in favour of ``new`` (a DeprecationWarning at the caller's
    line: Python's default filters show it once per call site)."""
    warnings.warn(f"meshkit.parallel: {old} is deprecated; {new}", DeprecationWarning, stacklevel=stacklevel)


def old_optimizer_argument(method: Callable[[Any], dict[str, int]]) -> Callable[..., dict[str, int]]:
    """``method(self)`` that also takes 0.2's ``method(self, optimizer)`` (a strategy built without
    one: its ``optimizer_state`` is that optimizer's), warning; the signature shown is ``method``'s,
    the protocol's (``functools.wraps``)."""
    @functools.wraps(method)
    def accepting(self: Any, optimizer: Any = None) -> dict[str, int]:
        report = method(self)
        if optimizer is not None:
            deprecated(f"{type(self).__name__}.{method.__name__}(optimizer)",
                       f"pass optimizer= to the constructor and call {method.__name__}()")
            report["optimizer_state"] = optimizer.state_nbytes()
        return report
    return accepting


def split_state_dict(op: str, state_dict: Any, group: ProcessGroup | None = None
                     ) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """``(model, optim)`` of a state dict of ``state_dict()``'s shape ``{"model": ..., "optim": ...}``
    (``op`` and ``group``, whose global rank the message names: as :func:`~meshkit.parallel.checks.where`'s).

    Raises:
        DistValueError: it is not a mapping of those two keys, each a mapping (naming what it got).
    """
    if isinstance(state_dict, Mapping) and isinstance(state_dict.get("model"), Mapping) \
            and isinstance(state_dict.get("optim", {}), Mapping):
        return state_dict["model"], state_dict.get("optim", {})
    got = sorted(map(str, state_dict)) if isinstance(state_dict, Mapping) else type(state_dict).__name__
    raise DistValueError(f"{where(op, group)}: state_dict must be {{'model': {{name: value}}, "
                         f"'optim': {{'state': ..., 'step': ...}}}} (state_dict()'s shape), got {got}")


def check_units(params: Mapping[str, Any], units: Sequence[Sequence[str]] | None
                ) -> tuple[list[list[str]] | None, str | None]:
    """The units as lists (default: one unit of every parameter), and what is wrong with them (or None)."""
    if units is None:
        return [list(params)], None
    try:
        units = [list(u) for u in units]
    except TypeError:
        return None, f"units must be a list of lists of parameter names, got {units!r}"
    seen = [n for u in units for n in u]
    unknown = [n for n in seen if n not in params]
    twice = sorted({n for n in seen if seen.count(n) > 1})
    missing = [n for n in params if n not in seen]
    if unknown or twice or missing or any(not u for u in units):
        return None, (f"units must put every parameter in exactly one non-empty unit; unknown names {unknown}, "
                      f"in several units {twice}, in none {missing}; valid names are {list(params)}")
    return units, None


class ReplicatedUnits:
    """``units``, ``unshard`` and ``prefetch`` of a strategy whose every rank holds the full
    parameters (DDP, ZeRO), as a part the strategy holds: ``unshard(i)`` yields unit ``i``'s
    entries of ``params``, the parameters themselves, without communication.

    Args:
        units: the strategy's units (lists of parameter names).
        params: the strategy's parameters (read at each ``unshard``).
        where: the strategy's error prefix for an operation (``where("unshard")``).
    """

    def __init__(self, units: list[list[str]], params: Mapping[str, Any], where: Callable[[str], str]) -> None:
        self.units, self.params, self._where = units, params, where

    def _unit(self, unit: Any, op: str) -> int:
        if isinstance(unit, bool) or not isinstance(unit, int) or not 0 <= unit < len(self.units):
            raise DistValueError(f"{self._where(op)}: unknown unit {unit!r}; valid units are 0..{len(self.units) - 1}")
        return unit

    def prefetch(self, unit: int) -> None:
        """Nothing to gather: every rank holds the full parameters (checks ``unit``)."""
        self._unit(unit, "prefetch")

    @contextlib.contextmanager
    def unshard(self, unit: int) -> Iterator[dict[str, Any]]:
        """Yield ``{name: parameter}`` of ``unit``: the parameters themselves (no communication)."""
        u = self._unit(unit, "unshard")
        params = self.params
        yield {name: params[name] for name in self.units[u]}


# ---------------------------------------------------------------------------- the rules

#: What a rank does with the pass it ends: uses its gradients (``step()``, ``clip_grad_norm_()``,
#: ``finish_gradient_sync()``), has a problem with it, or discards it (``zero_grad()``).
USE, FAILED, DISCARD = 0, 1, 2
def agreement_size(ranks: int) -> int:
    """int32 elements of a group's agreement (:class:`PassAgreement`): a row per rank, then the
    call fingerprint (the planner lists its all-reduce)."""
    return ranks * SLOTS + FINGERPRINT_SLOTS


#: A row's code once a group's call fingerprints differed (carried to the next group, HSDP).
MISMATCH = 3
#: Slots of a rank's row in the agreement: what it does with the pass, optimizer steps it has taken.
SLOTS = 2


def check_gradient(head: str, name: str, grad: Any, shape: tuple[int, ...], dtype: Any, like: Any, like_arg: str,
                   *, block: bool = False) -> None:
    """Refuse a gradient that is not of its parameter's shape, dtype and array library (rule 1).

    Args:
        head: the message prefix (``"meshkit.parallel: rank R: OP"``).
        shape, dtype: what the gradient must be (``block``: this rank's block of a DTensor parameter).
        like, like_arg: an array of the parameters' library, and how the message names it.

    Raises:
        DistTypeError: an array of another library (NumPy for CuPy parameters, or the reverse).
        DistValueError: another shape or dtype, naming both.
    """
    if grad.__class__ is like.__class__ and grad.shape == shape and grad.dtype == dtype:
        return
    check_same_library(head, f"gradient {name!r}", grad, like, like_arg, ref_plural=True)
    if getattr(grad, "shape", None) != shape or getattr(grad, "dtype", None) != dtype:
        whose = "this rank's block of the DTensor parameter: shape" if block else "the parameter's shape"
        raise DistValueError(f"{head}: gradient {name!r} has shape {getattr(grad, 'shape', None)} and dtype "
                             f"{getattr(grad, 'dtype', None)}; expected {whose} {shape} and dtype {np.dtype(dtype)}")


def marked_twice(head: str, name: str) -> DistValueError:
    """The refusal of a second mark in a pass (rule 2)."""
    return DistValueError(f"{head}: gradient {name!r} was already marked ready in this backward pass")


def marked_after_complete(name: str) -> str:
    """This rank's problem when it marks a gradient of a pass whose every gradient is marked (rule 4)."""
    return (f"gradient {name!r} was marked ready again after every gradient of the backward pass was marked, "
            "before step() ended the pass (a second mark, or a skipped step())")


def discarded_pass(users: list[int]) -> str:
    """A rank's problem when it discarded the pass that ranks ``users`` stepped on (rule 4)."""
    return (f"zero_grad() discarded a backward pass that step() had not ended: step() was skipped on this rank, "
            f"while rank(s) {users} ended the pass to use its gradients (step() or clip_grad_norm_())")


def refused_after_failure(head: str, failure: str) -> DistValueError:
    """The refusal to use (read, step on) the gradients of a pass that failed, until ``zero_grad()``."""
    return DistValueError(f"{head}: {failure}; the gradients of that pass were discarded: call zero_grad() and run "
                          "the backward pass again")


def failed_sync(head: str, failure: str) -> DistValueError:
    """The error every rank raises when the agreement says the pass failed."""
    return DistValueError(f"{head}: {failure}. This pass's gradients were discarded (zeroed) on every rank; run "
                          "the backward pass again")


class PassAgreement:
    """Whether every rank ended the pass alike (rule 5), and made the same calls on each group: one
    small all-reduce per group.

    Each rank writes its row (what it does with the pass, the optimizer steps it has taken) into
    an int32 array of one row per rank of the group, zero elsewhere, followed by the group's call
    fingerprint (comm/groups/call_fingerprint.py: a collective whose arguments differed between ranks,
    which MPI lets through as garbage); a MAX all-reduce gives every rank every row and tells whether
    every fingerprint was equal, and the one device-to-host copy of a sync (the host must branch).
    With two groups (HSDP: shard, then replicate) the second all-reduce carries each shard group's
    verdict, so that every rank of the mesh reaches the same one. Only when it is a failure are the
    problems themselves gathered (:func:`~meshkit.comm._seams.agree`), to be named on every rank; a mismatch is
    named by the members of the group where it happened (they exchange their last calls) and, in
    HSDP, reported by the rest as found on another group (a mismatch on a replicate group reaches
    that group's members only: nothing of the second stage flows back).

    Args:
        groups: the data-parallel groups, in order (every rank of the strategy is in each kind).
        like: an array of the strategy's library: the rows live there (device memory on NCCL).
        what: how a mismatch names the comparison (``"DDP's gradient sync"``).
    """

    def __init__(self, groups: Sequence[ProcessGroup], like: Any, what: str = "the gradient sync") -> None:
        self.groups = list(groups)
        self._xp = array_namespace(like)
        self.what = what

    def __call__(self, code: int, steps: int, problem: str | None) -> str | None:
        """Collective over the groups: None when the ranks agree, else what failed on which ranks
        (the same text on every rank).

        Args:
            code: :data:`USE` or :data:`DISCARD` (a ``problem`` makes it :data:`FAILED`).
            steps: the optimizer steps this rank's strategy has taken.
            problem: what is wrong on this rank, or None.

        Raises:
            CollectiveMismatchError: the ranks' calls on a group differed (on every rank).
        """
        row = (FAILED if problem is not None else code, steps)
        checked = []
        for group in self.groups:
            n = group.size
            values, token = stamp_fingerprint(group)
            host = np.zeros(agreement_size(n), dtype=np.int32)
            host[group.rank * SLOTS:(group.rank + 1) * SLOTS] = row
            host[n * SLOTS:] = values
            flat = self._xp.asarray(host)  # NumPy: the same array; CuPy: one host-to-device copy
            group.all_reduce(flat, ReduceOp.MAX)
            got = to_host(flat)
            fingerprints = got[n * SLOTS:]
            checked.append((group, fingerprints, token))
            same = fingerprints[0] == -fingerprints[2] and fingerprints[1] == -fingerprints[3]
            row = _verdict(got[:n * SLOTS].reshape(n, SLOTS)) if same and row[0] != MISMATCH else (MISMATCH, steps)
        for group, fingerprints, token in checked:  # raises on the members of a group whose calls differed
            verify_fingerprint(group, fingerprints, token, self.what)
        if row[0] == MISMATCH:
            raise CollectiveMismatchError(
                f"meshkit.parallel: rank {self.groups[0].global_rank}: {self.what} found a collective mismatch on "
                "another group of the strategy in this step (the members of that group name the calls); nothing of "
                "this step was applied")
        if row[0] != FAILED:
            return None
        return self._explain(code, steps, problem)

    def _explain(self, code: int, steps: int, problem: str | None) -> str:
        """Gather every rank's row and problem (the failure path only) and name what went wrong."""
        mine = [(self.groups[0].global_rank, FAILED if problem is not None else code, steps, problem)]
        # every rank's entry, on every rank (nothing to compare: it never raises)
        entries = agree(self.groups, mine, error=DistValueError,
                        combine=lambda parts: sorted({e[0]: e for part in parts for e in part}.values()))
        most = max(entry[2] for entry in entries)
        users = [rank for rank, c, _, _ in entries if c == USE]
        ahead = [rank for rank, _, s, _ in entries if s == most]
        problems: list[tuple[int, str | None]] = []
        for rank, c, s, p in entries:
            said = [p] if p is not None else []
            if c == DISCARD and users:
                said.append(discarded_pass(users))
            if s < most:
                said.append(f"it has taken {s} optimizer step(s) where rank(s) {ahead} took {most}: step() was "
                            "skipped on this rank")
            problems.append((rank, "; ".join(said) if said else None))
        failed = [rank for rank, p in problems if p is not None]
        return f"the gradient sync failed on rank(s) {failed}: " + on_ranks(problems)


def _verdict(rows: np.ndarray) -> tuple[int, int]:
    """The group's row for the next stage: the common (code, steps), or FAILED where they differ."""
    codes, steps = rows[:, 0], rows[:, 1]
    if (codes == MISMATCH).any():
        return MISMATCH, int(steps.max())
    if codes[0] != FAILED and (codes == codes[0]).all() and (steps == steps[0]).all():
        return int(codes[0]), int(steps[0])
    return FAILED, int(steps.max())
