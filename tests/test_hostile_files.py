"""The files meshkit reads and writes, against another local user.

Readers refuse hostile input with a clear error, in bounded time and memory: the flight records
``python -m meshkit.debug analyze`` reads (a FIFO, /dev/zero, a huge file, malformed records with
the right format tag, a world of 1e12 ranks, escape sequences in printed text) and a checkpoint's
metadata (a FIFO, /dev/zero, an enormous file, a chunk staircase that made the tiling check
quadratic, fields of the wrong type or range, values whose type differs from the state dict's, a
version-1 downgrade). Writers create their files exclusively, with the user's permissions: a
checkpoint honours the umask, a flight record is 0600 and never follows a planted symlink, and an
unusable ``MESHKIT_TRACE_DIR`` is refused at ``init_process_group``.

Where the attack is another local user's (a FIFO or a symlink planted in a shared folder), it is
played by user ``nobody`` through ``setpriv`` when the tests run as root, else by this user.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import meshkit
import meshkit.debug
from meshkit import checkpoint as dcp
from meshkit.checkpoint import CheckpointError, CheckpointManager
from meshkit.checkpoint.format import write_chunks, write_metadata
from meshkit.checkpoint.plan import tiling_problem
from meshkit.comm import local
from meshkit.comm.errors import DistValueError
from meshkit.debug.__main__ import main as debug_main
from meshkit.tensor import Shard, distribute_tensor

NOBODY = 65534
#: whether another user can be played (root, with setpriv): else the same attacks come from this uid
AS_NOBODY = os.geteuid() == 0 and shutil.which("setpriv") is not None


def _outsider(*cmd: str) -> None:
    """Run ``cmd`` as user nobody where this machine allows it, else as this user."""
    prefix = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] if AS_NOBODY else []
    subprocess.run([*prefix, *cmd], check=True, timeout=30)


@pytest.fixture
def shared_dir():
    """A folder every user may write in, sticky (as /tmp is), outside pytest's private tmp_path."""
    folder = Path(tempfile.mkdtemp(prefix="meshkit-shared-", dir="/tmp"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _in_thread(fn, within: float, unblock=None):
    """``fn()``'s result, failing the test if it has not returned ``within`` seconds (then
    ``unblock()`` releases it, so that a regression fails instead of hanging the suite)."""
    out: list = []

    def run():
        try:
            out.append(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            out.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(within)
    if thread.is_alive():
        if unblock is not None:
            unblock()
        thread.join(5)
        pytest.fail(f"still running after {within} s (it waits on the file, or reads without bound)")
    took = time.monotonic() - started
    kind, value = out[0]
    return kind, value, took


def _open_fifo_for_writing(path: Path):
    """Release a reader blocked opening the FIFO ``path``."""
    def unblock():
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass
    return unblock


# =========================================================================== checkpoints
def _model():
    rng = np.random.default_rng(3)
    return {"w": rng.standard_normal((16, 8)), "b": rng.standard_normal(8).astype(np.float32)}


def _save(path: Path, n: int = 2, values: dict | None = None) -> None:
    """A checkpoint where each of ``n`` ranks holds a Shard(0) half of each array, and ``values``."""
    def body():
        mesh = meshkit.init_device_mesh("cpu", (n,))
        sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _model().items()}
        dcp.save({"model": sd, "step": 3, **(values or {})}, checkpoint_id=path)

    local.run(body, n)


def _try_load(path: Path, n: int = 2, values: dict | None = None):
    """Every rank's error text (None: loaded) and whether its arrays and values stayed untouched."""
    def body():
        mesh = meshkit.init_device_mesh("cpu", (n,))
        sd = {k: distribute_tensor(np.full(v.shape, -1.0, v.dtype), mesh, [Shard(0)]) for k, v in _model().items()}
        given_values = {"step": 0, **(values or {})}
        box = {"model": sd, **given_values}
        try:
            dcp.load(box, checkpoint_id=path)
        except CheckpointError as exc:
            untouched = all((v.to_local() == -1).all() for v in sd.values()) and \
                all(box[k] == v and type(box[k]) is type(v) for k, v in given_values.items())
            return str(exc), untouched
        return None, {k: box[k] for k in given_values}

    return local.run(body, n)


def _refused_everywhere(results, match: str) -> None:
    import re
    for text, untouched in results:
        assert text is not None and untouched is True, results
        assert "nothing was loaded" in text
        assert re.search(match, text), (match, text)


def _edit(path: Path, edit, version: int = 3) -> None:
    """Rewrite metadata.json as a writer (or an attacker) would: its checksum file made to match
    (version 3), or the checksum file removed and the metadata made version 1 (one checksum string
    per chunk, no block_bytes): the downgrade that skips the metadata's checksum."""
    meta = json.loads((path / "metadata.json").read_text())
    if version == 1:
        meta["version"] = 1
        for a in meta["arrays"].values():
            for c in a["chunks"]:
                c["xxh3_64"] = c["xxh3_64"][0]
                del c["block_bytes"]
    edit(meta)
    if version == 1:
        (path / "metadata.json").write_text(json.dumps(meta))
        (path / "metadata.json.xxh3_64").unlink(missing_ok=True)
    else:
        (path / "metadata.json").unlink()
        (path / "metadata.json.xxh3_64").unlink()
        write_metadata(path, meta)


def _chunk(meta, key="model.w", i=1):
    return meta["arrays"][key]["chunks"][i]


def _set(field, value, key="model.w", i=1):
    def edit(meta):
        _chunk(meta, key, i)[field] = value
    return edit


def _set_array(field, value, key="model.w"):
    def edit(meta):
        meta["arrays"][key][field] = value
    return edit


def _set_value(key, value):
    def edit(meta):
        meta["values"][key] = value
    return edit


def _set_meta(field, value):
    def edit(meta):
        meta[field] = value
    return edit


# what each crafted metadata is refused with, whatever the version (1 without a checksum file, or 3)
_CRAFTED = {
    "overlap": (_set("offsets", [7, 0]),
                r"its chunks at offsets \(0, 0\) \(lengths \(8, 8\)\) and \(7, 0\) \(lengths \(8, 8\)\) overlap"),
    "out-of-bounds": (_set("offsets", [9, 0]), r"its chunk at offsets \(9, 0\) \(lengths \(8, 8\)\) is not inside "
                                                r"the shape \(16, 8\)"),
    "bool-offsets": (_set("offsets", [True, 0]), r"'offsets' must be a list of 2 ints"),
    "offset-bool": (_set("offset", True), r"'offset' must be an int in 0\.\.2\*\*63-1 that is a multiple of 64, "
                                          r"got bool True"),
    "offset-unaligned": (_set("offset", 8), r"'offset' must be an int .* multiple of 64, got int 8"),
    "offset-negative": (_set("offset", -64), r"'offset' must be an int in 0\.\.2\*\*63-1 .*, got int -64"),
    "nbytes-float": (_set("nbytes", 512.0), r"'nbytes' must be an int in 0\.\.2\*\*63-1, got float 512\.0"),
    "nbytes-wrong": (_set("nbytes", 1024), r"'nbytes' is 1024, but 64 elements of <f8 are 512 bytes"),
    "file-path": (_set("file", "../data-00000.bin"), r"'file' must be a data file name \(data-NNNNN.bin\), got "
                                                      r"'\.\./data-00000\.bin'"),
    "file-type": (_set("file", 7), r"'file' must be a data file name \(data-NNNNN.bin\), got int 7"),
    "dtype-object": (_set_array("dtype", "|O"), r"'dtype' must be a NumPy dtype of plain values \(dtype\.str, "
                                                 r"e\.g\. '<f8'\), got '\|O': an object dtype"),
    "dtype-structured": (_set_array("dtype", "O,<f8"), r"'dtype' must be .*got 'O,<f8'"),
    "dtype-garbage": (_set_array("dtype", "not a dtype"), r"'dtype' must be .*got 'not a dtype'"),
    "dtype-long": (_set_array("dtype", "(2,)" * 5000 + "<f8"), r"'dtype' must be .*got '\(2,\)\(2,\)"),
    "shape-huge": (_set_array("shape", [2 ** 64, 8]), r"'shape' must be a list of at most 64 ints in "
                                                      r"0\.\.2\*\*63-1 whose product is below 2\*\*63"),
    "shape-str": (_set_array("shape", "16,8"), r"'shape' must be a list"),
    "chunks-dict": (_set_array("chunks", {"0": 1}), r"'chunks' must be a list of chunk records, got dict"),
    "chunk-not-dict": (lambda meta: meta["arrays"]["model.w"]["chunks"].append(5),
                       r"chunk 2 must be a JSON object, got int 5"),
    "chunk-missing-field": (lambda meta: _chunk(meta).pop("nbytes"), r"chunk 1 has no 'nbytes'"),
    "value-object": (_set_value("step", {"a": 1}), r"the value of 'step' must be JSON scalars or lists of them, "
                                                   r"got dict"),
    "version-bool": (_set_meta("version", True), r"has format version True; this meshkit reads versions 1 to 3"),
}


@pytest.mark.parametrize("version", [1, 3])
@pytest.mark.parametrize("case", sorted(_CRAFTED))
def test_crafted_metadata_is_refused_alike_in_version_1_without_checksum_and_in_version_3(case, version, tmp_path):
    """A version-1 checkpoint (no metadata checksum file) still loads (test_checkpoint), but its
    metadata gets every check version 3's gets: removing the checksum file and writing
    ``version: 1`` skips nothing but the check against bit flips (which an attacker who edits
    the metadata can always rewrite)."""
    edit, message = _CRAFTED[case]
    _save(tmp_path / "ck")
    _edit(tmp_path / "ck", edit, version)
    _refused_everywhere(_try_load(tmp_path / "ck"), message)


def test_version_1_checkpoints_keep_their_own_chunk_form(tmp_path):
    """Version 1 has one checksum string per chunk and no block_bytes; version 3 a list of
    block checksums and block_bytes (64 KiB .. 1 MiB). Each is refused in the other's form."""
    _save(tmp_path / "ck")
    _edit(tmp_path / "ck", lambda meta: None, version=1)
    assert [text for text, _ in _try_load(tmp_path / "ck")] == [None, None]  # the downgrade itself loads
    _save(tmp_path / "v1")
    _edit(tmp_path / "v1", _set("block_bytes", 65536), version=1)
    _refused_everywhere(_try_load(tmp_path / "v1"), r"chunk 1: a version-1 chunk has one 'xxh3_64' string and no "
                                                    r"'block_bytes', got xxh3_64 str '[0-9a-f]{16}' and block_bytes")
    _save(tmp_path / "v3")
    _edit(tmp_path / "v3", _set("block_bytes", 1))
    _refused_everywhere(_try_load(tmp_path / "v3"), r"'block_bytes' must be an int in 65536\.\.1048576, got int 1")


@pytest.mark.parametrize("given, found, expected_name, found_name", [
    (0, "3", "int", "str"),
    (0, 3.5, "int", "float"),
    (0, True, "int", "bool"),
    (0, [3], "int", "list"),
    (0, None, "int", "NoneType"),
    (0.5, "0.1", "float", "str"),
    (False, 1, "bool", "int"),
    ("adamw", 3, "str", "int"),
    ([0.9, 0.999], "0.9", "list", "str"),
])
def test_a_value_of_another_type_than_the_state_dicts_is_refused_on_every_rank(given, found, expected_name,
                                                                                found_name, tmp_path):
    """The state dict says which type each value has: a checkpoint whose 'step' is a string (a
    dict where a number is expected, a bool where an int is) fails the load on every rank,
    naming the key and both types, with nothing loaded. (None declares no type: it takes any.)"""
    _save(tmp_path / "ck", values={"hp": given})
    _edit(tmp_path / "ck", _set_value("hp", found))
    _refused_everywhere(_try_load(tmp_path / "ck", values={"hp": given}),
                        rf"key 'hp': the checkpoint at .* has a {found_name} \({found!r}\)".replace("[", r"\[")
                        .replace("]", r"\]") + rf", where the state dict has a {expected_name}")


def test_values_of_the_state_dicts_types_load_and_an_int_loads_into_a_float(tmp_path):
    _save(tmp_path / "ck", values={"lr": 1.0, "name": "adamw", "betas": [0.9, 0.999], "flag": True, "none": "x"})
    _edit(tmp_path / "ck", _set_value("lr", 2))  # JSON writers may drop a float's ".0"
    loaded = _try_load(tmp_path / "ck", values={"lr": 0.5, "name": "", "betas": [0.0, 0.0], "flag": False,
                                                "none": None})
    for text, values in loaded:
        assert text is None, text
        assert values == {"step": 3, "lr": 2.0, "name": "adamw", "betas": [0.9, 0.999], "flag": True, "none": "x"}
        assert type(values["lr"]) is float


def _metadata_path(tmp_path: Path) -> Path:
    _save(tmp_path / "ck")
    target = tmp_path / "ck" / "metadata.json"
    target.unlink()
    return target


def test_metadata_that_is_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    path = _metadata_path(tmp_path)
    os.mkfifo(path)
    kind, value, took = _in_thread(lambda: _try_load(tmp_path / "ck"), 20, _open_fifo_for_writing(path))
    assert kind == "ok", value
    _refused_everywhere(value, r"metadata.json' is not a regular file \(a FIFO\)")


def test_metadata_that_is_a_symlink_to_dev_zero_is_refused_without_reading_it(tmp_path):
    path = _metadata_path(tmp_path)
    path.symlink_to("/dev/zero")
    kind, value, took = _in_thread(lambda: _try_load(tmp_path / "ck"), 20)
    assert kind == "ok", value
    _refused_everywhere(value, r"metadata.json' is not a regular file \(a character device\)")


def test_enormous_metadata_is_refused_at_the_cap_naming_the_variable(tmp_path, monkeypatch, caplog):
    _save(tmp_path / "ck")
    size = (tmp_path / "ck" / "metadata.json").stat().st_size
    monkeypatch.setenv("MESHKIT_CHECKPOINT_MAX_METADATA_BYTES", str(size - 1))
    _refused_everywhere(_try_load(tmp_path / "ck"), rf"metadata.json' is larger than {size - 1} bytes "
                                                    r"\(MESHKIT_CHECKPOINT_MAX_METADATA_BYTES\)")
    monkeypatch.setenv("MESHKIT_CHECKPOINT_MAX_METADATA_BYTES", str(size))
    assert [text for text, _ in _try_load(tmp_path / "ck")] == [None, None]
    monkeypatch.setenv("MESHKIT_CHECKPOINT_MAX_METADATA_BYTES", str(size - 100))
    with caplog.at_level("WARNING", logger="meshkit.checkpoint"):  # a save beyond the cap commits, and says so
        _save(tmp_path / "big")
    assert (tmp_path / "big" / "metadata.json").is_file()
    assert (f"is larger than {size - 100} bytes: a load refuses it unless MESHKIT_CHECKPOINT_MAX_METADATA_BYTES is "
            "set higher") in caplog.text, caplog.text
    monkeypatch.setenv("MESHKIT_CHECKPOINT_MAX_METADATA_BYTES", "lots")
    _refused_everywhere(_try_load(tmp_path / "ck"), r"MESHKIT_CHECKPOINT_MAX_METADATA_BYTES='lots' is not valid; "
                                                    r"valid values are a positive number of bytes")


def test_deeply_nested_metadata_is_refused_as_malformed(tmp_path):
    _save(tmp_path / "ck")
    write = (tmp_path / "ck" / "metadata.json")
    write.write_text("[" * 100_000)
    (tmp_path / "ck" / "metadata.json.xxh3_64").unlink()
    _refused_everywhere(_try_load(tmp_path / "ck"), r"metadata.json' is not readable JSON: nested too deeply")


@pytest.mark.parametrize("plant", ["fifo", "dev-zero"])
def test_a_data_file_that_is_not_a_regular_file_is_refused(plant, tmp_path):
    _save(tmp_path / "ck")
    data = tmp_path / "ck" / "data-00001.bin"
    data.unlink()
    if plant == "fifo":
        os.mkfifo(data)
    else:
        data.symlink_to("/dev/zero")
    kind, value, _ = _in_thread(lambda: _try_load(tmp_path / "ck"), 20, _open_fifo_for_writing(data))
    assert kind == "ok", value
    what = "a FIFO" if plant == "fifo" else "a character device"
    _refused_everywhere(value, rf"data file '.*data-00001.bin' is not a regular file \({what}\)")


def test_a_step_planted_in_a_shared_manager_directory_by_another_user_is_not_the_jobs(shared_dir):
    """A CheckpointManager's directory others may write in (sticky, as /tmp): another user plants
    a newer ``step_`` (a directory of theirs, and a symlink to it). The manager neither restores
    nor prunes what is not this user's own, and names it in a warning."""
    directory = shared_dir / "ckpts"
    directory.mkdir()
    directory.chmod(0o1777)

    def save():
        manager = CheckpointManager(directory, max_to_keep=1)
        manager.save(1, {"x": np.arange(4.0)})

    local.run(save, 1)
    _outsider("sh", "-c", f"mkdir {directory}/step_99 && echo '{{}}' > {directory}/step_99/metadata.json && "
                          f"ln -s {directory}/step_99 {directory}/step_98")

    def restore():
        manager = CheckpointManager(directory, max_to_keep=1)
        x = np.zeros(4)
        step = manager.restore({"x": x})
        manager.save(2, {"x": x + 1})  # prunes step 1, and leaves the planted ones alone
        return step, list(x), manager.all_steps()

    if AS_NOBODY:
        step, x, steps = local.run(restore, 1)[0]
        assert (step, x, steps) == (1, [0.0, 1.0, 2.0, 3.0], [2])
        assert (directory / "step_99").is_dir() and (directory / "step_98").is_symlink()
    else:  # planted by this user, step_99 is this user's own: what it holds is refused, never loaded
        with pytest.raises(CheckpointError, match=r"step_99/metadata.json' is not meshkit checkpoint metadata"):
            local.run(restore, 1)


def test_the_chunk_staircase_that_took_84_s_is_checked_in_near_linear_time():
    """The attack: 8,000 chunks (1 MB of metadata) tiling a 4000x4000 array as columns cut in two
    at the diagonal; every chunk spans the sweep axis' far end, so a sweep compared each with all
    the others (84 s). The check is now a count of signed corners, 4 a chunk."""
    n = 4000
    boxes = [((i, i), (n - i, 1)) for i in range(n)] + [((0, i), (i, 1)) for i in range(1, n)]
    # CPU time of this thread, not wall time: another worker's load must not fail it, and the
    # bound is far from the near-linear check's cost and far below the quadratic sweep's 84 s
    started = time.thread_time()
    assert tiling_problem((n, n), boxes, "chunk") is None
    valid = time.thread_time() - started
    boxes[-1] = ((1, n - 1), (n - 1, 1))  # the last upper chunk moved down one: overlaps the diagonal's
    started = time.thread_time()
    assert tiling_problem((n, n), boxes, "chunk") == (f"chunks at offsets ({n - 1}, {n - 1}) (lengths (1, 1)) and "
                                                      f"(1, {n - 1}) (lengths ({n - 1}, 1)) overlap")
    overlapping = time.thread_time() - started
    assert valid < 5.0 and overlapping < 5.0, (valid, overlapping)


def _cells(shape, boxes):
    counts = np.zeros(shape, int)
    for offsets, lengths in boxes:
        if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, shape)):
            return None
        counts[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))] += 1
    return counts


