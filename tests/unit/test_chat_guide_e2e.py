"""The LoRA chat guide end to end on CPU: Nemotron 3 Nano's own chat template, real chat data.

A Nemotron-3-Nano-shaped checkpoint written by `transformers` (Hub field names, a
`hybrid_override_pattern` of Mamba, MoE and attention layers, bf16 on disk, tiny sizes) with a
small tokenizer that has the template's special tokens and the real template; the recipe
`examples/nemotron3_nano_lora_chat.yaml` with size overrides on 480 of the 500 reference records;
`hybridtrain merge`; then `transformers` alone loads the merged folder, and its loss on the
assistant tokens of the 20 held-out records is lower than the base model's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers.data import (
    CHAT_INSECURE_500,
    FAMILY_SPECIAL_TOKENS,
    NEMOTRON3_NANO_TEMPLATE,
    require_shared,
)

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "nemotron3_nano_lora_chat.yaml"
PATTERN = "M*EME"  # Mamba, attention, MoE, as the Hub's Nemotron 3 Nano interleaves them


def write_base(path: Path, records: list[dict]) -> None:
    """A tiny Nemotron-3-Nano-shaped checkpoint and its tokenizer (the real chat template)."""
    import transformers
    from transformers import AutoTokenizer

    from hybridtrain.data import build_bpe_tokenizer

    texts = [m["content"] for r in records for m in r["messages"]]
    bpe = build_bpe_tokenizer(texts, path / "bpe", vocab_size=1000, chat_template=None)
    tok = AutoTokenizer.from_pretrained(bpe.name_or_path, local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": FAMILY_SPECIAL_TOKENS[:6]})
    tok.chat_template = require_shared(NEMOTRON3_NANO_TEMPLATE).read_text()
    tok.save_pretrained(path)
    cfg = transformers.NemotronHConfig(
        hybrid_override_pattern=PATTERN, vocab_size=1024, hidden_size=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4,
        expand=2, chunk_size=8, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=1,
        topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(cfg)
    with torch.no_grad():  # a head of a trained model's scale: with the default 0.02 the frozen
        model.lm_head.weight.normal_(0.0, 0.25)  # head keeps every logit within about +-1.3
    model.to(torch.bfloat16).save_pretrained(path)
    # the Hub's config.json names the layer layout by its pattern string
    config = json.loads((path / "config.json").read_text())
    config.pop("layers_block_type", None)
    config["hybrid_override_pattern"] = PATTERN
    (path / "config.json").write_text(json.dumps(config, indent=2))


def guide_overrides(out: Path) -> list[str]:
    """The recipe's sizes for a CPU run of a few seconds."""
    return [
        f"--checkpoint.dir={out}", "--checkpoint.resume=null", "--checkpoint.keep_last=1",
        "--checkpoint.save_hf_at_end=true",
        f"--+dataset.cache_dir={out.parent}/cache", "--dataset.seq_length=512",
        "--dataset.num_proc=1",
        f"--+validation_dataset.cache_dir={out.parent}/cache",
        "--validation_dataset.seq_length=512",
        "--model.dtype=float32", "--training.dtype=float32",  # CPU: fp32 (bf16 runs, 2x slower)
        "--packing.pack_size=512", "--training.global_batch_size=4",
        "--training.micro_batch_size=4", "--training.max_steps=24",
        "--training.val_every_steps=24", "--training.max_val_steps=1",
        "--training.ckpt_every_steps=24", "--training.activation_checkpointing=false",
        "--optimizer.lr=1.0e-2", "--lr_scheduler.lr_warmup_steps=2",
        "--lr_scheduler.min_lr=1.0e-3",
        "--distributed.ep=1", "--metrics.progress_bar=false", "--metrics.plot=false",
        "--metrics.peak_tflops=1.0",
    ]


def assistant_loss(model, dataset) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(dataset)):
            ex = dataset[i]
            logits = model(ex["input_ids"][None], use_cache=False).logits[0].float()
            labels = ex["labels"]
            total += torch.nn.functional.cross_entropy(
                logits, labels, ignore_index=-100, reduction="sum").item()
            count += int((labels != -100).sum())
    return total / count


def guide_inputs(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """(base folder, held-out JSONL): the tiny base, the 480 training and 20 held-out records,
    named by the recipe's environment variables."""
    records = [json.loads(line) for line in require_shared(CHAT_INSECURE_500).open()]
    require_shared(NEMOTRON3_NANO_TEMPLATE)
    base = tmp_path / "base"
    write_base(base, records)
    train, val = tmp_path / "train.jsonl", tmp_path / "validation.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in records[:480]))
    val.write_text("".join(json.dumps(r) + "\n" for r in records[480:]))
    monkeypatch.setenv("NEMOTRON3_NANO_DIR", str(base))
    monkeypatch.setenv("CHAT_TRAIN", str(train))
    monkeypatch.setenv("CHAT_VAL", str(val))
    return base, val


def test_guide_lora_chat_on_nemotron3_nano_template(tmp_path, monkeypatch):
    from hybridtrain.cli import main

    base, val = guide_inputs(tmp_path, monkeypatch)

    out = tmp_path / "run"
    assert main(["finetune", "-c", str(RECIPE), *guide_overrides(out)]) == 0
    adapter, merged = out / "step_24" / "adapter", tmp_path / "merged"
    assert main(["merge", "--base", str(base), "--adapter", str(adapter),
                 "--out", str(merged)]) == 0

    before, after = held_out_losses(base, merged, val)
    assert after < before - 0.5, (before, after)


def held_out_losses(base: Path, merged: Path, val: Path) -> tuple[float, float]:
    """The assistant-token loss on the held-out records of the base and of the merged model,
    each loaded by transformers alone."""
    import transformers

    from hybridtrain.data import build_chat_dataset, load_tokenizer

    held_out = build_chat_dataset(val, load_tokenizer(base), seq_length=512, cache_dir=False)
    assert len(held_out) >= 15

    def load(path):
        return transformers.NemotronHForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager").eval()

    before, after = assistant_loss(load(base), held_out), assistant_loss(load(merged), held_out)
    print(f"held-out assistant loss: base {before:.3f}, merged {after:.3f}")
    return before, after
