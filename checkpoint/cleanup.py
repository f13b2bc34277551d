"""Removing what crashes leave in a CheckpointManager's directory: stale ``.tmp-`` and ``.deleting-`` directories.

A save writes into ``.step_<n>.tmp-<random>/`` and commits by renaming it; a prune renames
``step_<n>`` to ``.deleting-<random>-step_<n>/`` and then removes it. A crash in between leaves
those directories behind, forever invisible to :meth:`CheckpointManager.all_steps`, but holding
disk space. The rule for removing them:

* ``.deleting-`` directories: always. Nothing reads one (it left its step's name atomically)
  and removing one that another process is removing too is harmless (errors ignored).
* ``.tmp-`` directories: only when nothing in them (the directory, its data files, its
  markers) was modified for more than ``idle_after`` seconds, twice the group's timeout. A save
  in flight is never that idle: every rank waits at most ``timeout`` after its own last write
  there (rank 0 for the markers, the others for the commit; a rank writing its data file
  updates its mtime as it goes), so after ``timeout`` of silence no rank is waiting for it any
  more; twice that leaves a margin for the clocks of hosts sharing the file system. Removing
  one earlier would fail a save in flight (on every rank: rank 0's verdict, ``writer._decide``).

A save that fails removes its own temporary directory (rank 0, once every rank is done with it),
so what is left here is a crash's: a killed rank 0, or a directory that could not be removed.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from pathlib import Path

__all__ = ["remove_stale"]

logger = logging.getLogger("meshkit.checkpoint")

_TMP = re.compile(r"\.step_\d+\.tmp-[0-9a-f]+")
_DELETING = re.compile(r"\.deleting-[0-9a-f]+-step_\d+")


def remove_stale(directory: Path, *, idle_after: float) -> list[Path]:
    """Remove the leftovers of crashed saves and prunes in ``directory`` (see the module docstring).

    Args:
        directory: a :class:`CheckpointManager`'s directory.
        idle_after: seconds without a modification after which a ``.tmp-`` directory is stale.

    Returns:
        the directories removed.
    """
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        path = Path(entry.path)
        if _DELETING.fullmatch(entry.name) or (_TMP.fullmatch(entry.name) and _idle(path) > idle_after):
            shutil.rmtree(path, ignore_errors=True)
            logger.info("meshkit.checkpoint: removed %s, left by a crashed save or prune", path)
            removed.append(path)
    return removed


def _idle(path: Path) -> float:
    """Seconds since anything in ``path`` (itself or an entry) was last modified; 0 if it vanished."""
    try:
        newest = path.stat().st_mtime
        with os.scandir(path) as it:
            for entry in it:
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
    except OSError:  # committed or removed meanwhile
        return 0.0
    return time.time() - newest
