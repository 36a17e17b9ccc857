"""Reference initialisation, the forward contract (logits / loss / hidden states), meta-device
construction, and a short overfit run."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config


def _large_config():
    return tiny_config("mixed", mamba_num_heads=64, mamba_head_dim=4, hidden_size=256, n_groups=2)


def test_reference_initialisation():
    torch.manual_seed(0)
    cfg = _large_config()
    _assert_reference_initialisation(NemotronHForCausalLM(cfg), cfg)


def _assert_reference_initialisation(m, cfg):
    mamba = m.backbone.layers["0"].mixer
    assert torch.allclose(mamba.A_log, torch.log(torch.arange(1, 65, dtype=torch.float32)))
    assert torch.equal(mamba.D, torch.ones(64))
    dt = F.softplus(mamba.dt_bias)
    assert dt.min() >= cfg.time_step_min * 0.999 and dt.max() <= cfg.time_step_max * 1.001
    assert dt.std() > 0  # random, log-uniform
    bound = 1 / math.sqrt(mamba.out_proj.in_features) / math.sqrt(cfg.num_hidden_layers)
    assert mamba.out_proj.weight.abs().max() <= bound + 1e-7
    assert mamba.out_proj.weight.abs().max() > 0.8 * bound
    assert abs(mamba.in_proj.weight.std().item() - cfg.initializer_range) < 0.002
    assert abs(m.backbone.embeddings.weight.std().item() - cfg.initializer_range) < 0.002
    assert abs(m.lm_head.weight.std().item() - cfg.initializer_range) < 0.002
    moe = m.backbone.layers["3"].mixer
    assert torch.equal(moe.gate.e_score_correction_bias, torch.zeros(cfg.n_routed_experts))
    assert abs(moe.experts.up_proj.std().item() - cfg.initializer_range) < 0.002
    for name, p in m.named_parameters():
        if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        if name.endswith(".bias") and "dt_bias" not in name:
            assert torch.equal(p, torch.zeros_like(p)), name


def test_meta_construction_allocates_nothing_then_initialises_as_the_reference():
    """Built on the meta device, then ``to_empty`` + ``init_weights``: the reference
    initialisation (as constructed on the CPU), the same weights again for the same seed."""
    cfg = _large_config()
    weights = []
    for _ in range(2):
        with torch.device("meta"):
            m = NemotronHForCausalLM(cfg)
        assert all(p.is_meta for p in m.parameters())
        m.to_empty(device="cpu")
        torch.manual_seed(0)
        m.init_weights()
        _assert_reference_initialisation(m, cfg)
        weights.append(m.state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_forward_contract_logits_loss_hidden_states():
    torch.manual_seed(0)
    cfg = tiny_config("mixed")
    m = NemotronHForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 13))
    labels = torch.randint(0, cfg.vocab_size, (2, 13))
    labels[:, :4] = -100
    with torch.no_grad():
        logits = m(ids)
        h = m.hidden_states(ids)
        loss = m(ids, labels=labels)
    assert logits.dtype == torch.float32 and logits.shape == (2, 13, cfg.vocab_size)
    assert h.shape == (2, 13, cfg.hidden_size)
    assert torch.allclose(m.lm_head(h), logits, atol=1e-6)
    ref = F.cross_entropy(logits.view(-1, cfg.vocab_size), labels.view(-1), ignore_index=-100)
    assert loss.shape == () and torch.allclose(loss, ref, atol=1e-6)
    assert m(ids, labels=torch.full_like(labels, -100)).item() == 0.0


def test_bf16_forward_runs_close_to_fp32():
    torch.manual_seed(0)
    cfg = tiny_config("mixed")
    m = NemotronHForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 20))
    with torch.no_grad():
        ref = m(ids)
        out = m.to(torch.bfloat16)(ids, cu_seqlens=torch.tensor([0, 7, 20]))
        assert m.backbone.layers["3"].mixer.gate.e_score_correction_bias.dtype == torch.float32
        ref_packed = m.float()(ids, cu_seqlens=torch.tensor([0, 7, 20]))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert (out - ref_packed).abs().max() < 0.05
    assert ref.shape == out.shape


def test_short_training_run_overfits():
    torch.manual_seed(0)
    cfg = tiny_config("mixed")
    m = NemotronHForCausalLM(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        loss = m(ids, labels=labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 5.0 and losses[-1] < 0.1 * losses[0], losses[::4]
