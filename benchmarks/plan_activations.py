"""``hybridtrain plan``'s activation estimate against measured CPU memory, per layer type.

For each case (a Nemotron-H of one layer type, the mixed one, the mixed one with activation
checkpointing) a fresh process builds the model (fp32), takes one forward + backward of
``B x L`` tokens through the chunked loss, and reports its ``peak``: the most bytes allocated
at once above those before (the parameters and their gradients, which exist before, as from a
step's second micro-batch on), counted by glibc (``tests.helpers.memory.malloc_mmap_peak``;
the children run with ``MALLOC_MMAP_THRESHOLD_=4096``: every block of a page or more is its
own mapping), and the plan's activation figure for the same recipe
(``plan_memory(...).ranks[0].activations``), with the ratio plan / peak. fp32 only (this
machine emulates bf16).

    python benchmarks/plan_activations.py [--tokens 2x2048]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.helpers

CASES = {  # name -> (hybrid_override_pattern, activation_checkpointing)
    "mamba": ("MMMM", False),
    "attention": ("****", False),
    "mlp": ("----", False),
    "moe": ("EEEE", False),
    "mixed": ("M*-EM*-E", False),
    "mixed+ckpt": ("M*-EM*-E", True),
}


def recipe(pattern: str, ckpt: bool, batch: int, seq_len: int) -> dict:
    config = dict(
        _target_="hybridtrain.models.nemotron_h.tiny_config", kind="mixed",
        hybrid_override_pattern=pattern, vocab_size=4096, hidden_size=256,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, intermediate_size=1024,
        mamba_num_heads=8, mamba_head_dim=64, n_groups=2, ssm_state_size=64, chunk_size=128,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=512,
        moe_shared_expert_intermediate_size=512)
    return {
        "model": {"_target_": "hybridtrain.models.nemotron_h.NemotronHForCausalLM",
                  "config": config},
        "packing": {"enabled": True, "pack_size": seq_len},
        "training": {"device": "cpu", "dtype": "float32", "micro_batch_size": batch,
                     "global_batch_size": batch, "activation_checkpointing": ckpt},
    }


def measure(name: str, batch: int, seq_len: int) -> dict:
    """One case in this process (called in a fresh subprocess, glibc's mmap threshold at a
    page: every block of 4 KiB or more is its own mapping)."""
    import torch

    from hybridtrain.config import build_config, instantiate
    from hybridtrain.distributed.activation_checkpoint import apply_activation_checkpointing
    from hybridtrain.models.spec import set_train_loss
    from hybridtrain.ops.loss import LinearCrossEntropy
    from hybridtrain.training.memory_plan import plan_memory
    from tests.helpers import memory as mem

    torch.set_num_threads(1)
    pattern, ckpt = CASES[name]
    cfg = build_config(recipe(pattern, ckpt, batch, seq_len))
    planned = plan_memory(cfg, 1, device_type="cpu").ranks[0]
    torch.manual_seed(0)
    model = instantiate(cfg.model)
    set_train_loss(model, LinearCrossEntropy(chunk_size="auto", reduction="sum"))
    if ckpt:
        apply_activation_checkpointing(model.backbone.layers, True)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len))
    model(ids[:, :64], labels=ids[:, :64]).backward()  # warm up kernels and allocator
    model.zero_grad(set_to_none=False)  # the gradients exist before, as from a step's second
    # micro-batch on: what forward and backward add above them is the activations
    before = mem.malloc_mmapped()
    model(ids, labels=ids).backward()
    peak = mem.malloc_mmap_peak() - before
    return {"case": name, "plan": planned.activations, "peak": peak,
            "per_micro_batch": planned.activations_per_micro_batch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="2x2048", help="BxL of the micro-batch")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one case, in a child
    args = ap.parse_args()
    batch, seq_len = (int(x) for x in args.tokens.lower().split("x"))
    if args.case:
        print(json.dumps(measure(args.case, batch, seq_len)))
        return
    mib = 2 ** 20
    print(f"fp32, micro-batch {batch} x {seq_len} tokens, one fresh process per case; MiB")
    print(f"{'case':<12}{'plan':>9}{'peak':>9}{'plan/peak':>11}")
    for name in CASES:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "4096"}
        out = subprocess.run([sys.executable, __file__, "--case", name, "--tokens", args.tokens],
                             capture_output=True, text=True, env=env)
        if out.returncode:
            print(f"{name}: failed\n{out.stderr[-2000:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name:<12}{r['plan'] / mib:9.1f}{r['peak'] / mib:9.1f}{r['plan'] / r['peak']:11.2f}")


if __name__ == "__main__":
    main()
