"""Step scheduler: batch arithmetic, run length, periodic events, and the data position.

One optimizer step consumes one *global batch* of ``global_batch_size`` samples: ``dp_size``
ranks each run ``grad_acc_steps`` micro-batches of ``micro_batch_size`` samples. An epoch is
``num_train_samples // global_batch_size`` steps (the tail that does not fill a global batch is
dropped; with ``drop_last=False`` the epoch has ``ceil`` steps and the last global batch is filled
up with samples from the start of the epoch's order, as ``DistributedSampler`` does), so the data position of step ``s`` is ``(epoch, step_in_epoch) = divmod(s, steps_per_epoch)``
and resuming needs nothing but the step counter and the sampler's seed.

The global order of epoch ``e`` is ``randperm(num_samples, seed + e)`` (or ``arange``). Step ``s``
takes the next ``global_batch_size`` indices; micro-step ``i`` of it takes ``dp_size *
micro_batch_size`` of those, and rank ``r`` the ``r``-th slice of ``micro_batch_size``. Every step
sees the same samples whatever ``dp_size`` is, which the parallel-parity tests rely on.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hybridtrain.config.keys import recipe_key


def epoch_order(num_samples: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(num_samples))
    g = torch.Generator()
    g.manual_seed(int(seed) + int(epoch))
    return torch.randperm(num_samples, generator=g).tolist()


def steps_per_epoch(num_samples: int, global_batch_size: int, drop_last: bool = True) -> int:
    if drop_last:
        return num_samples // global_batch_size
    return math.ceil(num_samples / global_batch_size)


def check_epochs(num_epochs: float) -> None:
    """Refuses a run length by epochs (``training.max_steps`` null) that trains nothing: 0, a
    negative number, NaN or infinity (instead of rounding it up to one step)."""
    if isinstance(num_epochs, bool) or not (float(num_epochs) > 0 and math.isfinite(
            float(num_epochs))):
        raise ValueError(
            f"{recipe_key('num_epochs')}={num_epochs!r} with {recipe_key('max_steps')}=null "
            f"trains nothing; set {recipe_key('num_epochs')} to a number of epochs > 0 (e.g. 1) "
            f"or {recipe_key('max_steps')} to a number of steps")


class MicroBatchSampler:
    """Batch sampler for one rank: the micro-batches of steps ``[start_step, steps_per_epoch)`` of
    one epoch (see module docstring). Usable as ``DataLoader(batch_sampler=...)``."""

    def __init__(
        self,
        num_samples: int,
        micro_batch_size: int,
        grad_acc_steps: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        epoch: int = 0,
        start_step: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ):
        self.mbs, self.ga = micro_batch_size, grad_acc_steps
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.gbs = micro_batch_size * grad_acc_steps * dp_size
        self.steps_per_epoch = steps_per_epoch(num_samples, self.gbs, drop_last)
        self.order = epoch_order(num_samples, epoch, seed, shuffle)
        need = self.steps_per_epoch * self.gbs
        while len(self.order) < need:  # drop_last=False: wrap around
            self.order += self.order[: need - len(self.order)]
        self.start_step = start_step

    def __len__(self) -> int:
        return max(self.steps_per_epoch - self.start_step, 0) * self.ga

    def for_rank(self, dp_rank: int) -> "MicroBatchSampler":
        """The same sampler for data-parallel rank ``dp_rank`` (a rank reading for others)."""
        other = copy.copy(self)
        other.dp_rank = dp_rank
        return other

    def __iter__(self) -> Iterator[list[int]]:
        chunk = self.mbs * self.dp_size
        for step in range(self.start_step, self.steps_per_epoch):
            base = step * self.gbs
            for i in range(self.ga):
                lo = base + i * chunk + self.dp_rank * self.mbs
                yield self.order[lo : lo + self.mbs]


class EvalBatchSampler:
    """All ``num_samples`` in order, split over ranks so that every rank runs the same number of
    micro-batches (collectives inside the model need that). Missing tail slots are filled with
    index 0; :attr:`num_real` tells the trainer how many rows of each batch are real."""

    def __init__(self, num_samples: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1):
        self.n, self.mbs, self.dp_rank, self.dp_size = num_samples, micro_batch_size, dp_rank, dp_size
        self.num_batches = math.ceil(num_samples / (micro_batch_size * dp_size)) if num_samples else 0
        self.num_real: list[int] = []
        for b in range(self.num_batches):
            lo = b * micro_batch_size * dp_size + dp_rank * micro_batch_size
            self.num_real.append(max(0, min(micro_batch_size, num_samples - lo)))

    def __len__(self) -> int:
        return self.num_batches

    def for_rank(self, dp_rank: int) -> "EvalBatchSampler":
        """The same split's batches of data-parallel rank ``dp_rank``."""
        return EvalBatchSampler(self.n, self.mbs, dp_rank, self.dp_size)

    def __iter__(self) -> Iterator[list[int]]:
        for b in range(self.num_batches):
            lo = b * self.mbs * self.dp_size + self.dp_rank * self.mbs
            yield [i if i < self.n else 0 for i in range(lo, lo + self.mbs)]


