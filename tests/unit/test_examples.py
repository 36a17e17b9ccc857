"""Every recipe in examples/ loads against the recipe's dataclasses, and every `_target_` in it
resolves to a callable that accepts the recipe's keys (typos in shipped recipes fail here, not on a cluster)."""

import inspect
from pathlib import Path

import pytest

from hybridtrain.config import load_config
from hybridtrain.config.instantiate import resolve_target

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def _targets(node, path=()):
    if isinstance(node, dict):
        if "_target_" in node:
            yield path, node
        for k, v in node.items():
            yield from _targets(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _targets(v, path + (i,))


@pytest.mark.parametrize("recipe", EXAMPLES, ids=lambda p: p.name)
def test_recipe_loads_and_targets_resolve(recipe):
    cfg = load_config(recipe)
    found = list(_targets(cfg))
    assert found, f"{recipe.name} instantiates nothing"
    for path, node in found:
        fn = resolve_target(node["_target_"])
        params = inspect.signature(fn).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            continue
        keys = {k for k in node if not k.startswith("_")}
        assert keys <= set(params), f"{recipe.name}:{'.'.join(map(str, path))}: {keys - set(params)}"
