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

    def __call__(self, model, input_ids, hidden, max_length):
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
