"""How Nemotron-H parallelizes one (stage) model, in a fixed order (as torchtitan):

    TP -> CP -> EP -> activation checkpointing -> compile -> FSDP2

The pipeline split comes before, in :func:`hybridtrain.distributed.parallel_plan.parallelize`, through
the spec's ``pipeline_stage``; this function then runs on each stage. Degrees of 1 do nothing.
FSDP2 units: the embeddings, every block (an MoE block's routed experts are their own unit, on
the expert mesh when ``ep > 1``, so a rank gathers one block's experts at a time), ``norm_f`` +
``lm_head`` (one unit), every MTP layer (as the blocks) and the (stage) model as root, holding
nothing else. Expert parallelism, activation checkpointing and compile cover the MTP layers as
the blocks (each MTP layer one graph).

Tensor parallelism (:func:`apply_tp`) splits every mixer by heads: attention's q/k/v by heads
(k/v computed whole when there are fewer kv heads than ranks), o_proj by rows; the MLP and the
MoE's shared expert up by columns, down by rows; Mamba2 by B/C groups (whole groups with their
heads: in_proj's rows, which we hold group by group, the conv channels, ``dt_bias``/``A_log``/
``D``, the gated norm's groups; out_proj by rows); the embeddings and the LM head over the
vocabulary. Norms, the router and the routed experts (split by ``ep`` instead) are replicated
over the tp ranks. With ``distributed.sequence_parallel`` the residual stream and the blocks'
norms hold each tp rank's part of the rows (``model.sequence_parallel``; the mixers, the routed
experts included, still take whole rows).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridtrain.config.sections import DistributedSection, TrainingSection
from hybridtrain.distributed.activation_checkpoint import apply_activation_checkpointing
from hybridtrain.distributed.compile import apply_compile, compile_enabled
from hybridtrain.distributed.context_parallel import ContextParallel
from hybridtrain.distributed.expert_parallel import apply_expert_parallel, check_ep_backend
from hybridtrain.distributed.fsdp import apply_fsdp
from hybridtrain.distributed.parallel_dims import ParallelDims
from hybridtrain.distributed.tensor_parallel import (LocalSlice, SequenceParallel, apply_tp_plan,
                                                     check_divisible, tp_mesh)
from hybridtrain.models.spec import LayerTypes

from .config import LAYER_TYPES, LEGACY_TYPE_NAMES, PATTERN_TO_TYPE


def check_tp(config, tp: int) -> None:
    """``ValueError`` naming the config field that does not split over ``tp`` ranks."""
    types = set(config.layers_block_type)
    if "full_attention" in types:
        check_divisible("num_attention_heads", config.num_attention_heads, tp)
        kv = config.num_key_value_heads
        if kv >= tp:
            check_divisible("num_key_value_heads", kv, tp)
        elif tp % kv:
            raise ValueError(f"distributed.tp={tp} is more than num_key_value_heads = {kv} and not a "
                             "multiple of it: with fewer kv heads than ranks each rank takes one kv "
                             f"head; choose a tp that divides {kv} or a multiple of it")
    if "linear_attention" in types:
        check_divisible("n_groups (Mamba2 B/C groups)", config.n_groups, tp,
                        ": each rank holds whole groups with their heads")
    if "mlp" in types:
        check_divisible("intermediate_size", config.intermediate_size, tp)
    if "moe" in types:
        check_divisible("moe_shared_expert_intermediate_size",
                        config.moe_shared_expert_intermediate_size, tp)


def check_layout(config, dims: ParallelDims, distributed: DistributedSection,
                 training: TrainingSection, device_type: str) -> None:
    """The layouts :func:`parallelize_nemotron_h` refuses for a model of ``config`` (the spec's
    ``LayoutRules``): heads, groups and widths that do not split over ``tp``, experts that do
    not split over ``ep``, an expert dispatcher the device lacks."""
    if dims.tp > 1:
        check_tp(config, dims.tp)
    if dims.ep > 1:
        check_ep_backend(distributed.ep_backend, device_type)
        dims.check_experts(config.n_routed_experts)


def tp_plan(model: nn.Module, tp: int) -> dict:
    """The tensor-parallel plan of a (stage) model over ``tp`` ranks (see the module docstring and
    ``distributed.tensor_parallel``): {submodule path: style, or parameters sharded along dim 0}."""
    config = model.config
    check_tp(config, tp)
    plan = {}
    if model.backbone.embeddings is not None:
        plan["backbone.embeddings"] = "vocab_embedding"
    if model.lm_head is not None:
        plan["lm_head"] = "vocab_head"
    blocks = [(f"backbone.layers.{name}", block) for name, block in model.backbone.layers.items()]
    if model.mtp is not None:  # the MTP layers' mixers split as the main stack's
        blocks += [(f"mtp.layers.{name}", block) for name, block in model.mtp.layers.items()]
    for prefix, block in blocks:
        at = f"{prefix}.mixer"
        if block.block_type == "linear_attention":
            plan.update({f"{at}.in_proj": "column", f"{at}.out_proj": "row", f"{at}.conv1d": ("weight", "bias"),
                         at: ("dt_bias", "A_log", "D"), f"{at}.norm": ("weight",)})
        elif block.block_type == "full_attention":
            plan.update({f"{at}.q_proj": "column", f"{at}.o_proj": "row"})
            if config.num_key_value_heads >= tp:  # else k/v whole on every rank (apply_tp)
                plan.update({f"{at}.k_proj": "column", f"{at}.v_proj": "column"})
        elif block.block_type == "mlp":
            plan.update({f"{at}.up_proj": "column", f"{at}.down_proj": "row"})
        elif block.block_type == "moe":
            plan.update({f"{at}.shared_experts.up_proj": "column", f"{at}.shared_experts.down_proj": "row"})
    return plan


def apply_tp(model: nn.Module, mesh, sequence_parallel: bool = False) -> None:
    """Tensor parallelism of a (stage) model over the 1-D ``mesh`` (see the module docstring);
    ``sequence_parallel``: the residual stream and the norms hold each rank's part of the rows."""
    config, tp = model.config, mesh.size()
    apply_tp_plan(model, mesh, tp_plan(model, tp))
    if sequence_parallel:
        model.sequence_parallel = SequenceParallel(mesh)
    kv = config.num_key_value_heads
    if kv < tp:  # k/v whole on every rank; each takes the kv head of its query heads
        mtp = list(model.mtp.layers.values()) if model.mtp is not None else []
        for block in list(model.backbone.layers.values()) + mtp:
            if block.block_type == "full_attention":
                block.mixer.local_kv_heads = LocalSlice(mesh, dim=1, start=mesh.get_local_rank() * kv // tp,
                                                        length=1)


