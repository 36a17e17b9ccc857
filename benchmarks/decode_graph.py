"""Decoding with the step captured as one CUDA graph against the same decoding step by step, on
one model in one invocation: greedy ``generate``, tokens/s of the new tokens, the ratio, and
whether the tokens are identical.

    python benchmarks/decode_graph.py [--config nano8|small_moe|tiny] [--batch-sizes 1,8]
        [--prompt-len 512] [--new-tokens 128]

On CUDA (bf16): ``generate`` with ``ops.backend``'s ``decode_graph`` off and on. Without a GPU
(fp32, a dry run of the script on tiny shapes): the graph side is the same loop replaying the
step compiled whole by ``generation.compiled_capture`` (``torch.compile`` standing in for the
CUDA graph); its time says nothing about a GPU. nano8: Nemotron 3 Nano 30B-A3B layer shapes,
8 layers ``MEMEM*EM``, 32 experts top-6 (~1.9B parameters; ``benchmarks/gpu/nano8.yaml``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

NANO8 = dict(hybrid_override_pattern="MEMEM*EM", vocab_size=131072, hidden_size=2688, num_attention_heads=32,
             num_key_value_heads=2, head_dim=128, intermediate_size=1856, mamba_num_heads=64, mamba_head_dim=64,
             n_groups=8, ssm_state_size=128, chunk_size=128, n_routed_experts=32, num_experts_per_tok=6,
             moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712, routed_scaling_factor=2.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, choices=("nano8", "small_moe", "tiny"))
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, small_moe_config, tiny_config
    from hybridtrain.models.nemotron_h import generation as G
    from hybridtrain.ops import backend
    from hybridtrain.ops.sampling import GenerationConfig, decode

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    name = args.config or ("nano8" if cuda else "tiny")
    cfg = {"nano8": lambda: small_moe_config(**NANO8), "small_moe": small_moe_config,
           "tiny": lambda: tiny_config("mixed")}[name]()
    torch.manual_seed(0)
    model = NemotronHForCausalLM(cfg).to(device, dtype).eval()
    print(f"device: {torch.cuda.get_device_name() if cuda else 'CPU (dry run: graph side compiled, not captured)'}; "
          f"model {name} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B), {dtype}, torch {torch.__version__}")

    def eager(ids, n):
        with backend.using(dataclasses.replace(backend.settings(), decode_graph=False)):
            return model.generate(ids, max_new_tokens=n)

    def graphed(ids, n):
        if cuda:
            return model.generate(ids, max_new_tokens=n)
        with torch.inference_mode():  # generate's loop, the step replayed through the stand-in
            logits, cache = G.prefill(model, ids, max_length=ids.shape[1] + n)
            graph = G.StepGraph(model, cache, ids[:, -1], capture=G.compiled_capture)
            return decode(lambda: logits, lambda tok: G.decode_step(model, cache, tok, graph), ids,
                          GenerationConfig(max_new_tokens=n)).clone()

    def timed(fn, ids, n):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn(ids, n)
        if cuda:
            torch.cuda.synchronize()
        return out, time.perf_counter() - t

    print(f"{'batch':>5} {'eager tok/s':>12} {'graph tok/s':>12} {'ratio':>7}  identical")
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        ids = torch.randint(3, cfg.vocab_size, (b, args.prompt_len), generator=torch.Generator().manual_seed(b)).to(device)
        rate, outs = {}, {}
        for side, fn in (("eager", eager), ("graph", graphed)):
            fn(ids, 4)  # warm-up (kernels, autotuning)
            (_, t1), (out, tn) = timed(fn, ids, 1), timed(fn, ids, args.new_tokens)
            rate[side], outs[side] = b * (args.new_tokens - 1) / max(tn - t1, 1e-9), out
        print(f"{b:>5} {rate['eager']:>12.1f} {rate['graph']:>12.1f} {rate['graph'] / rate['eager']:>6.2f}x  "
              f"{torch.equal(outs['eager'], outs['graph'])}")


if __name__ == "__main__":
    main()
