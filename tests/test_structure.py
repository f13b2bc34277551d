"""The shape of the house: no import cycles, dependencies one way, packages as boundaries.

Imports are read from the source (``ast``), every one of them: at module level, inside
functions (lazy imports) and under ``if TYPE_CHECKING:``. A cycle through any of them is a
cycle a reader has to untangle, whether or not Python happens to resolve it.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def _parsed(path: Path) -> ast.Module:
    """``path``'s syntax tree, parsed once per test process (the tests here only read the trees)."""
    return ast.parse(path.read_text(), str(path))
#: Folders of the repository that are not part of the package.
NOT_PACKAGE = {"tests", "examples", "benchmarks", "build", "dist"}
#: What each top-level package may import from meshkit (checkpoint -> parallel -> tensor -> mesh -> comm;
#: ``state``, the boxes checkpoints read and write, on comm alone, below parallel and checkpoint; ``debug``, the
#: tools that read flight records, on comm alone too; ``plan``, the planner, on top of everything;
#: ``launch_protocol``, the names the launcher and the ranks share, standard library only, below launch, elastic
#: and comm, which import nothing else of each other).
ALLOWED = {
    "launch_protocol": set(),
    "comm": {"launch_protocol"},
    "mesh": {"comm"},
    "tensor": {"comm", "mesh"},
    "state": {"comm"},
    "parallel": {"comm", "mesh", "tensor", "state"},
    "checkpoint": {"comm", "mesh", "tensor", "state", "parallel"},
    "launch": {"launch_protocol"},
    "debug": {"comm"},
    "elastic": {"launch_protocol"},
    "plan": {"comm", "mesh", "tensor", "state", "parallel", "checkpoint"},
}


def _modules() -> dict[str, Path]:
    """``meshkit.x.y`` -> path, for every module of the package."""
    found = {"meshkit": ROOT / "__init__.py"}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in NOT_PACKAGE or rel.parts[0].startswith(".") or len(rel.parts) == 1:
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(["meshkit", *parts])] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """``(target module, imported names, line)`` for every meshkit import in a module."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(_parsed(path)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("meshkit"):
                continue
            names = [a.name for a in node.names]
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            out.extend((sub, [], node.lineno) for sub in submodules)
            rest = [n for n in names if f"{target}.{n}" not in MODULES]
            if rest or not submodules:
                out.append((target, rest, node.lineno))
        elif isinstance(node, ast.Import):
            out.extend((a.name, [], node.lineno) for a in node.names if a.name.startswith("meshkit"))
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _top(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_module_is_found():
    for expected in ("meshkit.comm.groups.group", "meshkit.comm.engines.engine", "meshkit.mesh.layout",
                     "meshkit.parallel.data_parallelism.ddp", "meshkit.state.boxes"):
        assert expected in MODULES


def test_pyproject_installs_every_package_of_the_tree():
    """A wheel (``pip install .``, not ``-e``) holds only the packages pyproject lists: one left out
    installs a meshkit whose ``import`` fails (context_parallelism was, until this test)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {m for m, path in MODULES.items() if path.name == "__init__.py"}
    assert on_disk - listed == set(), "packages on disk that pyproject.toml does not install"
    assert listed - on_disk == set(), "packages pyproject.toml lists that do not exist"


