"""The few-row forms of a decoding step (the mixers' ``step`` methods, ``decode_ops``) compute what
the layers' own forwards compute: the projections' CPU product forms, the MoE step (one token and
several; host-grouped and grouped on the device), the fused block norm, and the LM head against
its transposed copy on a long generation (cached logits = the full forward's)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.helpers.models import perturbed_model
from torch import nn

from hybridtrain.models.nemotron_h import generation as G
from hybridtrain.models.nemotron_h import decode_ops, tiny_config
from hybridtrain.models.nemotron_h.mamba_step import ssd_step_torch
from hybridtrain.ops import backend


def device_forms():
    """The decoding forms of a captured step (no fp32 CPU forms)."""
    return backend.using(dataclasses.replace(backend.settings(), cpu_decode_forms=False))


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_few_row_linear_matches_the_module(rows):
    torch.manual_seed(0)
    lin = nn.Linear(48, 80)
    x = torch.randn(rows, 1, 48)
    assert torch.allclose(decode_ops.linear(lin, x), lin(x), atol=1e-6, rtol=1e-5)
    assert decode_ops.linear(lin, x).is_contiguous()


@pytest.mark.parametrize("host_grouped", [True, False])
@pytest.mark.parametrize("tokens", [1, 3])
def test_moe_step_matches_the_layer(tokens, host_grouped):
    model = perturbed_model(tiny_config("moe"), seed=4)
    moe = next(b.mixer for b in model.backbone.layers.values() if b.block_type == "moe")
    x = torch.randn(tokens, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), (backend.using(backend.settings()) if host_grouped else device_forms()):
        assert torch.allclose(moe.step(x), moe(x), atol=1e-6, rtol=1e-5)


def test_block_norm_of_a_step_matches_the_module():
    model = perturbed_model(tiny_config("dense"), seed=6)
    norm = model.backbone.layers["0"].norm
    x = torch.randn(3, 1, model.config.hidden_size)
    with torch.no_grad():
        assert torch.allclose(decode_ops.norm(norm, x), norm(x), atol=1e-6, rtol=1e-5)


def test_ssd_step_matches_the_per_head_recurrence():
    g = torch.Generator().manual_seed(7)
    b, h, p, n, groups = 2, 4, 3, 5, 2
    state = torch.randn(b, h, p, n, generator=g)
    x, dt = torch.randn(b, h, p, generator=g), torch.rand(b, h, generator=g)
    A, D = -torch.rand(h, generator=g), torch.randn(h, generator=g)
    B, C = torch.randn(b, groups, n, generator=g), torch.randn(b, groups, n, generator=g)
    Bh, Ch = B.repeat_interleave(h // groups, 1), C.repeat_interleave(h // groups, 1)
    ref = state * torch.exp(dt * A)[..., None, None] + (dt[..., None] * x)[..., None] * Bh[:, :, None]
    y_ref = torch.einsum("bhpn,bhn->bhp", ref, Ch) + D[:, None] * x
    y = ssd_step_torch(state, x, dt, A, B, C, D)
    assert torch.allclose(state, ref, atol=1e-6) and torch.allclose(y, y_ref, atol=1e-5)


def test_long_generation_uses_the_transposed_head_and_matches_the_full_forward():
    model = perturbed_model(tiny_config("mixed"), seed=8)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(9))
    n = backend.TRANSPOSED_HEAD_MIN_STEPS + 2
    out = model.generate(ids, max_new_tokens=n)
    with torch.no_grad():
        full = model(out)
    logits, cache = G.prefill(model, ids, max_length=out.shape[1])
    worst = (logits - full[:, 5]).abs().max().item()
    for t in range(6, out.shape[1] - 1):
        worst = max(worst, (G.decode_step(model, cache, out[:, t]) - full[:, t]).abs().max().item())
    assert cache.head_t is not None
    assert worst <= 1e-4, worst


def test_generated_tokens_are_a_plain_tensor():
    """generate runs under inference mode; what it returns is usable in autograd and in place."""
    model = perturbed_model(tiny_config("dense"), seed=10)
    out = model.generate(torch.randint(0, 256, (1, 4)), max_new_tokens=3)
    assert not out.is_inference()
    out[:, 0] = 1
    model(out, labels=out).backward()


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("conv_bias", [True, False])
def test_fused_mamba_step_equals_the_generic_step(rows, conv_bias):
    """The fp32 CPU Mamba2 step (one function on [b, groups, ...] views, parameters prepared
    once) gives bit-identical outputs, conv windows and SSM states to the generic step
    (conv_step / ssd_step / the gated norm module), with 2 B/C groups."""
    import copy

    model = perturbed_model(tiny_config("mixed", use_conv_bias=conv_bias), seed=11)
    name, block = next((n, b) for n, b in model.backbone.layers.items() if b.block_type == "linear_attention")
    ids = torch.randint(0, 256, (rows, 7), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        _, cache = G.prefill(model, ids, max_length=12)
        fused, generic = cache.layers[name], copy.deepcopy(cache.layers[name])
        generic.step = None  # the generic path
        assert fused.step is not None  # prefill chose the fused path
        for t in range(3):
            x = torch.randn(rows, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(t))
            assert torch.equal(block.mixer.step(x, fused), block.mixer.step(x, generic))
        assert torch.equal(fused.conv, generic.conv) and torch.equal(fused.ssm, generic.ssm)
