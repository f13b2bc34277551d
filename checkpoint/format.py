"""The on-disk format: raw per-rank data files and one JSON metadata file.

A checkpoint is a directory::

    <checkpoint_id>/
      metadata.json        what every array is made of, and the JSON values
      metadata.json.xxh3_64  the XXH3-64 of metadata.json's bytes, as 16 hex digits
      data-00000.bin       rank 0's chunks, back to back (64-byte aligned)
      data-00001.bin       ...  (a rank that writes nothing has no file)

``metadata.json``::

    {"format": "meshkit.checkpoint", "version": 3, "world_size": 4,
     "arrays": {"model.w0": {"shape": [20, 64], "dtype": "<f8",
                             "chunks": [{"offsets": [0, 0], "lengths": [5, 64],
                                         "file": "data-00000.bin", "offset": 0, "nbytes": 2560,
                                         "block_bytes": 65536, "xxh3_64": ["9f3c0e2a1b4d5c6e"]},
                                        ...]}},
     "values": {"optim.step.w0": 10}}

A key is the leaf's path in the state dict, joined with ``.``; a ``.`` or ``\\`` inside one
dict key is escaped with ``\\`` (``{"layer.0": {"w": x}}`` is ``layer\\.0.w``), list items are
nested by index (:mod:`.leaves`).

A chunk is a C-order box of the global array (``A[o0:o0+l0, o1:o1+l1, ...]``) stored raw at
``offset`` in ``file``; ``dtype`` is NumPy's ``dtype.str`` (byte order included, so complex and
any NumPy dtype round-trip). Reading one needs NumPy alone::

    np.fromfile(dir / c["file"], dtype=a["dtype"], count=prod(c["lengths"]),
                offset=c["offset"]).reshape(c["lengths"])

Why not safetensors: it has no complex dtypes (meshkit arrays may be complex128), and its
one-header-per-file layout would still need a second index of chunks to reshard; a raw file per
rank plus one JSON index is what DCP does, readable with NumPy alone and needing no dependency.
A chunk's checksums are the 64-bit XXH3 (``xxhash.xxh3_64_hexdigest``) of each ``block_bytes``
block of its bytes, in order (the last block shorter; :mod:`.blocks`): block ``i`` is the
file's bytes ``offset + i * block_bytes`` up to ``offset + min((i + 1) * block_bytes, nbytes)``,
so a reader verifies only the blocks it reads. XXH3 runs at 12 GB/s
here against 2.2-4 GB/s for zlib's CRC-32, which cost a load 2.6-3x ``np.load`` of the same
bytes from the page cache (checksum pass, then copy) with two ranks on two cores; with XXH3
the checksum is a small part of a load.

The metadata is checksummed too (a flipped bit in an offset or a value would otherwise load
wrong values silently), by a checksum file beside it rather than a field inside it: the digest
covers the exact bytes, so any reader in any language can check it without re-serializing JSON.
Both are written and fsynced before the commit rename. A reader also checks that each array's
chunks tile it exactly (inside it, no overlap, every element once).

Version 1 (no ``metadata.json.xxh3_64``; ``xxh3_64`` one string, the whole chunk's checksum)
is still read, as version 2 with one block per chunk. Versions 1 and 2 joined keys without
escaping (a ``.`` inside a key was ambiguous); they are read with such keys, and version 3
differs from version 2 in that alone.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ..comm import DistValueError
from ..comm._seams import NotRegular, TooLarge, open_regular as open_bounded, positive_setting, read_bounded
from .blocks import MAX_BLOCK, MIN_BLOCK, block_bytes, block_checksums
from .errors import CheckpointError
from .plan import Box, tiling_problem

__all__ = ["FORMAT", "VERSION", "LEGACY_BEFORE", "METADATA", "METADATA_CHECKSUM", "ALIGN", "data_file", "write_chunks",
           "read_metadata", "write_metadata", "fsync_dir", "checksum", "CHECKSUM", "create_exclusive", "METADATA_ENV",
           "MAX_METADATA_BYTES", "max_metadata_bytes", "read_regular", "open_regular", "check_dtype_string"]

FORMAT, VERSION = "meshkit.checkpoint", 3
#: versions below this joined nested keys with "." without escaping a "." inside a key
#: (:func:`~meshkit.checkpoint.leaves.flat_key`)
LEGACY_BEFORE = 3
METADATA = "metadata.json"
#: the XXH3-64 of metadata.json's bytes (16 hex digits), written before the commit like it
METADATA_CHECKSUM = "metadata.json.xxh3_64"
#: chunk offsets are multiples of this, so a memory map of any chunk is aligned for any dtype
ALIGN = 64


def data_file(rank: int) -> str:
    return f"data-{rank:05d}.bin"


#: the chunk records' checksum field
CHECKSUM = "xxh3_64"


def checksum(buf: Any) -> str:
    """XXH3-64 of a contiguous array's bytes, as 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(memoryview(buf).cast("B"))


