"""Linear cross-entropy: the LM head and the token cross-entropy in one step.

With a 131k vocabulary the ``[tokens, vocab]`` logits are the largest tensor of a training step
(8k tokens x 131k x 4 bytes = 4 GiB in fp32). :func:`cross_entropy_sum` never builds them whole:
it walks the tokens in chunks of ``chunk_size`` and, per chunk, forms the logits, their fp32
log-sum-exp and the loss terms, and the chunk's share of the gradients of the hidden states and
of the head weight. Tokens whose label is ``ignore_index`` (an SFT prompt) get no logits at all:
their gradient is zero, so only the label tokens go through the head. Two ways to get the
gradients:

* ``recompute=True``: forward keeps one fp32 log-sum-exp per token and backward recomputes each
  chunk's logits. Costs one more LM-head matmul per step; nothing but the inputs is held between
  forward and backward (use it where forwards run long before their backwards, as in a GPipe
  pipeline schedule).
* ``recompute=False`` (default): the gradients are formed in forward from the chunk logits
  already at hand and held until backward scales them by the incoming gradient. Same peak memory
  when backward follows forward (the buffers are the ones backward would allocate first), one
  LM-head matmul less. Without autograd (``torch.no_grad()`` or inputs without
  ``requires_grad``) no gradient is formed.

Precision (issue 7): the matmul runs in the input dtype (or autocast's); the logits are then taken
to fp32 and every softmax, log-sum-exp and the loss sum are fp32. The weight gradient is
accumulated over chunks in fp32 and returned in the weight's dtype.

Labels are aligned with ``hidden`` (the caller shifts them for next-token prediction); positions
equal to ``ignore_index`` contribute nothing. The result is the fp32 SUM over label tokens:
the caller divides by the number of label tokens of the (global) batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridtrain.models.nemotron_h.numerics import LOG2E, gemm_row_multiple

DEFAULT_CHUNK_SIZE = "auto"
AUTO_CHUNK_LOGITS = 1 << 25


def auto_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk for ``chunk_size="auto"``: about 2^25 logits (128 MiB in fp32) per chunk,
    a multiple of 64 tokens, at least 64. Large enough for full-speed GEMMs, small enough that
    the per-chunk buffers neither spill far out of cache nor churn the allocator: on the 2-core
    CPU, 16 x 512 tokens of the 48M MoE (vocabulary 32000) took 7-9 s per bf16 step with
    4096-token chunks (glibc returned the 0.5 GiB buffers and page-faulted them in again every
    step) and 5.3 s with 1024; at 4 x 512 tokens 1024 was as fast as 4096 with 10 % less memory."""
    return max(64, AUTO_CHUNK_LOGITS // max(vocab_size, 1) // 64 * 64)


def cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | str | None = DEFAULT_CHUNK_SIZE,
    ignore_index: int = -100,
    recompute: bool = False,
) -> torch.Tensor:
    """Sum over tokens of ``cross_entropy(hidden @ weight.T, labels)``, as an fp32 scalar.

    hidden: ``[N, H]`` or ``[B, L, H]``; weight: ``[V, H]`` (the LM head); labels: ``[N]`` or
    ``[B, L]`` integer class ids or ``ignore_index``. ``chunk_size`` tokens are processed at a
    time (``None`` computes the full logits, the plain reference). Gradients come back in the
    dtypes of ``hidden`` and ``weight``. ``recompute``: see the module docstring.
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
    if chunk_size == "auto":
        chunk_size = auto_chunk_size(weight.shape[0])
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"cross_entropy_sum: chunk_size must be a positive int, 'auto' or None, got {chunk_size!r}")
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if chunk_size is None:
        logits = (hidden @ weight.t()).float()
        return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    # Only label tokens need logits: in SFT most positions (the prompt) carry ignore_index. Their
    # rows are dropped here (index_select's backward puts zeros there); this syncs with the device
    # once for the count.
    keep = labels != ignore_index
    if not bool(keep.all()):
        idx = keep.nonzero().squeeze(1)
        hidden, labels = hidden.index_select(0, idx), labels.index_select(0, idx)
    # the label count changes every step: pad with ignored rows where the GEMM backend wants
    # fixed row multiples (CPU bf16, see gemm_row_multiple)
    pad = -hidden.shape[0] % gemm_row_multiple(hidden.device, _compute_dtype(hidden, weight))
    if pad:
        hidden = F.pad(hidden, (0, 0, 0, pad))
        labels = F.pad(labels, (0, pad), value=ignore_index)
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        with torch.no_grad():
            return _chunked(hidden, weight, labels, chunk_size, ignore_index, _compute_dtype(hidden, weight))[0]
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk_size, ignore_index, recompute)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The matmul dtype: autocast's when autocast is on (as for ``hidden @ weight.t()``), else the
    promoted input dtype."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _chunked(hidden, weight, labels, chunk_size, ignore_index, dtype, lse=None, grad_hidden=None, weight_grad=False,
             scale=None):
    """One pass over the chunks, with autocast off and the matmuls in ``dtype``.

    Returns ``(loss_sum, lse, grad_weight)``. When ``lse`` is given (a per-token fp32
    log-sum-exp from an earlier pass) the logits are not reduced again. When ``grad_hidden``
    ([N, H], written to) is given and/or ``weight_grad`` is set, the gradients of
    ``scale * loss_sum`` are formed; the weight's is summed over chunks in fp32 ([V, H], else None).

    Softmax in base 2: ``exp(x - m) = 2^(x log2(e) - m log2(e))``, one fused pass from the matmul
    output to the fp32 exponent, and exp2 (about 4x cheaper than exp in torch's CPU kernels).
    """
    n = hidden.shape[0]
    valid = labels != ignore_index
    safe_labels = torch.where(valid, labels, torch.zeros_like(labels))  # 0 stands in; masked below
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    out_lse = lse if lse is not None else torch.empty(n, dtype=torch.float32, device=hidden.device)
    want_grads = grad_hidden is not None or weight_grad
    grad_weight = None
    with torch.autocast(hidden.device.type, enabled=False):
        w = weight.to(dtype)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            h = hidden[start:end].to(dtype)
            y, ok = safe_labels[start:end], valid[start:end]
            logits = h @ w.t()
            rows = torch.arange(end - start, device=logits.device)
            weight_rows = torch.where(ok, scale, 0.0) if want_grads else None  # d total / d row
            if lse is None:
                target = logits[rows, y].float()
                if not want_grads:
                    chunk_lse = torch.logsumexp(logits.float(), dim=-1)
                else:
                    # e = exp(logits - max) in fp32 (the buffer becomes the gradient),
                    # lse = max + log(sum e), softmax = e / sum e
                    m = logits.amax(dim=-1, keepdim=True).float()
                    e = _exp_shifted(logits, m)
                    s = e.sum(dim=-1, keepdim=True)
                    chunk_lse = (m + s.log()).squeeze(1)
                    g = e.mul_(weight_rows[:, None] / s)
                out_lse[start:end] = chunk_lse
                total += torch.where(ok, chunk_lse - target, 0.0).sum()
            else:
                g = _exp_shifted(logits, lse[start:end, None]).mul_(weight_rows[:, None])
            if not want_grads:
                continue
            # d(lse - logit[label]) / d logits = softmax - onehot(label); zero on ignored rows.
            g[rows, y] -= weight_rows
            g = g.to(dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = g @ w
            if weight_grad:
                if grad_weight is None:  # the first chunk's product starts the fp32 sum
                    grad_weight = (g.t() @ h).float()
                elif dtype == torch.float32:  # (the out= form, not addmm_, so FlopCounterMode sees it)
                    torch.addmm(grad_weight, g.t(), h, out=grad_weight)
                else:  # bf16 partial product, summed into the fp32 buffer
                    grad_weight.add_(g.t() @ h)
            del g, logits
    if weight_grad and grad_weight is None:  # no rows at all
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    return total, out_lse, grad_weight


def _exp_shifted(logits, shift):
    """fp32 exp(logits - shift) as 2^(logits log2(e) - shift log2(e)): one pass to the exponent
    (in place for fp32 logits) and exp2. shift [rows, 1] fp32."""
    out = logits if logits.dtype == torch.float32 else torch.empty(logits.shape, dtype=torch.float32,
                                                                        device=logits.device)
    return torch.add(shift * -LOG2E, logits, alpha=LOG2E, out=out).exp2_()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    # Autocast is switched off inside and the compute dtype chosen once in forward, so that the
    # logits recomputed in backward (where autocast is not active) are bit-identical to forward's.

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, ignore_index, recompute):
        dtype = _compute_dtype(hidden, weight)
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.args = (chunk_size, ignore_index, dtype)
        ctx.recompute = recompute
        if recompute:
            total, lse, _ = _chunked(hidden, weight, labels, chunk_size, ignore_index, dtype)
            ctx.save_for_backward(hidden, weight, labels, lse)
            return total
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        one = torch.ones((), dtype=torch.float32, device=hidden.device)
        total, _, grad_weight = _chunked(hidden, weight, labels, chunk_size, ignore_index, dtype,
                                         grad_hidden=grad_hidden, weight_grad=need_weight, scale=one)
        ctx.grads = [grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype)]
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total):
        chunk_size, ignore_index, dtype = ctx.args
        scale = grad_total.float()
        if ctx.recompute:
            hidden, weight, labels, lse = ctx.saved_tensors
            need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            grad_hidden = torch.empty_like(hidden) if need_hidden else None
            # the weight gradient is summed over chunks in fp32 (bf16 partial sums would lose bits)
            _, _, grad_weight = _chunked(hidden, weight, labels, chunk_size, ignore_index, dtype, lse=lse,
                                         grad_hidden=grad_hidden, weight_grad=need_weight, scale=scale)
            if grad_weight is not None:
                grad_weight = grad_weight.to(weight.dtype)
            return grad_hidden, grad_weight, None, None, None, None
        if ctx.grads is None:
            raise RuntimeError(
                "cross_entropy_sum(recompute=False) gives its gradients to one backward only; "
                "use recompute=True to backward through it more than once (retain_graph)"
            )
        grads, ctx.grads = ctx.grads, None
        # scaled in place (by the fp32 scalar): these buffers were made for this backward
        return tuple(g.mul_(scale) if g is not None else None for g in grads) + (None,) * 4
