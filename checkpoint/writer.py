"""save and async_save: each rank writes what the plan gives it; one atomic rename commits.

The protocol (every rank of ``group``):

1. describe the state dict; rank 0 gathers the descriptions, plans (:mod:`.plan`), makes the
   temporary directory ``.<id>.tmp-<random>`` beside ``<id>`` and scatters each rank its boxes
   (two object collectives, whatever the world size);
2. each rank writes its boxes to its own data file and fsyncs it, then drops a marker file
   (``rank-<r>.json``: its chunk records);
3. each rank sends rank 0 its outcome (written, or why not: disk full, a failed copy, ...);
4. rank 0, every rank written, writes ``metadata.json``, fsyncs, and renames the temporary
   directory to ``<id>`` (one atomic rename, then an fsync of the parent); on any failure (a
   rank's, a timeout, the rename refused because another save committed ``<id>`` first) it
   removes the temporary directory (its own: the name is this save's). Then it sends every rank
   the verdict, committed or the first failure's message, which every rank returns or raises as
   :class:`CheckpointError`: one outcome for all, never inferred from the file system (a rank
   that looked for ``<id>`` took another job's checkpoint for its own, and a full disk left no
   room for a failure marker).

A crash at any moment leaves ``<id>`` complete or absent (at worst a stray ``.tmp-`` directory).
Steps 3-4 are point-to-point messages (on the group's largest tag, each carrying the save's
number), not collectives, so :func:`async_save` runs steps 2-4 on a background thread after
step 1 and a copy of the boxes this rank writes, while training goes on and uses the group. A
group's saves finish one at a time, in the order they started, on one worker thread, so that
their messages pair up on every rank.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import json
import logging
import os
import shutil
import threading
import time
import uuid
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..comm import CollectiveTimeout, DistError, ProcessGroup, RankFailedError, gather_object, scatter_object_list
from ..comm._seams import resolve_group, to_host
from .errors import CheckpointError
from .format import (FORMAT, METADATA_ENV, VERSION, create_exclusive, fsync_dir, max_metadata_bytes, read_regular,
                     write_chunks, write_metadata)
from .leaves import ArrayLeaf, array_leaf, flatten, json_value
from .plan import Description, describe, make_plan

__all__ = ["save", "async_save"]

logger = logging.getLogger("meshkit.checkpoint")
#: the largest chunk a box is written as (cut along axis 0), so that large arrays verify in parallel
CHUNK_BYTES = 16 << 20


def save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike, group: ProcessGroup | None = None,
         timeout: float | None = None) -> None:
    """Save ``state_dict`` to the directory ``checkpoint_id`` (collective over ``group``).

    Each rank writes only the boxes it holds, replicated ones once over the group; nothing is
    gathered. ``checkpoint_id`` must not exist yet; it appears, complete, when every rank has
    written and fsynced (see the module docstring). A failed save removes what it wrote. The
    group's pending :func:`async_save` calls finish first.

    Args:
        state_dict: a nested dict of arrays, lists of ShardedArray, DTensors and JSON values
            (:mod:`.leaves`), e.g. ``{"model": msd, "optim": osd}`` from :func:`get_state_dict`.
        checkpoint_id: the checkpoint's directory (a path every rank sees: a shared file system
            when ranks run on several hosts).
        group: the ranks that save together (default: the world).
        timeout: seconds to wait for the other ranks' writes (default: the group's timeout).

    Raises:
        CheckpointError: on every rank, the same message, naming the key, file or rank at fault.
    """
    queue, finish = _start(state_dict, checkpoint_id, group, "save", staged=False, timeout=timeout)
    queue.submit(finish).result()  # after the group's pending async saves, whose messages come first


def async_save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike, group: ProcessGroup | None = None,
               timeout: float | None = None) -> "Future[None]":
    """Like :func:`save`, but return once this rank's boxes are copied; write in the background.

    The arrays may change as soon as this returns. The returned future completes when the
    checkpoint is committed, or raises :class:`CheckpointError` with the same message on every
    rank (a failure is logged too); the process waits for pending saves before it exits. The
    verdict travels over ``group``: wait for the future before destroying the process group.
    """
    queue, finish = _start(state_dict, checkpoint_id, group, "async_save", staged=True, timeout=timeout)

    def run() -> None:
        try:
            finish()
        except BaseException as exc:  # logged for who does not wait on the future, before it completes
            logger.error("meshkit.checkpoint: async_save to %s failed: %s", checkpoint_id, exc)
            raise

    return queue.submit(run)


def _start(state_dict: Any, checkpoint_id: Any, group: ProcessGroup | None, op: str, *, staged: bool,
           timeout: float | None = None) -> tuple[_Queue, Callable[[], None]]:
    """Steps 1 (collective) and the copy; returns the group's queue of saves and steps 2-4 as a function."""
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
    # Plain data (a dataclass would need pickle, which a group of unauthenticated peers refuses)
    gather_object(description if isinstance(description, str) else dataclasses.astuple(description), gathered,
                  group=g, group_dst=0)
    assignments: list[Any] | None = None
    if rank == 0:
        assignments = _plan(gathered, final, op, size)
    received: list[Any] = [None]
    scatter_object_list(received, assignments, group=g, group_src=0)
    queue = _queue_of(g)
    seq = queue.number()  # the same on every rank: this point is reached in program order
    got = received[0]
    if isinstance(got, str):
        raise CheckpointError(got)
    tmp, boxes = Path(got[0]), got[1]
    chunks = []
    failure: str | None = None
    try:
        for key, (offsets, lengths) in boxes:
            piece = next(p for p in leaves[key].pieces if not p.replica and p.box == (tuple(offsets), tuple(lengths)))
            data = to_host(piece.data)
            if staged and data is piece.data:  # to_host copied device data already
                data = np.array(data, copy=True)
            chunks += [(key, o, slab) for o, slab in slabs(tuple(offsets), data)]
    except Exception as exc:  # (a failed device copy, memory): reported in the verdict, on every rank
        failure = f"meshkit.checkpoint: rank {rank}: {op}: staging {str(tmp)!r} failed: {type(exc).__name__}: {exc}"
        chunks = []
    limit = g.timeout if timeout is None else float(timeout)
    return queue, lambda: _finish(g, seq, tmp, final, chunks, got[2], limit, failure)


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
    gathered = [d if isinstance(d, str) else Description(*d) for d in gathered]
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