def test_no_import_cycles():
    """Tarjan's strongly connected components over module imports: every one must be a single module."""
    edges = {m: sorted({t for t, _, _ in GRAPH[m] if t in MODULES}) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges[v]:
                cycles.append(sorted(component))

    for module in sorted(MODULES):
        if module not in index:
            visit(module)
    assert not cycles, f"import cycles: {cycles}"


def test_packages_depend_one_way():
    wrong = []
    for module, imports in GRAPH.items():
        source = _top(module)
        if source is None:
            continue
        for target, _, line in imports:
            other = _top(target)
            if other is not None and other != source and other not in ALLOWED.get(source, set()):
                wrong.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, "imports against the layering (checkpoint -> parallel -> tensor -> mesh -> comm):\n" + \
        "\n".join(wrong)


def test_packages_import_each_other_only_through_their_public_names_or_seams():
    """``from ..comm import X`` with X in ``meshkit.comm.__all__``, or ``from ..comm._seams import X``
    with X in the seams' ``__all__`` (the convention of meshkit's docstring); never ``..comm.world``,
    another private module, or a name of neither list."""
    import importlib
    wrong = []
    for module, imports in GRAPH.items():
        source = _top(module)
        if source is None:
            continue
        for target, names, line in imports:
            other = _top(target)
            if other is None or other == source:
                continue
            where = f"{MODULES[module].relative_to(ROOT)}:{line}"
            if target not in (f"meshkit.{other}", f"meshkit.{other}._seams"):
                wrong.append(f"{where} imports the inner module {target}")
                continue
            public = set(importlib.import_module(target).__all__)
            wrong += [f"{where} imports {target}.{n}, not in its __all__" for n in names if n not in public]
    assert not wrong, "\n".join(wrong)


#: Base names that several modules of the package share, each with why the folder says which one is
#: meant. Any other shared name is two rooms with one name: rename one (``parallel/state_dict.py`` is
#: ``parallel/data_parallelism/full_state.py`` beside ``checkpoint/state_dict.py``).
SHARED_NAMES = {
    "__init__.py": "a package",
    "_seams.py": "what the package of its folder offers the others that is not user API",
    "errors.py": "the error types and message prefix of the package of its folder",
    "checks.py": "the argument checks (cheap, specific messages) of the package of its folder",
    "arrays.py": "NumPy or CuPy: comm's rule (host or device) and, in parallel, the conversions strategies make",
    "__main__.py": "the command line of the package of its folder (python -m meshkit.launch, meshkit.debug)",
}
#: checkpoint's modules that may reach the strategies: the bridge asking a strategy for its state, and
#: the package's front that re-exports it. The file I/O (writer, reader, plan, format, blocks, leaves...)
#: deals in meshkit.state's boxes and must not.
CHECKPOINT_BRIDGES = {"meshkit.checkpoint", "meshkit.checkpoint.state_dict"}


def _package_files() -> list[Path]:
    return [path for path in MODULES.values() if path.parent != ROOT or path.name != "__init__.py"]


def test_no_two_modules_share_a_name_unless_listed_with_a_reason():
    by_name: dict[str, list[str]] = {}
    for path in [*_package_files(), ROOT / "__init__.py"]:
        by_name.setdefault(path.name, []).append(path.relative_to(ROOT).as_posix())
    shared = {name: sorted(paths) for name, paths in by_name.items() if len(paths) > 1 and name not in SHARED_NAMES}
    assert not shared, f"one name, one room: rename one of each, or list the name with a reason: {shared}"
    assert by_name.get("errors.py") and by_name.get("_seams.py"), "the scan found nothing"


def test_no_module_is_named_setup_py():
    """``setup.py`` is setuptools' script; a module of that name (``parallel/setup.py`` was one) reads
    as the build to anyone opening the folder."""
    found = [p.relative_to(ROOT).as_posix() for p in _package_files() if p.name == "setup.py"]
    assert not found, found


def test_checkpoint_file_io_imports_nothing_of_the_strategies():
    """Followed through every import (lazy ones too): only the bridge reaches ``meshkit.parallel``."""
    io_modules = sorted(m for m in MODULES if _top(m) == "checkpoint" and m not in CHECKPOINT_BRIDGES)
    assert {"meshkit.checkpoint.writer", "meshkit.checkpoint.reader", "meshkit.checkpoint.leaves",
            "meshkit.checkpoint.plan", "meshkit.checkpoint.format", "meshkit.checkpoint.blocks"} <= set(io_modules)
    wrong = {}
    for start in io_modules:
        seen, todo, path_to = {start}, [start], {start: [start]}
        while todo:
            m = todo.pop()
            for target, _, _ in GRAPH[m]:
                if target in MODULES and target not in seen:
                    seen.add(target)
                    path_to[target] = [*path_to[m], target]
                    todo.append(target)
        reached = sorted(t for t in seen if _top(t) == "parallel")
        if reached:
            wrong[start] = " -> ".join(path_to[reached[0]])
    assert not wrong, f"checkpoint's file I/O reaches the strategies: {wrong}"
    assert any(_top(t) == "parallel" for t, _, _ in GRAPH["meshkit.checkpoint.state_dict"]), "the bridge moved"


#: Names that are not user API: what packages use of each other (their ``_seams``) and inner
#: machinery that was in an ``__all__`` in 0.1. No package's ``__all__`` may hold them.
SEAMS = {
    "comm": {"PreparedCollective", "prepare_collective", "PREPARED_OPS", "create_groups", "resolve_group",
             "current_world", "array_namespace", "is_device_array"},
    "mesh": {"host_names"},
    "tensor": {"local_shape_and_offset", "chunks"},
    "state": {"flat_range_boxes", "box_view", "load_pieces", "optimizer_state_views"},
    "parallel": {"GradientReducer", "ShardedStrategy", "Bucket", "BucketManager", "BufferPool", "assign_buckets",
                 "FlatLayout", "is_array", "flat_range_boxes", "load_pieces", "optimizer_state_views"},
}
#: A seam of one package that another offers its users on purpose: ``meshkit.parallel.array_namespace``
#: is how model code runs on NumPy and CuPy alike (the examples' models use it); comm's is the engines' rule.
USER_HELPERS = {"parallel": {"array_namespace"}}
#: Each name taken out of an ``__all__``: (old package, its new module).
MOVED = {
    **{("meshkit.comm", n): "meshkit.comm._seams" for n in SEAMS["comm"]},
    **{("meshkit", n): "meshkit.comm._seams" for n in SEAMS["comm"]},
    ("meshkit.mesh", "host_names"): "meshkit.mesh.device_mesh",
    ("meshkit.tensor", "local_shape_and_offset"): "meshkit.tensor._seams",
    **{("meshkit.parallel", n): "meshkit.parallel._seams"
       for n in ("ShardedStrategy", "load_pieces", "optimizer_state_views", "is_array")},
    **{("meshkit.parallel", n): "meshkit.parallel.data_parallelism.buckets"
       for n in ("Bucket", "BucketManager", "assign_buckets")},
    ("meshkit.parallel", "GradientReducer"): "meshkit.parallel.data_parallelism.reducer",
    ("meshkit.parallel", "BufferPool"): "meshkit.parallel.data_parallelism.pool",
    ("meshkit.parallel", "FlatLayout"): "meshkit.parallel.data_parallelism.flat",
    ("meshkit.parallel", "flat_range_boxes"): "meshkit.state._seams",
    **{("meshkit.launch", n): "meshkit.launch.cli" for n in ("ALLOCATOR_ENV", "THREAD_ENV_VARS")},
    **{("meshkit.launch", n): "meshkit.launch.job" for n in ("FAILURE_SETTLE_S", "KILL_GRACE_S", "TIMEOUT_EXIT_CODE")},
    ("meshkit.launch", "JOB_SECRET_ENV"): "meshkit.launch_protocol",
}


def test_no_seam_in_any_public_api():
    import importlib
    every = set().union(*SEAMS.values())
    packages = sorted(m for m in MODULES if MODULES[m].name == "__init__.py" and _top(m) != "launch")
    leaked = {}
    for name in packages:
        exported = set(importlib.import_module(name).__all__)
        for n in exported:
            _resolve(f"{name}.{n}")  # every name of an __all__ is there, and no deprecated one
        allowed = USER_HELPERS.get(_top(name) or "", set()) - SEAMS.get(_top(name) or "", set())
        if exported & (every - allowed):
            leaked[name] = sorted(exported & (every - allowed))
    assert not leaked, f"seams in a public __all__: {leaked}"
    for package in ("comm", "tensor", "state", "parallel"):  # what a _seams module offers is a seam, never user API
        seams = set(importlib.import_module(f"meshkit.{package}._seams").__all__)
        assert not seams & set(importlib.import_module(f"meshkit.{package}").__all__), package


def test_moved_names_still_import_from_their_old_place_with_a_warning_naming_the_new():
    """Documented as public in 0.1: one more release of the old spelling, as attribute and as from-import."""
    import importlib
    import warnings

    import pytest
    for (old, name), new in sorted(MOVED.items()):
        expected = getattr(importlib.import_module(new), name)
        with pytest.warns(DeprecationWarning, match=rf"^{old}\.{name} is not public API .* import it from {new} "):
            assert getattr(importlib.import_module(old), name) is expected
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            namespace: dict = {}
            exec(f"from {old} import {name} as got", namespace)
        assert namespace["got"] is expected
        assert [str(w.message).split(" is")[0] for w in caught] == [f"{old}.{name}"], (old, name)  # once
        assert caught[0].filename == "<string>", caught[0].filename  # at the importing line, not importlib's
    with pytest.raises(AttributeError, match="'meshkit.parallel' has no attribute 'nothing'"):
        importlib.import_module("meshkit.parallel").nothing


def _meshkit_uses(source: str | Path) -> list[tuple[str, str, int]]:
    """``(module, name, line)`` for every ``from meshkit.X import name`` and every ``meshkit.X.name``
    in a file or a code block, following aliases (``from meshkit import checkpoint as dcp``: ``dcp.save``)."""
    tree = ast.parse(source.read_text() if isinstance(source, Path) else source)
    aliases = {"meshkit": "meshkit"}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("meshkit"):
            out.extend((node.module, a.name, node.lineno) for a in node.names)
            aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and a.name.startswith("meshkit")})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in aliases:  # meshkit.a.b also gives meshkit.a: both used
                chain.reverse()
                out.append((".".join([aliases[inner.id], *chain[:-1]]), chain[-1], node.lineno))
    return out