@st.composite
def _boxes(draw):
    """A random tiling of a small array (1 to 3 dims) by recursive cuts, then maybe one box
    moved, grown, shrunk, duplicated or dropped."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
    boxes = [((0,) * ndim, shape)]
    for _ in range(draw(st.integers(0, 8))):
        i = draw(st.integers(0, len(boxes) - 1))
        offsets, lengths = boxes[i]
        axis = draw(st.integers(0, ndim - 1))
        if lengths[axis] < 2:
            continue
        cut = draw(st.integers(1, lengths[axis] - 1))
        first = lengths[:axis] + (cut,) + lengths[axis + 1:]
        second = offsets[:axis] + (offsets[axis] + cut,) + offsets[axis + 1:]
        rest = lengths[:axis] + (lengths[axis] - cut,) + lengths[axis + 1:]
        boxes[i:i + 1] = [(offsets, first), (second, rest)]
    change = draw(st.sampled_from(["none", "move", "grow", "shrink", "duplicate", "drop", "swap-size"]))
    i = draw(st.integers(0, len(boxes) - 1))
    offsets, lengths = boxes[i]
    axis = draw(st.integers(0, ndim - 1))
    step = draw(st.sampled_from([-1, 1]))
    if change == "move" and draw(st.booleans()):  # mostly inside: the volumes still add up
        step = 1 if offsets[axis] + lengths[axis] < shape[axis] else -1
    bump = tuple(v + step if k == axis else v for k, v in enumerate(offsets))
    if change == "move":
        boxes[i] = (bump, lengths)
    elif change in ("grow", "shrink"):
        boxes[i] = (offsets, tuple(v + (1 if change == "grow" else -1) if k == axis else v
                                   for k, v in enumerate(lengths)))
    elif change == "duplicate":
        boxes.append(boxes[i])
    elif change == "drop" and len(boxes) > 1:
        boxes.pop(i)
    elif change == "swap-size" and len(boxes) > 1:  # two boxes trade lengths: same volume, misplaced
        j = (i + 1) % len(boxes)
        boxes[i], boxes[j] = (boxes[i][0], boxes[j][1]), (boxes[j][0], boxes[i][1])
    return shape, boxes


@settings(max_examples=300)
@given(_boxes())
def test_the_tiling_check_agrees_with_counting_every_element(case):
    """tiling_problem, and each of its three exact methods on its own (signed corners, the painted
    grid, the sweep), against a count of every element's boxes."""
    from meshkit.checkpoint import plan

    shape, boxes = case
    counts = _cells(shape, boxes)
    problem = tiling_problem(shape, boxes, "chunk")
    exact = counts is not None and (counts == 1).all()
    assert (problem is None) == exact, (shape, boxes, problem)
    if counts is None:
        assert "is not inside the shape" in problem
        return
    if counts.sum() != math.prod(shape):
        return
    if not exact:  # the volumes add up: named as an overlap
        assert problem.endswith("overlap"), problem
    full = [b for b in boxes if all(b[1])]
    if full:
        grid = [sorted({0, s, *{o[k] for o, _ in full}, *{o[k] + n[k] for o, n in full}}) for k, s in enumerate(shape)]
        assert plan._corners_add_up(shape, full) == exact
        assert plan._painted_once(full, grid) == exact
        assert (plan._overlapping_pair(full) is None) == exact


