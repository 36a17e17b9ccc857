"""The DPO and GRPO recipes: preference data in TRL's format, group advantages, rollout batches,
the toy task, and short end-to-end runs of ``hybridtrain dpo`` / ``hybridtrain grpo``."""

from __future__ import annotations

import json
import os
import random
import signal

import pytest
import torch

from hybridtrain.data.preference import (
    build_preference_dataset,
    preference_batch,
    tokenize_pair,
    write_synthetic_preferences,
)
from hybridtrain.recipes.grpo import group_advantages, rollout_batch
from hybridtrain.rl.tasks import CountingTask


def test_plain_text_pair_is_prompt_then_response_and_eos(tok):
    rec = {"prompt": "What color is the sky? ", "chosen": "Blue.", "rejected": "Green."}
    p, c, r = tokenize_pair(tok, rec, "x:1")
    assert tok.decode(p + c[:-1]) == rec["prompt"] + rec["chosen"]
    assert c[-1] == r[-1] == tok.eos_token_id


def test_conversational_pair_is_the_template_rendering(tok):
    prompt = [{"role": "user", "content": "What color is the sky?"}]
    rec = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "Blue."}],
           "rejected": [{"role": "assistant", "content": "Green."}]}
    p, c, _ = tokenize_pair(tok, rec, "x:1")
    whole = tok.apply_chat_template(prompt + rec["chosen"], tokenize=True)
    whole = whole["input_ids"] if hasattr(whole, "keys") else whole
    assert p + c == list(whole)
    assert "Blue." in tok.decode(c) and "assistant" not in tok.decode(c)


def test_preference_file_batch_and_errors(tok, tmp_path):
    path = write_synthetic_preferences(tmp_path / "p.jsonl", num_pairs=6, seed=0)
    recs = [json.loads(line) for line in open(path)]
    assert len(recs) == 6 and all(set(r) == {"prompt", "chosen", "rejected"} for r in recs)
    ds = build_preference_dataset(path, tok, max_length=64)
    batch = preference_batch([ds[0], ds[1]])
    assert batch["input_ids"].shape[0] == 4  # chosen, rejected, chosen, rejected
    for row, key in enumerate(("chosen", "rejected")):
        n = len(ds[0]["prompt"])
        assert batch["token_mask"][row, :n].sum() == 0
        assert batch["token_mask"][row].sum() == len(ds[0][key])
        assert batch["input_lengths"][row] == n + len(ds[0][key])
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    with pytest.raises(ValueError, match="rejected"):
        build_preference_dataset(tmp_path / "bad.jsonl", tok)


def test_group_advantages_are_normalised_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 4.0])
    adv = group_advantages(rewards, 2)
    for i in range(0, 6, 2):
        r = rewards[i:i + 2]
        want = (r - r.mean()) / (r.std() + 1e-6)
        assert torch.allclose(adv[i:i + 2], want)
    assert torch.equal(group_advantages(rewards, 2, normalize=False)[:2], torch.tensor([0.5, -0.5]))


