"""Evaluation by generation under every training layout (gloo): the recipe's builder and trainer
(``tests.helpers.parity.build``) with the evaluator of ``training.builder.make_evaluator``;
``Trainer.validate`` gives the single process's SQuAD exact match / F1 and counts, and
``generate`` its tokens, for the same weights and examples.

The references make the scores non-trivial (some replies match exactly, some partly), and the
tokenizer's eos is a token the model generates, so rows and ranks finish at different steps (the
lockstep loop keeps the ranks' collectives in step); 7 examples over 2 data-parallel ranks leave
one rank a filler prompt.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

from tests.helpers.data import sft_dataset
from tests.helpers.distributed import run_cli, run_distributed

NUM_EXAMPLES, MAX_NEW = 7, 6


class _Tok:
    pad_token_id = 0

    def __init__(self, eos):
        self.eos_token_id = eos

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class _Examples(torch.utils.data.Dataset):
    def __init__(self):
        self.ds = sft_dataset(10, vocab_size=256, min_len=6, max_len=16, seed=3)

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return self.ds[i]

    def record_id(self, i):
        return str(i)


class _Scored(_Examples):
    def __init__(self, answers):
        super().__init__()
        self.answers = answers

    def reference_answers(self):
        return self.answers

    def answer_of(self, text):
        return text


def _section(out_dir):
    from hybridtrain.config.recipe import EvaluationSection

    return EvaluationSection(num_examples=NUM_EXAMPLES, max_new_tokens=MAX_NEW, batch_size=3,
                             num_samples=NUM_EXAMPLES,
                             samples_file=os.path.join(out_dir, "samples.jsonl"))


def _prompts():
    return torch.randint(1, 256, (3, 11), generator=torch.Generator().manual_seed(0))


def _run(layout, world, dataset, eos, out_dir):
    """(validation record, tokens of _prompts()) under ``layout`` on this rank."""
    from hybridtrain.training.builder import make_evaluator
    from hybridtrain.training.evaluation import full_parameters
    from tests.helpers import parity as pu

    torch.set_num_threads(1)
    b, trainer = pu.build(layout, world)
    ev = make_evaluator(b, _section(out_dir), dataset, _Tok(eos))
    trainer.evaluator = ev
    rec = trainer.validate()
    stages = b.plan.pipeline.stages if b.plan.pipeline is not None else []
    with full_parameters(b.model, *stages):
        tokens = b.model.generate(_prompts(), max_new_tokens=8, eos_token_id=eos, **ev.layout_kwargs())
    return {k: rec.get(k) for k in ("exact_match", "f1", "eval_examples", "eval_new_tokens")}, tokens


def _ranks(rank, world, layouts, answers, eos, out_dir):
    """Every layout of ``layouts`` ({name: layout}) in turn, in one set of processes."""
    out = {}
    for name, layout in layouts.items():
        os.makedirs(os.path.join(out_dir, name), exist_ok=True)
        out[name] = _run(layout, world, _Scored(answers), eos, os.path.join(out_dir, name))
    return out


@pytest.fixture(scope="module")
def reference():
    """The single process: eos picked from its replies, references from its replies (even
    examples: exact; odd: one extra word), then its record and tokens."""
    with tempfile.TemporaryDirectory() as d:
        _run({}, 1, _Examples(), None, d)
        replies = [json.loads(line)["reply"] for line in open(os.path.join(d, "samples.jsonl"))]
        eos = int(replies[0].split()[2])
    with tempfile.TemporaryDirectory() as d:
        _run({}, 1, _Examples(), eos, d)
        replies = [json.loads(line) for line in open(os.path.join(d, "samples.jsonl"))]
    answers = {r["id"]: [r["reply"] if int(r["id"]) % 2 == 0 else r["reply"] + " 7"] for r in replies}
    assert any(len(r["reply"].split()) < MAX_NEW for r in replies), "eos ends no reply early"
    with tempfile.TemporaryDirectory() as d:
        rec, tokens = _run({}, 1, _Scored(answers), eos, d)
    assert 0 < rec["exact_match"] < 100 and rec["f1"] > rec["exact_match"], rec
    return rec, tokens, answers, eos


LAYOUTS = {
    "ep2": ({"ep": 2}, 2),
    "tp2": ({"tp": 2}, 2),
    "cp2": ({"cp": 2}, 2),
    "pp2": ({"pp": 2}, 2),
    "pp2_interleaved": ({"pp": 2, "schedule": "interleaved1f1b"}, 2),
    "pp2_zbv": ({"pp": 2, "schedule": "zbv"}, 2),  # stages 1 and 2 on one rank: handed over locally
    "pp2_ep2": ({"pp": 2, "ep": 2}, 4),
}


@pytest.fixture(scope="module")
def layout_runs(reference, tmp_path_factory):
    """Each layout's per-rank (record, tokens): the layouts of one world size in one launch."""
    _, _, answers, eos = reference
    out = {}
    for world in sorted({w for _, w in LAYOUTS.values()}):
        layouts = {name: layout for name, (layout, w) in LAYOUTS.items() if w == world}
        tmp = str(tmp_path_factory.mktemp(f"eval{world}"))
        for rank, res in enumerate(run_distributed(_ranks, world, layouts, answers, eos, tmp)):
            for name, got in res.items():
                out.setdefault(name, []).append(got)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_evaluation_matches_one_process(name, reference, layout_runs):
    ref_rec, ref_tokens, _, _ = reference
    for rec, tokens in layout_runs[name]:
        assert rec == pytest.approx(ref_rec, rel=0, abs=1e-9), (name, rec, ref_rec)
        assert torch.equal(tokens, ref_tokens), name


