"""Buddy copies renewed every K steps (``MESHKIT_BUDDY_EVERY``), and the steps since replayed after a failure, in-process.

On the local engine (threads as ranks) with ``MESHKIT_SURVIVE`` set as ``meshkit-run --survive``
sets it: a strategy trains t steps, a rank is taken away, the survivors' contributions assemble
the state at the last renewal (the newest step at which every shard is held), and the survivors'
world, built anew, loads it and replays the steps since: the final parameters equal single-process
training (1e-10 for float64) for a failure at every offset within K, within a node and by message,
and for two failures in a row. HSDP's replicate dimension holds a lost shard live: no rollback.
The setting is validated and must agree across the shard group (comm's agree: every rank raises). Under the launcher, every job of
tests/test_survive_launch.py runs at the default K (one at K=1).
"""

from __future__ import annotations

import numpy as np
import pytest

import sharded_cases
from meshkit import comm
from meshkit.comm import DistValueError, local
from meshkit.parallel import buddy

KIND = "adamw"
TOTAL = 10  # steps of the whole run, against single-process training of as many


def _train(strategy: str, world: int, steps: range, state=None, mesh_shape=None, every=None):
    """``world`` ranks train ``steps`` from ``state`` (then renewing at once, as survive.shrink does); each
    rank's contribution, the full state, the layouts, the hyperparameters and the buddy copy."""
    def body():
        held = []

        def setup(model):
            held.append(model)
            if every is not None:
                model.shards.buddy.every, model.shards.buddy.auto = every[comm.get_rank()], False
            if state is not None:
                model.shards.after_step(force=True)
        if strategy == "fsdp":
            full, _ = sharded_cases.train_fsdp(KIND, mesh_shape=mesh_shape, steps=steps, state=state, setup=setup)
        else:
            full, _ = sharded_cases.STRATEGIES[strategy](KIND, steps=steps, state=state, setup=setup)
        model = held[0]
        return (buddy.contribution(model, comm.get_rank()), full, model._layouts(), dict(model.optimizer.hyper),
                model.shards.buddy, model.memory_report())
    return local.run(body, world)


def _lose(out, dead: list[int]):
    """The state the survivors of ``out`` assemble once ``dead`` (ranks of that world) are gone, and its step;
    as survive.shrink does it too (the step counts first, then each shard chosen from one survivor): the same."""
    survivors = [o[0] for r, o in enumerate(out) if r not in dead]
    layouts, hyper = out[0][2], out[0][3]
    state, step, _ = buddy.assemble(layouts, survivors, hyper, dead)
    picked, chosen = buddy.choose(layouts[0].shards, [c.skeleton() for c in survivors], dead)
    assert picked == step and all(not h.arrays for h in chosen.values())
    given = [c.arrays_of(chosen) for c in survivors]
    assert sorted(i for g in given for i in g) == list(range(layouts[0].shards))  # each shard moves once
    for g in given:
        for i, arrays in g.items():
            chosen[i].arrays = arrays
    joined = buddy.join(layouts, chosen, hyper)
    for name, value in state["model"].items():
        np.testing.assert_array_equal(joined["model"][name], value)
    assert joined["optim"]["step"] == state["optim"]["step"]
    return state, step


@pytest.mark.parametrize("strategy, shared", [("zero2", "1"), ("fsdp", "1"), ("zero1", "0")],
                         ids=["zero2", "fsdp", "zero1-by-message"])
def test_a_failure_at_every_offset_within_k_rolls_back_to_the_renewal_and_replays_exactly(strategy, shared,
                                                                                          monkeypatch):
    monkeypatch.setenv("MESHKIT_SURVIVE", "1")
    monkeypatch.setenv("MESHKIT_BUDDY_SHM", shared)
    monkeypatch.setenv("MESHKIT_BUDDY_EVERY", "4")
    reference = sharded_cases.reference(KIND, steps=TOTAL)
    for done in range(4, 8):  # the failure 0..3 steps after the renewal at step 4
        out = _train(strategy, 4, range(done))
        copy, report, own = out[0][4], out[0][5], sum(int(a.nbytes) for a in out[0][0].held[0].arrays.values())
        assert copy.every == 4 and copy.refreshes == 2  # after steps 1 and 4 only
        assert report["buddy"] == copy.nbytes >= 2 * own  # two shards' worth: two slots, or a snapshot and a copy
        dead = done % 4  # a different rank each time
        state, step = _lose(out, [dead])
        assert step == 4, (done, step)  # the lost shard is held at the renewal only: every survivor rolls back
        params = _train(strategy, 3, range(step, TOTAL), state=state)[0][1]["model"]
        sharded_cases.assert_matches(params, reference, f"{strategy}, rank {dead} lost after step {done}")


