"""The repository as CI meets it: a clone in a folder of any name runs the README's test command."""

from __future__ import annotations

import ast
import re
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


# --------------------------------------------------------------------------- the documentation
DOCS = ROOT / "docs"
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")  # a Markdown link's target, without its #anchor


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def test_every_relative_link_of_the_readme_and_docs_resolves():
    broken = [f"{page.relative_to(ROOT)}: {target}" for page in _pages() for target in _LINK.findall(page.read_text())
              if "://" not in target and not (page.parent / target).exists()]
    assert not broken, broken
    assert any(t.startswith("docs/") for t in _LINK.findall((ROOT / "README.md").read_text())), "the scan found no link"


def test_every_docs_page_is_linked_from_the_readme_and_links_back():
    linked = {(ROOT / t).resolve() for t in _LINK.findall((ROOT / "README.md").read_text())}
    pages = sorted(DOCS.glob("*.md"))
    assert len(pages) >= 11, pages
    assert [p.name for p in pages if p.resolve() not in linked] == []
    for page in pages:
        title, blank, covers = page.read_text().split("\n")[:3]
        # a page opens with its title and one line saying what it covers, linking back to the README
        assert title.startswith("# ") and blank == "" and "](../README.md)" in covers, (page.name, covers)


def test_the_readme_is_a_front_page_with_the_map_near_the_top():
    readme = (ROOT / "README.md").read_text()
    assert len(readme) < 16_000, len(readme)  # was 57 KB with the map 87% of the way down
    heads = re.findall(r"(?m)^## (.*)$", readme)
    assert heads[:2] == ["Set up and test (two commands)", "Run the example"], heads
    assert "How the code is organised" in heads, heads
    assert '```bash\npip install -e ".[test]"\npytest -n 2\n```' in readme  # .ci/run runs this command
    assert (ROOT / ".ci" / "run").read_text().endswith("\npython -m pytest -n 2\n")
    assert "```bash\nmeshkit-run -n 4 examples/train_mlp.py --check\n```" in readme


#: Packages whose docstring does not carry the map yet (none: every package's does).
MAP_PENDING: set[str] = set()


def _docstring(package: Path) -> str:
    return ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""


def test_each_package_docstring_is_its_map():
    """The map of the code is in the packages' docstrings: each module (``layout.py``, or ``layout``)
    and each subpackage (``optim/``) is named in its package's docstring, or in an enclosing
    package's by its path inside it (``engines/mpi.py``, or ``mpi.py`` in a map that names its room
    ``engines/``); the root's names every package."""
    packages = sorted(p.parent for p in ROOT.rglob("__init__.py") if ROOT / "tests" not in p.parents
                      and not any(part.startswith(".") or part.endswith(".egg-info") for part in p.parts))
    assert ROOT in packages and ROOT / "parallel" / "optim" in packages, packages
    missing = []
    for package in packages:
        for item in sorted(package.iterdir()):
            if item.name == "__init__.py" or not (item.suffix == ".py" or (item / "__init__.py").is_file()):
                continue
            if package == ROOT:
                named = f"meshkit.{item.name}" in _docstring(ROOT)
            else:
                enclosing = [p for p in packages if p != ROOT and (p == package or p in package.parents)]
                named = False
                for outer in enclosing:
                    inner = item.relative_to(outer).as_posix()
                    text = _docstring(outer)
                    rooms = item.relative_to(outer).parts[:-1]  # a map by room: "``engines/``", then "mpi.py"
                    named |= (f"{inner}/" if item.is_dir() else inner) in text or \
                        (outer == package and f"``{item.stem}``" in text) or \
                        (bool(rooms) and item.name in text and all(f"{room}/" in text for room in rooms))
            top = item.relative_to(ROOT).parts[0]
            if not named and top not in MAP_PENDING:
                missing.append(item.relative_to(ROOT).as_posix())
    assert not missing, f"not named in its package's docstring: {missing}"


def test_the_readme_lists_the_packages_and_names_every_script():
    """The README's map ("How the code is organised") has a line for each package (its docstring
    holds the rest), and names every script of examples/ and benchmarks/ by its file name."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## How the code is organised", 1)[1].split("\n## ", 1)[0]
    entries = dict(re.findall(r"(?ms)^- `(\w+)/`:(.*?)(?=^- `|^\S|\Z)", section))
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name != "tests"}
    assert packages <= set(entries), sorted(packages - set(entries))
    missing = [f"{folder}/{path.name}" for folder in ("examples", "benchmarks")
               for path in sorted((ROOT / folder).glob("*.py")) if f"`{path.name}`" not in entries[folder]]
    assert not missing, f"not named in the README's map: {missing}"


def test_the_docs_cite_no_tracker_numbers():
    # the pages describe the library as it is; an issue's number means nothing to a reader
    found = [f"{page.relative_to(ROOT)}:{n}" for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
             for n, line in enumerate(page.read_text().splitlines(), 1)
             if re.search(r"\bissues? #?\d+", line, re.IGNORECASE)]
    assert not found, found
