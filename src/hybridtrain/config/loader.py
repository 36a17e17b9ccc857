"""Load a YAML recipe into a ``ConfigNode``: the recipe's defaults, overrides, ``${env:...}``.

``load_config(path, overrides)`` does, in order:

1. parse the YAML (floats such as ``1e-4`` are floats; duplicate keys are errors) and record
   the line of every key, so errors can say ``recipe.yaml:12``;
2. check the top-level sections and fill the defaults of fixed sections from ``recipe.py``;
3. apply overrides (``--section.key=value``; values parsed as YAML; a key that exists neither
   in the recipe nor in ``recipe.py`` needs a leading ``+``: ``--+model.new_kwarg=1``);
4. replace ``${env:VAR}`` / ``${env:VAR,default}`` in string values (a value that is exactly one
   reference is parsed as a YAML scalar, so ``${env:STEPS,10}`` is the int 10);
5. validate fixed sections (unknown keys with a suggestion; types, ranges, choices and the
   rules over several keys, by making the section's dataclass), ``dist_env``, and
   every ``_target_`` against the allow-list (without importing anything); a key that would
   let a dependency load code (``trust_remote_code: true``, ``targets.CODE_LOADING_OPTIONS``)
   is refused anywhere in the recipe;
6. warn about settings that contradict each other (``consistency.py``).

Nothing here imports torch, so ``dist_env`` can be applied before CUDA is touched.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import yaml

from hybridtrain.config.consistency import warn_contradictions
from hybridtrain.config.dist_env import dist_env_vars
from hybridtrain.config.errors import ConfigError
from hybridtrain.config.node import ConfigMeta, ConfigNode, dotted, suggest
from hybridtrain.config.recipe import SECTIONS, TOP_LEVEL_KEYS
from hybridtrain.config.recipe_fields import KeyProblem, KeySpec, check_value, section_defaults
from hybridtrain.config.targets import (DEFAULT_ALLOWED_PREFIXES, check_code_loading_option,
                                        check_target, normalize_prefixes)
from hybridtrain.fileio import (MAX_RECIPE_BYTES, EncodingError, InputError, read_text,
                                text_reader)

__all__ = [
    "ConfigError", "Override", "load_config", "build_config", "parse_overrides",
    "parse_scalar", "split_cli_overrides",
]


# --------------------------------------------------------------------------------------------
# YAML
# --------------------------------------------------------------------------------------------
class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-4`` / ``3E5`` as floats (YAML 1.1 wants a dot)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)

_MERGE_TAG = "tag:yaml.org,2002:merge"


# the most nodes a recipe's YAML may expand to once its aliases (``*name``) are followed: a real
# recipe has a few hundred; nested aliases (a "billion laughs") would expand to billions
MAX_YAML_NODES = 100_000


def _record_locations(node: yaml.Node, path: tuple, locs: dict, source: str,
                      budget: list[int]) -> None:
    budget[0] -= 1
    if budget[0] < 0:
        raise ConfigError(
            f"{source}: the YAML expands to more than {MAX_YAML_NODES} values once its aliases "
            "(*name) are followed; a recipe is far smaller: write the values out, or use fewer "
            "nested aliases")
    if isinstance(node, yaml.MappingNode):
        first_line: dict[Any, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node)
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise ConfigError(
                    f"duplicate key '{dotted(path + (key,))}' in {source}:{line} "
                    f"(first set at line {first_line[key]}); keep only one")
            first_line[key] = line
            locs[path + (key,)] = f"{source}:{line}"
            _record_locations(value_node, path + (key,), locs, source, budget)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            locs[path + (i,)] = f"{source}:{item.start_mark.line + 1}"
            _record_locations(item, path + (i,), locs, source, budget)


class _InvalidYAML(ConfigError):
    """Text that is not YAML: ``source:LINE: invalid YAML: what``."""


def _yaml_error(e: yaml.YAMLError, source: str) -> _InvalidYAML:
    """PyYAML's error named by file and line (its own text says ``<unicode string>``)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"{source}:{mark.line + 1}" if mark is not None else source
    what = " ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x)
    return _InvalidYAML(f"{where}: invalid YAML: {what or e}")


