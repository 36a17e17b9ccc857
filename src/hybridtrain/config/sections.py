"""The loaded recipe as typed, frozen objects: one dataclass per fixed section of ``schema.py``.

    recipe = recipe_config("recipe.yaml")      # or a loaded ConfigNode, or a dict
    recipe.training.max_steps                  # a field of TrainingSection
    raise ValueError(f"... ({recipe.training.where('max_steps')})")   # -> "recipe.yaml:12"

The section classes are made from ``schema.py``'s ``K`` entries (field names and types; the
defaults stay there alone, filled in by the loader), so a key added to the schema is a field here
without another edit. A value is checked once, when the recipe loads (``loader.py``: type,
choices, minimum); these objects only carry it. A section that is a ``_target_`` mapping
(``optimizer`` / ``lr_scheduler`` may be) stays the ``ConfigNode``; an absent optional section
(``peft``, ``evaluation``, ``benchmark``) is None; the open sections (``model``, ``dataset``, ...)
stay ``ConfigNode`` (their keys are the target's arguments).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Mapping
from typing import Any, ClassVar, Union

from hybridtrain.config.errors import ConfigError
from hybridtrain.config.loader import build_config, load_config
from hybridtrain.config.node import ConfigNode
from hybridtrain.config.schema import SECTIONS, K, Section

__all__ = [
    "RecipeSection", "RecipeConfig", "SECTION_TYPES", "config_section", "recipe_config",
    "typed_section", "DataloaderSection", "PackingSection", "TrainingSection", "OptimizerSection",
    "LRSchedulerSection", "CheckpointSection", "PeftSection", "DistributedSection",
    "MetricsSection", "EvaluationSection", "BenchmarkSection", "RLSection", "DPOSection",
    "GRPOSection",
]


@dataclasses.dataclass(frozen=True)
class RecipeSection:
    """Base of the typed sections. ``where(key)`` names where a value was set ("recipe.yaml:12",
    a command-line override, or the recipe file for a schema default)."""

    section: ClassVar[str] = ""

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
        return _with_node(dataclasses.replace(self, **changes), self.__dict__.get("_node"))


def _with_node(section: RecipeSection, node: ConfigNode | None) -> RecipeSection:
    object.__setattr__(section, "_node", node)  # not a field: equality and repr ignore it
    return section


def _annotation(spec: K) -> Any:
    """The field type of a key: its accepted types (``types``), else the default's type."""
    types = spec.types or ((type(spec.default),) if spec.default is not None else None)
    if types is None:
        return Any
    types = tuple(None if t is type(None) else t for t in types)
    return types[0] if len(types) == 1 else Union[types]


def _section_class(class_name: str, sec: Section) -> type[RecipeSection]:
    fields = [(key, _annotation(spec)) for key, spec in sec.keys.items()]
    cls = dataclasses.make_dataclass(class_name, fields, bases=(RecipeSection,), frozen=True,
                                     namespace={"section": sec.name})
    cls.__module__ = __name__
    cls.__doc__ = f"The recipe's ``{sec.name}:`` section ({sec.doc}); keys: config/schema.py."
    return cls


DataloaderSection = _section_class("DataloaderSection", SECTIONS["dataloader"])
PackingSection = _section_class("PackingSection", SECTIONS["packing"])
TrainingSection = _section_class("TrainingSection", SECTIONS["training"])
OptimizerSection = _section_class("OptimizerSection", SECTIONS["optimizer"])
LRSchedulerSection = _section_class("LRSchedulerSection", SECTIONS["lr_scheduler"])
CheckpointSection = _section_class("CheckpointSection", SECTIONS["checkpoint"])
PeftSection = _section_class("PeftSection", SECTIONS["peft"])
DistributedSection = _section_class("DistributedSection", SECTIONS["distributed"])
MetricsSection = _section_class("MetricsSection", SECTIONS["metrics"])
EvaluationSection = _section_class("EvaluationSection", SECTIONS["evaluation"])
BenchmarkSection = _section_class("BenchmarkSection", SECTIONS["benchmark"])
RLSection = _section_class("RLSection", SECTIONS["rl"])
DPOSection = _section_class("DPOSection", SECTIONS["dpo"])
GRPOSection = _section_class("GRPOSection", SECTIONS["grpo"])

# every fixed section's class, by section name
SECTION_TYPES: dict[str, type[RecipeSection]] = {
    cls.section: cls for cls in (
        DataloaderSection, PackingSection, TrainingSection, OptimizerSection, LRSchedulerSection,
        CheckpointSection, PeftSection, DistributedSection, MetricsSection, EvaluationSection,
        BenchmarkSection, RLSection, DPOSection, GRPOSection)}
assert set(SECTION_TYPES) == {n for n, s in SECTIONS.items() if s.kind == "fixed"}


def typed_section(name: str, node: ConfigNode | None) -> RecipeSection | ConfigNode | None:
    """The fixed section ``name`` of a loaded recipe as its typed object (a ``_target_``
    mapping stays the node; an absent optional section is None)."""
    if node is None or "_target_" in node:
        return node
    cls = SECTION_TYPES[name]
    assert set(node) == set(SECTIONS[name].keys), f"section {name} was not loaded: {set(node)}"
    return _with_node(cls(**node), node)


def config_section(name: str, values: Mapping[str, Any] | RecipeSection | None = None):
    """The typed section ``name``: a section of a loaded recipe as it is, or ``values`` (a
    mapping of some keys) over the schema's defaults, checked as a recipe is (an unknown key or
    a wrong type is a ``ConfigError`` naming it)."""
    if isinstance(values, RecipeSection):
        return values
    if isinstance(values, ConfigNode) and values.dotted_path() == name:
        return typed_section(name, values)  # loaded and checked already
    return typed_section(name, build_config({name: dict(values or {})})[name])


@dataclasses.dataclass(frozen=True)
class RecipeConfig:
    """A loaded recipe, typed: each fixed section as its ``*Section`` object (see the module
    docstring), the open sections as ``ConfigNode``; ``node`` is the loaded tree itself
    (``to_yaml``, the ``_target_`` allow-list, every key's source line)."""

    node: ConfigNode = dataclasses.field(repr=False, compare=False)
    model: ConfigNode | None
    tokenizer: ConfigNode | None
    dataset: ConfigNode | None
    validation_dataset: ConfigNode | None
    dataloader: DataloaderSection
    packing: PackingSection
    training: TrainingSection
    optimizer: OptimizerSection | ConfigNode  # a ConfigNode when a _target_ mapping
    lr_scheduler: LRSchedulerSection | ConfigNode  # a ConfigNode when a _target_ mapping
    checkpoint: CheckpointSection
    peft: PeftSection | None  # None: no LoRA
    distributed: DistributedSection
    metrics: MetricsSection
    dist_env: ConfigNode
    evaluation: EvaluationSection | None
    benchmark: BenchmarkSection | None
    rl: RLSection
    dpo: DPOSection
    grpo: GRPOSection

    @property
    def source_file(self) -> str:
        return self.node.source_file

    def to_yaml(self) -> str:
        """The resolved recipe as YAML (saved next to the checkpoints)."""
        return self.node.to_yaml()


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
