"""Linear cross-entropy and per-token log-probabilities: the LM head and the token losses in one
step, from the final hidden states and the head's weight.

With a 131k vocabulary the ``[tokens, vocab]`` logits are the largest tensor of a training step
(8k tokens x 131k x 4 bytes = 4 GiB in fp32). The chunked functions never build them whole:
they walk the tokens in chunks of ``chunk_size`` and, per chunk, form the logits, their fp32
log-sum-exp and the loss terms (and the chunk's share of the gradients of the hidden states and
of the head weight). Tokens whose label is ``ignore_index`` (an SFT prompt) get no logits at all:
their gradient is zero, so only the label tokens go through the head.

* :class:`LinearCrossEntropy` -- the module a model holds: ``forward(hidden, head, labels)``.
* :func:`cross_entropy_sum` -- the fp32 SUM of the token cross-entropies over label tokens (the
  trainer divides by the label-token count of the global batch).
* :func:`token_logprobs` -- ``log p(label | position)`` per token (0 at ignored positions),
  differentiable (RL losses).
* :func:`topk_logits` -- the ``k`` largest logits per token and their vocabulary ids (no gradient).

Precision: the matmul runs in the input dtype (or autocast's); the logits are then taken to fp32
and every softmax, log-sum-exp and sum is fp32 (fp64 for fp64 inputs, for gradcheck). The weight
gradient is accumulated over chunks in fp32 and returned in the weight's dtype.

Labels are aligned with ``hidden`` (the caller shifts them for next-token prediction).

Implementation (``training.fused_loss``, read from ``ops.backend.settings()`` in one place,
:func:`_implementation`): ``torch``, the chunk loop below (CPU default; fp32 bit-identical to
earlier runs); ``compiled``, the same loop with its chunk functions under ``torch.compile`` (on
CUDA the softmax and the logit gradient fuse after the matmul: no fp32 chunk in memory);
``liger``, Liger-Kernel's fused linear cross-entropy (:mod:`hybridtrain.ops.liger`; per-token
log-probs too; ``recompute=True`` takes the compiled chunks, Liger holds its gradients from
forward). A vocab-parallel head always takes the torch loop.

Vocab-parallel head: when the weight is a DTensor sharded over the vocabulary (``Shard(0)`` on a
1-D tensor-parallel mesh), each rank forms only its vocabulary slice of every chunk's logits; the
row maximum and then the sum of exponentials and the label's logit are all-reduced over the
mesh's group (two all-reduces per chunk), so no rank ever holds full logits. The hidden-state
gradient is summed over the group once; the weight gradient stays with the rank's shard.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybridtrain.ops import backend, liger
from hybridtrain.ops.backend import auto_chunk_size, pad_rows, unpad_rows
from hybridtrain.ops.base2 import LOG2E
from hybridtrain.ops.labels import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "DEFAULT_CHUNK_SIZE", "LinearCrossEntropy", "cross_entropy_sum", "token_logprobs",
           "topk_logits", "vocab_shard"]

DEFAULT_CHUNK_SIZE = "auto"


class LinearCrossEntropy(nn.Module):
    """Cross-entropy of ``head(hidden)`` against ``labels``, chunked (see :func:`cross_entropy_sum`).

    ``forward(hidden, head, labels)`` -> fp32 scalar: the sum over label tokens
    (``reduction="sum"``) or that sum over the number of label tokens, at least 1 (``"mean"``).
    ``head`` is the LM head (an ``nn.Linear`` without bias; its ``weight`` is read).
    ``token_logprobs(hidden, head, labels)``: :func:`token_logprobs` through the same head.
    """

    def __init__(self, chunk_size: int | str | None = DEFAULT_CHUNK_SIZE, reduction: str = "sum",
                 ignore_index: int = IGNORE_INDEX, recompute: bool = False):
        super().__init__()
        if reduction not in ("sum", "mean"):
            raise ValueError(f"LinearCrossEntropy: reduction must be 'sum' or 'mean', got {reduction!r}")
        _check_chunk_size(chunk_size)
        self.chunk_size, self.reduction, self.ignore_index, self.recompute = (
            chunk_size, reduction, ignore_index, recompute)

    def forward(self, hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor) -> torch.Tensor:
        loss = cross_entropy_sum(hidden, _head_weight(head), labels, self.chunk_size, self.ignore_index,
                                 self.recompute)
        if self.reduction == "mean":
            loss = loss / (labels != self.ignore_index).sum().clamp(min=1)
        return loss

    def token_logprobs(self, hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor) -> torch.Tensor:
        return token_logprobs(hidden, _head_weight(head), labels, self.chunk_size, self.ignore_index)

    def extra_repr(self) -> str:
        return (f"chunk_size={self.chunk_size!r}, reduction={self.reduction!r}, "
                f"ignore_index={self.ignore_index}, recompute={self.recompute}")


def _head_weight(head: nn.Module) -> torch.Tensor:
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"LinearCrossEntropy: the head {type(head).__name__} has a bias; the linear "
                         "cross-entropy takes a head without bias (nn.Linear(..., bias=False))")
    return head.weight


def cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | str | None = DEFAULT_CHUNK_SIZE,
    ignore_index: int = IGNORE_INDEX,
    recompute: bool = False,
) -> torch.Tensor:
    """Sum over tokens of ``cross_entropy(hidden @ weight.T, labels)``, as an fp32 scalar.

    hidden: ``[N, H]`` or ``[B, L, H]``; weight: ``[V, H]`` (the LM head); labels: ``[N]`` or
    ``[B, L]`` integer class ids or ``ignore_index``. ``chunk_size`` tokens are processed at a
    time (``"auto"``: :func:`~hybridtrain.ops.backend.auto_chunk_size`; ``None`` computes the
    full logits, the plain reference). Gradients come back in the dtypes of ``hidden`` and
    ``weight``. Two ways to get them:

    * ``recompute=False`` (default): the gradients are formed in forward from the chunk logits
      already at hand and held until backward scales them by the incoming gradient. Same peak
      memory when backward follows forward, one LM-head matmul less. Without autograd
      (``torch.no_grad()`` or inputs without ``requires_grad``) no gradient is formed.
    * ``recompute=True``: forward keeps one fp32 log-sum-exp per token and backward recomputes
      each chunk's logits (one more LM-head matmul; nothing but the inputs is held between
      forward and backward: for forwards that run long before their backwards, as in a GPipe
      pipeline schedule, and for more than one backward).
    """
    chunk_size = _resolve(hidden, weight, labels, chunk_size, "cross_entropy_sum")
    weight, tp = vocab_shard(weight)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if chunk_size is None and tp is None:
        logits = (hidden @ weight.t()).to(_acc_dtype(weight.dtype))
        return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    hidden, labels, _ = _label_rows(hidden, labels, ignore_index)
    chunk_size = chunk_size or max(hidden.shape[0], 1)  # a vocab-parallel head: one chunk
    impl = _implementation(tp, hidden)
    if impl == "liger" and not recompute:
        return liger.linear_cross_entropy(hidden, weight, labels, ignore_index, _compute_dtype(hidden, weight), "sum")
    vocab = _vocab(labels, ignore_index, tp, weight, compiled=impl != "torch")
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        with torch.no_grad():
            return _forward_pass(hidden, weight, chunk_size, _compute_dtype(hidden, weight), vocab)[0]
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, chunk_size, vocab, recompute)


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | str | None = DEFAULT_CHUNK_SIZE,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """``log_softmax(hidden @ weight.T)[label]`` per token: fp32 (fp64 for fp64 inputs), the
    shape of ``labels``, 0 where the label is ``ignore_index``. Differentiable w.r.t. ``hidden``
    and ``weight``: forward keeps one log-sum-exp per label token and backward recomputes each
    chunk's logits (as ``cross_entropy_sum(recompute=True)``). Shapes and ``chunk_size`` as
    :func:`cross_entropy_sum`."""
    chunk_size = _resolve(hidden, weight, labels, chunk_size, "token_logprobs")
    weight, tp = vocab_shard(weight)
    shape = labels.shape
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if chunk_size is None and tp is None:
        valid = labels != ignore_index
        logp = (hidden @ weight.t()).to(_acc_dtype(weight.dtype)).log_softmax(-1)
        picked = logp.gather(1, torch.where(valid, labels, 0)[:, None]).squeeze(1)
        return torch.where(valid, picked, 0.0).view(shape)
    n = labels.shape[0]
    rows, row_labels, idx = _label_rows(hidden, labels, ignore_index)
    chunk_size = chunk_size or max(rows.shape[0], 1)
    impl = _implementation(tp, rows)
    if impl == "liger":  # (Liger's per-token losses: lse - logit, 0 at ignored rows)
        logp = liger.linear_cross_entropy(rows, weight, row_labels, ignore_index, _compute_dtype(rows, weight),
                                          "none").neg()
    else:
        logp = _ChunkedTokenLogprobs.apply(rows, weight, chunk_size,
                                           _vocab(row_labels, ignore_index, tp, weight, compiled=impl != "torch"))
    logp = unpad_rows(logp, n if idx is None else idx.shape[0])
    if idx is not None:  # back to every position (ignored ones 0)
        logp = logp.new_zeros(n).index_copy(0, idx, logp)
    return logp.view(shape)


@torch.no_grad()
def topk_logits(hidden: torch.Tensor, weight: torch.Tensor, k: int,
                chunk_size: int | str | None = DEFAULT_CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of ``hidden @ weight.T`` per token, chunked: (fp32 values, int64 ids),
    each of shape ``hidden.shape[:-1] + (k,)``, largest first.

    A vocab-parallel head (see :func:`vocab_shard`): each rank takes the top-k of its vocabulary
    slice (ids shifted by the slice's offset), the ``k`` candidates per token are all-gathered
    over the tp group and the top-k of those taken again (``tp x k`` values per token, never the
    full logits)."""
    if not 0 < k <= weight.shape[0]:
        raise ValueError(f"topk_logits: k must be in 1..{weight.shape[0]} (the vocabulary), got {k}")
    chunk_size = _resolve(hidden, weight, hidden.new_zeros(hidden.shape[:-1]), chunk_size, "topk_logits")
    weight, tp = vocab_shard(weight)
    shape = hidden.shape[:-1] + (k,)
    flat = hidden.reshape(-1, hidden.shape[-1])
    step = chunk_size or max(flat.shape[0], 1)
    values, ids = [], []
    for start in range(0, flat.shape[0], step):
        logits = (flat[start:start + step] @ weight.t()).to(_acc_dtype(weight.dtype))
        v, i = logits.topk(min(k, weight.shape[0]), dim=-1)
        if tp is not None:
            v, i = _topk_over_group(v, i + tp[1], k, tp[0])
        values.append(v)
        ids.append(i)
    if not values:
        return hidden.new_zeros(shape, dtype=torch.float32), torch.zeros(shape, dtype=torch.long)
    return torch.cat(values).view(shape), torch.cat(ids).view(shape)


