"""Generation on an FSDP2-sharded model (2 gloo ranks): with the parameters gathered
(``training.evaluation.full_parameters``) ``generate`` gives the single process's tokens, and the
evaluator splits the examples over the data-parallel ranks and sums their counts."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.data import sft_dataset
from tests.helpers.distributed import run_distributed
from tests.helpers.recipes import tiny_recipe


class _Tok:
    eos_token_id, pad_token_id = None, 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _prompts():
    return torch.randint(1, 256, (3, 11), generator=torch.Generator().manual_seed(0))


def _evaluate(model, dims=None):
    from hybridtrain.training.evaluation import GenerationEvaluator

    ds = sft_dataset(10, vocab_size=256, min_len=6, max_len=16, seed=3)
    ev = GenerationEvaluator(ds, _Tok(), num_examples=7, max_new_tokens=5, batch_size=3, num_samples=0,
                             dims=dims)
    return ev(model, step=1)


def _ranks(rank, world):
    from hybridtrain.training.builder import build
    from hybridtrain.training.evaluation import full_parameters

    b = build(tiny_recipe(), "cpu", rank == 0, world, data=False)
    assert b.plan.dims.dp == 2
    with full_parameters(b.model):
        tokens = b.model.generate(_prompts(), max_new_tokens=8)
    return tokens, _evaluate(b.model, b.plan.dims)


@pytest.mark.distributed
def test_generate_and_evaluate_under_fsdp2():
    from hybridtrain.training.builder import build

    torch.set_num_threads(1)
    single = build(tiny_recipe(), "cpu", True, 1, data=False).model
    ref_tokens = single.generate(_prompts(), max_new_tokens=8)
    ref_eval = _evaluate(single)
    for tokens, rec in run_distributed(_ranks, 2):
        assert torch.equal(tokens, ref_tokens)
        assert rec["eval_examples"] == ref_eval["eval_examples"] == 7
        assert rec["eval_new_tokens"] == ref_eval["eval_new_tokens"]
