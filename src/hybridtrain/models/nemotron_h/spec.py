"""The Nemotron-H model spec: how generic code builds, splits, parallelizes, counts, exports and
adapts this family (see :mod:`hybridtrain.models.spec`)."""

from __future__ import annotations

from torch import nn

from hybridtrain.models.spec import (
    AuxiliaryLosses, Decoding, ExpertRouting, FlopsCount, HFAdapter, LayoutRules, MemoryPlanSupport, MetaInit, ModelSpec, PeftSupport, PipelineSplit,
    register_model_spec)

from . import flops
from .config import NemotronHConfig
from .hf_io import hub_layout, hub_tensors, save_hf_checkpoint, slice_reader
from .memory import activation_bytes
from .model import NemotronHForCausalLM
from .moe import Experts
from .mtp_training import setup_aux_losses, setup_expert_load
from .continuations import score_continuations
from .speculative import speculative_decode
from .parallelize import BLOCK_TYPES, check_layout, fsdp_units, parallelize_nemotron_h, tp_plan


def pipeline_layers(model: nn.Module) -> list[str]:
    """The blocks in order (names are the global layer indices)."""
    return list(model.backbone.layers.keys())


def is_complete(model: nn.Module) -> bool:
    bb = model.backbone
    return (len(bb.layers) == model.config.num_hidden_layers and bb.embeddings is not None
            and model.lm_head is not None)


def pipeline_stage(model: nn.Module, layers: list[str], is_first: bool, is_last: bool) -> nn.Module:
    return model.pipeline_stage([int(k) for k in layers], is_first, is_last)


def carried_size(model: nn.Module) -> int:
    """The MTP depths' input embeddings, carried by the stages when those layers train (see
    ``NemotronHForCausalLM.pipeline_stage``)."""
    return model.config.hidden_size * model.config.num_nextn_predict_layers if "mtp" in model.aux_terms else 0


def layer_flops(config: NemotronHConfig, seq_len: int) -> list[float]:
    """Forward FLOPs of each layer over one ``seq_len``-token row (the pipeline split's costs)."""
    return [float(sum(flops.layer_flops(config, t, seq_len).values()))
            for t in config.layers_block_type]


def head_flops(config: NemotronHConfig) -> float:
    return 2.0 * config.hidden_size * config.vocab_size


def batch_flops(config: NemotronHConfig, batch: dict, head_on_label_tokens_only: bool) -> float:
    """Training FLOPs of a collated batch: attention per document; the LM head on label tokens
    only when the loss gives logits to nothing else (the chunked loss), else on every token."""
    if head_on_label_tokens_only:
        return float(flops.batch_flops(config, batch))
    rows = flops.batch_doc_lengths(batch)
    return float(flops.model_flops(config, rows, training=True)) if rows else 0.0


def config_state_format(cfg: NemotronHConfig) -> str | None:
    """Mamba in_proj / conv1d rows are held group by group (see ``mamba2``); with one group, or
    without Mamba layers, that is the Hub's (plain) order."""
    if cfg.n_groups > 1 and "linear_attention" in cfg.layers_block_type:
        return "mamba_rows_group_major"
    return None


def state_format(model: nn.Module) -> str | None:
    return config_state_format(model.config)


def lora_export_notes(adapted: list[str]) -> str | None:
    """Which adapters PEFT's ``PeftModel`` on transformers' Nemotron-H cannot take."""
    parts = []
    if any(n.endswith(".mixer.out_proj") for n in adapted):
        parts.append("Mamba out_proj (PEFT refuses it for nemotron_h)")
    if any(".mixer.experts." in n for n in adapted):
        parts.append("routed experts (transformers stacks them and PEFT does not convert "
                     "nemotron_h expert adapters)")
    if not parts:
        return None
    return (f"the LoRA adapter includes {' and '.join(parts)}: hybridtrain loads and merges it "
            "(load_peft_adapter, `hybridtrain merge`); peft.PeftModel on transformers' "
            "NemotronHForCausalLM takes only the other modules")


NEMOTRON_H = register_model_spec(ModelSpec(
    name="nemotron_h",
    model_cls=NemotronHForCausalLM,
    config_cls=NemotronHConfig,
    parallelize_fn=parallelize_nemotron_h,
    pipeline=PipelineSplit(layers=pipeline_layers, stage=pipeline_stage, is_complete=is_complete,
                           carried_size=carried_size),
    flops=FlopsCount(layer=layer_flops, head=head_flops, batch=batch_flops),
    hf=HFAdapter(save=save_hf_checkpoint, hub_tensors=hub_tensors, hub_layout=hub_layout,
                 state_format=state_format),
    parts=(
        PeftSupport(expert_modules=(Experts,), export_notes=lora_export_notes,
                    module_prefixes={"model.": "backbone."}),
        MetaInit(init_units=NemotronHForCausalLM.init_units, hf_slice_reader=slice_reader),
        MemoryPlanSupport(activation_bytes=activation_bytes, tp_plan=tp_plan,
                          fsdp_units=fsdp_units),
        BLOCK_TYPES,
        Decoding(pipeline=True, lockstep=True, speculative=speculative_decode,
                 score_continuations=score_continuations),
        LayoutRules(check=check_layout),
        AuxiliaryLosses(setup=setup_aux_losses),
        ExpertRouting(setup=setup_expert_load),
    ),
))
