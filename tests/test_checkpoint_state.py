"""State dicts stay current (issue 23.1) and hold what torch's do (23.9); replicated copies agree
and read-only destinations are named (23.8)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import checkpoint_state_cases as cases
import meshkit
from meshkit import checkpoint as dcp
from meshkit.checkpoint import CheckpointError
from meshkit.comm import local
from meshkit.parallel import AdamW, StepCount, ZeroRedundancyOptimizer
from meshkit.tensor import DTensor, Replicate, Shard


@pytest.mark.parametrize("how", cases.SAVES)
@pytest.mark.parametrize("pattern", cases.PATTERNS)
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
@pytest.mark.parametrize("kind", cases.KINDS)
def test_resuming_equals_training_on_however_the_state_dict_was_built(kind, opt, pattern, how, tmp_path):
    got = local.run(lambda: cases.resume(kind, opt, pattern, how, tmp_path), 4 if kind == "hsdp" else 2)[0]
    cases.check(got, opt, tmp_path, f"{kind} {opt} {pattern} {how}")


def test_resuming_a_state_dict_built_once_on_real_processes(tmp_path):
    from conftest import launch
    launch("mpi_checkpoint_resume.py", 2, str(tmp_path), "first", timeout=120)
    proc = launch("mpi_checkpoint_resume.py", 2, str(tmp_path), "resume", timeout=120)
    assert proc.stdout.count("RESUMED OK") == 2, proc.stdout


# --------------------------------------------------------------------------- step counts read through
def test_a_step_count_reads_and_sets_its_optimizer():
    opt, w = AdamW(lr=0.1), np.ones(3)
    _, optim = dcp.get_state_dict({"w": w}, opt)
    count = optim["step"]["w"]
    assert isinstance(count, StepCount) and count == 0 and repr(count) == "StepCount(0)"
    opt.step({"w": w}, {"w": np.ones(3)})
    assert count == 1 and int(count) == 1 and [0, 1, 2][count] == 1
    count.set(5)
    assert opt.steps["w"] == 5
    opt.steps.update(optim["step"])  # as code written for int counts does: the count now, never the leaf
    assert type(opt.steps["w"]) is int and count == 5
    with pytest.raises(ValueError, match=r"a step count must be an int >= 0, got -1"):
        count.set(-1)
    with pytest.raises(TypeError, match="unhashable"):
        hash(count)


@pytest.mark.parametrize("steps, message", [
    ({"a": 3, "b": 4}, r"keys 'optim.step.b' and 'optim.step.a' are one step count of this optimizer \(their "
                       r"parameters share a flat shard\), but the checkpoint at .* has 4 and 3"),
    ({"a": 3, "b": -2}, r"key 'optim.step.b': the checkpoint at .* has -2, a step count must be an int >= 0"),
], ids=["disagree", "negative"])
def test_step_counts_a_flat_shard_shares_must_agree_before_anything_is_loaded(steps, message, tmp_path):
    def save():
        params, opt = {"a": np.ones(4), "b": np.ones(2)}, AdamW(lr=0.1)
        model, optim = dcp.get_state_dict(params, opt)
        opt.steps.update(a=steps["a"], b=max(steps["b"], 0))
        dcp.save({"model": model, "optim": optim}, checkpoint_id=tmp_path / "ck")

    local.run(save, 1)
    if steps["b"] < 0:  # what no optimizer holds: a corrupt (or hand-made) checkpoint's count
        from meshkit.checkpoint.format import write_metadata
        meta = json.loads((tmp_path / "ck" / "metadata.json").read_text())
        meta["values"]["optim.step.b"] = steps["b"]
        for name in ("metadata.json", "metadata.json.xxh3_64"):  # (written exclusively, as a save writes them)
            (tmp_path / "ck" / name).unlink()
        write_metadata(tmp_path / "ck", meta)

    def body():
        zero = ZeroRedundancyOptimizer({"a": np.zeros(4), "b": np.zeros(2)}, AdamW(lr=0.1), stage=1)
        model, optim = dcp.get_state_dict(zero)
        with pytest.raises(CheckpointError, match=message):
            dcp.load({"model": model, "optim": optim}, checkpoint_id=tmp_path / "ck")
        assert not zero.params["a"].any() and zero.optimizer.steps == {"float64": 0}  # nothing loaded

    local.run(body, 2)


# --------------------------------------------------------------------------- 23.9: lists, tuples, dotted keys
def test_lists_and_tuples_of_arrays_nest_by_index(tmp_path):
    def state(fill):
        return {"buffers": [np.arange(3.0) * fill, np.full((2, 2), fill)], "pair": (np.full(2, fill), np.ones(1)),
                "param_groups": [{"lr": 0.1 * fill, "params": ["w", "b"]}, {"lr": 0.01 * fill, "params": ["c"]}]}

    def body():
        dcp.save(state(2.0), checkpoint_id=tmp_path / "ck")
        out = state(0.0)
        dcp.load(out, checkpoint_id=tmp_path / "ck")
        return out

    out = local.run(body, 2)[0]
    want = state(2.0)
    assert [g["lr"] for g in out["param_groups"]] == [0.2, 0.02] and out["param_groups"][1]["params"] == ["c"]
    for got, expected in zip([*out["buffers"], *out["pair"]], [*want["buffers"], *want["pair"]]):
        np.testing.assert_array_equal(got, expected)
    meta = json.loads((tmp_path / "ck" / "metadata.json").read_text())
    assert sorted(meta["arrays"]) == ["buffers.0", "buffers.1", "pair.0", "pair.1"]
    assert meta["values"]["param_groups.1.lr"] == 0.02


def test_a_key_containing_a_dot_is_not_the_nested_key(tmp_path):
    def body():
        dcp.save({"a.b": np.full(2, 1.0), "a": {"b": np.full(2, 2.0)}, "c\\": 3}, checkpoint_id=tmp_path / "ck")
        out = {"a.b": np.zeros(2), "a": {"b": np.zeros(2)}, "c\\": 0}
        dcp.load(out, checkpoint_id=tmp_path / "ck")
        with pytest.raises(CheckpointError, match=r"key 'x\.y' is missing in the checkpoint"):
            dcp.load({"x": {"y": np.zeros(2)}}, checkpoint_id=tmp_path / "ck2")
        return out

    def save_dotted():
        dcp.save({"x.y": np.ones(2)}, checkpoint_id=tmp_path / "ck2")

    local.run(save_dotted, 2)
    out = local.run(body, 2)[0]
    assert out["a.b"].tolist() == [1.0, 1.0] and out["a"]["b"].tolist() == [2.0, 2.0] and out["c\\"] == 3
    meta = json.loads((tmp_path / "ck" / "metadata.json").read_text())
    assert sorted(meta["arrays"]) == ["a.b", "a\\.b"] and list(meta["values"]) == ["c\\\\"]


def test_a_version_2_checkpoint_with_dotted_keys_still_loads(tmp_path):
    """Version 2 joined keys without escaping: its keys are read as it wrote them."""
    from meshkit.checkpoint.format import write_metadata
    local.run(lambda: dcp.save({"model": {"layer.0": np.arange(4.0)}}, checkpoint_id=tmp_path / "ck"), 2)
    meta = json.loads((tmp_path / "ck" / "metadata.json").read_text())
    meta["version"], meta["arrays"] = 2, {k.replace("\\.", "."): v for k, v in meta["arrays"].items()}
    for name in ("metadata.json", "metadata.json.xxh3_64"):  # (written exclusively, as a save writes them)
        (tmp_path / "ck" / name).unlink()
    write_metadata(tmp_path / "ck", meta)

    def body():
        out = {"model": {"layer.0": np.zeros(4)}}
        dcp.load(out, checkpoint_id=tmp_path / "ck")
        with pytest.raises(CheckpointError, match=r"the entries at \['model', 'layer.0'\] and \['model', 'layer', "
                                                  r"'0'\] both read the key 'model.layer.0' of this checkpoint"):
            dcp.load({"model": {"layer.0": np.zeros(4), "layer": [np.zeros(4)]}}, checkpoint_id=tmp_path / "ck")
        return out["model"]["layer.0"]

    assert local.run(body, 2)[0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_value_inside_a_tuple_that_would_change_is_refused(tmp_path):
    local.run(lambda: dcp.save({"pair": (np.ones(2), "tag")}, checkpoint_id=tmp_path / "ck"), 1)

    def body():
        out = {"pair": (np.zeros(2), "other")}
        with pytest.raises(CheckpointError, match=r"key 'pair.1' is in a tuple, whose items cannot be replaced"):
            dcp.load(out, checkpoint_id=tmp_path / "ck")
        assert not out["pair"][0].any()
        same = {"pair": (np.zeros(2), "tag")}
        dcp.load(same, checkpoint_id=tmp_path / "ck")
        assert same["pair"][0].tolist() == [1.0, 1.0]

    local.run(body, 2)


# --------------------------------------------------------------------------- 23.8: read-only destinations
def test_loading_into_a_read_only_array_names_the_key_on_every_rank(tmp_path):
    local.run(lambda: dcp.save({"w": np.arange(4.0), "v": np.ones(2)}, checkpoint_id=tmp_path / "ck"), 2)

    def body():
        w, v = np.zeros(4), np.zeros(2)
        if meshkit.get_rank() == 1:
            w.flags.writeable = False
        with pytest.raises(CheckpointError, match=r"rank 1: load: 'w': the array to load into is read-only "
                                                  r"\(flags.writeable is False\).*nothing was loaded"):
            dcp.load({"v": v, "w": w}, checkpoint_id=tmp_path / "ck")
        assert not v.any() and not w.any()

    local.run(body, 2)


# --------------------------------------------------------------------------- 23.8: replicated copies agree
@pytest.mark.parametrize("how", ["array", "dtensor"])
def test_replicated_copies_that_differ_fail_the_save_on_every_rank(how, tmp_path):
    """Differing ints are refused (a value is saved once); so are differing copies of an array."""
    def body():
        rank = meshkit.get_rank()
        x = np.arange(6.0).reshape(2, 3) + (rank == 2)  # rank 2's copy differs
        if how == "dtensor":
            mesh = meshkit.init_device_mesh("cpu", (2, 2))
            x = DTensor.from_local(x[:, :2] if mesh.get_coordinate()[1] == 0 else x[:, 2:], mesh,
                                   [Replicate(), Shard(1)], shape=(2, 3))
        with pytest.raises(CheckpointError, match=r"'model.x' is replicated, but ranks \[0(, 1)?\] vs \[2\] hold "
                                                  r"different copies.*broadcast it from one rank"):
            dcp.save({"model": {"x": x, "same": np.ones(2)}}, checkpoint_id=tmp_path / "ck")
        dcp.save({"model": {"same": np.ones(2)}}, checkpoint_id=tmp_path / "ok")  # equal copies save

    local.run(body, 3 if how == "array" else 4)
    assert not (tmp_path / "ck").exists() and (tmp_path / "ok").exists()


# --------------------------------------------------------------------------- a dict built once, state loaded by other means
@pytest.mark.parametrize("how", ["optimizer.load_state_dict", "load_full_state_dict"])
def test_a_dict_built_once_sees_state_loaded_without_it(how, tmp_path):
    """``opt.load_state_dict`` and ``load_full_state_dict`` write into the arrays the dict views."""
    def body():
        params = {"a": np.ones(4), "b": np.ones(2)}
        if how == "optimizer.load_state_dict":
            strategy, opt = params, AdamW(lr=0.1)
            state = dcp.get_state_dict(strategy, opt)
            donor = AdamW(lr=0.1)
            for _ in range(2):
                donor.step({k: v.copy() for k, v in params.items()}, {k: np.full_like(v, 0.5) for k, v in params.items()})
            opt.load_state_dict(donor.state_dict())
        else:
            strategy, opt = ZeroRedundancyOptimizer(params, AdamW(lr=0.1), stage=1), None
            state = dcp.get_state_dict(strategy)
            donor = ZeroRedundancyOptimizer({k: v.copy() for k, v in params.items()}, AdamW(lr=0.1), stage=1)
            for _ in range(2):
                donor.zero_grad()
                for k, v in params.items():
                    donor.mark_grad_ready(k, np.full_like(v, 0.5))
                donor.step()
            strategy.load_full_state_dict(donor.full_state_dict())
        dcp.save({"model": state[0], "optim": state[1]}, checkpoint_id=tmp_path / "ck")
        out = {"model": {k: np.zeros_like(v) for k, v in params.items()},
               "optim": {"state": {k: {"exp_avg": np.zeros_like(v), "exp_avg_sq": np.zeros_like(v)} for k, v in
                                   params.items()}, "step": {k: 0 for k in params}}}
        dcp.load(out, checkpoint_id=tmp_path / "ck")
        return out

    out = local.run(body, 2)[0]
    assert out["optim"]["step"] == {"a": 2, "b": 2}
    assert out["optim"]["state"]["a"]["exp_avg"].tolist() == pytest.approx([0.5 * (1 - 0.9 ** 2)] * 4)


# --------------------------------------------------------------------------- a corrupt newest checkpoint (issue 36.5)
def _flip_a_byte(path):
    f = path / "data-00001.bin"
    raw = bytearray(f.read_bytes())
    raw[5] ^= 0x10
    f.write_bytes(bytes(raw))


def _remove_a_data_file(path):
    (path / "data-00000.bin").unlink()


def _train_save_twice(directory, kind="fsdp", opt="adamw"):
    """Steps 0-2, ``CheckpointManager.save(3)``, steps 3-5, ``save(6)``: an elastic job's history."""
    manager, run = dcp.CheckpointManager(directory, max_to_keep=2), cases.Run(kind, opt)
    state = run.state()
    for step in range(6):
        run.step(step)
        if step in (2, 5):
            manager.save(step + 1, state)