def test_two_failures_in_a_row_each_roll_back_and_the_result_is_exact(monkeypatch):
    monkeypatch.setenv("MESHKIT_SURVIVE", "2")
    monkeypatch.setenv("MESHKIT_BUDDY_EVERY", "3")
    out = _train("fsdp", 4, range(5))  # renewals after steps 1 and 3
    state, step = _lose(out, [1])
    assert step == 3
    out = _train("fsdp", 3, range(step, 8), state=state)  # renewed at 3 (the shrink) and 6
    assert out[0][4].refreshes == 2
    state, step = _lose(out, [0])
    assert step == 6
    params = _train("fsdp", 2, range(step, TOTAL), state=state)[0][1]["model"]
    sharded_cases.assert_matches(params, sharded_cases.reference(KIND, steps=TOTAL), "fsdp after two failures")


def test_hsdp_takes_a_lost_shard_live_from_its_replica_not_the_renewal(monkeypatch):
    monkeypatch.setenv("MESHKIT_SURVIVE", "1")
    monkeypatch.setenv("MESHKIT_BUDDY_EVERY", "4")
    out = _train("fsdp", 4, range(6), mesh_shape=(2, 2))
    state, step = _lose(out, [3])
    assert step == 6  # rank 1 of the other replica holds rank 3's shard at step 6: nothing to replay
    assert state["optim"]["step"] == out[0][1]["optim"]["step"]


@pytest.mark.parametrize("value", ["0", "x", "10001", "-2"])
def test_a_bad_cadence_is_an_error_naming_the_variable(value, monkeypatch):
    monkeypatch.setenv("MESHKIT_BUDDY_EVERY", value)
    with pytest.raises(DistValueError, match=rf"MESHKIT_BUDDY_EVERY='{value}' is not valid; valid values are integers "
                                             r"from 1 .* to 10000 \(unset: chosen from the measured step"):
        buddy.every()


def test_unset_the_cadence_is_chosen_and_an_empty_value_is_unset(monkeypatch):
    monkeypatch.delenv("MESHKIT_BUDDY_EVERY", raising=False)
    assert buddy.every() is None
    monkeypatch.setenv("MESHKIT_BUDDY_EVERY", " ")
    assert buddy.every() is None
    monkeypatch.setenv("MESHKIT_BUDDY_EVERY", "8")
    assert buddy.every() == 8


@pytest.mark.parametrize("renewal_ms, step_ms, chosen", [
    (0.5, 2.5, 32),    # zero1 at 2 ranks here: 1-3.5% of a step at K = 8, 0.6% at 32
    (0.3, 8.7, 4),     # fsdp at 4 ranks: 0.86% at 4
    (0.05, 4.0, 2),    # a cheap renewal
    (0.001, 4.0, 1),   # nothing to save by waiting
    (1.0, 1000.0, 1),  # long steps: renewed every step, nothing replayed
    (5.0, 0.1, 64),    # a very short step: the largest cadence
    (2.0, 20.0, 8),    # share wants 16; the replay (15 x 20 ms = 0.3 s) caps it at 8 (7 x 20 = 0.14 s)
    (3.0, 100.0, 2),   # share wants 4; the replay allows 2 (0.1 s), not 4 (0.3 s)
])
def test_the_chosen_cadence_keeps_a_renewal_under_1_percent_of_a_step_and_a_replay_under_a_quarter_second(
        renewal_ms, step_ms, chosen):
    k = buddy.choose_every(renewal_ms / 1e3, step_ms / 1e3)
    assert k == chosen
    assert (k - 1) * step_ms / 1e3 <= buddy.REPLAY_SECONDS
    assert k == buddy.CHOSEN_MAX or renewal_ms <= buddy.RENEWAL_SHARE * k * step_ms or \
        (2 * k - 1) * step_ms / 1e3 > buddy.REPLAY_SECONDS  # under the share, or the replay forbids the next


def test_a_save_that_rank_0_committed_before_dying_is_skipped_by_the_replay_on_every_rank(tmp_path, monkeypatch):
    """Rank 0 commits step 7, then dies before the others' save returns: they never recorded the
    step as saved, only as begun. The replay's save of it is skipped on every rank alike (before, the
    survivors that began it saved again and failed as existing, while a rank that had recorded it
    asked rank 0 alone: a collective on some ranks only)."""
    import meshkit
    from meshkit.checkpoint import CheckpointManager
    from meshkit.checkpoint import manager as manager_module
    from meshkit.comm import RankFailedError

    survived, real_save = [0], manager_module.save
    monkeypatch.setattr(manager_module, "recoveries", lambda: survived[0])

    def save_then_lose_rank_0(state, checkpoint_id, group):
        real_save(state, checkpoint_id=checkpoint_id, group=group)  # committed: rank 0 renamed it in place
        if group.rank != 0:
            raise RankFailedError("rank 0 died after committing, before telling the others")

    monkeypatch.setattr(manager_module, "save", save_then_lose_rank_0)

    def body():
        manager = CheckpointManager(tmp_path / "ckpt")
        state = {"w": np.arange(4.0)}
        try:
            manager.save(7, state)
        except RankFailedError:
            assert meshkit.get_rank() != 0
        before = (tmp_path / "ckpt" / "step_7").stat().st_mtime_ns
        meshkit.barrier()
        if meshkit.get_rank() == 0:
            survived[0] = 1
        meshkit.barrier()
        manager.save(7, state)  # the replay: skipped on every rank, none refused as existing
        assert (tmp_path / "ckpt" / "step_7").stat().st_mtime_ns == before
        return manager.all_steps()

    assert local.run(body, 3) == [[7]] * 3