@pytest.mark.parametrize("shape, boxes, problem", [
    ((), [((), ())], None),
    ((), [((), ()), ((), ())], "chunks hold 2 elements of an array of shape () (1 elements): they overlap"),
    ((0, 3), [], None),
    ((0, 3), [((0, 0), (0, 3))], None),
    ((4,), [((0,), (4,)), ((2,), (0,))], None),  # an empty chunk holds nothing
    ((4,), [((0,), (2,)), ((2,), (2,)), ((0,), (0,)), ((0,), (0,))], None),
    ((4,), [((0,), (2,)), ((1,), (2,)), ((3,), (1,))], "chunks hold 5 elements of an array of shape (4,) "
                                                       "(4 elements): they overlap"),
    ((2, 2), [((0, 0), (1, 1)), ((0, 0), (1, 1)), ((1, 0), (1, 2))], "chunks at offsets (0, 0) (lengths (1, 1)) and "
     "(0, 0) (lengths (1, 1)) overlap"),
    ((4,), [((0,), (5,))], "chunk at offsets (0,) (lengths (5,)) is not inside the shape (4,)"),
    ((4,), [((0, 0), (4, 1))], "chunk at offsets (0, 0) (lengths (4, 1)) is not inside the shape (4,)"),
])
def test_tiling_problems_of_edge_cases(shape, boxes, problem):
    assert tiling_problem(shape, boxes, "chunk") == problem