def _outside_the_package() -> list[Path]:
    return sorted(p for folder in ("tests", "examples", "benchmarks") for p in (ROOT / folder).rglob("*.py"))


def test_the_repository_uses_no_moved_name():
    """The tests, examples and benchmarks import each moved name from its new place (no warning in the suite)."""
    wrong = [f"{path.relative_to(ROOT)}:{line} uses {module}.{name} (now {MOVED[module, name]})"
             for path in [*_outside_the_package(), *MODULES.values()] for module, name, line in _meshkit_uses(path)
             if (module, name) in MOVED]
    assert not wrong, "\n".join(wrong)


def _resolve(dotted: str):
    """``meshkit.a.b.c`` as an attribute chain, importing submodules on the way; warnings are errors."""
    import importlib
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        parts = dotted.split(".")
        obj = importlib.import_module(parts[0])
        for i, part in enumerate(parts[1:], 2):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                obj = importlib.import_module(".".join(parts[:i]))
        return obj


def test_what_the_readme_and_the_examples_use_is_user_api():
    """Every ``meshkit.x.y`` the README and docs/ name and every name the examples import from meshkit
    resolves with no warning, is in its module's ``__all__`` (a package's, or a public module's as
    ``meshkit.comm.engines.cuda_runtime.gpu_available``), and is no seam, whichever module it is taken from."""
    import importlib
    import re
    import types
    uses = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:  # the front page and its topics
        where, text = page.relative_to(ROOT).as_posix(), page.read_text()
        uses += [(where, 0, m) for m in re.findall(r"\bmeshkit(?:\.[A-Za-z_]\w*)+", text)]
        uses += [(where, 0, f"{module}.{name}") for block in re.findall(r"```python\n(.*?)```", text, re.S)
                 for module, name, _ in _meshkit_uses(block)]
    uses += [(path.relative_to(ROOT).as_posix(), line, f"{module}.{name}")
             for path in sorted((ROOT / "examples").glob("*.py")) for module, name, line in _meshkit_uses(path)]
    assert {"meshkit.parallel.data_parallel", "meshkit.checkpoint.save"} <= {u[2] for u in uses}, \
        "the scan missed what the README shows"
    seams = set().union(*SEAMS.values()) - set().union(*USER_HELPERS.values())
    wrong = []
    for where, line, dotted in uses:
        parts = dotted.split(".")
        objects = [_resolve(".".join(parts[:i])) for i in range(1, len(parts) + 1)]
        # the first name that is not a module (meshkit.ReduceOp in meshkit.ReduceOp.SUM) is what its module exports
        first = next((i for i, o in enumerate(objects) if not isinstance(o, types.ModuleType)), None)
        if any(p.startswith("_") for p in parts[:len(parts) if first is None else first + 1]):
            wrong.append(f"{where}:{line} {dotted} is private")
        elif first is not None and parts[first] not in objects[first - 1].__all__:
            wrong.append(f"{where}:{line} {dotted} is not in {'.'.join(parts[:first])}.__all__")
        elif first is not None and parts[first] in seams:
            wrong.append(f"{where}:{line} {dotted} is a seam, not user API")
    assert not wrong, "\n".join(wrong)
    assert _resolve("meshkit.tensor.DTensor") is importlib.import_module("meshkit.tensor.dtensor").DTensor


def test_what_the_benchmarks_import_resolves_without_a_warning():
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for module, name, _ in _meshkit_uses(path):
            _resolve(f"{module}.{name}")


def test_every_package_declares_all():
    import importlib
    for name in MODULES:
        if MODULES[name].name == "__init__.py":
            assert isinstance(getattr(importlib.import_module(name), "__all__", None), list), name


def test_import_meshkit_makes_every_package_an_attribute():
    code = ("import meshkit; meshkit.parallel.DistributedDataParallel; meshkit.mesh.DeviceMesh; "
            "meshkit.comm.ProcessGroup; meshkit.tensor.DTensor; meshkit.checkpoint.save; print('OK')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "OK", out.stderr


def test_import_meshkit_does_not_initialize_mpi():
    """MPI starts with ``init_process_group("mpi")``, not on import: a local job never starts it."""
    code = "import sys, meshkit; print('mpi4py.MPI' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


#: The MPI engine's modules, one concern each (issue 25.3): the engine, its datatypes, device staging,
#: CUDA-aware detection, the notice mailbox and the shared-memory path under it (its segment made over
#: MPI) import mpi4py; its wait policy needs none.
MPI_ENGINE = {"meshkit.comm.engines.mpi", "meshkit.comm.engines.mpi_datatypes", "meshkit.comm.engines.mpi_staging",
              "meshkit.comm.engines.mpi_ulfm", "meshkit.comm.engines.mpi_spares",
              "meshkit.comm.engines.mpi_cuda_aware", "meshkit.comm.engines.mpi_mailbox", "meshkit.comm.engines.mpi_polling",
              "meshkit.comm.engines.shm"}


def test_only_the_mpi_engine_imports_mpi4py_and_only_lifecycle_reaches_it_lazily():
    """Importing mpi4py initializes MPI: only the MPI engine's modules that need it import it, and the
    package reaches them from outside only inside a function of ``comm/setup/lifecycle.py`` (the ``mpi``
    backend chosen), so that neither ``import meshkit`` nor the wait policy starts MPI."""
    assert MPI_ENGINE <= set(MODULES), sorted(MPI_ENGINE - set(MODULES))
    importers, outside = set(), {}
    for module, path in MODULES.items():
        tree = _parsed(path)
        if any(isinstance(n, ast.ImportFrom) and (n.module or "").startswith("mpi4py") or isinstance(n, ast.Import)
               and any(a.name.startswith("mpi4py") for a in n.names) for n in ast.walk(tree)):
            importers.add(module)
        if module not in MPI_ENGINE:
            at_import = {t for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.ClassDef))
                         for t, _, line in GRAPH[module] if n.lineno <= line <= n.end_lineno}
            reached = {t for t, _, _ in GRAPH[module] if t in MPI_ENGINE}
            if reached:
                outside[module] = reached & at_import  # what importing the module would import
    assert importers == MPI_ENGINE - {"meshkit.comm.engines.mpi_polling"}, sorted(importers)
    assert outside == {"meshkit.comm.setup.lifecycle": set()}, outside
    code = "import sys, meshkit.comm.engines.mpi_polling; print('mpi4py.MPI' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def _in_repo(filename: str) -> str:
    """A frame's file as the README's map names it (relative to the repository root)."""
    path = Path(filename).resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def test_one_ddp_all_reduce_reaches_the_engine_in_five_calls():
    """mark_grad_ready -> Bucket.launch -> allreduce_hook -> ProcessGroup.all_reduce -> engine.all_reduce,
    each in the file the README's map names."""
    import inspect

    import numpy as np

    import meshkit
    from meshkit.comm import local
    from meshkit.comm._seams import current_world

    def body():
        ddp = meshkit.parallel.DistributedDataParallel({"w": np.ones(4)})
        engine = current_world().default_group.engine
        seen = []
        real = engine.all_reduce

        def spy(buf, op):
            frames = inspect.stack()[:8]
            seen.append(([f.function for f in frames], [_in_repo(f.filename) for f in frames],
                         [_defined_as(f.frame) for f in frames]))
            return real(buf, op)

        engine.all_reduce = spy
        ddp.zero_grad()
        ddp.mark_grad_ready("w", np.ones(4))
        ddp.finish_gradient_sync()
        return seen

    stacks = local.run(body, 1)[0]
    path, files, names = next(s for s in stacks if "mark_grad_ready" in s[0])  # not the per-sync agreement's
    chain = path[:path.index("mark_grad_ready") + 1][::-1]
    assert chain == ["mark_grad_ready", "launch", "allreduce_hook", "all_reduce", "spy"], chain
    where = files[:path.index("mark_grad_ready") + 1][::-1][:4]  # the files the README shows
    assert where == ["parallel/data_parallelism/reducer.py", "parallel/data_parallelism/buckets.py",
                     "parallel/data_parallelism/hooks.py", "comm/groups/group.py"], where
    # the README's chain names each frame by the class that defines it (GradientReducer's: DDP holds one, and its
    # mark_grad_ready is the reducer's bound method, parallel/forwarding.py)
    block = (ROOT / "README.md").read_text().split("One all-reduce, from DDP to MPI, is five calls", 1)[1]
    rows = [line.strip().removeprefix("-> ").split() for line in block.split("```")[1].strip().splitlines()]
    assert [r[0] for r in rows[:4]] == names[:path.index("mark_grad_ready") + 1][::-1][:4], (rows, names)
    assert [r[1] for r in rows[:4]] == where, rows


