"""Model specs: the one way generic code (training, recipes, peft, distributed) reaches a model.

A model family registers one :class:`ModelSpec`. Everything outside ``models/`` asks the
registry (:func:`get_model_spec` by name, :func:`model_spec_for` by model object) and never
imports a model package itself, so a new model is added by writing its package and its spec.

What a model of a spec promises (the model contract):

* ``forward(input_ids, position_ids=None, cu_seqlens=None, labels=None)``: hidden states
  ``[B, L, H]`` when it holds no head (a pipeline stage before the last), else logits, or with
  ``labels`` the loss ``self.loss(hidden, head, labels)`` (an ``ops.loss.LinearCrossEntropy``;
  the trainer installs its summing one with :func:`set_train_loss`). A stage without
  embeddings takes hidden states as ``input_ids``.
* ``config`` (with ``to_dict()``), ``save_pretrained(dir, state_dict=, dtype=)`` and the
  class method ``from_pretrained(dir, dtype=)``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

__all__ = ["ModelSpec", "register_model_spec", "get_model_spec", "model_spec_for",
           "set_train_loss"]


@dataclass(frozen=True)
class ModelSpec:
    """How a model family is built, split, parallelized, counted, exported and adapted.

    * ``parallelize_fn(model, dims, distributed, training, device)``: applies TP/EP/activation
      checkpointing/compile/FSDP to one (stage) model in place; ``distributed`` / ``training``
      are the recipe's whole sections.
    * ``is_complete(model) -> bool``: whether ``model`` holds every part (not a pipeline stage).
    * ``pipeline_layers(model) -> list[str]``: the names of the model's pipeline-splittable
      layers, in order; ``pipeline_stage(model, layer_names, is_first, is_last)`` returns the
      stage: the model without the parts it does not own (same modules, same parameter names).
    * ``layer_flops(config, seq_len) -> list[float]``: forward cost of each layer per token (the
      pipeline split); ``head_flops(config)``: the head's; ``batch_flops(config, batch,
      head_on_label_tokens_only) -> float``: training FLOPs of a collated batch.
    * ``save_hf(state_dict, config, out_dir, dtype)``: write full tensors as a Hugging Face
      checkpoint; ``config_cls``: the config class (``from_dict``) of a saved checkpoint.
    * ``expert_modules``: module classes holding stacked per-expert weights (LoRA adapts
      them per expert); ``lora_export_notes(targets) -> str | None``: what PEFT cannot take;
      ``peft_module_prefixes``: {prefix of the transformers implementation's module names:
      ours}, to read adapters PEFT wrote for it.
    * ``activation_bytes(config, micro_batch, seq_len, dtype, loss_chunk_size, head_grad) ->
      {"layers": [{"type", "category", "saved", "checkpointed"}, ...], "head": {name: bytes}}``:
      what one micro-batch keeps for backward per layer (with and without activation
      checkpointing) and on the last stage (``hybridtrain plan``; None: no activation estimate).
    * ``hub_tensors(state_dict, config) -> iterator of (Hub name, tensor)``: a full state dict
      in the Hub's names and layout (None: the names and layout are the Hub's already).
    * ``hub_layout(name, tensor, config, to_hub) -> tensor``: our tensor ``name`` (a parameter
      or a LoRA ``<module>.lora_A``/``lora_B``) in the Hugging Face layout (``to_hub``) or a
      Hugging Face tensor in ours, where the two order rows differently (None: the same).
    * ``state_format(model) -> str | None``: a marker of how the model holds its parameters,
      stored with each checkpoint; a checkpoint whose marker differs is refused (None: the
      plain layout, also that of checkpoints written without a marker).
    * ``init_units(model) -> [(submodule name, init function)]``: the random initialisation in
      independent parts (each seeded on its own when materialising a meta-device model).
    * ``hf_slice_reader(local_dir) -> read(name, region)``: reads ``region`` (a tuple of slices)
      of parameter ``name`` from the Hugging Face checkpoint in ``local_dir``, touching only
      the checkpoint tensors it needs (the Hub <-> our name and layout mapping). A model that
      ``from_pretrained(dir, device="meta")`` builds records ``dir`` as ``name_or_path``.
    * ``hetero_plan(model, distributed, world_size)``: the plan of ``distributed.encoder_ranks``
      (the model's encoder on its own ranks; see :mod:`hybridtrain.distributed.hetero`), None
      when the model has no such split.
    * ``tp_plan(model, tp) -> {submodule path: style}``: how ``parallelize_fn`` splits a (stage)
      model over ``tp`` ranks (see ``distributed.tensor_parallel``; ``hybridtrain plan`` counts
      each parameter's share from it; None: no tensor parallelism).
    """

    name: str
    model_cls: type[nn.Module]
    config_cls: type
    parallelize_fn: Callable[..., None]
    is_complete: Callable[[nn.Module], bool]
    pipeline_layers: Callable[[nn.Module], list[str]]
    pipeline_stage: Callable[[nn.Module, list[str], bool, bool], nn.Module]
    layer_flops: Callable[[Any, int], list[float]]
    head_flops: Callable[[Any], float]
    batch_flops: Callable[[Any, dict, bool], float]
    save_hf: Callable[..., None]
    expert_modules: tuple[type[nn.Module], ...] = ()
    lora_export_notes: Callable[[list[str]], str | None] | None = None
    peft_module_prefixes: dict[str, str] = field(default_factory=dict)
    activation_bytes: Callable[..., dict] | None = None
    hub_tensors: Callable[[Any], Any] | None = None
    hub_layout: Callable[[str, Any, Any, bool], Any] | None = None
    state_format: Callable[[nn.Module], str | None] | None = None
    init_units: Callable[[nn.Module], list[tuple[str, Callable[[nn.Module], None]]]] | None = None
    hf_slice_reader: Callable[[str], Callable[[str, tuple[slice, ...]], Any]] | None = None
    hetero_plan: Callable[..., Any] | None = None
    tp_plan: Callable[[nn.Module, int], dict] | None = None


_SPECS: dict[str, ModelSpec] = {}
# model packages that register a spec when imported (imported on first lookup)
_BUILTIN = {"nemotron_h": "hybridtrain.models.nemotron_h.spec",
            "nemotron_h_vlm": "hybridtrain.models.nemotron_vlm.spec"}


def register_model_spec(spec: ModelSpec) -> ModelSpec:
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


def set_train_loss(model: nn.Module, loss: nn.Module) -> None:
    """Install the loss ``model.forward(labels=...)`` returns (the model contract's ``loss``);
    a model whose loss lives in a sub-model installs it with its own ``set_train_loss``."""
    if hasattr(model, "set_train_loss"):
        model.set_train_loss(loss)
        return
    assert hasattr(model, "loss"), f"{type(model).__name__} has no loss module"
    model.loss = loss