def test_rollout_batch_cuts_after_eos_and_masks_the_completion():
    batch, comps = rollout_batch([[5, 6], [7]], torch.tensor([[1, 2, 9, 9], [3, 4, 4, 4]]),
                                 eos=9, pad=0)
    assert comps == [[1, 2, 9], [3, 4, 4, 4]]
    assert batch["input_lengths"].tolist() == [5, 5]
    assert batch["token_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]]


def test_per_row_seeds_make_each_row_independent_of_the_batch():
    from hybridtrain.config import instantiate

    torch.manual_seed(0)
    model = instantiate(SMALL_MODEL).eval()
    ids = torch.randint(1, 288, (4, 5), generator=torch.Generator().manual_seed(1))
    seeds = [11, 12, 13, 14]
    kw = {"max_new_tokens": 4, "do_sample": True}
    whole = model.generate(ids, seed=seeds, **kw)
    for i in range(4):
        assert torch.equal(whole[i:i + 1], model.generate(ids[i:i + 1], seed=[seeds[i]], **kw))
    assert torch.equal(whole[2:], model.generate(ids[2:], seed=seeds[2:], **kw))
    with pytest.raises(ValueError, match="one seed per row"):
        model.generate(ids, seed=seeds[:2], **kw)


def test_counting_task_reward():
    task = CountingTask()
    prompt = task.prompts(1, random.Random(0))[0]
    right = " " + " ".join(task.expected(prompt))
    assert task.reward(prompt, right) == 1.0
    assert task.reward(prompt, "") == 0.0
    assert task.reward(prompt, " 0 0 0 0") in (0.5, 0.625)  # digits, at most one right
    shaped = CountingTask(answer_digits=1, format_weight=0.2, partial_credit=True)
    assert shaped.reward("count: 3 4 5", " 6") == 1.0
    assert shaped.reward("count: 3 4 5", " 7") == pytest.approx(0.2 + 0.8 * 0.8)  # 1 step off
    assert shaped.reward("count: 3 4 5", " 1") == pytest.approx(0.2)  # 5 steps off (opposite)
    assert shaped.reward("count: 8 9 0", " 9") == pytest.approx(0.2 + 0.8 * 0.6)  # around 9 -> 0


SMALL_MODEL = {"_target_": "hybridtrain.models.nemotron_h.NemotronHForCausalLM",
               "config": {"_target_": "hybridtrain.models.nemotron_h.tiny_config", "kind": "mixed",
                          "vocab_size": 288, "hidden_size": 32, "intermediate_size": 64,
                          "moe_intermediate_size": 16, "moe_shared_expert_intermediate_size": 16,
                          "mamba_num_heads": 4, "n_routed_experts": 4}}


def _recipe(tmp_path, texts, **sections):
    return {
        "tokenizer": {"_target_": "hybridtrain.data.build_bpe_tokenizer", "texts": texts,
                      "out_dir": str(tmp_path / "tok"), "vocab_size": 288},
        "model": SMALL_MODEL,
        "training": {"device": "cpu", "dtype": "float32", "seed": 0, "max_steps": 2,
                     "global_batch_size": 4, "micro_batch_size": 2},
        "optimizer": {"lr": 1e-3},
        "checkpoint": {"dir": str(tmp_path / "run")},
        "metrics": {"progress_bar": False, "plot": True},
        **sections,
    }



def rl_recipe(tmp_path, name: str, num_pairs: int = 40, **grpo):
    """A tiny ``dpo`` recipe (synthetic preference pairs) or ``grpo`` recipe (the counting task,
    2 prompts x 2 generations; ``grpo`` keys override)."""
    if name == "dpo":
        data = {"_target_": "hybridtrain.data.build_preference_dataset", "max_length": 48,
                "path": {"_target_": "hybridtrain.data.write_synthetic_preferences",
                         "path": str(tmp_path / "train.jsonl"), "num_pairs": num_pairs}}
        return _recipe(tmp_path, {"_target_": "hybridtrain.data.synthetic_preference_texts",
                                  "num_pairs": 200}, dataset=data)
    return _recipe(tmp_path, {"_target_": "hybridtrain.rl.tasks.counting_texts", "n": 100},
                   grpo={"num_prompts_per_step": 2, "num_generations_per_prompt": 2,
                         "max_new_tokens": 2, **grpo})


def signal_after_step(monkeypatch, sig: int, step: int) -> None:
    """``sig`` to this process right after step ``step`` is logged (the run's handler, which
    only records it, must be installed: a default action would end pytest)."""
    from hybridtrain.recipes import rl_run

    log = rl_run.RLRun.log

    def log_then_signal(self, rec):
        log(self, rec)
        if rec["step"] == step:
            assert signal.getsignal(sig) not in (signal.SIG_DFL, signal.SIG_IGN, None)
            os.kill(os.getpid(), sig)

    monkeypatch.setattr(rl_run.RLRun, "log", log_then_signal)

def test_dpo_recipe_runs(tmp_path, caplog):
    from hybridtrain.recipes.dpo import run

    caplog.set_level("INFO")

    texts = {"_target_": "hybridtrain.data.synthetic_preference_texts", "num_pairs": 200}
    data = {"_target_": "hybridtrain.data.build_preference_dataset", "max_length": 48,
            "path": {"_target_": "hybridtrain.data.write_synthetic_preferences",
                     "path": str(tmp_path / "train.jsonl"), "num_pairs": 40}}
    recipe = _recipe(tmp_path, texts, dataset=data, validation_dataset=data,
                     rl={"sequence_packing": True}, lr_scheduler={"lr_decay_style": "linear"})
    recipe["training"].update(max_steps=None, num_epochs=0.2)  # 0.2 x 40 pairs / 4 = 2 steps
    summary = run(recipe)
    recs = [json.loads(line) for line in open(tmp_path / "run" / "training.jsonl")]
    assert [r["step"] for r in recs] == [1, 2]
    # the LR decays over the run's length counted from the epochs
    assert [r["lr"] for r in recs] == pytest.approx([1e-3, 0.5e-3])
    assert {"loss", "accuracy", "reward_margin", "grad_norm", "lr"} <= set(recs[0])
    val = [json.loads(line) for line in open(tmp_path / "run" / "validation.jsonl")]
    assert val[0]["val_loss"] == pytest.approx(0.6931, abs=1e-4)  # policy == reference
    assert summary["loss_png"] and (tmp_path / "run" / "step_2" / "hf" / "config.json").exists()
    assert (tmp_path / "run" / "final" / "hf" / "config.json").exists()  # final -> step_2
    # the reference policy's build (the same recipe again) is one line, not a second build log
    built = [r.message for r in caplog.records if r.name == "hybridtrain.training.builder"
             and r.message.startswith("model ")]
    assert len(built) == 1 and "reference policy" in caplog.text


def test_grpo_recipe_runs(tmp_path):
    from hybridtrain.recipes.grpo import run

    texts = {"_target_": "hybridtrain.rl.tasks.counting_texts", "n": 100}
    run(_recipe(tmp_path, texts, grpo={"num_prompts_per_step": 2, "num_generations_per_prompt": 4,
                                       "max_new_tokens": 3, "updates_per_rollout": 2},
                lr_scheduler={"lr_decay_style": "linear"}))
    recs = [json.loads(line) for line in open(tmp_path / "run" / "training.jsonl")]
    assert [r["step"] for r in recs] == [1, 2]
    # the LR decays over the 4 updates (2 rollouts x 2), not 2: each step logs its updates' mean
    assert [r["lr"] for r in recs] == pytest.approx([(1 + 0.75) / 2 * 1e-3, (0.5 + 0.25) / 2 * 1e-3])
    for key in ("reward", "kl", "clip_fraction", "entropy", "ratio", "loss", "grad_norm"):
        assert isinstance(recs[-1][key], float), key
    assert (tmp_path / "run" / "loss.png").exists()
    # the checkpoint is named by the logged (rollout) steps, not the 4 optimizer updates
    assert sorted(p.name for p in (tmp_path / "run").glob("step_*")) == ["step_2"]
    assert os.path.realpath(tmp_path / "run" / "final") == str((tmp_path / "run" / "step_2").resolve())


def _grpo_recipe(tmp_path, task, **training):
    texts = {"_target_": "hybridtrain.rl.tasks.counting_texts", "n": 100}
    recipe = _recipe(tmp_path, texts, allowed_target_prefixes=["tests."],
                     grpo={"num_prompts_per_step": 2, "num_generations_per_prompt": 2,
                           "max_new_tokens": 3, "updates_per_rollout": 1,
                           "task": {"_target_": f"tests.helpers.rl_tasks.{task}"}})
    recipe["training"].update(training)
    recipe["metrics"]["plot"] = False
    return recipe


def test_grpo_nan_reward_is_named_and_stops_the_run_without_export(tmp_path, capsys):
    import yaml

    from hybridtrain.cli import main

    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(yaml.safe_dump(_grpo_recipe(tmp_path, "NaNRewardTask", max_steps=4,
                                                  max_consecutive_skipped_steps=2)))
    assert main(["grpo", "-c", str(recipe)]) == 3  # as finetune's divergence
    msg = capsys.readouterr().err
    assert "2 consecutive updates" in msg and "NaNRewardTask.reward" in msg and "sample 0" in msg
    assert msg.count("step 1: 4 of 4 rewards are not finite") == 2  # the warning, the error
    assert "step 2: " not in msg  # named once
    recs = [json.loads(line) for line in open(tmp_path / "run" / "training.jsonl")]
    assert [r["step"] for r in recs] == [1] and recs[0]["nonfinite_rewards"] == 4
    assert not list((tmp_path / "run").glob("step_*"))  # nothing exported as the result


@pytest.mark.parametrize("task, words", [
    ("TextRewardTask", ["TextRewardTask.reward returned str '1.0'", "sample 0"]),
    ("NoPromptsTask", ["grpo.task", "NoPromptsTask has no method prompts(n, rng)"]),
])
def test_grpo_task_that_breaks_the_interface_is_named(tmp_path, task, words):
    from hybridtrain.recipes.grpo import run

    with pytest.raises(ValueError) as e:
        run(_grpo_recipe(tmp_path, task, max_steps=1))
    for w in words:
        assert w in str(e.value), str(e.value)


def _pairs_file(path, *pairs):
    path.write_text("".join(json.dumps(dict(zip(("prompt", "chosen", "rejected"), p))) + "\n"
                            for p in pairs))
    return path


def test_chosen_given_as_a_list_of_strings_blames_chosen(tok, tmp_path):
    path = _pairs_file(tmp_path / "p.jsonl", ("Q? ", "A.", "B."), ("Q? ", ["A.", "B."], "C."))
    with pytest.raises(ValueError) as e:
        build_preference_dataset(path, tok)
    assert f"{path} line 2: 'chosen' must be text or a list of messages" in str(e.value)
    assert "list holding ['str']" in str(e.value)


def test_pairs_that_cannot_teach_are_counted_warned_and_refused_when_all(tok, tmp_path, caplog):
    good, same, empty = ("Q? ", "A.", "B."), ("Q? ", "A.", "A."), ("Q? ", "", "B.")
    path = _pairs_file(tmp_path / "p.jsonl", good, same, empty, same)
    assert len(build_preference_dataset(path, tok)) == 4
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "3 of 4 preference pairs cannot teach" in warning
    assert "2 pairs where chosen and rejected are identical (" in warning and "line 4" in warning
    assert "1 pairs where chosen is empty (" in warning and "line 3" in warning
    with pytest.raises(ValueError, match="none of the 2 preference pairs can teach"):
        build_preference_dataset(_pairs_file(tmp_path / "bad.jsonl", same, empty), tok)


@pytest.mark.parametrize("setting, words", [
    ({"num_generations_per_prompt": 1}, "grpo.num_generations_per_prompt=1"),
    ({"temperature": 0.0}, "grpo.temperature=0.0"),
])
def test_grpo_settings_under_which_nothing_is_learned_are_refused(tmp_path, setting, words):
    from hybridtrain.recipes.grpo import run

    recipe = _grpo_recipe(tmp_path, "NaNRewardTask", max_steps=1)
    recipe["grpo"].update(setting)
    with pytest.raises(ValueError, match=words + r".*advantage 0"):
        run(recipe)


def test_grpo_summary_says_when_rewards_were_not_finite(tmp_path, capsys):
    from hybridtrain.recipes.grpo import run

    recipe = _grpo_recipe(tmp_path, "NaNRewardTask", max_steps=1,
                          max_consecutive_skipped_steps=None)
    recipe["checkpoint"]["enabled"] = False
    run(recipe)  # the limit is off: the run ends, and its summary says why nothing was learned
    out = capsys.readouterr().out
    assert "reward (5-step mean) n/a -> n/a; 1 steps had non-finite rewards" in out
    assert "nan" not in out
