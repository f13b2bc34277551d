"""The debug level at run time, the Chrome trace of the flight records, the records a
timeout leaves in MESHKIT_TRACE_DIR and ``python -m meshkit.debug analyze``, and ``breakpoint``."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import meshkit
from meshkit.comm import local
from meshkit.comm.errors import CollectiveMismatchError, CollectiveTimeout, DistTypeError, DistValueError

import meshkit.debug
from meshkit.debug.__main__ import main as debug_command


# ----------------------------------------------------------------- set_debug_level


def test_debug_level_functions_are_exported_as_torch_names_them():
    for name in ("set_debug_level", "get_debug_level", "set_debug_level_from_env"):
        assert name in meshkit.comm.__all__
        assert getattr(meshkit, name) is getattr(meshkit.comm, name)


def test_set_debug_level_reaches_groups_that_exist_already():
    """A mismatched async all_reduce on a group made before the switch: OFF, the local engine finds
    it when the data meets (at wait); DETAIL, the fingerprints are compared before anything starts,
    at the call itself. The cached level (comm/groups/group.py before levels changed at run time) kept OFF's behaviour."""

    def job():
        sub = meshkit.new_group([0, 1])
        assert meshkit.get_debug_level() is meshkit.DebugLevel.OFF
        meshkit.set_debug_level("Detail")  # any case
        assert meshkit.get_debug_level() is meshkit.DebugLevel.DETAIL
        if meshkit.get_rank() == 2:
            return None
        x = np.ones(3 + meshkit.get_rank())
        try:
            work = meshkit.all_reduce(x, group=sub, async_op=True)
        except CollectiveMismatchError as exc:
            return "at the call", str(exc)
        try:
            work.wait()
        except CollectiveMismatchError as exc:
            return "at wait", str(exc)
        return "not at all", ""

    results = local.run(job, 3)
    assert [r[0] for r in results[:2]] == ["at the call"] * 2
    assert "shape=(3,)" in results[0][1] and "shape=(4,)" in results[0][1]


def test_set_debug_level_back_to_off_applies_from_the_next_call():
    def job():
        meshkit.set_debug_level(meshkit.DebugLevel.DETAIL)
        meshkit.set_debug_level("off")
        assert meshkit.get_debug_level() is meshkit.DebugLevel.OFF
        x = np.ones(2)
        meshkit.all_reduce(x)
        return x

    assert [list(x) for x in local.run(job, 3)] == [[3.0, 3.0]] * 3


@pytest.mark.parametrize("bad, error, match", [
    ("verbose", DistValueError, r"level='verbose' is not a debug level; valid levels are \['OFF', 'INFO', 'DETAIL'\]"),
    (2, DistTypeError,
     r"level must be a DebugLevel or its name, got int 2; valid levels are \['OFF', 'INFO', 'DETAIL'\]"),
])
def test_a_bad_level_is_an_error_naming_the_argument_and_the_valid_levels(bad, error, match):
    with pytest.raises(error, match=match):
        meshkit.set_debug_level(bad)

    def job():
        meshkit.set_debug_level(bad)

    with pytest.raises(error, match=r"rank \d: set_debug_level: " + match):
        local.run(job, 2)


def test_before_init_the_level_is_the_one_init_uses_and_set_from_env_reads_meshkit_debug(monkeypatch):
    monkeypatch.setenv("MESHKIT_DEBUG", "info")

    def job():
        assert meshkit.get_debug_level() is meshkit.DebugLevel.INFO  # MESHKIT_DEBUG until set
        meshkit.set_debug_level("detail")
        assert meshkit.get_debug_level() is meshkit.DebugLevel.DETAIL
        meshkit.init_process_group("local", timeout=5)
        before = meshkit.get_debug_level()
        meshkit.set_debug_level_from_env()
        return before, meshkit.get_debug_level()

    assert local.run(job, 2, init=False) == [(meshkit.DebugLevel.DETAIL, meshkit.DebugLevel.INFO)] * 2
    monkeypatch.setenv("MESHKIT_DEBUG", "loud")
    with pytest.raises(DistValueError, match=r"MESHKIT_DEBUG='loud' is not valid; valid values are "
                                             r"\['off', 'info', 'detail'\]"):
        meshkit.set_debug_level_from_env()