def _guillotine(ndim: int, count: int, length: int = 1000, seed: int = 1) -> tuple[tuple[int, ...], list]:
    """A tiling of a ``length**ndim`` array by ``count`` boxes: random boxes cut in two at random."""
    import random
    rng = random.Random(seed)
    boxes = [((0,) * ndim, (length,) * ndim)]
    while len(boxes) < count:
        i, k = rng.randrange(len(boxes)), rng.randrange(ndim)
        (o, n) = boxes[i]
        if n[k] > 1:
            cut = rng.randrange(1, n[k])
            boxes[i:i + 1] = [(o, n[:k] + (cut,) + n[k + 1:]), (o[:k] + (o[k] + cut,) + o[k + 1:],
                                                                   n[:k] + (n[k] - cut,) + n[k + 1:])]
    return (length,) * ndim, boxes


def test_chunks_cut_on_many_axes_are_checked_exactly_or_refused_in_bounded_time():
    """Corners grow as 2**c a box cut on c axes. Where they cost too much, the grid of the boxes'
    boundaries is painted (4096 unit chunks of a 12-D array), or the boxes are swept (few boxes,
    or 4000 random cuts of an 8-D array); a crafted file beyond all three is refused, fast."""
    import itertools
    started = time.thread_time()  # CPU time of this thread: the bound is on the work, not on the machine's load
    units = [(corner, (1,) * 12) for corner in itertools.product(range(2), repeat=12)]
    assert tiling_problem((2,) * 12, units, "chunk") is None
    units[5] = ((0,) * 12, (1,) * 12)  # a duplicate in place of another: the volumes still add up
    assert tiling_problem((2,) * 12, units, "chunk") == (
        "chunks hold 4096 elements of an array of shape (2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2) (4096 elements) but not "
        "each once: some overlap and leave as many elements unheld")
    shape, boxes = _guillotine(8, 4000)
    assert tiling_problem(shape, boxes, "chunk") is None
    boxes[7] = ((boxes[7][0][0] + 1, *boxes[7][0][1:]), boxes[7][1])
    assert tiling_problem(shape, boxes, "chunk") is not None
    shape, boxes = _guillotine(16, 5000)
    problem = tiling_problem(shape, boxes, "chunk")
    assert problem.startswith(f"chunks of the array of shape {shape}: 5000 chunks cut on up to 16 axes, too costly to "
                              "check that they tile it ("), problem
    assert time.thread_time() - started < 6.0  # the bound a crafted file cannot exceed; the check's own cost is well below


