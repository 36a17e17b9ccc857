"""GRPO rollouts split over data-parallel ranks (2 gloo ranks): each rank samples only its share of
the prompt groups, and the gathered rollouts -- and the steps trained on them -- equal the single
process's (per-sample seeds: ``recipes.grpo.rollout_seed``)."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.unit.test_rl_recipes import SMALL_MODEL, _recipe

P, G = 4, 3


class _CharTokenizer:
    """Bytes as ids (enough for the counting task's prompts and rewards)."""

    pad_token_id, eos_token_id = 0, None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode())}

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if 0 < i < 256).decode(errors="replace")


class _Engine:
    """A model's ``generate`` that counts the rows it was asked for."""

    def __init__(self, model):
        self.model, self.rows = model, 0

    def generate(self, ids, mask, **kw):
        self.rows += ids.shape[0]
        return self.model.generate(ids, mask, **kw)


def _rollouts(dims):
    from hybridtrain.config import instantiate
    from hybridtrain.recipes.grpo import sample_rollouts
    from hybridtrain.rl.tasks import CountingTask

    torch.manual_seed(0)
    engine = _Engine(instantiate(SMALL_MODEL).eval())
    task = CountingTask()
    prompts = task.prompts(P, random.Random(0))
    batch, scores = sample_rollouts(engine, _CharTokenizer(), task, prompts, G, seed=5, step=2,
                                    dims=dims, max_new_tokens=5)
    return batch, scores, engine.rows


def _rank_rollouts(rank, world):
    import torch.distributed as dist

    return _rollouts(SimpleNamespace(dp=world, dp_rank=rank, dp_group=dist.group.WORLD))


@pytest.mark.distributed
def test_rollouts_split_over_ranks_equal_one_process():
    torch.set_num_threads(1)
    ref_batch, ref_scores, rows = _rollouts(None)
    assert rows == P * G and set(ref_scores) == {"reward", "accuracy"}
    for batch, scores, rows in run_distributed(_rank_rollouts, 2):
        assert rows == P * G // 2  # each rank samples half the groups
        assert all(torch.equal(scores[k], ref_scores[k]) for k in ref_scores)
        assert set(batch) == set(ref_batch)
        assert all(torch.equal(batch[k], ref_batch[k]) for k in ref_batch)


def _grpo_three_steps(rank, world, tmp, resume):
    """3 steps with a checkpoint after each (``resume``: a step folder to continue from)."""
    from hybridtrain.recipes.grpo import run

    texts = {"_target_": "hybridtrain.rl.tasks.counting_texts", "n": 100}
    cfg = _recipe(tmp, texts, grpo={"num_prompts_per_step": 2, "num_generations_per_prompt": 4,
                                    "max_new_tokens": 3, "updates_per_rollout": 2},
                  metrics={"progress_bar": False, "plot": False},
                  checkpoint={"dir": str(tmp / "run"), "save_hf_at_end": False, "resume": resume})
    cfg["training"].update(max_steps=3, ckpt_every_steps=1)
    run(cfg)
    return [json.loads(line) for line in open(tmp / "run" / "training.jsonl")] if rank == 0 else None


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The 3-step run under FSDP2 over 2 ranks (checkpoints after each step in ``tmp/run``):
    (tmp, its records)."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("grpo2")
    return tmp, run_distributed(_grpo_three_steps, 2, tmp, None)[0]


@pytest.mark.distributed
def test_grpo_steps_on_two_ranks_equal_one_process(whole, tmp_path):
    """FSDP2 over 2 ranks, each sampling one of the 2 prompt groups: the same rewards, completion
    lengths, losses, KL and gradient norms as one process sampling both, at each of 3 steps."""
    torch.set_num_threads(1)
    ref = _grpo_three_steps(0, 1, tmp_path / "one", None)
    got = whole[1]
    assert len(got) == len(ref) == 3
    for g, r in zip(got, ref):
        for k in ("reward", "reward_std", "accuracy", "completion_tokens"):
            assert g[k] == r[k], (k, g[k], r[k])
        # within 1e-5 of the value, or for the loss of the size of its terms: advantages of unit
        # std within each group times ratios near 1 (summed, they nearly cancel: a loss of -1.6e-3
        # differed by 4.5e-8 under AVX2 kernels)
        for k in ("loss", "kl", "grad_norm", "clip_fraction", "entropy", "ratio"):
            scale = max(abs(r[k]), 1.0 if k == "loss" else 1e-6)
            assert abs(g[k] - r[k]) <= 1e-5 * scale, (k, g[k], r[k])


@pytest.mark.distributed
def test_grpo_on_two_ranks_resumes_exactly(whole):
    """FSDP2 over 2 ranks: resumed from step_1 (every rank's RNG, the sharded optimizer state,
    the prompt generator), steps 2 and 3 log exactly what the uninterrupted run logged. (One
    run per set of processes: a second process group in the same processes can hang.)"""
    torch.set_num_threads(1)
    tmp, records = whole
    resumed = run_distributed(_grpo_three_steps, 2, tmp, str(tmp / "run" / "step_1"))[0]
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for k in ("reward", "reward_std", "accuracy", "loss", "kl", "grad_norm", "lr", "ratio"):
        assert [r[k] for r in resumed] == [r[k] for r in records], k
