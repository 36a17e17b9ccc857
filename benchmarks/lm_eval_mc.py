"""lm-evaluation-harness log-likelihoods (a multiple-choice task's requests): hybridtrain's
``hybridtrain`` lm_eval model against lm_eval's own ``hf`` backend (transformers'
NemotronHForCausalLM), the same requests in one process: the time of each, their ratio and the
largest difference of the log-likelihoods.

    python benchmarks/lm_eval_mc.py                       # a tiny model built here, on the CPU
    python benchmarks/lm_eval_mc.py --model DIR --device cuda --docs 500

The requests: ``--docs`` questions of ~``--context`` words, each with 4 answers of a few words
(the shape of ARC or HellaSwag: one context, several short continuations). Both backends score
them in batches of ``--batch-size`` (hybridtrain: requests packed into rows of
``--max-batch-tokens``).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time


def requests(n_docs: int, context_words: int, seed: int = 0) -> list:
    from lm_eval.api.instance import Instance

    rng = random.Random(seed)
    words = ["river", "city", "north", "blue", "stone", "market", "winter", "tower", "green",
             "bridge", "garden", "old", "silver", "harbour", "forest", "lamp", "road", "bell"]
    out = []
    for d in range(n_docs):
        context = " ".join(rng.choice(words) for _ in range(context_words)) + "\nAnswer:"
        for c in range(4):
            answer = " " + " ".join(rng.choice(words) for _ in range(rng.randint(1, 4)))
            out.append(Instance("loglikelihood", {}, (context, answer), idx=c))
    return out


def tiny_model(path: str) -> None:
    import torch

    from hybridtrain.data import build_bpe_tokenizer, synthetic_texts
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config

    build_bpe_tokenizer(synthetic_texts(200, seed=0), out_dir=path, vocab_size=512)
    torch.manual_seed(0)
    NemotronHForCausalLM(tiny_config("mixed", vocab_size=512)).save_pretrained(path)


def timed(lm, reqs) -> tuple[list, float]:
    t0 = time.perf_counter()
    out = lm.loglikelihood(reqs, disable_tqdm=True)
    return out, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder (default: a tiny model built here)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--docs", type=int, default=100)
    p.add_argument("--context", type=int, default=60, help="words per question")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-batch-tokens", type=int, default=4096)
    args = p.parse_args()

    import transformers
    from lm_eval.models.huggingface import HFLM

    from hybridtrain.recipes.lm_harness_model import HybridtrainLM

    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tiny_model(tmp) or tmp
        reqs = requests(args.docs, args.context)
        ours = HybridtrainLM(model, device=args.device, dtype="float32",
                             max_batch_tokens=args.max_batch_tokens)
        hf = HFLM(pretrained=model, device=args.device, dtype="float32",
                  batch_size=args.batch_size)
        timed(ours, reqs[:8]), timed(hf, reqs[:8])  # warm-up
        a, t_ours = timed(ours, reqs)
        b, t_hf = timed(hf, reqs)
    diff = max(abs(x[0] - y[0]) for x, y in zip(a, b))
    same_greedy = sum(x[1] == y[1] for x, y in zip(a, b))
    print(f"{len(reqs)} loglikelihood requests ({args.docs} questions x 4 answers), "
          f"{args.device}: hybridtrain {t_ours:.2f} s, lm_eval hf {t_hf:.2f} s, "
          f"speed-up {t_hf / t_ours:.2f}x; max |log-likelihood difference| {diff:.2e}, "
          f"is_greedy equal {same_greedy}/{len(reqs)}")


if __name__ == "__main__":
    main()
