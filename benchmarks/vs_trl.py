"""hybridtrain vs TRL's ``SFTTrainer`` + PEFT on CPU: the same tiny Nemotron-H (squad_tiny's
model, random weights, exported to a Hugging Face folder both load), the same chat data
(examples/data/chat_tiny_train.jsonl, loss on assistant turns), the same LoRA (rank 8, alpha 32,
attention q/k/v/o, Mamba in_proj, MLP and shared-expert up/down_proj; frozen on both sides: the
routed experts, fused tensors in transformers, and Mamba's out_proj, which PEFT refuses), the same schedule (33 steps, global
batch 4 = 2 x 2 accumulation, AdamW lr 3e-3 betas (0.9, 0.95), cosine to 3e-4 after 10 warm-up
steps, clip 1.0), no activation checkpointing, fp32, unpacked (rows of <= 256 tokens, padded per
micro-batch) and packed (rows of 512 tokens; hybridtrain: each micro-batch's rows joined without
their trailing padding, ``packing.padding_free``; TRL: its "wrapped" packing, since its best-fit
packing is padding-free, which transformers refuses on CPU for Mamba layers without mamba_ssm).

    pip install -e ".[bench]"      # trl>=1.16, an optional benchmark dependency
    python benchmarks/vs_trl.py    # ~5 min on 2 cores

Each run is a fresh process. "same policy": both under the OpenMP wait policy hybridtrain's
default chooses on this machine now (config/dist_env.py); "out of the box": each as it comes
(TRL: libgomp's default). The figure is the time of steps 2..33 from step 1's end to step 33's,
the loader's time in it (TRL: a callback's clock at each step's end; hybridtrain: the sum of its
``step_time_s``, the same clock), the best of ``--repeats``. Prints the
machine, both sides' trainable parameter counts (equal: the same LoRA) and the ratios
TRL time / hybridtrain time (> 1: hybridtrain faster).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data" / "chat_tiny_train.jsonl"
STEPS, MBS, ACCUM, LR, MIN_LR, WARMUP, RANK, ALPHA, SEQ, PACK = 33, 2, 2, 3e-3, 3e-4, 10, 8, 32, 256, 512
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "up_proj", "down_proj")


def _prepare(base: Path) -> None:
    """squad_tiny's model (random weights, seed 0) and a ChatML BPE tokenizer in ``base``."""
    import torch
    import yaml

    from hybridtrain.data import build_bpe_tokenizer, synthetic_texts
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config

    cfg = yaml.safe_load(open(ROOT / "examples" / "squad_tiny.yaml"))["model"]["config"]
    cfg.pop("_target_")
    texts = list(synthetic_texts(num_questions=2000, seed=0))
    texts += [m["content"] for line in open(DATA) for m in json.loads(line)["messages"]]
    tok = build_bpe_tokenizer(texts, base, vocab_size=cfg["vocab_size"])
    torch.manual_seed(0)
    NemotronHForCausalLM(tiny_config(**cfg)).save_pretrained(base)
    tok.save_pretrained(base)


def recipe(base: Path, out: Path, packed: bool) -> dict:
    """hybridtrain's side as a recipe (``base``: the folder :func:`_prepare` wrote; ``out``: the
    run folder)."""
    return {
        "tokenizer": {"_target_": "hybridtrain.data.load_tokenizer", "path": str(base)},
        "model": {"_target_": "hybridtrain.models.nemotron_h.NemotronHForCausalLM.from_pretrained",
                  "local_dir": str(base), "dtype": "float32"},
        "peft": {"method": "lora", "dim": RANK, "alpha": ALPHA, "dropout": 0.0,
                 "match_all_linear": False, "target_modules": [f"*.{t}" for t in TARGETS],
                 "exclude_modules": ["*.experts.*"]},
        "dataset": {"_target_": "hybridtrain.data.build_chat_dataset", "path": str(DATA),
                    "seq_length": SEQ, "train_on": "all"},
        "packing": {"enabled": packed, "pack_size": PACK, "padding_free": packed},
        "training": {"global_batch_size": MBS * ACCUM, "micro_batch_size": MBS, "max_steps": STEPS,
                     "val_every_steps": 0, "ckpt_every_steps": 0, "log_every_steps": 1,
                     "seed": 1234, "grad_clip": 1.0, "dtype": "float32"},
        "optimizer": {"lr": LR, "weight_decay": 0.0, "betas": [0.9, 0.95]},
        "lr_scheduler": {"lr_decay_style": "cosine", "lr_warmup_steps": WARMUP, "min_lr": MIN_LR},
        "checkpoint": {"dir": str(out), "save_hf_at_end": False},
        "metrics": {"progress_bar": False, "plot": False, "peak_tflops": 1.0},
    }


