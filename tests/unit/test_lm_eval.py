"""lm-evaluation-harness on a hybridtrain model (`hybridtrain lm-eval`, the lm_eval model
`hybridtrain`), offline on local YAML tasks over local JSONL (multiple choice and generation):
the same log-likelihoods (1e-4), choices, generations and metrics as lm_eval's own `hf` backend
(transformers) on the same tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.helpers.models import tiny_base

lm_eval = pytest.importorskip("lm_eval")

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: "{{{{question}}}}\\nAnswer:"
doc_to_target: {target}
"""
MC = """output_type: multiple_choice
doc_to_choice: "{{choices}}"
metric_list: [{metric: acc}, {metric: acc_norm}]
"""
GEN = """output_type: generate_until
generation_kwargs: {until: ["\\n"], max_gen_toks: 6, do_sample: false}
metric_list: [{metric: exact_match}]
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(tiny model folder, task folder)."""
    root = tmp_path_factory.mktemp("lm_eval")
    tiny_base(root / "model")
    docs = [{"question": f"Where does the bell of tower {i} ring?",
             "choices": [" in the north", " by the river", " at the market"], "answer": i % 3}
            for i in range(8)]
    mc, gen = root / "mc.jsonl", root / "gen.jsonl"
    mc.write_text("".join(json.dumps(d) + "\n" for d in docs))
    gen.write_text("".join(json.dumps({"question": d["question"], "answer": "north"}) + "\n"
                           for d in docs[:4]))
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(TASK.format(name="tiny_mc", data=mc, target="answer") + MC)
    (tasks / "tiny_gen.yaml").write_text(TASK.format(name="tiny_gen", data=gen, target="answer")
                                         + GEN)
    return root / "model", tasks


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))


def _evaluate(model: str, model_args: dict, tasks: Path) -> dict:
    from lm_eval.tasks import TaskManager

    import hybridtrain.recipes.lm_harness_model  # noqa: F401  (registers 'hybridtrain')

    return lm_eval.simple_evaluate(model=model, model_args=model_args,
                                   tasks=["tiny_mc", "tiny_gen"], batch_size=4, log_samples=True,
                                   task_manager=TaskManager(include_path=str(tasks),
                                                            include_defaults=False))


def test_the_same_scores_as_lm_evals_hf_backend(setup):
    model, tasks = setup
    ours = _evaluate("hybridtrain", {"pretrained": str(model), "device": "cpu",
                                     "max_batch_tokens": 64}, tasks)  # several packed rows
    hf = _evaluate("hf", {"pretrained": str(model), "device": "cpu", "dtype": "float32"}, tasks)

    def scores(r, task):  # (log-likelihood, is_greedy) of each (document, choice)
        return [x for s in r["samples"][task] for x in s["filtered_resps"]]

    a, b = scores(ours, "tiny_mc"), scores(hf, "tiny_mc")
    assert len(a) == len(b) == 24
    assert [float(x[0]) for x in a] == pytest.approx([float(y[0]) for y in b], abs=1e-4)
    assert [x[1] for x in a] == [y[1] for y in b]
    assert ours["results"]["tiny_mc"]["acc,none"] == hf["results"]["tiny_mc"]["acc,none"]
    replies = [s["filtered_resps"] for s in ours["samples"]["tiny_gen"]]
    assert replies == [s["filtered_resps"] for s in hf["samples"]["tiny_gen"]]
    assert any(r[0] for r in replies)  # greedy text came out (cut at the newline)


def test_the_command_prints_lm_evals_table_and_writes_the_results(setup, tmp_path, capsys):
    from hybridtrain.cli import main

    model, tasks = setup
    out = tmp_path / "results.json"
    assert main(["lm-eval", str(model), "--tasks", "tiny_mc", "--include-path", str(tasks),
                 "--device", "cpu", "--limit", "4", "--output", str(out)]) == 0
    assert "tiny_mc" in capsys.readouterr().out and "acc" in out.read_text()
    assert json.loads(out.read_text())["results"]["tiny_mc"]["acc,none"] >= 0
