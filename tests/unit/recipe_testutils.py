"""Shared helpers of the end-to-end recipe tests (tests/unit/test_*_e2e.py, test_lora_recipe.py)."""

from __future__ import annotations

from pathlib import Path


def run_overrides(out: Path, max_steps: int, resume: str = "null", *extra: str) -> list[str]:
    """Command-line overrides for a short tiny-recipe run into ``out``: ``extra`` (the recipe's
    own), validation and checkpoints every 2 steps, no progress bar, no CPU peak measurement."""
    return [
        f"--checkpoint.dir={out}",
        f"--checkpoint.resume={resume}",
        *extra,
        f"--training.max_steps={max_steps}",
        "--training.val_every_steps=2",
        "--training.ckpt_every_steps=2",
        "--metrics.progress_bar=false",
        "--metrics.peak_tflops=1.0",  # skip measuring the CPU's matmul peak
    ]
