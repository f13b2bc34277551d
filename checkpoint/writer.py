"""save and async_save: each rank writes what the plan gives it; one atomic rename commits.

The protocol (every rank of ``group``):

1. describe the state dict; rank 0 gathers the descriptions, plans (:mod:`.plan`), makes the
   temporary directory ``.<id>.tmp-<random>`` beside ``<id>`` and scatters each rank its boxes
   (two object collectives, whatever the world size);
2. each rank writes its boxes to its own data file and fsyncs it, then drops a marker file
   (``rank-<r>.json``: its chunk records, or ``rank-<r>.error``);
3. rank 0 waits for every marker, writes ``metadata.json``, fsyncs, and renames the temporary
   directory to ``<id>`` (one atomic rename, then an fsync of the parent). The other ranks wait
   for ``<id>`` to appear, or for a ``FAILED`` file with rank 0's reason.

A crash at any moment leaves ``<id>`` complete or absent (at worst a stray ``.tmp-`` directory).
Steps 2-3 need no collective, so :func:`async_save` runs them on a background thread after
step 1 and a copy of the boxes this rank writes, while training goes on and uses the group.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..comm import ProcessGroup, gather_object, resolve_group, scatter_object_list
from ..parallel import to_host
from .errors import CheckpointError
from .format import FORMAT, METADATA, VERSION, fsync_dir, write_chunks, write_metadata
from .leaves import ArrayLeaf, array_leaf, flatten, json_value
from .plan import describe, make_plan

__all__ = ["save", "async_save"]

logger = logging.getLogger("meshkit.checkpoint")

FAILED = "FAILED"
#: the largest chunk a box is written as (cut along axis 0), so that large arrays verify in parallel
CHUNK_BYTES = 16 << 20


def save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike, group: ProcessGroup | None = None,
         timeout: float | None = None) -> None:
    """Save ``state_dict`` to the directory ``checkpoint_id`` (collective over ``group``).

    Each rank writes only the boxes it holds, replicated ones once over the group; nothing is
    gathered. ``checkpoint_id`` must not exist yet; it appears, complete, when every rank has
    written and fsynced (see the module docstring).

    Args:
        state_dict: a nested dict of arrays, lists of ShardedArray, DTensors and JSON values
            (:mod:`.leaves`), e.g. ``{"model": msd, "optim": osd}`` from :func:`get_state_dict`.
        checkpoint_id: the checkpoint's directory (a path every rank sees: a shared file system
            when ranks run on several hosts).
        group: the ranks that save together (default: the world).
        timeout: seconds to wait for the other ranks' writes (default: the group's timeout).

    Raises:
        CheckpointError: on every rank, naming the key, file or rank at fault.
    """
    _start(state_dict, checkpoint_id, group, "save", staged=False, timeout=timeout)()


def async_save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike, group: ProcessGroup | None = None,
               timeout: float | None = None) -> "Future[None]":
    """Like :func:`save`, but return once this rank's boxes are copied; write in the background.

    The arrays may change as soon as this returns. The returned future completes when the
    checkpoint is committed (or raises :class:`CheckpointError`); the process waits for pending
    saves before it exits.
    """
    finish = _start(state_dict, checkpoint_id, group, "async_save", staged=True, timeout=timeout)
    future: Future[None] = Future()
    future.set_running_or_notify_cancel()

    def run() -> None:
        try:
            finish()
        except BaseException as exc:  # handed to whoever waits on the future, and logged for who does not
            logger.error("meshkit.checkpoint: async_save to %s failed: %s", checkpoint_id, exc)
            future.set_exception(exc)
        else:
            future.set_result(None)

    threading.Thread(target=run, name=f"meshkit-async-save {checkpoint_id}", daemon=False).start()
    return future


def _start(state_dict: Any, checkpoint_id: Any, group: ProcessGroup | None, op: str, *, staged: bool,
           timeout: float | None = None) -> Callable[[], None]:
    """Steps 1 (collective) and the copy; returns steps 2-3 as a function."""
    g = resolve_group(group)
    rank, size = g.rank, g.size
    final = Path(checkpoint_id)
    leaves: dict[str, ArrayLeaf] = {}
    description: Any
    try:
        values = {}
        for key, value, _, _ in flatten(state_dict, op, rank):
            leaf = array_leaf(key, value, op, rank)
            if leaf is None:
                values[key] = json_value(value)
            else:
                leaves[key] = leaf
        description = describe(leaves, values, digest_replicas=size > 1)
    except CheckpointError as exc:
        description = str(exc)
    except Exception as exc:  # fails the save on every rank (rank 0 tells them), never one rank alone
        description = f"meshkit.checkpoint: rank {rank}: {op}: {type(exc).__name__}: {exc}"
    gathered: list[Any] | None = [None] * size if rank == 0 else None
    gather_object(description, gathered, group=g, group_dst=0)
    assignments: list[Any] | None = None
    if rank == 0:
        assignments = _plan(gathered, final, op, size)
    received: list[Any] = [None]
    scatter_object_list(received, assignments, group=g, group_src=0)
    got = received[0]
    if isinstance(got, str):
        raise CheckpointError(got)
    tmp, boxes = Path(got[0]), got[1]
    chunks = []
    try:
        for key, (offsets, lengths) in boxes:
            piece = next(p for p in leaves[key].pieces if not p.replica and p.box == (tuple(offsets), tuple(lengths)))
            data = to_host(piece.data)
            if staged and data is piece.data:  # to_host copied device data already
                data = np.array(data, copy=True)
            chunks += [(key, o, slab) for o, slab in slabs(tuple(offsets), data)]
    except Exception as exc:  # (a failed device copy, memory): the others must not wait for this rank
        text = f"meshkit.checkpoint: rank {rank}: {op}: staging {str(tmp)!r} failed: {type(exc).__name__}: {exc}"
        _drop(tmp / f"rank-{rank}.error", text)
        if rank == 0:
            _drop(tmp / FAILED, text)
        raise CheckpointError(text) from exc
    limit = g.timeout if timeout is None else float(timeout)
    return lambda: _finish(tmp, final, rank, size, chunks, got[2], limit)


def slabs(offsets: tuple[int, ...], data: np.ndarray) -> list[tuple[tuple[int, ...], np.ndarray]]:
    """A box cut along axis 0 into chunks of at most :data:`CHUNK_BYTES` (whole rows; views), so
    that a reader verifies checksums in parallel and reads only the rows it needs."""
    if data.ndim == 0 or data.shape[0] <= 1 or data.nbytes <= CHUNK_BYTES:
        return [(offsets, data)]
    rows = max(1, CHUNK_BYTES // max(1, data.nbytes // data.shape[0]))
    return [((offsets[0] + i, *offsets[1:]), data[i:i + rows]) for i in range(0, data.shape[0], rows)]


def _plan(gathered: list[Any], final: Path, op: str, size: int) -> list[Any]:
    """Rank 0: every rank's assignment ``(tmp dir, boxes, metadata skeleton)``, or one error for all."""
    errors = [(r, d) for r, d in enumerate(gathered) if isinstance(d, str)]
    try:
        if errors:
            r, text = errors[0]
            raise CheckpointError(f"{text}{f' (and {len(errors) - 1} more ranks failed)' if len(errors) > 1 else ''}")
        if final.exists():
            raise CheckpointError(f"meshkit.checkpoint: {op}: {str(final)!r} already exists; a checkpoint is never "
                                  "overwritten: remove it or choose another checkpoint_id")
        plan = make_plan(gathered)
        tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:12]}"
        tmp.mkdir(parents=True)
    except CheckpointError as exc:
        text = str(exc) if str(exc).startswith("meshkit.checkpoint") else f"meshkit.checkpoint: {op}: {exc}"
        return [text] * size
    except OSError as exc:
        return [f"meshkit.checkpoint: {op}: cannot create a directory beside {str(final)!r}: {exc}"] * size
    skeleton = {"format": FORMAT, "version": VERSION, "world_size": size,
                "arrays": {k: {**a, "chunks": []} for k, a in plan.arrays.items()}, "values": plan.values}
    return [(str(tmp), plan.writes[r], skeleton if r == 0 else None) for r in range(size)]


