"""Self-speculative decoding with the MTP layers: the same tokens as plain greedy decoding
(Mamba states and key/value caches rolled back after every rejected draft), the acceptance
statistics, and the CLI's refusals."""

from __future__ import annotations

import pytest
import torch

from hybridtrain.models.nemotron_h import NemotronHForCausalLM
from hybridtrain.models.nemotron_h.speculative import speculative_generate
from hybridtrain.models.nemotron_h.tiny import tiny_config


def _model(main: str, mtp: str) -> NemotronHForCausalLM:
    """Random weights large enough that every token depends on the whole state."""
    torch.manual_seed(0)
    return NemotronHForCausalLM(tiny_config(main, num_nextn_predict_layers=1, mtp_hybrid_override_pattern=mtp,
                                            initializer_range=0.3)).eval()


class Oracle:
    """Drafts the reference continuation, one draft of every other round wrong."""

    def __init__(self, reference: torch.Tensor, prompt_length: int):
        self.ref, self.n, self.rounds = reference[0, prompt_length:].tolist(), 0, 0

    def __call__(self, model, input_ids, hidden, main_cache):
        return self

    def draft(self, hidden, tokens, k):
        self.n += tokens.shape[1]
        self.rounds += 1
        out = (self.ref[self.n:self.n + k] + [0] * k)[:k]
        if self.rounds % 2:
            out[self.rounds % k] = (out[self.rounds % k] + 1) % 256
        return out


@pytest.mark.parametrize("main,mtp", [("moe", "*E"), ("mixed", "M-")])
@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafts_decode_the_greedy_tokens(main, mtp, k):
    model = _model(main, mtp)
    ids = torch.randint(3, 256, (1, 11), generator=torch.Generator().manual_seed(1))
    ref = model.generate(ids, max_new_tokens=20, do_sample=False)
    got, stats = speculative_generate(model, ids, 20, k)
    assert torch.equal(got, ref)
    assert stats.drafted >= stats.accepted >= 0 and stats.rounds > 0


@pytest.mark.parametrize("k", [2, 4])
def test_accepted_drafts_roll_the_caches_back_exactly(k):
    model = _model("mixed", "*E")  # Mamba, attention, MLP and MoE layers in the main stack
    ids = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    ref = model.generate(ids, max_new_tokens=25, do_sample=False)
    oracle = Oracle(ref, ids.shape[1])
    got, stats = speculative_generate(model, ids, 25, k, drafter=oracle)
    assert torch.equal(got, ref)
    assert 0.4 < stats.acceptance_rate < 1 and stats.rounds < 25 / 2


def test_eos_ends_both_alike_and_a_model_without_mtp_is_refused():
    model = _model("moe", "*E")
    ids = torch.randint(3, 256, (1, 7), generator=torch.Generator().manual_seed(3))
    free = model.generate(ids, max_new_tokens=12, do_sample=False)
    eos = int(free[0, ids.shape[1] + 4])
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=eos)
    oracle = Oracle(free, ids.shape[1])
    got, _ = speculative_generate(model, ids, 12, 3, eos_token_id=eos, drafter=oracle)
    assert torch.equal(got, ref) and got.shape[1] < free.shape[1]
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="no multi-token prediction layers"):
        speculative_generate(NemotronHForCausalLM(tiny_config("moe")), ids, 4)


def test_generate_cli_speculative_prints_the_greedy_completion_and_its_acceptance(tmp_path, capsys):
    import json

    from hybridtrain.cli import main
    from hybridtrain.data import build_bpe_tokenizer, synthetic_texts

    tok = build_bpe_tokenizer(synthetic_texts(40, seed=0), tmp_path, vocab_size=300)
    torch.manual_seed(0)
    NemotronHForCausalLM(tiny_config("moe", vocab_size=len(tok), num_nextn_predict_layers=1,
                                     mtp_hybrid_override_pattern="*E")).save_pretrained(tmp_path)
    runs = []
    for flags in ([], ["--speculative", "mtp", "--draft-tokens", "2"]):
        assert main(["generate", "--model", str(tmp_path), "--prompt", "the answer is",
                     "--max-new-tokens", "8", *flags]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    plain, spec = runs
    assert spec["completion"] == plain["completion"] and spec["new_tokens"] == plain["new_tokens"]
    assert spec["drafted"] >= spec["accepted"] >= 0 and "acceptance_rate" in spec
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi", "--speculative", "mtp",
                 "--temperature", "0.7"]) == 2
    assert "--speculative decodes greedily" in capsys.readouterr().err