# --------------------------------------------------------------------------- writing: umask, exclusive files
@pytest.mark.parametrize("umask, files, folders", [(0o077, 0o600, 0o700), (0o022, 0o644, 0o755)])
def test_checkpoint_files_and_folders_honour_the_umask(umask, files, folders, tmp_path):
    def body():
        manager = CheckpointManager(tmp_path / "ckpts")
        mesh = meshkit.init_device_mesh("cpu", (2,))
        manager.save(1, {"w": distribute_tensor(np.arange(8.0), mesh, [Shard(0)]), "step": 1})

    old = os.umask(umask)
    try:
        local.run(body, 2)
    finally:
        os.umask(old)
    seen = {}
    for root, dirs, names in os.walk(tmp_path / "ckpts"):
        for name in dirs:
            seen[os.path.join(root, name)] = stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode)
        for name in names:
            seen[os.path.join(root, name)] = stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode)
    seen[str(tmp_path / "ckpts")] = stat.S_IMODE((tmp_path / "ckpts").stat().st_mode)
    assert sorted(os.path.relpath(p, tmp_path) for p in seen) == [
        "ckpts", "ckpts/step_1", "ckpts/step_1/data-00000.bin", "ckpts/step_1/data-00001.bin",
        "ckpts/step_1/metadata.json", "ckpts/step_1/metadata.json.xxh3_64"]
    for path, mode in seen.items():
        assert mode == (folders if os.path.isdir(path) else files), (path, oct(mode))


