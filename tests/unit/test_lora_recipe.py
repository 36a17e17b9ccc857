"""examples/chat_lora_tiny.yaml end to end (a few steps) on a tiny base model built here:
adapter-only checkpoints, the PEFT adapter and merged exports, resume."""

import json
import os
from pathlib import Path

import torch
from tests.helpers.models import tiny_base
from tests.helpers.recipes import run_overrides

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "chat_lora_tiny.yaml"


def _overrides(out: Path, max_steps: int, resume: str = "null") -> list[str]:
    return run_overrides(
        out, max_steps, resume,
        f"--+dataset.cache_dir={out.parent}/cache",
        "--+dataset.limit=48",
        f"--+validation_dataset.cache_dir={out.parent}/cache",
        "--+validation_dataset.limit=8",
        "--packing.pack_size=256",
        "--training.global_batch_size=2",
        "--metrics.plot=false",
    )


def test_chat_lora_tiny(tmp_path, monkeypatch):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    from hybridtrain.cli import main
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM
    from hybridtrain.peft import load_peft_adapter

    base = tmp_path / "base"
    tiny_base(base)
    monkeypatch.setenv("HYBRIDTRAIN_TINY_BASE", str(base))
    out = tmp_path / "run"
    assert main(["finetune", "-c", str(RECIPE), *_overrides(out, 2)]) == 0

    recs = [json.loads(line) for line in open(out / "training.jsonl")]
    assert [r["step"] for r in recs] == [1, 2] and all(r["skipped_steps"] == 0 for r in recs)
    step = out / "step_2"
    adapter, merged = step / "adapter", step / "merged_hf"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(os.listdir(adapter))
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["base_model_name_or_path"]) == (8, 32, str(base))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(merged))
    assert not (step / "hf").exists()

    # the checkpoint holds adapters (+ buffers) and their optimizer state, never base weights
    keys = FileSystemReader(str(step / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all("lora_" in k or k.endswith("e_score_correction_bias") for k in model_keys)
    assert not any(k.endswith((".weight", "experts.up_proj")) and "lora_" not in k for k in keys)

    # base + adapter == merged export, and training moved the adapters
    t = load_file(adapter / "adapter_model.safetensors")
    assert any(v.abs().sum() > 0 for k, v in t.items() if "lora_B" in k)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        m = NemotronHForCausalLM.from_pretrained(base)
        load_peft_adapter(m, adapter)
        want = m(ids)
        got = NemotronHForCausalLM.from_pretrained(merged)(ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    # resume from the adapter-only checkpoint (base weights come from the base model again); the
    # merged export follows checkpoint.save_dtype like hf/ does
    assert main(["finetune", "-c", str(RECIPE), *_overrides(out, 3, resume="auto"),
                 "--checkpoint.save_dtype=bfloat16"]) == 0
    recs2 = [json.loads(line) for line in open(out / "training.jsonl")]
    assert [r["step"] for r in recs2] == [1, 2, 3] and recs2[:2] == recs
    merged3 = load_file(out / "step_3" / "merged_hf" / "model.safetensors")
    assert {v.dtype for k, v in merged3.items() if k.endswith("proj.weight")} == {torch.bfloat16}


def test_chat_lora_tiny_runs_right_after_the_demo(tmp_path, monkeypatch):
    """The README's two demos in a row, with the defaults' paths, whatever the first's step count:
    the LoRA recipe reads the base from outputs/squad_tiny/final/hf."""
    from hybridtrain.cli import main

    repo = RECIPE.parents[1]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYBRIDTRAIN_TINY_BASE", raising=False)
    (tmp_path / "examples").symlink_to(repo / "examples")
    short = ["--metrics.progress_bar=false", "--metrics.plot=false", "--metrics.peak_tflops=1.0"]
    assert main(["finetune", "-c", "examples/squad_tiny.yaml", "--training.max_steps=3",
                 "--training.ckpt_every_steps=2", "--training.val_every_steps=0",
                 "--tokenizer.out_dir=outputs/squad_tiny/tokenizer",
                 "--tokenizer.texts.num_questions=300",
                 "--dataset.path.path=outputs/data/train.json",
                 "--dataset.path.num_questions=100",
                 "--validation_dataset.path.path=outputs/data/validation.json",
                 "--validation_dataset.path.num_questions=8", *short]) == 0
    final = tmp_path / "outputs" / "squad_tiny" / "final"
    assert os.readlink(final) == "step_3" and (final / "hf" / "config.json").is_file()
    assert main(["finetune", "-c", "examples/chat_lora_tiny.yaml", "--training.max_steps=2",
                 "--training.ckpt_every_steps=0", "--training.val_every_steps=0",
                 f"--+dataset.cache_dir={tmp_path}/cache", "--+dataset.limit=24",
                 f"--+validation_dataset.cache_dir={tmp_path}/cache",
                 "--+validation_dataset.limit=4", "--packing.pack_size=256",
                 "--training.global_batch_size=2", *short]) == 0
    adapter = tmp_path / "outputs" / "chat_lora_tiny" / "final" / "adapter"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == "outputs/squad_tiny/final/hf"
    # and the README's merge command
    assert main(["merge", "--base", "outputs/squad_tiny/final/hf", "--adapter", str(adapter),
                 "--out", "outputs/chat_lora_tiny/merged"]) == 0