def _resume_from_the_newest_that_verifies(directory, kind="fsdp", opt="adamw"):
    """What a restarted job does: restore, then train on to step 6 and save it."""
    manager, run = dcp.CheckpointManager(directory, max_to_keep=2), cases.Run(kind, opt)
    state = run.state()
    start = manager.restore(state)
    run.take(state)
    for step in range(start, 6):
        run.step(step)
    manager.save(6, state)
    return start, run.params(), manager.all_steps()


@pytest.mark.parametrize("corrupt, reason", [
    (_flip_a_byte, r"data-00001.bin': checksum mismatch in the chunk of '[^']+' at offsets"),
    (_remove_a_data_file, r"data file '.*step_6/data-00000.bin' is missing"),
], ids=["flipped-byte", "missing-data-file"])
def test_a_corrupt_newest_checkpoint_is_skipped_on_every_rank_and_the_next_resumes_exactly(corrupt, reason,
                                                                                          tmp_path, caplog):
    local.run(lambda: _train_save_twice(tmp_path), 2)
    corrupt(tmp_path / "step_6")
    with caplog.at_level("WARNING", logger="meshkit.checkpoint"):
        results = local.run(lambda: _resume_from_the_newest_that_verifies(tmp_path), 2)
    for start, params, steps in results:
        assert start == 3 and steps == [3, 6]  # the resumed run's own step 6 replaced the corrupt one
        cases.check(params, "adamw", tmp_path, "fsdp resumed from step 3")
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 2 and skipped[0] == skipped[1], skipped  # one warning a rank, the same text
    import re
    assert re.search(r"CheckpointManager.restore: skipped step 6 in '.*': it does not load \(", skipped[0])
    assert re.search(reason, skipped[0]), skipped[0]
    assert re.search(r"restored step 3 instead; step 6 is kept as '.*step_6\.skipped-[0-9a-f]{8}'", skipped[0])
    aside = [p.name for p in tmp_path.iterdir() if p.name.startswith("step_6.skipped-")]
    assert len(aside) == 1  # kept for inspection, out of the way of the next save of step 6


