"""``HYBRIDTRAIN_*`` environment variables: each one the package reads is documented in the
README, and read when it is used, never into a module global at import time."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import hybridtrain

PACKAGE = Path(hybridtrain.__file__).parent
README = PACKAGE.parents[1] / "README.md"


def _sources():
    return sorted(PACKAGE.rglob("*.py"))


def test_every_variable_is_documented():
    used = {v for p in _sources() for v in re.findall(r"\bHYBRIDTRAIN_[A-Z0-9_]+", p.read_text())}
    section = README.read_text().split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    missing = sorted(used - set(re.findall(r"HYBRIDTRAIN_[A-Z0-9_]+", section)))
    assert not missing, f"not in the README's Environment variables section: {missing}"


def _module_level_environ_reads(path: Path) -> list[int]:
    """Lines that read os.environ / os.getenv outside any function or class body."""
    tree = ast.parse(path.read_text())
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            inside |= {id(n) for n in ast.walk(node)}
    return [n.lineno for n in ast.walk(tree) if id(n) not in inside
            and isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv")]


def test_no_variable_is_read_at_import_time():
    found = {str(p.relative_to(PACKAGE)): lines for p in _sources()
             for lines in [_module_level_environ_reads(p)] if lines}
    assert not found, f"environment read at import time (file: lines): {found}"