def _topk_over_group(values: torch.Tensor, ids: torch.Tensor, k: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` of every rank's candidates ``values``/``ids`` ``[N, <= k]`` (global ids);
    a shard with fewer than ``k`` rows pads with ``-inf``, which never wins (k <= vocabulary)."""
    pad = k - values.shape[1]
    if pad:
        values = torch.cat([values, values.new_full((values.shape[0], pad), -math.inf)], dim=1)
        ids = torch.cat([ids, ids.new_full((ids.shape[0], pad), -1)], dim=1)
    n = dist.get_world_size(group)
    all_v, all_i = [torch.empty_like(values) for _ in range(n)], [torch.empty_like(ids) for _ in range(n)]
    dist.all_gather(all_v, values.contiguous(), group=group)
    dist.all_gather(all_i, ids.contiguous(), group=group)
    v, pos = torch.cat(all_v, dim=1).topk(k, dim=-1)
    return v, torch.cat(all_i, dim=1).gather(1, pos)


def vocab_shard(weight: torch.Tensor) -> tuple[torch.Tensor, tuple | None]:
    """``(tensor to compute with, tp)``: a head weight that is a DTensor sharded over the
    vocabulary (``Shard(0)`` on a 1-D mesh) gives its local rows (differentiable) and ``tp =
    (process group, first vocabulary id of the local rows)``; a replicated DTensor its local
    copy and None; any other tensor itself and None."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(weight, DTensor):
        return weight, None
    mesh, placements = weight.device_mesh, tuple(weight.placements)
    if all(isinstance(p, Replicate) for p in placements):
        return weight.to_local(), None
    if mesh.ndim != 1 or placements != (Shard(0),):
        raise ValueError(f"the LM head weight is a DTensor placed {placements} on a {mesh.ndim}-D mesh; "
                         "the linear cross-entropy takes a head sharded over the vocabulary "
                         "(Shard(0) on the tensor-parallel mesh) or a replicated one")
    vocab, n = weight.shape[0], mesh.size()
    offset = min(mesh.get_local_rank() * math.ceil(vocab / n), vocab)  # torch.chunk's split
    local = weight.to_local()
    assert local.shape[0] == min(math.ceil(vocab / n), vocab - offset), (local.shape, vocab, n)
    return local, (mesh.get_group(), offset)


def _check_chunk_size(chunk_size) -> None:
    if chunk_size not in ("auto", None) and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
                                              or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive int, 'auto' or None, got {chunk_size!r}")


def _resolve(hidden, weight, labels, chunk_size, name):
    """Checks the shapes; returns the chunk size in tokens (None: full logits)."""
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"{name}: hidden size {hidden.shape[-1]} of `hidden` {tuple(hidden.shape)} does not "
            f"match the LM head weight {tuple(weight.shape)} (expected [vocab, {hidden.shape[-1]}])"
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"{name}: labels {tuple(labels.shape)} must have the shape of hidden without its last "
            f"dimension, {tuple(hidden.shape[:-1])}"
        )
    try:
        _check_chunk_size(chunk_size)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    return auto_chunk_size(weight.shape[0], hidden.device.type) if chunk_size == "auto" else chunk_size


def _label_rows(hidden, labels, ignore_index):
    """The rows with a label (``hidden`` [N, H], ``labels`` [N]), padded with ignored rows to
    the backend's GEMM row multiple (the label count changes every step), and the kept row
    indices (None: all rows kept).

    In SFT most positions (the prompt) carry ``ignore_index``: their rows are dropped here
    (index_select's backward puts zeros there); this syncs with the device once for the count."""
    keep = labels != ignore_index
    idx = None
    if not bool(keep.all()):
        idx = keep.nonzero().squeeze(1)
        hidden, labels = hidden.index_select(0, idx), labels.index_select(0, idx)
    return pad_rows(hidden), pad_rows(labels, ignore_index), idx


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The matmul dtype: autocast's when autocast is on (as for ``hidden @ weight.t()``), else the
    promoted input dtype."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax / sum dtype for matmuls in ``dtype``: fp32 (fp64 for fp64)."""
    return torch.promote_types(dtype, torch.float32)


# -- the chunk passes ----------------------------------------------------------------------------
# Three passes over the chunks, one per mode: ``_forward_pass`` (loss and log-sum-exp, no
# gradient), ``_fused_pass`` (forward with the gradients at unit scale, for
# ``recompute=False``), ``_recompute_pass`` (gradients from a saved log-sum-exp). Each takes the
# per-chunk math from a vocabulary object: :class:`_Vocab` (the whole vocabulary on this rank;
# its functions may be compiled: ``_compiled_chunk_fns``) or :class:`_VocabShard` (a
# vocab-parallel head: the reductions over the vocabulary are all-reduced).
# Softmax in base 2 (see ``ops.base2``): ``exp(x - m) = 2^(x log2(e) - m log2(e))``, one fused
# pass from the matmul output to the fp32 exponent, then exp2.

def _chunks(n: int, chunk_size: int):
    return ((start, min(start + chunk_size, n)) for start in range(0, n, chunk_size))


def _row_weights(ok: torch.Tensor, scale: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """d total / d row: ``scale`` (a scalar or one value per token) on label rows, else 0."""
    return torch.where(ok, scale if scale.dim() == 0 else scale[start:end], 0.0)


def _forward_pass(hidden, weight, chunk_size, dtype, vocab, token_out=None):
    """(fp32 sum over label rows of ``lse - logit[label]``, per-row fp32 log-sum-exp [N]);
    ``token_out`` ([N], written to): ``logit[label] - lse`` per row, 0 at ignored ones."""
    n, acc = hidden.shape[0], _acc_dtype(dtype)
    total = torch.zeros((), dtype=acc, device=hidden.device)
    lse = torch.empty(n, dtype=acc, device=hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        w = weight.to(dtype)
        for start, end in _chunks(n, chunk_size):
            chunk_lse, target = vocab.logsumexp(hidden[start:end].to(dtype), w, start, end)
            ok = vocab.valid[start:end]
            lse[start:end] = chunk_lse
            total += torch.where(ok, chunk_lse - target, 0.0).sum()
            if token_out is not None:
                token_out[start:end] = torch.where(ok, target - chunk_lse, 0.0)
    return total, lse


def _fused_pass(hidden, weight, chunk_size, dtype, vocab, need_hidden, need_weight):
    """(the loss sum as :func:`_forward_pass`, grad hidden or None, fp32 grad weight or None):
    the gradients of the sum, formed from each chunk's softmax while it is at hand."""
    n, acc = hidden.shape[0], _acc_dtype(dtype)
    total = torch.zeros((), dtype=acc, device=hidden.device)
    one = torch.ones((), dtype=acc, device=hidden.device)
    grads = _Grads(hidden, weight, dtype, need_hidden, need_weight)
    with torch.autocast(hidden.device.type, enabled=False):
        w = weight.to(dtype)
        for start, end in _chunks(n, chunk_size):
            h, ok = hidden[start:end].to(dtype), vocab.valid[start:end]
            chunk_lse, target, g = vocab.softmax_grad(h, w, start, end, _row_weights(ok, one, start, end))
            total += torch.where(ok, chunk_lse - target, 0.0).sum()
            grads.add(start, end, g, h, w)
    return (total,) + grads.result(vocab)


def _recompute_pass(hidden, weight, lse, scale, chunk_size, dtype, vocab, need_hidden, need_weight):
    """(grad hidden or None, fp32 grad weight or None) of ``sum_t scale_t (lse_t -
    logit_t[label_t])`` (``scale``: a scalar or one value per row), the chunk logits recomputed
    and shifted by the saved ``lse``."""
    grads = _Grads(hidden, weight, dtype, need_hidden, need_weight)
    with torch.autocast(hidden.device.type, enabled=False):
        w = weight.to(dtype)
        for start, end in _chunks(hidden.shape[0], chunk_size):
            h = hidden[start:end].to(dtype)
            weight_rows = _row_weights(vocab.valid[start:end], scale, start, end)
            grads.add(start, end, vocab.recomputed_grad(h, w, start, end, lse[start:end], weight_rows), h, w)
    return grads.result(vocab)


class _Grads:
    """The gradients of hidden ([N, H], written chunk by chunk) and of the head weight (the
    chunks' products summed in fp32: bf16 partial sums would lose bits) from each chunk's
    logit gradient ``g`` (in the matmul dtype)."""

    def __init__(self, hidden, weight, dtype, need_hidden: bool, need_weight: bool):
        self.hidden = torch.empty_like(hidden) if need_hidden else None
        self.need_weight, self.weight = need_weight, None
        self.dtype, self.acc, self.shape, self.device = dtype, _acc_dtype(dtype), weight.shape, weight.device

    def add(self, start: int, end: int, g: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> None:
        if self.hidden is not None:
            self.hidden[start:end] = g @ w
        if not self.need_weight:
            return
        if self.weight is None:  # the first chunk's product starts the fp32 sum
            self.weight = (g.t() @ h).to(self.acc)
        elif self.dtype == self.acc:  # (the out= form, not addmm_, so FlopCounterMode sees it)
            torch.addmm(self.weight, g.t(), h, out=self.weight)
        else:  # low-precision partial product, summed into the fp32 buffer
            self.weight.add_(g.t() @ h)

    def result(self, vocab) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.need_weight and self.weight is None:  # no rows at all
            self.weight = torch.zeros(self.shape, dtype=self.acc, device=self.device)
        if self.hidden is not None and self.hidden.shape[0]:
            vocab.reduce_grad_hidden(self.hidden)
        return self.hidden, self.weight


def _pick(logits: torch.Tensor, labels: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``logits[t, labels[t]]`` in ``acc``."""
    return logits[torch.arange(logits.shape[0], device=logits.device), labels].to(acc)


def _exp_shifted(logits, shift):
    """fp32 exp(logits - shift) as 2^(logits log2(e) - shift log2(e)): one pass to the exponent
    (in place for fp32 logits) and exp2. shift [rows, 1] fp32 (fp64 for fp64 logits). Under
    torch.compile the functional form, which the compiler fuses into one pass (written as a
    difference: inductor on CPU, torch 2.13, folds ``add(.., mm, alpha=)`` into a wrong addmm)."""
    if torch.compiler.is_compiling():
        return (logits.to(shift.dtype) * LOG2E - shift * LOG2E).exp2()
    out = logits if logits.dtype == shift.dtype else torch.empty(logits.shape, dtype=shift.dtype,
                                                                  device=logits.device)
    return torch.add(shift * -LOG2E, logits, alpha=LOG2E, out=out).exp2_()


def _logit_grad(e: torch.Tensor, scale: torch.Tensor, labels: torch.Tensor, weight_rows: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """``e * scale - weight_rows * onehot(labels)`` in ``dtype`` (e: the fp32 exponentials [c, V],
    scale [c, 1]): d(lse - logit[label]) / d logits is softmax - onehot(label). In e's memory
    when ``dtype`` is e's; else the product rounds to ``dtype`` as it is stored (one pass, no
    fp32 gradient beside its bf16 copy) and the label entries, formed in fp32 first, are rounded
    once: the values of a cast after."""
    rows = torch.arange(e.shape[0], device=e.device)
    if dtype == e.dtype or torch.compiler.is_compiling():  # (compiled: one fused pass anyway)
        g = e.mul_(scale)
        g[rows, labels] -= weight_rows
        return g.to(dtype)
    at_label = e[rows, labels] * scale[:, 0] - weight_rows
    g = torch.mul(e, scale, out=torch.empty(e.shape, dtype=dtype, device=e.device))
    g[rows, labels] = at_label.to(dtype)
    return g


# The per-chunk math of the whole vocabulary (h [c, H], w [V, H] in the matmul dtype; labels
# [c] valid ids, 0 standing in at ignored rows; weight_rows [c] zero there). Plain functions of
# tensors, so that ``_compiled_chunk_fns`` can compile them unchanged.
def chunk_logsumexp(h, w, labels):
    """(fp32 log-sum-exp [c], fp32 label logit [c]) of the chunk's logits ``h @ w.T``."""
    logits = h @ w.t()
    acc = _acc_dtype(logits.dtype)
    return torch.logsumexp(logits.to(acc), dim=-1), _pick(logits, labels, acc)


def chunk_softmax_grad(h, w, labels, weight_rows):
    """(log-sum-exp, label logit, d(sum_t weight_rows_t (lse_t - logit_t[label_t])) / d logits
    in the matmul dtype). The fp32 exponentials buffer becomes the gradient."""
    logits = h @ w.t()
    acc = _acc_dtype(logits.dtype)
    target = _pick(logits, labels, acc)  # before _exp_shifted, which may reuse the logits' memory
    m = logits.amax(dim=-1, keepdim=True).to(acc)
    e = _exp_shifted(logits, m)
    s = e.sum(dim=-1, keepdim=True)
    g = _logit_grad(e, weight_rows[:, None] / s, labels, weight_rows, h.dtype)
    return (m + s.log()).squeeze(1), target, g


def chunk_recomputed_grad(h, w, labels, lse, weight_rows):
    """The logit gradient of :func:`chunk_softmax_grad` from the saved log-sum-exp ``lse`` [c]."""
    return _logit_grad(_exp_shifted(h @ w.t(), lse[:, None]), weight_rows[:, None], labels, weight_rows, h.dtype)


class _Vocab:
    """The head's whole vocabulary on this rank: every reduction over it is local. ``fns``:
    the three chunk functions (eager, or ``_compiled_chunk_fns``)."""

    def __init__(self, labels: torch.Tensor, ignore_index: int, fns):
        self.valid = labels != ignore_index
        self.labels = torch.where(self.valid, labels, torch.zeros_like(labels))  # 0 stands in; masked
        self.fns = fns

    def logsumexp(self, h, w, start, end):
        return self.fns[0](h, w, self.labels[start:end])

    def softmax_grad(self, h, w, start, end, weight_rows):
        return self.fns[1](h, w, self.labels[start:end], weight_rows)

    def recomputed_grad(self, h, w, start, end, lse, weight_rows):
        return self.fns[2](h, w, self.labels[start:end], lse, weight_rows)

    def reduce_grad_hidden(self, grad_hidden) -> None:
        pass


class _VocabShard:
    """This rank's vocabulary slice of a vocab-parallel head (``tp = (group, offset)``, see
    :func:`vocab_shard`): the row maximum, then the exponential sums and the label logits (which
    only the label's owner forms) are all-reduced over the group, two all-reduces per chunk;
    the hidden-state gradient is summed over the group once."""

    def __init__(self, labels: torch.Tensor, ignore_index: int, tp: tuple, rows_held: int):
        self.group, offset = tp
        self.valid = labels != ignore_index
        shifted = labels - offset
        self.own = self.valid & (shifted >= 0) & (shifted < rows_held)  # labels whose logit is here
        self.labels = torch.where(self.own, shifted, torch.zeros_like(labels))

    def _softmax(self, h, w, start, end):
        """(exp(logits - max), the group's exp sums [c, 1], lse [c], label logits [c])."""
        logits = h @ w.t()
        acc = _acc_dtype(logits.dtype)
        target = torch.where(self.own[start:end], _pick(logits, self.labels[start:end], acc), 0.0)
        m = logits.amax(dim=-1, keepdim=True).to(acc)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=self.group)
        e = _exp_shifted(logits, m)
        both = torch.cat([e.sum(dim=-1, keepdim=True), target[:, None]], dim=1)
        dist.all_reduce(both, group=self.group)  # one all-reduce for the exp sums and label logits
        s, target = both[:, :1], both[:, 1]
        return e, s, (m + s.log()).squeeze(1), target

    def logsumexp(self, h, w, start, end):
        _, _, lse, target = self._softmax(h, w, start, end)
        return lse, target

    def softmax_grad(self, h, w, start, end, weight_rows):
        e, s, lse, target = self._softmax(h, w, start, end)
        return lse, target, self._own_logit_grad(e, weight_rows[:, None] / s, start, end, weight_rows, h.dtype)

    def recomputed_grad(self, h, w, start, end, lse, weight_rows):
        e = _exp_shifted(h @ w.t(), lse[:, None])
        return self._own_logit_grad(e, weight_rows[:, None], start, end, weight_rows, h.dtype)

    def _own_logit_grad(self, e, scale, start, end, weight_rows, dtype):
        own = self.own[start:end]
        return _logit_grad(e, scale, self.labels[start:end], torch.where(own, weight_rows, 0.0), dtype)

    def reduce_grad_hidden(self, grad_hidden) -> None:
        dist.all_reduce(grad_hidden, group=self.group)  # every rank's vocabulary slice


def _implementation(tp, rows: torch.Tensor) -> str:
    """The one dispatch point of the chunked functions: ``backend.settings().fused_loss``
    (``torch``, ``compiled`` or ``liger``, from ``training.fused_loss``). A vocab-parallel head
    takes the torch loop (its all-reduces sit between the chunk's reductions), and so does a
    batch without label rows (Liger divides by the row count)."""
    if tp is not None or rows.shape[0] == 0:
        return "torch"
    return backend.settings().fused_loss


def _vocab(labels, ignore_index, tp, weight, compiled=False):
    if tp is not None:
        return _VocabShard(labels, ignore_index, tp, weight.shape[0])
    return _Vocab(labels, ignore_index, _compiled_chunk_fns() if compiled else _EAGER_CHUNK_FNS)


_EAGER_CHUNK_FNS = (chunk_logsumexp, chunk_softmax_grad, chunk_recomputed_grad)


@functools.cache
def _compiled_chunk_fns():
    """The chunk functions under ``torch.compile`` (one graph each, shapes dynamic: the label
    count changes every step). On CUDA the softmax, the loss terms and the logit gradient fuse
    into one or two kernels after the matmul, so no fp32 ``[chunk, vocab]`` buffer is written;
    the first call of each compiles (seconds to a minute)."""
    return tuple(torch.compile(fn, fullgraph=True, dynamic=True) for fn in _EAGER_CHUNK_FNS)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy_sum`` of label rows. Autocast is switched off inside and the compute dtype
    chosen once in forward, so that the logits recomputed in backward (where autocast is not
    active) are bit-identical to forward's. The softmax runs in base 2 (``_exp_shifted``)."""

    @staticmethod
    def forward(ctx, hidden, weight, chunk_size, vocab, recompute):
        dtype = _compute_dtype(hidden, weight)
        ctx.args = (chunk_size, dtype, vocab)
        ctx.recompute = recompute
        if recompute:
            total, lse = _forward_pass(hidden, weight, chunk_size, dtype, vocab)
            ctx.save_for_backward(hidden, weight, lse)
            return total
        total, grad_hidden, grad_weight = _fused_pass(hidden, weight, chunk_size, dtype, vocab,
                                                      ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        ctx.grads = [grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype)]
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total):
        scale = grad_total.to(_acc_dtype(ctx.args[1]))
        if ctx.recompute:
            return _recomputed_grads(ctx, scale) + (None,) * 3
        if ctx.grads is None:
            raise RuntimeError(
                "cross_entropy_sum(recompute=False) gives its gradients to one backward only; "
                "use recompute=True to backward through it more than once (retain_graph)"
            )
        grads, ctx.grads = ctx.grads, None
        # scaled in place (by the fp32 scalar): these buffers were made for this backward
        return tuple(g.mul_(scale) if g is not None else None for g in grads) + (None,) * 3


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """``token_logprobs`` of label rows: forward keeps the per-token log-sum-exp; backward is the
    cross-entropy's recompute pass with one scale per token, ``-grad`` (``logp = -(lse - logit)``)."""

    @staticmethod
    def forward(ctx, hidden, weight, chunk_size, vocab):
        dtype = _compute_dtype(hidden, weight)
        logp = torch.empty(hidden.shape[0], dtype=_acc_dtype(dtype), device=hidden.device)
        _, lse = _forward_pass(hidden, weight, chunk_size, dtype, vocab, token_out=logp)
        ctx.args = (chunk_size, dtype, vocab)
        ctx.save_for_backward(hidden, weight, lse)
        return logp

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp):
        return _recomputed_grads(ctx, -grad_logp.to(_acc_dtype(ctx.args[1]))) + (None,) * 2


def _recomputed_grads(ctx, scale):
    """(grad hidden, grad weight) of ``sum_t scale_t (lse_t - logit_t[label_t])`` from the saved
    inputs and log-sum-exp, the chunk logits recomputed."""
    chunk_size, dtype, vocab = ctx.args
    hidden, weight, lse = ctx.saved_tensors
    grad_hidden, grad_weight = _recompute_pass(hidden, weight, lse, scale, chunk_size, dtype, vocab,
                                               ctx.needs_input_grad[0], ctx.needs_input_grad[1])
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    return grad_hidden, grad_weight
