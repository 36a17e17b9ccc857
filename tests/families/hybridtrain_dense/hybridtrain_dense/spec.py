"""The model spec of the dense family, which hybridtrain finds through the entry point
``dense_test = "hybridtrain_dense.spec:DENSE"`` (group ``hybridtrain.models``) of this
package's pyproject.toml and checks against its model contract when it registers it."""

from __future__ import annotations

from hybridtrain.distributed.activation_checkpoint import apply_activation_checkpointing
from hybridtrain.distributed.fsdp import apply_fsdp
from hybridtrain.models.spec import (Decoding, FlopsCount, HFAdapter, LayoutRules,
                                     MemoryPlanSupport, MetaInit, ModelSpec, PeftSupport,
                                     PipelineSplit)

from hybridtrain_dense.model import DenseConfig, DenseLM, save_hf


def fsdp_units(model) -> tuple[list, list]:
    """(the FSDP2 units: each decoder layer, no expert units); the root holds the rest."""
    return list(model.model.layers.values()), []


def check_layout(config, dims, distributed, training, device_type):
    """The layouts :func:`parallelize` refuses (the LayoutRules part)."""
    if dims.tp > 1 or dims.cp > 1 or dims.ep > 1:
        raise ValueError("dense_test supports data and pipeline parallelism only; set "
                         "distributed.tp, cp and ep to 1")


def parallelize(model, dims, distributed, training, *, device, autocast_dtype):
    check_layout(model.config, dims, distributed, training, device.type)
    if training.activation_checkpointing:  # no LayerTypes part: all or every k-th block only
        apply_activation_checkpointing(model.model.layers, training.activation_checkpointing)
    if dims.fsdp_enabled:
        units, _ = fsdp_units(model)
        apply_fsdp(model, units, dims, distributed, autocast_dtype=autocast_dtype)


def layer_flops(c: DenseConfig, seq_len: int) -> list[float]:
    H, kv = c.hidden_size, c.hidden_size // c.num_attention_heads * c.num_key_value_heads
    per = 2 * (2 * H * H + 2 * H * kv + 3 * H * c.intermediate_size) + 4 * seq_len * H
    return [float(per)] * c.num_hidden_layers


def batch_flops(c: DenseConfig, batch: dict, head_on_label_tokens_only: bool) -> float:
    tokens = batch["input_ids"].numel()
    return 3.0 * tokens * (sum(layer_flops(c, batch["input_ids"].shape[1]))
                           + 2 * c.hidden_size * c.vocab_size)


DENSE = ModelSpec(
    name="dense_test", model_cls=DenseLM, config_cls=DenseConfig, parallelize_fn=parallelize,
    pipeline=PipelineSplit(
        layers=lambda m: list(m.model.layers.keys()),
        stage=lambda m, layers, first, last: m.pipeline_stage(layers, first, last),
        is_complete=lambda m: (len(m.model.layers) == m.config.num_hidden_layers
                               and m.lm_head is not None and m.model.embed_tokens is not None)),
    flops=FlopsCount(layer=layer_flops, head=lambda c: 2.0 * c.hidden_size * c.vocab_size,
                     batch=batch_flops),
    hf=HFAdapter(save=save_hf),
    parts=(MetaInit(init_units=DenseLM.init_units),
           PeftSupport(module_prefixes={"model.": "model."}),
           MemoryPlanSupport(fsdp_units=fsdp_units),  # no activation estimate: plan warns
           Decoding(lockstep=True),  # not through pipeline stages
           LayoutRules(check=check_layout)),
)
