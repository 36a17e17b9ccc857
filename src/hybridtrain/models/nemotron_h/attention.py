"""Causal grouped-query attention of Nemotron-H: explicit head_dim, no positional encoding."""

from __future__ import annotations

import torch
from torch import nn

from hybridtrain.ops.attention import document_causal_attention

from . import context_parallel as cpl
from .config import NemotronHConfig


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