def write_chunks(directory: Path, rank: int, chunks: list[tuple[str, tuple[int, ...], np.ndarray]]
                 ) -> list[tuple[str, dict[str, Any]]]:
    """Write ``(key, offsets, host array)`` chunks to this rank's data file and fsync it.

    Returns:
        ``(key, chunk record)`` per chunk, as metadata.json lists them.
    """
    if not chunks:
        return []
    name = data_file(rank)
    out = []
    with create_exclusive(directory / name) as f:
        pos = 0
        for key, offsets, data in chunks:
            if not data.flags.c_contiguous:  # (np.ascontiguousarray would turn a 0-d array 1-d)
                data = data.copy(order="C")
            pad = -pos % ALIGN
            if pad:
                f.write(b"\0" * pad)
                pos += pad
            f.write(memoryview(data).cast("B") if data.nbytes else b"")
            block = block_bytes(data.nbytes)
            out.append((key, {"offsets": list(offsets), "lengths": list(data.shape), "file": name, "offset": pos,
                              "nbytes": int(data.nbytes), "block_bytes": block,
                              CHECKSUM: block_checksums(data, block, checksum)}))
            pos += data.nbytes
        f.flush()
        os.fsync(f.fileno())
    return out


def write_metadata(directory: Path, metadata: dict[str, Any]) -> int:
    """Write metadata.json and its checksum file (each created exclusively), fsync both and their
    directory; returns metadata.json's size in bytes."""
    raw = json.dumps(metadata, separators=(",", ":")).encode()
    for name, data in ((METADATA, raw), (METADATA_CHECKSUM, checksum(raw).encode())):
        with create_exclusive(directory / name) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    fsync_dir(directory)
    return len(raw)


