"""The loaded recipe as typed, frozen objects: the dataclasses of ``recipe.py``.

    recipe = recipe_config("recipe.yaml")      # or a loaded ConfigNode, or a dict
    recipe.training.max_steps                  # a field of TrainingSection
    raise ValueError(f"... ({recipe.training.where('max_steps')})")   # -> "recipe.yaml:12"
    TrainingSection(max_steps=3)               # a section made in code: its defaults, checked

A value is checked when its section is made (type, range, choices, the section's rules over
several keys), so once when the recipe loads (``loader.py``, naming the line). A section that is
a ``_target_`` mapping (``optimizer`` / ``lr_scheduler`` may be) stays the ``ConfigNode``; an
absent optional section (``peft``, ``evaluation``, ``benchmark``) is None; the open sections
(``model``, ``dataset``, ...) and ``dist_env`` stay ``ConfigNode`` (their keys are the target's
arguments, the variables' names).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from hybridtrain.config.errors import ConfigError
from hybridtrain.config.loader import build_config, load_config
from hybridtrain.config.node import ConfigNode
from hybridtrain.config.recipe import *  # noqa: F401,F403 (the section classes)
from hybridtrain.config.recipe import SECTION_TYPES, SECTIONS, TOP_LEVEL_KEYS, RecipeConfig
from hybridtrain.config.recipe import __all__ as _TYPES
from hybridtrain.config.recipe_fields import RecipeSection, with_node

__all__ = ["config_section", "recipe_config", "typed_section", *_TYPES]


def typed_section(name: str, node: ConfigNode | None) -> RecipeSection | ConfigNode | None:
    """The fixed section ``name`` of a loaded recipe as its typed object (a ``_target_``
    mapping stays the node; an absent optional section is None)."""
    if node is None or "_target_" in node:
        return node
    assert set(node) == set(SECTIONS[name].keys), f"section {name} was not loaded: {set(node)}"
    return with_node(SECTION_TYPES[name](**node), node)


def config_section(name: str, values: Mapping[str, Any] | RecipeSection | None = None):
    """The typed section ``name``: a section of a loaded recipe as it is, or ``values`` (a
    mapping of some keys) over its defaults, checked as a recipe is (an unknown key or a wrong
    type is a ``ConfigError`` naming it)."""
    if isinstance(values, RecipeSection):
        return values
    if isinstance(values, ConfigNode) and values.dotted_path() == name:
        return typed_section(name, values)  # loaded and checked already
    return typed_section(name, build_config({name: dict(values or {})})[name])


def _values(recipe: RecipeConfig) -> dict[str, Any]:
    """The recipe data of a ``RecipeConfig`` made in code (sections as plain dicts)."""
    out = {name: getattr(recipe, name) for name in (*SECTIONS, *TOP_LEVEL_KEYS)}
    return {name: v.to_dict() if isinstance(v, RecipeSection) else v for name, v in out.items()}


def recipe_config(cfg: Any) -> RecipeConfig:
    """The typed recipe of ``cfg``: a recipe path, a loaded ``ConfigNode``, a dict (checked as a
    recipe is), or a ``RecipeConfig`` (returned as it is once loaded; one made in code,
    ``RecipeConfig(training=TrainingSection(max_steps=3), model={...})``, is loaded as a dict
    of its values, so it has a tree too: ``to_yaml``, the ``_target_`` checks)."""
    if isinstance(cfg, RecipeConfig):
        return cfg if cfg.node is not None else recipe_config(_values(cfg))
    if isinstance(cfg, (str, os.PathLike)):
        cfg = load_config(cfg)
    elif isinstance(cfg, Mapping) and not isinstance(cfg, ConfigNode):
        cfg = build_config(dict(cfg))
    if not isinstance(cfg, ConfigNode):
        raise ConfigError(f"expected a recipe path, a loaded config or a dict, got {type(cfg)}")
    return RecipeConfig(node=cfg, **{
        name: typed_section(name, cfg[name]) if sec.kind == "fixed" else cfg[name]
        for name, sec in SECTIONS.items()},
        **{name: cfg[name] for name in TOP_LEVEL_KEYS})
