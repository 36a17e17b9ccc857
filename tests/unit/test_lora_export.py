"""LoRA adapters in the Hugging Face PEFT format: keys, config, round trip, merge CLI, PEFT load."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re

import pytest
import torch
from safetensors import safe_open

from hybridtrain.models.nemotron_h import NemotronHForCausalLM
from hybridtrain.peft import (
    apply_lora,
    export_peft,
    has_lora,
    load_peft_adapter,
    lora_state_dict,
    save_merged_hf,
    save_peft_adapter,
)
from hybridtrain.recipes.merge import run as merge_cli

from test_lora import ids, make_model, randomize_adapters

_KEY = r"^base_model\.model\.(backbone\.layers\.\d+\.mixer\.(?:[a-z_]+\.)?(?:\d+\.)?[a-z_]+)\.lora_[AB]\.weight$"


def _read(path):
    with safe_open(os.path.join(path, "adapter_model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_adapter_keys_and_config(tmp_path):
    m = make_model()
    apply_lora(m, dim=4, alpha=8, dropout=0.1)
    randomize_adapters(m)
    out = save_peft_adapter(m, tmp_path / "adapter", base_model_name_or_path="/models/base")
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM" and cfg["bias"] == "none"
    assert (cfg["r"], cfg["lora_alpha"], cfg["lora_dropout"]) == (4, 8, 0.1)
    assert cfg["base_model_name_or_path"] == "/models/base"
    # every linear layer but lm_head is adapted, so the leaf names describe it exactly
    assert cfg["target_modules"] == ["down_proj", "in_proj", "k_proj", "o_proj", "out_proj", "q_proj",
                                     "up_proj", "v_proj"]
    t = _read(out)
    assert all(re.match(_KEY, k) for k in t), [k for k in t if not re.match(_KEY, k)][:5]
    q = "base_model.model.backbone.layers.1.mixer.q_proj"
    assert t[f"{q}.lora_A.weight"].shape == (4, 64) and t[f"{q}.lora_B.weight"].shape == (64, 4)
    torch.testing.assert_close(t[f"{q}.lora_B.weight"], m.backbone.layers["1"].mixer.q_proj.lora_B)
    # per-expert adapters under the Hub's per-expert module names
    exp = m.backbone.layers["3"].mixer.experts
    for j in range(8):
        e = f"base_model.model.backbone.layers.3.mixer.experts.{j}"
        assert t[f"{e}.up_proj.lora_A.weight"].shape == (4, 64)
        assert t[f"{e}.up_proj.lora_B.weight"].shape == (32, 4)
        assert t[f"{e}.down_proj.lora_A.weight"].shape == (4, 32)
        torch.testing.assert_close(t[f"{e}.down_proj.lora_B.weight"], exp.down_proj_lora_B[j])
    n_linear = sum(1 for n in lora_state_dict(m) if n.endswith(".lora_A"))
    assert len(t) == 2 * (n_linear + 2 * 2 * 8)  # + 2 MoE layers x 2 projections x 8 experts


def test_partial_targets_config_is_exact_regex(tmp_path):
    m = make_model()
    names = apply_lora(m, dim=4, alpha=8, target_modules=["q_proj", "*.experts.*.up_proj"],
                       exclude_modules=["backbone.layers.5.*"])
    save_peft_adapter(m, tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    pat = cfg["target_modules"]
    assert isinstance(pat, str)
    hub_modules = [n for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)]
    hub_modules += [f"backbone.layers.{i}.mixer.experts.{j}.{p}" for i in (3, 6) for j in range(8)
                    for p in ("up_proj", "down_proj")]
    hit = {n for n in hub_modules if re.fullmatch(pat, n)}
    want = {"backbone.layers.1.mixer.q_proj"} | {f"backbone.layers.{i}.mixer.experts.{j}.up_proj"
                                                 for i in (3, 6) for j in range(8)}
    assert hit == want
    # transformers' module names (model.layers...) match the same way
    assert re.fullmatch(pat, "model.layers.1.mixer.q_proj") and not re.fullmatch(pat, "model.layers.5.mixer.q_proj")
    assert len(names) == 3


def test_export_load_round_trip_same_logits(tmp_path):
    m = make_model()
    applied = apply_lora(m, dim=4, alpha=8, target_modules=["in_proj", "out_proj", "q_proj", "v_proj",
                                                            "up_proj", "down_proj"])
    randomize_adapters(m)
    x = ids()
    with torch.no_grad():
        want = m(x)
    export_peft(m, tmp_path / "adapter", "base")  # single process: same as save_peft_adapter
    fresh = make_model()  # same base weights (same seed), no adapters
    names = load_peft_adapter(fresh, tmp_path / "adapter")
    assert sorted(names) == sorted(applied)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), want, atol=0, rtol=0)
    # loading into a model that already has matching adapters only copies the weights
    load_peft_adapter(fresh, tmp_path / "adapter")
    # a model with different adapters is refused
    other = make_model()
    apply_lora(other, dim=2, alpha=8)
    with pytest.raises(ValueError, match="does not match the model's adapters"):
        load_peft_adapter(other, tmp_path / "adapter")


def test_load_rejects_bad_adapters(tmp_path):
    with pytest.raises(ValueError, match="not a PEFT adapter directory"):
        load_peft_adapter(make_model(), tmp_path)
    m = make_model()
    apply_lora(m, dim=4, alpha=8, target_modules=["q_proj"])
    d = save_peft_adapter(m, tmp_path / "a")
    cfg_path = os.path.join(d, "adapter_config.json")
    cfg = json.load(open(cfg_path))
    json.dump({**cfg, "use_dora": True}, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="unsupported LoRA options.*use_dora"):
        load_peft_adapter(make_model(), d)
    json.dump(cfg, open(cfg_path, "w"))
    small = NemotronHForCausalLM(make_model("dense").config)  # no attention layer 1 -> no q_proj there
    with pytest.raises(ValueError, match="do not fit this model"):
        load_peft_adapter(small, d)


def test_merge_cli_and_save_merged_hf(tmp_path):
    m = make_model()
    m.save_pretrained(tmp_path / "base")
    (tmp_path / "base" / "tokenizer_config.json").write_text("{}")
    apply_lora(m, dim=4, alpha=8)
    randomize_adapters(m)
    x = ids()
    with torch.no_grad():
        want = m(x)
    save_peft_adapter(m, tmp_path / "adapter", str(tmp_path / "base"))
    from hybridtrain.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["merge", "--base", str(tmp_path / "base"), "--adapter", str(tmp_path / "adapter"),
                     "--out", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "tokenizer_config.json").is_file()
    merged = NemotronHForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(merged(x), want, atol=1e-5, rtol=1e-5)
    # the trainer's option: a merged HF dir straight from the live LoRA model
    save_merged_hf(m, tmp_path / "merged2")
    merged2 = NemotronHForCausalLM.from_pretrained(tmp_path / "merged2")
    with torch.no_grad():
        torch.testing.assert_close(merged2(x), want, atol=1e-5, rtol=1e-5)
    assert has_lora(m)  # the live model keeps its adapters
    with pytest.raises(SystemExit):
        with contextlib.redirect_stderr(io.StringIO()):
            merge_cli(["--base", "x"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_save_merged_hf_writes_the_save_dtype(tmp_path, dtype):
    """``checkpoint.save_dtype`` applies to merged_hf/ as to hf/ (fp32 weights in both cases)."""
    m = make_model()
    apply_lora(m, dim=4, alpha=8)
    randomize_adapters(m)
    save_merged_hf(m, tmp_path / "merged", dtype=dtype)
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), framework="pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    want = {torch.bfloat16: "BF16", torch.float32: "F32"}[dtype]
    kept_fp32 = {k for k in dtypes if k.endswith("e_score_correction_bias")}  # transformers keeps fp32
    assert {v for k, v in dtypes.items() if k not in kept_fp32} == {want}
    assert "backbone.layers.1.mixer.q_proj.weight" in dtypes  # merged weights, not adapter keys
    assert not any("lora" in k for k in dtypes)
    if dtype == torch.bfloat16:  # the merged values, rounded
        merged = NemotronHForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
        lin = m.backbone.layers["1"].mixer.q_proj
        q = (lin.weight + lin.delta_weight()).detach()
        torch.testing.assert_close(merged.backbone.layers["1"].mixer.q_proj.weight,
                                   q.to(torch.bfloat16).float(), atol=0, rtol=0)


def test_peft_library_loads_adapter_into_transformers(tmp_path):
    """The strongest format check: PEFT's PeftModel on transformers' NemotronHForCausalLM gives
    our logits. (PEFT refuses Mamba out_proj for nemotron_h, and transformers' stacked experts do
    not take per-expert adapters, so those are left out here.)"""
    pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from peft import PeftModel

    transformers.logging.set_verbosity_error()
    m = make_model()
    m.save_pretrained(tmp_path / "base")
    apply_lora(m, dim=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "in_proj",
                                                  "shared_experts.up_proj", "mixer.down_proj"])
    randomize_adapters(m)
    save_peft_adapter(m, tmp_path / "adapter", str(tmp_path / "base"))
    x = ids()
    with torch.no_grad():
        want = m(x)
    with contextlib.redirect_stderr(io.StringIO()):
        hf = transformers.NemotronHForCausalLM.from_pretrained(
            tmp_path / "base", dtype=torch.float32, attn_implementation="eager").eval()
        pm = PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
        n_lora = sum(1 for n, _ in pm.named_parameters() if "lora_A" in n)
        with torch.no_grad():
            got = pm(x, use_cache=False).logits
    assert n_lora == sum(1 for n in lora_state_dict(m) if n.endswith("lora_A"))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_merge_refuses_another_base_unless_told(tmp_path, capsys):
    from hybridtrain.cli import main

    m = make_model()
    m.save_pretrained(tmp_path / "base")
    m.save_pretrained(tmp_path / "other")  # same shapes, another folder
    apply_lora(m, dim=4, alpha=8)
    randomize_adapters(m)
    save_peft_adapter(m, tmp_path / "adapter", str(tmp_path / "base"))
    args = ["merge", "--base", str(tmp_path / "other"), "--adapter", str(tmp_path / "adapter"),
            "--out", str(tmp_path / "merged")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "base") in err and str(tmp_path / "other") in err
    assert "--allow-base-mismatch" in err and not (tmp_path / "merged").exists()
    assert main(args + ["--allow-base-mismatch"]) == 0
    assert (tmp_path / "merged" / "config.json").is_file()
    # a Hub id matches a local folder named after it (or the Hub cache's snapshot folder)
    from hybridtrain.peft.export import _same_base

    snap = tmp_path / "models--org--Model-X" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    assert _same_base("org/Model-X", str(snap), str(tmp_path / "adapter"))
    assert _same_base("org/Model-X", str(tmp_path / "org" / "Model-X"), str(tmp_path))
    assert not _same_base("org/Model-Y", str(snap), str(tmp_path / "adapter"))
