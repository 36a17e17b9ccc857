"""Causal grouped-query attention of Nemotron-H: explicit head_dim, no positional encoding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import NemotronHConfig


def document_causal_mask(seq_idx: torch.Tensor) -> torch.Tensor:
    """Boolean [b, 1, L, L] mask: query i may attend key j iff j <= i and both are in one document."""
    L = seq_idx.shape[-1]
    causal = torch.ones(L, L, dtype=torch.bool, device=seq_idx.device).tril()
    same = seq_idx[:, :, None] == seq_idx[:, None, :]
    return (same & causal)[:, None]


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

    def forward(self, hidden_states: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``attn_mask``: None for plain causal attention, or the boolean [b, 1, L, L] mask of
        :func:`document_causal_mask` for packed documents (built once per forward by the model)."""
        b, L, _ = hidden_states.shape
        # (head counts from the projections: this rank's heads under tensor parallelism)
        q = self.q_proj(hidden_states).view(b, L, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, L, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, L, -1, self.head_dim).transpose(1, 2)
        if self.local_kv_heads is not None:
            k, v = self.local_kv_heads(k), self.local_kv_heads(v)
        dropout = self.config.attention_dropout if self.training else 0.0
        gqa = k.shape[1] != q.shape[1]
        if attn_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, L, -1))
