"""``ConfigNode``: a dict with attribute access that remembers where its keys came from.

A loaded recipe is a tree of ``ConfigNode`` (plain ``dict`` subclasses, so ``cfg["training"]``,
``**cfg.optimizer``, ``json.dumps`` and ``==`` all work) with attribute access on top:
``cfg.training.max_steps``. Every node knows its dotted key path and shares the recipe's source
locations, so code can name the file and line of a bad value::

    raise ValueError(f"training.global_batch_size must be divisible by ... "
                     f"({cfg.training.where('global_batch_size')})")   # -> "recipe.yaml:12"
"""

from __future__ import annotations

import difflib
from typing import Any, Iterable

from hybridtrain.config.targets import DEFAULT_ALLOWED_PREFIXES

__all__ = ["ConfigNode", "ConfigMeta", "dotted", "suggest"]


def dotted(path: Iterable[Any]) -> str:
    """``("dataset", "files", 0)`` -> ``"dataset.files[0]"``."""
    out = ""
    for seg in path:
        if isinstance(seg, int):
            out += f"[{seg}]"
        else:
            out += f".{seg}" if out else str(seg)
    return out or "<root>"


def suggest(name: str, candidates: Iterable[Any]) -> str:
    """``"; did you mean 'max_steps'?"`` or ``"; valid keys: a, b"`` (empty if no candidates)."""
    cands = sorted(str(c) for c in candidates)
    best = difflib.get_close_matches(str(name), cands, n=1, cutoff=0.6)
    if best:
        return f"; did you mean '{best[0]}'?"
    if cands:
        return "; valid keys: " + ", ".join(cands)
    return ""


class ConfigMeta:
    """Shared by all nodes of one config: source file, key locations, ``_target_`` allow-list."""

    __slots__ = ("source", "locs", "allowed_target_prefixes")

    def __init__(self, source: str = "<dict>", locs: dict | None = None,
                 allowed_target_prefixes: tuple[str, ...] | None = None):
        self.source = source
        self.locs: dict[tuple, str] = dict(locs or {})
        if allowed_target_prefixes is None:
            allowed_target_prefixes = DEFAULT_ALLOWED_PREFIXES
        self.allowed_target_prefixes = tuple(allowed_target_prefixes)

    def where(self, path: tuple) -> str:
        """Location of ``path`` ("recipe.yaml:12", "command-line override ..."), or the file."""
        path = tuple(path)
        while path:
            if path in self.locs:
                return self.locs[path]
            path = path[:-1]
        return self.source

    def __reduce__(self):
        return (ConfigMeta, (self.source, self.locs, self.allowed_target_prefixes))


def _wrap(value: Any, path: tuple, meta: ConfigMeta) -> Any:
    if isinstance(value, dict):
        return ConfigNode(value, path, meta)
    if isinstance(value, list):
        return [_wrap(v, path + (i,), meta) for i, v in enumerate(value)]
    return value


class ConfigNode(dict):
    """A recipe (or a section of it). Attribute access reads keys; missing keys suggest."""

    __slots__ = ("_path", "_meta")

    def __init__(self, data: Any = (), path: tuple = (), meta: ConfigMeta | None = None):
        super().__init__()
        object.__setattr__(self, "_path", tuple(path))
        object.__setattr__(self, "_meta", meta if meta is not None else ConfigMeta())
        for key, value in dict(data).items():
            self[key] = value

    # -- dict / attribute access ------------------------------------------------------------
    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, _wrap(value, self._path + (key,), self._meta))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError:
            raise AttributeError(
                f"config has no key '{dotted(self._path + (name,))}' "
                f"({self._meta.where(self._path)}){suggest(name, self.keys())}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ConfigNode.__slots__:
            object.__setattr__(self, name, value)
        else:
            self[name] = value

    def __delattr__(self, name: str) -> None:
        try:
            del self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __reduce__(self):
        return (ConfigNode, (dict(self), self._path, self._meta))

    def __repr__(self) -> str:
        return f"ConfigNode({dict.__repr__(self)})"

    # -- helpers (named so they are unlikely to collide with recipe keys) ---------------------
    def dotted_path(self, key: Any = None) -> str:
        """Dotted key path of this node (or of ``key`` in it), e.g. ``"training.max_steps"``."""
        return dotted(self._path + ((key,) if key is not None else ()))

    def where(self, key: Any = None) -> str:
        """Where this node (or ``key`` in it) was set: ``"recipe.yaml:12"``, a command-line
        override, or the recipe file when the value is a default."""
        return self._meta.where(self._path + ((key,) if key is not None else ()))

    @property
    def source_file(self) -> str:
        return self._meta.source

    def target_prefixes(self) -> tuple[str, ...]:
        """The effective ``_target_`` allow-list (defaults + the recipe's extensions)."""
        return self._meta.allowed_target_prefixes

    def to_dict(self) -> dict:
        """A deep copy made of plain dicts and lists."""
        return _plain(self)

    def to_yaml(self) -> str:
        """The resolved config as YAML (for saving next to checkpoints)."""
        import yaml

        return yaml.safe_dump(_plain(self, for_yaml=True), sort_keys=False)


def _plain(value: Any, for_yaml: bool = False) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v, for_yaml) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        seq = [_plain(v, for_yaml) for v in value]
        return seq if (for_yaml or isinstance(value, list)) else tuple(seq)
    if for_yaml and not isinstance(value, (str, int, float, bool, type(None))):
        return str(value)
    return value