def test_one_pass_verify_gives_the_full_forwards_logits_and_states():
    """The verify forward over T new tokens from the prompt's cache: the logits of the model's
    forward over prompt + tokens (to fp32 rounding), and per token the Mamba states and the
    key/value cache a prefill of the prompt up to that token leaves."""
    from hybridtrain.models.nemotron_h.cache import KVCache
    from hybridtrain.models.nemotron_h.decode_ops import norm
    from hybridtrain.models.nemotron_h.generation import _step_logits, prefill_hidden
    from hybridtrain.models.nemotron_h.speculative import _run_tokens

    model = _model("mixed", "*E")
    ids = torch.randint(3, 256, (1, 14), generator=torch.Generator().manual_seed(4))
    L, T = 9, 5
    with torch.no_grad():
        full = model(ids)[0, L - 1:].float()
        _, cache = prefill_hidden(model, ids[:, :L], None, 16)
        bb = model.backbone
        h, states = _run_tokens(bb.layers, cache, bb.embeddings(ids[:, L:]), keep_states=True)
        logits = _step_logits(model, cache, norm(bb.norm_f, h[0]))
        assert torch.allclose(logits, full[1:], atol=1e-4, rtol=0)
        for i in (0, T - 1):
            _, ref = prefill_hidden(model, ids[:, :L + i + 1], None, 16)
            for name, entry in ref.layers.items():
                if isinstance(entry, KVCache):
                    n = L + i + 1
                    assert torch.allclose(cache.layers[name].k[:, :, :n], entry.k[:, :, :n], atol=1e-5)
                else:
                    conv, ssm = states[i][name]
                    assert torch.allclose(conv, entry.conv, atol=1e-5)
                    assert torch.allclose(ssm, entry.ssm, atol=1e-4)


def _first_two(p, q, n, gen):
    """Speculative sampling's first two output tokens for ``n`` rounds of two drafts from ``q``."""
    from hybridtrain.models.nemotron_h.speculative import speculative_accept

    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen) for i in range(2)], 1)
    accepted, nxt = speculative_accept(p.expand(n, -1, -1), q.expand(n, -1, -1), drafts, gen)
    first = torch.where(accepted > 0, drafts[:, 0], nxt)
    second = torch.where(accepted > 1, drafts[:, 1], nxt)[accepted > 0]
    return first, second


def test_speculative_sampling_keeps_the_main_models_distribution():
    """Whatever the draft's q, each output token is distributed as the main model's p (the
    frequencies over many rounds, tiny vocabulary)."""
    gen = torch.Generator().manual_seed(0)
    V = 6
    logits = 2 * torch.randn(3, V, generator=gen)
    p = torch.softmax(logits, -1)
    q = torch.softmax(logits[:2] + 1.5 * torch.randn(2, V, generator=gen), -1)  # near p, not p
    first, second = _first_two(p, q, 40000, gen)
    for tokens, want in ((first, p[0]), (second, p[1])):
        freq = torch.bincount(tokens, minlength=V).float() / len(tokens)
        assert (freq - want).abs().sum() / 2 < 0.015, (freq, want)
    # the draft distribution itself is far from p (else the test would not tell)
    assert (q - p[:2]).abs().sum(-1).min() / 2 > 0.05


def test_sampled_speculative_decoding_is_seeded_and_greedy_at_low_temperature():
    model = _model("mixed", "M-")
    ids = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(5))
    runs = [speculative_generate(model, ids, 10, 2, temperature=1.0, seed=s)[0] for s in (1, 1, 2)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    cold, stats = speculative_generate(model, ids, 10, 2, temperature=1e-4, seed=3)
    assert torch.equal(cold, model.generate(ids, max_new_tokens=10, do_sample=False))
    assert stats.rounds > 0


def test_grpo_rollouts_with_speculative_sampling_are_seeded_per_sample():
    """``grpo.speculative: mtp``: each rollout sampled on its own with its sample's seed (the
    same rollouts again for the same step, other ones for another step)."""
    import random

    from hybridtrain.models.nemotron_h.speculative import speculative_decode
    from hybridtrain.recipes.grpo import sample_rollouts
    from hybridtrain.rl.tasks import CountingTask
    from tests.distributed.test_grpo_rollouts import _CharTokenizer as Bytes

    model, task = _model("mixed", "*E"), CountingTask()
    prompts = task.prompts(2, random.Random(0))
    runs = [sample_rollouts(model, Bytes(), task, prompts, 2, seed=5, step=s, max_new_tokens=4,
                            speculative=speculative_decode, draft_tokens=2)[0] for s in (1, 1, 2)]
    assert torch.equal(runs[0]["input_ids"], runs[1]["input_ids"])
    assert not torch.equal(runs[0]["input_ids"], runs[2]["input_ids"])
    assert runs[0]["token_mask"].sum(-1).tolist() == [4] * 4