def create_exclusive(path: Path) -> Any:
    """A new file at ``path`` for writing (binary): created exclusively (``O_EXCL``: never one that
    exists, nor through a symbolic link planted at that name), with mode 0666 less the umask, as
    ``open`` creates files: a checkpoint's files are as private as the user's umask asks.

    Raises:
        FileExistsError: something is at ``path`` already (the save fails; nothing is overwritten).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    return os.fdopen(fd, "wb")


def fsync_dir(directory: Path) -> None:
    """Make a directory's entries (created, renamed files) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_metadata(directory: Path) -> dict[str, Any]:
    """metadata.json of the checkpoint at ``directory``, verified against its checksum file and
    checked for form: every field the reader uses has its type and range (:func:`_check_entry`),
    every value is JSON data, and every array's chunks tile it exactly (inside it, no two
    overlapping, every element in one).

    The metadata is read only if it is a regular file (a FIFO would wait for a writer, /dev/zero
    never end) of at most :func:`max_metadata_bytes`; the checks take time linear in its size.
    Version 1 (no checksum file) gets every check the later versions get: the checksum guards
    against corruption, not against whoever can write the metadata (who can rewrite the checksum
    file too), so removing it skips nothing else.

    Raises:
        CheckpointError: no checkpoint there; metadata that is unreadable, too large, corrupt (its
            checksum differs or is missing) or malformed; naming the file and what is wrong.
    """
    path = directory / METADATA
    if not directory.is_dir():
        raise CheckpointError(f"no checkpoint at {str(directory)!r}: the directory does not exist")
    limit = max_metadata_bytes()
    try:
        raw = read_regular(path, limit, f" ({METADATA_ENV}): set that variable higher to read this checkpoint")
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {str(directory)!r}: {METADATA} is missing (an incomplete save "
                              "never has this name: was the directory made by something else?)") from None
    except OSError as exc:
        raise CheckpointError(f"{str(path)!r} cannot be read: {exc}") from None
    side = directory / METADATA_CHECKSUM
    try:
        recorded: str | None = read_regular(side, _CHECKSUM_FILE_BYTES, ": a checksum file holds 16 hex digits"
                                            ).decode(errors="replace").strip()
    except FileNotFoundError:
        recorded = None  # version 1 had none; from version 2 on, a missing one is an error (below)
    except OSError as exc:
        raise CheckpointError(f"{str(side)!r} cannot be read: {exc}") from None
    actual = checksum(raw)
    if recorded is not None and actual != recorded:
        shown = recorded if _HEX16.fullmatch(recorded) else repr(recorded[:32])
        raise CheckpointError(f"{str(path)!r} does not match its checksum in {METADATA_CHECKSUM} (XXH3-64 {actual}, "
                              f"recorded {shown}): the metadata is corrupt")
    try:
        meta = json.loads(raw)
    except RecursionError:
        raise CheckpointError(f"{str(path)!r} is not readable JSON: nested too deeply") from None
    except ValueError as exc:
        raise CheckpointError(f"{str(path)!r} is not readable JSON: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("arrays"), dict) \
            or not isinstance(meta.get("values"), dict):
        raise CheckpointError(f"{str(path)!r} is not meshkit checkpoint metadata (format {FORMAT!r}, with 'arrays' "
                              "and 'values')")
    version = meta.get("version")
    if isinstance(version, bool) or version not in (1, 2, VERSION):
        raise CheckpointError(f"{str(path)!r} has format version {version!r}; this meshkit reads versions 1 to "
                              f"{VERSION}")
    if recorded is None and version != 1:
        raise CheckpointError(f"{str(side)!r} is missing: {METADATA} cannot be verified (a checkpoint is committed "
                              "with both)")
    for key, a in meta["arrays"].items():
        try:
            _check_entry(a, version)
        except ValueError as exc:
            raise CheckpointError(f"{str(path)!r}: the entry of {key!r} is malformed: {exc}") from None
    for key, value in meta["values"].items():
        if not _is_json_data(value):
            raise CheckpointError(f"{str(path)!r}: the value of {key!r} must be JSON scalars or lists of them, got "
                                  f"{_shown(value)}")
    return meta


# --------------------------------------------------------------------------- reading files safely
#: the variable that sets :func:`max_metadata_bytes`
METADATA_ENV = "MESHKIT_CHECKPOINT_MAX_METADATA_BYTES"
#: metadata.json's default cap: about 130 bytes a chunk (more with many checksum blocks), so 256
#: MiB is some 2M chunks, e.g. 1000 arrays flat-sharded over 2048 ranks; parsed, it takes about
#: ten times that in memory, which a rank that loads that checkpoint can afford
MAX_METADATA_BYTES = 256 << 20
#: the checksum file holds 16 hex digits (and maybe a newline)
_CHECKSUM_FILE_BYTES = 4096
_HEX16 = re.compile(r"[0-9a-f]{16}")


def max_metadata_bytes() -> int:
    """``MESHKIT_CHECKPOINT_MAX_METADATA_BYTES``: the most bytes of metadata.json a load reads
    (default :data:`MAX_METADATA_BYTES`).

    Raises:
        CheckpointError: the variable is not a positive whole number of bytes, naming it.
    """
    try:
        return int(positive_setting(METADATA_ENV, MAX_METADATA_BYTES, integer=True, where="meshkit.checkpoint",
                                    valid=f"a positive number of bytes (default {MAX_METADATA_BYTES}: 256 MiB)"))
    except DistValueError as exc:
        raise CheckpointError(str(exc)) from None


def read_regular(path: Path, limit: int, why: str) -> bytes:
    """The bytes of the regular file at ``path`` (a symbolic link is followed to one), at most ``limit``.

    A FIFO, a device (``/dev/zero``), a directory or a socket is refused before it is read, and
    opened, if at all, without blocking; a file is read no further than ``limit`` bytes
    (:func:`meshkit.comm._seams.read_bounded`).

    Raises:
        FileNotFoundError: there is no file at ``path``.
        CheckpointError: not a regular file, or larger than ``limit`` (``why`` follows: what sets it).
        OSError: it cannot be read.
    """
    try:
        return read_bounded(path, limit)
    except NotRegular as exc:
        raise _not_regular(path, exc.kind, "") from None
    except TooLarge:
        raise CheckpointError(f"{str(path)!r} is larger than {limit} bytes{why}") from None


def open_regular(path: Path, what: str) -> Any:
    """A binary file object of the regular file at ``path`` (see :func:`read_regular`), for a
    memory map. ``what`` precedes the path in an error (``"data file"``).

    Raises:
        FileNotFoundError, OSError; CheckpointError: not a regular file.
    """
    try:
        return os.fdopen(open_bounded(path), "rb")
    except NotRegular as exc:
        raise _not_regular(path, exc.kind, what) from None


def _not_regular(path: Path, kind: str, what: str) -> CheckpointError:
    return CheckpointError(f"{what + ' ' if what else ''}{str(path)!r} is not a regular file ({kind}); a "
                           "checkpoint's files are the regular files its save wrote")


# --------------------------------------------------------------------------- the form of an entry
#: the largest index NumPy can address: shapes, offsets and byte counts are below it
_LIMIT = 2 ** 63
_MAX_NDIM = 64  # NumPy's (NPY_MAXDIMS since NumPy 2)
#: a dtype string longer than this is not one ``dtype.str`` writes (those are a few characters)
_MAX_DTYPE_CHARS = 32
_DATA_FILE = re.compile(r"data-\d{5,}\.bin")


def _shown(v: Any) -> str:
    """A value in an error message: its type and (shortened) repr."""
    text = repr(v)
    return f"{type(v).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _int(v: Any, what: str, low: int = 0, high: int = _LIMIT - 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise ValueError(f"{what} must be an int in {low}..{'2**63-1' if high == _LIMIT - 1 else high}, got "
                         f"{_shown(v)}")
    return v


