"""MTP self-speculative greedy decoding against plain greedy decoding, both in one invocation,
on a model where the verification pass (the main stack) costs most: the per-component costs of
a round, tokens/s of both, their ratio, and the break-even acceptance rate.

    python benchmarks/speculative_decode.py [--draft-tokens 1,2,3] [--new-tokens 64]
        [--copy-gains 0,1000] [--threads 1] [--json out.json]

Model: a scaled-up ``small_moe_config()`` (hidden 1024, 16 layers ``MEM*EM-E`` twice, 16 experts
top-2 + shared expert, vocab 32000, ~260M parameters) with one MTP depth of pattern ``*E`` (as
Nemotron 3 Super), random weights, fp32 on the CPU, one 64-token prompt, batch 1.

Acceptance: random MTP layers draft nothing the main model accepts. ``--copy-gains g`` makes the
MTP depth *copy the main model's next-token prediction* (the cost of every product unchanged):
the embeddings times ``g`` so that the main model's next token is mostly a function of the
current token, and the depth's ``eh_proj`` passing its token's normalised embedding on at ``g``
(its mixers' outputs a perturbation), so it proposes the main model's next token from the token
it reads. ``g = 0``: the random model as initialised. Each gain gives one acceptance rate.

Per round with ``k`` drafts: ``k`` draft steps (the MTP layers over one token, or over the
caught-up tokens, and the LM head), one verification (the main stack over ``k + 1`` tokens and
the head over ``k + 1`` rows), the rollback (Mamba states restored, KV positions invalidated),
and Python. A round yields ``1 + a`` tokens (``a`` drafts accepted); plain decoding yields one
per step. Speed-up = (1 + E[a]) * step / round; at an acceptance rate ``p`` per draft (each
accepted while all before it were) E[a] = p + p^2 + ... + p^k, and the break-even ``p`` solves
1 + E[a] = round / step. Times are CPU seconds of the (one-threaded) process, the best of
``--rounds`` (a shared machine's other load moves wall-clock figures by 2-5x), and wall-clock.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from hybridtrain.models.nemotron_h import NemotronHForCausalLM
from hybridtrain.models.nemotron_h import speculative as spec
from hybridtrain.models.nemotron_h.decode_ops import norm
from hybridtrain.models.nemotron_h.generation import _step_logits, _transposed_head, prefill_hidden
from hybridtrain.models.nemotron_h.tiny import small_moe_config
from hybridtrain.ops.backend import configure_backend

PROMPT = 64
SCALE = dict(hidden_size=1024, hybrid_override_pattern="MEM*EM-E" * 2, n_routed_experts=16,
             moe_intermediate_size=512, moe_shared_expert_intermediate_size=1024, intermediate_size=3072,
             mamba_num_heads=32, num_attention_heads=8, head_dim=128)


def build_model() -> NemotronHForCausalLM:
    torch.manual_seed(0)
    config = small_moe_config(num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*E", **SCALE)
    return NemotronHForCausalLM(config).eval()


@torch.no_grad()
def copy_prediction(model: NemotronHForCausalLM, gain: float, base: dict) -> None:
    """The MTP depth proposes the main model's next token (see the module docstring); ``base``:
    the weights as initialised (gain 0 restores them)."""
    model.backbone.embeddings.weight.copy_(base["emb"] * (gain or 1.0))
    w = model.mtp.layers["0"].eh_proj.weight
    w.copy_(base["eh"])
    if gain:
        w.zero_()
        w[:, :w.shape[0]] = torch.eye(w.shape[0]) * gain


def best(fn, rounds: int) -> tuple[object, float, float]:
    """(fn's result, best CPU seconds, best wall seconds) over ``rounds`` runs after a warm-up."""
    out = fn()
    cpu, wall = [], []
    for _ in range(rounds):
        c0, w0 = time.thread_time(), time.perf_counter()
        out = fn()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    return out, min(cpu), min(wall)


@torch.inference_mode()
def component_costs(model, prompt: torch.Tensor, k: int, reps: int = 5) -> dict[str, float]:
    """CPU ms of a plain step, a draft step (MTP layers + head), the verification of ``k + 1``
    tokens (main stack + head) and the rollback, on the caches after the prompt."""
    hidden, cache = prefill_hidden(model, prompt, None, PROMPT + 256)
    cache.head_t = _transposed_head(model, hidden, 256)
    L, bb = cache.length, model.backbone
    saved = spec._snapshot(cache)
    draft = spec.MTPDraft(model, prompt, hidden, cache)
    dsaved, dl = spec._snapshot(draft.cache), draft.cache.length
    tok = torch.tensor([[7]])
    tokens = torch.randint(0, 1000, (1, k + 1), generator=torch.Generator().manual_seed(1))

    def plain():
        h, _ = spec._run_tokens(bb.layers, cache, bb.embeddings(tok), keep_states=False)
        int(_step_logits(model, cache, norm(bb.norm_f, h[0])).argmax(-1)[0])
        spec._restore(cache, saved, L)

    def verify():
        h, states = spec._run_tokens(bb.layers, cache, bb.embeddings(tokens), keep_states=True)
        _step_logits(model, cache, norm(bb.norm_f, h[0])).argmax(-1).tolist()
        spec._restore(cache, states[0], L + 1)
        spec._restore(cache, saved, L)

    def draft_step():
        m = draft._run(hidden[:, -1:], tok)
        int(_step_logits(model, draft.cache, m[:, 0]).argmax(-1)[0])
        spec._restore(draft.cache, dsaved, dl)

    def rollback():
        spec._restore(cache, saved, L)

    return {name: best(fn, reps)[1] * 1e3 for name, fn in
            (("plain_step_ms", plain), ("verify_ms", verify), ("draft_step_ms", draft_step),
             ("rollback_ms", rollback))}


def cpu_name() -> str:
    """The CPU's model name (Linux), else the machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return f"CPU {platform.machine()}"


def break_even(ratio: float, k: int) -> float | None:
    """The acceptance rate p with 1 + p + ... + p^k = ``ratio`` (None: not reachable)."""
    if ratio > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** i for i in range(k + 1)) < ratio else (lo, mid)
    return lo


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft-tokens", default="1,2,3")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--copy-gains", default="0,1000")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    configure_backend(torch.device("cpu"), torch.float32)
    model = build_model()
    base = {"emb": model.backbone.embeddings.weight.detach().clone(),
            "eh": model.mtp.layers["0"].eh_proj.weight.detach().clone()}
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    n = args.new_tokens
    device = f"{cpu_name()}, {torch.get_num_threads()} thread(s), torch {torch.__version__}"
    params = sum(t.numel() for t in model.parameters()) / 1e6
    print(f"device: {device}; model {params:.0f}M parameters (MTP depth '*E'), fp32, batch 1, "
          f"{PROMPT}-token prompt, {n} new tokens", flush=True)
    results = {"device": device, "parameters_m": params, "new_tokens": n, "runs": [], "costs": {}}
    ks = [int(k) for k in args.draft_tokens.split(",")]
    for k in ks:
        c = component_costs(model, prompt, k)
        results["costs"][k] = c
        print(f"k={k}: plain step {c['plain_step_ms']:.1f} ms | draft step {c['draft_step_ms']:.1f} ms | "
              f"verify {k + 1} tokens {c['verify_ms']:.1f} ms | rollback {c['rollback_ms']:.2f} ms (CPU ms)",
              flush=True)
    for gain in [float(g) for g in args.copy_gains.split(",")]:
        copy_prediction(model, gain, base)
        plain, cpu_plain, wall_plain = best(
            lambda: model.generate(prompt, max_new_tokens=n, do_sample=False), args.rounds)
        for k in ks:
            (ids, stats), cpu_spec, wall_spec = best(
                lambda: spec.speculative_generate(model, prompt, n, k), args.rounds)
            assert torch.equal(ids, plain), "speculative decoding changed the greedy tokens"
            round_over_step = (cpu_spec / stats.rounds) / (cpu_plain / n)
            row = {"copy_gain": gain, "draft_tokens": k, "acceptance_rate": stats.acceptance_rate,
                   "plain_tokens_per_cpu_s": n / cpu_plain, "speculative_tokens_per_cpu_s": n / cpu_spec,
                   "ratio_cpu": cpu_plain / cpu_spec, "ratio_wall": wall_plain / wall_spec,
                   "round_over_step": round_over_step, "break_even_acceptance": break_even(round_over_step, k),
                   "identical": True}
            results["runs"].append(row)
            be = row["break_even_acceptance"]
            print(f"gain {gain:g}, k={k}: acceptance {stats.acceptance_rate:.2f} | plain {n / cpu_plain:.1f} "
                  f"tokens/CPU-s | speculative {n / cpu_spec:.1f} tokens/CPU-s | x{row['ratio_cpu']:.2f} "
                  f"(wall-clock x{row['ratio_wall']:.2f}) | a round costs {round_over_step:.2f} steps: "
                  f"break-even acceptance {'n/a' if be is None else f'{be:.2f}'} | greedy tokens identical",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
