"""Learning-rate schedules: one pure function of the position (optimizer steps or samples).

Styles (``lr_scheduler.lr_decay_style``)
    constant   warmup, then ``lr``
    linear     warmup, then linear decay from ``lr`` to ``min_lr`` at ``decay_steps``
    cosine     warmup, then half-cosine decay from ``lr`` to ``min_lr`` at ``decay_steps``
    wsd        warmup-stable-decay: warmup, ``lr`` until ``decay_steps - wsd_decay_steps``,
               then ``wsd_decay_style`` (linear | cosine | minus_sqrt) down to ``min_lr``;
               ``wsd_decay_steps`` defaults to 10 % of ``decay_steps``

Positions are 0-based: ``x`` = optimizer updates (or samples) already applied before this update.
Warmup is linear from ``init_lr`` and reaches ``lr`` on the last warmup update
(``x = warmup - 1``); decay progress is ``(x - warmup) / (decay_steps - warmup)``, so ``lr`` holds
at ``x = warmup`` and ``min_lr`` is reached at ``x = decay_steps`` and kept after it.

``LRScheduler`` applies that function to an optimizer. It counts only the updates actually applied
(a skipped, non-finite step does not call ``step()``), and is ``state_dict``-able.
"""

from __future__ import annotations

import logging
import math
from typing import Any

logger = logging.getLogger(__name__)

STYLES = ("constant", "linear", "cosine", "wsd")
DECAY_STYLES = ("linear", "cosine", "minus_sqrt")


def _decay(style: str, progress: float) -> float:
    """Multiplier in [0, 1] going from 1 (progress 0) to 0 (progress 1)."""
    progress = min(max(progress, 0.0), 1.0)
    if style == "linear":
        return 1.0 - progress
    if style == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(progress)
    raise ValueError(f"unknown decay style {style!r}; expected one of {DECAY_STYLES}")


def lr_at(
    x: float,
    *,
    lr: float,
    style: str = "cosine",
    min_lr: float = 0.0,
    init_lr: float = 0.0,
    warmup: float = 0,
    decay_steps: float | None = None,
    wsd_decay_steps: float | None = None,
    wsd_decay_style: str = "linear",
) -> float:
    """Learning rate at position ``x`` (see module docstring); lengths share ``x``'s unit."""
    if warmup > 0 and x < warmup:
        return init_lr + (lr - init_lr) * (x + 1) / warmup
    if style == "constant":
        return lr
    if decay_steps is None:
        raise ValueError(f"lr style {style!r} needs decay_steps")
    if style in ("linear", "cosine"):
        span = max(decay_steps - warmup, 1)
        return min_lr + (lr - min_lr) * _decay(style, (x - warmup) / span)
    if style == "wsd":
        if wsd_decay_steps is None:
            raise ValueError("lr style 'wsd' needs wsd_decay_steps")
        start = decay_steps - wsd_decay_steps
        if x < start:
            return lr
        return min_lr + (lr - min_lr) * _decay(wsd_decay_style, (x - start) / max(wsd_decay_steps, 1))
    raise ValueError(f"unknown lr style {style!r}; expected one of {STYLES}")


