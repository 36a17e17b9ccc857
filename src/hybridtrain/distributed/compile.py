"""``training.compile``: ``torch.compile`` each block of a model, in place."""

from __future__ import annotations

import torch
from torch import nn


def compile_enabled(setting: bool | str, device: torch.device | str) -> bool:
    """``training.compile`` on ``device``: true/false as given; ``auto`` -> on CUDA (blocks
    compile into one graph each: no host syncs inside them, also under TP and CP; under EP an
    MoE block into three, its all-to-all exchange running eagerly between), off on CPU (compiling costs more
    than it saves for the CPU's short runs, and eager is what the CPU tests check)."""
    if isinstance(setting, bool):
        return setting
    if str(setting).lower() != "auto":
        raise ValueError(f"training.compile: {setting!r} is not one of auto, true, false")
    return torch.device(device).type == "cuda"


def apply_compile(layers: nn.ModuleDict, setting: bool | str = True, device: torch.device | str = "cpu",
                  **options) -> None:
    """Compile every block (``nn.Module.compile``: the module and its parameter names stay)
    where :func:`compile_enabled` says so; ``options``: ``torch.compile``'s (none: its defaults;
    the tests pass ``backend="aot_eager", fullgraph=True``)."""
    if not compile_enabled(setting, device):
        return
    for block in layers.values():
        block.compile(**options)
