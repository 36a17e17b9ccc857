"""examples/squad_tiny.yaml end to end (a few steps): the output-folder contract of DESIGN.md."""

import json
import os
from pathlib import Path

import pytest
from tests.helpers.recipes import run_overrides

from hybridtrain.training.metrics import TRAIN_FIELDS

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "squad_tiny.yaml"


def _overrides(out: Path, max_steps: int, resume: str = "null", files: Path | None = None
               ) -> list[str]:
    """The run's overrides; its tokenizer and data are built in (or read from) ``files``
    (default: the run folder)."""
    files = files or out
    return run_overrides(
        out, max_steps, resume,
        f"--tokenizer.out_dir={files}/tokenizer",
        "--tokenizer.texts.num_questions=300",
        f"--dataset.path.path={files}/data/train.json",
        "--dataset.path.num_questions=200",
        f"--validation_dataset.path.path={files}/data/validation.json",
        "--validation_dataset.path.num_questions=16",
    )


def test_squad_tiny_output_folder(tmp_path, capsys):
    from hybridtrain.cli import main

    out = tmp_path / "run"
    assert main(["finetune", "-c", str(RECIPE), *_overrides(out, 4)]) == 0
    printed = capsys.readouterr().out
    assert f"outputs in {out}/" in printed and "step_4/hf/" in printed

    recs = [json.loads(line) for line in open(out / "training.jsonl")]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for r in recs:
        assert set(TRAIN_FIELDS) <= set(r), set(TRAIN_FIELDS) - set(r)
        assert r["num_label_tokens"] > 0 and r["num_tokens"] >= r["num_label_tokens"]
        assert r["tflops_per_device"] > 0 and r["mfu"] == pytest.approx(r["tflops_per_device"])
    assert [r["consumed_samples"] for r in recs] == [8, 16, 24, 32]
    vals = [json.loads(line) for line in open(out / "validation.jsonl")]
    assert [v["step"] for v in vals] == [0, 2, 4] and all(v["val_loss"] > 0 for v in vals)

    assert open(out / "latest").read().strip() == "step_4"
    assert sorted(p.name for p in out.glob("step_*")) == ["step_2", "step_4"]
    hf = out / "step_4" / "hf"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(hf))
    assert not (out / "step_2" / "hf").exists()  # save_hf_every is off
    assert (out / "loss.png").stat().st_size > 0 and (out / "config.yaml").exists()

    # the README's convert command reproduces the export from the sharded checkpoint
    from safetensors.torch import load_file

    assert main(["convert", str(out), str(tmp_path / "converted")]) == 0
    a = load_file(hf / "model.safetensors")
    b = load_file(tmp_path / "converted" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)

    # resume: continue the finished run to 6 steps; files read as one run
    assert main(["finetune", "-c", str(RECIPE), *_overrides(out, 6, resume="auto")]) == 0
    recs2 = [json.loads(line) for line in open(out / "training.jsonl")]
    assert [r["step"] for r in recs2] == [1, 2, 3, 4, 5, 6]
    assert recs2[:4] == recs
    assert [json.loads(line)["step"] for line in open(out / "validation.jsonl")] == [0, 2, 4, 6]

    # a fresh start (resume null) in a folder holding a run refuses unless overwrite is set
    capsys.readouterr()
    kept = {p: p.read_bytes() for p in (out / "config.yaml", out / "tokenizer" / "tokenizer.json",
                                        out / "data" / "train.json")}
    assert main(["finetune", "-c", str(RECIPE), *_overrides(out, 2),
                 "--checkpoint.overwrite=false", "--tokenizer.texts.num_questions=250",
                 "--dataset.path.seed=7"]) == 2
    assert {p: p.read_bytes() for p in kept} == kept  # the refused run wrote nothing
    err = capsys.readouterr().err
    assert "already holds a run" in err and "checkpoint.resume=auto" in err
    assert open(out / "latest").read().strip() == "step_6"


def test_loss_chunk_size_switch_keeps_the_losses(tmp_path):
    """training.loss_chunk_size: null (plain full-logit loss) gives the chunked run's losses
    (the second run reads the tokenizer and data the first built)."""
    from hybridtrain.cli import main

    losses = []
    for chunk in ("null", "64"):
        out = tmp_path / f"chunk_{chunk}"
        assert main(["finetune", "-c", str(RECIPE), *_overrides(out, 2, files=tmp_path),
                     f"--training.loss_chunk_size={chunk}", "--checkpoint.enabled=false",
                     "--checkpoint.save_hf_at_end=false", "--training.val_every_steps=0"]) == 0
        losses.append([json.loads(line)["loss"] for line in open(out / "training.jsonl")])
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
