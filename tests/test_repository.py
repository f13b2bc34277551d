"""The repository as CI meets it: a clone in a folder of any name runs the README's test command."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_clone_in_a_folder_whose_name_is_not_an_identifier_runs_its_tests(tmp_path: Path) -> None:
    # pytest makes a folder holding __init__.py a package and imports that file under the
    # folder's name; the root's relative imports then failed and every test errored at setup
    # (a clone in mesh-kit/). tests/conftest.py collects the root as a plain directory.
    clone = tmp_path / "mesh-kit"
    (clone / "tests").mkdir(parents=True)
    for name in ("__init__.py", "pyproject.toml", "tests/conftest.py"):
        shutil.copy(ROOT / name, clone / name)
    (clone / "tests" / "test_one.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=clone,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout
