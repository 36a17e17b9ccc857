"""Recipes: YAML loading, defaults, overrides, ``${env:...}``, ``_target_``, dist_env.

The API the rest of hybridtrain uses::

    from hybridtrain.config import load_config, instantiate, apply_dist_env

    cfg = load_config("recipe.yaml", ["--training.max_steps=5"])   # ConfigNode
    recipe = recipe_config(cfg)               # typed sections: recipe.training.max_steps
    apply_dist_env(cfg.dist_env)              # before torch.cuda / torch.distributed
    cfg.training.max_steps                    # defaults are filled in
    model = instantiate(cfg.model)
    opt = instantiate(cfg.optimizer, params)  # call-site arguments are added
    raise ValueError(f"... ({cfg.training.where('global_batch_size')})")  # "recipe.yaml:12"

Every key, with its default, doc, range and unit, is written once: the dataclasses of
``src/hybridtrain/config/recipe.py``.
Nothing in this package imports torch.
"""

from hybridtrain.config.dist_env import apply_dist_env, apply_process_defaults, dist_env_vars
from hybridtrain.config.errors import ConfigError
from hybridtrain.config.instantiate import instantiate, resolve_target
from hybridtrain.config.loader import (
    Override,
    build_config,
    load_config,
    parse_overrides,
    parse_scalar,
)
from hybridtrain.config.node import ConfigNode
from hybridtrain.config.recipe import SECTIONS
from hybridtrain.config.sections import RecipeConfig, config_section, recipe_config
from hybridtrain.config.targets import DEFAULT_ALLOWED_PREFIXES, is_target_allowed

__all__ = [
    "ConfigError", "ConfigNode", "Override", "SECTIONS", "DEFAULT_ALLOWED_PREFIXES",
    "load_config", "build_config", "parse_overrides", "parse_scalar",
    "instantiate", "resolve_target", "is_target_allowed", "apply_dist_env",
    "apply_process_defaults",
    "dist_env_vars", "RecipeConfig", "config_section", "recipe_config",
]
