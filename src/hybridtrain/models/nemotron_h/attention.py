"""Causal grouped-query attention of Nemotron-H: explicit head_dim, no positional encoding."""

from __future__ import annotations

import torch
from torch import nn

from hybridtrain.ops.attention import document_causal_attention

from . import context_parallel as cpl
from .cache import KVCache
from .config import NemotronHConfig
from .decode_ops import linear


class Attention(nn.Module):
    def __init__(self, config: NemotronHConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        # tensor parallelism with fewer kv heads than ranks: k/v are computed whole (replicated
        # weights) and this callable takes the kv heads of this rank's query heads
        self.local_kv_heads = None

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            nn.init.normal_(lin.weight, mean=0.0, std=self.config.initializer_range)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def forward(self, hidden_states: torch.Tensor, seq_idx: torch.Tensor | None = None,
                cp: "cpl.CPSlice | None" = None) -> torch.Tensor:
        """``seq_idx`` [b, L]: document id of every token (packed rows; None: one document per
        row); attention never crosses a document and costs the sum of the documents' causal
        squares. ``cp``: this rank's slice of a context-parallel sequence (K/V gathered)."""
        b, L, _ = hidden_states.shape
        # (head counts from the projections: this rank's heads under tensor parallelism)
        q = self.q_proj(hidden_states).view(b, L, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, L, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, L, -1, self.head_dim).transpose(1, 2)
        if self.local_kv_heads is not None:
            k, v = self.local_kv_heads(k), self.local_kv_heads(v)
        dropout = self.config.attention_dropout if self.training else 0.0
        offset = 0
        if cp is not None:
            k, v = cpl.gather_keys_values(k, v, cp)
            seq_idx, offset = cp.seq_idx, cp.offset
        out = document_causal_attention(q, k, v, seq_idx, q_offset=offset, dropout_p=dropout)
        return self.o_proj(out.transpose(1, 2).reshape(b, L, -1))

    # ------------------------------------------------------------------ cached decoding
    def _qkv(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [b, heads, L, head_dim] (this rank's heads under tensor parallelism)."""
        b, L, _ = hidden_states.shape
        q, k, v = (linear(p, hidden_states).view(b, L, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.local_kv_heads is not None:
            k, v = self.local_kv_heads(k), self.local_kv_heads(v)
        return q, k, v

    def prefill(self, hidden_states: torch.Tensor, seq_idx: torch.Tensor | None,
                max_length: int) -> tuple[torch.Tensor, KVCache]:
        """The prompt's attention (``seq_idx``: padding and prompt as two documents, or None)
        and its key/value cache, allocated once with room for ``max_length`` positions."""
        q, k, v = self._qkv(hidden_states)
        b, kv_heads, L, d = k.shape
        cache = KVCache(*(torch.zeros(b, kv_heads, max_length, d, dtype=k.dtype, device=k.device)
                          for _ in range(2)))
        cache.k[:, :, :L] = k
        cache.v[:, :, :L] = v
        out = document_causal_attention(q, k, v, seq_idx)
        return self.o_proj(out.transpose(1, 2).reshape(b, L, -1)), cache

    def step(self, hidden_states: torch.Tensor, cache: KVCache, valid: torch.Tensor,
             position: torch.Tensor) -> torch.Tensor:
        """One token per row, hidden_states [b, 1, H], written to the cache at ``position`` [1]
        (a device tensor), attending to the cached positions ``valid`` [b, max_length] marks
        (this one included) over the whole static cache: no shape depends on the position. The
        query heads sharing a kv head are the rows of one attention (no causal mask: every valid
        key precedes the query)."""
        q, k, v = self._qkv(hidden_states)
        cache.k.index_copy_(2, position, k)
        cache.v.index_copy_(2, position, v)
        b, heads = q.shape[:2]
        kv_heads = cache.k.shape[1]
        q = q.reshape(b, kv_heads, heads // kv_heads, self.head_dim)
        out = torch.nn.functional.scaled_dot_product_attention(q, cache.k, cache.v, attn_mask=valid[:, None, None])
        return linear(self.o_proj, out.reshape(b, 1, heads * self.head_dim))

    def verify(self, hidden_states: torch.Tensor, cache: KVCache, valid: torch.Tensor,
               start: int) -> torch.Tensor:
        """``T`` new tokens per row at once, hidden_states [b, T, H] (speculative verification),
        written to the cache at ``start``..``start + T - 1``: each attends to the cached
        positions ``valid`` [b, max_length] marks before ``start`` and to the new tokens up to
        itself."""
        q, k, v = self._qkv(hidden_states)
        b, heads, T, _ = q.shape
        cache.k[:, :, start:start + T] = k
        cache.v[:, :, start:start + T] = v
        kv_heads, L = cache.k.shape[1], cache.k.shape[2]
        keys = torch.arange(L, device=q.device)
        new = torch.arange(start, start + T, device=q.device)
        mask = ((valid[:, None, :] & (keys < start)) | ((keys >= start) & (keys <= new[:, None])))  # [b, T, L]
        g = heads // kv_heads
        q = q.reshape(b, kv_heads, g * T, self.head_dim)  # a kv head's query heads, each its T tokens
        mask = mask[:, None, None].expand(b, 1, g, T, L).reshape(b, 1, g * T, L)
        out = torch.nn.functional.scaled_dot_product_attention(q, cache.k, cache.v, attn_mask=mask)
        out = out.reshape(b, heads, T, self.head_dim).transpose(1, 2)
        return linear(self.o_proj, out.reshape(b, T, heads * self.head_dim))
