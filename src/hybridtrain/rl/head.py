"""What a Policy's model returns: the model's ``loss`` slot (``forward(..., labels=)`` returns
``self.loss(hidden, head, labels)``, see ``models/spec.py``) filled with :class:`PolicyHead`, so
every layout (FSDP, EP, the last pipeline stage) runs the model's own forward and the head's
weight is read where the layout has gathered it."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from hybridtrain.ops.loss import LinearCrossEntropy, topk_logits

__all__ = ["PolicyHead"]


class PolicyHead(LinearCrossEntropy):
    """``forward(hidden, head, labels)`` -> per-token log-probs ``[B, L]`` fp32 (0 where the label
    is ignored), chunked over tokens (no ``[B, L, vocab]`` logits); inside :meth:`top_k` ->
    ``[B, L, 2k]`` fp32: the ``k`` largest logits, then their ids (exact as floats below 2^24)."""

    def __init__(self, chunk_size: int | str | None = "auto"):
        super().__init__(chunk_size=chunk_size, reduction="sum")
        self.k: int | None = None

    @contextlib.contextmanager
    def top_k(self, k: int):
        self.k = k
        try:
            yield
        finally:
            self.k = None

    def forward(self, hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor) -> torch.Tensor:
        if self.k is None:  # (a view of the token values: FSDP2 wants a model output of its own)
            return self.token_logprobs(hidden, head, labels).clone()
        assert head.weight.shape[0] < 2 ** 24, "vocabulary ids must be exact in fp32"
        values, ids = topk_logits(hidden, head.weight, self.k, self.chunk_size)
        return torch.cat([values, ids.float()], dim=-1)
