"""Verifiable toy tasks for GRPO demos: a task makes prompts and scores completions.

A task object has ``prompts(n, rng) -> list[str]`` (``rng``: a ``random.Random``) and
``reward(prompt, completion) -> float`` in ``[0, 1]``; ``texts(n)`` gives text to train a
tokenizer on. Any object with these methods can be named by the recipe's ``grpo.task``.
"""

from __future__ import annotations

import random
import re

__all__ = ["CountingTask", "counting_texts"]


class CountingTask:
    """``"count: 3 4 5"`` -> the model should go on with ``" 6 7 8 9"`` (digits mod 10).

    Reward: ``format_weight`` for writing ``answer_digits`` digits, the rest for each being the
    right next one (so a policy first learns to write digits at all, then the right ones)."""

    def __init__(self, prompt_digits: int = 3, answer_digits: int = 4, format_weight: float = 0.5):
        self.prompt_digits, self.answer_digits = prompt_digits, answer_digits
        self.format_weight = format_weight

    def prompts(self, n: int, rng: random.Random) -> list[str]:
        out = []
        for _ in range(n):
            start = rng.randrange(10)
            out.append("count: " + " ".join(str((start + i) % 10) for i in range(self.prompt_digits)))
        return out

    def expected(self, prompt: str) -> list[str]:
        last = int(prompt.split()[-1])
        return [str((last + 1 + i) % 10) for i in range(self.answer_digits)]

    def reward(self, prompt: str, completion: str) -> float:
        digits = re.findall(r"\d", completion)[: self.answer_digits]
        k = self.answer_digits
        right = sum(d == e for d, e in zip(digits, self.expected(prompt)))
        return self.format_weight * len(digits) / k + (1 - self.format_weight) * right / k

    def texts(self, n: int = 500, seed: int = 0) -> list[str]:
        rng = random.Random(seed)
        return [p + " " + " ".join(self.expected(p)) for p in self.prompts(n, rng)]


def counting_texts(n: int = 500, seed: int = 0, prompt_digits: int = 3, answer_digits: int = 4
                   ) -> list[str]:
    """Tokenizer training text for :class:`CountingTask` (a recipe's ``_target_``)."""
    return CountingTask(prompt_digits, answer_digits).texts(n, seed)
