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

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import math

import torch

from hybridtrain.ops import triton_interpret
from hybridtrain.ops.backend import auto_chunk_size

__all__ = ["linear_cross_entropy", "chunk_budget", "problem", "describe"]


# the positional arguments :func:`linear_cross_entropy` passes (``LigerFusedLinearCrossEntropyFunction
# .forward`` after ``ctx``; releases before chunk_mem_const take fewer: a TypeError at the first loss)
POSITIONAL = ("_input", "weight", "target", "bias", "ce_weight", "ignore_index", "lse_square_scale",
              "label_smoothing", "reduction", "softcap", "return_z_loss", "accum_dtype", "use_token_scaling",
              "return_token_accuracy", "return_predicted_tokens", "ce_impl", "ce_mode", "chunk_mem_const")
FIX = "pip install 'liger-kernel>=0.8.5' (extra hybridtrain[cuda])"


@functools.cache
def _function():
    triton_interpret.activate()  # (only under TRITON_INTERPRET=1 without a GPU)
    return importlib.import_module("liger_kernel.ops.fused_linear_cross_entropy").LigerFusedLinearCrossEntropyFunction


def version() -> str | None:
    try:
        return importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return None


def signature_problem(forward) -> str | None:
    """Why ``forward`` (a ``LigerFusedLinearCrossEntropyFunction.forward``) cannot take the call
    :func:`linear_cross_entropy` makes, or None."""
    names = [p.name for p in inspect.signature(forward).parameters.values()][1:]  # (after ctx)
    if tuple(names[:len(POSITIONAL)]) != POSITIONAL:
        return (f"its LigerFusedLinearCrossEntropyFunction takes ({', '.join(names)}), not the "
                f"({', '.join(POSITIONAL)}) hybridtrain calls")
    return None


@functools.cache
def problem() -> str | None:
    """Why Liger's fused linear cross-entropy cannot be used here (not installed, does not
    import, or a release whose signature differs from the call), with the fix; None if it can."""
    if importlib.util.find_spec("liger_kernel") is None:
        return f"liger-kernel is not installed; {FIX}"
    try:
        fn = _function()
    except Exception as e:  # ImportError, a broken triton
        return f"liger-kernel {version()} does not import ({type(e).__name__}: {e}); {FIX}"
    why = signature_problem(fn.forward)
    return None if why is None else f"liger-kernel {version()}: {why}; {FIX}"


def describe() -> str:
    return f"liger-kernel {version()} LigerFusedLinearCrossEntropyFunction (Triton)"


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
        out = _function().apply(hidden.to(dtype), weight.to(dtype), labels, None, None, ignore_index, 0.0, 0.0,
                                reduction, None, False, torch.float32, False, False, False, None, None,
                                chunk_budget(n, h, weight.shape[0]))
    return out[0]
