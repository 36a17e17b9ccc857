"""The loaded recipe as typed, frozen objects: one dataclass per fixed section of ``schema.py``.

    recipe = recipe_config("recipe.yaml")      # or a loaded ConfigNode, or a dict
    recipe.training.max_steps                  # a field of TrainingSection
    raise ValueError(f"... ({recipe.training.where('max_steps')})")   # -> "recipe.yaml:12"

The section classes and ``RecipeConfig`` are source code (``section_types.py``), written by
``python scripts/gen_sections.py`` from ``schema.py``'s ``K`` entries (field names, types and
docs; the defaults stay there alone, filled in by the loader) and checked in; a test fails when
they are not current. A value is checked once, when the recipe loads (``loader.py``: type,
choices, minimum); these objects only carry it. A section that is a ``_target_`` mapping
(``optimizer`` / ``lr_scheduler`` may be) stays the ``ConfigNode``; an absent optional section
(``peft``, ``evaluation``, ``benchmark``) is None; the open sections (``model``, ``dataset``, ...)
stay ``ConfigNode`` (their keys are the target's arguments).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from hybridtrain.config.errors import ConfigError
from hybridtrain.config.loader import build_config, load_config
from hybridtrain.config.node import ConfigNode
from hybridtrain.config.schema import SECTIONS
from hybridtrain.config.section_base import RecipeSection, with_node
from hybridtrain.config.section_types import *  # noqa: F401,F403 (the generated classes)
from hybridtrain.config.section_types import SECTION_TYPES, RecipeConfig
from hybridtrain.config.section_types import __all__ as _TYPES

__all__ = ["RecipeSection", "config_section", "recipe_config", "typed_section", *_TYPES]

def typed_section(name: str, node: ConfigNode | None) -> RecipeSection | ConfigNode | None:
    """The fixed section ``name`` of a loaded recipe as its typed object (a ``_target_``
    mapping stays the node; an absent optional section is None)."""
    if node is None or "_target_" in node:
        return node
    cls = SECTION_TYPES[name]
    assert set(node) == set(SECTIONS[name].keys), f"section {name} was not loaded: {set(node)}"
    return with_node(cls(**node), node)


def config_section(name: str, values: Mapping[str, Any] | RecipeSection | None = None):
    """The typed section ``name``: a section of a loaded recipe as it is, or ``values`` (a
    mapping of some keys) over the schema's defaults, checked as a recipe is (an unknown key or
    a wrong type is a ``ConfigError`` naming it)."""
    if isinstance(values, RecipeSection):
        return values
    if isinstance(values, ConfigNode) and values.dotted_path() == name:
        return typed_section(name, values)  # loaded and checked already
    return typed_section(name, build_config({name: dict(values or {})})[name])


def recipe_config(cfg: Any) -> RecipeConfig:
    """The typed recipe of ``cfg``: a recipe path, a loaded ``ConfigNode``, a dict (checked as a
    recipe is), or a ``RecipeConfig`` (returned as it is)."""
    if isinstance(cfg, RecipeConfig):
        return cfg
    if isinstance(cfg, (str, os.PathLike)):
        cfg = load_config(cfg)
    elif isinstance(cfg, Mapping) and not isinstance(cfg, ConfigNode):
        cfg = build_config(dict(cfg))
    if not isinstance(cfg, ConfigNode):
        raise ConfigError(f"expected a recipe path, a loaded config or a dict, got {type(cfg)}")
    return RecipeConfig(node=cfg, **{
        name: typed_section(name, cfg[name]) if sec.kind == "fixed" else cfg[name]
        for name, sec in SECTIONS.items()})
