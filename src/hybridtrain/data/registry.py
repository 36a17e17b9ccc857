"""Datasets from outside the tree, found through the entry-point group ``hybridtrain.datasets``.

A package registers a builder in its pyproject.toml::

    [project.entry-points."hybridtrain.datasets"]
    my_lines = "my_package.data:build_my_lines"

and a recipe names it (no ``allowed_target_prefixes`` needed: installing the package is the
user's act)::

    dataset: {_target_: hybridtrain.data.registered_dataset, name: my_lines, path: ..., ...}

The builder takes the section's other keys, plus ``tokenizer`` and ``default_split`` when its
signature names them, and returns a :class:`~hybridtrain.data.contract.TokenDataset`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from hybridtrain.data.contract import TokenDataset, check_dataset

ENTRY_POINT_GROUP = "hybridtrain.datasets"
# what the commands offer every dataset builder; a builder gets those its signature names
OFFERED = ("tokenizer", "default_split")


def dataset_builder(name: str) -> Callable[..., TokenDataset]:
    """The builder registered as ``name`` in the entry-point group ``hybridtrain.datasets``."""
    found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    if name not in found:
        raise ValueError(f"no dataset named {name!r} is registered (entry-point group "
                         f"{ENTRY_POINT_GROUP!r}; registered: {', '.join(sorted(found)) or 'none'}"
                         "); pip install the package that provides it")
    try:
        return found[name].load()
    except Exception as e:  # a broken third-party package names itself
        raise ValueError(f"dataset entry point {name} = {found[name].value} (group "
                         f"{ENTRY_POINT_GROUP!r}) failed to load: {type(e).__name__}: {e}") from e


def registered_dataset(name: str, **options: Any) -> TokenDataset:
    """The dataset the builder registered as ``name`` makes of ``options``, checked against the
    data contract."""
    build = dataset_builder(name)
    params = inspect.signature(build).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in options.items()
              if k not in OFFERED or k in params or takes_any}
    return check_dataset(build(**kwargs), f"the dataset {name!r} (entry point of "
                                          f"{ENTRY_POINT_GROUP!r})")
