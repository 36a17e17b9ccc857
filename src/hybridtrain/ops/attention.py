"""Causal attention over packed documents without an ``[L, L]`` mask.

::

    document_spans(seq_idx, q_offset, q_len) -> per row [(q_start, q_end, k_start), ...]
    document_causal_attention(q, k, v, seq_idx=None, q_offset=0, dropout_p=0.0)

A query at (global) position ``i`` sees the keys ``j <= i`` of its own document. Each document
of a row is one ``scaled_dot_product_attention`` call on its own tokens (``is_causal``: the
fused kernels, memory linear in the document's length), so the work is the sum over documents
of each document's causal square, never the full row's.

Queries may start inside the key sequence (``q_offset``): a KV cache (the queries are the last
tokens of the keys) or a context-parallel rank (its slice of the sequence, all keys gathered).
A document that starts before the queries is attended in query blocks of ``block`` rows with a
``[block, keys]`` mask (lower-right causal), so memory stays linear in the key length.

On CUDA with ``flash_attn`` installed (bf16/fp16, no queries offset into earlier keys) one varlen
call runs all documents of the batch; the per-document path is always there and is the one tested.

Under ``torch.compile`` the document boundaries are never read on the host (no graph break): the
mask "same document and causal" is a function of ``seq_idx`` on the device. Where flash-attn
varlen runs (above; no dropout, flash-attn >= 2.7) its own ``torch.library`` ops are reached through
the custom op :func:`~hybridtrain.ops.flash_varlen.flash_document_attention`, which reads the
document lengths inside the op, out of dynamo's sight. Else, on CUDA (the named fallback: a missing flash-attn is
a warning at start, ``ops.backend.slow_paths``) and wherever no gradient is needed, a
``flex_attention`` block mask (blocks across documents are skipped: the work stays about the
documents' causal squares); where a gradient is needed on the CPU (flex_attention has no CPU
backward) or with dropout, a dense ``[b, 1, Lq, Lk]`` mask for ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .documents import document_starts
from .flash_varlen import (flash_document_attention, flash_ops, flash_varlen, flatten_tokens, unflatten_tokens,
                           varlen_attention)

__all__ = ["document_spans", "document_causal_attention"]

QUERY_BLOCK = 1024


def document_spans(seq_idx: torch.Tensor, q_offset: int, q_len: int
                   ) -> list[list[tuple[int, int, int]]]:
    """For every row, the documents the queries ``[q_offset, q_offset + q_len)`` cover, as
    ``(q_start, q_end, k_start)`` in key positions: queries ``q_start..q_end-1`` attend keys
    ``k_start..`` (the document's first token) up to themselves. ``seq_idx`` [b, >= q_offset +
    q_len]: non-decreasing document ids (their starts read once per tensor:
    :func:`~hybridtrain.ops.documents.document_starts`)."""
    q_end = q_offset + q_len
    rows = []
    for row in document_starts(seq_idx):
        s = [a for a in row if a < q_end] + [q_end]
        spans = []
        for a, e in zip(s[:-1], s[1:]):
            if e > q_offset:
                spans.append((max(a, q_offset), e, a))
        rows.append(spans)
    return rows


def _sdpa(q, k, v, dropout_p, causal=False, mask=None):
    gqa = q.shape[-3] != k.shape[-3]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          is_causal=causal, enable_gqa=gqa)


def _offset_causal(q, k, v, q0: int, k0: int, dropout_p: float, block: int):
    """Queries at key positions ``q0..`` attending keys ``k0..`` up to themselves (a document
    that started before the queries), in query blocks with a lower-right causal mask."""
    out = []
    Lq = q.shape[-2]
    for a in range(0, Lq, block):
        e = min(a + block, Lq)
        kend = q0 + e - k0  # keys [k0, q0 + e)
        qpos = torch.arange(q0 + a, q0 + e, device=q.device)
        kpos = torch.arange(k0, k0 + kend, device=q.device)
        mask = kpos[None, :] <= qpos[:, None]
        out.append(_sdpa(q[..., a:e, :], k[..., :kend, :], v[..., :kend, :], dropout_p, mask=mask))
    return out[0] if len(out) == 1 else torch.cat(out, dim=-2)


def _each_document(q, k, v, lens: list[int], dropout_p: float) -> torch.Tensor:
    """Each document's causal square, the rows taken as one sequence (``lens``: the documents'
    lengths, row after row), as the varlen kernel sees them: one split of each input (its
    backward: one concatenation) and one concatenation of the outputs, token-major."""
    seqs = [flatten_tokens(t).transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # [1, heads, b*L, d]
    docs = [seqs] if len(lens) == 1 else zip(*(t.split(lens, -2) for t in seqs))
    out = _cat([_sdpa(*doc, dropout_p, causal=True) for doc in docs], 2)
    return unflatten_tokens(out.squeeze(0).transpose(0, 1), q.shape[0])


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """[b, h, l, d] parts concatenated along ``dim`` (0 rows, 2 tokens), stored token-major
    ([b, L, h, d] memory, the layout the fused CPU kernel returns) so that the caller's
    ``transpose(1, 2).reshape`` to [b, L, h * d] is a view, not a second copy of the output."""
    if len(parts) == 1:
        return parts[0]
    return torch.cat([p.transpose(1, 2) for p in parts], dim=min(dim, 1)).transpose(1, 2)


def flash_ok(device_type: str, dtype: torch.dtype, q_offset: int, Lq: int, Lk: int) -> bool:
    """Whether flash-attn varlen runs these packed rows: installed, CUDA, bf16/fp16, the queries
    starting with the keys."""
    return (device_type == "cuda" and dtype in (torch.float16, torch.bfloat16) and q_offset == 0
            and Lq == Lk and flash_varlen() is not None)


def flash_op_ok(q: torch.Tensor, k: torch.Tensor, q_offset: int, dropout_p: float) -> bool:
    """Whether compiled blocks run these packed rows by flash-attn (its own ``torch.library`` ops,
    through :func:`~hybridtrain.ops.flash_varlen.flash_document_attention`): :func:`flash_ok`, no
    dropout, head_dim a multiple of 8."""
    return (dropout_p == 0.0 and q.shape[-1] % 8 == 0
            and flash_ok(q.device.type, q.dtype, q_offset, q.shape[-2], k.shape[-2]) and flash_ops() is not None)


def _document_mask(seq_idx: torch.Tensor, q_offset: int):
    """``mask_mod(b, h, q, k)``: key ``k`` is in query ``q``'s document and not after it (the
    query at key position ``q + q_offset``); any index tensors broadcast."""
    def mask_mod(b, h, q_idx, kv_idx):
        q_pos = q_idx + q_offset
        return (seq_idx[b, q_pos] == seq_idx[b, kv_idx]) & (kv_idx <= q_pos)
    return mask_mod


def _flex_wanted(q, k, v, dropout_p: float) -> bool:
    """flex_attention: on CUDA, or anywhere no gradient is taken (no CPU backward); no dropout."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return dropout_p == 0.0 and (q.is_cuda or not grad)


