"""The shipped examples/vlm_tiny.yaml through the CLI under ``--distributed.encoder_ranks=2`` on 4
ranks, as docs/vlm.md runs it: all modules trained, and stage 1 (``model.freeze: [vision,
language]``). Two steps on smaller synthetic data; the recipe's ``val_accuracy: true`` is
reported in ``validation.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.distributed import run_cli

pytestmark = pytest.mark.timeout(300)

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "vlm_tiny.yaml"
SMALL = ["--training.max_steps=2", "--training.max_val_steps=2", "--dataset.path.n=200",
         "--validation_dataset.path.n=16", "--metrics.progress_bar=false", "--metrics.plot=false"]


@pytest.mark.parametrize("freeze", ["[]", "[vision, language]"], ids=["colocated", "stage1"])
def test_vlm_tiny_under_encoder_ranks(tmp_path, freeze):
    run_cli(["finetune", "-c", str(RECIPE), "--distributed.encoder_ranks=2",
             f"--model.freeze={freeze}", *SMALL], 4, tmp_path)
    out = tmp_path / "outputs" / "vlm_tiny"
    val = [json.loads(line) for line in (out / "validation.jsonl").read_text().splitlines()]
    assert [v["step"] for v in val] == [0, 2]
    assert all(v["token_accuracy"] is not None and v["answer_accuracy"] is not None
               for v in val), val
    assert (out / "final" / "hf" / "config.json").is_file()