def _read_yaml(text: str, source: str, empty: Any = None) -> tuple[Any, dict[tuple, str]]:
    """The document of ``text`` (``empty`` when it has none) and the ``file:line`` of each key;
    refuses a document whose aliases expand past :data:`MAX_YAML_NODES` before building it."""
    loader = None
    try:
        loader = _Loader(text)  # refuses control characters (e.g. NUL bytes) at once
        loader.name = source  # PyYAML's marks would say "<unicode string>"
        node = loader.get_single_node()
        if node is None:
            return empty, {}
        locs: dict[tuple, str] = {}
        _record_locations(node, (), locs, source, [MAX_YAML_NODES])
        data = loader.construct_document(node)
    except yaml.reader.ReaderError as e:  # a character YAML never holds (e.g. a NUL byte)
        char = ord(e.character) if isinstance(e.character, str) else e.character
        line = text.count("\n", 0, e.position) + 1
        raise _InvalidYAML(f"{source}:{line}: invalid YAML: unacceptable character #x{char:04x} "
                           "(a recipe is text: is it a binary file?)") from None
    except yaml.YAMLError as e:
        raise _yaml_error(e, source) from None
    except RecursionError:  # a key that is its own ancestor (&a [*a]) or absurd nesting
        raise ConfigError(f"{source}: the YAML nests too deeply (or an alias refers to a value "
                          "that contains it); a recipe is a few levels deep") from None
    finally:
        if loader is not None:
            loader.dispose()
    return data, locs


def parse_scalar(text: str) -> Any:
    """Parse an override / environment value as YAML: ``5``, ``0.1``, ``1e-4``, ``true``,
    ``null``, ``[1, 2]``, anything else stays a string (``""`` stays ``""``)."""
    if text == "":
        return ""
    try:
        value = _read_yaml(text, "a command-line value")[0]
    except _InvalidYAML:
        return text
    if value is None and text.strip() not in ("null", "Null", "NULL", "~"):
        return text  # e.g. "#tag" is a YAML comment, not null
    return value


# --------------------------------------------------------------------------------------------
# overrides
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Override:
    """``--section.key=value`` (``add`` when written ``--+section.key=value``)."""

    path: tuple[str, ...]
    value: Any
    add: bool
    text: str


_KEY_RE = re.compile(r"^[A-Za-z0-9_\-]+$")


def _parse_key(key: str, text: str) -> tuple[tuple[str, ...], bool]:
    add = key.startswith("+")
    if add:
        key = key[1:]
    segs = tuple(key.split("."))
    if not key or not all(_KEY_RE.match(s) for s in segs):
        raise ConfigError(
            f"malformed override '{text}': expected --section.key=value "
            f"(or --+section.new_key=value to add a key)")
    return segs, add


def parse_overrides(tokens: Sequence[str | Override] | Mapping[str, Any]) -> list[Override]:
    """Parse override tokens.

    Accepts command-line tokens (``--a.b=1``, ``--a.b 1``, ``--+a.new=1``), the same without
    dashes (``a.b=1``), ready ``Override`` objects, or a mapping ``{"a.b": value}`` whose values
    are used as they are (not parsed).
    """
    if isinstance(tokens, Mapping):
        out = []
        for key, value in tokens.items():
            text = f"{key}={value!r}"
            path, add = _parse_key(str(key), text)
            out.append(Override(path, value, add, text))
        return out
    out: list[Override] = []
    i = 0
    tokens = list(tokens)
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if isinstance(tok, Override):
            out.append(tok)
            continue
        body = tok[2:] if tok.startswith("--") else tok
        if "=" in body:
            key, raw = body.split("=", 1)
            text = tok
        elif tok.startswith("--"):
            if i >= len(tokens) or not isinstance(tokens[i], str) or tokens[i].startswith("--"):
                raise ConfigError(
                    f"override '{tok}' has no value: write {tok}=VALUE or {tok} VALUE")
            key, raw = body, tokens[i]
            text = f"{tok} {raw}"
            i += 1
        else:
            raise ConfigError(
                f"unexpected argument '{tok}': overrides look like --section.key=value")
        path, add = _parse_key(key, text)
        out.append(Override(path, parse_scalar(raw), add, text))
    return out


