"""The recipe values the training loop reads, made once into one typed, frozen object."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hybridtrain.config.sections import config_section

__all__ = ["TrainerSettings", "trainer_settings"]


@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    """What :class:`~hybridtrain.training.trainer.Trainer` reads from ``training:`` and
    ``checkpoint:`` (the keys' meanings and defaults: config/schema.py)."""

    grad_clip: float | None
    max_val_steps: int | None
    val_micro_batch_size: int | None  # None: the step scheduler's micro_batch_size
    val_accuracy: bool
    gc_every_steps: int | None
    max_consecutive_skipped_steps: int | None
    save_hf_at_end: bool
    save_ckpt: bool  # checkpoint.enabled


def trainer_settings(training: Mapping[str, Any] | Any = None,
                     checkpoint: Mapping[str, Any] | Any = None,
                     **overrides: Any) -> TrainerSettings:
    """The settings of a recipe's ``training`` and ``checkpoint`` sections (typed sections, or
    mappings of some keys over the schema's defaults), then ``overrides`` by field name."""
    t = config_section("training", training)
    ck = config_section("checkpoint", checkpoint)
    settings = TrainerSettings(
        grad_clip=t.grad_clip, max_val_steps=t.max_val_steps,
        val_micro_batch_size=t.val_micro_batch_size, val_accuracy=t.val_accuracy,
        gc_every_steps=t.gc_every_steps,
        max_consecutive_skipped_steps=t.max_consecutive_skipped_steps,
        save_hf_at_end=ck.save_hf_at_end, save_ckpt=ck.enabled)
    return dataclasses.replace(settings, **overrides)
