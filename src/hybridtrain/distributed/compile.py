"""``training.compile``: ``torch.compile`` each block of a model, in place."""

from __future__ import annotations

from torch import nn


def apply_compile(layers: nn.ModuleDict) -> None:
    """Compile every block (``nn.Module.compile``: the module and its parameter names stay)."""
    for block in layers.values():
        block.compile()