def split_cli_overrides(argv: Sequence[str], known_options: set[str]) -> tuple[list[str], list[str]]:
    """Split ``argv`` into (arguments for argparse, override tokens).

    Any ``--name[=value]`` whose name is not one of ``known_options`` is an override; without
    ``=`` the next token is its value (unless that token starts with ``--``).
    """
    rest: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        i += 1
        name = tok.split("=", 1)[0]
        if tok.startswith("--") and tok != "--" and name not in known_options:
            overrides.append(tok)
            if "=" not in tok and i < len(argv) and not argv[i].startswith("--"):
                overrides.append(argv[i])
                i += 1
        else:
            rest.append(tok)
    return rest, overrides


def _fixed_keys(path: tuple, root: dict) -> dict[str, KeySpec] | None:
    """The keys of ``recipe.py`` when ``path`` names a fixed section (not a _target_ mapping)."""
    if len(path) != 1 or path[0] not in SECTIONS:
        return None
    sec = SECTIONS[path[0]]
    node = root.get(path[0])
    if sec.kind != "fixed" or (isinstance(node, dict) and "_target_" in node):
        return None
    return sec.keys


def _apply_override(root: dict, ov: Override, locs: dict) -> None:
    top = ov.path[0]
    where = f"command-line override '{ov.text}'"
    if top not in SECTIONS and top not in TOP_LEVEL_KEYS:
        raise ConfigError(
            f"unknown section '{top}' in {where}"
            f"{suggest(top, list(SECTIONS) + list(TOP_LEVEL_KEYS))} "
            f"(sections are defined in src/hybridtrain/config/recipe.py)")
    cur: Any = root
    for depth, seg in enumerate(ov.path[:-1]):
        here = ov.path[: depth + 1]
        key: Any = seg
        if isinstance(cur, list):
            key = _list_index(cur, seg, here, where)
            nxt = cur[key]
        else:
            nxt = cur.get(seg)
        if nxt is None:
            sec = SECTIONS.get(seg) if depth == 0 else None
            if sec is not None and sec.kind == "fixed":
                nxt = section_defaults(sec)  # e.g. --peft.dim=8 enables an absent peft section
            elif sec is not None or ov.add or (isinstance(cur, dict) and seg in cur):
                nxt = {}
            else:
                raise ConfigError(f"unknown key '{dotted(here)}' in {where}"
                                  f"{suggest(seg, cur.keys())}; to add it write "
                                  f"--+{'.'.join(ov.path)}=...")
            cur[key] = nxt
        if not isinstance(nxt, (dict, list)):
            raise ConfigError(f"cannot set '{dotted(ov.path)}' in {where}: "
                              f"'{dotted(here)}' is {nxt!r}, not a mapping")
        cur = nxt
    last: Any = ov.path[-1]
    parent = ov.path[:-1]
    if isinstance(cur, list):
        last = _list_index(cur, last, ov.path, where)
    elif last not in cur:
        fixed = _fixed_keys(parent, root) if parent else None
        if fixed is not None and last not in fixed:
            raise ConfigError(
                f"unknown key '{dotted(ov.path)}' in {where}{suggest(last, fixed)} "
                f"(the keys of '{parent[0]}' are fixed: see src/hybridtrain/config/recipe.py)")
        if fixed is None and not ov.add and parent:
            raise ConfigError(f"unknown key '{dotted(ov.path)}' in {where}"
                              f"{suggest(last, cur.keys())}; to add a new key write "
                              f"--+{'.'.join(ov.path)}=...")
    cur[last] = ov.value
    full = tuple(ov.path[:-1]) + (last,)
    for p in [p for p in locs if p[: len(full)] == full]:
        del locs[p]
    locs[full] = where


def _list_index(seq: list, seg: str, path: tuple, where: str) -> int:
    if not seg.isdigit() or int(seg) >= len(seq):
        raise ConfigError(f"'{dotted(path[:-1])}' is a list of {len(seq)} items; "
                          f"'{seg}' in {where} is not an index of it")
    return int(seg)


