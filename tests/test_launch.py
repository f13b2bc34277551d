"""Tests of ``meshkit-run`` (meshkit.launch): real jobs under mpiexec, plus its parsing.

Each job runs ``python -m meshkit.launch ...`` from a temporary directory with one of the
rank scripts in ``tests/scripts/launch_*.py``, which use mpi4py directly.
"""

from __future__ import annotations

import ast
import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshkit import launch
from meshkit.launch import bootstrap, cli

SCRIPTS = Path(__file__).resolve().parent / "scripts"
LAUNCHER = [sys.executable, "-m", "meshkit.launch"]


def _have_mpiexec() -> bool:
    try:
        launch.find_mpiexec()
    except launch.LaunchError:
        return False
    return True


needs_mpiexec = pytest.mark.skipif(not _have_mpiexec(), reason="no mpiexec (pip install mpich)")


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
def test_exit_code_of_the_script_passes_through(tmp_path: Path) -> None:
    result = run_launcher(["-n", "2", str(SCRIPTS / "launch_exit.py"), "3"], tmp_path)

    assert result.returncode == 3, result.stderr


@needs_mpiexec
@pytest.mark.parametrize("others", ["barrier", "sleep"])
def test_exception_on_one_rank_ends_the_job(tmp_path: Path, others: str) -> None:
    start = time.time()
    result = run_launcher(["-n", "2", str(SCRIPTS / "launch_raise.py"), others], tmp_path)
    end = time.time()

    assert result.returncode != 0
    raised_at = float(re.search(r"\[rank1\]: raising at ([\d.]+)", result.stdout).group(1))
    assert end - raised_at < 5, f"job took {end - raised_at:.1f} s to end after the raise"
    assert end - start < 15
    errors = rank_lines(result.stderr)
    assert "[rank1]: Traceback (most recent call last):" in errors
    assert "[rank1]: ValueError: launch test failure on rank 1" in errors
    # The bootstrap's own frames are not shown, as for `python script.py`.
    assert "runpy" not in result.stderr and "bootstrap.py" not in result.stderr and "launch.py" not in result.stderr


@needs_mpiexec
def test_failed_rank_that_leaves_others_waiting_is_killed_after_grace(tmp_path: Path) -> None:
    # sys.exit(3) runs MPI_Finalize, which waits for rank 0, itself stuck in a barrier:
    # the launcher ends the job KILL_GRACE_S after rank 1 reported its failure.
    start = time.monotonic()
    result = run_launcher(["-n", "2", str(SCRIPTS / "launch_exit_one.py"), "3"], tmp_path)
    elapsed = time.monotonic() - start

    assert result.returncode == 3, result.stderr
    assert "rank 1 failed (exit 3); killing the job" in result.stderr
    assert elapsed < launch.KILL_GRACE_S + 8


@needs_mpiexec
def test_sigint_to_the_launcher_ends_the_job(tmp_path: Path) -> None:
    with open(tmp_path / "out.txt", "w") as out:
        proc = subprocess.Popen(
            [*LAUNCHER, "-n", "2", str(SCRIPTS / "launch_sleep.py")],
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 30
            while not all((tmp_path / f"ready.{r}").exists() for r in range(2)):
                assert proc.poll() is None, (tmp_path / "out.txt").read_text()
                assert time.monotonic() < deadline, "ranks did not start"
                time.sleep(0.05)
            start = time.monotonic()
            proc.send_signal(signal.SIGINT)
            returncode = proc.wait(timeout=15)
            elapsed = time.monotonic() - start
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    assert returncode == 130, (tmp_path / "out.txt").read_text()
    assert elapsed < 10


@needs_mpiexec
def test_timeout_ends_the_job_with_124(tmp_path: Path) -> None:
    start = time.monotonic()
    result = run_launcher(["-n", "2", "--timeout", "2", str(SCRIPTS / "launch_sleep.py")], tmp_path)
    elapsed = time.monotonic() - start

    assert result.returncode == launch.TIMEOUT_EXIT_CODE
    assert "meshkit-run: job exceeded --timeout 2 s" in result.stderr
    assert elapsed < 2 + launch.KILL_GRACE_S + 5


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
        (["-n", "two", "script.py"], r"argument -n/--nproc: expected an integer >= 1, got 'two'"),
        (["script.py"], r"the following arguments are required: -n/--nproc"),
        (["-n", "2", "missing.py"], r"script not found: 'missing.py'"),
        (["-n", "2"], r"no script given: pass a script path or -m MODULE"),
        (["-n", "2", "-m"], r"argument -m: expected a module name"),
        (["-n", "2", "--timeout", "0", "script.py"], r"--timeout: expected seconds > 0, got 0"),
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


def test_thread_limits_respect_the_users_settings() -> None:
    assert launch.thread_limits(4, {"OMP_NUM_THREADS": "3"}) == {
        "OPENBLAS_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 4)),
        "MKL_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 4))}


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
        assert not any(name.startswith("meshkit.launch") for name in _imports(path)), path


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
