"""Launching: `hybridtrain finetune --nproc-per-node 2` (the CLI re-launches itself under
torchrun) and an external `torchrun ... -m hybridtrain finetune` both train like one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "squad_tiny.yaml"
STEPS = 3


def _overrides(tmp: Path, name: str) -> list[str]:
    return [
        f"--checkpoint.dir={tmp / name}",
        f"--tokenizer.out_dir={tmp}/tokenizer",
        "--tokenizer.texts.num_questions=300",
        f"--dataset.path.path={tmp}/data/train.json",
        "--dataset.path.num_questions=200",
        f"--validation_dataset.path.path={tmp}/data/validation.json",
        "--validation_dataset.path.num_questions=16",
        f"--training.max_steps={STEPS}",
        "--training.val_every_steps=0",
        "--training.ckpt_every_steps=0",
        "--checkpoint.save_hf_at_end=false",
        "--metrics.progress_bar=false",
        "--metrics.plot=false",
        "--evaluation=null",  # generation-based metrics need the whole model (refused under pp)
        "--metrics.peak_tflops=1.0",
    ]


def _losses(run: Path, key: str = "loss") -> list[float]:
    return [json.loads(line)[key] for line in open(run / "training.jsonl")]


def _run(argv: list[str], tmp: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    p = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.distributed
def test_cli_nproc_and_external_torchrun_match_single_process(tmp_path):
    from hybridtrain.cli import main

    assert main(["finetune", "-c", str(RECIPE), *_overrides(tmp_path, "single")]) == 0
    ref, ref_norm = _losses(tmp_path / "single"), _losses(tmp_path / "single", "grad_norm")

    # the CLI re-launches itself under torchrun: 2 pipeline stages
    _run([sys.executable, "-m", "hybridtrain", "finetune", "-c", str(RECIPE),
          "--nproc-per-node", "2", "--distributed.pp=2",
          *_overrides(tmp_path, "pp2")], tmp_path)
    # an external torchrun runs hybridtrain in-process: expert parallel over 2 ranks
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
          "-m", "hybridtrain", "finetune", "-c", str(RECIPE), "--distributed.ep=2",
          *_overrides(tmp_path, "ep2")], tmp_path)
    for name in ("pp2", "ep2"):
        losses, norms = _losses(tmp_path / name), _losses(tmp_path / name, "grad_norm")
        assert len(losses) == STEPS
        for a, b in zip(losses + norms, ref + ref_norm):
            assert abs(a - b) <= 1e-5 * abs(b), (name, losses, ref, norms, ref_norm)