class StepScheduler:
    """Counts steps/epochs/samples, decides when to log, validate, checkpoint and stop.

    ``max_steps`` wins over ``num_epochs`` (the data then repeats epoch after epoch);
    ``num_epochs`` (may be fractional) is used when ``max_steps`` is None.
    """

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        dp_size: int = 1,
        max_steps: int | None = None,
        num_epochs: int | None = None,
        num_train_samples: int | None = None,
        val_every_steps: int | None = None,
        ckpt_every_steps: int | None = None,
        log_every_steps: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ):
        gbs, mbs = recipe_key("global_batch_size"), recipe_key("micro_batch_size")
        for key, val in (("global_batch_size", global_batch_size),
                         ("micro_batch_size", micro_batch_size), ("dp_size", dp_size)):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{recipe_key(key)} must be a positive integer, got {val!r}")
        per_micro_step = micro_batch_size * dp_size
        if global_batch_size % per_micro_step:
            raise ValueError(
                f"{gbs}={global_batch_size} is not divisible by {mbs} x the data-parallel size "
                f"= {micro_batch_size} x {dp_size} = {per_micro_step}; choose a {gbs} that is a "
                f"multiple of {per_micro_step}"
            )
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_size = dp_size
        self.grad_acc_steps = global_batch_size // per_micro_step
        self.num_train_samples = num_train_samples
        self.drop_last = bool(drop_last)
        self.steps_per_epoch: int | None = None
        if num_train_samples is not None:
            self.steps_per_epoch = steps_per_epoch(num_train_samples, global_batch_size, drop_last)
            if self.steps_per_epoch == 0:
                raise ValueError(
                    f"the training set has {num_train_samples} samples, fewer than "
                    f"{gbs}={global_batch_size}; lower {gbs} or add data"
                )
        if max_steps is None:
            if num_epochs is None:
                raise ValueError(f"set {recipe_key('max_steps')} or {recipe_key('num_epochs')}")
            if self.steps_per_epoch is None:
                raise ValueError(f"{recipe_key('num_epochs')} needs the training-set size")
            check_epochs(num_epochs)
            max_steps = max(int(float(num_epochs) * self.steps_per_epoch), 1)
        if int(max_steps) < 1:
            raise ValueError(f"{recipe_key('max_steps')} must be >= 1, got {max_steps}")
        self.max_steps = int(max_steps)
        self.val_every_steps = val_every_steps
        self.ckpt_every_steps = ckpt_every_steps
        self.log_every_steps = max(int(log_every_steps or 1), 1)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        # state
        self.step = 0  # optimizer steps attempted (applied or skipped)
        self.consumed_samples = 0
        self.skipped_steps = 0

    # -- position --------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.step // self.steps_per_epoch if self.steps_per_epoch else 0

    @property
    def step_in_epoch(self) -> int:
        return self.step % self.steps_per_epoch if self.steps_per_epoch else self.step

    @property
    def done(self) -> bool:
        return self.step >= self.max_steps

    def advance(self, skipped: bool = False) -> None:
        """Marks the current step finished (its global batch consumed)."""
        self.step += 1
        self.consumed_samples += self.global_batch_size
        self.skipped_steps += int(skipped)

    # -- events (evaluated after advance(); ``step`` is then the number of finished steps) -----
    def _every(self, n: int | None) -> bool:
        return bool(n) and n > 0 and self.step % n == 0

    @property
    def is_log_step(self) -> bool:
        return self._every(self.log_every_steps) or self.done

    @property
    def is_val_step(self) -> bool:
        """Every ``val_every_steps`` and after the last step (only then when it is null/0)."""
        return self._every(self.val_every_steps) or self.done

    @property
    def is_ckpt_step(self) -> bool:
        """Every ``ckpt_every_steps`` and after the last step (only then when it is null/0)."""
        return self._every(self.ckpt_every_steps) or self.done

    # -- data ------------------------------------------------------------------------------
    def train_batches(
        self, make_loader: Callable[[MicroBatchSampler], Any], num_samples: int,
        dp_rank: int = 0,
    ) -> Iterator[list[Any]]:
        """Yields, from the current position, one list of ``grad_acc_steps`` micro-batches per
        step; ``make_loader(batch_sampler)`` turns a sampler into an iterable of batches."""
        if num_samples != self.num_train_samples:
            raise ValueError(
                f"training set has {num_samples} samples, the step scheduler was built for "
                f"{self.num_train_samples}"
            )
        if not self.steps_per_epoch:
            raise ValueError("StepScheduler.train_batches needs num_train_samples")
        while True:
            epoch, start = self.epoch, self.step_in_epoch
            sampler = MicroBatchSampler(
                num_samples, self.micro_batch_size, self.grad_acc_steps, dp_rank, self.dp_size,
                epoch=epoch, start_step=start, seed=self.seed, shuffle=self.shuffle,
                drop_last=self.drop_last,
            )
            it = iter(make_loader(sampler))
            for _ in range(start, sampler.steps_per_epoch):
                yield [next(it) for _ in range(self.grad_acc_steps)]

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "consumed_samples": self.consumed_samples,
            "skipped_steps": self.skipped_steps,
            "global_batch_size": self.global_batch_size,
            "num_train_samples": self.num_train_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("global_batch_size", "num_train_samples", "seed", "shuffle", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"the checkpoint was written with {key}={state[key]!r} but this run has "
                    f"{key}={getattr(self, key)!r}; resuming would change the data order. Use the "
                    "checkpoint's value or start a new run (checkpoint.resume: null)"
                )
        self.step = int(state["step"])
        self.consumed_samples = int(state["consumed_samples"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