class LRScheduler:
    """Sets ``lr`` on every param group of ``optimizer`` from :func:`lr_at`.

    Takes the ``lr_scheduler`` recipe section's keys. Lengths are in optimizer steps
    (``lr_warmup_steps``, ``lr_decay_steps``, ``lr_wsd_decay_steps``) or, when any ``*_samples``
    key is set, in samples (``lr_warmup_samples``, ``lr_decay_samples``,
    ``lr_wsd_decay_samples``). The decay length defaults to the run length (``total_steps`` /
    ``total_samples``, given by the recipe); the WSD decay phase to 10 % of it. The peak ``lr``
    defaults to the optimizer's. A param group's ``lr_mult`` (if any) scales its lr.
    ``optimizer`` None (a rank with nothing to train): the schedule only counts (give ``lr``).
    """

    def __init__(
        self,
        optimizer,
        lr_decay_style: str = "constant",
        lr_warmup_steps: int = 0,
        lr_warmup_samples: int | None = None,
        lr_decay_steps: int | None = None,
        lr_decay_samples: int | None = None,
        lr_wsd_decay_style: str = "linear",
        lr_wsd_decay_steps: int | None = None,
        lr_wsd_decay_samples: int | None = None,
        init_lr: float = 0.0,
        min_lr: float = 0.0,
        lr: float | None = None,
        total_steps: int | None = None,
        total_samples: int | None = None,
    ):
        style = lr_decay_style
        if optimizer is None and lr is None:
            raise ValueError("lr_scheduler: this rank has no optimizer (nothing trainable on it, "
                             "e.g. a frozen module on its own ranks) and no lr to follow; set "
                             "lr_scheduler.lr (or the optimizer section's lr)")
        if style not in STYLES:
            raise ValueError(f"lr_scheduler.lr_decay_style={style!r} is not one of {STYLES}")
        if lr_wsd_decay_style not in DECAY_STYLES:
            raise ValueError(f"lr_scheduler.lr_wsd_decay_style={lr_wsd_decay_style!r} is not "
                             f"one of {DECAY_STYLES}")
        sample_keys = {"lr_warmup_samples": lr_warmup_samples, "lr_decay_samples": lr_decay_samples,
                       "lr_wsd_decay_samples": lr_wsd_decay_samples}
        units = "samples" if any(v is not None for v in sample_keys.values()) else "steps"
        if units == "samples":
            mixed = [k for k, v in (("lr_warmup_steps", lr_warmup_steps or None),
                                    ("lr_decay_steps", lr_decay_steps),
                                    ("lr_wsd_decay_steps", lr_wsd_decay_steps)) if v is not None]
            if mixed:
                raise ValueError(
                    f"lr_scheduler: {', '.join(mixed)} mixed with *_samples keys; give all "
                    "lengths in steps or all in samples"
                )
            warmup, length, wsd = lr_warmup_samples, lr_decay_samples, lr_wsd_decay_samples
            implicit = length is None
            length = length if length is not None else total_samples
        else:
            warmup, length, wsd = lr_warmup_steps, lr_decay_steps, lr_wsd_decay_steps
            implicit = length is None
            length = length if length is not None else total_steps
        warmup = int(warmup or 0)
        if warmup < 0:
            raise ValueError(f"lr_scheduler: warmup must be >= 0, got {warmup}")
        if style != "constant" and length is None:
            raise ValueError(f"lr_scheduler.lr_decay_style={style!r} needs lr_decay_{units} "
                             "or a known run length")
        if style == "wsd" and wsd is None:
            wsd = max(int(round(0.1 * length)), 1)
        if length is not None and style != "constant" and warmup > length and implicit:
            logger.warning("lr_scheduler: the run is %d %s long, shorter than lr_warmup_%s=%d; "
                           "warming up over the whole run", length, units, units, warmup)
            warmup = int(length)
        if length is not None and style != "constant" and warmup > length:
            raise ValueError(
                f"lr_scheduler: warmup ({warmup} {units}) is longer than the decay length "
                f"({length} {units}); shorten lr_warmup_{units} or lengthen lr_decay_{units}"
            )
        if style == "wsd" and wsd > length - warmup:
            raise ValueError(
                f"lr_scheduler: lr_wsd_decay_{units}={wsd} does not fit after a warmup of "
                f"{warmup} within a decay length of {length} {units}"
            )
        self.optimizer = optimizer
        self.style = style
        self.units = units
        self.base_lr = float(lr if lr is not None else optimizer.param_groups[0]["lr"])
        self.min_lr = float(min_lr)
        self.init_lr = float(init_lr)
        self.warmup = warmup
        self.decay_length = length
        self.wsd_decay_length = wsd
        self.wsd_decay_style = lr_wsd_decay_style
        for group in self._groups():
            group.setdefault("lr_mult", 1.0)
        self.num_steps = 0  # optimizer updates applied
        self.num_samples = 0  # samples of the applied updates
        self._apply()

    def position(self) -> int:
        return self.num_steps if self.units == "steps" else self.num_samples

    def lr_at(self, x: float) -> float:
        return lr_at(
            x, lr=self.base_lr, style=self.style, min_lr=self.min_lr, init_lr=self.init_lr,
            warmup=self.warmup, decay_steps=self.decay_length,
            wsd_decay_steps=self.wsd_decay_length, wsd_decay_style=self.wsd_decay_style,
        )

    def get_lr(self) -> float:
        """The lr the next optimizer update uses."""
        return self.lr_at(self.position())

    def _apply(self) -> None:
        lr = self.get_lr()
        for group in self._groups():
            group["lr"] = lr * group["lr_mult"]

    def _groups(self) -> list[dict]:
        return self.optimizer.param_groups if self.optimizer is not None else []

    def step(self, num_samples: int = 0) -> None:
        """Call after an applied optimizer update (never after a skipped one)."""
        self.num_steps += 1
        self.num_samples += int(num_samples)
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {"num_steps": self.num_steps, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_steps = int(state["num_steps"])
        self.num_samples = int(state["num_samples"])
        self._apply()