def _finish(g: ProcessGroup, seq: int, tmp: Path, final: Path, chunks: list, skeleton: Any, limit: float,
            failure: str | None) -> None:
    """Steps 2-3: write and mark; then one verdict for every rank (rank 0 commits, or removes ``tmp``)."""
    rank = g.rank
    if failure is None:
        failure = _write(tmp, rank, chunks)
    if rank == 0:
        verdict = _decide(g, seq, tmp, final, skeleton, failure, limit)
    else:
        verdict = _report(g, seq, final, failure, limit)
    if verdict is not None:
        raise CheckpointError(verdict)


def _write(tmp: Path, rank: int, chunks: list) -> str | None:
    """Write this rank's data file and its marker; None, or why it failed (any exception)."""
    try:
        records = write_chunks(tmp, rank, chunks)
        _drop(tmp / f"rank-{rank}.json", json.dumps(records))
    except Exception as exc:  # disk full, a directory removed by hand, ...: the verdict of every rank
        cause = str(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
        return f"meshkit.checkpoint: rank {rank}: writing {str(tmp)!r} failed: {cause}"
    return None


def _drop(path: Path, text: str) -> None:
    """Write a marker file whole (written aside, then renamed: a reader never sees half of it)."""
    part = path.with_name(path.name + ".part")
    with create_exclusive(part) as f:  # (in this save's own directory: nothing is there yet)
        f.write(text.encode())
    os.replace(part, path)


def _decide(g: ProcessGroup, seq: int, tmp: Path, final: Path, skeleton: dict[str, Any], failure: str | None,
            limit: float) -> str | None:
    """Rank 0: collect every rank's outcome, commit if all wrote, else remove ``tmp``; send the
    verdict (None: committed, or the first failure's message) to every rank and return it."""
    size = g.size
    works = {r: _post(g, r) for r in range(1, size)}
    deadline = time.monotonic() + limit
    failures = [] if failure is None else [failure]
    missing = []
    lost: RankFailedError | None = None  # ranks dead under --survive: the save fails, then the loop shrinks
    for r, (work, buf) in works.items():
        try:
            failed, text = _receive(g, seq, r, work, buf, deadline)
        except DistError as exc:  # a timeout (the rank is still writing, or gone), a broken group
            if _died(exc):
                lost = lost or exc
            if isinstance(exc, CollectiveTimeout):
                missing.append(g.ranks[r])
            else:
                failures.append(f"meshkit.checkpoint: rank 0: no word from rank {g.ranks[r]} on writing "
                                f"{str(final)!r}: {exc}")
            continue
        if failed:
            failures.append(text)
    if missing:
        failures.append(f"meshkit.checkpoint: rank 0: ranks {missing} did not finish writing {str(final)!r} within "
                        f"{limit:g} s; nothing was committed")
    verdict: str | None = None
    if failures:
        more = len(failures) - 1
        verdict = failures[0] + (f" (and {more} more {'ranks' if more > 1 else 'rank'} failed)" if more else "")
    else:
        verdict = _commit(tmp, final, size, skeleton)
    if verdict is not None:  # every rank is done with tmp (or past its time): what this save wrote goes
        shutil.rmtree(tmp, ignore_errors=True)
        if tmp.exists():
            logger.warning("meshkit.checkpoint: rank 0: could not remove %s after a failed save; "
                           "CheckpointManager removes it later", tmp)
    # ranks died: the survivors must raise the RankFailedError too (their loop shrinks), not a CheckpointError
    message = _message(seq, verdict) if lost is None else _message(seq, verdict or str(lost), lost.failed_ranks)
    sends = [g.isend(message, r, _tag(g)) for r in range(1, size)]
    for work in sends:  # small messages leave at once; a rank that is gone must not hold rank 0 up
        try:
            work.wait(timeout=limit)
        except DistError:
            pass
    if lost is not None:  # nothing was committed (tmp is gone); the survivors' loop catches this and shrinks
        raise lost
    return verdict


def _died(exc: BaseException) -> bool:
    """Ranks died under ``meshkit-run --survive``: a ``RankFailedError`` naming them, which the save lets
    through (after cleaning up) so the loop can shrink and redo, rather than a ``CheckpointError``."""
    return isinstance(exc, RankFailedError) and bool(exc.failed_ranks)


def _commit(tmp: Path, final: Path, size: int, skeleton: dict[str, Any]) -> str | None:
    """Rank 0, every rank's marker in ``tmp``: write the metadata and rename; None, or why not."""
    try:
        limit = max_metadata_bytes()
        for r in range(size):
            marker = read_regular(tmp / f"rank-{r}.json", 1 << 62, "")  # (this save's own: a regular file, any size)
            for key, record in json.loads(marker):
                skeleton["arrays"][key]["chunks"].append(record)
        for a in skeleton["arrays"].values():
            a["chunks"].sort(key=lambda c: c["offsets"])
        if write_metadata(tmp, skeleton) > limit:  # committed all the same: it loads with the variable raised
            logger.warning("meshkit.checkpoint: rank 0: the metadata of %s is larger than %d bytes: a load refuses "
                           "it unless %s is set higher", final, limit, METADATA_ENV)
        for p in tmp.glob("rank-*.json"):
            p.unlink()
        os.rename(tmp, final)  # the commit: atomic, and refused if final appeared meanwhile
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST) and exc.filename == str(tmp):
            return (f"meshkit.checkpoint: rank 0: committing {str(final)!r} failed: another save committed it "
                    f"first (a checkpoint is never overwritten; that one is kept, this save's files are removed)")
        return f"meshkit.checkpoint: rank 0: committing {str(final)!r} failed: {exc}"
    except Exception as exc:  # a marker that does not parse, ...: fails the save on every rank, never rank 0 alone
        return f"meshkit.checkpoint: rank 0: committing {str(final)!r} failed: {type(exc).__name__}: {exc}"
    try:
        fsync_dir(final.parent)
    except OSError as exc:  # committed: the verdict says so on every rank, with a warning here
        logger.warning("meshkit.checkpoint: rank 0: %s is committed, but syncing its parent directory failed (the "
                       "rename may not survive a power loss): %s", final, exc)
    return None


