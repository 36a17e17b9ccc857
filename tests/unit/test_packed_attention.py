"""Packed attention without an [L, L] mask (``ops.attention.document_causal_attention``) equals
attention under the dense document-causal mask -- outputs and gradients, grouped-query heads,
queries offset into the keys (a KV cache, a context-parallel slice) with documents that began
before them, in query blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridtrain.ops.attention import document_causal_attention, document_spans


def _seq_idx(rows):
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(r)]) for r in rows])


def _dense(q, k, v, seq_idx, q_offset):
    """The definition: one [Lq, Lk] boolean mask per row."""
    Lq, Lk = q.shape[-2], k.shape[-2]
    qpos = torch.arange(q_offset, q_offset + Lq)
    mask = torch.arange(Lk)[None, :] <= qpos[:, None]
    if seq_idx is not None:
        mask = mask & (seq_idx[:, q_offset:q_offset + Lq, None] == seq_idx[:, None, :])
        mask = mask[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _qkv(b, h, kvh, Lq, Lk, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, Lq, d, dtype=torch.float64, generator=g).requires_grad_()
    k = torch.randn(b, kvh, Lk, d, dtype=torch.float64, generator=g).requires_grad_()
    v = torch.randn(b, kvh, Lk, d, dtype=torch.float64, generator=g).requires_grad_()
    return q, k, v


DOCS = [[5, 14, 5], [24], [12, 12], [1, 1, 22]]


def _compare(q, k, v, seq_idx, q_offset, **kw):
    out = document_causal_attention(q, k, v, seq_idx, q_offset=q_offset, **kw)
    w = torch.randn_like(out)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref = _dense(q, k, v, seq_idx, q_offset)
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    assert (out - ref).abs().max() < 1e-12
    for a, b in zip(got, want):
        assert (a - b).abs().max() < 1e-12


@pytest.mark.parametrize("packed", [False, True], ids=["one-doc", "packed"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_equals_dense_document_mask(packed, heads):
    q, k, v = _qkv(len(DOCS), *heads, 24, 24)
    _compare(q, k, v, _seq_idx(DOCS) if packed else None, 0)


@pytest.mark.parametrize("q_offset,Lq", [(12, 12), (7, 10), (23, 1), (0, 24)])
@pytest.mark.parametrize("block", [3, 1024])
@pytest.mark.parametrize("packed", [False, True], ids=["one-doc", "packed"])
def test_queries_offset_into_the_keys(q_offset, Lq, block, packed):
    """A KV cache or a context-parallel slice: the queries are keys q_offset..q_offset+Lq-1."""
    q, k, v = _qkv(len(DOCS), 4, 2, Lq, 24, seed=1)
    _compare(q, k, v, _seq_idx(DOCS) if packed else None, q_offset, block=block)


def test_document_spans():
    seq_idx = _seq_idx([[5, 14, 5], [24]])
    assert document_spans(seq_idx, 0, 24) == [[(0, 5, 0), (5, 19, 5), (19, 24, 19)], [(0, 24, 0)]]
    # queries 12..23: the middle document began at 5, before them
    assert document_spans(seq_idx, 12, 12) == [[(12, 19, 5), (19, 24, 19)], [(12, 24, 0)]]


def test_dropout_keeps_the_shape():
    q, k, v = _qkv(2, 4, 2, 24, 24)
    out = document_causal_attention(q, k, v, _seq_idx(DOCS[:2]), dropout_p=0.5)
    assert out.shape == q.shape and torch.isfinite(out).all()
