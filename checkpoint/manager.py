"""CheckpointManager: numbered checkpoints in one directory, the newest ``max_to_keep`` kept.

Each step's checkpoint is the directory ``<directory>/step_<step>``, which only exists once
complete (:mod:`.save` commits by one atomic rename), so :meth:`latest_step` never returns an
incomplete one. Old checkpoints are removed by renaming them aside first, so a crash while
deleting cannot leave a half-deleted one under a step's name. Rank 0 also removes what crashes
left (:mod:`.cleanup`) when the manager is made and after each save.

:meth:`CheckpointManager.restore` takes the newest checkpoint that loads: one that fails
verification (a flipped byte, a missing file) would otherwise fail an elastic job the same way on
every restart. A skipped one is renamed aside (``step_<n>.skipped-<random>``, never removed) once
an older one has loaded, so that the resumed run's own save of that step does not collide with it
and pruning does not count it; ``fallback=False`` refuses instead.

A save of a step this manager saved, or began to save, before a failure the job survived, and which
is still there complete, is skipped (on every rank alike): under ``meshkit-run --survive`` the survivors of a
failure may roll back a few steps and replay them (docs/elastic.md "Surviving failures"), and the
replay's save of a step that committed before the failure would otherwise fail, as a save never
overwrites. The step on disk is the same step of the same run (the replay reproduces it). A step
saved twice with no failure survived in between (a loop's mistake: the second state may differ),
and a step this manager did not save (another run's, left in the directory), still make the
save fail.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from ..comm import ProcessGroup, ReduceOp, broadcast_object_list
from ..comm._seams import recoveries, resolve_group
from .cleanup import remove_stale
from .errors import CheckpointError
from .format import METADATA
from .reader import load
from .writer import async_save, save

__all__ = ["CheckpointManager"]

logger = logging.getLogger("meshkit.checkpoint")

_STEP = re.compile(r"step_(\d+)")


class CheckpointManager:
    """Save and find checkpoints by training step (orbax's ``CheckpointManager``).

    Args:
        directory: where the ``step_<n>`` checkpoints live (created if missing).
        max_to_keep: keep only this many newest checkpoints (None: keep all).
        group: the ranks that save and load together (default: the world, the one of each call: after
            ``meshkit.parallel.survive.shrink`` under ``meshkit-run --survive`` the survivors' world).
        fallback: whether :meth:`restore` skips checkpoints that do not load (True, the default)
            or raises the newest one's error (False).

    Example::

        manager = CheckpointManager("ckpt", max_to_keep=3)
        start = manager.restore(state_dict) or 0     # the newest one that loads, if any
        ...
        manager.save(step, state_dict)
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = None,
                 group: ProcessGroup | None = None, fallback: bool = True) -> None:
        if not isinstance(fallback, bool):
            raise CheckpointError(f"meshkit.checkpoint: CheckpointManager: fallback must be True or False, got "
                                  f"{fallback!r}")
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or isinstance(max_to_keep, bool)
                                        or max_to_keep < 1):
            raise CheckpointError(f"meshkit.checkpoint: CheckpointManager: max_to_keep must be a positive int or "
                                  f"None, got {max_to_keep!r}")
        self.directory = Path(directory)
        self.max_to_keep = max_to_keep
        self.fallback = fallback
        self._group = group
        resolve_group(group)  # a bad group, or no world, is an error here, not at the first save
        #: serializes pruning: an async_save's writer thread and the caller's next save prune at once
        self._prune_lock = threading.Lock()
        #: names of step_ entries owned by another user, warned about once
        self._foreign: set[str] = set()
        #: the steps whose save this manager began, each with the failures survived by then (comm's
        #: ``recoveries()``): a save of one after a later recovery is a replay's, skipped where the step
        #: is complete on disk (a save that met a dead rank may have committed: rank 0 finished, then
        #: died before the others' save returned)
        self._tried: dict[int, int] = {}
        if self.group.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._prune(steps=False)  # only the leftovers of crashes: no step is dropped before a save

    @property
    def group(self) -> ProcessGroup:
        """The ranks that save and load together: the group given, else the world of now (a world
        rebuilt on the survivors of a failure replaces the one this manager was made in)."""
        return resolve_group(self._group)

    def path(self, step: int) -> Path:
        """The directory of ``step``'s checkpoint."""
        return self.directory / f"step_{int(step)}"

    def all_steps(self) -> list[int]:
        """The steps with a complete checkpoint, in increasing order (reads the directory).

        A ``step_<n>`` that another user owns (the directory, or a symbolic link planted in a
        directory others may write in) is not this job's: it is left out, with a warning, so that
        it is neither restored nor pruned. Load one deliberately with :func:`load` and its path.
        """
        if not self.directory.is_dir():
            return []
        steps = []
        for p in self.directory.iterdir():
            m = _STEP.fullmatch(p.name)
            if m and (p / METADATA).is_file() and self._own(p):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def _own(self, path: Path) -> bool:
        """Whether ``path`` (not followed) belongs to this process's user; warns once a name if not."""
        try:
            owner = path.lstat().st_uid
        except OSError:  # removed meanwhile
            return False
        if owner == os.geteuid():
            return True
        if path.name not in self._foreign:
            self._foreign.add(path.name)
            logger.warning("meshkit.checkpoint: CheckpointManager: %s is owned by uid %d, not this user (uid %d): it "
                           "is not this job's checkpoint and is neither restored nor removed", path, owner,
                           os.geteuid())
        return False

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, state_dict: dict[str, Any]) -> None:
        """Save ``state_dict`` as ``step`` (collective), then drop checkpoints beyond ``max_to_keep``.

        A step this manager saved before and still holds complete is skipped (a replay after a
        survived failure: see the module's docstring)."""
        group = self.group
        if self._replayed(step, group):
            return
        path = self._new(step)
        self._tried[int(step)] = recoveries()
        save(state_dict, checkpoint_id=path, group=group)
        self._prune(group)

    def _replayed(self, step: int, group: ProcessGroup) -> bool:
        """Whether ``step`` is a replay's save of a step this manager saved, or began to save, before a
        failure survived since, and which is complete on disk (rank 0's view): the save is skipped.

        Only in a job that survived a failure (``recoveries()``, the same on every survivor), and then
        collective on every save: one small all-reduce of (saved or begun before, complete). A
        survivor that was still in an earlier call when the failure struck never began the save, so
        one rank's memory is not enough; and rank 0 may have committed the step and died before the
        others' save returned (they began it, none finished it)."""
        now = recoveries()
        if not now:
            return False
        key = int(step)
        before = self._tried.get(key, now) < now
        votes = np.array([before, group.rank == 0 and key in self.all_steps()], dtype=np.int64)
        group.all_reduce(votes, ReduceOp.MAX)
        if not (votes[0] and votes[1]):
            return False
        logger.info("meshkit.checkpoint: CheckpointManager: step %d was saved before a failure the job survived; "
                    "the replay's save of it is skipped (%s is complete)", step, self.path(step))
        return True

    def async_save(self, step: int, state_dict: dict[str, Any]) -> "Future[None]":
        """:func:`~meshkit.checkpoint.async_save` as ``step``; old ones are dropped once it commits.

        The future completes when the checkpoint is committed and, on rank 0, the checkpoints
        beyond ``max_to_keep`` are removed.
        """
        group = self.group  # resolved here: the writer thread has no world of its own (the local engine's)
        future: Future[None] = Future()
        future.set_running_or_notify_cancel()
        if self._replayed(step, group):
            future.set_result(None)
            return future
        path = self._new(step)
        self._tried[int(step)] = recoveries()
        inner = async_save(state_dict, checkpoint_id=path, group=group)

        def done(f: "Future[None]") -> None:  # on the writer thread
            exc = f.exception()
            if exc is not None:
                future.set_exception(exc)
                return
            try:
                self._prune(group)
            finally:
                future.set_result(None)

        inner.add_done_callback(done)
        return future

    def restore(self, state_dict: dict[str, Any]) -> int | None:
        """Load the newest checkpoint that loads, if there is one, into ``state_dict`` (collective).

        Returns its step, or None (nothing loaded) when there is none: the usual start of a job
        that may be resuming. Rank 0's view of the directory decides for every rank.

        A checkpoint that does not load (it fails verification: a flipped byte, a truncated or
        missing file; or it does not fit ``state_dict``) is skipped for the next newest, with a
        warning on every rank naming the step and the reason (the same text on every rank: the
        ranks agree on each load's outcome, so they load the same step). Once an older one has
        loaded, each skipped one is renamed aside to ``step_<n>.skipped-<random>`` by rank 0, kept
        for inspection (rename it back to retry it): left under its name it would make the
        resumed run's save of step ``n`` fail (a save never overwrites) and count towards
        ``max_to_keep``. With ``fallback=False`` the newest one's error is raised instead.

        Raises:
            CheckpointError: on every rank, with nothing loaded: none of the checkpoints loads
                (each step and its reason named; none is renamed), or the newest does not load
                and ``fallback`` is False.
        """
        listing = [(self.all_steps(), uuid.uuid4().hex[:8])]  # the suffix of the names aside, rank 0's
        broadcast_object_list(listing, group=self.group, group_src=0)
        steps, suffix = listing[0]
        skipped: list[tuple[int, str]] = []
        for step in reversed(steps if self.fallback else steps[-1:]):
            try:
                load(state_dict, checkpoint_id=self.path(step), group=self.group)
            except CheckpointError as exc:  # raised on every rank alike, nothing loaded
                if not self.fallback:
                    raise
                skipped.append((step, str(exc)))
                continue
            for bad, reason in skipped:
                self._set_aside(bad, reason, step, suffix)
            return step
        if skipped:
            reasons = "; ".join(f"step {bad}: {reason}" for bad, reason in skipped)
            raise CheckpointError(f"meshkit.checkpoint: rank {self.group.rank}: CheckpointManager.restore: none of "
                                  f"the {len(skipped)} checkpoints in {str(self.directory)!r} loads, each is kept: "
                                  f"{reasons}")
        return None

    def _set_aside(self, step: int, reason: str, restored: int, suffix: str) -> None:
        """Warn (every rank) that ``step`` was skipped for ``restored``; rank 0 renames it aside."""
        aside = self.directory / f"step_{step}.skipped-{suffix}"
        logger.warning("meshkit.checkpoint: CheckpointManager.restore: skipped step %d in %r: it does not load (%s); "
                       "restored step %d instead; step %d is kept as %r", step, str(self.directory), reason, restored,
                       step, str(aside))
        if self.group.rank == 0:
            try:
                os.rename(self.path(step), aside)
            except OSError as exc:  # never raised on rank 0 alone: the load succeeded everywhere
                logger.warning("meshkit.checkpoint: rank 0: CheckpointManager.restore could not rename the skipped "
                               "%s to %s: %s; a save of step %d will fail until it is moved", self.path(step), aside,
                               exc, step)

    def load(self, step: int | None, state_dict: dict[str, Any]) -> int:
        """Load ``step``'s checkpoint (None: the latest, as rank 0 sees the directory) into
        ``state_dict`` in place (collective); returns the step.

        Raises:
            CheckpointError: no checkpoint (for that step), or a bad one (see :func:`load`).
        """
        if step is None:  # rank 0's view of the directory decides, so no two ranks load different steps
            latest = [self.latest_step()]
            broadcast_object_list(latest, group=self.group, group_src=0)
            step = latest[0]
            if step is None:
                raise CheckpointError(f"meshkit.checkpoint: rank {self.group.rank}: no complete checkpoint in "
                                      f"{str(self.directory)!r}")
        load(state_dict, checkpoint_id=self.path(step), group=self.group)
        return step

    def _new(self, step: int) -> Path:
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise CheckpointError(f"meshkit.checkpoint: rank {self.group.rank}: step must be a non-negative int, "
                                  f"got {step!r}")
        return self.path(step)

    def _prune(self, group: ProcessGroup | None = None, *, steps: bool = True) -> None:
        """Rank 0: remove the oldest complete checkpoints beyond ``max_to_keep`` (if ``steps``),
        and what crashed saves and prunes left (:func:`~.cleanup.remove_stale`: ``.tmp-``
        directories idle for twice the group's timeout, ``.deleting-`` ones).

        Never raises: the save before it is complete on every rank, and an error here on rank 0
        alone would tell the ranks different stories; a failure is logged as a warning.
        """
        group = group or self.group
        if group.rank != 0:
            return
        with self._prune_lock:
            try:
                for step in self.all_steps()[:-self.max_to_keep] if steps and self.max_to_keep else ():
                    doomed = self.directory / f".deleting-{uuid.uuid4().hex[:8]}-step_{step}"
                    try:
                        os.rename(self.path(step), doomed)  # atomic: the step is gone before any file is
                    except FileNotFoundError:  # removed meanwhile (another manager on this directory)
                        continue
                    shutil.rmtree(doomed, ignore_errors=True)
                remove_stale(self.directory, idle_after=2 * group.timeout)
            except OSError as exc:
                logger.warning("meshkit.checkpoint: rank 0: CheckpointManager could not remove old checkpoints in "
                               "%s (max_to_keep=%s): %s", self.directory, self.max_to_keep, exc)