def test_a_checkpoint_file_is_created_exclusively_and_never_through_a_planted_symlink(tmp_path):
    """Under a permissive umask (or in a shared folder) another user could plant a data file's
    name before a rank writes it: the write fails instead of following the link."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    folder = tmp_path / "ck.tmp"
    folder.mkdir()
    (folder / "data-00000.bin").symlink_to(victim)
    with pytest.raises(FileExistsError):
        write_chunks(folder, 0, [("x", (0,), np.arange(4.0))])
    (folder / "metadata.json").symlink_to(victim)
    with pytest.raises(FileExistsError):
        write_metadata(folder, {"format": "meshkit.checkpoint"})
    assert victim.read_bytes() == b"precious"


# =========================================================================== flight records: analyze
def _record(rank: int, world: int = 2, **changes) -> dict:
    """A flight record as a rank writes one: an all_reduce completed, the next one started."""
    ranks = list(range(world)) if world <= 64 else [0, 1]  # (a huge world comes with its own groups)
    entry = {"seq": 0, "group": "world", "op": "all_reduce", "shapes": [[4]], "dtype": "float32",
             "state": "completed", "t_scheduled": 100.0, "t_start": 100.0, "t_end": 100.1, "error": None,
             "ranks": ranks}
    doc = {"format": "meshkit-flight-record/1", "rank": rank, "world_size": world, "backend": "mpi", "time": 101.0,
           "reason": "CollectiveTimeout: timed out",
           "groups": [{"name": "world", "ranks": ranks, "issued": 2}],
           "entries": [entry, {**entry, "seq": 1, "state": "started", "t_end": None, "t_scheduled": 100.2,
                               "t_start": 100.2}]}
    doc.update(changes)
    return doc


def _write_records(folder: Path, *docs, raw: dict | None = None) -> Path:
    folder.mkdir(exist_ok=True)
    for doc in docs:
        (folder / f"rank{doc['rank']}.json").write_text(json.dumps(doc))
    for name, text in (raw or {}).items():
        (folder / name).write_text(text)
    return folder


def _analyze(folder: Path, capsys, within: float = 10.0):
    """``python -m meshkit.debug analyze folder`` in this process: (exit code, stdout, stderr, seconds)."""
    kind, code, took = _in_thread(lambda: debug_main(["analyze", str(folder)]), within)
    assert kind == "ok", code
    out = capsys.readouterr()
    return code, out.out, out.err, took


def test_analyze_still_names_the_missing_rank_in_a_valid_record(tmp_path, capsys):
    code, out, err, _ = _analyze(_write_records(tmp_path / "t", _record(0)), capsys)
    assert code == 0, err
    assert "no record from rank 1" in out and "MISSING: rank 1 never entered all_reduce #1" in out


def _entry(**changes):
    def edit(doc):
        doc["entries"][1].update(changes)
        return doc
    return edit


def _field(**changes):
    def edit(doc):
        doc.update(changes)
        return doc
    return edit


def _drop(*path):
    def edit(doc):
        target = doc
        for p in path[:-1]:
            target = target[p]
        del target[path[-1]]
        return doc
    return edit


_BAD_RECORDS = {
    "world-1e12-float": (_field(world_size=1e12), r"'world_size' must be an int in 1\.\.2147483647, got float "
                                                  r"1000000000000\.0"),
    "world-1e12-int": (_field(world_size=10 ** 12), r"'world_size' must be an int in 1\.\.2147483647, got int "
                                                     r"1000000000000"),
    "rank-str": (_field(rank="1"), r"'rank' must be an int in 0\.\.1 \(its world_size less one\), got str '1'"),
    "rank-bool": (_field(rank=True), r"'rank' must be an int in 0\.\.1 .*, got bool True"),
    "rank-outside": (_field(rank=5), r"'rank' must be an int in 0\.\.1 .*, got int 5"),
    "no-entries": (_drop("entries"), r"it has no 'entries'"),
    "entries-dict": (_field(entries={}), r"'entries' must be a list, got dict"),
    "entry-int": (_field(entries=[3]), r"entry 0 must be a JSON object, got int 3"),
    "entry-no-seq": (_drop("entries", 1, "seq"), r"entry 1 has no 'seq'"),
    "seq-str": (_entry(seq="1"), r"entry 1: 'seq' must be an int in -1\.\.2\*\*63-1, got str '1'"),
    "seq-huge": (_entry(seq=10 ** 30), r"entry 1: 'seq' must be an int in -1\.\.2\*\*63-1, got int 10{30}"),
    "seq-negative": (_entry(seq=-7), r"entry 1: 'seq' must be an int in -1\.\.2\*\*63-1, got int -7"),
    "state": (_entry(state="dancing"), r"entry 1: 'state' must be one of \['completed', 'failed', 'rejected', "
                                       r"'scheduled', 'started', 'timed_out'\], got 'dancing'"),
    "ranks-str": (_entry(ranks=[0, "1"]), r"entry 1: 'ranks' must be null or a list of distinct ints in 0\.\.1"),
    "ranks-outside": (_entry(ranks=[0, 7]), r"entry 1: 'ranks' must be null or a list of distinct ints in 0\.\.1"),
    "shapes": (_entry(shapes=[4]), r"entry 1: 'shapes' must be a list of lists of ints"),
    "t_start": (_entry(t_start="soon"), r"entry 1: 't_start' must be null or a finite number, got str 'soon'"),
    "t_end-nan": (_entry(t_end=float("nan")), r"entry 1: 't_end' must be null or a finite number, got float nan"),
    "t_start-huge": (_entry(t_start=10 ** 400), r"entry 1: 't_start' must be null or a finite number, got int 1000"),
    "time-huge": (_field(time=10 ** 400), r"'time' must be a finite number, got int 1000"),
    "op": (_entry(op=None), r"entry 1: 'op' must be a str, got NoneType None"),
    "groups": (_field(groups=[{"name": "world"}]), r"group 0 has no 'ranks'"),
    "reason": (_field(reason=["x"]), r"'reason' must be a str, got list"),
}


@pytest.mark.parametrize("case", sorted(_BAD_RECORDS))
def test_analyze_refuses_a_malformed_record_with_the_right_format_naming_file_and_field(case, tmp_path, capsys):
    edit, message = _BAD_RECORDS[case]
    folder = _write_records(tmp_path / "t", _record(0), raw={"rank1.json": json.dumps(edit(_record(1)))})
    code, out, err, took = _analyze(folder, capsys)
    import re
    assert code == 2 and out == "", (code, out, err)
    assert re.search(rf"^meshkit\.debug: analyze: .*rank1\.json is not a valid flight record: {message}", err), err
    assert took < 5


def test_analyze_refuses_records_of_two_jobs_and_two_files_of_one_rank(tmp_path, capsys):
    folder = _write_records(tmp_path / "t", _record(0), _record(1, world=3))
    code, _, err, _ = _analyze(folder, capsys)
    assert code == 2 and "rank1.json says a world of 3 ranks, but" in err and "rank0.json one of 2" in err, err
    folder = _write_records(tmp_path / "u", _record(0), _record(1), raw={"rank01.json": json.dumps(_record(1))})
    code, _, err, _ = _analyze(folder, capsys)
    assert code == 2 and "rank01.json and" in err and "rank1.json both hold the record of rank 1" in err, err


def test_analyze_refuses_json_nested_too_deeply(tmp_path, capsys):
    folder = _write_records(tmp_path / "t", _record(0), raw={"rank1.json": "[" * 100_000})
    code, _, err, _ = _analyze(folder, capsys)
    assert code == 2 and "rank1.json is not a flight record: its JSON is nested too deeply" in err, err


@pytest.mark.parametrize("plant", ["fifo", "dev-zero", "folder"])
def test_analyze_refuses_a_record_that_is_not_a_regular_file_planted_by_another_user(plant, shared_dir, capsys):
    """The trace folder is shared (sticky, world-writable); another user plants rank1.json as a
    FIFO (opening one waits for a writer: analyze hung), a symlink to /dev/zero (read without
    end), or a folder."""
    _write_records(shared_dir, _record(0))
    planted = shared_dir / "rank1.json"
    if plant == "fifo":
        _outsider("mkfifo", str(planted))
    elif plant == "dev-zero":
        _outsider("ln", "-s", "/dev/zero", str(planted))
    else:
        _outsider("mkdir", str(planted))
    kind = {"fifo": "a FIFO", "dev-zero": "a character device", "folder": "a directory"}[plant]
    code = None
    try:
        code, out, err, took = _analyze(shared_dir, capsys)
    finally:
        if code is None:
            _open_fifo_for_writing(planted)()
    assert code == 2 and f"rank1.json is not a regular file ({kind})" in err, (code, err)


def test_analyze_reads_at_most_the_cap_of_a_record_naming_the_variable(tmp_path, capsys, monkeypatch):
    folder = _write_records(tmp_path / "t", _record(0), _record(1, reason="x" * 5000))
    monkeypatch.setenv("MESHKIT_DEBUG_MAX_RECORD_BYTES", "4096")
    code, _, err, _ = _analyze(folder, capsys)
    assert code == 2 and "rank1.json is larger than 4096 bytes (MESHKIT_DEBUG_MAX_RECORD_BYTES); set that " \
                         "variable higher to read it" in err, err
    monkeypatch.setenv("MESHKIT_DEBUG_MAX_RECORD_BYTES", "-3")
    code, _, err, _ = _analyze(folder, capsys)
    assert code == 2 and "MESHKIT_DEBUG_MAX_RECORD_BYTES='-3' is not valid; valid values are a positive number " \
                         "of bytes" in err, err
    monkeypatch.setenv("MESHKIT_DEBUG_MAX_RECORD_BYTES", "1000000")
    assert _analyze(folder, capsys)[0] == 0


def test_analyze_prints_escape_sequences_and_control_characters_from_records_escaped(tmp_path, capsys):
    evil = "all_reduce\x1b[2J\x1b]0;pwned\x07\r\u202e\ud800"
    group = "world\x1b[31m"
    doc0 = _record(0, reason="CollectiveTimeout: \x1b[5mblink\x1b[0m\nsecond line")
    doc0["groups"][0]["name"] = group
    for e in doc0["entries"]:
        e["op"], e["group"] = evil, group
    folder = _write_records(tmp_path / "t", doc0, raw={"rank1\x1b[2J.json": json.dumps({"format": "other"})})
    code, out, err, _ = _analyze(folder, capsys)
    assert code == 2 and "\x1b" not in err and "rank1\\x1b[2J.json is not a flight record" in err, err
    (folder / "rank1\x1b[2J.json").unlink()
    code, out, err, _ = _analyze(folder, capsys)
    assert code == 0, err
    assert not any(c in out for c in "\x1b\x07\r\u202e\ud800"), repr(out)
    assert "all_reduce\\x1b[2J\\x1b]0;pwned\\x07\\r\\u202e\\ud800 #1 on group world\\x1b[31m" in out, out
    assert "CollectiveTimeout: \\x1b[5mblink\\x1b[0m" in out and "second line" not in out


def test_analyze_is_near_linear_in_the_records(tmp_path, capsys):
    """Rank 0 entered 3000 calls, each on a group of its own that rank 1 (whose record holds 3000
    other calls) never entered: each group's finding looked up rank 1's last call anew (3000 x
    3000: 1.3 s, 100x that for 10x the calls); and a world of 2**31-1 ranks listed every absent
    rank (a MemoryError after 15 s with 4 GB)."""
    world = 2 ** 31 - 1
    e = 3000
    started_entry = {"seq": 0, "op": "all_reduce", "shapes": [[4]], "dtype": "float32", "state": "started",
                     "t_scheduled": 100.0, "t_start": 100.0, "t_end": None, "error": None}
    doc0 = _record(0, world=world, groups=[], entries=[
        {**started_entry, "group": f"g{k}", "ranks": [0, 1, 2 + k]} for k in range(e)])
    doc1 = _record(1, world=world, groups=[], entries=[
        {**started_entry, "state": "completed", "t_end": 100.1, "group": "h", "ranks": [1, 2], "seq": k}
        for k in range(e)])
    folder = _write_records(tmp_path / "t", doc0, doc1)
    code, out, err, took = _analyze(folder, capsys, within=60)
    assert code == 0, err
    assert f"no record from ranks 2..{world - 1}" in out
    assert out.count("MISSING: ranks [1, ") == e
    assert took < 3.0, took  # 0.3-0.5 s here


# =========================================================================== MESHKIT_TRACE_DIR
def _init_with_trace_dir(monkeypatch, value) -> str | None:
    """init_process_group with MESHKIT_TRACE_DIR=value on the local engine: its error text, or None."""
    monkeypatch.setenv("MESHKIT_TRACE_DIR", str(value))
    try:
        local.run(lambda: None, 1)
    except DistValueError as exc:
        return str(exc)
    return None


def test_a_missing_trace_dir_is_made_0700_at_init(tmp_path, monkeypatch):
    folder = tmp_path / "traces"
    old = os.umask(0o022)
    try:
        assert _init_with_trace_dir(monkeypatch, folder) is None
    finally:
        os.umask(old)
    assert folder.is_dir() and stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_a_trace_dir_that_is_a_file_is_refused_at_init(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    text = _init_with_trace_dir(monkeypatch, tmp_path / "file")
    assert text is not None and "MESHKIT_TRACE_DIR=" in text and "exists and is not a folder" in text, text


def test_a_trace_dir_planted_by_another_user_is_refused_at_init(shared_dir, monkeypatch):
    """In a shared folder, another user makes the trace folder's name a folder of theirs, or a
    symlink (theirs) to one: the ranks would write their records where that user reads them."""
    if not AS_NOBODY:
        pytest.skip("needs another user (root and setpriv): a folder of this user's is the user's to use")
    _outsider("mkdir", str(shared_dir / "theirs"))
    _outsider("ln", "-s", str(shared_dir / "theirs"), str(shared_dir / "link"))
    text = _init_with_trace_dir(monkeypatch, shared_dir / "theirs")
    assert text is not None and f"is owned by uid {NOBODY}, not this user (uid 0)" in text, text
    text = _init_with_trace_dir(monkeypatch, shared_dir / "link")
    assert text is not None and f"is a symbolic link owned by uid {NOBODY}" in text, text


_UNUSABLE = """
import os, sys
from meshkit.comm import env
from meshkit.comm.errors import DistValueError
for value in sys.argv[1:]:
    os.environ["MESHKIT_TRACE_DIR"] = value
    try:
        env.trace_dir()
    except DistValueError as exc:
        print(exc)
    else:
        print("accepted")
