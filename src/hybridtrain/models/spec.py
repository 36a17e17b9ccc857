"""Model specs: the one way generic code (training, recipes, peft, distributed) reaches a model.

A model family registers one :class:`ModelSpec`: a small required core (how to build, lay out,
split, count and export the model) plus optional *parts* (:class:`PeftSupport`,
:class:`MetaInit`, :class:`MemoryPlanSupport`, :class:`HeteroSupport`, :class:`LayerTypes`,
:class:`Decoding`, :class:`LayoutRules`), each a typed dataclass. Families are found through the Python entry-point
group ``hybridtrain.models`` (:data:`ENTRY_POINT_GROUP`; hybridtrain's own families are
declared in its ``pyproject.toml`` like any other package's), loaded on first lookup.

What generic code calls on a model and its config is stated once, here, as code:
:class:`CausalLM` and :class:`ModelConfig` (typing protocols, with :class:`Decoder` for a
family with a :class:`Decoding` part) and the signature of :attr:`HFAdapter.save`.
:func:`register_model_spec` checks a spec against them (:meth:`ModelSpec.validate`), so a
missing or ill-shaped piece names itself when the family registers, not mid-run; generic code
then calls the contract directly and never probes a model's attributes. A generic caller that
needs an optional part asks ``spec.part(PartClass, "what for")``, which raises a ValueError
naming the spec and the part when the family has none.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable, ClassVar, Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["ModelSpec", "PipelineSplit", "FlopsCount", "HFAdapter", "PeftSupport", "MetaInit",
           "MemoryPlanSupport", "HeteroSupport", "LayerTypes", "Decoding", "LayoutRules", "PART_TYPES",
           "CausalLM", "TrainLoss", "ModelConfig", "ActivationBytes", "LayerActivations",
           "EncoderActivations",
           "Decoder", "HFSave", "ENTRY_POINT_GROUP",
           "register_model_spec", "get_model_spec", "model_spec_for", "registered_model_class",
           "set_train_loss"]


# -- the model contract -----------------------------------------------------------------------
class ModelConfig(Protocol):
    """A family's config class (``ModelSpec.config_cls``).

    * ``model_type``: a class attribute equal to the spec's ``name`` (and to ``model_type`` of
      the ``config.json`` it writes: ``hybridtrain generate``/``convert`` find the family by it).
    * ``hidden_size`` / ``vocab_size`` (fields or properties): the width of the hidden states
      (the compute dtype ``auto`` is chosen by it on CPU) and of the vocabulary (the
      tokenizer must fit in it; synthetic data draws from it).
    * ``context_length`` (a field or property): the longest sequence (prompt plus generated
      tokens) the model takes, or None for no limit (``hybridtrain generate`` refuses longer).
    * ``to_dict()``: the ``config.json`` content; ``from_dict(d, source=...)``: the config of
      a ``config.json`` (``source``: the file, named in its errors).
    """

    model_type: ClassVar[str]
    hidden_size: int
    vocab_size: int
    context_length: int | None

    def to_dict(self) -> dict[str, Any]: ...

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = ...) -> "ModelConfig": ...


@runtime_checkable
class TrainLoss(Protocol):
    """The model's loss slot (``CausalLM.loss``), a declared part of the contract: the model
    calls it at the end of its forward with ``labels``, where the layout has gathered the
    head's weight (FSDP2 unshards it for the root's forward; the last pipeline stage holds it).
    The trainer fills the slot (:func:`set_train_loss`): the summing
    :class:`~hybridtrain.ops.loss.LinearCrossEntropy` for training, RL's
    :class:`~hybridtrain.rl.head.PolicyHead` for log-probs (docs/architecture.md, "Why the loss
    is a slot on the model").

    * ``forward(hidden [B, L, H], head, labels [B, L])``: the fused or chunked head and loss
      (never the ``[B, L, vocab]`` logits): a scalar sum, or per-token values;
    * ``recompute``: back-propagate through it twice (zero-bubble pipeline schedules set it).
    """

    recompute: bool

    def __call__(self, hidden: torch.Tensor, head: nn.Module,
                 labels: torch.Tensor) -> torch.Tensor: ...


class CausalLM(Protocol):
    """What generic code calls on a model of a spec (``ModelSpec.model_cls``).

    * ``forward(input_ids, position_ids=None, cu_seqlens=None, labels=None)``: hidden states
      ``[B, L, H]`` when it holds no head (a pipeline stage before the last), else logits, or
      with ``labels`` the loss ``self.loss(hidden, self.lm_head, labels)``. A stage without
      embeddings takes hidden states as ``input_ids``. More keyword inputs (e.g. images) come
      from ``PipelineSplit.row_inputs``.
    * ``lm_head``: the output projection (an ``nn.Linear``; None on a pipeline stage before
      the last), registered last: its parameters come last in ``parameters()`` (LoRA never
      adapts it; ``plan`` counts it as the last stage's).
    * ``loss``: a :class:`TrainLoss` module (the family builds an
      ``ops.loss.LinearCrossEntropy``; the trainer installs its own with :func:`set_train_loss`
      and sets ``loss.recompute`` for zero-bubble pipelines); it may be a property of a model
      that holds it in a sub-model.
    * the decoder layers sit in an ``nn.ModuleDict`` keyed by their global index (``"0"``,
      ``"1"``, ...; a pipeline stage keeps the keys of the layers it holds), the names
      ``PipelineSplit.layers`` returns.
    * ``name_or_path`` / ``checkpoint_dtype``: the folder and the dtype ``from_pretrained``
      read (class attributes None otherwise; the builder reads the weights of a meta-device
      model from ``name_or_path``, ``checkpoint.save_dtype: auto`` exports in
      ``checkpoint_dtype``).
    * ``save_pretrained(save_dir, *, dtype=None, state_dict=None)`` writes a Hub checkpoint
      (``state_dict``: full tensors to write instead of the model's); the class method
      ``from_pretrained(local_dir, dtype=None, device=None)`` reads one.
    """

    config: ModelConfig
    lm_head: nn.Module | None
    loss: TrainLoss
    name_or_path: ClassVar[str | None]
    checkpoint_dtype: ClassVar[torch.dtype | None]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, labels: torch.Tensor | None = None
                ) -> torch.Tensor: ...

    def save_pretrained(self, save_dir: str | os.PathLike, *, dtype: torch.dtype | None = None,
                        state_dict: dict[str, torch.Tensor] | None = None) -> None: ...

    @classmethod
    def from_pretrained(cls, local_dir: str | os.PathLike, dtype: torch.dtype | str | None = None,
                        device: torch.device | str | None = None) -> "CausalLM": ...


class Decoder(Protocol):
    """A model of a family with a :class:`Decoding` part also has ``generate``: the prompt
    ``input_ids`` [B, L] (left-padded where ``attention_mask`` is 0) followed by up to
    ``max_new_tokens`` new tokens, [B, L + n]. ``settings``: the fields of
    ``ops.sampling.GenerationConfig``; ``pipeline``: a ``distributed.pipeline_decode.
    PipelineDecoder`` over this rank's stages; ``lockstep_group``: ranks that decode together."""

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 pipeline: Any = None, lockstep_group: Any = None, **settings: Any
                 ) -> torch.Tensor: ...

    def generation_cache_bytes(self, batch_size: int, max_length: int) -> int:
        """Bytes ``generate`` allocates for its decoding state (a key/value cache, recurrent
        states) for ``batch_size`` rows of ``max_length`` positions: known before allocating,
        so ``hybridtrain generate`` refuses a length that would not fit."""
        ...


class HFSave(Protocol):
    """``HFAdapter.save``: write full tensors as a Hub checkpoint in ``out_dir`` (config.json
    and safetensors); ``dtype``: the dtype to write (None: as held); ``max_shard_size``: the
    largest safetensors file; ``tensors``: ``(name, full tensor)`` pairs streamed one at a time
    instead of ``state_dict``'s (whose names and shapes they follow)."""

    def __call__(self, state_dict: dict[str, Any], config: Any, out_dir: str | os.PathLike, *,
                 dtype: torch.dtype | None = None, max_shard_size: int | str = ...,
                 tensors: Any = None) -> None: ...


def _missing_parameters(fn: Callable, protocol_fn: Callable, positional: int,
                        same_names: bool) -> list[str]:
    """The parameters of ``protocol_fn`` (after ``self``/``cls``) that ``fn`` cannot take as
    the protocol passes them: its first ``positional`` by position (under the same names when
    ``same_names``), the others by keyword."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return ["a signature"]
    want = [n for n in inspect.signature(protocol_fn).parameters
            if n not in ("self", "cls", "settings")]
    have = [p for p in params.values() if p.name not in ("self", "cls")]
    var_kw = any(p.kind is p.VAR_KEYWORD for p in have)
    by_position = [p.name for p in have if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    missing = []
    for i, name in enumerate(want):
        if i < positional:
            ok = i < len(by_position) and (not same_names or by_position[i] == name)
        else:
            ok = var_kw or (name in params and params[name].kind in (
                inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))
        if not ok:
            missing.append(name)
    return missing


def _check_signature(where: str, fn: Callable, protocol_fn: Callable, positional: int = 1,
                     same_names: bool = False) -> None:
    """ValueError naming ``where`` and what it lacks of ``protocol_fn``'s signature."""
    missing = _missing_parameters(fn, protocol_fn, positional, same_names)
    if missing:
        raise ValueError(f"{where} must take {protocol_fn.__qualname__.split('.')[-1]}"
                         f"{inspect.signature(protocol_fn)} (models/spec.py); it lacks "
                         f"{', '.join(missing)}")


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
    * ``carried_size(model) -> int``: the further width the stages' training activations carry
      after the hidden states, for the model as training set it up (e.g. inputs of the last
      stage's extra objectives that only the first stage can compute; None: none).
    """

    layers: Callable[[nn.Module], list[str]]
    stage: Callable[[nn.Module, list[str], bool, bool], nn.Module]
    is_complete: Callable[[nn.Module], bool]
    hidden_size: Callable[[Any], int] = lambda config: config.hidden_size
    row_inputs: Callable[[Any, dict], dict] | None = None
    carried_size: Callable[[nn.Module], int] | None = None

    def __post_init__(self):
        _check(self, ("layers", "stage", "is_complete", "hidden_size"), ("row_inputs", "carried_size"))


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

    * ``save(state_dict, config, out_dir, *, dtype=None, max_shard_size=..., tensors=None)``:
      write full tensors as a Hub checkpoint (see :class:`HFSave`).
    * ``hub_tensors(state_dict, config) -> iterator of (Hub name, tensor)``: a full state dict
      in the Hub's names and layout (None: the names and layout are the Hub's already).
    * ``hub_layout(name, tensor, config, to_hub) -> tensor``: our tensor ``name`` (a parameter
      or a LoRA ``<module>.lora_A``/``lora_B``) in the Hub's row order (``to_hub``) or back
      (None: the same).
    * ``state_format(model) -> str | None``: a marker of how the model holds its parameters,
      stored with each checkpoint; a checkpoint whose marker differs is refused (None: plain).
    """

    save: HFSave
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
class LayerActivations:
    """What one block keeps of a micro-batch for its backward: ``saved`` without activation
    checkpointing, ``checkpointed`` with it (its input), and ``backward``: what its backward
    works with at once besides. ``type``: its layer type (``LayerTypes``), ``category``: the
    name the plan sums it under."""

    type: str
    category: str
    saved: float
    checkpointed: float
    backward: float = 0.0


@dataclass(frozen=True)
class ActivationBytes:
    """One micro-batch's activation estimate (``MemoryPlanSupport.activation_bytes``):
    ``layers``, one per block in order; ``loss``: what the final norm and the loss keep until
    their backward on the last stage; ``loss_backward``: what the loss works with while it
    runs."""

    layers: tuple[LayerActivations, ...]
    loss: float
    loss_backward: float = 0.0


@dataclass(frozen=True)
class EncoderActivations:
    """What the first stage's input encoders (e.g. a vision encoder) keep of one micro-batch
    (``MemoryPlanSupport.encoder_activation_bytes``): ``kept``, bytes kept for backward by the
    category the plan sums them under; ``backward``: what one encoder block's backward works
    with (its recompute when checkpointed); ``inputs``: the encoders' inputs in the batch."""

    kept: dict[str, float] = dataclasses.field(default_factory=dict)
    backward: float = 0.0
    inputs: float = 0.0


@dataclass(frozen=True)
class MemoryPlanSupport:
    """What ``hybridtrain plan`` estimates beyond parameters.
    ``activation_bytes(config, micro_batch, seq_len, dtype, loss_chunk_size, head_grad) ->
    ActivationBytes``: what one micro-batch keeps for backward per layer (with and without
    checkpointing) and in the loss, and what one layer's backward and the loss work with at
    once besides (``head_grad``: whether the output head trains); ``tp_plan(model, tp) -> {submodule path: style}``:
    how the spec's ``parallelize_fn`` splits a (stage) model over ``tp`` ranks (None: no
    tensor parallelism); ``fsdp_units(model) -> (units, expert_units)``: the FSDP2 units
    ``parallelize_fn`` gives ``distributed.fsdp.apply_fsdp`` (it asks this function too; a
    unit is a module or a list of modules, the root holds the rest; None: no FSDP2 estimate);
    ``encoder_activation_bytes(model, micro_batch, seq_len, dtype, recipe) ->
    EncoderActivations``: what the first stage's input encoders (e.g. a vision encoder on the
    micro-batch's images) of (stage) ``model`` keep per micro-batch beyond the layers, given
    the recipe (its data and training sections), what one encoder block's backward works with,
    and their inputs (None: no encoder)."""

    activation_bytes: Callable[..., ActivationBytes] | None = None
    tp_plan: Callable[[nn.Module, int], dict] | None = None
    fsdp_units: Callable[[nn.Module], tuple[list, list]] | None = None
    encoder_activation_bytes: Callable[..., EncoderActivations] | None = None

    def __post_init__(self):
        _check(self, (), ("activation_bytes", "tp_plan", "fsdp_units", "encoder_activation_bytes"))


@dataclass(frozen=True)
class HeteroSupport:
    """``plan(model, distributed, world_size, *, parallelize, device, autocast_dtype)``: the
    layout of ``distributed.encoder_ranks`` (the model's encoder on its own ranks, the rest laid
    out by ``parallelize(model, dims)``; see :mod:`hybridtrain.distributed.hetero`).
    ``sides(model) -> (encoder, rest)``: the two parts of a (meta-device) model, each a module
    holding only its side's parameters (their names as in ``model``), as ``plan`` lays them out
    (what ``hybridtrain plan`` plans; None: the plan refuses the layout)."""

    plan: Callable[..., Any]
    sides: Callable[[nn.Module], tuple[nn.Module, nn.Module]] | None = None

    def __post_init__(self):
        _check(self, ("plan",), ("sides",))


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


@dataclass(frozen=True)
class Decoding:
    """The model generates text: its class has ``generate`` (:class:`Decoder`), which
    ``hybridtrain generate``, the ``evaluation`` section and GRPO's rollouts call.
    ``pipeline``: it also decodes through pipeline stages (its ``generate`` takes a
    ``PipelineDecoder``); ``lockstep``: ranks whose model holds collectives (tensor, expert or
    context parallel) can decode together (``lockstep_group``). ``speculative``: self-speculative
    greedy decoding of one prompt, ``speculative(model, input_ids [1, L], max_new_tokens,
    draft_tokens, eos_token_id) -> (ids [1, L + n], {"drafted", "accepted", "acceptance_rate"})``,
    token-identical to greedy ``generate`` (None: the family has no draft of its own;
    ``hybridtrain generate --speculative`` refuses it). ``score_continuations``: several
    continuations of each prompt from one prefill of the prompt (its state copied per
    continuation), ``score_continuations(model, input_ids [b, L], attention_mask, rows [R],
    continuations [R, n], lengths) -> fp32 logits [R, n, V]`` whose ``[r, t]`` predicts
    ``continuations[r, t]`` after prompt ``rows[r]`` (left-padded where ``attention_mask`` is 0)
    and ``continuations[r, :t]``; ``lengths``: the tokens of each continuation (right-padded to
    n), longest first (logits past a row's length mean nothing); the lm-evaluation-harness
    model scores multiple-choice answers with it (None: it runs each context again per
    answer)."""

    pipeline: bool = False
    lockstep: bool = False
    speculative: Callable[..., tuple] | None = None
    score_continuations: Callable[..., torch.Tensor] | None = None

    def __post_init__(self):
        _check(self, optional=("speculative", "score_continuations"))


@dataclass(frozen=True)
class LayoutRules:
    """``check(config, dims, distributed, training, device_type)``: ValueError for a layout the
    spec's ``parallelize_fn`` cannot apply to a model of ``config`` (e.g. experts that do not
    split over ``ep``), without building anything. ``parallelize_fn`` applies the same rules;
    ``training.validate.validate_run`` calls it before a run builds its layout and when
    ``hybridtrain plan`` plans one, so both refuse the same layouts (None: no rules)."""

    check: Callable[..., None]

    def __post_init__(self):
        _check(self, ("check",))


@dataclass(frozen=True)
class AuxiliaryLosses:
    """The model trains objectives beside its language-model loss with layers of its own (e.g.
    multi-token prediction). ``setup(model, training)``: applies the recipe's ``training``
    choice for them to the (meta-device) model in place, logs it, and returns the
    :class:`~hybridtrain.ops.aux_loss.AuxiliaryLoss` the trainer drives (None: nothing to
    train). ``check_layout(model, dims, distributed, training)``: ValueError for a layout under
    which those objectives cannot train (``training.validate.validate_run`` calls it; None:
    they train under every layout)."""

    setup: Callable[[nn.Module, Any], Any]
    check_layout: Callable[[nn.Module, Any, Any, Any], None] | None = None

    def __post_init__(self):
        _check(self, ("setup",), optional=("check_layout",))


@dataclass(frozen=True)
class ExpertRouting:
    """The model has mixture-of-experts layers whose routers training watches and balances:
    ``setup(model, training) -> ExpertLoad | None`` (:class:`~hybridtrain.ops.expert_load.
    ExpertLoad`: the step's token counts per expert, the load metrics, the bias update at
    ``training.moe_bias_update_rate``; None: the model has no MoE layer)."""

    setup: Callable[[nn.Module, Any], Any]

    def __post_init__(self):
        _check(self, ("setup",))


PART_TYPES = (PeftSupport, MetaInit, MemoryPlanSupport, HeteroSupport, LayerTypes, Decoding,
              LayoutRules, AuxiliaryLosses, ExpertRouting)
P = TypeVar("P")


@dataclass(frozen=True)
class ModelSpec:
    """How a model family is built, laid out, split, counted and exported (the core), plus its
    optional ``parts`` (at most one of each of :data:`PART_TYPES`).

    ``parallelize_fn(model, dims, distributed, training, *, device, autocast_dtype)`` applies
    TP/EP/CP/activation checkpointing/compile/FSDP to one (stage) model in place
    (``distributed`` / ``training``: the recipe's typed sections, ``DistributedSection`` /
    ``TrainingSection`` of :mod:`hybridtrain.config.sections`); ``name``: the config's
    ``model_type``; ``model_cls`` keeps :class:`CausalLM`, ``config_cls`` :class:`ModelConfig`
    (``from_dict`` reads a saved checkpoint's config).
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
        """ValueError naming the first piece of the spec, its model class or its config class
        that the model contract (:class:`CausalLM`, :class:`ModelConfig`, :class:`HFSave`,
        :class:`Decoder`) asks for and it lacks."""
        where = f"model spec {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"{where}: name must be a non-empty string")
        if not (isinstance(self.model_cls, type) and issubclass(self.model_cls, nn.Module)):
            raise ValueError(f"{where}: model_cls must be an nn.Module class")
        if not isinstance(self.config_cls, type):
            raise ValueError(f"{where}: config_cls must be a class")
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
        self._check_contract(where)

    def _check_contract(self, where: str) -> None:
        model, config = self.model_cls, self.config_cls
        m, c = f"{where}: {model.__name__}", f"{where}: {config.__name__}"
        if getattr(config, "model_type", None) != self.name:
            raise ValueError(f"{c} must have the class attribute model_type = {self.name!r} (the "
                             "spec's name, as config.json spells it), got "
                             f"{getattr(config, 'model_type', None)!r}")
        for name in ("to_dict", "from_dict"):
            if not callable(getattr(config, name, None)):
                raise ValueError(f"{c} has no {name} (ModelConfig in models/spec.py)")
        for name in ("hidden_size", "vocab_size", "context_length"):
            if not (hasattr(config, name) or name in getattr(config, "__dataclass_fields__", {})):
                raise ValueError(f"{c} has no field or property {name} (ModelConfig in "
                                 "models/spec.py)")
        _check_signature(f"{c}.from_dict", config.from_dict, ModelConfig.from_dict)
        for name in ("name_or_path", "checkpoint_dtype"):
            if not hasattr(model, name):
                raise ValueError(f"{m} must declare the class attribute {name} (None until "
                                 "from_pretrained sets it; CausalLM in models/spec.py)")
        for name in ("save_pretrained", "from_pretrained"):
            if not callable(getattr(model, name, None)):
                raise ValueError(f"{m} has no {name} (CausalLM in models/spec.py)")
        _check_signature(f"{m}.forward", model.forward, CausalLM.forward, 4, same_names=True)
        _check_signature(f"{m}.save_pretrained", model.save_pretrained, CausalLM.save_pretrained)
        _check_signature(f"{m}.from_pretrained", model.from_pretrained, CausalLM.from_pretrained)
        _check_signature(f"{where}: HFAdapter.save", self.hf.save, HFSave.__call__, 3)
        if self.find(Decoding) is not None:
            if not callable(getattr(model, "generate", None)):
                raise ValueError(f"{m} has no generate, which its Decoding part promises "
                                 "(Decoder in models/spec.py)")
            _check_signature(f"{m}.generate", model.generate, Decoder.generate, 2)
            if not callable(getattr(model, "generation_cache_bytes", None)):
                raise ValueError(f"{m} has no generation_cache_bytes, which its Decoding part "
                                 "promises (Decoder in models/spec.py)")
            _check_signature(f"{m}.generation_cache_bytes", model.generation_cache_bytes,
                             Decoder.generation_cache_bytes, 2)

    def check_model(self, model: nn.Module) -> None:
        """ValueError naming what a built model (complete, not a stage) of this spec lacks of
        the contract's instance side: ``lm_head`` registered last, a ``loss``, layers keyed by
        their global index."""
        m = f"model spec {self.name!r}: {type(model).__name__}"
        heads = [n for n, _ in model.named_modules() if n.rpartition(".")[2] == "lm_head"]
        if len(heads) != 1:
            raise ValueError(f"{m} must hold one module named lm_head (CausalLM in "
                             f"models/spec.py), found {heads or 'none'}")
        names = [n for n, _ in model.named_parameters()]
        head_names = [n for n in names if n.startswith(heads[0] + ".")]
        if head_names and names[-len(head_names):] != head_names:
            raise ValueError(f"{m}: the lm_head's parameters must come last in parameters() "
                             f"(register lm_head last); the last is {names[-1]!r}")
        if not (isinstance(model.loss, nn.Module) and isinstance(model.loss, TrainLoss)):
            raise ValueError(f"{m} has no loss module with a recompute flag (TrainLoss, "
                             "CausalLM.loss in models/spec.py)")
        layers = self.pipeline.layers(model)
        if layers != [str(i) for i in range(len(layers))]:
            raise ValueError(f"{m}: its layers must sit in an nn.ModuleDict keyed by their global "
                             "index ('0', '1', ...), the names PipelineSplit.layers gives in "
                             f"order; got {layers[:4]}")


assert len(dataclasses.fields(ModelSpec)) <= 8  # the core stays small: new needs are parts

_SPECS: dict[str, ModelSpec] = {}
# the entry-point group families register through: ``name = "package.module:SPEC"`` in the
# ``[project.entry-points."hybridtrain.models"]`` table of the family's pyproject.toml, the
# entry's name equal to the spec's
ENTRY_POINT_GROUP = "hybridtrain.models"
_loaded_all = False
_broken: dict[str, str] = {}  # entry point name: why it failed to load


def register_model_spec(spec: ModelSpec) -> ModelSpec:
    """Check ``spec`` (:meth:`ModelSpec.validate`) and make it known by name and model class."""
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"register_model_spec takes a ModelSpec, got {type(spec).__name__}")
    spec.validate()
    if spec.name in _SPECS and _SPECS[spec.name] is not spec:
        raise ValueError(f"a model spec named {spec.name!r} is already registered")
    _SPECS[spec.name] = spec
    return spec


def _load_entry_point(ep) -> None:
    try:
        spec = ep.load()
    except Exception as e:  # a broken third-party package names itself
        raise ValueError(f"model family entry point {ep.name} = {ep.value} (group "
                         f"{ENTRY_POINT_GROUP!r}) failed to load: {type(e).__name__}: {e}") from e
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"entry point {ep.name} = {ep.value} (group {ENTRY_POINT_GROUP!r}) "
                         f"must name a ModelSpec, got {type(spec).__name__}")
    if spec.name != ep.name:
        raise ValueError(f"entry point {ep.name} = {ep.value} (group {ENTRY_POINT_GROUP!r}) "
                         f"names the spec {spec.name!r}; the entry's name must be the spec's")
    register_model_spec(spec)


def _load_families(name: str | None = None) -> None:
    """Load the entry points of group ``hybridtrain.models`` (only ``name``'s when given). A
    family that fails to load is left out (its error is kept, and named when a lookup finds
    nothing), so one broken package does not stop runs of the others."""
    global _loaded_all
    if _loaded_all or (name is not None and name in _SPECS):
        return
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if (name is None or ep.name == name) and ep.name not in _SPECS and ep.name not in _broken:
            try:
                _load_entry_point(ep)
            except ValueError as e:
                _broken[ep.name] = str(e)
                logger.warning("%s", e)
    _loaded_all = _loaded_all or name is None


def _unknown(what: str) -> str:
    broken = "".join(f"; {e}" for e in _broken.values())
    return (f"{what}; registered: {', '.join(sorted(_SPECS)) or 'none'}{broken}. A model family "
            f"registers through the entry-point group {ENTRY_POINT_GROUP!r} of an installed "
            "package (pip install it; hybridtrain's own families need hybridtrain installed, "
            "`pip install -e .`), or by calling register_model_spec")


def get_model_spec(name: str) -> ModelSpec:
    _load_families(name)
    if name not in _SPECS:
        raise ValueError(_unknown(f"no model spec named {name!r}"))
    return _SPECS[name]


def model_spec_for(model: nn.Module | type) -> ModelSpec:
    """The spec whose model class ``model`` (an instance or a class) is."""
    cls = model if isinstance(model, type) else type(model)
    for _ in range(2):  # the families registered so far, then all of them
        for spec in _SPECS.values():
            if issubclass(cls, spec.model_cls):
                return spec
        _load_families()
    raise ValueError(_unknown(f"{cls.__module__}.{cls.__name__} is not a registered model"))


def registered_model_class(dotted: str) -> type[nn.Module]:
    """The model class of a registered spec named ``module.Class``; ValueError otherwise."""
    _load_families()
    for spec in _SPECS.values():
        if f"{spec.model_cls.__module__}.{spec.model_cls.__qualname__}" == dotted:
            return spec.model_cls
    raise ValueError(_unknown(f"checkpoint model class {dotted!r} is not the model class of a "
                              "registered model spec"))


def set_train_loss(model: nn.Module, loss: TrainLoss) -> None:
    """Install the loss ``model.forward(labels=...)`` returns (the contract's
    :class:`TrainLoss`) in the place of ``model.loss``, wherever the model holds it (e.g. in a
    sub-model)."""
    if not (isinstance(loss, nn.Module) and isinstance(loss, TrainLoss)):
        raise ValueError(f"set_train_loss takes a TrainLoss module (models/spec.py: forward("
                         f"hidden, head, labels) and a recompute flag), got {type(loss).__name__}")
    old = model.loss
    holders = [(mod, name) for mod in model.modules() for name, child in mod.named_children()
               if child is old]
    assert holders, f"{type(model).__name__}.loss is not one of its modules"
    for mod, name in holders:
        setattr(mod, name, loss)
