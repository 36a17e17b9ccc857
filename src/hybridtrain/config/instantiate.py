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

Every ``_target_`` is checked against the recipe's allow-list (``hybridtrain.config.targets``)
before anything is imported, and the object it resolves to by its defining module.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, Callable, Iterable, Mapping

from hybridtrain.config.errors import ConfigError
from hybridtrain.config.node import ConfigNode, dotted, suggest
from hybridtrain.config.targets import (DEFAULT_ALLOWED_PREFIXES, check_defining_module,
                                        check_target)

__all__ = ["instantiate", "resolve_target"]

_RESERVED = ("_target_", "_partial_", "_args_")


def resolve_target(target: str, prefixes: Iterable[str] = DEFAULT_ALLOWED_PREFIXES) -> Callable:
    """Import ``a.b.c.attr``: the longest prefix that is a real module, then attributes that
    are classes (on the way) and, last, a class, function or method. Refused: a private
    segment, a module reached as another module's attribute (``torch.serialization.os.system``),
    an instance on the way (``pkg.logger.info``), an object that does not say where it is
    defined (a bound builtin method), and anything whose defining module (or that of a class
    on the way) the allow-list ``prefixes`` does not admit
    (:func:`hybridtrain.config.targets.check_defining_module`)."""
    check_target(target, prefixes, "_target_", "being resolved")
    parts = target.split(".")
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
            reached = ".".join(parts[:j + 1])
            if obj is not module:  # a class on the way: judged like the target itself
                check_defining_module(target, _defined_as(obj, target, reached), prefixes)
            try:
                obj = getattr(obj, attr)
            except AttributeError:
                raise ConfigError(f"cannot resolve _target_ '{target}': "
                                  f"'{'.'.join(parts[:j])}' has no attribute '{attr}'"
                                  f"{suggest(attr, [a for a in dir(obj) if not a.startswith('_')])}"
                                  ) from None
            if inspect.ismodule(obj):
                raise ConfigError(
                    f"_target_ '{target}' reaches module '{obj.__name__}' through the attribute "
                    f"'{reached}': name callables by the module that defines "
                    "them, not through another module's attributes")
            if j < len(parts) - 1 and not inspect.isclass(obj):
                raise ConfigError(
                    f"_target_ '{target}' passes through '{reached}', a "
                    f"{type(obj).__name__} object, not a module or class: name a module-level "
                    "class or function, or a class's method")
        check_defining_module(target, _defined_as(obj, target, target), prefixes)
        return obj
    raise ConfigError(f"cannot resolve _target_ '{target}': no module '{parts[0]}'")


def _defined_as(obj: Any, target: str, reached: str) -> str:
    """``defining_module.QualName`` of ``obj``, a class, function or method (bound methods:
    their function's, and their class's must be allowed too); anything else, or an object that
    does not say where it is defined (a bound builtin method, an instance), is refused."""
    if inspect.ismethod(obj):  # a classmethod reached through its class
        owner = obj.__self__
        if not inspect.isclass(owner):
            raise ConfigError(f"_target_ '{target}' resolves to a method of a "
                              f"{type(owner).__name__} object ('{reached}'): name a class, a "
                              "function or a class's method")
        obj = obj.__func__
    elif inspect.isbuiltin(obj) and not (obj.__self__ is None or inspect.ismodule(obj.__self__)):
        obj = None  # a builtin method bound to an object: {}.get, "".join
    elif not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj)):
        obj = None
    module = getattr(obj, "__module__", None) if obj is not None else None
    qualname = getattr(obj, "__qualname__", None) if obj is not None else None
    if not (isinstance(module, str) and isinstance(qualname, str)):
        raise ConfigError(f"_target_ '{target}' resolves to '{reached}', which is not a class, "
                          "function or method that says where it is defined (a bound builtin "
                          "method or an instance): it is refused, since the allow-list judges an "
                          "object by its defining module")
    return f"{module}.{qualname}"


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
    fn = resolve_target(target, prefixes)
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