def _report(g: ProcessGroup, seq: int, final: Path, failure: str | None, limit: float) -> str | None:
    """A rank other than 0: send rank 0 this rank's outcome, then return rank 0's verdict."""
    work, buf = _post(g, 0)  # posted first: the verdict may come before this rank's word (a failure)
    g.isend(_message(seq, failure), 0, _tag(g))
    try:
        flag, text = _receive(g, seq, 0, work, buf, time.monotonic() + limit)
    except DistError as exc:
        if _died(exc):
            raise
        waited = f" within {limit:g} s" if isinstance(exc, CollectiveTimeout) else ""
        return (f"meshkit.checkpoint: rank {g.rank}: no verdict from rank 0 on {str(final)!r}{waited} "
                f"({exc}); whether it was committed is unknown")
    if flag == _LOST:  # rank 0 met dead ranks (under --survive): nothing was committed, tmp is gone
        ranks, _, cause = (text or "").partition("\n")
        dead = tuple(int(r) for r in ranks.split(",") if r.isdigit())
        raise RankFailedError(f"meshkit.checkpoint: rank {g.rank}: the save of {str(final)!r} failed: rank 0 met "
                              f"dead rank(s) {list(dead)} ({cause}); nothing was committed", failed_ranks=dead)
    return text


# --------------------------------------------------------------------------- the verdict's messages
#: the size of an outcome or verdict message: a header and a UTF-8 message, cut to fit (messages
#: are a few hundred bytes); small enough that MPI sends it eagerly, without waiting for the receiver
MESSAGE_BYTES = 4096
_HEAD = 3  # int64s: save number, failed (0/1, or _LOST), message length
#: a verdict's "failed" when rank 0 met dead ranks: its text is their ranks (comma-separated), a newline,
#: then the error; every survivor raises the RankFailedError naming them (meshkit-run --survive)
_LOST = 2