def _ints(v: Any, what: str, n: int) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) != n or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < _LIMIT for x in v):
        raise ValueError(f"{what} must be a list of {n} ints in 0..2**63-1, got {_shown(v)}")
    return tuple(v)


def check_dtype_string(text: Any) -> np.dtype:
    """The dtype a metadata ``dtype`` field names, if it is one a checkpoint can hold: a NumPy
    ``dtype.str`` (canonical: what the writer records) of plain values, with a non-zero itemsize.
    Object dtypes (pointers to Python objects), structured and subarray dtypes are refused.

    Raises:
        ValueError: naming the string and what is wrong.
    """
    valid = "'dtype' must be a NumPy dtype of plain values (dtype.str, e.g. '<f8'), got"
    if not isinstance(text, str):
        raise ValueError(f"{valid} {_shown(text)}")
    shown = repr(text if len(text) <= 40 else text[:37] + "...")
    if len(text) > _MAX_DTYPE_CHARS:
        raise ValueError(f"{valid} {shown}: longer than any dtype.str")
    try:
        dtype = np.dtype(text)
    except (TypeError, ValueError, SyntaxError):
        raise ValueError(f"{valid} {shown}: not a dtype NumPy reads") from None
    if dtype.hasobject:
        raise ValueError(f"{valid} {shown}: an object dtype (its bytes would be pointers to Python objects)")
    if dtype.fields is not None or dtype.subdtype is not None:
        raise ValueError(f"{valid} {shown}: a structured or subarray dtype")
    if dtype.str != text:
        raise ValueError(f"{valid} {shown}: not in its dtype.str form ({dtype.str!r})")
    if dtype.itemsize < 1:
        raise ValueError(f"{valid} {shown}: its itemsize is 0")
    return dtype


