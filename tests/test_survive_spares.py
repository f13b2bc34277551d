"""``meshkit-run --survive K --spares N``: idle spares take the places of lost ranks, so the world keeps
its size (and hsdp its 2x2 mesh), and the result still equals single-process training.

examples/train_mlp.py runs unchanged (its ``survive.start`` is ``build()`` on every rank but a spare
that joined); tests/scripts/elastic_train.py arms the faults by rank as launched, the spares being
the last N processes (a spare that joined is killed by its number as launched, and an idle one by
rank 0, from the launcher's status directory: it runs no code of the script).
"""

from __future__ import annotations

import json
import re
import time

import pytest

from meshkit.launch import cli
from meshkit.launch.survived import SurvivedReports, parse_recovery
from test_survive import EXAMPLES, launch, needs_ulfm

STEPS = 20

#: (strategy, -n, --spares, faults KIND:RANK-AS-LAUNCHED:STEP, the world's size after each failure,
#: the spares (as launched) that joined at each: none where the world shrank)
CASES = [
    # rank 0 lost inside a bucket's all-reduce: the spare takes rank 0; then that spare, now rank 0, is
    # lost at a step: no spare is left, the world shrinks
    ("ddp", 3, 1, ("bucket:0:4", "step:3:9"), (3, 2), ((3,), ())),
    # 2x2 stays 2x2 (the spare takes rank 1's coordinates, its shard from the buddy copy), then 1x3
    ("hsdp", 4, 1, ("step:1:3", "bucket:2:9"), (4, 3), ((4,), ())),
    # two spares: both failures replaced, fsdp keeps its 3 shards
    ("fsdp", 3, 2, ("step:2:3", "save:0:10"), (3, 3), ((3,), (4,))),
    # the idle spare lost first (the world unchanged, one failure of --survive's two spent), then a rank
    ("zero1", 3, 1, ("spare:3:4", "step:1:9"), (2,), ((),)),
]


@needs_ulfm
@pytest.mark.parametrize(("strategy", "ranks", "spares", "faults", "sizes", "joined"), CASES,
                         ids=[c[0] for c in CASES])
def test_spares_take_the_places_of_lost_ranks(strategy, ranks, spares, faults, sizes, joined, tmp_path):
    cap = ["--bucket-cap-mb", "0.01"] if strategy in ("ddp", "zero1", "zero2") else []
    result = launch("elastic_train.py", ranks, str(EXAMPLES / "train_mlp.py"), "--strategy", strategy, "--steps",
                    str(STEPS), "--batch", "120", "--samples", "1024", *cap, "--checkpoint-dir",
                    str(tmp_path / "ckpt"), "--save-every", "5", "--check",
                    options=("--survive", str(len(faults)), "--spares", str(spares),
                             "--survive-report", str(tmp_path / "survived.json")),
                    env={"ELASTIC_FAULT": "+".join(faults), "MESHKIT_BUDDY_EVERY": "8"}, timeout=150)
    out, err = result.stdout, result.stderr
    assert f"{strategy} on {sizes[-1]} ranks" in out and "check against single-process training: OK (float64" in out, \
        out + err
    reports = json.loads((tmp_path / "survived.json").read_text())
    # each failure names the rank lost as launched (a spare that joined, lost later, by its own number)
    assert [r["ranks"] for r in reports] == [[int(f.split(":")[1])] for f in faults if not f.startswith("spare")], \
        reports
    before = [ranks, *sizes[:-1]]
    assert [(r["ranks_before"], r["ranks_after"], r["spares"], r["complete"]) for r in reports] == \
        [(b, a, list(j), True) for b, a, j in zip(before, sizes, joined)], reports
    for r in reports:
        said = f", spare {r['spares'][0]} joined" if r["spares"] else ""
        assert re.search(rf"survived failure {r['survived']} \(rank {r['ranks'][0]}, signal 9; {r['ranks_before']} -> "
                         rf"{r['ranks_after']} ranks{said}, redo from step {r['redo_step']}\)", err), err
        assert len(r["survivors"]) == r["ranks_after"] - len(r["spares"]), r  # a spare that joined survived nothing
    for spare in (s for j in joined for s in j):
        assert re.search(rf"\[rank{spare}\]: meshkit: spare {spare} took rank \d", out + err), out + err


