"""How Nemotron-H parallelizes one (stage) model, in a fixed order (as torchtitan):

    TP (not yet) -> CP -> EP -> activation checkpointing -> compile -> FSDP2

The pipeline split comes before, in :func:`hybridtrain.distributed.plan.parallelize`, through
the spec's ``pipeline_stage``; this function then runs on each stage. Degrees of 1 do nothing.
FSDP2 units: the embeddings, every block (an MoE block's routed experts are their own unit on
the expert mesh when ``ep > 1``) and the (stage) model as root, holding ``norm_f`` + ``lm_head``.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridtrain.distributed.activation_checkpoint import apply_activation_checkpointing
from hybridtrain.distributed.compile import apply_compile
from hybridtrain.distributed.context_parallel import apply_context_parallel
from hybridtrain.distributed.expert_parallel import apply_expert_parallel, check_ep_backend
from hybridtrain.distributed.fsdp import apply_fsdp
from hybridtrain.distributed.parallel_dims import ParallelDims


def parallelize_nemotron_h(model: nn.Module, dims: ParallelDims, distributed, training, *,
                           device: torch.device, autocast_dtype: torch.dtype | None) -> None:
    """Apply the ``distributed`` / ``training`` sections' layout to ``model`` in place."""
    if dims.tp > 1:
        raise ValueError(
            f"distributed.tp={dims.tp}: tensor parallelism is not implemented for Nemotron-H "
            "yet; use tp: 1 (FSDP2, pipeline, expert and context parallelism cover the "
            "supported layouts)")
    if dims.cp > 1:
        apply_context_parallel(model, dims.group("cp"))
    layers = model.backbone.layers
    moe_blocks = [b for b in layers.values() if b.block_type == "moe"]
    if dims.ep > 1:
        check_ep_backend(distributed.ep_backend, device.type)
        dims.check_experts(model.config.n_routed_experts)
        for block in moe_blocks:
            apply_expert_parallel(block.mixer, dims.mesh("ep"))
    if training.activation_checkpointing:
        apply_activation_checkpointing(layers, training.activation_checkpointing)
    if training.compile:
        apply_compile(layers)
    if dims.fsdp_enabled:
        units = [model.backbone.embeddings] + list(layers.values())
        experts = [b.mixer.experts for b in moe_blocks] if dims.ep > 1 else []
        apply_fsdp(model, [u for u in units if u is not None], dims, distributed,
                   autocast_dtype=autocast_dtype, expert_units=experts)