# --------------------------------------------------------------------------------------------
# ${env:VAR,default}
# --------------------------------------------------------------------------------------------
_ENV_RE = re.compile(r"\$\{env:\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:,([^}]*))?\}")


def _interpolate(value: Any, path: tuple, meta: ConfigMeta, environ: Mapping[str, str]) -> Any:
    if isinstance(value, dict):
        return {k: _interpolate(v, path + (k,), meta, environ) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, path + (i,), meta, environ) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value

    def lookup(m: re.Match) -> str:
        var, default = m.group(1), m.group(2)
        if var in environ:
            return environ[var]
        if default is None:
            raise ConfigError(
                f"environment variable {var} is not set, needed by '{dotted(path)}' "
                f"({meta.where(path)}); set it, or give a default: ${{env:{var},DEFAULT}}")
        return default.strip()

    whole = _ENV_RE.fullmatch(value.strip())
    if whole:
        return parse_scalar(lookup(whole))
    return _ENV_RE.sub(lookup, value)


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------
def _validate_fixed(name: str, node: Any, meta: ConfigMeta) -> Any:
    sec = SECTIONS[name]
    if node is None:
        return None if sec.optional else section_defaults(sec)
    if not isinstance(node, dict):
        raise ConfigError(f"section '{name}' must be a mapping, got {node!r} "
                          f"in {meta.where((name,))}")
    if sec.target_ok and "_target_" in node:
        return node
    for key in node:
        if key not in sec.keys:
            hint = " (or make the section a _target_ mapping)" if sec.target_ok else ""
            raise ConfigError(f"unknown key '{name}.{key}' in {meta.where((name, key))}"
                              f"{suggest(key, sec.keys)}{hint}")
    try:  # the dataclass checks each value and the rules over its keys
        made = sec.cls(**{**section_defaults(sec), **node})
    except KeyProblem as e:
        raise e.at(meta.where((name, e.key))) from None
    return {key: getattr(made, key) for key in sec.keys}


def _validate_dist_env(node: Any, meta: ConfigMeta) -> dict:
    if node is None:
        return {}
    if not isinstance(node, dict):
        raise ConfigError(f"section 'dist_env' must be a mapping of names to values, "
                          f"got {node!r} in {meta.where(('dist_env',))}")
    dist_env_vars(node, where=lambda key: meta.where(("dist_env", key)))  # raises on mistakes
    return node


def _check_targets(value: Any, path: tuple, meta: ConfigMeta) -> None:
    if isinstance(value, dict):
        if "_target_" in value:
            check_target(value["_target_"], meta.allowed_target_prefixes,
                         dotted(path + ("_target_",)), meta.where(path + ("_target_",)))
            partial = value.get("_partial_", False)
            if not isinstance(partial, bool):
                raise ConfigError(f"'{dotted(path + ('_partial_',))}' must be true or false "
                                  f"({meta.where(path + ('_partial_',))})")
        for k, v in value.items():
            check_code_loading_option(k, v, dotted(path + (k,)), meta.where(path + (k,)))
            _check_targets(v, path + (k,), meta)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_targets(v, path + (i,), meta)


# --------------------------------------------------------------------------------------------
# entry points
# --------------------------------------------------------------------------------------------
def _refuse_nan(value: Any, path: tuple, meta: ConfigMeta) -> None:
    """No recipe value is NaN (``.nan`` in YAML), also where no key's range applies (a
    ``_target_``'s arguments): it compares false with every bound."""
    if isinstance(value, float) and math.isnan(value):
        raise ConfigError(f"'{dotted(path)}' is NaN in {meta.where(path)}; give a number")
    items = value.items() if isinstance(value, Mapping) else enumerate(value) if isinstance(
        value, list) else ()
    for k, v in items:
        _refuse_nan(v, path + (k,), meta)