def _finish(tmp: Path, final: Path, rank: int, size: int, chunks: list, skeleton: Any, limit: float) -> None:
    """Steps 2-3: write, mark, and (rank 0) commit; or wait for the commit."""
    try:
        records = write_chunks(tmp, rank, chunks)
    except OSError as exc:
        text = f"meshkit.checkpoint: rank {rank}: writing {str(tmp)!r} failed: {exc}"
        _drop(tmp / f"rank-{rank}.error", text)
        if rank == 0:
            _drop(tmp / FAILED, text)
        raise CheckpointError(text) from None
    if not _drop(tmp / f"rank-{rank}.json", json.dumps(records)):  # rank 0 cannot have committed without it
        raise CheckpointError(f"meshkit.checkpoint: rank {rank}: the temporary directory {str(tmp)!r} of "
                              f"{str(final)!r} vanished before this rank finished writing (removed by hand?); "
                              "nothing was committed")
    if rank == 0:
        _commit(tmp, final, size, skeleton, limit)
    else:
        _await_commit(tmp, final, rank, limit)


def _drop(path: Path, text: str) -> bool:
    """Write a marker file whole (written aside, then renamed: a reader never sees half of it);
    False if it could not be written (the directory is gone: renamed or removed)."""
    part = path.with_name(path.name + ".part")
    try:
        part.write_text(text)
        os.replace(part, path)
    except OSError:
        return False
    return True


