"""``_target_`` instantiation with a module allow-list.

A mapping ``{_target_: a.b.callable, k1: v1, ...}`` becomes ``a.b.callable(k1=v1, ...)``:

* nested mappings with a ``_target_`` are instantiated first (other mappings become plain
  dicts, lists stay lists);
* ``_partial_: true`` returns ``functools.partial(callable, **kwargs)`` instead of calling it;
* ``_args_: [...]`` gives positional arguments;
* arguments given at the call site (``instantiate(cfg.optimizer, params)``,
  ``instantiate(cfg.model, dtype=torch.bfloat16)``) are added, and win over the recipe's;
* keys are checked against the callable's signature before anything is built: an unknown
  key is a ``ValueError`` naming the key, where it was set and the nearest parameter name.

YAML must not become arbitrary code execution: a ``_target_`` must lie under one of
``DEFAULT_ALLOWED_PREFIXES`` or a prefix the user added explicitly (a top-level
``allowed_target_prefixes: [mypkg.]`` in the recipe, ``--allowed_target_prefixes=[mypkg.]``, or
``load_config(..., allowed_target_prefixes=[...])``). The check runs before any import.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, Callable, Iterable, Mapping

from hybridtrain.config.loader import ConfigError
from hybridtrain.config.node import ConfigNode, dotted, suggest

__all__ = ["DEFAULT_ALLOWED_PREFIXES", "instantiate", "resolve_target", "check_target",
           "normalize_prefixes", "is_target_allowed"]

DEFAULT_ALLOWED_PREFIXES: tuple[str, ...] = ("hybridtrain.", "torch.", "transformers.",
                                             "datasets.")
_RESERVED = ("_target_", "_partial_", "_args_")


def normalize_prefixes(prefixes: Iterable[str]) -> tuple[str, ...]:
    """``["mypkg", "torch."]`` -> ``("mypkg.", "torch.")`` (deduplicated, order kept)."""
    out: list[str] = []
    for p in prefixes:
        p = str(p).strip()
        p = p if p.endswith(".") else p + "."
        if p not in out:
            out.append(p)
    return tuple(out)


def is_target_allowed(target: str, prefixes: Iterable[str]) -> bool:
    return any(target.startswith(p) or target == p[:-1] for p in normalize_prefixes(prefixes))


def check_target(target: Any, prefixes: Iterable[str], key_path: str, where: str) -> None:
    """Raise ``ConfigError`` unless ``target`` is a dotted name under an allowed prefix."""
    if not isinstance(target, str) or not target.strip() or " " in target.strip():
        raise ConfigError(f"'{key_path}' must be a dotted name like 'torch.optim.AdamW', "
                          f"got {target!r} ({where})")
    prefixes = normalize_prefixes(prefixes)
    if is_target_allowed(target, prefixes):
        return
    top = target.split(".")[0]
    raise ConfigError(
        f"_target_ '{target}' at '{key_path}' ({where}) is not allowed: a recipe may only "
        f"name callables under {', '.join(prefixes)}. If you trust '{top}', allow it "
        f"explicitly with a top-level recipe key `allowed_target_prefixes: [{top}.]`, the "
        f"override --allowed_target_prefixes=[{top}.], or "
        f"load_config(..., allowed_target_prefixes=['{top}.'])")


def resolve_target(target: str) -> Callable:
    """Import ``a.b.c.attr`` (the longest importable module, then attributes)."""
    parts = target.split(".")
    module = None
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            # Only "this very module does not exist" means: try a shorter one.
            if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
                continue
            raise
        obj: Any = module
        for j, attr in enumerate(parts[i:], start=i):
            try:
                obj = getattr(obj, attr)
            except AttributeError:
                raise ConfigError(f"cannot resolve _target_ '{target}': "
                                  f"'{'.'.join(parts[:j])}' has no attribute '{attr}'"
                                  f"{suggest(attr, [a for a in dir(obj) if not a.startswith('_')])}"
                                  ) from None
        return obj
    raise ConfigError(f"cannot resolve _target_ '{target}': no module '{parts[0]}'")


def _location(node: Mapping) -> tuple[str, str, tuple[str, ...]]:
    """(key path, where, allowed prefixes) of a node; plain dicts get defaults."""
    if isinstance(node, ConfigNode):
        return node.dotted_path(), node.where(), node.target_prefixes()
    return "<dict>", "<dict>", DEFAULT_ALLOWED_PREFIXES


def _build(value: Any, prefixes: tuple[str, ...]) -> Any:
    if isinstance(value, Mapping):
        if "_target_" in value:
            return _instantiate(value, (), {}, prefixes)
        return {k: _build(v, prefixes) for k, v in value.items()}
    if isinstance(value, list):
        return [_build(v, prefixes) for v in value]
    if isinstance(value, tuple):
        return tuple(_build(v, prefixes) for v in value)
    return value


def _instantiate(node: Mapping, args: tuple, kwargs: dict, prefixes: tuple[str, ...]) -> Any:
    key_path, where, _ = _location(node)
    target = node.get("_target_")
    tpath = f"{key_path}._target_" if key_path != "<dict>" else "_target_"
    twhere = node.where("_target_") if isinstance(node, ConfigNode) else where
    check_target(target, prefixes, tpath, twhere)
    fn = resolve_target(target)
    if not callable(fn):
        raise ConfigError(f"_target_ '{target}' at '{tpath}' ({twhere}) is not callable")
    partial = bool(node.get("_partial_", False))
    cfg_kwargs = {k: v for k, v in node.items() if k not in _RESERVED}

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        params = sig.parameters.values()
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                          p.KEYWORD_ONLY)]
            for key in cfg_kwargs:
                if key not in names and key not in kwargs:
                    kw_where = node.where(key) if isinstance(node, ConfigNode) else where
                    raise ConfigError(
                        f"unknown argument '{key}' for {target} at "
                        f"'{dotted(((key_path,) if key_path != '<dict>' else ()) + (key,))}' "
                        f"({kw_where}){suggest(key, names)}")

    pos = list(args) if args else list(_build(list(node.get("_args_", []) or []), prefixes))
    call_kwargs = {k: _build(v, prefixes) for k, v in cfg_kwargs.items()}
    call_kwargs.update(kwargs)
    if sig is not None:
        try:
            (sig.bind_partial if partial else sig.bind)(*pos, **call_kwargs)
        except TypeError as e:
            raise ConfigError(f"cannot call {target} with the arguments of '{key_path}' "
                              f"({where}): {e}") from None
    if partial:
        return functools.partial(fn, *pos, **call_kwargs)
    return fn(*pos, **call_kwargs)


def instantiate(node: Mapping | None, /, *args: Any, **kwargs: Any) -> Any:
    """Instantiate a ``_target_`` mapping (a ``ConfigNode`` section or a plain dict).

    ``instantiate(cfg.model)``, ``instantiate(cfg.optimizer, param_groups)``,
    ``instantiate(cfg.dataset, tokenizer=tok)``. ``None`` gives ``None`` (absent section).
    Plain dicts use ``DEFAULT_ALLOWED_PREFIXES``; config nodes use their recipe's list.
    """
    if node is None:
        return None
    if not isinstance(node, Mapping) or "_target_" not in node:
        key_path, where, _ = _location(node) if isinstance(node, Mapping) else ("?", "?", ())
        raise ConfigError(f"'{key_path}' ({where}) has no _target_ to instantiate")
    return _instantiate(node, args, kwargs, _location(node)[2])
