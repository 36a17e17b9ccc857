"""The Nemotron-H vision-language model spec (see :mod:`hybridtrain.models.spec`): the language
model's layers, FLOPs and export rules plus the vision encoder and projector."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import register_fsdp_forward_method

from hybridtrain.config.sections import DistributedSection, TrainingSection
from hybridtrain.distributed.activation_checkpoint import apply_activation_checkpointing
from hybridtrain.distributed.compile import apply_compile, compile_enabled
from hybridtrain.distributed.fsdp import apply_fsdp
from hybridtrain.models.nemotron_h import spec as lm_spec
from hybridtrain.models.nemotron_h.moe import Experts
from hybridtrain.models.nemotron_h.parallelize import fsdp_units as lm_fsdp_units
from hybridtrain.models.nemotron_h.parallelize import BLOCK_TYPES, parallelize_nemotron_h
from hybridtrain.models.nemotron_h.parallelize import check_layout as lm_check_layout
from hybridtrain.models.nemotron_h.parallelize import tp_plan as lm_tp_plan
from hybridtrain.models.spec import (
    FlopsCount, HeteroSupport, HFAdapter, LayoutRules, MemoryPlanSupport, MetaInit, ModelSpec,
    PeftSupport, PipelineSplit, register_model_spec)

from .config import NemotronVLMConfig
from .hetero import hetero_plan, hetero_sides
from .io import save_vlm, vlm_slice_reader
from .memory import activation_bytes, encoder_activation_bytes
from .model import NemotronVLMForConditionalGeneration
from .pipeline import images_by_row


def parallelize_vlm(model: nn.Module, dims, distributed: DistributedSection,
                    training: TrainingSection, *, device: torch.device,
                    autocast_dtype: torch.dtype | None) -> None:
    """The language model as Nemotron-H parallelizes it, then the ViT blocks (activation
    checkpointing, compile) and FSDP2: one unit per ViT block, one for the projector, the
    whole model as root (patch/position embeddings, class tokens, the ViT's final norm). A
    pipeline stage after the first holds no ViT or projector; an encoder rank of the
    heterogeneous layout no language model (its step calls ``image_embeddings``, which FSDP2
    then gathers the root for as for ``forward``)."""
    if model.language_model is not None:
        parallelize_nemotron_h(model.language_model, dims, distributed, training, device=device,
                               autocast_dtype=autocast_dtype)
    if model.vision_model is not None:  # not on a later pipeline stage
        blocks = model.vision_model.blocks
        if training.activation_checkpointing:
            apply_activation_checkpointing(blocks, "all", compiled=compile_enabled(training.compile, device))
        apply_compile(blocks, training.compile, device)
    if dims.fsdp_enabled:
        apply_fsdp(model, _vision_units(model), dims, distributed, autocast_dtype=autocast_dtype)
        if model.language_model is None:
            register_fsdp_forward_method(model, "image_embeddings")


def check_layout(config, dims, distributed, training, device_type: str) -> None:
    """The language model's rules (:func:`parallelize_vlm` lays it out as Nemotron-H)."""
    lm_check_layout(config.text_config, dims, distributed, training, device_type)


def _vision_units(model: nn.Module) -> list[nn.Module]:
    if model.vision_model is None:
        return []
    return list(model.vision_model.blocks.values()) + [model.projector]


def fsdp_units(model: nn.Module) -> tuple[list, list[nn.Module]]:
    """The FSDP2 units :func:`parallelize_vlm` makes: the language model's (its own root,
    the language model, one unit), then the ViT blocks and the projector."""
    if model.language_model is None:  # an encoder rank of the heterogeneous layout
        return _vision_units(model), []
    lm_units, experts = lm_fsdp_units(model.language_model)
    return lm_units + [model.language_model] + _vision_units(model), experts


def tp_plan(model: nn.Module, tp: int) -> dict:
    """The language model's tensor-parallel plan (:func:`parallelize_vlm` applies Nemotron-H's
    to it), under its name in the VLM; the ViT and projector are not split."""
    return {f"language_model.{k}": v for k, v in lm_tp_plan(model.language_model, tp).items()}


def pipeline_layers(model: nn.Module) -> list[str]:
    """The language model's layers (none on an encoder rank of the heterogeneous layout)."""
    if model.language_model is None:
        return []
    return lm_spec.pipeline_layers(model.language_model)


def is_complete(model: nn.Module) -> bool:
    """False for a rank of the heterogeneous layout (it holds only some modules)."""
    return (model.vision_model is not None and model.projector is not None
            and model.language_model is not None and lm_spec.is_complete(model.language_model))


def pipeline_stage(model, layers, is_first, is_last):
    if model.config.image_token_id == 0:
        raise ValueError("distributed.pp > 1 pads rows with token id 0, which is this model's "
                         "image_token_id (placeholders would appear); give the image "
                         "placeholder another id")
    return model.pipeline_stage([int(k) for k in layers], is_first, is_last)


def layer_flops(config: NemotronVLMConfig, seq_len: int) -> list[float]:
    return lm_spec.layer_flops(config.text_config, seq_len)


def head_flops(config: NemotronVLMConfig) -> float:
    return lm_spec.head_flops(config.text_config)


def vision_flops(config: NemotronVLMConfig, image_grid) -> float:
    """Training FLOPs (3 x forward) of the ViT and the projector on images of ``image_grid``:
    per image of T = h*w + class tokens: blocks ``2 T (4 D^2 + 2 D I) + 4 T^2 D`` each, patch
    embedding ``2 h w C p^2 D``, projector ``2 (h w / 4)(4 D P + P H)``."""
    v = config.vision_config
    D, I_, P, H = v.hidden_size, v.intermediate_size, config.projector_hidden_size, config.hidden_size
    total = 0.0
    for h, w in (image_grid.tolist() if image_grid is not None else []):
        n = h * w
        T = n + v.class_token_len
        total += v.num_hidden_layers * (2 * T * (4 * D * D + 2 * D * I_) + 4 * T * T * D)
        total += 2 * n * v.patch_dim * D
        m = n // config.merge ** 2
        total += 2 * m * (config.merge ** 2 * D * P + P * H)
    return 3.0 * total


def batch_flops(config: NemotronVLMConfig, batch: dict, head_on_label_tokens_only: bool) -> float:
    return (lm_spec.batch_flops(config.text_config, batch, head_on_label_tokens_only)
            + vision_flops(config, batch.get("image_grid")))


def save_hf(state_dict, config, out_dir, *, dtype=None, max_shard_size="5GB", tensors=None
            ) -> None:
    """safetensors + config.json, the language model's tensors in the Hub's names and layout."""
    save_vlm(state_dict, config, out_dir, max_shard_size=max_shard_size, dtype=dtype,
             tensors=tensors)


def state_format(model: nn.Module) -> str | None:
    """The language model's marker (its Mamba row order), from the config: also on a rank of
    the heterogeneous layout that holds only the encoder."""
    return lm_spec.config_state_format(model.config.text_config)


NEMOTRON_H_VLM = register_model_spec(ModelSpec(
    name="nemotron_h_vlm",
    model_cls=NemotronVLMForConditionalGeneration,
    config_cls=NemotronVLMConfig,
    parallelize_fn=parallelize_vlm,
    pipeline=PipelineSplit(layers=pipeline_layers, stage=pipeline_stage, is_complete=is_complete,
                           row_inputs=images_by_row),
    flops=FlopsCount(layer=layer_flops, head=head_flops, batch=batch_flops),
    hf=HFAdapter(save=save_hf, state_format=state_format),
    parts=(
        PeftSupport(expert_modules=(Experts,)),
        HeteroSupport(plan=hetero_plan, sides=hetero_sides),
        MetaInit(init_units=NemotronVLMForConditionalGeneration.init_units,
                 hf_slice_reader=vlm_slice_reader),
        MemoryPlanSupport(activation_bytes=activation_bytes, fsdp_units=fsdp_units,
                          encoder_activation_bytes=encoder_activation_bytes, tp_plan=tp_plan),
        BLOCK_TYPES,  # the language model's (its parallelize function checkpoints by them)
        LayoutRules(check=check_layout),
    ),
))
