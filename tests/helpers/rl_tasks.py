"""GRPO tasks that break the task interface, for the tests of how the recipe reports them."""

from __future__ import annotations

from hybridtrain.rl.tasks import CountingTask


class NaNRewardTask(CountingTask):
    """Rewards every completion with NaN."""

    def reward(self, prompt: str, completion: str) -> float:
        return float("nan")


class TextRewardTask(CountingTask):
    """Returns the reward as text."""

    def reward(self, prompt: str, completion: str):
        return "1.0"


class NoPromptsTask:
    """Has a reward but no ``prompts``."""

    def reward(self, prompt: str, completion: str) -> float:
        return 0.0