def test_a_rank_in_detail_mode_facing_one_not_in_it_fails_at_init_on_every_rank():
    """Levels set differently before init: every rank raises at init_process_group, naming them."""

    def job():
        if _thread_rank() == 0:  # before init: the rank of local.run's thread
            meshkit.set_debug_level("detail")
        meshkit.init_process_group("local", timeout=5)

    with pytest.raises(DistValueError, match=r"init_process_group: the ranks' debug levels differ "
                                             r"\(rank 0: DETAIL; ranks \[1, 2\]: OFF\)"):
        local.run(job, 3, init=False)


def _thread_rank() -> int:
    return int(threading.current_thread().name.rsplit("rank", 1)[1])


def test_a_rank_switching_alone_fails_with_a_mismatch_on_every_rank_not_a_hang():
    """Rank 0 switches to detail alone; rank 1 goes on to its all_reduce. Both raise at once,
    naming set_debug_level and the all_reduce (no hang, no data moved)."""
    errors = {}

    def job():
        x = np.ones(2)
        try:
            if meshkit.get_rank() == 0:
                meshkit.set_debug_level("detail")
            meshkit.all_reduce(x)
        except CollectiveMismatchError as exc:
            errors[meshkit.get_rank()] = str(exc)
        return x

    started = time.monotonic()
    results = local.run(job, 2, timeout=30)
    assert time.monotonic() - started < 10
    assert sorted(errors) == [0, 1]
    for text in errors.values():
        assert "set_debug_level" in text and "all_reduce(shape=(2,), dtype=float64, op=SUM)" in text
    assert [list(x) for x in results] == [[1.0, 1.0]] * 2  # nothing reduced


def test_set_debug_level_with_different_levels_or_unequal_calls_is_an_error_on_every_rank():
    def levels():
        meshkit.set_debug_level("detail" if meshkit.get_rank() == 0 else "info")

    with pytest.raises(DistValueError, match=r"set_debug_level: the ranks passed different levels "
                                             r"\(rank 0: DETAIL; rank 1: INFO\)"):
        local.run(levels, 2)

    def unequal():
        sub = meshkit.new_group([1, 2])
        if meshkit.get_rank() == 1:
            meshkit.all_reduce(np.ones(1), group=sub, async_op=True)  # rank 2 issues it after the switch
        meshkit.set_debug_level("detail")

    with pytest.raises(DistValueError, match=r"the members of group \[1, 2\] had issued different numbers of calls "
                                             r"on it \(rank 1: 1, rank 2: 0\)"):
        local.run(unequal, 3, timeout=5)


# ----------------------------------------------------------------- the Chrome trace


def test_export_chrome_trace_writes_one_file_with_a_track_per_rank_and_group(tmp_path):
    path = tmp_path / "trace.json"

    def job():
        sub = meshkit.new_group([0, 1])
        x = np.ones(4, np.float32)
        meshkit.all_reduce(x)
        if meshkit.get_rank() < 2:
            meshkit.broadcast(np.zeros(3), src=0, group=sub)
        meshkit.debug.export_chrome_trace(str(path))

    local.run(job, 3)
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1"), (2, "rank 2")}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    world_tid = next(t for (p, t), n in threads.items() if n == "world [0, 1, 2]")
    sub_tid = next(t for (p, t), n in threads.items() if n.endswith("[0, 1]"))
    assert {(p, t) for (p, t), n in threads.items() if n == "world [0, 1, 2]"} == {(0, world_tid), (1, world_tid),
                                                                                 (2, world_tid)}
    calls = [e for e in events if e["ph"] == "X"]
    reduces = [e for e in calls if e["name"] == "all_reduce"]
    assert sorted(e["pid"] for e in reduces) == [0, 1, 2]
    for e in reduces:
        assert e["tid"] == world_tid
        assert e["args"] == {"seq": e["args"]["seq"], "shapes": [[4]], "dtype": "float32", "bytes": 16,
                             "state": "completed"}
        assert e["ts"] >= 0 and e["dur"] >= 0
    broadcasts = [e for e in calls if e["name"] == "broadcast"]
    assert sorted(e["pid"] for e in broadcasts) == [0, 1] and {e["tid"] for e in broadcasts} == {sub_tid}
    assert broadcasts[0]["args"]["bytes"] == 24
    # one clock for all: every rank's all_reduce starts before any rank's broadcast ends
    assert max(e["ts"] for e in reduces) <= min(e["ts"] + e["dur"] for e in broadcasts)
    assert "wall clock" in trace["otherData"]["clock"]


