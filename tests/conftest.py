"""Shared fixtures: run a script on real processes through meshkit-run."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run (the suite must be deterministic) and keep
# no example database between runs.
settings.register_profile("meshkit", derandomize=True, database=None, deadline=None)
settings.load_profile("meshkit")

SCRIPTS = Path(__file__).parent / "scripts"


def _cache_bytecode_for_the_session() -> None:
    """With ``PYTHONDONTWRITEBYTECODE`` set (some images set it), every process the tests start
    (each rank of each ``meshkit-run`` job, each benchmark) compiled meshkit's ~160 modules again:
    0.45 s of CPU in each ``python -c "import meshkit"`` (0.80 s against 0.37 s with the bytecode
    cached, measured on the 2-core machine), and the suite starts over a thousand such processes.
    Here the session keeps its bytecode in a private temporary folder (``mkdtemp``: mode 0700, so
    no other user can plant bytecode there), removed when the session ends; the tree stays free
    of ``__pycache__`` as the variable asked. Set here at import, before pytest-xdist starts its
    workers, so that they and every process they start inherit it; a user's own
    ``PYTHONPYCACHEPREFIX`` is left as it is."""
    if os.environ.get("PYTHONDONTWRITEBYTECODE") and not os.environ.get("PYTHONPYCACHEPREFIX"):
        prefix = tempfile.mkdtemp(prefix="meshkit-tests-bytecode-")
        atexit.register(shutil.rmtree, prefix, ignore_errors=True)
        del os.environ["PYTHONDONTWRITEBYTECODE"]
        os.environ["PYTHONPYCACHEPREFIX"] = prefix


_cache_bytecode_for_the_session()


#: The module behind ``meshkit-run``: the one place the tests name it.
LAUNCHER_MODULE = "meshkit.launch"


def launch(script: str | Path, n: int, *args: str, timeout: float = 120, env: dict[str, str] | None = None,
           check: bool = True, options: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``meshkit-run -n N [OPTIONS] SCRIPT ARGS``; output captured; asserts exit 0 if ``check``.

    ``script`` is a file name in tests/scripts, or an absolute path (e.g. an example).
    """
    path = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    full_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    cmd = [sys.executable, "-m", LAUNCHER_MODULE, "-n", str(n), "--timeout", str(int(timeout)), *options,
           str(SCRIPTS / script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30, env=full_env)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


def _have_mpiexec() -> bool:
    from meshkit import launch as launcher

    try:
        launcher.find_mpiexec()
    except launcher.LaunchError:
        return False
    return True


#: Tests that start mpiexec themselves (not through ``launch``): skipped, saying why, without one.
needs_mpiexec = pytest.mark.skipif(not _have_mpiexec(), reason="no mpiexec (pip install mpich)")


@pytest.fixture
def mpirun():
    return launch


@pytest.fixture
def cupy():
    """tests/doubles/fake_cupy.py as ``cupy`` in sys.modules and the NCCL double as the CUDA runtime, for
    the test: strict device arrays (not np.ndarray) for the parallel layer, no GPU needed."""
    from doubles import fake_cupy

    with fake_cupy.installed() as module:
        yield module


@pytest.fixture
def fake_gpu():
    """The NCCL double as the CUDA runtime for the test (tests/support/nccl.py); yields its module."""
    from support.nccl import fake_runtime

    with fake_runtime() as double:
        yield double


@pytest.fixture(autouse=True)
def job_teardowns(monkeypatch):
    """The NCCL watchdog ends the whole job (os._exit) when deferred device work fails: inside
    pytest that would end the run with no report. Here it is recorded instead, and a test that
    caused one without expecting it fails, naming the reason; tests of it patch ``tear_down``."""
    import meshkit.comm.groups.work

    ended: list[str] = []
    monkeypatch.setattr(meshkit.comm.job_end, "tear_down", lambda world, reason: ended.append(reason))
    yield ended
    assert not ended, f"the job would have ended: {ended}"


class _RepositoryRootIsNotATestPackage:
    """Collect the repository root as a plain directory, not as a package.

    The root is the package ``meshkit`` (pyproject maps it), and it has an ``__init__.py``, so
    pytest (8+) makes it a ``Package`` node and imports that file under the *folder's* name to
    look for ``setup_module``: as a second copy of meshkit when the folder's name is an
    identifier (``main``), and as a failing relative import when it is not (a clone in
    ``mesh-kit/``: every test errored at setup). Registered from ``pytest_configure`` so that it
    applies above this conftest's own directory.
    """

    @pytest.hookimpl(tryfirst=True)
    def pytest_collect_directory(self, path: Path, parent: pytest.Collector) -> pytest.Collector | None:
        if path == Path(__file__).resolve().parent.parent:
            return pytest.Dir.from_parent(parent, path=path)
        return None


#: The files holding the suite's longest tests (real processes: benchmarks, restarts, kills, device
#: doubles; 7-17 s each in ``--durations=25`` of ``pytest -n 2`` on a quiet 2-core machine, and the
#: files with the most test time in a loaded run's ``--durations=0``), roughly longest test first. They run
#: before every other file so that ``-n 2``'s two workers end together: pytest-xdist hands out tests
#: in collection order, and a 12 s test collected last (alphabetical order puts test_tensor_*,
#: test_transformer_example and test_zero_bubble there) can keep one worker busy while the other
#: has nothing left; the files left to the end are in-process tests of milliseconds. A file missing
#: from the list keeps its place; a name here with no file is ignored.
LONGEST_FIRST = ("test_benchmarks.py", "test_elastic.py", "test_tensor_redistribute.py", "test_tensor_cupy.py",
                 "test_gpu_check.py", "test_checkpoint_state.py", "test_blocking_calls.py", "test_checkpoint.py",
                 "test_simulated_nodes.py", "test_transformer_example.py", "test_plan.py", "test_examples.py",
                 "test_launch.py", "test_stores.py", "test_tensor_validation.py", "test_zero_bubble.py",
                 "test_notices.py", "test_mpi_device.py", "test_gpu_threads.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the files of LONGEST_FIRST first, in its order; every file's tests keep their order (a
    file is never split, so its module fixtures are set up once)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_RepositoryRootIsNotATestPackage(), "meshkit-repository-root")