def _traced_document_attention(q, k, v, seq_idx, q_offset: int, dropout_p: float):
    """:func:`document_causal_attention` with the document mask built on the device (the path
    under ``torch.compile``: no host reads, one graph)."""
    b, _, Lq, _ = q.shape
    Lk = k.shape[-2]
    if flash_op_ok(q, k, q_offset, dropout_p):
        return flash_document_attention(q, k, v, seq_idx)
    mask_mod = _document_mask(seq_idx, q_offset)
    if _flex_wanted(q, k, v, dropout_p):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        block_mask = create_block_mask(mask_mod, b, None, Lq, Lk, device=q.device)
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=q.shape[-3] != k.shape[-3])
    rows = torch.arange(b, device=q.device)[:, None, None, None]
    q_idx = torch.arange(Lq, device=q.device)[None, None, :, None]
    kv_idx = torch.arange(Lk, device=q.device)[None, None, None, :]
    return _sdpa(q, k, v, dropout_p, mask=mask_mod(rows, None, q_idx, kv_idx))


def document_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              seq_idx: torch.Tensor | None = None, q_offset: int = 0,
                              dropout_p: float = 0.0, block: int = QUERY_BLOCK) -> torch.Tensor:
    """Causal attention that never crosses a document.

    q [b, h, Lq, d]; k, v [b, kv_heads, Lk, d] (grouped-query when ``kv_heads < h``);
    ``seq_idx`` [b, Lk] document id of every key (non-decreasing; None: one document per row);
    the queries are the keys ``q_offset .. q_offset + Lq - 1``. Returns [b, h, Lq, d]."""
    b, _, Lq, _ = q.shape
    Lk = k.shape[-2]
    assert 0 <= q_offset and q_offset + Lq <= Lk, (q_offset, Lq, Lk)
    if seq_idx is None:  # one document per row
        if q_offset == 0 and Lq == Lk:
            return _sdpa(q, k, v, dropout_p, causal=True)
        end = q_offset + Lq
        return _offset_causal(q, k[..., :end, :], v[..., :end, :], q_offset, 0, dropout_p, block)
    if torch.compiler.is_compiling():
        return _traced_document_attention(q, k, v, seq_idx, q_offset, dropout_p)
    spans = document_spans(seq_idx, q_offset, Lq)
    if q_offset == 0 and Lq == Lk:  # every document starts with its queries (training)
        lens = [e - s for row in spans for s, e, _ in row]
        if flash_ok(q.device.type, q.dtype, q_offset, Lq, Lk):  # pragma: no cover - CUDA only
            return varlen_attention(q, k, v, lens, dropout_p)
        return _each_document(q, k, v, lens, dropout_p)
    # split (not index) rows and documents: their backward is one concatenation, where each
    # indexed slice's backward would allocate a zero gradient of the whole tensor; one row and
    # all keys are taken whole (a split into one part or a full narrow copies the gradient)
    rows = []
    for r, (rq, rk, rv) in enumerate(zip(*((t,) if b == 1 else t.split(1) for t in (q, k, v)))):
        if all(qs == ks for qs, _, ks in spans[r]):  # every document starts with the queries
            lens = [qe - qs for qs, qe, _ in spans[r]]
            if Lq != Lk:
                rk, rv = (t.narrow(-2, q_offset, Lq) for t in (rk, rv))
            parts = [_sdpa(a, c, d, dropout_p, causal=True)
                     for a, c, d in zip(rq.split(lens, -2), rk.split(lens, -2), rv.split(lens, -2))]
        else:
            parts = []
            for qs, qe, ks in spans[r]:
                qq = rq[..., qs - q_offset:qe - q_offset, :]
                kk, vv = rk[..., ks:qe, :], rv[..., ks:qe, :]
                if qs == ks:  # the document starts with the queries: its causal square
                    parts.append(_sdpa(qq, kk, vv, dropout_p, causal=True))
                else:
                    parts.append(_offset_causal(qq, kk, vv, qs, ks, dropout_p, block))
        rows.append(_cat(parts, 2))
    return _cat(rows, 0)