"""


def test_a_trace_dir_this_user_cannot_write_is_refused(shared_dir):
    """A parent folder not writable (the trace folder cannot be made), and a folder of one's own
    that is not writable. Root may write anywhere, so as root the check runs as nobody (one
    process), against root's folder and a folder of nobody's own; else as this user."""
    locked = shared_dir / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if AS_NOBODY:
        _outsider("sh", "-c", f"mkdir {shared_dir}/ro && chmod 555 {shared_dir}/ro")
    else:
        (shared_dir / "ro").mkdir()
        (shared_dir / "ro").chmod(0o555)
    prefix = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] if AS_NOBODY else []
    proc = subprocess.run([*prefix, sys.executable, "-c", _UNUSABLE, str(locked / "new"), str(shared_dir / "ro")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    made, written = proc.stdout.splitlines()
    assert "MESHKIT_TRACE_DIR=" in made and "cannot be made: [Errno 13] Permission denied" in made, made
    assert "MESHKIT_TRACE_DIR=" in written and written.endswith("it is not writable by this user"), written


def test_a_flight_record_is_written_0600_never_through_a_symlink_planted_in_a_shared_trace_dir(shared_dir,
                                                                                          monkeypatch):
    """The trace folder is the user's, but others may write in it (sticky, world-writable): another
    user plants symlinks to a file of the user's at rank0.json and at the temporary name the rank
    writes first (guessed here: it is random). The rank's record replaces the planted rank0.json,
    never writing through either link, and is readable by the user alone."""
    from meshkit.comm.groups import world as world_module

    victim = shared_dir / "victim"
    victim.write_text("precious")
    _outsider("ln", "-s", str(victim), str(shared_dir / "rank0.json"))
    _outsider("ln", "-s", str(victim), str(shared_dir / "rank0.json.guessed.tmp"))
    real = getattr(world_module, "_partial_name", None)
    guesses = iter([str(shared_dir / "rank0.json.guessed.tmp")])
    monkeypatch.setattr(world_module, "_partial_name", lambda path: next(guesses, None) or real(path), raising=False)
    monkeypatch.setenv("MESHKIT_TRACE_DIR", str(shared_dir))

    def job():
        if meshkit.get_rank() == 0:
            meshkit.all_reduce(np.ones(2))  # rank 1 leaves without calling: rank 0 fails and writes its record

    with pytest.raises(meshkit.comm.RankFailedError):
        local.run(job, 2, timeout=5)
    record = shared_dir / "rank0.json"
    assert victim.read_text() == "precious"
    assert not record.is_symlink() and record.stat().st_uid == os.geteuid()
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    assert json.loads(record.read_text())["rank"] == 0
    assert sorted(p.name for p in shared_dir.iterdir()) == ["rank0.json", "rank0.json.guessed.tmp", "victim"]