def _check_entry(a: Any, version: int) -> None:
    """One array's entry: its shape, dtype and chunk records (each field's type and range), and
    that the chunks tile it. A version-1 chunk (one checksum string, no block_bytes) is rewritten
    as version 2's: one block a chunk.

    Raises:
        ValueError: what is wrong, naming the field (and the chunk's index).
    """
    if not isinstance(a, dict):
        raise ValueError(f"it must be a JSON object, got {_shown(a)}")
    for field in ("shape", "dtype", "chunks"):
        if field not in a:
            raise ValueError(f"it has no {field!r}")
    shape = a["shape"]
    if not isinstance(shape, list) or len(shape) > _MAX_NDIM or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < _LIMIT for x in shape) or \
            math.prod(shape) >= _LIMIT:
        raise ValueError(f"'shape' must be a list of at most {_MAX_NDIM} ints in 0..2**63-1 whose product is below "
                         f"2**63, got {_shown(shape)}")
    shape = tuple(shape)
    dtype = check_dtype_string(a["dtype"])
    chunks = a["chunks"]
    if not isinstance(chunks, list):
        raise ValueError(f"'chunks' must be a list of chunk records, got {type(chunks).__name__}")
    boxes = []
    for i, c in enumerate(chunks):
        if not isinstance(c, dict):
            raise ValueError(f"chunk {i} must be a JSON object, got {_shown(c)}")
        try:
            boxes.append(_check_chunk(c, shape, dtype, version))
        except KeyError as exc:
            raise ValueError(f"chunk {i} has no {exc.args[0]!r}") from None
        except ValueError as exc:
            raise ValueError(f"chunk {i}: {exc}") from None
    problem = tiling_problem(shape, boxes, "chunk")
    if problem:
        raise ValueError(f"its {problem}")


def _check_chunk(c: dict[str, Any], shape: tuple[int, ...], dtype: np.dtype, version: int) -> Box:
    """One chunk record's fields (KeyError: one is missing); its box."""
    offsets = _ints(c["offsets"], "'offsets'", len(shape))
    lengths = _ints(c["lengths"], "'lengths'", len(shape))
    name = c["file"]
    if not isinstance(name, str) or not _DATA_FILE.fullmatch(name):
        raise ValueError(f"'file' must be a data file name (data-NNNNN.bin), got "
                         f"{repr(name) if isinstance(name, str) else _shown(name)}")
    offset = c["offset"]
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < _LIMIT or offset % ALIGN:
        raise ValueError(f"'offset' must be an int in 0..2**63-1 that is a multiple of {ALIGN}, got {_shown(offset)}")
    nbytes = _int(c["nbytes"], "'nbytes'")
    elements = math.prod(lengths)
    if nbytes != elements * dtype.itemsize:
        raise ValueError(f"'nbytes' is {nbytes}, but {elements} elements of {dtype.str} are "
                         f"{elements * dtype.itemsize} bytes")
    if offset + nbytes >= _LIMIT:
        raise ValueError(f"its bytes {offset}..{offset + nbytes} lie beyond any file")
    sums = c[CHECKSUM]
    if version == 1:
        if not isinstance(sums, str) or "block_bytes" in c:
            raise ValueError(f"a version-1 chunk has one {CHECKSUM!r} string and no 'block_bytes', got "
                             f"{CHECKSUM} {_shown(sums)}{' and block_bytes' if 'block_bytes' in c else ''}")
        c["block_bytes"], c[CHECKSUM] = max(1, nbytes), [sums] if nbytes else []
        sums = c[CHECKSUM]
    else:
        _int(c["block_bytes"], "'block_bytes'", MIN_BLOCK, MAX_BLOCK)
    count = -(-nbytes // c["block_bytes"])
    if not isinstance(sums, list) or len(sums) != count or not all(
            isinstance(x, str) and _HEX16.fullmatch(x) for x in sums):
        raise ValueError(f"{CHECKSUM!r} must be a list of {count} checksums (16 hex digits), one a block of "
                         f"{c['block_bytes']} bytes of its {nbytes}, got {_shown(sums)}")
    return offsets, lengths


def _is_json_data(value: Any) -> bool:
    """Whether ``value`` (parsed JSON) is what a state dict's value can be: None, a bool, an int,
    a float, a str, or a list of such (nested); no objects. Iterative: any depth JSON parsed."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, list):
            todo.extend(v)
        elif not (v is None or isinstance(v, (bool, int, float, str))):
            return False
    return True
