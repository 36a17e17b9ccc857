"""Moving weights between our Nemotron-H and transformers' (the model-parity tests)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from packaging.version import Version

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


# transformers clamps the Mamba step dt = softplus(dt + dt_bias) at the config's time_step_limit,
# as mamba_ssm's kernels (and we) do, from 5.25.0 on; before, its CPU path clamped at
# [time_step_min, inf) and read no time_step_limit.
CLAMPS_AT_TIME_STEP_LIMIT = Version(transformers.__version__) >= Version("5.25.0")


def reference_clamp(hf_config: dict) -> dict:
    """Overrides of the Hub config ``hf_config`` under which the installed transformers clamps dt
    as the config says (``time_step_limit``): an older one is given that lower bound as its
    ``time_step_min``, which only initialises dt otherwise (at least 1e-30: it takes the log; no
    softplus(dt + dt_bias) of these tests comes near)."""
    if CLAMPS_AT_TIME_STEP_LIMIT:
        return {}
    lo, hi = hf_config.get("time_step_limit", (0.0, float("inf")))
    if hi != float("inf"):
        pytest.skip(f"transformers {transformers.__version__} < 5.25 cannot clamp dt from above")
    return {"time_step_min": max(lo, 1e-30)}


def hf_from_dir(path, **kw):
    with contextlib.redirect_stderr(io.StringIO()):
        model, info = transformers.NemotronHForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True,
            **reference_clamp(json.loads((Path(path) / "config.json").read_text())), **kw
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