def _defined_as(frame) -> str:
    """``Class.method`` of the class whose own method runs in ``frame`` (not the instance's class), else the
    function's name: what the README's chain shows (``co_qualname`` needs Python 3.11)."""
    name, owner = frame.f_code.co_name, frame.f_locals.get("self")
    for cls in type(owner).__mro__ if owner is not None else ():
        if getattr(cls.__dict__.get(name), "__code__", None) is frame.f_code:
            return f"{cls.__name__}.{name}"
    return name


def test_a_queued_bucket_reaches_the_engine_from_the_group_queue():
    """A bucket completed while an earlier one reduces is queued and started by
    CollectiveQueue.advance (comm/groups/execution.py) -> RequestWork.start (comm/groups/work.py) -> engine.all_reduce
    (as the README says); every bucket's reduction takes one of the two documented paths."""
    import inspect

    import numpy as np

    import meshkit
    from meshkit.comm import local
    from meshkit.comm._seams import current_world

    def body():
        # 3 buckets of one 1 MB gradient each (caps of 1 MB)
        params = {f"w{i}": np.ones(1 << 17) for i in range(3)}
        ddp = meshkit.parallel.DistributedDataParallel(params, bucket_cap_mb=1, first_bucket_cap_mb=1)
        engine = current_world().default_group.engine
        seen, files = [], []
        real = engine.all_reduce

        def spy(buf, op):
            if buf.size == 1 << 17:  # a bucket, not the per-sync agreement
                frames = inspect.stack()[1:4]
                seen.append([f.function for f in frames])
                files.append([_in_repo(f.filename) for f in frames])
            return real(buf, op)

        engine.all_reduce = spy
        for _ in range(5):
            ddp.zero_grad()
            for name in reversed(params):
                ddp.mark_grad_ready(name, np.ones(1 << 17))
            ddp.finish_gradient_sync()
        return seen, files, [float(ddp.grads[n][0]) for n in params]

    for stacks, files, grads in local.run(body, 2):
        assert grads == [1.0, 1.0, 1.0]
        assert len(stacks) == 15
        direct = ["all_reduce", "allreduce_hook", "launch"]
        queued = ["start", "advance"]
        assert all(s == direct or s[:2] == queued for s in stacks), stacks
        assert any(s[:2] == queued for s in stacks), "no bucket was ever queued: the test proves nothing"
        # the files the README shows for each path
        assert all(f == ["comm/groups/group.py", "parallel/data_parallelism/hooks.py", "parallel/data_parallelism/buckets.py"]
                   if s == direct else
                   f[:2] == ["comm/groups/work.py", "comm/groups/execution.py"] for s, f in zip(stacks, files)), files


#: Private attributes that comm's modules read or call on objects other than ``self``/``cls`` (and
#: other than a module's, as ``sys._getframe``), each with why. Anything else is a private call or
#: read across objects: declare what one object asks of another as public methods of a declared
#: interface (``WorkOwner`` in comm/groups/work.py: what a RequestWork asks of its group's queue; the group's
#: ``queue`` and ``failures``; ``EngineCapabilities``) instead.
CROSS_OBJECT_PRIVATE = {
    **{("comm/groups/work.py", name): "Work and CommThread are one mechanism, in one module: a queued Work knows "
       "its thread (_queue, _owner), the thread completes it (_finish) and counts its waiters (_cond), "
       "and names it in an error (_what)" for name in ("_queue", "_owner", "_finish", "_cond", "_what")},
    ("comm/collectives.py", "_with_outputs"): "the module-level collectives name their output arrays, the "
                                              "value of the Work's future (torch's get_future())",
    ("comm/collectives.py", "_group_rank_of"): "the module-level functions translate a global rank with one "
                                               "dict lookup on the group's index (every call with a root or "
                                               "peer), raising their own message",
    **{("comm/engines/shm_small.py", name): "the channel's one-meeting calls, in a module of their own: a call "
       "here is a step of the channel's, so it writes the channel's header (_header), raises its mismatch "
       "(_compare) and looks at the missing ranks' lives (_check_alive) exactly as the channel's own calls do"
       for name in ("_header", "_compare", "_check_alive")},
}