@needs_ulfm
def test_spares_never_needed_exit_with_the_job(tmp_path):
    """No failure: the spares wait, idle, and exit 0 when rank 0 ends the job; the job ends as fast."""
    started = time.monotonic()
    result = launch("elastic_train.py", 3, str(EXAMPLES / "train_mlp.py"), "--strategy", "zero2", "--steps", "10",
                    "--batch", "120", "--samples", "1024", "--check", options=("--survive", "1", "--spares", "2"),
                    timeout=90)
    assert "zero2 on 3 ranks" in result.stdout and "OK (float64" in result.stdout, result.stdout + result.stderr
    assert "failed" not in result.stderr and "took rank" not in result.stdout + result.stderr, result.stderr
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("args, message", [
    (["-n", "2", "--spares", "1"], r"argument --spares: spares take the place of a rank that --survive K survives; "
                                   r"give --survive K too"),
    (["-n", "2", "--survive", "1", "--spares", "-1"], r"argument --spares: expected an integer >= 0, got -1"),
])
def test_bad_spares_flags_are_usage_errors_naming_the_flag(args, message, capsys):
    with pytest.raises(SystemExit) as ended:
        cli._parse_args([*args, __file__])
    assert ended.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_recovery_record_names_the_spares_that_joined(tmp_path, caplog):
    """A survivor's record ends with the spares (as launched) that took the lost ranks' places; an older
    record without them reads as none. The report counts a spare in the world after, not among the
    survivors whose records complete it."""
    assert parse_recovery("1 2 3 4 5 7 1 3").joined == (3,)
    assert parse_recovery("1 2 3 4 5 7 1,2 3,4").joined == (3, 4)
    assert parse_recovery("1 2 3 4 5 7 1").joined == () and parse_recovery("1 2 3 4 5 7 1 -").joined == ()
    for bad in ("1 2 3 4 5 7 1 3;rm", "1 2 3 4 5 7 1 3 4"):
        with pytest.raises(ValueError, match="not a recovery record"):
            parse_recovery(bad)
    ms = 1_000_000
    job = type("Job", (), {"status_dir": str(tmp_path), "survived": {1: type("Death", (), {"how": "signal 9",
                                                                                            "time_ns": ms})()}})()
    for rank in (0, 2):  # the survivors; spare 3 took rank 1 and writes no record
        (tmp_path / f"survived-1.{rank}").write_text(f"{2 * ms} {3 * ms} {4 * ms} {5 * ms} {6 * ms} 7 1 3")
    reports = SurvivedReports()
    reports.begin(3, 0)
    with caplog.at_level("WARNING", logger="meshkit.launch"):
        reports.poll(job)
    assert [r.getMessage() for r in caplog.records] == [
        "survived failure 1 (rank 1, signal 9; 3 -> 3 ranks, spare 3 joined, redo from step 7): failure -> next step "
        "0.005 s = detection 0.001 + agreement 0.001 + shrink 0.001 + state rebuild 0.001 + redo 0.001"]


@needs_ulfm
def test_a_spare_whose_script_skips_start_fails_naming_the_call():
    """A loop without ``survive.start`` (``model = build()`` at the top): the spare that took rank 1's
    place fails at build()'s first collective, naming ``survive.start``, instead of matching the
    survivors' recovery exchange with build()'s collectives. Its error is the script's, which ends
    the job (meshkit-run's exit status), in seconds; the survivors meanwhile shrink again without it
    (a rank lost during a recovery) and may finish this script's six steps before the end comes."""
    started = time.monotonic()
    result = launch("spare_forgets_start.py", 3, options=("--survive", "2", "--spares", "1"), check=False, timeout=90)
    assert result.returncode != 0, result.stdout + result.stderr
    assert ("[rank3]: meshkit.comm.errors.DistError: meshkit.comm: rank 1: all_gather_into_tensor: group world is "
            "unusable after an earlier failure: this process is a spare of meshkit-run --spares that took rank 1's "
            "place; the survivors wait for it in their recovery: call meshkit.parallel.survive.start(build) right "
            "after init_process_group") in result.stdout + result.stderr, result.stdout + result.stderr
    assert time.monotonic() - started < 60