# the block types, as per-type settings may name them: the config's names, their legacy names
# and the `hybrid_override_pattern` characters (the spec's LayerTypes part)
BLOCK_TYPES = LayerTypes(names=LAYER_TYPES, of=lambda block: block.block_type,
                         aliases={**LEGACY_TYPE_NAMES, **PATTERN_TO_TYPE})


def parallelize_nemotron_h(model: nn.Module, dims: ParallelDims, distributed: DistributedSection,
                           training: TrainingSection, *, device: torch.device,
                           autocast_dtype: torch.dtype | None, compile_options: dict | None = None) -> None:
    """Apply the ``distributed`` / ``training`` sections' layout to ``model`` in place (the MTP
    layers checkpointed and compiled as the main stack's blocks; ``compile_options``:
    ``torch.compile``'s, see :func:`~hybridtrain.distributed.compile.apply_compile`)."""
    check_layout(model.config, dims, distributed, training, device.type)
    if dims.tp > 1:
        apply_tp(model, tp_mesh(dims), distributed.sequence_parallel)
    if dims.cp > 1:
        model.context_parallel = ContextParallel(dims.group("cp"))
    layers = model.backbone.layers
    stacks = [layers] + ([model.mtp.layers] if model.mtp is not None else [])
    moe_blocks = [b for stack in stacks for b in stack.values() if b.block_type == "moe"]
    if dims.ep > 1:
        for block in moe_blocks:
            block.mixer.token_dispatcher = apply_expert_parallel(block.mixer.experts,
                                                                 dims.mesh("ep"))
    for stack in stacks:
        if training.activation_checkpointing:
            apply_activation_checkpointing(stack, training.activation_checkpointing, BLOCK_TYPES,
                                           compiled=compile_enabled(training.compile, device))
        apply_compile(stack, training.compile, device, **(compile_options or {}))
    if dims.fsdp_enabled:
        units, expert_units = fsdp_units(model)
        apply_fsdp(model, units, dims, distributed, autocast_dtype=autocast_dtype,
                   expert_units=expert_units)


def fsdp_units(model: nn.Module) -> tuple[list, list[nn.Module]]:
    """(dense FSDP2 units in forward order, stacked-expert units) of a (stage) model, the root
    holding the rest: the embeddings, each block, and the final norm with the head as one unit
    (gathered when the norm runs: the loss reads the head's weight, so a rank does not hold the
    head through the whole step as the root would)."""
    layers = list(model.backbone.layers.values())
    head = [m for m in (model.backbone.norm_f, model.lm_head) if m is not None]
    mtp = list(model.mtp.layers.values()) if model.mtp is not None else []
    units = [model.backbone.embeddings] + layers + [head or None] + mtp
    experts = [b.mixer.experts for b in layers + mtp if b.block_type == "moe"]
    return [u for u in units if u is not None], experts
