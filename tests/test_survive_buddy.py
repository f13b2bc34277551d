"""Buddy copies of sharded state (meshkit.parallel.buddy): which shards come from whom, in-process.

On the local engine (threads as ranks) with ``MESHKIT_SURVIVE`` set as ``meshkit-run --survive``
sets it: ZeRO-1/2, FSDP and HSDP train a few steps with AdamW, then for each rank taken away the
survivors' contributions assemble the full state exactly (bitwise equal to ``full_state_dict()``),
the lost rank's shard from the rank before it (``MESHKIT_BUDDY_EVERY=1`` here: every K steps is
tests/test_buddy_every.py); two neighbours lost is a clear error naming the shard; a lost rank's
copy one renewal behind is met at the survivors' renewal before (the segment's second slot), two
renewals behind is the same error; a slot torn mid-write is skipped for the other. Under the launcher (Open MPI's ULFM): the example's
hsdp (2x2 -> 1x3) survives a SIGKILL between steps with ``--check`` (tests/test_survive_launch.py
kills every strategy of the example twice, inside a gradient reduction and inside a save).
"""

from __future__ import annotations

import argparse
import re
import sys

import numpy as np
import pytest

import sharded_cases
from meshkit import comm
from meshkit.comm import DistValueError, local
from meshkit.parallel import buddy, buddy_shared, survive
from test_survive import EXAMPLES, launch, needs_ulfm

STEPS = range(3)
sys.path.insert(0, str(EXAMPLES))
import train_mlp  # noqa: E402  (examples/, beside mlp.py and loop.py)


def _trained(strategy: str, mesh_shape=None, steps=STEPS):
    def body():
        held = []
        if strategy == "fsdp":
            full, _ = sharded_cases.train_fsdp("adamw", mesh_shape=mesh_shape, steps=steps, setup=held.append)
        else:
            full, _ = sharded_cases.STRATEGIES[strategy]("adamw", steps=steps, setup=held.append)
        model = held[0]
        return (buddy.contribution(model, comm.get_rank()), full, model._layouts(), dict(model.optimizer.hyper),
                model.memory_report(), model.shards.buddy)
    return local.run(body, 4)


@pytest.mark.parametrize("strategy, mesh_shape, shared", [("zero1", None, "1"), ("zero2", None, "1"), ("fsdp", None, "1"),
                                                           ("fsdp", (2, 2), "1"), ("zero2", None, "0")],
                         ids=["zero1", "zero2", "fsdp", "hsdp2x2", "zero2-by-message"])
def test_any_one_rank_lost_its_shards_come_from_its_buddy_exactly(strategy, mesh_shape, shared, monkeypatch):
    monkeypatch.setenv("MESHKIT_SURVIVE", "1")
    monkeypatch.setenv("MESHKIT_BUDDY_SHM", shared)  # within a node (1): each copy in its owner's segment
    monkeypatch.setenv("MESHKIT_BUDDY_EVERY", "1")  # renewed after every step (test_buddy_every.py: every K)
    out = _trained(strategy, mesh_shape)
    assert all((o[5].mailbox is not None) == (shared == "1" and buddy_shared.supported()) for o in out)
    contributions, full, layouts, hyper = [o[0] for o in out], out[0][1], out[0][2], out[0][3]
    n = layouts[0].shards
    for rank, (c, _, lays, _, report, copy) in enumerate(out):
        own = sum(int(a.nbytes) for a in c.held[0].arrays.values())
        # within a node two slots of this rank's shards (double buffering), by message one copy of the neighbour's
        assert report["buddy"] == copy.nbytes >= (2 if shared == "1" else 1) * own > 0
        index = c.group.index(rank)
        # its own shards live, then (within a node) its own renewal before, then its copies of the neighbour's
        own_steps = [h.count for h in c.held if h.index == index]
        assert own_steps == ([len(STEPS), len(STEPS) - 1] if shared == "1" else [len(STEPS)])
        copies = [h for h in c.held if h.index != index]
        assert copy.valid and copies[0].count == len(STEPS)
        assert copies[0].index == (index + 1) % n and copies[0].owner == c.group[(index + 1) % n]
        neighbour = next(o[0] for o in out if o[0].held[0].holder == copies[0].owner)
        for key, value in neighbour.held[0].arrays.items():  # the copy is the neighbour's shards, bit for bit
            np.testing.assert_array_equal(copies[0].arrays[key], value)
    for dead in range(4):
        survivors = [c for r, c in enumerate(contributions) if r != dead]
        state, step, chosen = buddy.assemble(layouts, survivors, hyper, [dead])
        assert step == len(STEPS)
        group = contributions[dead].group
        index = group.index(dead)
        if mesh_shape is None:  # the one shard group: the dead rank's shard from the rank before it
            assert chosen[index].holder == group[(index - 1) % n] and chosen[index].owner == dead
        assert all(h.holder != dead for h in chosen.values())
        for name, value in full["model"].items():
            np.testing.assert_array_equal(state["model"][name], value)
        for name, per_key in full["optim"]["state"].items():
            for key, value in per_key.items():
                np.testing.assert_array_equal(state["optim"]["state"][name][key], value)
        assert state["optim"]["step"] == full["optim"]["step"]


