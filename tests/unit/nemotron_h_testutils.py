"""Shared helpers of the Nemotron-H model tests: building a model with non-trivial weights,
moving weights between our model and transformers', reference implementations."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from hybridtrain.models.nemotron_h import NemotronHForCausalLM

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def perturbed_model(cfg, seed: int = 0, scale: float = 0.05) -> NemotronHForCausalLM:
    """Reference init plus noise on every parameter and buffer (norm weights, D, biases,
    e_score_correction_bias all away from their trivial init values)."""
    torch.manual_seed(seed)
    m = NemotronHForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * scale)
        for b in m.buffers():
            b.add_(torch.randn_like(b) * scale)
    return m.eval()


def hf_from_dir(path, **kw):
    with contextlib.redirect_stderr(io.StringIO()):
        model, info = transformers.NemotronHForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True, **kw
        )
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not problems, f"transformers did not load every tensor: {problems}"
    return model.eval()


def hf_logits(hf_model, input_ids):
    with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
        return hf_model(input_ids, use_cache=False).logits


def hf_name(ours: str) -> str:
    """Our parameter name -> the name inside transformers' module tree."""
    assert ours.startswith(("backbone.", "lm_head."))
    return "model." + ours[len("backbone."):] if ours.startswith("backbone.") else ours


def reference_ssm(x, dt, A, B, C, D, seq_idx=None):
    """Token-by-token Mamba2 recurrence (the definition the chunked scan must equal).
    x [b,L,h,p], dt [b,L,h] (post softplus), A [h], B/C [b,L,g,n], D [h]."""
    b, L, h, p = x.shape
    g, n = B.shape[-2:]
    rep = h // g
    Bh = B.repeat_interleave(rep, dim=2)
    Ch = C.repeat_interleave(rep, dim=2)
    state = x.new_zeros(b, h, p, n)
    ys = []
    for t in range(L):
        if seq_idx is not None and t > 0:
            keep = (seq_idx[:, t] == seq_idx[:, t - 1]).to(x.dtype)[:, None, None, None]
            state = state * keep
        dA = torch.exp(dt[:, t] * A)  # [b,h]
        state = state * dA[:, :, None, None] + (dt[:, t, :, None, None] * x[:, t, :, :, None] * Bh[:, t, :, None, :])
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]) + D[None, :, None] * x[:, t])
    return torch.stack(ys, dim=1)