def _cross_object_private(root: Path) -> list[tuple[str, str, int, str]]:
    """``(file, attribute, line, expression)`` for every ``x._name`` in comm with x not self/cls/a module."""
    found = []
    for path in sorted(p for p in (root / "comm").rglob("*.py") if p.parent.name != "stores"):
        tree = _parsed(path)
        modules = {(a.asname or a.name).split(".")[0] for node in ast.walk(tree)
                   if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            base = node.value
            if isinstance(base, ast.Name) and (base.id in ("self", "cls") or base.id in modules):
                continue
            found.append((path.relative_to(root).as_posix(), node.attr, node.lineno, ast.unparse(node)))
    return found


def test_no_undeclared_cross_object_private_access_in_comm():
    """Issue 25.3: ProcessGroup's parts (its queue, its failure state, the works it hands out, the
    progress agent, prepared collectives, lifecycle) ask each other only what is declared."""
    wrong = [f"{file}:{line}: {expr}" for file, attr, line, expr in _cross_object_private(ROOT)
             if (file, attr) not in CROSS_OBJECT_PRIVATE]
    assert not wrong, "private attributes read or called across objects (declare a public interface, or " \
                      "list them in CROSS_OBJECT_PRIVATE with a reason):\n" + "\n".join(wrong)
    used = {(file, attr) for file, attr, _, _ in _cross_object_private(ROOT)}
    assert not set(CROSS_OBJECT_PRIVATE) - used, f"listed but no longer used: {set(CROSS_OBJECT_PRIVATE) - used}"


def test_no_engine_is_probed_with_getattr_or_hasattr():
    """An engine declares what it can do (``EngineCapabilities``, comm/engines/engine.py) and has every method of
    the Engine protocol; nothing asks ``getattr(engine, ...)``/``hasattr(engine, ...)`` (issue 25.3), except
    comm/setup/backends.py's ``check_engine``, which checks a registered backend's engine has them (issue 26.5)."""
    check = _method(ROOT / "comm/setup/backends.py", None, "check_engine")
    wrong = []
    for module, path in MODULES.items():
        for node in ast.walk(_parsed(path)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and node.args and "engine" in ast.unparse(node.args[0]).lower()
                    and not (module == "meshkit.comm.setup.backends" and check.lineno <= node.lineno <= check.end_lineno)):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not wrong, "\n".join(wrong)


def _private_module_imports(graph: dict[str, list[tuple[str, list[str], int]]]) -> list[str]:
    """Imports of a private module (``_name``, other than ``_seams``) from outside the package holding it."""
    wrong = []
    for module, imports in graph.items():
        package = module if MODULES.get(module, Path()).name == "__init__.py" else module.rsplit(".", 1)[0]
        for target, _, line in imports:
            parent, _, last = target.rpartition(".")
            if last.startswith("_") and not last.startswith("__") and last != "_seams" and parent != package:
                wrong.append(f"{module}:{line} imports the private module {target}")
    return wrong


def test_no_package_imports_another_packages_private_module():
    """A module named as private (``_x.py``) is its package's own; another package (a subpackage too) reaches
    it only through that package's ``_seams`` (issue 25). The check itself is tested on a planted import."""
    assert not _private_module_imports(GRAPH), "\n".join(_private_module_imports(GRAPH))
    planted = {"meshkit.parallel.optim.sgd": [("meshkit.parallel.data_parallelism._flat", [], 3),
                                              ("meshkit.comm._seams", [], 4)],
               "meshkit.parallel.data_parallelism.buckets": [("meshkit.parallel.data_parallelism._flat", [], 5)]}
    assert _private_module_imports(planted) == [
        "meshkit.parallel.optim.sgd:3 imports the private module meshkit.parallel.data_parallelism._flat"]


def _method(path: Path, cls: str | None, name: str) -> ast.FunctionDef:
    tree = _parsed(path)
    body = tree.body if cls is None else next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    return next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_process_group_holds_its_parts_instead_of_inheriting_them():
    """Issue 25.3: no mixins; the queue and the failure state are objects that declare their state."""
    from meshkit.comm.groups.execution import CollectiveQueue
    from meshkit.comm.groups.failures import FailureState
    from meshkit.comm.groups.group import ProcessGroup
    assert ProcessGroup.__mro__ == (ProcessGroup, object), ProcessGroup.__mro__
    for cls in (ProcessGroup, CollectiveQueue, FailureState):
        assert "__slots__" in cls.__dict__, f"{cls.__name__} does not declare its state"


def test_all_reduce_takes_the_path_every_collective_takes():
    """Issue 25.3: ProcessGroup.all_reduce is no hand-inlined copy of the generic path: it calls the
    same phases of the group's queue, in the same order, as CollectiveQueue.run (and makes the engine
    call itself, for DDP's five calls)."""
    def phases(fn: ast.FunctionDef, owner: str) -> list[str]:
        calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and isinstance(n.func.value, ast.Name) and n.func.value.id == owner]
        return [c.func.attr for c in sorted(calls, key=lambda c: (c.lineno, c.col_offset))]
    run = phases(_method(ROOT / "comm/groups/execution.py", "CollectiveQueue", "run"), "self")
    all_reduce = phases(_method(ROOT / "comm/groups/group.py", "ProcessGroup", "all_reduce"), "queue")
    assert run == ["behind_tasks", "run", "issue", "enqueue", "start_failed", "started"], run
    assert all_reduce == ["behind_tasks", "issue", "averaged", "enqueue", "start_failed", "started"], all_reduce
    assert [p for p in run if p != "run"] == [p for p in all_reduce if p != "averaged"]


def test_every_engine_declares_its_capabilities():
    """Each engine class says what it can do beyond the common operations (comm/engines/engine.py's
    EngineCapabilities), instead of being probed with getattr/hasattr."""
    missing = []
    for file, cls in (("comm/engines/mpi.py", "MPIEngine"), ("comm/engines/local_engine.py", "LocalEngine"),
                      ("comm/engines/nccl.py", "NCCLEngine")):
        tree = _parsed(ROOT / file)
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
        declared = [n for n in body if isinstance(n, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "capabilities" for t in n.targets)
            and isinstance(n.value, ast.Call) and ast.unparse(n.value.func) == "EngineCapabilities"]
        if not declared:
            missing.append(f"{file}: {cls}")
    assert not missing, missing


def _stdlib_only(path: Path) -> list[str]:
    """The imports of a file that are not of the standard library."""
    wrong = []
    for node in ast.walk(_parsed(path)):
        if isinstance(node, ast.ImportFrom):
            if node.level or (node.module or "").split(".")[0] not in sys.stdlib_module_names | {"__future__"}:
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}")
        elif isinstance(node, ast.Import):
            wrong += [f"{path.relative_to(ROOT)}:{node.lineno}" for a in node.names
                      if a.name.split(".")[0] not in sys.stdlib_module_names]
    return wrong


def test_the_launch_protocol_has_one_home_that_both_sides_import():
    """The launcher-to-rank names (environment variables, status files, milestones) are written once, in
    meshkit.launch_protocol (standard library only: the rank bootstrap loads it by path), and no other
    module of the package spells one of its variables."""
    import importlib

    protocol = importlib.import_module("meshkit.launch_protocol")
    assert _stdlib_only(ROOT / "launch_protocol" / "__init__.py") == []
    variables = {getattr(protocol, n) for n in protocol.__all__ if n.endswith("_ENV")}
    assert len(variables) >= 12, variables
    spelled = [f"{path.relative_to(ROOT)}:{node.lineno} spells {node.value!r}"
               for name, path in MODULES.items() if _top(name) != "launch_protocol"
               for node in ast.walk(_parsed(path))
               if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in variables]
    assert not spelled, "\n".join(spelled)
    users = {_top(m) for m, imports in GRAPH.items() for target, _, _ in imports if _top(target) == "launch_protocol"}
    assert users == {"comm", "launch", "elastic"}, users


