"""Small Nemotron-H configurations for tests, demos and benchmarks."""

from __future__ import annotations

from typing import Any

from .config import NemotronHConfig

_PATTERNS = {
    "dense": "M-M*-M",
    "moe": "MEM*EM",
    "mixed": "M*-EM*E",  # all four layer types
}


def tiny_config(kind: str = "mixed", **overrides: Any) -> NemotronHConfig:
    """A tiny config (hidden 64, vocab 256, chunk_size 8 so short inputs span several chunks).

    ``kind``: 'dense' (``M-M*-M``), 'moe' (``MEM*EM``) or 'mixed' (``M*-EM*E``, all four layer
    types). ``overrides`` are config fields, plus ``hybrid_override_pattern``.
    """
    if kind not in _PATTERNS:
        raise ValueError(f"tiny_config kind must be one of {sorted(_PATTERNS)}, got {kind!r}")
    d: dict[str, Any] = dict(
        hybrid_override_pattern=_PATTERNS[kind],
        vocab_size=256,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        mamba_num_heads=8,
        mamba_head_dim=16,
        n_groups=2,
        ssm_state_size=16,
        conv_kernel=4,
        expand=2,
        chunk_size=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        max_position_embeddings=1024,
    )
    d.update(overrides)
    return NemotronHConfig.from_dict(d, source=f"tiny_config({kind!r})")


def small_moe_config(**overrides: Any) -> NemotronHConfig:
    """About 48M parameters (hidden 512, vocab 32000, 8 layers ``MEM*EM-E``): big enough for
    throughput benchmarks on one GPU, small enough for CPU smoke runs."""
    d: dict[str, Any] = dict(
        hybrid_override_pattern="MEM*EM-E",
        vocab_size=32000,
        hidden_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=1536,
        mamba_num_heads=16,
        mamba_head_dim=64,
        n_groups=2,
        ssm_state_size=64,
        conv_kernel=4,
        chunk_size=128,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        moe_shared_expert_intermediate_size=512,
        n_group=1,
        topk_group=1,
        max_position_embeddings=8192,
    )
    d.update(overrides)
    return NemotronHConfig.from_dict(d, source="small_moe_config()")