def test_restore_refuses_instead_when_asked_and_when_no_checkpoint_loads(tmp_path):
    """``fallback=False`` raises the newest one's error; with every checkpoint corrupt, restore
    raises naming each (a silent start from scratch would lose the run), renaming none."""
    local.run(lambda: _train_save_twice(tmp_path), 2)
    _flip_a_byte(tmp_path / "step_6")

    def restore(fallback):
        state = cases.Run("fsdp", "adamw").state()
        try:
            dcp.CheckpointManager(tmp_path, fallback=fallback).restore(state)
        except CheckpointError as exc:
            return str(exc)

    for text in local.run(lambda: restore(False), 2):
        assert "step_6/data-00001.bin': checksum mismatch" in text and "nothing was loaded" in text, text
    _remove_a_data_file(tmp_path / "step_3")
    for text in local.run(lambda: restore(True), 2):
        assert text.startswith("meshkit.checkpoint: rank ") and "CheckpointManager.restore: none of the 2 " \
            "checkpoints in" in text and "loads, each is kept: step 6: " in text, text
        assert "checksum mismatch" in text and "; step 3: " in text and "step_3/data-00000.bin' is missing" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "step_6"]
    with pytest.raises(CheckpointError, match="CheckpointManager: fallback must be True or False, got 'no'"):
        local.run(lambda: dcp.CheckpointManager(tmp_path, fallback="no"), 1)