def test_launch_exports_no_constants():
    import importlib

    launch = importlib.import_module("meshkit.launch")
    constants = [n for n in launch.__all__ if n.isupper()]
    assert not constants, constants


#: Modules that gather objects for another reason than comparing the ranks' arguments, with the reason.
GATHER_FACTS = {
    "meshkit.comm.objects": "defines all_gather_object",
    "meshkit.comm.agree": "the one agreement",
    "meshkit.mesh.device_mesh": "host names and GPUs, to group ranks by host (facts, not arguments)",
    "meshkit.debug.server": "the debug servers' addresses, so that every rank's /all can reach the others",
    "meshkit.parallel.expert_parallelism.expert_strategy": "full_state_dict gathers the experts' blocks and their "
                                                           "offsets (the data, not arguments)",
    "meshkit.parallel.survive": "shrink gathers the survivors' shards and buddy copies of a sharded strategy (the "
                                "data, not arguments; parallel/buddy.py)",
}


#: What a function named ``agree``/``_agree``/``agree_*`` may call to agree: comm's agree() (as itself or
#: ``comm_agree``, where the module's own function is called agree), a wrapper of it, or the strategies' per-step
#: pass agreement (``_agreement``: one all_reduce of rows per sync, data_parallelism/protocol.py, whose failure
#: path goes through agree()).
AGREE_CALLS = {"agree", "comm_agree", "_agree", "check_same_arguments", "_agreement"}


def test_one_agree():
    """Every rank agrees on its arguments, or all raise the same error, through comm's one agree()
    (comm/agree.py): no other module of the package gathers objects to compare them, and a function
    named for an agreement (``agree``, ``_agree``, ``agree_on_load``...) is a wrapper that calls it."""
    gathers, own = [], []
    for name, path in MODULES.items():
        tree = _parsed(path)
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
        if name not in GATHER_FACTS:
            gathers += [f"{path.relative_to(ROOT)}:{c.lineno}" for c in calls
                        if ast.unparse(c.func).split(".")[-1] == "all_gather_object"]
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and fn.name.lstrip("_").split("_")[0] == "agree" and \
                    name != "meshkit.comm.agree":
                called = {ast.unparse(c.func).split(".")[-1] for c in ast.walk(fn) if isinstance(c, ast.Call)}
                if not called & AGREE_CALLS:
                    own.append(f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name}")
    assert not gathers, "objects gathered outside comm's agree():\n" + "\n".join(gathers)
    assert not own, "agreements that do not go through comm's agree():\n" + "\n".join(own)


def test_one_way_to_name_ranks():
    """"rank 3" / "ranks [0, 2]" is written once (comm/naming.py); launch, which imports nothing of comm,
    names ranks its own way ("ranks 1, 2", after a launcher's listing)."""
    import re

    pattern = re.compile(r"""f"rank \{[^}]*\[0\]\}[^"]*"\s+if\s+len\(""")
    copies = [str(path.relative_to(ROOT)) for name, path in MODULES.items()
              if name != "meshkit.comm.naming" and _top(name) != "launch" and pattern.search(path.read_text())]
    assert not copies, copies


#: The library's strategy classes (and the parts some hold): what a caller would dispatch on.
STRATEGY_CLASSES = {"DistributedDataParallel", "ZeroRedundancyOptimizer", "FullyShardedDataParallel", "LocalStrategy",
                    "Composite", "ExpertStrategy", "ShardedStrategy", "GradientReducer", "ReplicatedUnits"}


def test_examples_and_checkpoint_never_isinstance_a_strategy_class():
    """Issue 37.1: every strategy answers the one Protocol, so no example and no checkpoint code
    dispatches on a strategy's class (``isinstance(strategy, Strategy)``, the Protocol itself, checks a
    type and stays allowed). A class an example defines with ``mark_grad_ready`` and ``step`` counts as a
    strategy too (train_transformer's ``Experts`` was one, tested with ``isinstance`` twice)."""
    found = []
    for folder in ("examples", "checkpoint"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = _parsed(path)
            local_strategies = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                                and {"mark_grad_ready", "step"} <= {f.name for f in node.body
                                                                    if isinstance(f, ast.FunctionDef)}}
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2):
                    continue
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                names = {k.id if isinstance(k, ast.Name) else k.attr if isinstance(k, ast.Attribute) else "" for k in kinds}
                if names & (STRATEGY_CLASSES | local_strategies):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def test_examples_compose_through_the_library_recipe():
    """A model whose parts differ is composed by ``meshkit.parallel.parallelize_model``: no example builds a
    ``Composite`` or an ``ExpertStrategy`` itself (train_transformer's ``build`` did, by hand)."""
    found = []
    for path in sorted((ROOT / "examples").rglob("*.py")):
        for node in ast.walk(_parsed(path)):
            names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else \
                [node.attr] if isinstance(node, ast.Attribute) else [node.id] if isinstance(node, ast.Name) else []
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n in ("Composite", "ExpertStrategy")]
    assert not found, found
    assert "parallelize_model" in (ROOT / "examples" / "train_transformer.py").read_text()


#: The parts strategies hold (``self.reducer``, ``self.shards``, ``self.replicated``): never a base class.
STRATEGY_PARTS = {"GradientReducer", "Shards", "ReplicatedUnits"}


def _parallel_classes() -> list[type]:
    """Every class defined in a module of meshkit.parallel (importing them all)."""
    import importlib
    import inspect
    found = []
    for name in sorted(m for m in MODULES if m.startswith("meshkit.parallel.") or m == "meshkit.parallel"):
        module = importlib.import_module(name)
        found += [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == name]
    return found


def _inherited_parts(classes: list[type]) -> list[str]:
    """Classes that inherit a strategy or a strategy's part: a strategy (a class with every method of the
    Strategy Protocol, the Protocol itself aside) whose MRO holds any class but itself and ``object``, or
    any class deriving from a part (whatever it is)."""
    from meshkit.parallel.strategy import PROTOCOL_METHODS
    wrong = []
    for cls in classes:
        is_strategy = all(hasattr(cls, m) for m in PROTOCOL_METHODS) and not getattr(cls, "_is_protocol", False)
        bases = [b.__name__ for b in cls.__mro__[1:] if b is not object]
        if is_strategy and bases:
            wrong.append(f"strategy {cls.__module__}.{cls.__name__} inherits {bases}")
        elif set(bases) & STRATEGY_PARTS:
            wrong.append(f"{cls.__module__}.{cls.__name__} inherits the part {sorted(set(bases) & STRATEGY_PARTS)}")
    return wrong


