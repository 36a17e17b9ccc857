"""MkDocs hook (mkdocs.yml ``hooks:``): adds the generated page recipes/reference.md, written from
the recipe's dataclasses (``hybridtrain.config.reference``) each time the site is built, so the
reference is never a checked-in copy that can fall behind ``src/hybridtrain/config/recipe.py``."""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))  # the tree being documented, installed or not

REFERENCE_PAGE = "recipes/reference.md"


def on_files(files, config):
    from hybridtrain.config.reference import page

    files.append(File.generated(config, REFERENCE_PAGE, content=page()))
    return files