RECIPE = Path(__file__).resolve().parents[2] / "examples" / "squad_tiny.yaml"
EVAL_KEYS = ("step", "exact_match", "f1", "eval_examples", "eval_new_tokens")


def _overrides(tmp: Path, name: str) -> list[str]:
    """The demo recipe, small: 1 step near the initial weights (replies of random tokens, not eos
    at once), validation with evaluation before and after it, a checkpoint at the end."""
    from tests.helpers.recipes import run_overrides

    return run_overrides(
        tmp / name, 1, "null", "--optimizer.lr=1e-7",
        f"--tokenizer.out_dir={tmp}/tokenizer", "--tokenizer.texts.num_questions=300",
        f"--dataset.path.path={tmp}/data/train.json", "--dataset.path.num_questions=200",
        f"--validation_dataset.path.path={tmp}/data/validation.json",
        "--validation_dataset.path.num_questions=16",
        "--evaluation.num_examples=5", "--evaluation.max_new_tokens=4", "--evaluation.num_samples=0",
        "--metrics.plot=false",
    )


def _records(path: Path) -> list[dict]:
    return [{k: r[k] for k in EVAL_KEYS} for r in map(json.loads, open(path)) if "eval_examples" in r]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    """The demo recipe trained in one process (evaluation at each validation)."""
    from hybridtrain.cli import main

    tmp = tmp_path_factory.mktemp("demo")
    assert main(["finetune", "-c", str(RECIPE), *_overrides(tmp, "single")]) == 0
    recs = _records(tmp / "single" / "validation.jsonl")
    assert len(recs) == 2 and all(r["eval_examples"] == 5 and r["eval_new_tokens"] > 0 for r in recs), recs
    return tmp


@pytest.mark.distributed
def test_finetune_under_pp_evaluates_like_one_process(single_run):
    """`hybridtrain finetune --distributed.pp=2` on 2 ranks with the `evaluation:` section: the
    one-process run's EM/F1 and counts at every validation."""
    run_cli(["finetune", "-c", str(RECIPE), *_overrides(single_run, "pp2"), "--distributed.pp=2"],
            2, single_run)
    assert _records(single_run / "pp2" / "validation.jsonl") == _records(single_run / "single" / "validation.jsonl")


@pytest.mark.distributed
def test_cli_evaluate_under_a_layout_matches_one_process(single_run):
    """`hybridtrain evaluate --distributed.ep=2` on 2 ranks on a run's checkpoint: the
    one-process command's record."""
    from hybridtrain.cli import main

    args = _overrides(single_run, "single")
    assert main(["evaluate", "-c", str(RECIPE), *args]) == 0
    run_cli(["evaluate", "-c", str(RECIPE), *args, "--distributed.ep=2"], 2, single_run)
    one, laid_out = _records(single_run / "single" / "evaluation.jsonl")
    assert laid_out == one and one["step"] == 1
