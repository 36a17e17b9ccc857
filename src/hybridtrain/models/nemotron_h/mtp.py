"""Multi-token prediction (MTP) layers of Nemotron-H, laid out as the Hub checkpoints hold them
(the layout vLLM's and SGLang's Nemotron-H MTP loaders read).

``num_nextn_predict_layers`` depths, each the layers of ``mtp_layers_block_type``, numbered on
under ``mtp.layers.{i}`` depth after depth (depth ``d``'s ``j``-th layer is ``i = d * p + j``
for a pattern of ``p`` layers). Every layer is a pre-norm residual block (``norm``, ``mixer``, as
the main stack's); a depth's first layer also has ``enorm``, ``hnorm`` and ``eh_proj`` and its
last one ``final_layernorm``::

    x = eh_proj(concat[enorm(embed(next token)), hnorm(previous hidden)])   # 2H -> H
    x = block_j(x) for each layer of the depth
    h_depth = final_layernorm(x)          # logits: the shared lm_head; next depth's "previous"

The previous hidden state of depth 1 is the main model's output after ``norm_f``. The embedding
and the LM head are the main model's.

Training: depth ``k`` (1-based) at position ``t`` reads the embedding of token ``t + k`` and
predicts token ``t + 1 + k``, i.e. the label ``labels[t + k]`` (labels are already shifted), and
only where position ``t + k`` is in ``t``'s document: packed documents never predict across a
boundary, and masked (assistant-only) labels stay masked.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridtrain.ops.labels import IGNORE_INDEX

from .blocks import Block
from .config import NemotronHConfig
from .norms import RMSNorm


def mtp_block(config: NemotronHConfig, index: int) -> nn.Module:
    """Layer ``index`` of ``mtp.layers`` (a :class:`MTPLayer`)."""
    p = len(config.mtp_layers_block_type)
    return MTPLayer(config, index, first=index % p == 0, last=index % p == p - 1)


class MTPLayer(Block):
    """One MTP layer: a main-stack block (``norm``, ``mixer``: the Hub names them directly
    under the layer) with the depth's input fusion when ``first`` and its final norm when
    ``last``."""

    def __init__(self, config: NemotronHConfig, index: int, first: bool, last: bool):
        p = len(config.mtp_layers_block_type)
        # the mixers number their layers on after the main stack's (as vLLM)
        super().__init__(config, config.num_hidden_layers + index, config.mtp_layers_block_type[index % p])
        eps, hidden = config.layer_norm_epsilon, config.hidden_size
        self.enorm = RMSNorm(hidden, eps=eps) if first else None
        self.hnorm = RMSNorm(hidden, eps=eps) if first else None
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False) if first else None
        self.final_layernorm = RMSNorm(hidden, eps=eps) if last else None
        self.std = config.initializer_range

    def reset_parameters(self) -> None:
        super().reset_parameters()
        for n in (self.enorm, self.hnorm, self.final_layernorm):
            if n is not None:
                n.reset_parameters()
        if self.eh_proj is not None:
            nn.init.normal_(self.eh_proj.weight, mean=0.0, std=self.std)

    def fuse(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """The depth's input: eh_proj(concat[enorm(embeds), hnorm(hidden)])."""
        dtype = self.enorm.weight.dtype
        fused = torch.cat([self.enorm(embeds.to(dtype)), self.hnorm(hidden.to(dtype))], dim=-1)
        return self.eh_proj(fused)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor | None = None, info=None) -> torch.Tensor:
        if self.eh_proj is not None:
            hidden = self.fuse(hidden, embeds)
        hidden = super().forward(hidden, info)
        if self.final_layernorm is not None:
            hidden = self.final_layernorm(hidden.to(self.final_layernorm.weight.dtype))
        return hidden


class MultiTokenPredictor(nn.Module):
    """``layers``: every depth's layers (a dict keyed "0".."D*p-1", the Hub's names)."""

    def __init__(self, config: NemotronHConfig):
        super().__init__()
        self.depths = config.num_nextn_predict_layers
        self.per_depth = len(config.mtp_layers_block_type)
        self.layers = nn.ModuleDict({str(i): mtp_block(config, i) for i in range(config.num_mtp_layers)})

    def depth(self, d: int) -> list[MTPLayer]:
        """The layers of depth ``d`` (0-based)."""
        return [self.layers[str(d * self.per_depth + j)] for j in range(self.per_depth)]

    def run_depth(self, d: int, hidden: torch.Tensor, embeds: torch.Tensor, info=None) -> torch.Tensor:
        """Depth ``d``'s output [B, L, H] from the previous hidden states and the embeddings of the
        tokens it reads (position ``t``: the token ``d + 1`` ahead)."""
        for layer in self.depth(d):
            hidden = layer(hidden, embeds, info)
        return hidden

    def hidden_states(self, hidden: torch.Tensor, input_ids: torch.Tensor, embeddings: nn.Module,
                      info=None) -> list[torch.Tensor]:
        """Every depth's output [B, L, H] over a training row (``hidden``: the main model's final
        hidden states): depth ``d`` reads ``input_ids`` shifted left by ``d + 1``."""
        outs = []
        for d in range(self.depths):
            embeds = embeddings(shift_left(input_ids, d + 1, 0))
            hidden = self.run_depth(d, hidden, embeds, info)
            outs.append(hidden)
        return outs


def shift_left(x: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """``x[:, t + k]`` at ``t`` ([B, L]); the last ``k`` positions hold ``fill``."""
    out = torch.full_like(x, fill)
    if k < x.shape[1]:
        out[:, :x.shape[1] - k] = x[:, k:]
    return out


def depth_labels(labels: torch.Tensor, k: int, seq_idx: torch.Tensor | None) -> torch.Tensor:
    """Targets of MTP depth ``k`` (1-based): ``labels[t + k]`` where position ``t + k`` lies in
    ``t``'s document (``seq_idx``: document id per token; None: one document per row), else
    ``IGNORE_INDEX``."""
    out = shift_left(labels, k, IGNORE_INDEX)
    if seq_idx is not None:
        same = shift_left(seq_idx, k, -1) == seq_idx
        out = torch.where(same, out, torch.full_like(out, IGNORE_INDEX))
    return out
