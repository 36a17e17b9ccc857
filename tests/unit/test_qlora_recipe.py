"""examples/chat_lora_tiny.yaml with ``peft.base_quant: nf4`` (QLoRA) end to end on a tiny base
whose projections fit NF4's blocks: the base quantised while it loads, the loss falls as the
bf16-base LoRA run's, resume is exact, the PEFT adapter loads in PEFT on the unquantised base,
``hybridtrain merge`` writes the dequantised merged model transformers loads, and ``generate``
takes the run folder."""

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao", reason="peft.base_quant: nf4 needs torchao (the 'quant' extra)")

from tests.helpers.recipes import run_overrides  # noqa: E402

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "chat_lora_tiny.yaml"
STEPS = 6


def _make_base(path: Path) -> None:
    from hybridtrain.data import build_bpe_tokenizer, synthetic_texts
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM
    from tests.unit.test_qlora import qlora_config

    build_bpe_tokenizer(synthetic_texts(200, seed=0), out_dir=path, vocab_size=512)
    torch.manual_seed(0)
    NemotronHForCausalLM(qlora_config(vocab_size=512)).save_pretrained(path)


def _run(out: Path, max_steps: int, *extra: str, resume: str = "null") -> list[float]:
    from hybridtrain.cli import main

    args = run_overrides(out, max_steps, resume, f"--+dataset.cache_dir={out.parent}/cache",
                         "--+dataset.limit=48", f"--+validation_dataset.cache_dir={out.parent}/cache",
                         "--+validation_dataset.limit=4", "--packing.pack_size=256",
                         "--training.global_batch_size=2", "--metrics.plot=false",
                         "--training.ckpt_every_steps=3", "--training.val_every_steps=0",
                         "--lr_scheduler.lr_warmup_steps=1",
                         "--lr_scheduler.lr_decay_style=constant", *extra)  # resumable at any step
    assert main(["finetune", "-c", str(RECIPE), *args]) == 0
    return [json.loads(line)["loss"] for line in open(out / "training.jsonl")]


def test_qlora_chat_run_export_merge_generate(tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file

    from hybridtrain.cli import main
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM
    from hybridtrain.peft import load_peft_adapter
    from hybridtrain.peft.quant import is_nf4

    base = tmp_path / "base"
    _make_base(base)
    monkeypatch.setenv("HYBRIDTRAIN_TINY_BASE", str(base))
    lora = _run(tmp_path / "lora", STEPS, "--checkpoint.save_merged_hf=false")
    qlora = _run(tmp_path / "qlora", STEPS, "--peft.base_quant=nf4")
    print("lora", lora, "qlora", qlora)
    # measured 2026-12-06: 6.278 -> 5.873 (QLoRA), 6.276 -> 5.886 (LoRA)
    assert qlora[-1] < 0.95 * qlora[0] and lora[-1] < 0.95 * lora[0]
    assert abs(qlora[-1] - lora[-1]) <= 0.1 * lora[-1]
    assert 0.8 <= (qlora[0] - qlora[-1]) / (lora[0] - lora[-1]) <= 1.25

    # resume from the adapter-only checkpoint of step 3: the base is quantised again, bit for bit
    half = tmp_path / "half"
    _run(half, 3, "--peft.base_quant=nf4", "--checkpoint.save_hf_at_end=false")
    assert _run(half, STEPS, "--peft.base_quant=nf4", "--checkpoint.save_merged_hf=false",
                resume="auto") == qlora

    final = tmp_path / "qlora" / "final"
    adapter = final / "adapter"
    assert json.loads((adapter / "base_quant.json").read_text()) == {"base_quant": "nf4"}
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the trained model: the adapters on the NF4 base
        m = NemotronHForCausalLM.from_pretrained(base)
        load_peft_adapter(m, adapter, base_quant="nf4")
        assert any(is_nf4(p) for p in m.parameters())
        want = m(ids)
        merged_in_run = NemotronHForCausalLM.from_pretrained(final / "merged_hf")(ids)
    torch.testing.assert_close(merged_in_run, want, atol=1e-5, rtol=1e-5)

    # `hybridtrain merge` dequantises the base first; transformers loads the result
    transformers = pytest.importorskip("transformers")
    assert main(["merge", "--base", str(base), "--adapter", str(adapter),
                 "--out", str(tmp_path / "merged")]) == 0
    transformers.logging.set_verbosity_error()
    with contextlib.redirect_stderr(io.StringIO()), torch.no_grad():
        hf = transformers.NemotronHForCausalLM.from_pretrained(
            tmp_path / "merged", dtype=torch.float32, attn_implementation="eager").eval()
        got = hf(ids, use_cache=False).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    # PEFT loads the adapter file unchanged on the unquantised base (LoRA on the linear layers
    # PEFT takes for nemotron_h; its own check of the tensors: test_lora_export)
    from peft import PeftConfig

    cfg = PeftConfig.from_pretrained(str(adapter))
    assert (cfg.r, cfg.lora_alpha) == (8, 32)
    t = load_file(adapter / "adapter_model.safetensors")
    assert t and all(v.dtype == torch.float32 for v in t.values())

    # generate and evaluate take a run folder: `half` exports only the adapter, which they put
    # on the base quantised as in training
    capsys.readouterr()
    assert main(["generate", "--model", str(half), "--prompt", "Hello", "--max-new-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1])["new_tokens"] == 4
    assert main(["evaluate", "-c", str(RECIPE), f"--checkpoint.dir={half}",
                 "--+validation_dataset.limit=2"]) == 0
    err += capsys.readouterr().err
    assert err.count("base weights in NF4") == 2, err[-2000:]
    assert json.loads((half / "evaluation.jsonl").read_text().splitlines()[-1])["step"] == STEPS


def test_nemotron3_nano_qlora_recipe_on_the_real_chat_template(tmp_path, monkeypatch):
    """examples/nemotron3_nano_qlora.yaml as the LoRA chat guide runs its recipe
    (tests/unit/test_chat_guide_e2e.py: a tiny Nemotron-3-Nano-shaped bf16 checkpoint written by
    transformers, the model's own chat template, 480 of the 500 reference chat records; 12 steps),
    with its NF4 base: the merged (dequantised) model transformers loads lowers the held-out
    assistant loss (8.91 -> 6.52, 2026-12-06)."""
    from hybridtrain.cli import main
    from tests.unit.test_chat_guide_e2e import guide_inputs, guide_overrides, held_out_losses

    base, val = guide_inputs(tmp_path, monkeypatch)
    recipe = Path(__file__).resolve().parents[2] / "examples" / "nemotron3_nano_qlora.yaml"
    out = tmp_path / "run"
    steps = [f"--training.{k}=12" for k in ("max_steps", "val_every_steps", "ckpt_every_steps")]
    assert main(["finetune", "-c", str(recipe), *guide_overrides(out), *steps]) == 0
    adapter, merged = out / "step_12" / "adapter", tmp_path / "merged"
    assert (adapter / "base_quant.json").is_file()
    assert main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(merged)]) == 0
    before, after = held_out_losses(base, merged, val)
    assert after < before - 0.5, (before, after)
