"""Launching: `hybridtrain finetune --nproc-per-node 2` (the CLI re-launches itself under
torchrun; pipeline and context parallel) and an external `torchrun ... -m hybridtrain finetune`
(expert parallel) all train like one process (one one-process run for all)."""

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
        "--evaluation=null",  # (evaluation under layouts: tests/distributed/test_evaluation_layouts.py)
        "--metrics.peak_tflops=1.0",
    ]


def _losses(run: Path, key: str = "loss") -> list[float]:
    return [json.loads(line)[key] for line in open(run / "training.jsonl")]


def _run(argv: list[str], tmp: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    p = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The recipe trained in one process (in this process): (directory, losses, gradient norms)."""
    from hybridtrain.cli import main

    tmp = tmp_path_factory.mktemp("launch")
    assert main(["finetune", "-c", str(RECIPE), *_overrides(tmp, "single")]) == 0
    return tmp, _losses(tmp / "single"), _losses(tmp / "single", "grad_norm")


def _assert_matches(tmp: Path, name: str, ref: list[float], ref_norm: list[float]) -> None:
    losses, norms = _losses(tmp / name), _losses(tmp / name, "grad_norm")
    assert len(losses) == STEPS
    for a, b in zip(losses + norms, ref + ref_norm):
        assert abs(a - b) <= 1e-5 * abs(b), (name, losses, ref, norms, ref_norm)


@pytest.mark.distributed
def test_cli_nproc_and_external_torchrun_match_single_process(single):
    tmp, ref, ref_norm = single
    # the CLI re-launches itself under torchrun: 2 pipeline stages
    _run([sys.executable, "-m", "hybridtrain", "finetune", "-c", str(RECIPE),
          "--nproc-per-node", "2", "--distributed.pp=2",
          *_overrides(tmp, "pp2")], tmp)
    # an external torchrun runs hybridtrain in-process: expert parallel over 2 ranks
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
          "-m", "hybridtrain", "finetune", "-c", str(RECIPE), "--distributed.ep=2",
          *_overrides(tmp, "ep2")], tmp)
    for name in ("pp2", "ep2"):
        _assert_matches(tmp, name, ref, ref_norm)


@pytest.mark.distributed
def test_cli_cp2_matches_single_process(single):
    """``hybridtrain finetune --nproc-per-node 2 --distributed.cp=2`` on the packed tiny SQuAD
    recipe: the per-step losses and gradient norms of the one-process run."""
    tmp, ref, ref_norm = single
    _run([sys.executable, "-m", "hybridtrain", "finetune", "-c", str(RECIPE),
          "--nproc-per-node", "2", "--distributed.cp=2", *_overrides(tmp, "cp2")], tmp)
    _assert_matches(tmp, "cp2", ref, ref_norm)
