"""Model specs: the one way generic code (training, recipes, peft, distributed) reaches a model.

A model family registers one :class:`ModelSpec`: a small required core (how to build, lay out,
split, count and export the model) plus optional *parts* (:class:`PeftSupport`,
:class:`MetaInit`, :class:`MemoryPlanSupport`, :class:`HeteroSupport`, :class:`LayerTypes`),
each a typed
dataclass. :func:`register_model_spec` checks the core and every part, so a missing or
ill-typed piece names itself when the family registers, not mid-run; a generic caller that
needs an optional part asks ``spec.part(PartClass, "what for")``, which raises a ValueError
naming the spec and the part when the family has none. Everything outside ``models/`` asks the
registry (:func:`get_model_spec` by name, :func:`model_spec_for` by model object) and never
imports a model package itself, so a new model is added by writing its package and its spec
(tests/families/ holds a dense Transformer registered from the test suite alone).

What a model of a spec promises (the model contract):

* ``forward(input_ids, position_ids=None, cu_seqlens=None, labels=None)``: hidden states
  ``[B, L, H]`` when it holds no head (a pipeline stage before the last), else logits, or with
  ``labels`` the loss ``self.loss(hidden, head, labels)`` (an ``ops.loss.LinearCrossEntropy``;
  the trainer installs its summing one with :func:`set_train_loss`). A stage without
  embeddings takes hidden states as ``input_ids``.
* ``config`` (with ``to_dict()``, ``hidden_size`` and ``vocab_size``),
  ``save_pretrained(dir, state_dict=, dtype=)`` and the class method
  ``from_pretrained(dir, dtype=)``.
* for ``hybridtrain generate``: ``generate(input_ids, attention_mask, **settings)`` and
  ``generation_cache_bytes(batch_size, max_length)`` (what its decoding state will take,
  known before allocating it); ``config.max_position_embeddings`` bounds its context.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from torch import nn

__all__ = ["ModelSpec", "PipelineSplit", "FlopsCount", "HFAdapter", "PeftSupport", "MetaInit",
           "MemoryPlanSupport", "HeteroSupport", "LayerTypes", "PART_TYPES", "register_model_spec",
           "get_model_spec", "model_spec_for", "registered_model_class", "set_train_loss"]


def _check(obj: Any, callables: tuple[str, ...] = (), optional: tuple[str, ...] = ()) -> None:
    """ValueError naming the part and field of ``obj`` that is not callable (``optional``
    fields may also be None)."""
    for name in callables + optional:
        value = getattr(obj, name)
        if value is None and name in optional:
            continue
        if not callable(value):
            raise ValueError(f"{type(obj).__name__}.{name} must be callable, got "
                             f"{type(value).__name__}")


# -- the required core ------------------------------------------------------------------------
@dataclass(frozen=True)
class PipelineSplit:
    """How the model splits into pipeline stages.

    * ``layers(model) -> list[str]``: the names of the splittable layers, in order;
      ``stage(model, layer_names, is_first, is_last)``: the model without the parts it does not
      own (same modules, same parameter names); ``is_complete(model)``: whether ``model`` holds
      every part (not a stage).
    * ``hidden_size(config) -> int``: the width of the hidden states stages exchange.
    * ``row_inputs(config, batch) -> {name: tensor}``: keyword inputs of the first stage besides
      ``input_ids`` / ``position_ids`` / ``labels`` (e.g. images), one entry per row of the
      collated ``batch`` (zero-padded), split into micro-batches with the rows (None: none).
    """

    layers: Callable[[nn.Module], list[str]]
    stage: Callable[[nn.Module, list[str], bool, bool], nn.Module]
    is_complete: Callable[[nn.Module], bool]
    hidden_size: Callable[[Any], int] = lambda config: config.hidden_size
    row_inputs: Callable[[Any, dict], dict] | None = None

    def __post_init__(self):
        _check(self, ("layers", "stage", "is_complete", "hidden_size"), ("row_inputs",))


@dataclass(frozen=True)
class FlopsCount:
    """``layer(config, seq_len) -> list[float]``: forward cost of each pipeline layer per token
    (the pipeline split); ``head(config)``: the head's; ``batch(config, batch,
    head_on_label_tokens_only) -> float``: training FLOPs of a collated batch."""

    layer: Callable[[Any, int], list[float]]
    head: Callable[[Any], float]
    batch: Callable[[Any, dict, bool], float]

    def __post_init__(self):
        _check(self, ("layer", "head", "batch"))


@dataclass(frozen=True)
class HFAdapter:
    """The Hugging Face side of the model.

    * ``save(state_dict, config, out_dir, dtype)``: write full tensors as a Hub checkpoint.
    * ``hub_tensors(state_dict, config) -> iterator of (Hub name, tensor)``: a full state dict
      in the Hub's names and layout (None: the names and layout are the Hub's already).
    * ``hub_layout(name, tensor, config, to_hub) -> tensor``: our tensor ``name`` (a parameter
      or a LoRA ``<module>.lora_A``/``lora_B``) in the Hub's row order (``to_hub``) or back
      (None: the same).
    * ``state_format(model) -> str | None``: a marker of how the model holds its parameters,
      stored with each checkpoint; a checkpoint whose marker differs is refused (None: plain).
    """

    save: Callable[..., None]
    hub_tensors: Callable[..., Any] | None = None
    hub_layout: Callable[[str, Any, Any, bool], Any] | None = None
    state_format: Callable[[nn.Module], str | None] | None = None

    def __post_init__(self):
        _check(self, ("save",), ("hub_tensors", "hub_layout", "state_format"))


# -- optional parts ---------------------------------------------------------------------------
@dataclass(frozen=True)
class PeftSupport:
    """LoRA and its PEFT export. ``expert_modules``: module classes holding stacked per-expert
    weights (adapted per expert); ``export_notes(adapted names) -> str | None``: what PEFT
    cannot take; ``module_prefixes``: {prefix of the transformers implementation's module
    names: ours}, to read adapters PEFT wrote for it and to name adapted modules relative to
    the decoder stack."""

    expert_modules: tuple[type[nn.Module], ...] = ()
    export_notes: Callable[[list[str]], str | None] | None = None
    module_prefixes: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        _check(self, (), ("export_notes",))
        if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in self.expert_modules):
            raise ValueError("PeftSupport.expert_modules must be nn.Module classes")
        if not all(isinstance(k, str) and isinstance(v, str)
                   for k, v in self.module_prefixes.items()):
            raise ValueError("PeftSupport.module_prefixes must map str to str")


@dataclass(frozen=True)
class MetaInit:
    """Building on the meta device and materialising each rank's shards.
    ``init_units(model) -> [(submodule name, init function)]``: the random initialisation in
    independent parts (each seeded on its own); ``hf_slice_reader(local_dir) -> read(name,
    region)``: reads a region of parameter ``name`` from the Hub checkpoint in ``local_dir``
    touching only the tensors it needs. A model that ``from_pretrained(dir, device="meta")``
    builds records ``dir`` as ``name_or_path``."""

    init_units: Callable[[nn.Module], list[tuple[str, Callable[[nn.Module], None]]]]
    hf_slice_reader: Callable[[str], Callable[[str, tuple[slice, ...]], Any]] | None = None

    def __post_init__(self):
        _check(self, ("init_units",), ("hf_slice_reader",))


@dataclass(frozen=True)
class MemoryPlanSupport:
    """What ``hybridtrain plan`` estimates beyond parameters.
    ``activation_bytes(config, micro_batch, seq_len, dtype, loss_chunk_size, head_grad) ->
    {"layers": [{"type", "category", "saved", "checkpointed", "backward"}, ...], "head": {name:
    bytes}, "head_backward": bytes}``: what one micro-batch keeps for backward per layer (with
    and without checkpointing) and in the loss, and what one layer's backward and the loss
    work with at once besides ("backward" keys optional); ``tp_plan(model, tp) -> {submodule path: style}``:
    how the spec's ``parallelize_fn`` splits a (stage) model over ``tp`` ranks (None: no
    tensor parallelism); ``fsdp_units(model) -> (units, expert_units)``: the FSDP2 units
    ``parallelize_fn`` gives ``distributed.fsdp.apply_fsdp`` (it asks this function too; a
    unit is a module or a list of modules, the root holds the rest; None: no FSDP2 estimate);
    ``encoder_activation_bytes(model, micro_batch, seq_len, dtype, recipe) -> {category:
    bytes, "backward": bytes}``: what the first stage's input encoders (e.g. a vision encoder
    on the micro-batch's images) of (stage) ``model`` keep per micro-batch beyond the layers,
    given the recipe (its data and training sections), and what one encoder block's backward
    works with (its recompute when checkpointed; None: no encoder)."""

    activation_bytes: Callable[..., dict] | None = None
    tp_plan: Callable[[nn.Module, int], dict] | None = None
    fsdp_units: Callable[[nn.Module], tuple[list, list]] | None = None
    encoder_activation_bytes: Callable[..., dict] | None = None

    def __post_init__(self):
        _check(self, (), ("activation_bytes", "tp_plan", "fsdp_units", "encoder_activation_bytes"))


@dataclass(frozen=True)
class HeteroSupport:
    """``plan(model, distributed, world_size, *, parallelize, device, autocast_dtype)``: the
    layout of ``distributed.encoder_ranks`` (the model's encoder on its own ranks, the rest laid
    out by ``parallelize(model, dims)``; see :mod:`hybridtrain.distributed.hetero`)."""

    plan: Callable[..., Any]

    def __post_init__(self):
        _check(self, ("plan",))


@dataclass(frozen=True)
class LayerTypes:
    """The model's block types, for settings that name them (per-type
    ``training.activation_checkpointing``, e.g. ``[mamba, moe]``). ``names``: the types, spelled
    as ``of`` and ``MemoryPlanSupport.activation_bytes``' ``"type"`` spell them; ``aliases``:
    {other spelling: type}; ``of(block) -> str``: the type of one of the pipeline layers."""

    names: tuple[str, ...]
    of: Callable[[nn.Module], str]
    aliases: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        _check(self, ("of",))
        if not (isinstance(self.names, tuple) and self.names
                and all(isinstance(n, str) for n in self.names)):
            raise ValueError("LayerTypes.names must be a non-empty tuple of str")
        bad = {k: v for k, v in self.aliases.items()
               if not isinstance(k, str) or v not in self.names}
        if bad:
            raise ValueError(f"LayerTypes.aliases must map str to one of names; not {bad}")


PART_TYPES = (PeftSupport, MetaInit, MemoryPlanSupport, HeteroSupport, LayerTypes)
P = TypeVar("P")


@dataclass(frozen=True)
class ModelSpec:
    """How a model family is built, laid out, split, counted and exported (the core), plus its
    optional ``parts`` (at most one of each of :data:`PART_TYPES`).

    ``parallelize_fn(model, dims, distributed, training, *, device, autocast_dtype)`` applies
    TP/EP/CP/activation checkpointing/compile/FSDP to one (stage) model in place
    (``distributed`` / ``training``: the recipe's typed sections, ``DistributedSection`` /
    ``TrainingSection`` of :mod:`hybridtrain.config.sections`); ``config_cls``: the config class
    (``from_dict``) of a saved checkpoint.
    """

    name: str
    model_cls: type[nn.Module]
    config_cls: type
    parallelize_fn: Callable[..., None]
    pipeline: PipelineSplit
    flops: FlopsCount
    hf: HFAdapter
    parts: tuple = ()

    def find(self, kind: type[P]) -> P | None:
        """The part of type ``kind``, None when the family has none."""
        return next((p for p in self.parts if isinstance(p, kind)), None)

    def part(self, kind: type[P], needed_for: str) -> P:
        """The part of type ``kind``; ValueError naming the spec, the part and ``needed_for``
        when the family has none."""
        found = self.find(kind)
        if found is None:
            raise ValueError(f"{needed_for} needs the model spec {self.name!r} to have a "
                             f"{kind.__name__} part; it has "
                             f"{', '.join(type(p).__name__ for p in self.parts) or 'none'}")
        return found

    def validate(self) -> None:
        """ValueError naming the first missing or ill-typed piece."""
        where = f"model spec {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"{where}: name must be a non-empty string")
        if not (isinstance(self.model_cls, type) and issubclass(self.model_cls, nn.Module)):
            raise ValueError(f"{where}: model_cls must be an nn.Module class")
        if not (isinstance(self.config_cls, type) and callable(getattr(self.config_cls,
                                                                        "from_dict", None))):
            raise ValueError(f"{where}: config_cls must be a class with from_dict")
        for name in ("save_pretrained", "from_pretrained"):
            if not callable(getattr(self.model_cls, name, None)):
                raise ValueError(f"{where}: {self.model_cls.__name__} has no {name}")
        if not callable(self.parallelize_fn):
            raise ValueError(f"{where}: parallelize_fn must be callable")
        for f, kind in (("pipeline", PipelineSplit), ("flops", FlopsCount), ("hf", HFAdapter)):
            if not isinstance(getattr(self, f), kind):
                raise ValueError(f"{where}: {f} must be a {kind.__name__}, got "
                                 f"{type(getattr(self, f)).__name__}")
        seen = set()
        for p in self.parts:
            if type(p) not in PART_TYPES:
                raise ValueError(f"{where}: part {type(p).__name__} is not one of "
                                 f"{', '.join(t.__name__ for t in PART_TYPES)}")
            if type(p) in seen:
                raise ValueError(f"{where}: two {type(p).__name__} parts")
            seen.add(type(p))


assert len(dataclasses.fields(ModelSpec)) <= 8  # the core stays small: new needs are parts

_SPECS: dict[str, ModelSpec] = {}
# model packages that register a spec when imported (imported on first lookup)
_BUILTIN = {"nemotron_h": "hybridtrain.models.nemotron_h.spec",
            "nemotron_h_vlm": "hybridtrain.models.nemotron_vlm.spec"}


def register_model_spec(spec: ModelSpec) -> ModelSpec:
    """Check ``spec`` (:meth:`ModelSpec.validate`) and make it known by name and model class."""
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"register_model_spec takes a ModelSpec, got {type(spec).__name__}")
    spec.validate()
    if spec.name in _SPECS and _SPECS[spec.name] is not spec:
        raise ValueError(f"a model spec named {spec.name!r} is already registered")
    _SPECS[spec.name] = spec
    return spec


def _load_builtins() -> None:
    for name, module in _BUILTIN.items():
        if name not in _SPECS:
            importlib.import_module(module)


def get_model_spec(name: str) -> ModelSpec:
    _load_builtins()
    if name not in _SPECS:
        raise ValueError(f"no model spec named {name!r}; registered: {', '.join(sorted(_SPECS))}")
    return _SPECS[name]


def model_spec_for(model: nn.Module | type) -> ModelSpec:
    """The spec whose model class ``model`` (an instance or a class) is."""
    _load_builtins()
    cls = model if isinstance(model, type) else type(model)
    for spec in _SPECS.values():
        if issubclass(cls, spec.model_cls):
            return spec
    raise ValueError(
        f"{cls.__module__}.{cls.__name__} is not a registered model (known: "
        f"{', '.join(s.model_cls.__name__ for s in _SPECS.values())}); a model enters "
        "hybridtrain through a ModelSpec (hybridtrain.models.spec.register_model_spec)")


def registered_model_class(dotted: str) -> type[nn.Module]:
    """The model class of a registered spec named ``module.Class``; ValueError otherwise."""
    _load_builtins()
    for spec in _SPECS.values():
        if f"{spec.model_cls.__module__}.{spec.model_cls.__qualname__}" == dotted:
            return spec.model_cls
    raise ValueError(f"checkpoint model class {dotted!r} is not a hybridtrain model nor one "
                     "whose spec this program registered (register_model_spec)")


def set_train_loss(model: nn.Module, loss: nn.Module) -> None:
    """Install the loss ``model.forward(labels=...)`` returns (the model contract's ``loss``);
    a model whose loss lives in a sub-model installs it with its own ``set_train_loss``."""
    if hasattr(model, "set_train_loss"):
        model.set_train_loss(loss)
        return
    assert hasattr(model, "loss"), f"{type(model).__name__} has no loss module"
    model.loss = loss
