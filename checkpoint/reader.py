"""load: fill a state dict in place from a checkpoint saved by any strategy at any world size.

Each rank reads only the chunks that intersect its own boxes, through a memory map of the data
files (so the bytes of other ranks' data are never touched and no staging copy is made). It
first verifies everything (keys, shapes, dtypes, file sizes, the checksum of every block of a
chunk that it reads: :mod:`.blocks`), then the ranks agree (one exchange of their outcomes,
:func:`meshkit.comm._seams.agree`) and only then copy into the state dict: a bad checkpoint raises
:class:`CheckpointError` on every rank with nothing written in place.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ..comm import ProcessGroup
from ..comm._seams import RESTORED, agree, array_namespace, milestone, resolve_group
from ..state import StepCount
from .blocks import touched_blocks
from .errors import CheckpointError
from .format import CHECKSUM, LEGACY_BEFORE, checksum, open_regular, read_metadata
from .leaves import Piece, array_leaf, flatten, json_value

__all__ = ["load"]

def _workers() -> int:
    """Threads per rank for hashing and copying: this rank's share of the cores it may use (the
    ranks on one host, as MPICH's, Open MPI's or Slurm's launcher tells each process), at most 4.
    Measured with 2 ranks on 2 cores: 2 threads each made a load slower than 1 thread each."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    here = next((int(v) for k in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")
                 if (v := os.environ.get(k, "")).isdigit() and int(v) > 0), 1)
    return max(1, min(4, cores // here))


#: threads that verify checksums and copy in a load
WORKERS = _workers()


def load(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike, group: ProcessGroup | None = None) -> None:
    """Load the checkpoint at ``checkpoint_id`` into ``state_dict`` in place (collective over ``group``).

    Arrays, DTensors and ShardedArray pieces are written in place, whatever boxes the
    checkpoint was saved in (resharding); JSON values are replaced in their dict (or list); a
    :class:`~meshkit.parallel.StepCount` is set in its optimizer and stays in the dict.
    Keys of the checkpoint that ``state_dict`` lacks are ignored, as in DCP.

    Raises:
        CheckpointError: on every rank, with nothing written, naming the key or file and what
            was expected: no checkpoint at the path, a missing file or key, another shape or
            dtype, a truncated file, a checksum mismatch, a read-only destination array, a step
            count that is not one, two counts the optimizer keeps as one (a flat shard's)
            given different values, a value to change inside a tuple, a value of another type
            than the state dict's (a str where it holds an int), metadata that is not a regular
            file, is too large (``MESHKIT_CHECKPOINT_MAX_METADATA_BYTES``) or malformed.
    """
    g = resolve_group(group)
    rank = g.rank
    try:
        copies, values = _prepare(state_dict, Path(checkpoint_id), rank)
        outcome = None
    except CheckpointError as exc:
        outcome = str(exc) if str(exc).startswith("meshkit.checkpoint") else \
            f"meshkit.checkpoint: rank {rank}: load: {exc}"
    except Exception as exc:  # anything else fails the load everywhere too, never one rank alone
        outcome = f"meshkit.checkpoint: rank {rank}: load: {type(exc).__name__}: {exc}"
    agree(g, None, problem=outcome, error=lambda message: CheckpointError(f"{message}; nothing was loaded"),
          invalid=lambda failed: failed[0][1] + (f" (and on ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1
                                                 else ""))
    host = [(d, src) for d, src in copies if array_namespace(d) is np]
    in_parallel(_copy, host)
    for dst, src in copies:  # device arrays from this thread: its current device is this rank's GPU
        if array_namespace(dst) is not np:
            _copy(dst, src)
    for parent, key, value in values:
        if isinstance(parent[key], StepCount):
            parent[key].set(value)  # the leaf stays: the dict keeps reading the optimizer's count
        elif not isinstance(parent, tuple):  # (a tuple's values were checked equal)
            parent[key] = value
    milestone(RESTORED)  # meshkit-run times a restart's checkpoint load by it


def _copy(dst: Any, src: np.ndarray) -> None:
    dst[...] = src if array_namespace(dst) is np else array_namespace(dst).asarray(src)


def in_parallel(fn: Any, tasks: list[tuple[Any, ...]]) -> list[Any]:
    """``[fn(*t) for t in tasks]`` on a few threads (hashing and NumPy copies release the GIL)."""
    if len(tasks) <= 1 or WORKERS <= 1:
        return [fn(*t) for t in tasks]
    with ThreadPoolExecutor(min(WORKERS, len(tasks)), thread_name_prefix="meshkit-load") as pool:
        return list(pool.map(lambda t: fn(*t), tasks))


def _prepare(state_dict: Any, path: Path, rank: int) -> tuple[list[tuple[Any, np.ndarray]], list[tuple[dict, str, Any]]]:
    """Everything checked and mapped: ``(destination view, verified source view)`` pairs and
    the values to set."""
    meta = read_metadata(path)
    maps: dict[str, np.ndarray] = {}
    verified: dict[int, tuple[str, dict[str, Any], np.ndarray, np.ndarray]] = {}  # by id of the chunk record
    copies: list[tuple[Any, np.ndarray]] = []
    values: list[tuple[Any, Any, Any]] = []
    counts: dict[Any, tuple[str, int]] = {}  # a StepCount's target -> (first key, its count)
    for key, value, parent, pkey in flatten(state_dict, "load", rank, legacy=meta["version"] < LEGACY_BEFORE):
        leaf = array_leaf(key, value, "load", rank)
        if leaf is None or (leaf.shape is None and key in meta["values"]):
            if key not in meta["values"]:
                kind = "an array" if key in meta["arrays"] else "absent"
                raise CheckpointError(f"key {key!r} (a value here) is {kind} in the checkpoint at {str(path)!r}")
            new = meta["values"][key]
            if isinstance(value, StepCount):
                new = _step_count(key, value, new, counts, path)
            else:
                new = _of_its_type(key, json_value(value), new, path)
            if isinstance(parent, tuple) and new != json_value(value):
                raise CheckpointError(f"key {key!r} is in a tuple, whose items cannot be replaced, and the checkpoint "
                                      f"at {str(path)!r} has {new!r} for it, not {value!r}; use a list")
            values.append((parent, pkey, new))
            continue
        entry = meta["arrays"].get(key)
        if entry is None:
            kind = "a value" if key in meta["values"] else "missing"
            raise CheckpointError(f"key {key!r} is {kind} in the checkpoint at {str(path)!r} "
                                  f"({len(meta['arrays'])} arrays there)")
        shape, dtype = tuple(entry["shape"]), np.dtype(entry["dtype"])
        if leaf.shape is not None and (tuple(leaf.shape) != shape or np.dtype(leaf.dtype) != dtype):
            raise CheckpointError(f"{key!r}: the checkpoint has shape {shape} and dtype {dtype}, this state dict "
                                  f"expects shape {tuple(leaf.shape)} and dtype {np.dtype(leaf.dtype)}")
        for piece in leaf.pieces:
            if not _writeable(piece.data):
                raise CheckpointError(f"{key!r}: the array to load into is read-only (flags.writeable is False); load "
                                      "writes in place: pass a writeable array (e.g. a copy)")
            copies += _piece_copies(key, piece, entry, dtype, path, maps, verified)
    failures = [f for f in in_parallel(_verify, [(path, *v) for v in verified.values()]) if f]
    if failures:
        raise CheckpointError(failures[0])
    return copies, values


def _writeable(a: Any) -> bool:
    flags = getattr(a, "flags", None)
    return bool(getattr(flags, "writeable", True))


def _of_its_type(key: str, given: Any, new: Any, path: Path) -> Any:
    """The checkpoint's value ``new`` for a leaf that is ``given`` now, if it has ``given``'s type
    (bool, int, float, str or list; an int may load into a float, and becomes one; None declares
    no type and takes any value): the state dict says what each value is, and code reading a
    step as an int must not get a str.

    Raises:
        CheckpointError: naming the key, both types and values.
    """
    if given is None:
        return new
    if isinstance(given, float) and isinstance(new, int) and not isinstance(new, bool):
        try:
            return float(new)
        except OverflowError:
            pass
    elif type(new) is type(given):  # (bool is not int here: True where an int is expected is refused)
        return new
    text = repr(new)
    shown = text if len(text) <= 60 else text[:57] + "..."
    raise CheckpointError(f"key {key!r}: the checkpoint at {str(path)!r} has a {type(new).__name__} ({shown}), where "
                          f"the state dict has a {type(given).__name__} ({given!r}); a value loads only into one of "
                          "its type (an int into a float too; None takes any)")


def _step_count(key: str, leaf: StepCount, new: Any, counts: dict[Any, tuple[str, int]], path: Path) -> int:
    """The checkpoint's count ``new`` for ``leaf`` once checked: a count, and the same as any
    other key's that is the same count of the optimizer (a flat shard's parameters share one)."""
    try:
        new = StepCount.check(new)
    except ValueError as exc:
        raise CheckpointError(f"key {key!r}: the checkpoint at {str(path)!r} has {new!r}, {exc}") from None
    first, count = counts.setdefault(leaf.target, (key, new))
    if count != new:
        raise CheckpointError(f"keys {first!r} and {key!r} are one step count of this optimizer (their parameters "
                              f"share a flat shard), but the checkpoint at {str(path)!r} has {count} and {new}")
    return new


def _piece_copies(key: str, piece: Piece, entry: dict[str, Any], dtype: np.dtype, path: Path,
                  maps: dict[str, np.ndarray], verified: dict) -> list[tuple[Any, np.ndarray]]:
    """The copies that fill ``piece`` from the chunks it intersects (each chunk noted in
    ``verified``, to be checked once)."""
    out, covered = [], 0
    for c in entry["chunks"]:
        lo = [max(a, b) for a, b in zip(piece.offsets, c["offsets"])]
        hi = [min(a + m, b + k) for a, m, b, k in zip(piece.offsets, piece.lengths, c["offsets"], c["lengths"])]
        if any(a >= b for a, b in zip(lo, hi)):
            continue
        data, needed = _chunk(key, c, dtype, path, maps, verified)
        needed |= touched_blocks(c["lengths"], [a - o for a, o in zip(lo, c["offsets"])],
                                 [b - o for b, o in zip(hi, c["offsets"])], dtype.itemsize, c["block_bytes"],
                                 needed.size)
        src = _box(data, lo, hi, c["offsets"])
        dst = _box(piece.data, lo, hi, piece.offsets)
        out.append((dst, src))
        covered += math.prod(b - a for a, b in zip(lo, hi))
    if covered != math.prod(piece.lengths):
        raise CheckpointError(f"{key!r}: the checkpoint's chunks cover {covered} of the {math.prod(piece.lengths)} "
                              f"elements of the box at offsets {piece.offsets} with lengths {piece.lengths}")
    return out


def _box(a: Any, lo: list[int], hi: list[int], offsets: Any) -> Any:
    """The view of ``a`` (whose first element is at global ``offsets``) on global ``[lo, hi)``;
    ``a`` itself for a 0-d array (indexing one by ``()`` would give a scalar, not a view)."""
    return a[tuple(slice(x - o, y - o) for x, y, o in zip(lo, hi, offsets))] if a.ndim else a


def _chunk(key: str, c: dict[str, Any], dtype: np.dtype, path: Path, maps: dict[str, np.ndarray],
           verified: dict) -> tuple[np.ndarray, np.ndarray]:
    """Chunk ``c`` as a read-only view of its memory-mapped file, and the mask of its checksum
    blocks to verify (noted in ``verified``; the caller marks the blocks it reads)."""
    name = c["file"]  # a data-NNNNN.bin name (read_metadata checked it)
    if name not in maps:
        file = path / name
        try:
            with open_regular(file, "data file") as f:  # a FIFO or a device is refused, never waited on
                maps[name] = np.memmap(f, dtype=np.uint8, mode="r") if os.fstat(f.fileno()).st_size else \
                    np.empty(0, np.uint8)
        except FileNotFoundError:
            raise CheckpointError(f"data file {str(file)!r} is missing (it holds {key!r})") from None
        except CheckpointError as exc:
            raise CheckpointError(f"{exc} (it holds {key!r})") from None
        except OSError as exc:
            raise CheckpointError(f"data file {str(file)!r} cannot be read: {exc}") from None
    m = maps[name]
    start, nbytes = int(c["offset"]), int(c["nbytes"])
    if start + nbytes > m.size:
        raise CheckpointError(f"data file {str(path / name)!r} is truncated: {m.size} bytes, but {key!r} has a chunk "
                              f"at bytes {start}..{start + nbytes}")
    raw = m[start:start + nbytes]
    needed = verified.setdefault(id(c), (key, c, raw, np.zeros(len(c[CHECKSUM]), bool)))[3]  # c: in meta, alive
    return raw.view(dtype).reshape(c["lengths"]), needed


def _verify(path: Path, key: str, c: dict[str, Any], raw: np.ndarray, needed: np.ndarray) -> str | None:
    """None if the ``needed`` checksum blocks of chunk ``c`` have their recorded checksums, else
    what is wrong."""
    block = c["block_bytes"]
    for i in np.flatnonzero(needed).tolist():
        if checksum(raw[i * block:(i + 1) * block]) != c[CHECKSUM][i]:
            start = int(c["offset"]) + i * block
            stop = min(start + block, int(c["offset"]) + int(c["nbytes"]))
            return (f"data file {str(path / c['file'])!r}: checksum mismatch in the chunk of {key!r} at offsets "
                    f"{tuple(c['offsets'])} (bytes {start}..{stop}): the file is corrupt")
    return None
