"""flash-attn's varlen attention over packed documents as a ``torch.library`` custom op
(``hybridtrain::flash_document_attention``): a fake implementation and a registered autograd, so a
compiled attention block stays one graph and runs flash-attn's kernels on packed rows, as the
Mamba kernels are reached (``models/nemotron_h/kernel_ops.py``).

::

    flash_varlen()                                   -> flash_attn_varlen_func, or None (eager)
    flash_ops()                                      -> flash-attn's own forward/backward ops, or None
    flash_document_attention(q, k, v, seq_idx)       -> [b, h, L, d] (through the custom op)

The op calls flash-attn's own ``torch.library`` ops, ``flashattn::_flash_attn_varlen_forward`` and
``_backward`` (flash-attn 2.7 and later register them): the forward returns the log-sum-exp the
backward kernel takes, and the fake implementation asks flash-attn's own fakes for its shapes.
Inside the op the document lengths are read on the host (flash-attn takes ``cu_seqlens`` and a
Python ``max_seqlen``): one small read per call, as the eager path makes, hidden from dynamo.
No dropout (the device-mask path keeps it); queries start with the keys (no KV cache or
context-parallel offset); head_dim a multiple of 8 (flash-attn's own padding is skipped).

flash-attn is looked up by module name when first needed, so a test can stand a module computing
attention in PyTorch in ``sys.modules`` (flash-attn is CUDA C++) and call
:func:`forget_flash_varlen`.
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

__all__ = ["flash_varlen", "flash_ops", "forget_flash_varlen", "flash_document_attention", "varlen_attention"]

_loaded: dict[str, object] = {}


def flash_varlen():
    """``flash_attn.flash_attn_varlen_func``, or None where flash-attn does not import (looked up
    once; a dict read afterwards, also while compiling)."""
    if "fn" not in _loaded:
        try:
            _loaded["fn"] = importlib.import_module("flash_attn").flash_attn_varlen_func
        except Exception:  # not installed, or a CUDA build that fails to load
            _loaded["fn"] = None
    return _loaded["fn"]


def forget_flash_varlen() -> None:
    """Look flash-attn up again on next use (after installing it, or in tests)."""
    _loaded.clear()


def document_lengths(seq_idx: Tensor) -> list[int]:
    """The lengths of the documents of all rows of ``seq_idx`` [b, L] (non-decreasing ids per
    row), row after row: one host read."""
    starts = torch.ones_like(seq_idx, dtype=torch.bool)
    starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    L = seq_idx.shape[1]
    lens = []
    for row in starts.cpu():
        s = row.nonzero().flatten().tolist() + [L]
        lens += [e - a for a, e in zip(s[:-1], s[1:])]
    return lens


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, lens: list[int], dropout_p: float = 0.0) -> Tensor:
    """One ``flash_attn_varlen_func`` call over every document of the batch (``lens``: their
    lengths, row after row; eager: flash-attn's autograd function); q [b, h, L, d], k/v [b,
    kv_heads, L, d] in, [b, h, L, d] out (token-major memory: the caller's ``transpose(1,
    2).reshape`` is a view)."""
    cu = _cu_seqlens(lens, q.device)
    out = flash_varlen()(*(flatten_tokens(t) for t in (q, k, v)), cu, cu, max(lens), max(lens),
                         dropout_p=dropout_p, causal=True)
    return unflatten_tokens(out, q.shape[0])


def flash_ops():
    """(forward, backward) of flash-attn's own ``torch.library`` varlen ops, or None where
    flash-attn does not import or registers none (before 2.7)."""
    if flash_varlen() is None:
        return None
    try:
        return torch.ops.flashattn._flash_attn_varlen_forward, torch.ops.flashattn._flash_attn_varlen_backward
    except AttributeError:
        return None


def _cu_seqlens(lens: list[int], device) -> Tensor:
    return torch.tensor([0] + lens, device=device, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def flatten_tokens(t: Tensor) -> Tensor:
    """[b, heads, L, d] -> [b * L, heads, d] (a view of token-major memory)."""
    b, heads, L, d = t.shape
    return t.transpose(1, 2).reshape(b * L, heads, d)


def unflatten_tokens(t: Tensor, b: int) -> Tensor:
    """[b * L, heads, d] -> [b, heads, L, d] (a view)."""
    return t.view(b, -1, *t.shape[1:]).transpose(1, 2)


def _forward(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float):
    out, lse, *_ = flash_ops()[0](*(flatten_tokens(t) for t in (q, k, v)), cu, cu, max_len, max_len, 0.0,
                                  scale, True)
    return unflatten_tokens(out, q.shape[0]), lse


@torch.library.custom_op("hybridtrain::flash_document_attention", mutates_args=())
def _attention(q: Tensor, k: Tensor, v: Tensor, seq_idx: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """(causal attention within each document of ``seq_idx`` [b, L], flash-attn's log-sum-exp)."""
    lens = document_lengths(seq_idx)
    return _forward(q, k, v, _cu_seqlens(lens, q.device), max(lens), scale)


@_attention.register_fake
def _(q, k, v, seq_idx, scale):
    b, _, L, _ = q.shape  # flash-attn's own fake gives the shapes (its max_seqlen: at most L)
    return _forward(q, k, v, seq_idx.new_empty(b * L + 1, dtype=torch.int32), L, scale)


@torch.library.custom_op("hybridtrain::flash_document_attention_backward", mutates_args=())
def _attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seq_idx: Tensor,
                        scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of :func:`_attention` by flash-attn's varlen backward kernel."""
    lens = document_lengths(seq_idx)
    cu = _cu_seqlens(lens, q.device)
    grads = [torch.empty_like(flatten_tokens(t)) for t in (q, k, v)]
    flash_ops()[1](*(flatten_tokens(t) for t in (dout, q, k, v, out)), lse, *grads, cu, cu, max(lens), max(lens),
                   0.0, scale, True, -1, -1, 0.0, None, False, None)
    return tuple(unflatten_tokens(g, q.shape[0]) for g in grads)


@_attention_backward.register_fake
def _(dout, q, k, v, out, lse, seq_idx, scale):
    return tuple(unflatten_tokens(torch.empty_like(flatten_tokens(t)), q.shape[0]) for t in (q, k, v))


def _setup(ctx, inputs, output):
    q, k, v, seq_idx, scale = inputs
    ctx.save_for_backward(q, k, v, seq_idx, *output)
    ctx.scale = scale


def _backward(ctx, dout, _dlse):
    q, k, v, seq_idx, out, lse = ctx.saved_tensors
    return (*_attention_backward(dout, q, k, v, out, lse, seq_idx, ctx.scale), None, None)


torch.library.register_autograd("hybridtrain::flash_document_attention", _backward, setup_context=_setup)


def flash_document_attention(q: Tensor, k: Tensor, v: Tensor, seq_idx: Tensor) -> Tensor:
    """Causal attention within each document of ``seq_idx`` [b, L] by flash-attn's varlen kernels
    (the custom op); q [b, h, L, d], k/v [b, kv_heads, L, d] -> [b, h, L, d]."""
    return _attention(q, k, v, seq_idx, q.shape[-1] ** -0.5)[0]
