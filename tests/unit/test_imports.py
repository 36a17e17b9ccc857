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
    the hybridtrain modules are dropped from sys.modules between two imports)."""
    code = """
import importlib, sys, traceback
failed = []
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
