"""Answer-quality evaluation: SQuAD exact match / F1 (official normalisation, max over all
references), the evaluator on a dataset, and end to end through the demo recipe: metrics in
validation.jsonl, replies in samples.jsonl, EM/F1 in the summary, ``hybridtrain generate`` on the
run's export and ``hybridtrain evaluate`` on its checkpoint."""

from __future__ import annotations

import collections
import json
import re
import string
from pathlib import Path

import pytest
import torch
from tests.helpers.recipes import run_overrides

from hybridtrain.training.evaluation import (
    GenerationEvaluator,
    exact_match,
    f1,
    normalize_answer,
    prompt_and_reference,
)

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "squad_tiny.yaml"


# the official SQuAD v1.1 evaluation functions, verbatim (evaluate-v1.1.py)
def _official_normalize(s):
    def remove_articles(text):
        return re.sub(r'\b(a|an|the)\b', ' ', text)

    def white_space_fix(text):
        return ' '.join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return ''.join(ch for ch in text if ch not in exclude)

    def lower(text):
        return text.lower()
    return white_space_fix(remove_articles(remove_punc(lower(s))))


def _official_f1(prediction, ground_truth):
    prediction_tokens = _official_normalize(prediction).split()
    ground_truth_tokens = _official_normalize(ground_truth).split()
    common = collections.Counter(prediction_tokens) & collections.Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall)


def test_squad_metrics_match_the_official_script():
    g = torch.Generator().manual_seed(0)
    words = ["The", "a", "an", "Eiffel", "tower", "Paris,", "paris", "France!", "in", "1889", "'s", "AN"]
    for _ in range(300):
        def phrase():
            n = int(torch.randint(1, 6, (), generator=g))
            return " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g))
        pred, refs = phrase(), [phrase() for _ in range(int(torch.randint(1, 4, (), generator=g)))]
        assert normalize_answer(pred) == _official_normalize(pred)
        assert exact_match(pred, refs) == max(float(_official_normalize(pred) == _official_normalize(r))
                                              for r in refs)
        if normalize_answer(pred) and all(normalize_answer(r) for r in refs):
            assert f1(pred, refs) == pytest.approx(max(_official_f1(pred, r) for r in refs))
    assert exact_match("The Eiffel Tower!", ["Paris", "eiffel  tower"]) == 1.0
    assert f1("in Paris France", ["Paris"]) == pytest.approx(0.5)
    assert f1("", [""]) == 1.0 and f1("x", [""]) == 0.0  # v2.0's rule for empty answers


def test_prompt_and_reference():
    ids = [5, 6, 7, 8, 9, 2]
    labels = [-100, -100, 8, 9, 2, -100]
    assert prompt_and_reference(ids, labels) == ([5, 6, 7], [8, 9, 2])
    with pytest.raises(ValueError, match="no label"):
        prompt_and_reference(ids, [-100] * 6)