@pytest.mark.parametrize("strategy, world, mesh_shape", [("zero2", 2, None), ("fsdp", 2, None), ("fsdp", 4, (2, 2))],
                         ids=["zero2", "fsdp", "hsdp"])
def test_unset_the_cadence_is_chosen_once_from_the_slowest_ranks_figures_alike_on_every_rank(strategy, world, mesh_shape,
                                                                                          monkeypatch):
    """Unset, the copy renews after step 1 and at multiples of 8 while it measures, then at the chosen
    cadence: chosen at the first renewal after 4 measured steps that set nothing up (step 8), from one
    MAX all-reduce of (renewal, median step), so every rank picks the same K from the same figures."""
    monkeypatch.setenv("MESHKIT_SURVIVE", "1")
    monkeypatch.delenv("MESHKIT_BUDDY_EVERY", raising=False)
    calls = []
    monkeypatch.setattr(buddy, "choose_every", lambda renewal, step: calls.append((renewal, step)) or 3)
    out = _train(strategy, world, range(20), mesh_shape=mesh_shape)
    copies = [o[4] for o in out]
    assert [list(c.renewed) for c in copies] == [[1, 8, 9, 12, 15, 18]] * world
    assert [(c.every, c.auto) for c in copies] == [(3, False)] * world
    # once per rank, from its shard group's MAX: the ranks of a group computed from the same figures
    assert len(calls) == world and len(set(calls)) == world // 2 and all(v > 0 for c in calls for v in c), calls
    # the result is the plain run's: the cadence changes when copies are taken, not what is trained
    monkeypatch.delenv("MESHKIT_SURVIVE")
    plain = _train(strategy, world, range(20), mesh_shape=mesh_shape)
    assert all(np.array_equal(a, b) for a, b in zip(_flat(out[0][1]), _flat(plain[0][1])))


def _flat(state):
    """Every array of a full state dict, in a fixed order."""
    model, optim = state["model"], state["optim"]["state"]
    return [model[k] for k in sorted(model)] + [optim[n][k] for n in sorted(optim) for k in sorted(optim[n])]


def test_a_cadence_that_differs_across_the_group_is_an_error_naming_each_ranks_value(monkeypatch):
    monkeypatch.setenv("MESHKIT_SURVIVE", "1")
    with pytest.raises(DistValueError, match=r"MESHKIT_BUDDY_EVERY differs across the shard group \(2 on rank 0, 3 on "
                                             r"rank 1\): set the same value on every rank"):
        _train("zero2", 2, range(2), every=[2, 3])


def test_a_replays_save_of_a_step_saved_before_the_failure_is_skipped_and_anothers_still_refused(tmp_path,
                                                                                                 monkeypatch):
    """A step saved before a failure the job survived is skipped when the replay saves it again; the
    same step saved twice with no failure in between (a loop's mistake: the second state may
    differ) is refused as before, and so is a step this manager did not save."""
    import meshkit
    from meshkit.checkpoint import CheckpointError, CheckpointManager
    from meshkit.checkpoint import manager as manager_module

    survived = [0]  # comm's count of failures survived, as meshkit.parallel.survive.shrink raises it
    monkeypatch.setattr(manager_module, "recoveries", lambda: survived[0])

    def body():
        manager = CheckpointManager(tmp_path / "ckpt")
        state = {"w": np.arange(4.0)}
        manager.save(5, state)
        before = (tmp_path / "ckpt" / "step_5").stat().st_mtime_ns
        with pytest.raises(CheckpointError, match=r"step_5' already exists; a checkpoint is never overwritten"):
            manager.save(5, {"w": np.zeros(4)})  # no failure survived since: not a replay, never skipped silently
        meshkit.barrier()
        if meshkit.get_rank() == 0:
            survived[0] = 1  # a failure survived (every rank sees it before its next save)
        meshkit.barrier()
        manager.save(5, state)  # the replay after a rollback: skipped on every rank, the step kept
        manager.async_save(5, state).result(timeout=30)
        assert (tmp_path / "ckpt" / "step_5").stat().st_mtime_ns == before and manager.all_steps() == [5]
        manager.save(6, state)  # the next step saves as usual
        with pytest.raises(CheckpointError, match=r"step_5' already exists; a checkpoint is never overwritten"):
            CheckpointManager(tmp_path / "ckpt").save(5, state)  # not this manager's: refused as before
        return manager.all_steps()

    assert local.run(body, 2) == [[5, 6]] * 2
