"""``hybridtrain plan``'s activation estimate against measured CPU memory, per layer type.

For each case (a Nemotron-H of one layer type, the mixed one, the mixed one with activation
checkpointing) a fresh process builds the model (fp32), takes one forward + backward of
``B x L`` tokens through the chunked loss, and reports:

* ``saved``: the bytes autograd keeps for backward after forward (unique storages seen by
  ``torch.autograd.graph.saved_tensors_hooks``, parameters excluded, plus the hidden-state and
  head-weight gradients the chunked loss forms in forward: ``tests.helpers.memory``'s
  ``SavedActivations`` and ``loss_forward_grads``, which the plan-vs-run tests use too) -- allocator-independent (under
  activation checkpointing the checkpoint's own hooks hide the block inputs from it);
* ``rss_kept``: resident memory after forward minus before (VmRSS);
* ``peak``: VmHWM over forward + backward (reset through /proc/self/clear_refs) minus VmRSS
  before forward, minus the parameter gradients backward allocates;

and the plan's activation figure for the same recipe (``plan_memory(...).ranks[0].activations``),
with the ratios plan / measured. fp32 only (this machine emulates bf16). The children run with
``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0`` so that freed tensors leave the
resident set (glibc's default heap keeps them and its RSS peak overstates live memory, up to 2x
here under activation checkpointing); ``--glibc-defaults`` measures without.

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


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(key)


def measure(name: str, batch: int, seq_len: int) -> dict:
    """One case in this process (called in a fresh subprocess)."""
    import torch

    from hybridtrain.config import build_config, instantiate
    from hybridtrain.distributed.activation_checkpoint import apply_activation_checkpointing
    from hybridtrain.models.spec import set_train_loss
    from hybridtrain.ops.loss import LinearCrossEntropy
    from hybridtrain.recipes.plan import plan_memory
    from tests.helpers.memory import SavedActivations, loss_forward_grads

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
    model.zero_grad(set_to_none=True)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())

    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM
    with SavedActivations(model) as saved_now:
        loss = model(ids, labels=ids)
        kept = _status("VmRSS") - before
        saved = saved_now.live + loss_forward_grads(model.config, batch * seq_len)
    loss.backward()
    peak = _status("VmHWM") - before - grads
    return {"case": name, "plan": planned.activations, "saved": saved, "rss_kept": kept,
            "peak": peak, "per_micro_batch": planned.activations_per_micro_batch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="2x2048", help="BxL of the micro-batch")
    ap.add_argument("--glibc-defaults", action="store_true",
                    help="keep glibc's malloc settings (its heap keeps freed blocks: RSS "
                         "overstates live memory)")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one case, in a child
    args = ap.parse_args()
    batch, seq_len = (int(x) for x in args.tokens.lower().split("x"))
    if args.case:
        print(json.dumps(measure(args.case, batch, seq_len)))
        return
    mib = 2 ** 20
    print(f"fp32, micro-batch {batch} x {seq_len} tokens, one fresh process per case; MiB")
    print(f"{'case':<12}{'plan':>9}{'saved':>9}{'rss kept':>10}{'peak':>9}"
          f"{'plan/saved':>12}{'plan/kept':>11}{'plan/peak':>11}")
    for name in CASES:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if not args.glibc_defaults:  # freed blocks go back to the OS: RSS = live tensors
            env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
        out = subprocess.run([sys.executable, __file__, "--case", name, "--tokens", args.tokens],
                             capture_output=True, text=True, env=env)
        if out.returncode:
            print(f"{name}: failed\n{out.stderr[-2000:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name:<12}{r['plan'] / mib:9.1f}{r['saved'] / mib:9.1f}{r['rss_kept'] / mib:10.1f}"
              f"{r['peak'] / mib:9.1f}{r['plan'] / r['saved']:12.2f}"
              f"{r['plan'] / max(r['rss_kept'], 1):11.2f}{r['plan'] / max(r['peak'], 1):11.2f}")


if __name__ == "__main__":
    main()