@needs_ulfm
def test_two_ranks_lost_at_once_rank_0_among_them_take_two_spares(tmp_path):
    """fsdp at 4 ranks loses ranks 0 and 2 in one step (their shards' copies on ranks 3 and 1, alive):
    one recovery, both spares joined in rank order (4 takes rank 0, 5 rank 2), the world still 4, the
    result exact; the new rank 0 is a spare, and reports it."""
    result = launch("elastic_train.py", 4, str(EXAMPLES / "train_mlp.py"), "--strategy", "fsdp", "--steps",
                    str(STEPS), "--batch", "120", "--samples", "1024", "--check",
                    options=("--survive", "2", "--spares", "2", "--survive-report", str(tmp_path / "survived.json")),
                    env={"ELASTIC_FAULT": "step:0:5+step:2:5", "MESHKIT_BUDDY_EVERY": "8"}, timeout=150)
    out, err = result.stdout, result.stderr
    assert "[rank4]: fsdp on 4 ranks" in out and "[rank4]: check against single-process training: OK (float64" in out, \
        out + err
    assert "spare 4 took rank 0, lost with rank(s) [0, 2]" in out + err and "spare 5 took rank 2" in out + err
    (report,) = json.loads((tmp_path / "survived.json").read_text())
    assert (report["ranks"], report["ranks_before"], report["ranks_after"], report["spares"], report["complete"]) == \
        ([0, 2], 4, 4, [4, 5], True), report
    assert "survived failure 1 (ranks 0, 2, signal 9; 4 -> 4 ranks, spares 4, 5 joined, redo from step 1)" in err, err


#: (strategy, spares, the rank lost in the recovery (as launched), the world's size at the end, the
#: spares that joined, the ranks the report names): rank 3 lost after step 9, then another in that
#: recovery, right after the world shrank (the others in its state exchange) or, a spare, in its join
DURING = [
    ("ddp", 0, 1, 2, (), [1, 3]),  # no spare: 4 -> 3, and within the same recovery 3 -> 2
    # spare 4 took rank 3; then, with no spare left, it holds nothing as the world shrinks again
    ("fsdp", 1, 1, 3, (4,), [1, 3]),
    ("hsdp", 2, 1, 4, (4, 5), [1, 3]),  # a spare for each: 2x2 stays 2x2
    # spare 4, which took rank 3, lost in its join: spare 5 takes rank 3 (spare 4 was in neither world:
    # the report names rank 3 and spare 5, the launcher's line the loss of process 4)
    ("fsdp", 2, 4, 4, (5,), [3]),
]


@needs_ulfm
@pytest.mark.parametrize(("strategy", "spares", "victim", "size", "joined", "named"), DURING,
                         ids=["ddp", "fsdp-spare", "hsdp-spares", "fsdp-spare-lost-joining"])
def test_a_rank_lost_during_a_recovery_is_survived_in_that_recovery(strategy, spares, victim, size, joined, named,
                                                                     tmp_path):
    """A second failure inside the first's recovery (the survivors in its state exchange, a spare among
    them, or the spare joining) makes every member of the new world shrink again and start the
    exchange over: one recovery, reported once, the result still exact; fsdp's lost shards come from
    their buddies (ranks 1 and 3 are no neighbours)."""
    options = ["--survive", "2", "--survive-report", str(tmp_path / "survived.json")]
    if spares:
        options += ["--spares", str(spares)]
    result = launch("elastic_train.py", 4, str(EXAMPLES / "train_mlp.py"), "--strategy", strategy, "--steps",
                    str(STEPS), "--batch", "120", "--samples", "1024", "--check", options=tuple(options),
                    env={"ELASTIC_FAULT": f"step:3:9+recovery:{victim}:1", "MESHKIT_BUDDY_EVERY": "8"}, timeout=150)
    out, err = result.stdout, result.stderr
    assert f"{strategy} on {size} ranks" in out and "check against single-process training: OK (float64" in out, \
        out + err
    assert re.search(rf"killing rank {victim} (\(a spare\) )?in its (join, )?recovery 1", out + err), out + err
    assert f"rank {victim} failed (signal 9); the survivors carry on without it (2 of --survive 2)" in err, err
    # every member of the world the first shrink made but the one lost (a spare that took rank 3 among them)
    again = re.findall(r"a rank was lost during the recovery .*; shrinking the world again", err)
    assert len(again) == (3 if spares else 2), err
    reports = json.loads((tmp_path / "survived.json").read_text())
    assert [(r["ranks"], r["ranks_before"], r["ranks_after"], r["spares"], r["complete"]) for r in reports] == \
        [(named, 4, size, list(joined), True)], reports
    assert reports[0]["redo_step"] == (9 if strategy == "ddp" else 8), reports  # sharded: the last renewal's
    said = f", spare{'s' if len(joined) > 1 else ''} {', '.join(map(str, joined))} joined" if joined else ""
    lost = f"rank{'s' if len(named) > 1 else ''} {', '.join(map(str, named))}"
    assert re.search(rf"survived failure 1 \({lost}, signal 9; 4 -> {size} ranks{said}, redo from step", err), err
