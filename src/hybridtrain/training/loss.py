"""Linear cross-entropy: the LM head and the token cross-entropy in one step.

With a 131k vocabulary the ``[tokens, vocab]`` logits are the largest tensor of a training step
(8k tokens x 131k x 4 bytes = 4 GiB in fp32). :func:`cross_entropy_sum` never builds them whole:
it walks the tokens in chunks, keeps one fp32 log-sum-exp per token in forward and recomputes each
chunk's logits in backward to form the gradients of the hidden states and of the head weight.

Precision (issue 7): the matmul runs in the input dtype (bf16 on GPU / bf16-capable CPUs); the
logits are then taken to fp32 and every softmax, log-sum-exp and the loss sum are fp32. The
weight gradient is accumulated over chunks in fp32 and returned in the weight's dtype.

Labels are aligned with ``hidden`` (the caller shifts them for next-token prediction); positions
equal to ``ignore_index`` contribute nothing. The result is the fp32 SUM over label tokens:
the caller divides by the number of label tokens of the (global) batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_SIZE = 4096


def cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Sum over tokens of ``cross_entropy(hidden @ weight.T, labels)``, as an fp32 scalar.

    hidden: ``[N, H]`` or ``[B, L, H]``; weight: ``[V, H]`` (the LM head); labels: ``[N]`` or
    ``[B, L]`` integer class ids or ``ignore_index``. ``chunk_size`` tokens are processed at a
    time (``None`` computes the full logits, the plain reference). Gradients come back in the
    dtypes of ``hidden`` and ``weight``.
    """
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"cross_entropy_sum: hidden size {hidden.shape[-1]} of `hidden` {tuple(hidden.shape)} does not "
            f"match the LM head weight {tuple(weight.shape)} (expected [vocab, {hidden.shape[-1]}])"
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"cross_entropy_sum: labels {tuple(labels.shape)} must have the shape of hidden without its last "
            f"dimension, {tuple(hidden.shape[:-1])}"
        )
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"cross_entropy_sum: chunk_size must be a positive int or None, got {chunk_size}")
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if chunk_size is None:
        logits = (hidden @ weight.t()).float()
        return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk_size, ignore_index)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The matmul dtype: autocast's when autocast is on (as for ``hidden @ weight.t()``), else the
    promoted input dtype."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    # Autocast is switched off inside and the compute dtype chosen once in forward, so that the
    # logits recomputed in backward (where autocast is not active) are bit-identical to forward's.

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, ignore_index):
        dtype = _compute_dtype(hidden, weight)
        n = hidden.shape[0]
        valid = labels != ignore_index
        # Index 0 stands in for ignored positions; their terms are masked out.
        safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for start in range(0, n, chunk_size):
                end = min(start + chunk_size, n)
                logits = (hidden[start:end].to(dtype) @ w.t()).float()
                chunk_lse = torch.logsumexp(logits, dim=-1)
                target = logits.gather(1, safe_labels[start:end, None]).squeeze(1)
                lse[start:end] = chunk_lse
                total += torch.where(valid[start:end], chunk_lse - target, 0.0).sum()
                del logits
        ctx.save_for_backward(hidden, weight, safe_labels, valid, lse)
        ctx.chunk_size = chunk_size
        ctx.dtype = dtype
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total):
        hidden, weight, safe_labels, valid, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype, chunk_size, n = ctx.dtype, ctx.chunk_size, hidden.shape[0]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # The weight gradient is summed over chunks in fp32 (bf16 partial sums would lose bits).
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        scale = grad_total.float()
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for start in range(0, n, chunk_size):
                end = min(start + chunk_size, n)
                h = hidden[start:end].to(dtype)
                # d(lse - logit[label]) / d logits = softmax - onehot(label); zero on ignored rows.
                g = (h @ w.t()).float()
                g.sub_(lse[start:end, None]).exp_()
                rows = torch.arange(end - start, device=g.device)
                g[rows, safe_labels[start:end]] -= 1.0
                g.mul_(torch.where(valid[start:end], scale, 0.0)[:, None])
                g = g.to(dtype)
                if need_hidden:
                    grad_hidden[start:end] = g @ w
                if need_weight:
                    if dtype == torch.float32:
                        # (the out= form, not addmm_, so FlopCounterMode sees the matmul)
                        torch.addmm(grad_weight, g.t(), h, out=grad_weight)
                    else:
                        grad_weight += (g.t() @ h).float()
                del g
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None
