"""Verifiable toy tasks for GRPO demos: a task makes prompts and scores completions.

A task object has ``prompts(n, rng) -> list[str]`` (``rng``: a ``random.Random``) and
``reward(prompt, completion) -> float`` in ``[0, 1]``; optionally ``accuracy(prompt,
completion) -> float`` (what is exactly right, logged next to the reward); ``texts(n)`` gives
text to train a tokenizer on. Any object with these methods can be named by the recipe's ``grpo.task``.

:func:`check_task`, :func:`task_prompts` and :func:`score` check that interface where a task
enters the GRPO loop, naming the task and method that broke it.
"""

from __future__ import annotations

import random
import re
from typing import Any, Callable

__all__ = ["CountingTask", "counting_texts", "check_task", "task_prompts", "score", "method_name"]

REQUIRED_METHODS = {"prompts": "prompts(n, rng) -> list[str]",
                    "reward": "reward(prompt, completion) -> float"}


def method_name(fn: Callable) -> str:
    """``Task.reward`` for a bound method, the function's name otherwise."""
    owner = getattr(fn, "__self__", None)
    name = getattr(fn, "__name__", repr(fn))
    return f"{type(owner).__qualname__}.{name}" if owner is not None else \
        getattr(fn, "__qualname__", name)


def check_task(task: Any, where: str = "grpo.task") -> None:
    """Refuses a task object without the methods GRPO calls (ValueError naming them)."""
    missing = [sig for m, sig in REQUIRED_METHODS.items() if not callable(getattr(task, m, None))]
    if missing:
        raise ValueError(f"{where}: the task {type(task).__module__}.{type(task).__qualname__} "
                         f"has no method {' and no '.join(missing)}; a GRPO task needs "
                         f"{' and '.join(REQUIRED_METHODS.values())} (see hybridtrain.rl.tasks)")


def task_prompts(task: Any, n: int, rng: random.Random) -> list[str]:
    """``task.prompts(n, rng)``, checked to be ``n`` strings."""
    out = task.prompts(n, rng)
    if not isinstance(out, (list, tuple)) or len(out) != n or \
            not all(isinstance(p, str) for p in out):
        got = (f"{len(out)} items of types {sorted({type(p).__name__ for p in out})}"
               if isinstance(out, (list, tuple)) else type(out).__name__)
        raise ValueError(f"{method_name(task.prompts)}({n}, rng) returned {got}; it must return "
                         f"a list of {n} prompt strings")
    return list(out)


def score(fn: Callable, prompt: str, completion: str, sample: int) -> float:
    """``fn(prompt, completion)`` as a float; a value that is not a number is refused, naming
    the function, the sample (group-major index of the step) and what it returned."""
    v = fn(prompt, completion)
    if isinstance(v, (str, bytes)) or not hasattr(v, "__float__"):
        raise ValueError(f"{method_name(fn)} returned {type(v).__name__} {v!r:.80} for sample "
                         f"{sample} (completion {completion!r:.80}); it must return a number")
    return float(v)


class CountingTask:
    """``"count: 3 4 5"`` -> the model should go on with ``" 6 7 8 9"`` (digits mod 10).

    Reward: ``format_weight`` for writing ``answer_digits`` digits, the rest for each being the
    right next one (so a policy first learns to write digits at all, then the right ones). With
    ``partial_credit`` a digit ``k`` steps away from the right one on the circle 0..9 earns
    ``1 - k/5`` of its share (still verifiable, 1 only for the exact answer): every sampled digit
    tells the policy which way to move, so the groups' rewards differ even once the policy
    writes only a few digits."""

    def __init__(self, prompt_digits: int = 3, answer_digits: int = 4, format_weight: float = 0.5,
                 partial_credit: bool = False):
        self.prompt_digits, self.answer_digits = prompt_digits, answer_digits
        self.format_weight, self.partial_credit = format_weight, partial_credit

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
        right = sum(self._score(int(d), int(e)) for d, e in zip(digits, self.expected(prompt)))
        return self.format_weight * len(digits) / k + (1 - self.format_weight) * right / k

    def accuracy(self, prompt: str, completion: str) -> float:
        """The fraction of the answer's digits that are exactly right."""
        digits = re.findall(r"\d", completion)[: self.answer_digits]
        return sum(d == e for d, e in zip(digits, self.expected(prompt))) / self.answer_digits

    def _score(self, d: int, e: int) -> float:
        if not self.partial_credit:
            return float(d == e)
        k = abs(d - e) % 10
        return 1 - min(k, 10 - k) / 5

    def texts(self, n: int = 500, seed: int = 0) -> list[str]:
        rng = random.Random(seed)
        return [p + " " + " ".join(self.expected(p)) for p in self.prompts(n, rng)]


def counting_texts(n: int = 500, seed: int = 0, prompt_digits: int = 3, answer_digits: int = 4
                   ) -> list[str]:
    """Tokenizer training text for :class:`CountingTask` (a recipe's ``_target_``)."""
    return CountingTask(prompt_digits, answer_digits).texts(n, seed)
