"""hybridtrain's Nemotron-H against transformers' reference implementation, on CPU in seconds.

Builds a tiny MoE Nemotron-H (Mamba2 + attention + MoE layers), saves it as a Hugging Face
checkpoint, loads it into ``transformers.NemotronHForCausalLM``, saves it from there, loads it
back into hybridtrain, and prints:

* the largest logit difference between the two implementations (fp32),
* whether every tensor survived the round trip bit for bit,
* the packed-sequence check: three documents in one row give the same logits as three
  separate forward passes.

    python examples/parity_demo.py
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import time
import warnings

import torch

from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config


def main() -> int:
    t0 = time.time()
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = tiny_config("moe", hybrid_override_pattern="MEM*EM")
    ours = NemotronHForCausalLM(cfg).eval()
    with torch.no_grad():  # move every weight off its init value so the comparison means something
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    print(f"model: pattern {cfg.hybrid_override_pattern}, {ours.num_parameters():,} parameters, "
          f"{cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}, chunk_size {cfg.chunk_size}")

    with tempfile.TemporaryDirectory() as tmp:
        a, b = os.path.join(tmp, "hybridtrain"), os.path.join(tmp, "transformers")
        ours.save_pretrained(a)
        with contextlib.redirect_stderr(io.StringIO()):
            hf = transformers.NemotronHForCausalLM.from_pretrained(a, dtype=torch.float32).eval()
            hf.save_pretrained(b)
        back = NemotronHForCausalLM.from_pretrained(b)

        ids = torch.randint(0, cfg.vocab_size, (2, 45))
        with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
            ref = hf(ids, use_cache=False).logits
            mine = ours(ids)
            mine_back = back(ids)
        diff = (mine - ref).abs().max().item()
        same = all(torch.equal(v, back.state_dict()[k]) for k, v in ours.state_dict().items())
        print(f"max |logits(hybridtrain) - logits(transformers)| = {diff:.2e}   (batch 2 x 45 tokens, fp32)")
        print(f"hybridtrain -> transformers -> hybridtrain: tensors identical = {same}, "
              f"logits identical = {torch.equal(mine, mine_back)}")

        docs = [17, 8, 20]
        cu = torch.tensor([0, 17, 25, 45])
        with torch.no_grad():
            packed = ours(ids[:1], cu_seqlens=cu)
            separate = torch.cat([ours(part) for part in ids[:1].split(docs, dim=1)], dim=1)
        pdiff = (packed - separate).abs().max().item()
        print(f"packing: 3 documents {docs} in one row vs 3 separate passes, max diff = {pdiff:.2e}")

    ok = diff <= 1e-4 and same and pdiff <= 1e-5
    print(f"{'OK' if ok else 'FAILED'} in {time.time() - t0:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
