"""Liger-Kernel's fused linear cross-entropy (``liger_kernel``, extra ``hybridtrain[cuda]``)
behind the loss of :mod:`hybridtrain.ops.loss`, which alone decides when to call it
(``training.fused_loss``, see :mod:`hybridtrain.ops.backend`).

Liger walks the tokens in chunks; per chunk one Triton kernel reads the matmul's logits, forms
the log-sum-exp, the loss and the logit gradient in place (the fp32 softmax never reaches
memory), and two GEMMs take the gradient to the hidden states and to the weight (summed in fp32
with ``addmm(out_dtype=float32)`` on CUDA). ``reduction="sum"`` forms the gradients in forward
(as ``cross_entropy_sum(recompute=False)``); ``"none"`` (per-token losses, for log-probs)
recomputes them in backward with the incoming per-token gradient folded in.
"""

from __future__ import annotations

import math

import torch

from hybridtrain.ops.backend import auto_chunk_size
from hybridtrain.ops.liger_loader import fused_function

__all__ = ["linear_cross_entropy", "chunk_budget"]


def chunk_budget(tokens: int, hidden_size: int, vocab_size: int) -> int:
    """Liger's ``chunk_mem_const`` for chunks of about :func:`auto_chunk_size` tokens on CUDA
    (Liger's own default, 1, bounds a chunk's logits to ``tokens x hidden`` values: 256-token
    chunks at a 131k vocabulary, and the fp32 weight gradient is read and written once per
    chunk, 2.8 GB each time for a 131k x 2688 head)."""
    target = auto_chunk_size(vocab_size, "cuda")
    return max(1, math.ceil(vocab_size * target / (hidden_size * max(tokens, 1))))


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                         dtype: torch.dtype, reduction: str) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T, labels)`` with the matmuls in ``dtype``: the fp32 sum
    over label tokens (``reduction="sum"``) or the fp32 loss per token, 0 at ignored ones
    (``"none"``). hidden [N, H], weight [V, H], labels [N]; gradients flow to both in their
    dtypes."""
    n, h = hidden.shape
    with torch.autocast(hidden.device.type, enabled=False):
        # (positional: autograd.Function.apply takes no keywords) bias, ce_weight, ignore_index,
        # lse_square_scale, label_smoothing, reduction, softcap, return_z_loss, accum_dtype,
        # use_token_scaling, return_token_accuracy, return_predicted_tokens, ce_impl, ce_mode,
        # chunk_mem_const
        out = fused_function().apply(hidden.to(dtype), weight.to(dtype), labels, None, None, ignore_index, 0.0, 0.0,
                                reduction, None, False, torch.float32, False, False, False, None, None,
                                chunk_budget(n, h, weight.shape[0]))
    return out[0]
