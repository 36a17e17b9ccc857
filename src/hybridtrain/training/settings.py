"""The recipe values the training loop reads, made once into one typed, frozen object."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hybridtrain.config.sections import CheckpointSection, TrainingSection, config_section

__all__ = ["TrainerSettings", "trainer_settings"]


@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    """What :class:`~hybridtrain.training.trainer.Trainer` reads: the recipe's ``training:``
    and ``checkpoint:`` sections, under the recipe's names (``settings.training.grad_clip``,
    ``settings.checkpoint.enabled``; meanings and defaults: config/recipe.py)."""

    training: TrainingSection
    checkpoint: CheckpointSection


def trainer_settings(training: Mapping[str, Any] | Any = None,
                     checkpoint: Mapping[str, Any] | Any = None) -> TrainerSettings:
    """The settings of a recipe's ``training`` and ``checkpoint`` sections (typed sections, or
    mappings of some keys over their defaults)."""
    return TrainerSettings(config_section("training", training),
                           config_section("checkpoint", checkpoint))
