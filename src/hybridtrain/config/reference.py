"""The recipe reference: every section and key of ``recipe.py`` with its default, range or
choices, unit and doc, as Markdown. The docs site makes its page recipes/reference.md from it at
build time (the hook scripts/mkdocs_hooks.py); the page is never checked in.

    python -m hybridtrain.config.reference              # print the whole page
    python -m hybridtrain.config.reference training     # one section's table
"""

from __future__ import annotations

import json
import sys

from hybridtrain.config.recipe import SECTIONS, TOP_LEVEL_KEYS
from hybridtrain.config.recipe_fields import KeySpec, SectionSpec

__all__ = ["page", "section_table"]

HEADER = """\
# Recipe reference

Every key with its default, the values it accepts and its unit. This page is written from the
dataclasses of `src/hybridtrain/config/recipe.py`, where each key is defined once, when the docs
are built. An unknown key is an error that names the file, line and nearest valid key; a value
outside its range is refused when the recipe loads. Sections `model`, `tokenizer`, `dataset`,
`validation_dataset` are `_target_` mappings whose keys are the callable's arguments. How recipes
are written and overridden: [Recipes](index.md).
"""


def _code(value) -> str:
    return "`" + json.dumps(value) + "`"


def _accepts(spec: KeySpec) -> str:
    """What a key accepts besides its type: its range (an interval), its choices, null."""
    parts = []
    if spec.range is not None:
        parts.append(f"`{spec.range}`")
    if spec.choices:
        parts.append(", ".join(f"`{c}`" for c in spec.choices))
    if spec.types and type(None) in spec.types:
        parts.append("`null`")
    return " or ".join(parts)


def _table(keys: dict[str, KeySpec]) -> list[str]:
    out = ["| key | default | accepts | unit | meaning |", "|---|---|---|---|---|"]
    for name, spec in keys.items():
        doc = spec.doc.replace("|", "\\|")
        out.append(f"| `{name}` | {_code(spec.default)} | {_accepts(spec)} | {spec.unit or ''} "
                   f"| {doc} |")
    return out


def section_table(sec: SectionSpec) -> str:
    """One section: its heading, doc and (for a fixed section) its keys' table."""
    out = [f"## `{sec.name}`", "", f"{sec.doc[0].upper()}{sec.doc[1:]}"
           + (" (optional)." if sec.optional else ".")]
    if sec.keys:
        out += [""] + _table(sec.keys)
    return "\n".join(out)


def page() -> str:
    """The whole page: header, every section, the top-level keys."""
    parts = [HEADER] + [section_table(sec) for sec in SECTIONS.values()]
    parts.append("\n".join(["## Top level", ""] + _table(TOP_LEVEL_KEYS)))
    return "\n\n".join(parts) + "\n"


def main(argv: list[str]) -> int:
    if not argv:
        print(page(), end="")
        return 0
    unknown = [name for name in argv if name not in SECTIONS]
    if unknown:
        print(f"no section {', '.join(unknown)}; sections: {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    print("\n\n".join(section_table(SECTIONS[name]) for name in argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