def build_config(
    data: Mapping[str, Any] | None,
    overrides: Sequence[str | Override] | Mapping[str, Any] = (),
    *,
    source: str = "<dict>",
    locs: dict[tuple, str] | None = None,
    allowed_target_prefixes: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> ConfigNode:
    """Build a validated config from already-parsed recipe data (see ``load_config``)."""
    environ = os.environ if environ is None else environ
    locs = dict(locs or {})
    meta = ConfigMeta(source, locs)
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: a recipe must be a mapping of sections, "
                          f"got {type(data).__name__}")
    data = {k: v for k, v in data.items() if not str(k).startswith("_")}  # YAML anchor holders
    for key in data:
        if key not in SECTIONS and key not in TOP_LEVEL_KEYS:
            raise ConfigError(f"unknown section '{key}' in {meta.where((key,))}"
                              f"{suggest(key, list(SECTIONS) + list(TOP_LEVEL_KEYS))}")

    root: dict[str, Any] = {}
    for name, sec in SECTIONS.items():
        node = data.get(name)
        if sec.kind == "fixed" and isinstance(node, dict) and not (
                sec.target_ok and "_target_" in node):
            root[name] = {**section_defaults(sec), **node}
        elif sec.kind == "fixed" and node is None and not sec.optional:
            root[name] = section_defaults(sec)
        elif sec.kind == "env" and node is None:
            root[name] = {}
        else:
            root[name] = node
    for name, spec in TOP_LEVEL_KEYS.items():
        root[name] = data.get(name, spec.current_default())

    for ov in parse_overrides(overrides):
        _apply_override(root, ov, meta.locs)

    root = _interpolate(root, (), meta, environ)

    for name, sec in SECTIONS.items():
        if sec.kind == "fixed":
            root[name] = _validate_fixed(name, root[name], meta)
        elif sec.kind == "env":
            root[name] = _validate_dist_env(root[name], meta)
        elif root[name] is not None and not isinstance(root[name], dict):
            raise ConfigError(f"section '{name}' must be a mapping (usually with _target_), "
                              f"got {root[name]!r} in {meta.where((name,))}")
    for name, spec in TOP_LEVEL_KEYS.items():
        root[name] = check_value("", spec, root[name], meta.where((name,)))

    extra = list(root["allowed_target_prefixes"]) + list(allowed_target_prefixes)
    for p in extra:
        if not isinstance(p, str) or not p.strip(".").strip():
            raise ConfigError(f"allowed_target_prefixes entries must be module names like "
                              f"'mypkg.', got {p!r} ({meta.where(('allowed_target_prefixes',))})")
    meta.allowed_target_prefixes = normalize_prefixes(DEFAULT_ALLOWED_PREFIXES + tuple(extra))
    _refuse_nan(root, (), meta)  # in what no key's range checks, e.g. a target's arguments
    _check_targets(root, (), meta)
    warn_contradictions(root, meta.where)
    return ConfigNode(root, (), meta)


@text_reader("recipe")
def load_config(
    path: str | os.PathLike,
    overrides: Sequence[str | Override] | Mapping[str, Any] = (),
    *,
    allowed_target_prefixes: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> ConfigNode:
    """Load a YAML recipe.

    ``overrides``: command-line style tokens (``["--training.max_steps=5", "--+model.x", "1"]``)
    or a mapping ``{"training.max_steps": 5}``. ``allowed_target_prefixes`` extends the
    ``_target_`` allow-list (as does a top-level ``allowed_target_prefixes:`` in the recipe).
    Raises ``ConfigError`` (a ``ValueError``) naming the file, line and key of a mistake.
    """
    source = os.fspath(path)
    try:
        text = read_text(source, max_bytes=MAX_RECIPE_BYTES, what="a recipe")
    except FileNotFoundError:
        raise ConfigError(f"recipe file not found: {source}") from None
    except IsADirectoryError:
        raise ConfigError(f"recipe {source} is a folder; give the YAML file in it") from None
    except (EncodingError, InputError) as e:
        raise ConfigError(str(e)) from None
    data, locs = _read_yaml(text, source, empty={})
    return build_config(data, overrides, source=source, locs=locs,
                        allowed_target_prefixes=allowed_target_prefixes, environ=environ)
