"""Moving weights between our Nemotron-H and transformers' (the model-parity tests)."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


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
