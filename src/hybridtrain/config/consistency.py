"""Settings that fit their types but contradict each other, said when the recipe is loaded.

    warnings = contradictions(root, where)   # [(message), ...]; loader.build_config logs them

Each rule names the keys involved, where they were set, what the run would do and what to change.
They are warnings: the run is possible, only not what the keys suggest. (Contradictions that make
a run impossible are errors where they are found, e.g. a global batch that the micro-batches and
data-parallel ranks cannot divide.)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

__all__ = ["contradictions", "warn_contradictions"]

logger = logging.getLogger("hybridtrain.config")
_warned: set[str] = set()  # a recipe is loaded more than once per process (e.g. Policy, reference)


def _plain(section: Any) -> dict | None:
    """A fixed section given as keys (not as a ``_target_`` mapping), else None."""
    return section if isinstance(section, dict) and "_target_" not in section else None


def contradictions(root: dict[str, Any], where: Callable[[tuple], str]) -> list[str]:
    """The contradictions of a validated recipe ``root``; ``where(path)``: where a key was set."""
    out = []
    t, lr, opt = root["training"], _plain(root["lr_scheduler"]), _plain(root["optimizer"])
    steps = t["max_steps"]
    if lr and steps and lr["lr_warmup_steps"] >= steps:
        out.append(
            f"lr_scheduler.lr_warmup_steps={lr['lr_warmup_steps']} "
            f"({where(('lr_scheduler', 'lr_warmup_steps'))}) is not shorter than "
            f"training.max_steps={steps} ({where(('training', 'max_steps'))}): the learning rate "
            "is still warming up when the run ends and never reaches optimizer.lr; shorten the "
            "warmup or train longer")
    if root.get("validation_dataset") and steps and (t["val_every_steps"] or 0) > steps:
        out.append(
            f"training.val_every_steps={t['val_every_steps']} "
            f"({where(('training', 'val_every_steps'))}) is more than training.max_steps={steps}: "
            "validation runs only before the first step and after the last")
    if lr and opt and lr["lr_decay_style"] != "constant" and lr["min_lr"] > opt["lr"]:
        out.append(
            f"lr_scheduler.min_lr={lr['min_lr']} ({where(('lr_scheduler', 'min_lr'))}) is above "
            f"optimizer.lr={opt['lr']}: the '{lr['lr_decay_style']}' decay raises the learning "
            "rate instead of lowering it")
    data, pack = root.get("dataset"), root["packing"]
    seq = data.get("seq_length") if isinstance(data, dict) else None
    if pack["enabled"] and isinstance(seq, int) and seq > pack["pack_size"]:
        out.append(
            f"dataset.seq_length={seq} ({where(('dataset', 'seq_length'))}) is longer than "
            f"packing.pack_size={pack['pack_size']} ({where(('packing', 'pack_size'))}): an "
            "example longer than a pack cannot be packed and stops the run once the data is "
            "tokenized; set packing.pack_size >= dataset.seq_length")
    return out


def warn_contradictions(root: dict[str, Any], where: Callable[[tuple], str]) -> None:
    """Logs each contradiction once per process, on the first rank only."""
    if os.environ.get("RANK", "0") != "0":
        return
    for message in contradictions(root, where):
        if message not in _warned:
            _warned.add(message)
            logger.warning("recipe: %s", message)
