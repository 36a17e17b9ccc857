"""Logits and gradient parity with transformers.NemotronHForCausalLM holding identical weights
(CPU, fp32). The measured maximum differences are printed (run with -s to see them)."""

from __future__ import annotations

import math

import pytest
import torch
from tests.helpers.hf import hf_from_dir, hf_logits, hf_name
from tests.helpers.models import perturbed_model

from hybridtrain.models.nemotron_h import tiny_config
from hybridtrain.models.nemotron_h.hf_io import hub_layout

CASES = {
    # name: (kind, config overrides, batch, seq_len)
    "dense M-M*-M": ("dense", {}, 2, 21),
    "moe MEM*EM": ("moe", {}, 2, 21),
    "moe n_group=4 topk_group=2 norm_topk_prob=False scale=2.5": (
        "moe", dict(n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=2.5), 2, 21),
    "mixed M*-EM*E": ("mixed", {}, 2, 21),
    "mixed L=16 (multiple of chunk_size)": ("mixed", {}, 2, 16),
    "mixed L=5 (shorter than one chunk)": ("mixed", {}, 2, 5),
    "mixed L=37 batch=3": ("mixed", {}, 3, 37),
    "dense batch=1 L=29": ("dense", {}, 1, 29),
    "mixed n_groups=1 MHA (kv heads = heads)": ("mixed", dict(n_groups=1, num_key_value_heads=4), 2, 19),
    "moe latent (moe_latent_size=32) top-3": ("moe", dict(moe_latent_size=32, num_experts_per_tok=3), 2, 21),
    "dense time_step_limit=(0.05, inf) (dt clamp active)": ("dense", dict(time_step_limit=(0.05, math.inf)), 2, 21),
    "dense time_step_limit=(0.01, 0.05) (dt clamped both sides)": ("dense", dict(time_step_limit=(0.01, 0.05)), 2, 21),
    "dense time_step_min=0.05 (initialises dt, no clamp)": ("dense", dict(time_step_min=0.05), 2, 21),
    "dense chunk_size=4 conv_kernel=2 biases": (
        "dense", dict(chunk_size=4, conv_kernel=2, use_bias=True, mlp_bias=True), 2, 23),
}


def test_the_clamp_cases_clamp():
    """The clamp cases above change the logits (dt crosses their bounds), so they test the clamp."""
    ids = torch.randint(0, tiny_config("dense").vocab_size, (2, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        free = perturbed_model(tiny_config("dense"), seed=1)(ids)
        for limit in [(0.05, math.inf), (0.01, 0.05)]:
            clamped = perturbed_model(tiny_config("dense", time_step_limit=limit), seed=1)(ids)
            assert (clamped - free).abs().max() > 5e-4, limit  # 5x the parity bound


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(name, tmp_path):
    kind, over, batch, length = CASES[name]
    cfg = tiny_config(kind, **over)
    ours = perturbed_model(cfg, seed=1)
    ours.save_pretrained(tmp_path / "ckpt")
    hf = hf_from_dir(tmp_path / "ckpt")
    torch.manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size, (batch, length))
    with torch.no_grad():
        a = ours(ids)
    b = hf_logits(hf, ids)
    diff = (a - b).abs().max().item()
    print(f"\n[parity] {name}: B={batch} L={length} max|logits diff| = {diff:.3e}")
    assert a.shape == b.shape == (batch, length, cfg.vocab_size)
    assert diff <= 1e-4


def test_gradients_match_transformers(tmp_path):
    cfg = tiny_config("mixed")
    ours = perturbed_model(cfg, seed=3)
    ours.save_pretrained(tmp_path / "ckpt")
    hf = hf_from_dir(tmp_path / "ckpt")
    torch.manual_seed(4)
    ids = torch.randint(0, cfg.vocab_size, (2, 21))
    w = torch.randn(2, 21, cfg.vocab_size)
    (ours(ids) * w).sum().backward()
    (hf(ids, use_cache=False).logits * w).sum().backward()
    hf_params = dict(hf.named_parameters())
    worst, checked = 0.0, 0
    for n, p in ours.named_parameters():
        g_ref = hf_params[hf_name(n)].grad
        assert p.grad is not None and g_ref is not None, n
        g = hub_layout(n, p.grad, cfg, to_hub=True)  # Mamba in_proj / conv1d rows in the Hub's order
        rel = ((g - g_ref).norm() / g_ref.norm().clamp(min=1e-12)).item()
        assert rel <= 1e-4, f"{n}: relative gradient error {rel:.2e}"
        worst, checked = max(worst, rel), checked + 1
    assert checked == len(hf_params)
    print(f"\n[parity] gradients, mixed M*-EM*E: {checked} parameters, max relative error = {worst:.3e}")
