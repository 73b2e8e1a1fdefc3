"""No import circle among python/lantern's modules.

The graph is built with ``ast`` from every ``import`` / ``from ... import`` statement in the package, at module
level and inside functions alike: a function-local import is still an edge (it runs whenever the function does,
and a circle through it is the same tangle of layers, only deferred to run time). ``from X import name`` is an
edge to the submodule ``X.name`` when there is one; else to ``X`` when ``name`` is bound at the top level of ``X``
(a function, a class, a variable or a name it imports); else to nothing (a compiled extension such as
``lantern._C`` is no Python module of the package). The implicit import of a
module's parent packages is not an edge: a package's ``__init__`` re-exporting its own submodules is how
packages are built, not a circle.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set

import pytest

PACKAGE = "lantern"
ROOT = Path(__file__).resolve().parents[1] / "python" / PACKAGE


def module_files(root: Path = ROOT) -> Dict[str, Path]:
    """dotted module name -> its file, for every .py file under the package."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _resolve(module: str, is_package: bool, level: int, target: Optional[str]) -> str:
    """The absolute name of a relative import's base (``from ..x import y`` in ``module``: level 2, target x)."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def top_level_names(path: Path) -> Set[str]:
    """The names a module binds at its top level (definitions, assignments, imports)."""
    names = set()
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def imports_of(module: str, path: Path, files: Dict[str, Path]) -> Set[str]:
    """The package's modules that ``module`` imports anywhere in its file (module docstring)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            bound = top_level_names(files[base]) if base in files else set()
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files or alias.name not in bound | {"*"}
                     else base for alias in node.names]
        else:
            continue
        for name in names:
            if name in files and name.split(".")[0] == PACKAGE and name != module:
                found.add(name)
    return found


def import_graph(root: Path = ROOT) -> Dict[str, Set[str]]:
    files = module_files(root)
    return {module: imports_of(module, path, files) for module, path in files.items()}


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One import circle as [a, b, ..., a], or None (depth-first search, colouring the modules on the path)."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(module: str) -> Optional[List[str]]:
        state[module] = 1
        path.append(module)
        for other in sorted(graph.get(module, ())):
            if state.get(other) == 1:
                return path[path.index(other):] + [other]
            if other not in state:
                cycle = visit(other)
                if cycle:
                    return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def test_the_package_has_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_graph_sees_module_level_and_function_local_imports(tmp_path):
    """Negative control: a package with a circle through a function-local relative import is caught, and one
    without is not."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("from .sub import b\n\ndef f():\n    return b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def g():\n    from ..a import f\n    return f\n")
    graph = import_graph(pkg)
    assert graph["lantern.a"] == {"lantern.sub.b"} and graph["lantern.sub.b"] == {"lantern.a"}
    assert find_cycle(graph) == ["lantern.a", "lantern.sub.b", "lantern.a"]
    (pkg / "sub" / "b.py").write_text("def g():\n    from .. import _C\n")  # an extension: no module here
    assert find_cycle(import_graph(pkg)) is None
    (pkg / "sub" / "b.py").write_text("def g():\n    from .. import f\n")  # bound in lantern/__init__.py
    assert find_cycle(import_graph(pkg)) == ["lantern", "lantern.a", "lantern.sub.b", "lantern"]


@pytest.mark.parametrize("module,is_package,level,target,expected", [
    ("lantern.cli.generate", False, 2, "decoding", "lantern.decoding"),
    ("lantern.cli", True, 1, "generate", "lantern.cli.generate"),
    ("lantern.sampling", False, 1, None, "lantern"),
    ("lantern.x", False, 0, "lantern.ops", "lantern.ops"),
])
def test_relative_imports_resolve(module, is_package, level, target, expected):
    assert _resolve(module, is_package, level, target) == expected



@pytest.mark.slow  # a process of its own: ~2 s
def test_importing_lantern_leaves_the_compiler_unimported():
    """``import lantern`` and ``lantern --help`` do not import torch._dynamo or inductor (dynamo alone took 1.3 s
    here, more than lantern's own import): every CLI process pays for what the package imports."""
    import subprocess
    import sys

    code = ("import contextlib, io, sys, lantern\n"
            "from lantern.cli import main\n"
            "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "    main(['--help'])\n"
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_the_source_digest_changes_with_any_module(tmp_path, monkeypatch):
    """The AOT packages' names and the cost models' staleness stamp digest lantern's source: a changed module
    (here a copy of the package with one line added) gives another digest."""
    import shutil

    import lantern
    from lantern import _version

    root = Path(lantern.__file__).parent
    copy = tmp_path / "lantern"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("weights", "__pycache__", "*.so"))
    monkeypatch.setattr(_version, "__file__", str(copy / "_version.py"))
    monkeypatch.setattr(_version, "_SOURCE_DIGEST", None)
    before = _version.source_digest()
    with open(copy / "decoding" / "planner.py", "a") as f:
        f.write("\n# a change\n")
    monkeypatch.setattr(_version, "_SOURCE_DIGEST", None)
    assert _version.source_digest() != before
