"""Cached decoding: hybridtrain's ``NemotronHForCausalLM.generate`` against transformers'
``generate`` (with its cache) on the same model and weights, in one invocation.

    python benchmarks/decode_vs_transformers.py [--prompt-len 512] [--new-tokens 256]
        [--batch-sizes 1,8] [--rounds 2] [--threads 1] [--json out.json]

Model: the ~48M-parameter MoE Nemotron-H of the other benchmarks (``small_moe_config()``, layers
``MEM*EM-E``, vocab 32000), initialised once and saved as a Hugging Face checkpoint that both sides
load; fp32 on the CPU. Random prompts of ``--prompt-len`` tokens, greedy decoding, no eos.

Per side and batch size, ``generate`` runs with 1 new token (the prefill: the prompt once, plus
the first token) and with ``--new-tokens``; prefill tokens/s = batch * prompt_len / t(1), decode
tokens/s = batch * (new_tokens - 1) / (t(new_tokens) - t(1)). The sides alternate, each
measurement ``--rounds`` times; the fastest is kept (the least disturbed by other load on a shared
machine). Also per CPU-second of the process (with ``--threads 1`` the same as per second on an
idle machine; on a loaded one the figure less disturbed by other processes). Also printed: whether the
greedy tokens are identical, and the size of hybridtrain's decoding state at the end (Mamba
layers: conv window + SSM state, the same for any length; attention: the key/value cache).

Bounds, measured in the same run: the CPU's fp32 GEMM rate (a [512, 512] x [512, 2048] product,
best of 5) and streaming read rate (a sum over 256 MiB); hybridtrain's FLOPs for the prefill and
for one decoding step (``torch.utils.flop_counter``) and the weight bytes one decoding step reads.
From them the fastest possible prefill (FLOPs at the GEMM rate) and decoding step (its weight
bytes at the read rate, or its FLOPs at the GEMM rate, whichever is longer), and the largest
ratio to transformers' measured CPU time that such a perfect implementation could reach.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn):
    t0, c0 = time.perf_counter(), cpu_seconds()
    out = fn()
    return out, time.perf_counter() - t0, cpu_seconds() - c0


def best_cpu_seconds(fn, repeats: int = 5) -> float:
    fn()
    return min(timed(fn)[2] for _ in range(repeats))


def machine_rates() -> tuple[float, float]:
    """(fp32 GEMM FLOP/s, streaming read bytes/s) of this CPU, as this process gets them."""
    a, b = torch.randn(512, 512), torch.randn(512, 2048)
    gemm = 2 * 512 * 512 * 2048 / best_cpu_seconds(lambda: [torch.mm(a, b) for _ in range(10)]) * 10
    big = torch.randn(64 * 2**20)
    read = big.nbytes / best_cpu_seconds(lambda: big.sum())
    return gemm, read


def flops(fn) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


def step_weight_bytes(model, batch: int) -> int:
    """Bytes of the weights one decoding step of ``batch`` rows reads: every weight but the
    embeddings (one row each) and the routed experts, plus per MoE layer the experts its tokens
    can choose (at most batch * k of them)."""
    total = 0
    for name, p in model.named_parameters():
        if "embeddings" in name:
            continue
        if ".experts." in name:  # stacked [E, ...]: the chosen experts' share
            E, k = model.config.n_routed_experts, model.config.num_experts_per_tok
            total += p.nbytes * min(E, batch * k) // E
        else:
            total += p.nbytes
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, small_moe_config
    from hybridtrain.models.nemotron_h.generation import prefill

    transformers.logging.set_verbosity_error()
    cfg = small_moe_config()
    torch.manual_seed(0)
    ours = NemotronHForCausalLM(cfg).eval()
    with tempfile.TemporaryDirectory() as d:
        ours.save_pretrained(d)
        hf = transformers.NemotronHForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in ours.parameters())
    print(f"model: small_moe_config ({n_params / 1e6:.1f}M parameters, layers {cfg.hybrid_override_pattern}), "
          f"fp32, {args.threads} thread(s), torch {torch.__version__}, transformers {transformers.__version__}")

    def run_ours(ids, n):
        return ours.generate(ids, max_new_tokens=n)

    def run_hf(ids, n):
        with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, eos_token_id=None, pad_token_id=0)

    sides = {"transformers": run_hf, "hybridtrain": run_ours}
    results = {}
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        ids = torch.randint(0, cfg.vocab_size, (bs, args.prompt_len), generator=torch.Generator().manual_seed(bs))
        for fn in sides.values():  # warm-up
            fn(ids[:, :32], 2)
        best = {s: {1: (float("inf"), 0.0), args.new_tokens: (float("inf"), 0.0)} for s in sides}
        best_cpu = {s: {1: float("inf"), args.new_tokens: float("inf")} for s in sides}
        tokens = {}
        for _ in range(args.rounds):
            for n in (1, args.new_tokens):
                for side, fn in sides.items():
                    out, wall, cpu = timed(lambda: fn(ids, n))
                    assert out.shape == (bs, args.prompt_len + n), (side, out.shape)
                    if wall < best[side][n][0]:
                        best[side][n] = (wall, cpu)
                    best_cpu[side][n] = min(best_cpu[side][n], cpu)
                    tokens[side] = out
        row = {}
        for side in sides:
            (t1, _), (tn, _) = best[side][1], best[side][args.new_tokens]
            c1, cn = best_cpu[side][1], best_cpu[side][args.new_tokens]
            row[side] = {"prefill_tokens_per_s": bs * args.prompt_len / t1,
                         "decode_tokens_per_s": bs * (args.new_tokens - 1) / (tn - t1),
                         "prefill_tokens_per_cpu_s": bs * args.prompt_len / c1,
                         "decode_tokens_per_cpu_s": bs * (args.new_tokens - 1) / (cn - c1),
                         "t_prefill_s": t1, "t_total_s": tn, "cpu_s_total": cn}
        row["identical_tokens"] = bool(torch.equal(tokens["transformers"], tokens["hybridtrain"]))
        for k in ("prefill_tokens_per_s", "decode_tokens_per_s", "prefill_tokens_per_cpu_s",
                  "decode_tokens_per_cpu_s"):
            row[k.replace("tokens_per", "ratio_per")] = row["hybridtrain"][k] / row["transformers"][k]
        results[f"batch_{bs}"] = row
        print(f"\nbatch {bs}, prompt {args.prompt_len}, {args.new_tokens} new tokens "
              f"(load average {os.getloadavg()[0]:.1f}); greedy tokens identical: {row['identical_tokens']}")
        print(f"  {'':<14}{'prefill tok/s':>15}{'decode tok/s':>15}{'prefill tok/cpu-s':>19}"
              f"{'decode tok/cpu-s':>18}{'total s':>9}{'cpu s':>8}")
        for side in sides:
            r = row[side]
            print(f"  {side:<14}{r['prefill_tokens_per_s']:>15.0f}{r['decode_tokens_per_s']:>15.1f}"
                  f"{r['prefill_tokens_per_cpu_s']:>19.0f}{r['decode_tokens_per_cpu_s']:>18.1f}"
                  f"{r['t_total_s']:>9.2f}{r['cpu_s_total']:>8.2f}")
        print(f"  {'ratio':<14}{row['prefill_ratio_per_s']:>14.2f}x{row['decode_ratio_per_s']:>14.2f}x"
              f"{row['prefill_ratio_per_cpu_s']:>18.2f}x{row['decode_ratio_per_cpu_s']:>17.2f}x")

    # bounds: what a perfect implementation could reach on this CPU
    from hybridtrain.models.nemotron_h.generation import decode_step

    gemm_rate, read_rate = machine_rates()
    print(f"\nbounds (this CPU, this run): fp32 GEMM {gemm_rate / 1e9:.1f} GFLOP/s, streaming read "
          f"{read_rate / 1e9:.1f} GB/s")
    results["bounds"] = {"gemm_flop_per_s": gemm_rate, "read_bytes_per_s": read_rate}
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        ids = torch.randint(0, cfg.vocab_size, (bs, args.prompt_len))
        f_pre = flops(lambda: prefill(ours, ids))
        _, cache = prefill(ours, ids, max_length=args.prompt_len + 8)
        f_step = flops(lambda: decode_step(ours, cache, ids[:, -1]))
        w_step = step_weight_bytes(ours, bs)
        row = results[f"batch_{bs}"]
        hf_pre = bs * args.prompt_len / row["transformers"]["prefill_tokens_per_cpu_s"]
        hf_step = bs / row["transformers"]["decode_tokens_per_cpu_s"]
        min_pre = f_pre / gemm_rate
        min_step = max(w_step / read_rate, f_step / gemm_rate)
        b = {"prefill_flops": f_pre, "step_flops": f_step, "step_weight_bytes": w_step,
             "min_prefill_s": min_pre, "min_step_s": min_step,
             "max_prefill_ratio": hf_pre / min_pre, "max_decode_ratio": hf_step / min_step}
        results["bounds"][f"batch_{bs}"] = b
        ours_pre = bs * args.prompt_len / row["hybridtrain"]["prefill_tokens_per_cpu_s"]
        ours_step = bs / row["hybridtrain"]["decode_tokens_per_cpu_s"]
        print(f"  batch {bs}: prefill {f_pre / 1e9:.1f} GFLOP -> >= {min_pre:.2f} s (transformers {hf_pre:.2f}, "
              f"hybridtrain {ours_pre:.2f} CPU-s): at most {b['max_prefill_ratio']:.2f}x; decode step "
              f"{f_step / 1e6:.0f} MFLOP, {w_step / 1e6:.0f} MB of weights -> >= {min_step * 1e3:.1f} ms "
              f"(transformers {hf_step * 1e3:.1f}, hybridtrain {ours_step * 1e3:.1f} CPU-ms): at most "
              f"{b['max_decode_ratio']:.2f}x")

    # decoding state: Mamba layers fixed, attention grows with the length
    sizes = {}
    for n in (args.prompt_len, args.prompt_len + args.new_tokens):
        _, cache = prefill(ours, torch.zeros(1, n, dtype=torch.long))
        mamba = sum(s.conv.nbytes + s.ssm.nbytes for s in cache.layers.values() if hasattr(s, "ssm"))
        kv = sum(s.k.nbytes + s.v.nbytes for s in cache.layers.values() if hasattr(s, "k"))
        sizes[n] = (mamba, kv)
    (m0, k0), (m1, k1) = sizes.values()
    per_tok = (k1 - k0) / args.new_tokens
    print(f"\ndecoding state per sequence: Mamba layers {m0 / 2**10:.0f} KiB after {args.prompt_len} tokens, "
          f"{m1 / 2**10:.0f} KiB after {args.prompt_len + args.new_tokens} (0 bytes per token); "
          f"attention KV cache {per_tok:.0f} bytes per token")
    results["state_bytes"] = {"mamba_per_sequence": m1, "mamba_growth_per_token": (m1 - m0) / args.new_tokens,
                              "kv_per_token": per_tok}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