def test_a_rank_and_its_buddy_both_lost_is_an_error_naming_the_shard(monkeypatch):
    monkeypatch.setenv("MESHKIT_SURVIVE", "2")
    monkeypatch.setenv("MESHKIT_BUDDY_EVERY", "1")  # no older renewal to roll back to
    out = _trained("fsdp")
    contributions, layouts, hyper = [o[0] for o in out], out[0][2], out[0][3]
    buddy.assemble(layouts, [contributions[0], contributions[2]], hyper, [1, 3])  # not neighbours: fine
    with pytest.raises(buddy.ShardsLostError, match=re.escape(
            "the loss of ranks [1, 2]: no survivor holds shard 2 of ranks [2], whose copies were on ranks [1]")):
        buddy.assemble(layouts, [contributions[0], contributions[3]], hyper, [1, 2])
    # the lost rank died between its optimizer step and its renewal (its copy one renewal behind a
    # survivor's live shards and newest renewal): the survivor's renewal before, in the other slot of
    # its segment, is the common step
    ahead = contributions[2]
    assert [h.count for h in ahead.held if h.index == 2] == [3, 2]

    def further(c):
        for h in c.held:
            if h.index == 2:
                h.steps = {k: n + 1 for k, n in h.steps.items()}
    further(ahead)
    assert buddy.assemble(layouts, [contributions[0], ahead, contributions[3]], hyper, [1])[1] == 3
    further(ahead)  # two renewals further: no step at which every shard is held
    with pytest.raises(buddy.ShardsLostError, match=r"shard 1 of ranks \[1\], whose copies were on ranks \[0\] "
                                                    r"\(held at step counts \[2, 3\] only\)"):
        buddy.assemble(layouts, [contributions[0], ahead, contributions[3]], hyper, [1])


def test_a_failure_before_the_first_step_finds_no_copy(monkeypatch):
    monkeypatch.setenv("MESHKIT_SURVIVE", "1")
    out = _trained("zero1", steps=range(0))
    assert not any(o[5].valid for o in out) and all(len(o[0].held) == 1 for o in out)
    with pytest.raises(buddy.ShardsLostError, match=r"loss of ranks \[2\]: no survivor holds shard 2 of ranks \[2\], "
                                                    r"whose copies were on ranks \[1\] at the step"):
        buddy.assemble(out[0][2], [o[0] for r, o in enumerate(out) if r != 2], out[0][3], [2])


def test_a_plain_run_keeps_no_copy_and_shrink_says_why(monkeypatch):
    monkeypatch.delenv("MESHKIT_SURVIVE", raising=False)

    def body():
        held = []
        sharded_cases.STRATEGIES["zero2"]("adamw", steps=range(1), setup=held.append)
        model = held[0]
        assert model.shards.buddy is None and "buddy" not in model.memory_report()
        with pytest.raises(DistValueError, match=rf"rank {comm.get_rank()}: ZeroRedundancyOptimizer holds sharded "
                                                 r"state and no buddy copies of it: build the strategy under "
                                                 r"meshkit-run --survive K"):
            survive.shrink(model, lambda: None)
        return True

    assert local.run(body, 2) == [True, True]


