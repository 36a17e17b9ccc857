"""NemotronHConfig: every spelling of the layer layout, legacy aliases, validation errors that
name the field, and a config.json that transformers reads the same way."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hybridtrain.models.nemotron_h import NemotronHConfig, NemotronHForCausalLM, small_moe_config, tiny_config

ALL = ["linear_attention", "full_attention", "mlp", "moe"]


def _base(**kw):
    d = tiny_config("mixed").to_hf_dict()
    for k in ("layers_block_type", "hybrid_override_pattern", "num_hidden_layers"):
        d.pop(k)
    d.update(kw)
    return d


def test_layer_layout_spellings_agree():
    a = NemotronHConfig.from_dict(_base(hybrid_override_pattern="M*-E"))
    b = NemotronHConfig.from_dict(_base(layers_block_type=ALL))
    c = NemotronHConfig.from_dict(_base(layer_types=["mamba", "attention", "mlp", "moe"]))
    d = NemotronHConfig.from_dict(_base(layers_block_type=ALL, hybrid_override_pattern="M*-E", num_hidden_layers=4))
    assert a.layers_block_type == b.layers_block_type == c.layers_block_type == d.layers_block_type == ALL
    assert a.hybrid_override_pattern == "M*-E" and a.num_hidden_layers == 4


def test_legacy_aliases():
    base = _base()
    for k in ("n_groups", "conv_kernel", "chunk_size", "head_dim", "time_step_min", "time_step_max",
              "time_step_limit", "time_step_floor", "use_conv_bias", "expand", "layer_norm_epsilon"):
        base.pop(k)
    cfg = NemotronHConfig.from_dict(base | dict(
        hybrid_override_pattern="M*", mamba_n_groups=4, mamba_d_conv=3, mamba_chunk_size=16, attention_head_dim=32,
        mamba_dt_min=0.002, mamba_dt_max=0.2, mamba_dt_limit=[0.0, "Infinity"], mamba_dt_init_floor=1e-3,
        mamba_conv_bias=False, mamba_expand=3, rms_norm_eps=1e-6,
    ))
    assert (cfg.n_groups, cfg.conv_kernel, cfg.chunk_size, cfg.head_dim) == (4, 3, 16, 32)
    assert (cfg.time_step_min, cfg.time_step_max, cfg.time_step_floor) == (0.002, 0.2, 1e-3)
    assert cfg.time_step_limit == (0.0, math.inf) and cfg.use_conv_bias is False and cfg.expand == 3
    assert cfg.layer_norm_epsilon == 1e-6
    with pytest.raises(ValueError, match="mamba_n_groups.*n_groups"):
        NemotronHConfig.from_dict(_base(hybrid_override_pattern="M", mamba_n_groups=4, n_groups=2))


def test_explicit_head_dim_is_used():
    cfg = tiny_config("dense", head_dim=24)  # != hidden_size / num_attention_heads = 16
    attn = NemotronHForCausalLM(cfg).backbone.layers["3"].mixer
    assert attn.q_proj.weight.shape == (4 * 24, 64) and attn.k_proj.weight.shape == (2 * 24, 64)
    assert attn.o_proj.weight.shape == (64, 4 * 24)


def test_infinity_spellings():
    for inf in (float("inf"), "Infinity", {"__float__": "Infinity"}):
        assert NemotronHConfig.from_dict(_base(time_step_limit=[0.0, inf])).time_step_limit == (0.0, math.inf)
    text = tiny_config("dense").to_json_string()
    assert "Infinity" in text and json.loads(text)["time_step_limit"] == [0.0, math.inf]


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(hybrid_override_pattern="M*X-"), r"hybrid_override_pattern.*'X' at position 2"),
        (dict(layers_block_type=["mamba", "conv"]), r"layers_block_type.*'conv' at index 1"),
        (dict(layer_types=["mlp", "sliding_attention"]), r"layer_types.*'sliding_attention'"),
        (dict(hybrid_override_pattern="M*-E", num_hidden_layers=5), r"num_hidden_layers.*5.*4 layers"),
        (dict(hybrid_override_pattern="M*", layers_block_type=["mamba", "mlp"]), r"hybrid_override_pattern"),
        (dict(hybrid_override_pattern="*", num_key_value_heads=3), r"num_key_value_heads"),
        (dict(hybrid_override_pattern="M", n_groups=3), r"`n_groups`"),
        (dict(hybrid_override_pattern="E", n_group=3), r"`n_group`"),
        (dict(hybrid_override_pattern="E", n_group=2, topk_group=3), r"`topk_group`"),
        (dict(hybrid_override_pattern="E", num_experts_per_tok=9), r"`num_experts_per_tok`"),
        (dict(hybrid_override_pattern="E", n_group=8), r"`n_group`.*>= 2 experts"),
        (dict(hybrid_override_pattern="-", mlp_hidden_act="swiglu"), r"`mlp_hidden_act`"),
        (dict(hybrid_override_pattern="M", hidden_size=0), r"`hidden_size`"),
        (dict(hybrid_override_pattern="M", time_step_limit=[0.0]), r"`time_step_limit`"),
        (dict(hybrid_override_pattern="M", model_type="llama"), r"model_type"),
        (dict(hybrid_override_pattern=""), r"hybrid_override_pattern"),
    ],
)
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        NemotronHConfig.from_dict(_base(**overrides))


def test_to_hf_dict_round_trips_and_transformers_agrees():
    transformers = pytest.importorskip("transformers")
    cfg = tiny_config("moe", n_group=2, topk_group=1, moe_latent_size=16)
    d = cfg.to_hf_dict()
    assert NemotronHConfig.from_dict(d) == cfg
    hf = transformers.NemotronHConfig(**json.loads(cfg.to_json_string()))
    assert hf.layers_block_type == cfg.layers_block_type
    for k in ("head_dim", "n_groups", "conv_kernel", "chunk_size", "mamba_num_heads", "mamba_head_dim",
              "n_routed_experts", "n_group", "topk_group", "moe_latent_size", "num_key_value_heads",
              "layer_norm_epsilon", "routed_scaling_factor", "norm_topk_prob", "time_step_min"):
        assert getattr(hf, k) == getattr(cfg, k), k
    # and the other way: transformers' own config.json reads back identically
    back = NemotronHConfig.from_dict(hf.to_dict())
    assert back.replace(extra={}, mtp_layers_block_type=None) == cfg  # transformers fills in an MTP default


def test_extra_keys_pass_through_and_remote_code_is_dropped():
    cfg = NemotronHConfig.from_dict(_base(hybrid_override_pattern="M", my_field=3,
                                          auto_map={"AutoModel": "x.Y"}, torch_dtype="bfloat16"))
    d = cfg.to_hf_dict(dtype="float32")
    assert d["my_field"] == 3 and "auto_map" not in d and "torch_dtype" not in d and d["dtype"] == "float32"
    assert d["architectures"] == ["NemotronHForCausalLM"] and d["model_type"] == "nemotron_h"


def test_dt_limit_is_the_kernels_time_step_limit():
    cfg = tiny_config("dense", time_step_min=0.05)
    assert cfg.dt_limit == (0.0, math.inf)  # time_step_min initialises dt; it does not clamp it
    assert tiny_config("dense", time_step_limit=(0.01, 5.0)).dt_limit == (0.01, 5.0)


def test_small_moe_config_size():
    cfg = small_moe_config()
    with torch.device("meta"):
        n = NemotronHForCausalLM(cfg).num_parameters()
    assert 40e6 < n < 60e6
    assert set(cfg.layers_block_type) == set(ALL)