def _tag(g: ProcessGroup) -> int:
    """The tag of a save's messages: the group's largest (docs/checkpoints.md says it is taken)."""
    return g.max_tag


def _message(seq: int, failure: str | None, lost: tuple[int, ...] | None = None) -> np.ndarray:
    if lost is not None:
        failure = f"{','.join(map(str, lost))}\n{failure or ''}"
    text = (failure or "").encode()[:MESSAGE_BYTES - 8 * _HEAD]
    buf = np.zeros(MESSAGE_BYTES, np.uint8)
    flag = _LOST if lost is not None else int(failure is not None)
    buf[:8 * _HEAD] = np.array([seq, flag, len(text)], np.int64).view(np.uint8)
    buf[8 * _HEAD:8 * _HEAD + len(text)] = np.frombuffer(text, np.uint8)
    return buf


def _post(g: ProcessGroup, src: int) -> tuple[Any, np.ndarray]:
    buf = np.empty(MESSAGE_BYTES, np.uint8)
    return g.irecv(buf, src, _tag(g)), buf


def _receive(g: ProcessGroup, seq: int, src: int, work: Any, buf: np.ndarray, deadline: float
             ) -> tuple[int, str | None]:
    """``(failed, message)`` of save ``seq`` from group rank ``src`` (failed: 0, 1, or :data:`_LOST`);
    a message of an earlier save (one whose waiter timed out) is skipped."""
    while True:
        work.wait(timeout=max(0.0, deadline - time.monotonic()))
        number, failed, length = (int(v) for v in buf[:8 * _HEAD].view(np.int64))
        if number == seq:
            text = bytes(buf[8 * _HEAD:8 * _HEAD + max(0, min(length, MESSAGE_BYTES - 8 * _HEAD))]).decode(
                errors="replace")
            return failed, text if failed else None
        work, buf = _post(g, src)


# --------------------------------------------------------------------------- one save at a time per group
class _Queue:
    """The finishing steps of one group's saves, run one at a time on a worker thread, in the
    order the saves started (the same on every rank), so that their messages pair up.

    The worker is not a daemon (the process waits for pending saves before it exits) and ends
    when the queue is empty.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._tasks: collections.deque[tuple[Callable[[], None], Future[None]]] = collections.deque()
        self._running = False
        self._count = 0

    def number(self) -> int:
        self._count += 1
        return self._count

    def submit(self, fn: Callable[[], None]) -> "Future[None]":
        future: Future[None] = Future()
        future.set_running_or_notify_cancel()
        with self._lock:
            self._tasks.append((fn, future))
            if not self._running:
                self._running = True
                threading.Thread(target=self._drain, name=f"meshkit-save[{self._name}]", daemon=False).start()
        return future

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._tasks:
                    self._running = False
                    return
                fn, future = self._tasks.popleft()
            try:
                fn()
            except BaseException as exc:  # the caller's (save) or the future's (async_save)
                future.set_exception(exc)
            else:
                future.set_result(None)


_queues: "weakref.WeakKeyDictionary[ProcessGroup, _Queue]" = weakref.WeakKeyDictionary()
_queues_lock = threading.Lock()


def _queue_of(g: ProcessGroup) -> _Queue:
    with _queues_lock:
        queue = _queues.get(g)
        if queue is None:
            queue = _queues[g] = _Queue(g.name)
        return queue