def test_export_chrome_trace_checks_its_path_on_every_rank_before_gathering():
    with pytest.raises(DistTypeError, match=r"rank \d: export_chrome_trace: path must be a str or path-like, "
                                            r"got int 3"):
        local.run(lambda: meshkit.debug.export_chrome_trace(3), 2)


# ----------------------------------------------------------------- MESHKIT_TRACE_DIR and analyze


def _analyze(folder, *, command: bool = False) -> str:
    """What ``python -m meshkit.debug analyze FOLDER`` prints: the command itself with ``command`` (a
    process: test_analyze_on_records_that_real_processes_wrote), else its ``main`` in this process."""
    if command:
        proc = subprocess.run([sys.executable, "-m", "meshkit.debug", "analyze", str(folder)], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert debug_command(["analyze", str(folder)]) == 0
    return out.getvalue()


def _findings(folder) -> list[tuple[str, tuple[int, ...], str, str, int]]:
    return [(f.kind, f.ranks, f.op, f.group, f.seq) for f in meshkit.debug.analyze(meshkit.debug.load_records(folder))]


def _run_failing(job, n, folder, monkeypatch, timeout=1.0):
    monkeypatch.setenv("MESHKIT_TRACE_DIR", str(folder))
    with pytest.raises((CollectiveTimeout, CollectiveMismatchError, meshkit.comm.RankFailedError)):
        local.run(job, n, timeout=timeout)


def test_analyze_names_the_rank_that_never_entered_the_call(tmp_path, monkeypatch):
    def job():
        x = np.ones(2)
        meshkit.all_reduce(x)  # #0
        if meshkit.get_rank() != 2:
            meshkit.all_reduce(x)  # #1: rank 2 skips it and leaves

    _run_failing(job, 4, tmp_path, monkeypatch)
    assert sorted(os.listdir(tmp_path)) == ["rank0.json", "rank1.json", "rank3.json"]
    assert _findings(tmp_path) == [("missing", (2,), "all_reduce", "world", 1)]
    out = _analyze(tmp_path)
    assert "MISSING: rank 2 never entered all_reduce #1 on group world (ranks [0, 1, 2, 3])" in out
    assert "no record from rank 2" in out


def test_analyze_names_the_rank_whose_call_differed(tmp_path, monkeypatch):
    def job():
        meshkit.all_reduce(np.ones(2))
        meshkit.all_reduce(np.ones(3 if meshkit.get_rank() == 1 else 4, np.float32))

    _run_failing(job, 4, tmp_path, monkeypatch)
    assert _findings(tmp_path) == [("mismatch", (1,), "all_reduce", "world", 1)]
    out = _analyze(tmp_path)
    assert ("MISMATCH: rank 1 called all_reduce(shapes=[(3,)], dtype=float32) as call #1 on group world "
            "(ranks [0, 1, 2, 3]) where ranks [0, 2, 3] called all_reduce(shapes=[(4,)], dtype=float32): the "
            "shape/size differs") in out

    def dtypes():
        meshkit.all_reduce(np.ones(4, np.float64 if meshkit.get_rank() == 3 else np.float32))

    folder = tmp_path / "dtype"
    _run_failing(dtypes, 4, folder, monkeypatch)
    assert _findings(folder) == [("mismatch", (3,), "all_reduce", "world", 0)]
    assert "the dtype differs" in _analyze(folder)


def test_analyze_names_the_rank_stuck_before_the_call(tmp_path, monkeypatch):
    def job():
        x = np.ones(2)
        meshkit.all_reduce(x)
        if meshkit.get_rank() == 3:
            time.sleep(2.0)  # "compute" longer than the 1 s timeout
        meshkit.all_reduce(x)

    _run_failing(job, 4, tmp_path, monkeypatch)
    assert sorted(os.listdir(tmp_path)) == ["rank0.json", "rank1.json", "rank2.json", "rank3.json"]
    assert _findings(tmp_path) == [("stuck", (3,), "all_reduce", "world", 1)]
    assert "STUCK: rank 3 entered all_reduce #1 on group world (ranks [0, 1, 2, 3]) only" in _analyze(tmp_path)


def test_analyze_names_ranks_that_called_collectives_in_another_order(tmp_path, monkeypatch):
    def job():
        sub = meshkit.new_group([0, 1])
        x = np.ones(2)
        if meshkit.get_rank() == 1:
            meshkit.all_reduce(x, group=sub)
            meshkit.all_reduce(x)
        else:
            meshkit.all_reduce(x)
            if meshkit.get_rank() == 0:
                meshkit.all_reduce(x, group=sub)

    _run_failing(job, 3, tmp_path, monkeypatch)
    # world's call #0 was new_group's split: the all_reduce is #1 there, #0 on the pair's group
    assert _findings(tmp_path) == [("order", (0, 1), "all_reduce", "group[0, 1]", 0)]
    out = _analyze(tmp_path)
    assert ("ORDER: ranks [0, 1] called collectives in different orders: rank 1 entered all_reduce #0 on group "
            "group[0, 1] (ranks [0, 1]) first, while rank 0 entered all_reduce #1 on group world (ranks [0, 1, 2]) "
            "first") in out
    assert "MISSING" not in out and "STUCK" not in out


def test_trace_dir_is_validated_like_the_other_variables(tmp_path, monkeypatch):
    file = tmp_path / "a_file"
    file.write_text("")
    monkeypatch.setenv("MESHKIT_TRACE_DIR", str(file))
    with pytest.raises(DistValueError, match=r"MESHKIT_TRACE_DIR='.*a_file' is not valid; valid values are a folder"):
        local.run(lambda: None, 1)


def test_analyze_of_a_folder_without_records_says_so(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "meshkit.debug", "analyze", str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "no flight record (rank<N>.json) in" in proc.stderr


@pytest.mark.parametrize("case, expected, line, failed", [
    ("missing", [("missing", (2,), "all_reduce", "world", 1)],
     "MISSING: rank 2 never entered all_reduce #1 on group world (ranks [0, 1, 2])", [0, 1]),
    ("mismatch", [("mismatch", (1,), "all_reduce", "world", 2)],
     "MISMATCH: rank 1 called all_reduce(shapes=[(3,)], dtype=float32) as call #2 on group world (ranks [0, 1, 2]) "
     "where ranks [0, 2] called all_reduce(shapes=[(4,)], dtype=float32): the shape/size differs", [0, 1, 2]),
    ("alone", [("mismatch", (0,), "set_debug_level", "world", 1)],
     "MISMATCH: rank 0 called set_debug_level(shapes=[]) as call #1 on group world (ranks [0, 1, 2]) where ranks "
     "[1, 2] called all_reduce(shapes=[(4,)], dtype=float32): the op, shape/size and dtype differ", [0, 1, 2]),
])
def test_analyze_on_records_that_real_processes_wrote(mpirun, tmp_path, case, expected, line, failed):
    """Under meshkit-run: the ranks that failed write rank<N>.json; analyze names the divergence.
    mismatch: set_debug_level("detail") on every rank (call #1) over MPI, then rank 1's shorter
    array; alone: rank 0 switches to detail alone: it times out in the switch naming the ranks
    that never called it, they in their all_reduce (no hang, no data moved)."""
    proc = mpirun("mpi_trace_dir.py", 3, case, timeout=90,
                  env={"MESHKIT_TRACE_DIR": str(tmp_path), "MESHKIT_TIMEOUT": "1"})
    for rank in failed:
        assert f"rank {rank}: " in proc.stdout and f"rank {rank}: no error" not in proc.stdout, proc.stdout
    if case == "alone":
        assert ("rank 0: CollectiveTimeout: meshkit.comm: rank 0: set_debug_level #1 on group world (ranks [0, 1, 2]) "
                "timed out after 1.0 s; ranks that did not arrive: [1, 2]") in proc.stdout
    assert sorted(os.listdir(tmp_path)) == [f"rank{r}.json" for r in failed]
    assert _findings(tmp_path) == expected
    assert line in _analyze(tmp_path, command=case == "missing")  # the command itself once


# ----------------------------------------------------------------- breakpoint


def test_breakpoint_runs_pdb_on_one_rank_while_the_others_wait_past_the_timeout(monkeypatch):
    """Local job, pdb's input injected (the terminal substitute): rank 1 is debugged; the others
    wait in a barrier without deadline while its session sleeps longer than the 1 s timeout."""
    from meshkit.comm import breakpoints

    out = io.StringIO()
    commands = io.StringIO("p x\n!import time; time.sleep(1.5)\nc\n")
    monkeypatch.setattr(breakpoints, "_terminal", lambda rank, backend: (commands, out))

    def job():
        x = 100 + meshkit.get_rank()  # noqa: F841 (read by pdb)
        started = time.monotonic()
        meshkit.breakpoint(rank=1)
        waited = time.monotonic() - started
        y = np.ones(1)
        meshkit.all_reduce(y)
        return waited, y[0]

    results = local.run(job, 3, timeout=1)
    assert "(Pdb) 101\n" in out.getvalue() and "rank 1 stopped in pdb" in out.getvalue()
    for rank, (waited, total) in enumerate(results):
        assert total == 3.0
        if rank != 1:
            assert waited > 1.4, (rank, waited)  # past the timeout of 1 s, without a CollectiveTimeout


def test_breakpoint_arguments_are_checked_on_every_rank():
    with pytest.raises(DistValueError, match=r"rank \d: breakpoint: rank=3 is out of range for a world of size 2 "
                                             r"\(valid: 0..1\)"):
        local.run(lambda: meshkit.breakpoint(rank=3), 2)
    with pytest.raises(DistTypeError, match=r"breakpoint: rank must be an int, got str '0'"):
        local.run(lambda: meshkit.breakpoint(rank="0"), 2)


def _meshkit_run(script: str, n: int, stdin: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    from conftest import LAUNCHER_MODULE, SCRIPTS

    path = os.pathsep.join(p for p in (os.path.dirname(__file__), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", LAUNCHER_MODULE, "-n", str(n), "--timeout", "90",
                           str(SCRIPTS / script)], input=stdin, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": path, **env})


def test_breakpoint_under_meshkit_run_reads_the_launchers_input_and_the_others_wait():
    """The launcher's stdin reaches rank 0 (mpiexec forwards it there; meshkit-run's ranks have no
    /dev/tty): pdb prints x, sleeps 2.5 s, continues; the other ranks waited past MESHKIT_TIMEOUT=1."""
    proc = _meshkit_run("mpi_breakpoint.py", 3, "p x\n!import time; time.sleep(2.5)\nc\n", {"MESHKIT_TIMEOUT": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[rank0]: (Pdb) 42" in proc.stdout
    for rank in range(3):
        line = next(line for line in proc.stdout.splitlines() if f"rank {rank} waited" in line)
        assert line.endswith("sum 3")
        if rank:
            assert float(line.split("waited ")[1].split(" s")[0]) >= 2.0, line


def test_breakpoint_on_a_rank_without_input_under_meshkit_run_fails_on_every_rank():
    proc = _meshkit_run("mpi_breakpoint.py", 2, "c\n", {"MESHKIT_TIMEOUT": "1", "BREAK_RANK": "1"})
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "breakpoint(rank=1): rank 1 has no terminal for pdb" in text
    assert "under meshkit-run only rank 0 receives the launcher's input" in text


def test_export_chrome_trace_under_meshkit_run_gathers_every_process(mpirun, tmp_path):
    path = tmp_path / "trace.json"
    mpirun("mpi_chrome_trace.py", 3, str(path), timeout=90)
    events = json.loads(path.read_text())["traceEvents"]
    calls = sorted((e["pid"], e["name"], e["args"]["seq"], e["args"]["bytes"]) for e in events if e["ph"] == "X")
    assert calls == [(rank, op, seq, 64) for rank in range(3) for op, seq in (("all_reduce", 0), ("broadcast", 1))]