class _Oracle(torch.nn.Module):
    """A 'model' whose generate answers each prompt with given tokens (then eos)."""

    def __init__(self, answers: dict, eos: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.answers, self.eos = answers, eos

    def generate(self, input_ids, attention_mask=None, max_new_tokens=8, eos_token_id=None, **kw):
        rows = []
        for ids, m in zip(input_ids.tolist(), attention_mask.tolist()):
            new = (self.answers[tuple(t for t, v in zip(ids, m) if v)] + [self.eos] * max_new_tokens)[:max_new_tokens]
            rows.append(ids + new)
        return torch.tensor(rows)


@pytest.fixture(scope="module")
def squad_setup(tmp_path_factory):
    from hybridtrain.data import build_bpe_tokenizer, build_squad_dataset

    d = tmp_path_factory.mktemp("squad")
    ctx = "The tower stands in Paris. It was built in 1889."
    data = {"data": [{"title": "t", "paragraphs": [{"context": ctx, "qas": [
        {"id": "q1", "question": "Where is the tower?", "answers": [
            {"text": "Paris", "answer_start": 20}, {"text": "in Paris", "answer_start": 17}]},
        {"id": "q2", "question": "When was it built?", "answers": [{"text": "1889", "answer_start": 43}]},
        {"id": "q3", "question": "Which city?", "answers": [{"text": "Paris", "answer_start": 20}]},
    ]}]}]}
    (d / "v.json").write_text(json.dumps(data))
    tok = build_bpe_tokenizer([ctx, "Where is the tower? When was it built? Which city? Answer: Context:"] * 20,
                              str(d / "tok"), vocab_size=300)
    return build_squad_dataset(str(d / "v.json"), tok), tok


def test_evaluator_scores_against_every_reference(squad_setup, tmp_path):
    ds, tok = squad_setup
    replies = {"q1": " in Paris", "q2": " 1890", "q3": " the Paris"}  # 2nd reference; wrong; article
    answers = {}
    for i in range(len(ds)):
        prompt, _ = prompt_and_reference(*ds.get_unpadded(i))
        answers[tuple(prompt)] = tok.encode(replies[ds.record_id(i)], add_special_tokens=False)
    ev = GenerationEvaluator(ds, tok, num_examples=8, max_new_tokens=6, batch_size=2, num_samples=2,
                             samples_path=str(tmp_path / "samples.jsonl"))
    rec = ev(_Oracle(answers, tok.eos_token_id), step=7)
    assert rec["eval_examples"] == 3
    assert rec["exact_match"] == pytest.approx(200 / 3) and rec["f1"] == pytest.approx(200 / 3)
    samples = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    assert len(samples) == 2 and samples[0]["step"] == 7
    assert samples[0]["answers"] == ["Paris", "in Paris"] and samples[0]["reply"].strip() == "in Paris"


def test_demo_recipe_evaluates_and_the_cli_generates(tmp_path, capsys):
    from hybridtrain.cli import main

    out = tmp_path / "run"
    args = run_overrides(
        out, 4, "null",
        f"--tokenizer.out_dir={out}/tokenizer", "--tokenizer.texts.num_questions=300",
        f"--dataset.path.path={out}/data/train.json", "--dataset.path.num_questions=200",
        f"--validation_dataset.path.path={out}/data/validation.json",
        "--validation_dataset.path.num_questions=16",
        "--evaluation.num_examples=6", "--evaluation.max_new_tokens=4", "--evaluation.num_samples=2",
    )
    assert main(["finetune", "-c", str(RECIPE), *args]) == 0
    printed = capsys.readouterr().out
    assert "exact match" in printed and "F1" in printed and "samples.jsonl" in printed
    vals = [json.loads(line) for line in open(out / "validation.jsonl")]
    assert [v["step"] for v in vals] == [0, 2, 4]
    assert all(v["eval_examples"] == 6 and 0 <= v["exact_match"] <= v["f1"] <= 100 for v in vals)
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert len(samples) == 6 and {"prompt", "reply", "reference", "answers", "exact_match", "f1"} <= set(samples[0])

    # generate on the run folder (its latest export), one prompt and a JSONL file
    assert main(["generate", "--model", str(out), "--prompt", "Context: x\nQuestion: y\nAnswer:",
                 "--max-new-tokens", "5"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"prompt", "completion", "new_tokens", "tokens_per_s"} <= set(rec) and 1 <= rec["new_tokens"] <= 5
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Context: a\\nQuestion: b\\nAnswer:"}\n'
                       '{"messages": [{"role": "user", "content": "hello"}]}\n')
    assert main(["generate", "--model", str(out / "step_4" / "hf"), "--prompts", str(prompts), "--chat",
                 "--temperature", "0.8", "--top-p", "0.9", "--seed", "1", "--max-new-tokens", "4",
                 "--output", str(tmp_path / "g.jsonl")]) == 0
    got = [json.loads(line) for line in open(tmp_path / "g.jsonl")]
    assert len(got) == 2 and got[1]["prompt"] == [{"role": "user", "content": "hello"}]

    # evaluate the checkpoint: the same metrics as the last validation of the run
    capsys.readouterr()
    assert main(["evaluate", "-c", str(RECIPE), *args, "--checkpoint", str(out)]) == 0
    ev = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ev["step"] == 4 and ev["eval_examples"] == 6
    assert ev["exact_match"] == pytest.approx(vals[-1]["exact_match"]) and ev["f1"] == pytest.approx(vals[-1]["f1"])
    assert (out / "evaluation.jsonl").exists()

    # a step without an export (step_2: only the last step has hf/): its sharded checkpoint, read
    # by convert's reader; evaluate gives the run's validation at that step, generate completes
    assert not (out / "step_2" / "hf").exists()
    assert main(["evaluate", "-c", str(RECIPE), *args, "--checkpoint", str(out / "step_2")]) == 0
    ev2 = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ev2["step"] == 2 and ev2["checkpoint"] == str(out / "step_2")
    assert ev2["exact_match"] == pytest.approx(vals[1]["exact_match"]) and ev2["f1"] == pytest.approx(vals[1]["f1"])
    assert main(["generate", "--model", str(out / "step_2"), "--prompt", "Context: x\nQuestion: y\nAnswer:",
                 "--max-new-tokens", "3"]) == 0
    assert 1 <= json.loads(capsys.readouterr().out.strip().splitlines()[-1])["new_tokens"] <= 3


def test_a_checkpoint_loads_as_its_export(tmp_path):
    """load_checkpoint_model (a step's sharded dcp/ in one process) gives the HF export's tensors."""
    from tests.helpers.models import tiny_model
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM
    from hybridtrain.training.checkpoint import Checkpointer
    from hybridtrain.training.checkpoint_reader import load_checkpoint_model

    step = Checkpointer(str(tmp_path)).save(3, tiny_model(), None, export=True)
    loaded, path = load_checkpoint_model(str(tmp_path))  # the run folder: its latest
    assert path == step
    exported = NemotronHForCausalLM.from_pretrained(f"{step}/hf").state_dict()
    got = loaded.state_dict()
    assert got.keys() == exported.keys() and all(torch.equal(got[k], exported[k]) for k in got)


def test_without_references_only_samples_are_written(tmp_path):
    """A dataset without reference answers (e.g. chat): replies and their references, no EM/F1."""
    from tests.helpers.data import sft_dataset

    ds = sft_dataset(5, vocab_size=256, seed=2)

    class Tok:
        eos_token_id, pad_token_id = 1, 0

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    answers = {}
    for i in range(len(ds)):
        prompt, ref = prompt_and_reference(ds[i]["input_ids"].tolist(), ds[i]["labels"].tolist())
        answers[tuple(prompt)] = ref
    ev = GenerationEvaluator(ds, Tok(), num_examples=5, max_new_tokens=20, num_samples=3,
                             samples_path=str(tmp_path / "s.jsonl"))
    rec = ev(_Oracle(answers, 1), step=0)
    assert "exact_match" not in rec and rec["eval_examples"] == 5
    samples = [json.loads(line) for line in open(tmp_path / "s.jsonl")]
    # a reply stops at the reference's last token (an end-of-turn token in chat data)
    assert len(samples) == 3 and all(s["reference"].startswith(s["reply"]) and s["reply"] for s in samples)


def test_a_reply_ends_at_its_own_reference_end_whatever_the_batch():
    """Replies do not depend on which examples share a batch: a reply is cut at eos or at its
    own reference's last token, never at another row's."""
    from tests.helpers.data import sft_dataset
    from tests.helpers.recipes import tiny_recipe

    from hybridtrain.training.builder import build
    from hybridtrain.training.evaluation import GenerationEvaluator

    class Tok:
        eos_token_id, pad_token_id = None, 0

    model = build(tiny_recipe(), "cpu", True, 1, data=False).model
    ds = sft_dataset(10, vocab_size=256, min_len=6, max_len=16, seed=3)
    ev = GenerationEvaluator(ds, Tok(), num_examples=7, max_new_tokens=5, batch_size=3, num_samples=0)

    def replies(indices):
        ex = [ev._example(i) for i in indices]
        return ev._replies(model, [e[0] for e in ex], [e[1] for e in ex], "cpu")

    alone = [replies([i])[0] for i in range(7)]
    assert replies(list(range(7))) == alone
    assert replies([1, 3, 5]) == [alone[1], alone[3], alone[5]]


def test_evaluator_checks_generation_settings_at_start_up():
    with pytest.raises(ValueError, match="top_p"):
        GenerationEvaluator([], object(), top_p=2.0)