def _hybridtrain(base: Path, out: Path, packed: bool) -> dict:
    import yaml

    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(recipe(base, out, packed)))
    from hybridtrain.cli import main

    assert main(["finetune", "-c", str(path)]) == 0
    records = [json.loads(line) for line in open(out / "training.jsonl")]
    assert len(records) == STEPS, len(records)
    from hybridtrain.config import load_config
    from hybridtrain.training.builder import build

    b = build(load_config(path), "cpu", data=False)
    trainable = sum(p.numel() for p in b.model.parameters() if p.requires_grad)
    return {"seconds": sum(r["step_time_s"] for r in records[1:]), "trainable": trainable,
            "tokens": sum(r["num_tokens"] for r in records[1:]), "loss": records[-1]["loss"]}


def _trl(base: Path, out: Path, packed: bool) -> dict:
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    clock: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.append(time.perf_counter())

    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    data = load_dataset("json", data_files=str(DATA), split="train")
    config = SFTConfig(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=MBS,
        gradient_accumulation_steps=ACCUM, learning_rate=LR, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.95, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr": MIN_LR}, warmup_steps=WARMUP, max_grad_norm=1.0,
        seed=1234, use_cpu=True, bf16=False, fp16=False, logging_steps=1, save_strategy="no",
        report_to=[], dataloader_num_workers=0, assistant_only_loss=True,
        max_length=PACK if packed else SEQ, packing=packed, disable_tqdm=True,
        gradient_checkpointing=False,  # TRL's default is on; hybridtrain's run checkpoints nothing
        # best-fit packing is padding-free, which transformers refuses for Mamba layers without
        # mamba_ssm's CUDA kernels: on CPU, TRL packs by concatenating (documents see each other)
        **({"packing_strategy": "wrapped", "padding_free": False} if packed else {}))
    lora = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                      target_modules=rf"^(?!.*\.experts\.).*\.({'|'.join(TARGETS)})$")
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tok,
                         peft_config=lora, callbacks=[Clock()])
    trainer.train()
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"seconds": clock[-1] - clock[0], "trainable": trainable, "loss": losses[-1]}


def _one(side: str, base: Path, out: Path, packed: bool, policy: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    result = out.parent / f"{out.name}.json"
    p = subprocess.run([sys.executable, __file__, "--side", side, "--base", str(base), "--out",
                        str(out), "--steps", str(STEPS), *(["--packed"] if packed else [])], env=env,
                       capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise SystemExit(f"{side} ({'packed' if packed else 'unpacked'}) failed:\n"
                         f"{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> int:
    global STEPS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--steps", type=int, default=STEPS, help="training steps (default 33)")
    ap.add_argument("--side", choices=("trl", "hybridtrain"), help=argparse.SUPPRESS)
    ap.add_argument("--base", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--packed", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prepare", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    STEPS = args.steps
    if args.prepare:
        _prepare(args.prepare)
        return 0
    if args.side:  # one run, in its own process
        fn = _trl if args.side == "trl" else _hybridtrain
        res = fn(args.base, args.out, args.packed)
        (args.out.parent / f"{args.out.name}.json").write_text(json.dumps(res))
        return 0
    try:
        import trl
    except ImportError:
        print("TRL is not installed: `pip install \"trl>=1.16\"` (an optional benchmark "
              "dependency) and run again")
        return 2
    from hybridtrain.config.dist_env import omp_wait_policy

    policy = omp_wait_policy(os.environ)
    cores = len(os.sched_getaffinity(0))
    import torch
    import transformers

    print(f"machine: {platform.processor() or platform.machine()}, {cores} cores; torch "
          f"{torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}; "
          f"load average {os.getloadavg()[0]:.1f}; hybridtrain's default policy now: "
          f"{policy or 'libgomp default'}")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        base = tmp / "base"
        subprocess.run([sys.executable, __file__, "--prepare", str(base)], check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        for label, policies in (("same policy", (policy, policy)),
                                ("out of the box", (None, None))):
            if label == "out of the box" and policy is None:
                continue  # the same runs as above
            for packed in (False, True):
                best = {}
                for r in range(args.repeats):
                    for side, pol in zip(("trl", "hybridtrain"), policies):
                        out = tmp / f"{side}_{int(packed)}_{r}_{label[:3]}"
                        res = _one(side, base, out, packed, pol)
                        if side not in best or res["seconds"] < best[side]["seconds"]:
                            best[side] = res
                        print(f"  {label}, {'packed' if packed else 'unpacked'}, {side}: "
                              f"{res['seconds']:.2f} s (trainable {res['trainable']}, last loss "
                              f"{res['loss']:.3f})", flush=True)
                rows.append((label, packed, best["trl"]["seconds"], best["hybridtrain"]["seconds"],
                             best["trl"]["trainable"], best["hybridtrain"]["trainable"]))
    name = "same policy" if policy is None else f"same policy ({policy})"
    print(f"\nsteps 2..{STEPS}, seconds; ratio = TRL / hybridtrain:")
    print(f"{'':32s} {'TRL':>8s} {'hybridtrain':>12s} {'ratio':>7s}  trainable TRL / ours")
    for label, packed, t, h, nt, nh in rows:
        label = name if label == "same policy" else label
        print(f"{label + (', packed' if packed else ', unpacked'):32s} {t:8.2f} {h:12.2f} "
              f"{t / h:6.2f}x  {nt} / {nh}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
