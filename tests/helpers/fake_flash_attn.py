"""A stand-in for flash-attn (CUDA C++: it cannot run here) computing its varlen attention in
PyTorch: ``flash_attn_varlen_func`` and the ``torch.library`` ops flash-attn 2.7 registers,
``flashattn::_flash_attn_varlen_forward`` / ``_backward``, with their argument order and their
outputs (the log-sum-exp [heads, total tokens]; the backward writes dq, dk, dv in place). Each
checks what flash-attn requires (int32 ``cu_seqlens``, a host ``max_seqlen`` equal to the longest
document) and records the document lengths it got in :data:`CALLS`.

``install(monkeypatch)`` puts the module in ``sys.modules['flash_attn']``."""

from __future__ import annotations

import sys
import types
from typing import Optional

import torch
from torch import Tensor

CALLS: list[tuple[str, list[int]]] = []


def _documents(name: str, cu: Tensor, max_len: int) -> list[tuple[int, int]]:
    lens = cu.diff()
    assert cu.dtype == torch.int32 and isinstance(max_len, int) and max_len == int(lens.max()), (cu, max_len)
    CALLS.append((name, lens.tolist()))
    bounds = cu.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _probs(q, k, scale):
    """(causal scores' softmax P [h, n, n], log-sum-exp [h, n]) of one document, kv heads
    repeated for the query heads sharing them."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    n = q.shape[0]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = s.logsumexp(-1)
    return (s - lse[..., None]).exp(), lse


def _group(t: Tensor, kv_heads: int) -> Tensor:
    """A gradient over repeated kv heads [n, h, d] summed back to [n, kv_heads, d]."""
    n, h, d = t.shape
    return t.view(n, kv_heads, h // kv_heads, d).sum(2)


@torch.library.custom_op("flashattn::_flash_attn_varlen_forward", mutates_args=())
def _flash_attn_varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                               max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float,
                               causal: bool, window_size_left: int = -1, window_size_right: int = -1,
                               softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
                               return_softmax: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    assert causal and dropout_p == 0.0 and torch.equal(cu_seqlens_q, cu_seqlens_k)
    out = torch.empty_like(q)
    lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    for a, e in _documents("forward", cu_seqlens_q, max_seqlen_q):
        p, lse[:, a:e] = _probs(q[a:e], k[a:e], softmax_scale)
        out[a:e] = torch.einsum("hqk,khd->qhd", p, v[a:e].repeat_interleave(q.shape[1] // v.shape[1], dim=1))
    return out, lse, q.new_empty(0), q.new_empty(2, dtype=torch.int64)


@_flash_attn_varlen_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
      window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False):
    return (torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32), q.new_empty(0),
            q.new_empty(2, dtype=torch.int64))


@torch.library.custom_op("flashattn::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"))
def _flash_attn_varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
                                dq: Optional[Tensor], dk: Optional[Tensor], dv: Optional[Tensor],
                                cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
                                window_size_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                                deterministic: bool, rng_state: Optional[Tensor] = None) -> Tensor:
    assert causal and dropout_p == 0.0 and torch.equal(cu_seqlens_q, cu_seqlens_k)
    g = q.shape[1] // k.shape[1]
    for a, e in _documents("backward", cu_seqlens_q, max_seqlen_q):
        p, lse = _probs(q[a:e], k[a:e], softmax_scale)
        torch.testing.assert_close(lse, softmax_lse[:, a:e])  # the forward's, handed back
        do, kk, vv = dout[a:e], k[a:e].repeat_interleave(g, dim=1), v[a:e].repeat_interleave(g, dim=1)
        ds = p * (torch.einsum("qhd,khd->hqk", do, vv) - (do * out[a:e]).sum(-1).T[..., None])
        dq[a:e] = torch.einsum("hqk,khd->qhd", ds, kk) * softmax_scale
        dk[a:e] = _group(torch.einsum("hqk,qhd->khd", ds, q[a:e]) * softmax_scale, k.shape[1])
        dv[a:e] = _group(torch.einsum("hqk,qhd->khd", p, do), k.shape[1])
    return softmax_lse.new_empty(softmax_lse.shape)


@_flash_attn_varlen_backward.register_fake
def _(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
      rng_state=None):
    return softmax_lse.new_empty(softmax_lse.shape)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, **kwargs):
    """The public eager entry (forward only here)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      dropout_p, scale, causal)[0]


def install(monkeypatch) -> None:
    """``import flash_attn`` gives this stand-in (until ``monkeypatch`` undoes it)."""
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    CALLS.clear()