def test_strategies_hold_their_parts_instead_of_inheriting_them():
    """Issue 37.1: no strategy of meshkit.parallel inherits another strategy, a reducer, the shards' surface or
    the units (it holds them: ``self.reducer``, ``self.shards``, ``self.replicated``, and declares what
    each asks of it: ``ReducerOwner``, ``ShardOwner``), and none of them or their parts raises
    ``NotImplementedError`` for a hook. The check catches a planted subclass (ZeRO's MRO was
    ``ReplicatedUnits -> GradientReducer -> ShardedStrategy``)."""
    import inspect

    from meshkit.parallel import DistributedDataParallel
    from meshkit.parallel.data_parallelism.reducer import GradientReducer

    classes = _parallel_classes()
    strategies = {c.__name__ for c in classes if c.__name__ in STRATEGY_CLASSES}
    assert strategies >= {"DistributedDataParallel", "ZeroRedundancyOptimizer", "FullyShardedDataParallel",
                          "LocalStrategy", "Composite", "ExpertStrategy"}, strategies
    assert not _inherited_parts(classes), "\n".join(_inherited_parts(classes))
    held = [c for c in classes if c.__name__ in STRATEGY_CLASSES | STRATEGY_PARTS]
    hooks = [c.__name__ for c in held if "NotImplementedError" in inspect.getsource(c)]
    assert not hooks, f"NotImplementedError hooks in {hooks}"

    class Mixed(GradientReducer):  # the old shape: a strategy built on the reducer
        pass

    class Derived(DistributedDataParallel):
        pass
    assert _inherited_parts([Mixed, Derived]) == [f"{__name__}.Mixed inherits the part ['GradientReducer']",
                                                  f"strategy {__name__}.Derived inherits ['DistributedDataParallel']"]


def test_forwarded_members_are_the_parts_own_with_their_signatures():
    """Issue 37.1: a strategy's member forwarded to a part it holds (``forward_to``, parallel/forwarding.py)
    is, on an instance, the part's own bound method (no frame of the strategy's when called: the hot path
    ``mark_grad_ready`` stays five frames from DDP to MPI), and on the class shows the part's method's
    name, signature and docstring (what ``help()`` and the Strategy Protocol's check read). DDP and ZeRO
    forward every public member of the reducer's they had when they inherited it, ZeRO and FSDP every one of
    the shards' surface. A member declared under another name than its target's is refused."""
    import inspect

    import numpy as np
    import pytest

    import meshkit
    from meshkit.comm import local
    from meshkit.parallel import SGD, data_parallel
    from meshkit.parallel.data_parallelism.reducer import GradientReducer
    from meshkit.parallel.data_parallelism.sharded import Shards
    from meshkit.parallel.forwarding import forward_attribute, forward_to

    surfaces = {"reducer": {"zero_grad", "mark_grad_ready", "no_sync", "sync_gradients", "finish_gradient_sync",
                            "buckets", "grads", "iteration", "find_unused_parameters"},
                "shards": {"grad_shards", "state_dict", "load_state_dict", "full_state_dict", "load_full_state_dict",
                           "sharded_state_dict", "load_sharded_state_dict", "memory_report"}}

    def build() -> dict[str, list[str]]:
        mesh = meshkit.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        problems: dict[str, list[str]] = {}
        for kind, parts in (("ddp", ["reducer"]), ("zero1", ["reducer", "shards"]), ("zero2", ["reducer", "shards"]),
                            ("fsdp", ["shards"])):
            model = data_parallel({"w": np.ones((2, 3)), "b": np.zeros(3)}, mesh, kind, optimizer=SGD(lr=0.1))
            cls, wrong = type(model), problems.setdefault(kind, [])
            members = {n: m for n, m in vars(cls).items() if isinstance(m, (forward_to, property)) and hasattr(m, "part")}
            for part in parts:
                if {n for n, m in members.items() if m.part == part} != surfaces[part]:
                    wrong.append(f"forwards {sorted(n for n, m in members.items() if m.part == part)} to {part}")
            for name, member in members.items():
                held = getattr(model, member.part)
                if isinstance(member, forward_to):
                    target = getattr(type(held), name)
                    bound = getattr(model, name)
                    if not (bound.__self__ is held and bound.__func__ is target and member.__wrapped__ is target):
                        wrong.append(f"{name} is not {member.part}'s bound method")
                    if (inspect.signature(getattr(cls, name)) != inspect.signature(target)
                            or getattr(cls, name).__doc__ != target.__doc__ or getattr(model, name) is not bound):
                        wrong.append(f"{name} does not show {type(held).__name__}.{name}'s signature and docstring")
                elif getattr(model, name) != getattr(held, name):
                    wrong.append(f"{name} is not {member.part}.{name}")
        return problems

    assert local.run(build, 2) == [{"ddp": [], "zero1": [], "zero2": [], "fsdp": []}] * 2

    class Owner:  # unbound calls reach the part; attributes are read live and are read-only
        mark_grad_ready = forward_to("part", GradientReducer.mark_grad_ready)
        iteration = forward_attribute("part", "iteration", doc="passes")

        def __init__(self, part: object) -> None:
            self.part = part

    class Part:
        iteration = 0

        def mark_grad_ready(self, name, grad=None):
            return ("marked", name, grad)

    owner = Owner(Part())
    assert Owner.mark_grad_ready(owner, "w", 1) == ("marked", "w", 1)
    owner.part.iteration = 3
    assert owner.iteration == 3 and Owner.iteration.__doc__ == "passes"
    with pytest.raises(AttributeError):
        owner.iteration = 4
    with pytest.raises((TypeError, RuntimeError)) as caught:  # Python 3.11 wraps __set_name__'s error in a RuntimeError
        type("Bad", (), {"step": forward_to("reducer", GradientReducer.sync_gradients)})
    error = caught.value if isinstance(caught.value, TypeError) else caught.value.__cause__
    assert isinstance(error, TypeError) and str(error).startswith(
        "meshkit.parallel: Bad.step forwards to self.reducer.sync_gradients: a forwarded member keeps its target's "
        "name"), repr(error)
    with pytest.raises(TypeError, match=r"forward_to: target must be a method of the part's class \(a function\), "
                                        r"got property"):
        forward_to("reducer", GradientReducer.buckets)
    with pytest.raises(TypeError, match=r"forward_to: part must be an attribute name, got 'self.reducer'"):
        forward_to("self.reducer", Shards.state_dict)


#: comm's rooms (comm/__init__.py's docstring maps them) and what each may import of comm. The
#: shared leaves at comm's top import no room; the user-facing modules at the top may import any.
COMM_LEAVES = {f"meshkit.comm.{m}" for m in ("errors", "env", "debug", "reduce_op", "arrays", "checks", "notices",
                                             "control", "job_end", "milestones", "files", "timeouts", "naming",
                                             "level_state")}
COMM_FRONT = {f"meshkit.comm.{m}" for m in ("collectives", "objects", "local", "levels", "breakpoints", "available",
                                            "_seams", "agree")} | {"meshkit.comm"}
