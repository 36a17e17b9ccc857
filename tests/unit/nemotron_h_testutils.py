"""Shared helpers of the Nemotron-H model tests: building a model with non-trivial weights,
moving weights between our model and transformers'. (The SSD scan's plain reference is
``models.nemotron_h.ssd.ssd_reference``.)"""

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