def _commit(tmp: Path, final: Path, size: int, skeleton: dict[str, Any], limit: float) -> None:
    deadline = time.monotonic() + limit
    pause = 0.0005
    while True:
        errors = sorted(tmp.glob("rank-*.error"))
        done = {int(p.name[5:-5]) for p in tmp.glob("rank-*.json")}
        if errors or len(done) == size:
            break
        if time.monotonic() > deadline:
            missing = [r for r in range(size) if r not in done]
            text = (f"meshkit.checkpoint: rank 0: ranks {missing} did not finish writing {str(final)!r} within "
                    f"{limit:g} s; nothing was committed")
            _drop(tmp / FAILED, text)
            raise CheckpointError(text)
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    if errors:
        text = errors[0].read_text()
        _drop(tmp / FAILED, text)
        raise CheckpointError(text)
    try:
        for r in range(size):
            for key, record in json.loads((tmp / f"rank-{r}.json").read_text()):
                skeleton["arrays"][key]["chunks"].append(record)
        for a in skeleton["arrays"].values():
            a["chunks"].sort(key=lambda c: c["offsets"])
        write_metadata(tmp, skeleton)
        for p in tmp.glob("rank-*.json"):
            p.unlink()
        os.rename(tmp, final)  # the commit: atomic, and refused if final appeared meanwhile
    except OSError as exc:
        text = f"meshkit.checkpoint: rank 0: committing {str(final)!r} failed: {exc}"
        _drop(tmp / FAILED, text)
        raise CheckpointError(text) from None
    try:
        fsync_dir(final.parent)
    except OSError as exc:  # committed, and the other ranks (seeing tmp gone) say so: no error on rank 0 alone
        logger.warning("meshkit.checkpoint: rank 0: %s is committed, but syncing its parent directory failed (the "
                       "rename may not survive a power loss): %s", final, exc)


def _await_commit(tmp: Path, final: Path, rank: int, limit: float) -> None:
    """A rank other than 0, its marker in ``tmp``: wait until rank 0 commits or fails.

    ``tmp`` vanishing with no ``FAILED`` in it means committed, even where ``final`` is gone
    again too (a ``max_to_keep`` prune after a later save can remove it before this rank looks:
    it polls at most every 20 ms). That is sound because ``tmp`` leaves only by the commit rename:

    * rank 0 renames it only after every rank's marker, and this rank's is in it (``_finish``
      raises if it could not be written);
    * every failure of rank 0 leaves ``tmp`` in place with ``FAILED`` written first;
    * nothing else in meshkit removes a temporary directory that a rank may still await:
      :class:`~meshkit.checkpoint.CheckpointManager` removes only ones idle for longer than
      twice the timeout (:mod:`.cleanup`), when every rank's wait has ended.

    A ``.tmp-`` directory removed by hand while its save runs voids this (the README says so).
    """
    deadline = time.monotonic() + limit
    pause = 0.0005
    while not (final / METADATA).exists():
        failed = tmp / FAILED
        if failed.exists():
            try:
                text = failed.read_text()
            except OSError as exc:
                text = f"meshkit.checkpoint: rank {rank}: saving {str(final)!r} failed (its FAILED marker: {exc})"
            raise CheckpointError(text)
        if not tmp.exists():
            return  # renamed to final: committed (and perhaps already pruned)
        if time.monotonic() > deadline:
            raise CheckpointError(f"meshkit.checkpoint: rank {rank}: rank 0 did not commit {str(final)!r} within "
                                  f"{limit:g} s (its temporary directory {str(tmp)!r} stays)")
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
