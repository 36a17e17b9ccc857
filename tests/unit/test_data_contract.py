"""The data contract (hybridtrain.data.contract): a dataset that breaks it is named where it is
built, with what it lacks; a dataset from outside the tree (tests/families/hybridtrain_lines,
registered through the entry-point group ``hybridtrain.datasets``) trains through finetune and
is read by evaluate."""

import json
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
import yaml

from hybridtrain.data.contract import check_dataset

ROOT = Path(__file__).resolve().parents[2]


class _NoPad:
    def __len__(self):
        return 1

    def __getitem__(self, i):
        return {"input_ids": torch.tensor([1, 2])}


def test_a_dataset_that_breaks_the_contract_is_named_with_what_it_lacks():
    with pytest.raises(ValueError, match=r"dataset \(recipe.yaml:3\): the dataset \(.*_NoPad\) "
                                         r"lacks pad_token_id"):
        check_dataset(_NoPad(), "dataset (recipe.yaml:3)")
    ds = _NoPad()
    ds.pad_token_id = 0
    with pytest.raises(ValueError, match="lacks example key 'labels'"):
        check_dataset(ds, "dataset")


def test_packing_and_padding_name_a_missing_pad_token():
    from hybridtrain.data import build_collator, pack_dataset

    rows = [{"input_ids": torch.tensor([1, 2]), "labels": torch.tensor([2, -100])}]
    with pytest.raises(ValueError, match="pack_dataset needs pad_token_id"):
        pack_dataset(rows, 8)
    with pytest.raises(ValueError, match="build_collator needs pad_token_id"):
        build_collator(rows)
    assert len(pack_dataset(rows, 8, pad_token_id=0)) == 1


def test_a_recipe_names_a_dataset_that_is_not_registered():
    from hybridtrain.data import registered_dataset

    with pytest.raises(ValueError, match="no dataset named 'nowhere' is registered"):
        registered_dataset("nowhere")


def test_a_dataset_from_outside_trains_through_finetune_and_evaluate(tmp_path):
    if not any(ep.name == "lines_test" for ep in entry_points(group="hybridtrain.datasets")):
        pytest.skip("pip install --no-deps -e tests/families/hybridtrain_lines (make test does)")
    from hybridtrain.cli import main

    lines = tmp_path / "lines.txt"
    lines.write_text("".join(f"The river {i} runs past the mill of {i * 7}.\n" for i in range(40)))
    recipe = yaml.safe_load((ROOT / "examples" / "squad_tiny.yaml").read_text().replace(
        "outputs/squad_tiny", str(tmp_path / "out")).replace("num_questions: 2000",
                                                            "num_questions: 200"))
    source = {"_target_": "hybridtrain.data.registered_dataset", "name": "lines_test",
              "path": str(lines), "seq_length": 32}
    run = tmp_path / "run"
    recipe.update(dataset=source, validation_dataset=source, evaluation={
        "num_examples": 2, "max_new_tokens": 2, "num_samples": 0}, checkpoint={"dir": str(run)})
    recipe["packing"]["pack_size"] = 64
    recipe["training"].update(max_steps=2, val_every_steps=2, ckpt_every_steps=2)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    quiet = ["--metrics.progress_bar=false", "--metrics.plot=false"]
    assert main(["finetune", "-c", str(path), *quiet]) == 0
    logged = [json.loads(line) for line in (run / "training.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2] and all(r["num_label_tokens"] > 0 for r in logged)
    assert "val_loss" in json.loads((run / "validation.jsonl").read_text().splitlines()[-1])
    assert main(["evaluate", "-c", str(path), "--checkpoint", str(run)]) == 0
    assert json.loads((run / "evaluation.jsonl").read_text().splitlines()[-1])["eval_examples"] == 2
