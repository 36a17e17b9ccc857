"""Recipes for tests: a recipe dict for the tiny model, overrides of short CLI runs."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

TINY_MODEL = {
    "_target_": "hybridtrain.models.nemotron_h.NemotronHForCausalLM",
    "config": {"_target_": "hybridtrain.models.nemotron_h.tiny_config", "kind": "mixed"},
}


def tiny_recipe(**sections: dict[str, Any]) -> dict[str, Any]:
    """A recipe dict (for ``hybridtrain.training.builder.build`` / ``hybridtrain.recipes.finetune.run``) training the tiny
    'mixed' Nemotron-H (Mamba, attention, MLP and MoE layers) in fp32 on the CPU with AdamW and
    ``grad_clip: 1.0``, on :func:`tests.helpers.data.sft_dataset` rows. Each keyword updates
    that section's keys (``training={"max_steps": 3}``; ``peft={...}`` adds a section)."""
    recipe = {
        "allowed_target_prefixes": ["tests."],  # the synthetic dataset below
        "model": copy.deepcopy(TINY_MODEL),
        "dataset": {"_target_": "tests.helpers.data.sft_dataset", "n": 64, "vocab_size": 256,
                    "min_len": 6, "max_len": 16, "seed": 1234},
        "training": {"device": "cpu", "dtype": "float32", "seed": 0, "grad_clip": 1.0,
                     "global_batch_size": 8, "micro_batch_size": 2},
        "optimizer": {"lr": 2e-4, "weight_decay": 0.1},
        "metrics": {"progress_bar": False, "plot": False, "peak_tflops": 1.0},
    }
    for name, values in sections.items():
        if isinstance(recipe.get(name), dict) and isinstance(values, dict):
            recipe[name].update(values)
        else:
            recipe[name] = values
    return recipe


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
