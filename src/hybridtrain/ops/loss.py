"""TEMPORARY shim until the loss module lands (replaced wholesale at merge)."""
from __future__ import annotations

import torch
from torch import nn


class LinearCrossEntropy(nn.Module):
    def __init__(self, chunk_size="auto", reduction="mean", ignore_index=-100, recompute=False):
        super().__init__()
        self.chunk_size, self.reduction = chunk_size, reduction
        self.ignore_index, self.recompute = ignore_index, recompute

    def forward(self, hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor) -> torch.Tensor:
        from hybridtrain.training.loss import cross_entropy_sum

        total = cross_entropy_sum(hidden, head.weight, labels, self.chunk_size, self.ignore_index,
                                  self.recompute)
        if self.reduction == "sum":
            return total
        return total / (labels != self.ignore_index).sum().clamp(min=1)