COMM_ROOMS = {  # room: the rooms it may import besides itself and the leaves
    "engines": {"stores"},  # an engine knows nothing of the group that drives it, nor of set-up
    "groups": {"engines"},  # a group and its parts know nothing of how the world started
    "setup": {"engines", "groups", "stores"},
    "stores": set(),
}
#: Imports against the rooms, each with its reason (what is left for a later change to remove).
COMM_ROOM_EXCEPTIONS = {
    ("meshkit.comm.setup.lifecycle", "meshkit.comm.agree"): (
        "the right edge, not a leftover: agree() is comm's one way for every rank to agree or all raise, and "
        "init's check of the ranks' debug levels is one such agreement; init passes its own exchange (the world "
        "engine's, unnumbered, before any group call), so it uses the protocol alone, not the object collective "
        "agree() defaults to, which is why agree sits above the rooms and may not move into a leaf"),
}


def _comm_room(module: str) -> str | None:
    """The room of a comm module: ``engines``/``groups``/``setup``/``stores``, ``leaf``, ``front``, or None."""
    parts = module.split(".")
    if parts[:2] != ["meshkit", "comm"]:
        return None
    if len(parts) > 2 and parts[2] in COMM_ROOMS:
        return parts[2]
    if module in COMM_LEAVES:
        return "leaf"
    if module in COMM_FRONT:
        return "front"
    return "unplaced"


def _comm_room_violations(graph: dict[str, list[tuple[str, list[str], int]]]) -> list[str]:
    wrong = []
    for module, imports in graph.items():
        room = _comm_room(module)
        if room in (None, "front"):
            continue
        if room == "unplaced":
            wrong.append(f"{module} is in no room: add it to a room, COMM_LEAVES or COMM_FRONT")
            continue
        allowed = {room, "leaf"} | COMM_ROOMS.get(room, set())
        for target, _, line in imports:
            to = _comm_room(target)
            if to is not None and to not in allowed and (module, target) not in COMM_ROOM_EXCEPTIONS:
                wrong.append(f"{module}:{line} ({room}) imports {target} ({to})")
    return wrong


def test_comms_rooms_import_one_way():
    """The engine room imports nothing of the group room or set-up; the group room nothing of set-up; stores
    and the shared leaves nothing of any room. The check catches the import this issue inverted."""
    wrong = _comm_room_violations(GRAPH)
    assert not wrong, "imports against comm's rooms:\n" + "\n".join(wrong)
    used = {(m, t) for m, imports in GRAPH.items() for t, _, _ in imports}
    assert set(COMM_ROOM_EXCEPTIONS) <= used, f"listed but gone: {set(COMM_ROOM_EXCEPTIONS) - used}"
    planted = {**GRAPH, "meshkit.comm.engines.mpi_polling": [("meshkit.comm.groups.work", ["in_background"], 21)]}
    assert _comm_room_violations(planted) == [
        "meshkit.comm.engines.mpi_polling:21 (engines) imports meshkit.comm.groups.work (groups)"]


def test_the_comm_docstring_maps_every_module_of_comm():
    """comm/__init__.py's docstring names every module of comm, under its room."""
    import meshkit.comm
    doc = meshkit.comm.__doc__
    for path in sorted((ROOT / "comm").rglob("*.py")):
        rel = path.relative_to(ROOT / "comm")
        if rel.name == "__init__.py" or rel.parts[0] == "stores":
            continue
        assert f"    {rel.name} " in doc, f"comm's docstring does not map {rel}"


def test_no_engine_request_is_probed_with_getattr_or_hasattr():
    """What a request carries is declared (``engine.Received``: source, count, dtype; the watched ones by
    ``EngineCapabilities.watched_requests``), so nothing in comm probes a request, nor forwards its
    attributes blindly (``__getattr__``)."""
    wrong = []
    for path in sorted((ROOT / "comm").rglob("*.py")):
        for node in ast.walk(_parsed(path)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and node.args and "request" in ast.unparse(node.args[0]).lower()):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
            if (isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
                    and path.relative_to(ROOT).parts[:2] == ("comm", "engines")):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: a request forwarding by __getattr__")
    assert not wrong, "\n".join(wrong)


def test_the_gated_engine_methods_are_protocols_beside_the_capabilities():
    """Each capability flag that gates methods names a typing.Protocol declaring them, and every engine of
    meshkit that sets the flag has them with the Protocol's signatures."""
    import inspect
    import typing

    from meshkit.comm.engines import engine as interface
    assert all(getattr(p, "_is_protocol", False) for p in (*interface.GATED.values(), interface.DEVICE,
                                                            interface.HostEngine, interface.Received))
    classes = {}
    for file, cls in (("comm/engines/mpi.py", "MPIEngine"), ("comm/engines/local_engine.py", "LocalEngine"),
                      ("comm/engines/nccl.py", "NCCLEngine"), ("comm/engines/store_engine.py", "StoreEngine")):
        tree = _parsed(ROOT / file)
        classes[cls] = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    declared = {flag: interface.methods(p) for flag, p in interface.GATED.items()}
    checked = 0
    for cls, node in classes.items():
        defs = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}
        calls = [n.value for n in node.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                 and ast.unparse(n.value.func) == "EngineCapabilities"]
        flags = {kw.arg for call in calls for kw in call.keywords
                 if isinstance(kw.value, ast.Constant) and kw.value.value is True}
        for flag in flags & set(declared):
            for name in declared[flag]:
                assert name in defs, f"{cls} sets {flag} but has no {name}"
                want = [a for a in inspect.signature(getattr(interface.GATED[flag], name)).parameters if a != "self"]
                assert [a.arg for a in defs[name].args.args if a.arg != "self"] == want, (cls, name)
                checked += 1
    assert checked >= 6, checked  # NCCL's defer, abandon, coalescing (2), abort; local's announce
    assert typing.get_type_hints(interface.Engine.recv)["return"] is interface.Received


def test_comms_moved_modules_import_from_their_old_paths_with_a_warning():
    """The flat paths of 0.1 (``meshkit.comm.world``) import for one more release: the same module
    object, a DeprecationWarning naming the new path at the importing line, as attribute and from-import."""
    import importlib
    import sys
    import warnings

    import pytest

    import meshkit.comm
    from meshkit.comm.groups import world
    from meshkit.comm.setup import registry
    for old in ("world", "registry"):
        sys.modules.pop(f"meshkit.comm.{old}", None)
        vars(meshkit.comm).pop(old, None)
    with pytest.warns(DeprecationWarning, match=r"^meshkit\.comm\.world moved to meshkit\.comm\.groups\.world: "):
        assert importlib.import_module("meshkit.comm.world") is world
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        namespace: dict = {}
        exec("from meshkit.comm import registry as got", namespace)
    assert namespace["got"] is registry and registry.__spec__.name == "meshkit.comm.setup.registry"
    assert [str(w.message).split(" moved")[0] for w in caught] == ["meshkit.comm.registry"]
    assert caught[0].filename == "<string>", caught[0].filename  # at the importing line, not importlib's
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("meshkit.comm.nothing")
