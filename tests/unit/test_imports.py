"""The package's import structure: no import circles (counting the imports inside functions and
under TYPE_CHECKING, which only hide a circle), every module imports on its own, and the config
package stays free of torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import hybridtrain

PACKAGE = Path(hybridtrain.__file__).parent
# Import edges a file owned by other work still has; each entry names what removes it.
PENDING: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("hybridtrain",) + path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports anywhere in its file (ancestors excluded: importing a
    submodule always runs its package's ``__init__`` first, which is no circle)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: None if is_pkg else -1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from pkg import sub` imports the submodule; `from pkg import name` the package
            targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix
                       for a in node.names]
        else:
            continue
        found |= {t for t in targets
                  if t in modules and t != name and not name.startswith(t + ".")}
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    for a, b in PENDING:
        graph[a].discard(b)
    circles = _cycles(graph)
    detail = ["  " + " <-> ".join(c) + ": " + "; ".join(
        f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in circles]
    assert not circles, "import circles:\n" + "\n".join(detail)


def test_every_module_imports_first():
    """Each module imported as the first hybridtrain module of a process (one child process;
    the hybridtrain modules are dropped from sys.modules between two imports). Each import runs
    every module body afresh; only the bytecode is compiled once per file (with no .pyc
    cache, as under PYTHONDONTWRITEBYTECODE, compiling again was 2/3 of this test's time)."""
    code = """
import importlib, importlib.machinery as im, sys, traceback
failed = []
compiled = {}

class CompileOnce(im.SourceFileLoader):
    def source_to_code(self, data, path, *, _optimize=-1):
        if path not in compiled:
            compiled[path] = super().source_to_code(data, path, _optimize=_optimize)
        return compiled[path]

class HybridtrainFinder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] != "hybridtrain":
            return None
        spec = im.PathFinder.find_spec(name, path, target)
        if spec is not None and type(spec.loader) is im.SourceFileLoader:
            spec.loader = CompileOnce(spec.name, spec.origin)
        return spec

sys.meta_path.insert(0, HybridtrainFinder)
for name in sys.argv[1:]:
    for m in [m for m in sys.modules if m == "hybridtrain" or m.startswith("hybridtrain.")]:
        del sys.modules[m]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ":\\n" + traceback.format_exc(limit=3))
print("\\n".join(failed))
"""
    names = [m for m in _modules() if m != "hybridtrain.__main__"]
    out = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True,
                         check=True, timeout=600)
    assert out.stdout.strip() == "", out.stdout


def test_config_imports_no_torch():
    code = ("import sys, hybridtrain.config, hybridtrain.config.dtypes, hybridtrain.cli; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _function_level_imports() -> list[tuple[Path, int, list[str]]]:
    """(file, line, source lines above and of it) of each package import inside a function."""
    out = []
    for path in _modules().values():
        text = path.read_text()
        lines = text.splitlines()

        def visit(node: ast.AST, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                    names = ([a.name for a in child.names] if isinstance(child, ast.Import)
                             else [child.module or ""])
                    if getattr(child, "level", 0) or any(n.split(".")[0] == "hybridtrain"
                                                         for n in names):
                        out.append((path, child.lineno,
                                    lines[max(child.lineno - 2, 0):child.end_lineno]))
                visit(child, in_function or isinstance(child, (ast.FunctionDef,
                                                               ast.AsyncFunctionDef)))

        visit(ast.parse(text, str(path)), False)
    return out


def test_function_level_imports_are_few_and_say_why():
    """An import inside a function hides an edge of the dependency graph: it is kept only for a
    cycle, an optional dependency or a light start-up, and says which in a comment on or above
    its line."""
    found = _function_level_imports()
    silent = [f"{p.relative_to(PACKAGE)}:{n}" for p, n, src in found
              if not any("#" in line for line in src)]
    assert not silent, "function-level imports without a reason comment: " + ", ".join(silent)
    assert len(found) <= 10, [f"{p.relative_to(PACKAGE)}:{n}" for p, n, _ in found]


def test_function_level_import_finder_sees_nested_and_relative_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "hybridtrain"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "import os\n"
        "from hybridtrain import b\n"
        "def f():\n"
        "    import json\n"
        "    # optional: needs x\n"
        "    from hybridtrain.b import g\n"
        "    def inner():\n"
        "        from . import b\n")
    (pkg / "b.py").write_text("def g():\n    pass\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    found = sorted((p.name, n, any("#" in s for s in src))
                   for p, n, src in _function_level_imports())
    assert found == [("a.py", 6, True), ("a.py", 8, False)]
