"""examples/train_mlp.py, unchanged, under ``meshkit-run --survive K``: K ranks lost, the exact result.

Issue 39's promise (docs/elastic.md "Surviving failures"): after any number of survived failures
the final parameters equal uninterrupted single-process training to 1e-10 (float64, ``--check``).
One job per strategy; ddp, zero1, zero2 and fsdp start 5 ranks and lose 3, hsdp starts 4 and loses
2, each by SIGKILL (tests/scripts/elastic_train.py arms every fault on the one attempt, by the rank
as launched):

* at a step: right after a training step, so the others meet its death in the next one;
* inside a gradient reduction: 50 ms after a rank handed over its second gradient of a step, the
  others in a DDP/ZeRO bucket's all-reduce (``--bucket-cap-mb 0.01``: several buckets) or an FSDP
  unit's reduce-scatter;
* inside a checkpoint save: its data file written, its marker not (rank 0, the committer, in one
  job), so that save fails on every survivor as a ``RankFailedError``, its temporary directory
  removed, and the loop shrinks and carries on; the checkpoints before and after it commit.

ddp's last failure comes in a row: in the save right after the step redone. hsdp's mesh goes
2x2 -> 1x3 -> 2x1; it is killed at a step in tests/test_survive_buddy.py.

The sharded strategies renew their buddy copies every ``MESHKIT_BUDDY_EVERY`` steps (8, set here: unset,
the cadence is chosen from measured times, which would make the steps redone vary; and 1 for zero1's
job): a failure rolls the survivors back to the last renewal (after step 1, a
multiple of 8, or the last shrink), so they replay the steps since, re-saving checkpoints that
committed before the failure (skipped: the step is on disk) and retaking the save that met the
dead rank; the result is still exact. hsdp's first failure takes the lost shard live from its
replica: no rollback.

The same jobs check the launcher's report of each survived failure, by phase (``--survive-report``,
:mod:`meshkit.launch.survived`): one line each on stderr and the JSON; its parsing and phase
arithmetic are tested in-process below.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshkit.launch import cli
from meshkit.launch.survived import SurvivedReports, parse_recovery
from test_survive import EXAMPLES, launch, needs_ulfm

PHASES = ("detection_s", "agreement_s", "shrink_s", "state_rebuild_s", "redo_s")

STEPS, EVERY = 20, 5
#: (strategy, ranks, MESHKIT_BUDDY_EVERY or None (unset), its faults in the order they strike:
#: KIND:RANK-AS-LAUNCHED:STEP (elastic_train.py), the step each failure's survivors redo from)
CASES = [
    ("ddp", 5, None, ("step:4:2", "bucket:0:4", "save:3:5"), (2, 4, 5)),  # the third in the save right after the
    # step redone; replicated: nothing rolls back
    ("zero1", 5, "1", ("step:4:2", "bucket:2:4", "save:0:10"), (2, 4, 10)),  # renewed every step; rank 0, the
    # save's committer, killed in it
    ("zero2", 5, "8", ("step:3:2", "bucket:1:7", "save:2:15"), (1, 1, 8)),  # back to the renewals after steps 1
    # (the save of 5 replayed: skipped), 1 (the shrink's) and 8 (the save of 10 skipped, 15's retaken)
    ("fsdp", 5, "8", ("step:0:2", "bucket:3:6", "save:1:10"), (1, 1, 8)),  # rank 0 between steps
    ("hsdp", 4, "8", ("bucket:1:4", "save:3:15"), (4, 8)),  # 2x2 -> 1x3 -> 2x1 (at a step: test_survive_buddy.py);
    # the first lost shard is live on its replica
]
SAID = {"step": "after step {}", "bucket": "inside step {}'s gradient reduction", "save": "inside the save of step {}"}


@needs_ulfm
@pytest.mark.parametrize(("strategy", "ranks", "every", "faults", "redo"), CASES, ids=[c[0] for c in CASES])
def test_train_mlp_survives_ranks_killed_at_a_step_in_a_reduction_and_in_a_save(strategy, ranks, every, faults, redo,
                                                                                tmp_path):
    ckpt = tmp_path / "ckpt"
    cap = ["--bucket-cap-mb", "0.01"] if strategy in ("ddp", "zero1", "zero2") else []
    lost = len(faults)
    result = launch("elastic_train.py", ranks, str(EXAMPLES / "train_mlp.py"), "--strategy", strategy, "--steps",
                    str(STEPS), "--batch", "120", "--samples", "1024", *cap, "--checkpoint-dir", str(ckpt),
                    "--save-every", str(EVERY), "--check",
                    options=("--survive", str(lost), "--survive-report", str(tmp_path / "survived.json")),
                    env={"ELASTIC_FAULT": "+".join(faults), **({"MESHKIT_BUDDY_EVERY": every} if every else {})},
                    timeout=150)
    out, err = result.stdout, result.stderr
    struck = [(kind, int(victim), int(at)) for kind, victim, at in (f.split(":") for f in faults)]
    for n, ((kind, victim, at), back) in enumerate(zip(struck, redo), 1):
        assert f"killing rank {victim} {SAID[kind].format(at)}" in out, out
        assert (f"rank {victim} failed (signal 9); the survivors carry on without it ({n} of --survive {lost})"
                in err), err
        assert f"rebuilt on {ranks - n} ranks" in out + err and f"redoing step {back} " in out + err, out + err
    assert f"{strategy} on {ranks - lost} ranks" in out and "check against single-process training: OK (float64" in out, out
    # the save that met the dead rank never commits, nor is it retaken unless the survivors rolled back past
    # it; the others commit (a replayed one once)
    saved = {at for (kind, _, at), back in zip(struck, redo) if kind == "save" and back == at}
    kept = sorted(int(p.name.split("_")[1]) for p in ckpt.iterdir() if p.name.startswith("step_"))
    assert kept == [s for s in range(EVERY, STEPS + 1, EVERY) if s not in saved], kept
    # the launcher's report: a line and a JSON entry per failure, every phase timed, in order
    reports = json.loads((tmp_path / "survived.json").read_text())
    assert [(r["survived"], r["ranks"], r["failure"], r["ranks_before"], r["ranks_after"], r["redo_step"],
             r["complete"]) for r in reports] == [(n, [victim], "signal 9", ranks - n + 1, ranks - n, back, True)
                                                  for n, ((_, victim, _), back) in enumerate(zip(struck, redo), 1)], \
        reports
    for r, (_, victim, _) in zip(reports, struck):
        assert all(r[p] is not None and r[p] >= 0 for p in PHASES), r
        assert sum(r[p] for p in PHASES) == pytest.approx(r["total_s"], abs=1e-6) and r["total_s"] < 30, r
        assert len(r["survivors"]) == r["ranks_after"] and victim not in r["survivors"], r
        assert re.search(rf"survived failure {r['survived']} \(rank {r['ranks'][0]}, signal 9; {r['ranks_before']} "
                         rf"-> {r['ranks_after']} ranks, redo from step {r['redo_step']}\): failure -> next step "
                         r"[0-9.]+ s = detection [0-9.]+ \+ agreement [0-9.]+ \+ shrink [0-9.]+ \+ state rebuild "
                         r"[0-9.]+ \+ redo [0-9.]+\n", err), err


# --------------------------------------------------------------------------- the report, in-process
def _record(folder: Path, n: int, rank: int, times, step: int, lost: str) -> None:
    (folder / f"survived-{n}.{rank}").write_text(" ".join(map(str, [*times, step, lost])))


def test_the_report_times_each_phase_by_its_last_survivor(tmp_path, caplog):
    ms = 1_000_000
    death = 1_000_000 * ms
    job = SimpleNamespace(status_dir=str(tmp_path), survived={
        3: SimpleNamespace(how="signal 9", time_ns=death), 1: SimpleNamespace(how="signal 9", time_ns=death + 900 * ms)})
    path = tmp_path / "report.json"
    reports = SurvivedReports(str(path))
    reports.begin(4, 0)
    # failure 1 (rank 3): two of three survivors recovered, one redo still to come
    _record(tmp_path, 1, 0, [death + 5 * ms, death + 9 * ms, death + 10 * ms, death + 40 * ms, death + 60 * ms], 7, "3")
    _record(tmp_path, 1, 1, [death + 8 * ms, death + 11 * ms, death + 12 * ms, death + 30 * ms, 0], 7, "3")
    _record(tmp_path, 1, 2, [death + 6 * ms, death + 10 * ms, death + 13 * ms, death + 35 * ms, death + 70 * ms], 7, "3")
    with caplog.at_level("WARNING", logger="meshkit.launch"):
        reports.poll(job)
        assert not caplog.records and not path.exists()  # not complete: nothing said yet
        _record(tmp_path, 1, 1, [death + 8 * ms, death + 11 * ms, death + 12 * ms, death + 30 * ms, death + 80 * ms], 7, "3")
        reports._listed = None  # (the folder's mtime may not tick between two writes this close)
        reports.poll(job)
        reports.poll(job)  # said once
    assert [r.getMessage() for r in caplog.records] == [
        "survived failure 1 (rank 3, signal 9; 4 -> 3 ranks, redo from step 7): failure -> next step 0.080 s = "
        "detection 0.008 + agreement 0.003 + shrink 0.002 + state rebuild 0.027 + redo 0.040"]
    (entry,) = json.loads(path.read_text())
    assert entry["ranks"] == [3] and entry["survivors"] == [0, 1, 2] and entry["complete"]
    assert entry["total_s"] == pytest.approx(0.080) and entry["failed_at_ns"] == death
    # failure 2 (rank 1, as launched, rank 1 of the world of 3 too): the job ends during its state rebuild;
    # a survivor's error before the watcher's record of the death starts the report
    caplog.clear()
    _record(tmp_path, 2, 0, [death + 850 * ms, death + 905 * ms, death + 906 * ms, death + 950 * ms, 0], 12, "1")
    _record(tmp_path, 2, 2, [death + 870 * ms, death + 903 * ms, death + 904 * ms, 0, 0], 12, "1")
    with caplog.at_level("WARNING", logger="meshkit.launch"):
        reports.poll(job)
        assert not caplog.records
        reports.finish(job)
    assert [r.getMessage() for r in caplog.records] == [
        "survived failure 2 (rank 1, signal 9; 3 -> 2 ranks, redo from step 12): failure -> last point passed "
        "0.056 s = detection 0.020 + agreement 0.035 + shrink 0.001 (not every survivor completed a step after it)"]
    second = json.loads(path.read_text())[1]
    assert second["state_rebuild_s"] is None and second["redo_s"] is None and not second["complete"]
    # a restart (--max-restarts): the next attempt's failures are numbered again, the file keeps all
    for name in ("survived-1.0", "survived-1.1", "survived-1.2", "survived-2.0", "survived-2.2"):
        (tmp_path / name).unlink()
    reports.begin(4, 1)
    job.survived = {2: SimpleNamespace(how="exit 9", time_ns=death)}
    for rank in (0, 1, 3):
        _record(tmp_path, 1, rank, [death + ms, death + 2 * ms, death + 3 * ms, death + 4 * ms, death + 5 * ms], 3, "2")
    caplog.clear()
    with caplog.at_level("WARNING", logger="meshkit.launch"):
        reports.poll(job)
    assert [r.getMessage() for r in caplog.records] == [
        "survived failure 1 of attempt 1 (rank 2, exit 9; 4 -> 3 ranks, redo from step 3): failure -> next step "
        "0.005 s = detection 0.001 + agreement 0.001 + shrink 0.001 + state rebuild 0.001 + redo 0.001"]
    assert [(e["attempt"], e["survived"]) for e in json.loads(path.read_text())] == [(0, 1), (0, 2), (1, 1)]


def test_a_recovery_record_is_read_strictly(tmp_path):
    assert parse_recovery("1 2 3 4 0 7 3,1\n").lost == (3, 1)
    assert parse_recovery("1 2 3 4 5 7 -").lost == ()
    for bad in ("1 2 3 4 5 7", "1 2 3 4 5 x 3", "1 2 3 4 5 7 3;rm", "-1 2 3 4 5 7 3", "1 2 3 4 5 7 3 extra"):
        with pytest.raises(ValueError, match="not a recovery record"):
            parse_recovery(bad)
    # a planted record that is not one, or a link, is skipped; the job's own are read
    job = SimpleNamespace(status_dir=str(tmp_path), survived={2: SimpleNamespace(how="signal 9", time_ns=10)})
    (tmp_path / "survived-1.0").write_text("garbage")
    (tmp_path / "elsewhere").write_text("1 2 3 4 5 7 2")
    (tmp_path / "survived-1.1").symlink_to(tmp_path / "elsewhere")
    reports = SurvivedReports()
    reports.begin(3, 0)
    reports.finish(job)
    assert reports.reports == []


def test_a_survive_report_needs_survive(capsys):
    with pytest.raises(SystemExit) as ended:
        cli._parse_args(["-n", "2", "--survive-report", "r.json", __file__])
    assert ended.value.code == 2
    assert "argument --survive-report: reports the failures --survive K survives; give --survive K too" in \
        capsys.readouterr().err


def test_a_survivor_records_each_recovery_with_the_ranks_as_launched(tmp_path, monkeypatch):
    import os

    from meshkit.comm import milestones

    monkeypatch.setenv(milestones.STATUS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(milestones.LAUNCHER_ENV, f"{os.uname().nodename} 1")
    monkeypatch.setenv("RANK", "3")  # launched as rank 3; rank 2, then rank 1, of the shrunk worlds
    monkeypatch.setattr(milestones, "_recoveries", [])
    monkeypatch.setattr(milestones, "_launched", None)
    milestones.survived(failed=(1,), old_size=4, detected_ns=10, agreed_ns=20, shrunk_ns=30, rebuilt_ns=40, step=7)
    assert parse_recovery((tmp_path / "survived-1.3").read_text()) == parse_recovery("10 20 30 40 0 7 1")
    milestones.milestone(milestones.FIRST_STEP)  # the redo: its time, once
    redone = parse_recovery((tmp_path / "survived-1.3").read_text()).redone
    assert redone > 40
    milestones.milestone(milestones.FIRST_STEP)
    assert parse_recovery((tmp_path / "survived-1.3").read_text()).redone == redone
    # the world is now launched ranks [0, 2, 3]: its rank 0 lost is launched rank 0
    milestones.survived(failed=(0,), old_size=3, detected_ns=50, agreed_ns=60, shrunk_ns=70, rebuilt_ns=80, step=9)
    assert parse_recovery((tmp_path / "survived-2.3").read_text()).lost == (0,)
    milestones.survived(failed=(0,), old_size=2, detected_ns=90, agreed_ns=91, shrunk_ns=92, rebuilt_ns=93, step=9)
    assert parse_recovery((tmp_path / "survived-3.3").read_text()).lost == (2,)
