"""The helpers config/recipe.py is written with, and the views of it that the rest reads.

A recipe key is a dataclass field made by :func:`key`; its default, one-line doc, range or
choices, unit, environment variable and path kind ride in the field's metadata::

    @dataclasses.dataclass(frozen=True)
    class TrainingSection(RecipeSection):
        section: ClassVar[str] = "training"
        max_steps: int | None = key(None, "optimizer steps to run", range="[1, inf)",
                                    unit="steps")

The field's annotation is the type the loader accepts (``int`` is accepted where ``float`` is;
``Any``: anything). :class:`KeySpec` and :class:`SectionSpec` are those fields read back: the
loader, the docs reference page and ``--help`` read them (``recipe.SECTIONS``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import types
import typing
from functools import cache
from typing import Any, ClassVar

from hybridtrain.config.dtypes import canonical_dtype_name
from hybridtrain.config.errors import ConfigError

__all__ = ["Range", "KeySpec", "SectionSpec", "RecipeSection", "KeyProblem", "key", "section",
           "open_section", "env_section", "check_value", "section_defaults", "sections_of",
           "keys_of", "with_node"]


# --------------------------------------------------------------------------------------------
# ranges
# --------------------------------------------------------------------------------------------
_INTERVAL = re.compile(r"^\s*([\[(])\s*(-?inf|[-+0-9.e]+)\s*,\s*(-?inf|[-+0-9.e]+)\s*([\])])\s*$")


@dataclasses.dataclass(frozen=True)
class Range:
    """The numbers a key accepts, written as an interval: ``"[1, inf)"`` (1 and up), ``"(0,
    1]"`` (above 0, up to 1). ``None`` ends are unbounded; NaN and infinities are never in."""

    min: float | None = None
    max: float | None = None
    min_open: bool = False
    max_open: bool = False

    @classmethod
    def parse(cls, text: str) -> Range:
        m = _INTERVAL.match(text)
        assert m, f"a range is an interval such as '[1, inf)' or '(0, 1]', not {text!r}"
        lo, hi = (None if "inf" in s else _number(s) for s in (m[2], m[3]))
        return cls(lo, hi, m[1] == "(", m[4] == ")")

    def __contains__(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.min is not None and (value <= self.min if self.min_open else value < self.min):
            return False
        return self.max is None or (value < self.max if self.max_open else value <= self.max)

    def __str__(self) -> str:
        lo = "-inf" if self.min is None else _fmt(self.min)
        hi = "inf" if self.max is None else _fmt(self.max)
        return f"{'(' if self.min_open else '['}{lo}, {hi}{')' if self.max_open else ']'}"

    def describe(self) -> str:
        """``">= 1"``, ``"> 0"``, ``"<= 1"`` or ``"in (0, 1]"``: what an error message says."""
        if self.max is None and self.min is not None:
            return f"{'>' if self.min_open else '>='} {_fmt(self.min)}"
        if self.min is None and self.max is not None:
            return f"{'<' if self.max_open else '<='} {_fmt(self.max)}"
        return f"in {self}"

    def outside(self) -> list[float]:
        """Numbers just outside the range (one below it, one above it when bounded)."""
        out = []
        if self.min is not None:
            out.append(self.min if self.min_open else self.min - 1)
        if self.max is not None:
            out.append(self.max if self.max_open else self.max + 1)
        return out


def _number(text: str) -> float:
    try:
        return int(text)
    except ValueError:
        return float(text)


def _fmt(x: float) -> str:
    return str(x) if isinstance(x, int) else (str(int(x)) if x.is_integer() else repr(x))


# --------------------------------------------------------------------------------------------
# fields
# --------------------------------------------------------------------------------------------
def key(default: Any, doc: str, *, range: str | Range | None = None,
        choices: tuple[str, ...] | None = None, unit: str | None = None, env: str | None = None,
        path: str | None = None) -> Any:
    """A recipe key: a dataclass field with ``default`` (lists and dicts copied for each object)
    and its ``doc`` (one line), ``range`` (numbers: an interval, ``"[1, inf)"``, or a
    :class:`Range`; for a list of numbers, each item's), ``choices`` (strings, matched
    case-insensitively), ``unit`` (``"steps"``, ``"tokens"``, ...), ``env`` (an environment
    variable that, when set, replaces the default) and ``path`` (``"file"`` or ``"folder"``: a
    path the user gives; blank is refused, ``~`` expanded)."""
    assert path in (None, "file", "folder"), path
    meta = {"kind": "key", "default": default, "doc": doc,
            "range": Range.parse(range) if isinstance(range, str) else range,
            "choices": tuple(choices) if choices else None, "unit": unit, "env": env,
            "path": path}
    if env is not None or isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: _current(default, env), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _current(default: Any, env: str | None) -> Any:
    """A fresh copy of ``default``, or the value of the variable ``env`` when it is set."""
    text = os.environ.get(env) if env else None
    return copy.deepcopy(default) if text is None else _env_scalar(text)


def section(cls: type, doc: str, *, optional: bool = False, target_ok: bool = False) -> Any:
    """A field of ``RecipeConfig`` holding the fixed section ``cls`` (its defaults when absent;
    None when absent and ``optional``; the ``ConfigNode`` when a ``_target_`` mapping and
    ``target_ok``)."""
    meta = {"kind": "fixed", "doc": doc, "cls": cls, "optional": optional,
            "target_ok": target_ok}
    if optional:
        return dataclasses.field(default=None, metadata=meta)
    return dataclasses.field(default_factory=cls, metadata=meta)


def open_section(doc: str) -> Any:
    """A field of ``RecipeConfig`` holding a section of any keys, usually a ``_target_`` mapping
    (its keys are checked against the callable's signature when it is built); None if absent."""
    return dataclasses.field(default=None, metadata={"kind": "open", "doc": doc})


def env_section(doc: str) -> Any:
    """A field of ``RecipeConfig`` mapping names to environment variables (``dist_env``)."""
    return dataclasses.field(default_factory=dict, metadata={"kind": "env", "doc": doc})


# --------------------------------------------------------------------------------------------
# the fields read back
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KeySpec:
    """One recipe key as the loader, the docs and ``--help`` read it."""

    name: str
    default: Any
    doc: str
    types: tuple[type, ...] | None  # None: any value
    item_types: tuple[type, ...] = ()  # a list's items (list[int] -> int)
    range: Range | None = None  # of the value, or of each item of a list of numbers
    choices: tuple[str, ...] | None = None
    unit: str | None = None
    env: str | None = None
    path: str | None = None

    @property
    def numeric(self) -> bool:
        """Whether the key accepts a number or a list of numbers (a bool is not one)."""
        return bool({int, float} & set(self.types or ())) or self.numeric_items

    @property
    def numeric_items(self) -> bool:
        return bool({int, float} & set(self.item_types))

    def type_names(self) -> str:
        """``"int or null"``: the accepted types as a recipe writes them."""
        assert self.types is not None
        return " or ".join("null" if t is type(None) else t.__name__ for t in self.types)

    def current_default(self) -> Any:
        """The default (a fresh copy), or the ``env`` variable's value when it is set."""
        return _current(self.default, self.env)


@dataclasses.dataclass(frozen=True)
class SectionSpec:
    """One top-level section: ``fixed`` (the keys of ``cls``), ``open`` or ``env``."""

    name: str
    kind: str
    doc: str
    keys: dict[str, KeySpec]
    cls: type | None = None
    optional: bool = False
    target_ok: bool = False


def _items(hint: Any) -> tuple[type, ...]:
    """The item types of the lists an annotation accepts: ``list[int] | None`` -> (int,)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(dict.fromkeys(t for arg in typing.get_args(hint) for t in _items(arg)))
    if typing.get_origin(hint) in (list, tuple):
        return tuple(t for t in typing.get_args(hint) if t is not Ellipsis)
    return ()


def _accepted(hint: Any) -> tuple[type, ...] | None:
    """The runtime types of an annotation: ``int | None`` -> (int, NoneType); ``list[str]`` ->
    (list,); ``Any`` -> None."""
    if hint is Any:
        return None
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        out: list[type] = []
        for arg in typing.get_args(hint):
            sub = _accepted(arg)
            if sub is None:
                return None
            out += [t for t in sub if t not in out]
        return tuple(out)
    return (typing.get_origin(hint) or hint,)


@cache
def keys_of(cls: type) -> dict[str, KeySpec]:
    """The recipe keys (fields made by :func:`key`) of the dataclass ``cls``, in order."""
    hints = typing.get_type_hints(cls)
    out = {f.name: KeySpec(f.name, f.metadata["default"], f.metadata["doc"],
                           _accepted(hints[f.name]), _items(hints[f.name]),
                           f.metadata["range"], f.metadata["choices"], f.metadata["unit"],
                           f.metadata["env"], f.metadata["path"])
           for f in dataclasses.fields(cls) if f.metadata.get("kind") == "key"}
    for spec in out.values():
        assert spec.range is None or spec.numeric, f"{cls.__name__}.{spec.name}: a range, no number"
    return out


@cache
def sections_of(cls: type) -> dict[str, SectionSpec]:
    """The sections (fields made by :func:`section`, :func:`open_section`, :func:`env_section`)
    of the recipe dataclass ``cls``, in order."""
    out = {}
    for f in dataclasses.fields(cls):
        m = f.metadata
        if m.get("kind") in ("fixed", "open", "env"):
            sec_cls = m.get("cls")
            out[f.name] = SectionSpec(f.name, m["kind"], m["doc"],
                                      keys_of(sec_cls) if sec_cls else {}, sec_cls,
                                      m.get("optional", False), m.get("target_ok", False))
    return out


def section_defaults(spec: SectionSpec) -> dict[str, Any]:
    """A fresh dict of a fixed section's defaults (an ``env`` variable, when set, replaces its
    key's default)."""
    return {name: k.current_default() for name, k in spec.keys.items()}


def _env_scalar(text: str) -> Any:
    """An environment variable's value as a recipe scalar ("0"/"1" as false/true)."""
    import yaml

    value = yaml.safe_load(text) if text.strip() else None
    return {0: False, 1: True}.get(value, value) if isinstance(value, int) else value


# --------------------------------------------------------------------------------------------
# checking a value
# --------------------------------------------------------------------------------------------
class KeyProblem(ConfigError):
    """A value of one key that the recipe refuses (``key``: which, ``problem``: why, without
    where it was set; ``str()`` adds where: "... in recipe.yaml:3", or "... (recipe.yaml:3)"
    after a ``rule`` over several keys, whose text ends with the fix)."""

    def __init__(self, key: str, problem: str, where: str, rule: bool = False):
        self.key, self.problem, self.rule = key, problem, rule
        super().__init__(self._said(where))

    def _said(self, where: str) -> str:
        return f"{self.problem} ({where})" if self.rule else f"{self.problem} in {where}"

    def at(self, where: str) -> ConfigError:
        """The same problem, said to be set at ``where``."""
        return ConfigError(self._said(where))


def check_value(section_name: str, spec: KeySpec, value: Any, where: str) -> Any:
    """``value`` of the key ``section_name.spec.name`` as the recipe holds it (a choice in its
    listed spelling, a path with ``~`` expanded); ``KeyProblem`` naming the key, ``where`` it
    was set and what it accepts when it does not fit the type, range or choices."""
    name = f"{section_name}.{spec.name}" if section_name else spec.name
    if spec.types is not None:
        ok = isinstance(value, spec.types) and not (isinstance(value, bool)
                                                    and bool not in spec.types)
        ok = ok or (float in spec.types and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            raise KeyProblem(spec.name, f"'{name}' must be {spec.type_names()}, got {value!r} "
                                        f"({type(value).__name__})", where)
    if spec.range is not None and _is_number(value) and value not in spec.range:
        raise KeyProblem(spec.name, f"'{name}' must be {spec.range.describe()}, got {value!r}",
                         where)
    if spec.range is not None and spec.numeric_items and isinstance(value, (list, tuple)):
        kind = "a number" if float in spec.item_types else "an integer"
        for i, item in enumerate(value):
            fits = _is_number(item) and (float in spec.item_types or isinstance(item, int))
            if not fits or item not in spec.range:
                raise KeyProblem(spec.name, f"'{name}[{i}]' must be {kind} "
                                            f"{spec.range.describe()}, got {item!r}", where)
    if spec.path and isinstance(value, str):
        if not value.strip():
            raise KeyProblem(spec.name, f"'{name}' is empty ({value!r}); give a {spec.path} path "
                                        "(an unset ${env:VAR,} gives an empty one), or leave the "
                                        "key out for its default", where)
        return os.path.expanduser(value)
    if spec.choices and isinstance(value, str):
        low = canonical_dtype_name(value) or value.lower()
        for choice in spec.choices:
            if choice.lower() == low:
                return choice
        raise KeyProblem(spec.name, f"'{name}' must be one of {', '.join(spec.choices)}; "
                                    f"got {value!r}", where)
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --------------------------------------------------------------------------------------------
# the base of the sections
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RecipeSection:
    """Base of the fixed sections. Made with its defaults (``TrainingSection(max_steps=3)``),
    checked as a recipe is (type, range, choices, :meth:`problem`); ``where(key)`` names where a
    value was set ("recipe.yaml:12", a command-line override, or "built in code")."""

    section: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for name, spec in keys_of(type(self)).items():
            value = getattr(self, name)
            checked = check_value(self.section, spec, value, self.where(name))
            if checked is not value:
                object.__setattr__(self, name, checked)
        found = self.problem()
        if found is not None:
            key_name, message = found
            raise KeyProblem(key_name, message, self.where(key_name), rule=True)

    def problem(self) -> tuple[str, str] | None:
        """A rule over several keys of the section: None, or (the key to point at, what is
        wrong and how to fix it)."""
        return None

    def where(self, key: str | None = None) -> str:
        node = self.__dict__.get("_node")
        if node is not None:
            return node.where(key)
        return f"'{self.section}' section built in code"

    def to_dict(self) -> dict[str, Any]:
        """The values, copied (e.g. ``LRScheduler(**section.to_dict())``)."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> RecipeSection:
        """A copy with ``changes`` (``where`` still names the recipe's lines)."""
        return with_node(dataclasses.replace(self, **changes), self.__dict__.get("_node"))


def with_node(section: RecipeSection, node: Any) -> RecipeSection:
    """``section`` remembering the loaded ``node`` it came from (for ``where``)."""
    object.__setattr__(section, "_node", node)  # not a field: equality and repr ignore it
    return section