@needs_ulfm
def test_train_mlp_hsdp_survives_a_killed_rank_on_a_shrunk_mesh_with_the_exact_result():
    # rank 1 SIGKILLed after step 5 of 10; hsdp 2x2 -> 1x3 (its default mesh adapts as on a restart): rank 1's
    # shards from rank 0's buddy copy; ranks 2 and 3 share no group with rank 1 and are woken by the revoke
    result = launch("elastic_train.py", 4, str(EXAMPLES / "train_mlp.py"), "--strategy", "hsdp", "--optimizer",
                    "adamw", "--steps", "10", "--check", options=("--survive", "1"),
                    env={"ELASTIC_FAULT": "step:1:5"}, timeout=90)
    assert "hsdp on 3 ranks" in result.stdout and "check against single-process training: OK" in result.stdout, \
        result.stdout
    assert "rebuilt on 3 ranks" in result.stdout + result.stderr and "redoing step 5" in result.stdout + result.stderr


def test_train_mlp_hsdp_mesh_adapts_after_a_shrink_unless_given():
    adapted = argparse.Namespace(strategy="hsdp", mesh=(2, 2), mesh_given=False)
    given = argparse.Namespace(strategy="hsdp", mesh=(2, 2), mesh_given=True)

    def body():
        assert train_mlp.shrunk_args(adapted).mesh == (1, 3) and adapted.mesh == (2, 2)  # a copy: args kept
        with pytest.raises(ValueError, match=rf"rank {comm.get_rank()}: argument --mesh: 2x2 cannot shrink to the 3 "
                                             r"ranks left after a failure; leave --mesh out"):
            train_mlp.shrunk_args(given)
        return True

    assert local.run(body, 3) == [True] * 3
    assert train_mlp.default_hsdp_mesh(4) == (2, 2) and train_mlp.default_hsdp_mesh(2) == (2, 1)


def test_a_copy_torn_by_its_owners_death_is_never_used_and_the_switch_is_checked(monkeypatch):
    # the owner died inside its write (the slot's sequence word still -1): its buddy never uses half a
    # copy; the other slot (the renewal before) is whole, and is what it reads
    monkeypatch.setenv("MESHKIT_SURVIVE", "1")
    monkeypatch.setenv("MESHKIT_BUDDY_SHM", "1")
    if not buddy_shared.supported():
        pytest.skip("buddy copies in shared memory are used on x86-64 only (its store order)")
    arrays = {"w": np.arange(5.0), "w:exp_avg": np.ones(5)}
    layout = buddy_shared.Layout(arrays, ["w"])
    owner, holder = buddy_shared.Mailbox.create(layout), buddy_shared.Mailbox.create(layout)
    try:
        holder.attach(owner.mine.path)
        assert holder.read() == []  # never written
        owner.write(arrays, [3])
        [(steps, copy)] = holder.read()
        assert steps == {"w": 3} and copy.keys() == arrays.keys()
        np.testing.assert_array_equal(copy["w"], arrays["w"])
        owner.write({k: a + 1 for k, a in arrays.items()}, [4])  # the other slot: both held, newest first
        assert [s for s, _ in holder.read()] == [{"w": 4}, {"w": 3}] == [s for s, _ in owner.read_own()]
        np.testing.assert_array_equal(holder.read()[0][1]["w"], arrays["w"] + 1)
        slot = owner.seq % 2  # the slot holding step 4
        np.frombuffer(owner.mine.memory, np.int64, 1, slot * layout.slot)[0] = -1  # died mid-write of that slot
        [(steps, copy)] = holder.read()
        assert steps == {"w": 3}  # the torn slot left out, the one before it whole
        np.testing.assert_array_equal(copy["w"], arrays["w"])
        np.frombuffer(owner.mine.memory, np.int64, 1, (1 - slot) * layout.slot)[0] = -1
        assert holder.read() == []
    finally:
        for box in (owner, holder):
            box.mine.unlink()
            box.close()
    monkeypatch.setenv("MESHKIT_BUDDY_SHM", "yes")
    with pytest.raises(DistValueError, match=r"MESHKIT_BUDDY_SHM='yes' is not valid; valid values are 0 .* and 1"):
        buddy_shared.enabled()
