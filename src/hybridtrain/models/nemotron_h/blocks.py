"""A Nemotron-H layer: the pre-norm residual block around one mixer (Mamba2, attention, MLP or
MoE), and the per-forward packing information its mixers read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from .attention import Attention
from .config import NemotronHConfig
from .context_parallel import CPSlice
from .decode_ops import norm
from .mamba2 import Mamba2Mixer
from .mlp import MLP
from .moe import MoE
from .norms import RMSNorm
from .numerics import matmul_dtype

if TYPE_CHECKING:
    from hybridtrain.distributed.tensor_parallel import SequenceParallel

MIXERS = {"linear_attention": Mamba2Mixer, "full_attention": Attention, "mlp": MLP, "moe": MoE}


@dataclass
class SequenceInfo:
    """Per-forward packing information, computed once and shared by all layers."""

    seq_idx: torch.Tensor | None = None  # [B, L] int32 document id, None = one document per row
    cp: CPSlice | None = None  # this rank's slice of a context-parallel sequence
    # sequence parallelism: between the mixers, this rank's part of the rows' ``length`` tokens
    sp: SequenceParallel | None = None
    length: int = 0


class Block(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x))."""

    def __init__(self, config: NemotronHConfig, layer_idx: int, block_type: str | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.block_type = config.layers_block_type[layer_idx] if block_type is None else block_type
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        mixer_cls = MIXERS[self.block_type]
        self.mixer = MLP(config) if mixer_cls is MLP else mixer_cls(config, layer_idx=layer_idx)

    def reset_parameters(self) -> None:
        self.norm.reset_parameters()
        self.mixer.reset_parameters()

    def forward(self, hidden_states: torch.Tensor, info: SequenceInfo | None = None) -> torch.Tensor:
        sp = info.sp if info is not None else None
        x = hidden_states.to(self.norm.weight.dtype)
        if sp is None:
            # a mixer whose one reader of h is a linear layer (Mamba's in_proj, the MLP's up_proj)
            # gets h in that layer's compute dtype, written by the norm: no fp32 h for autocast to
            # cast (attention's three projections would sum h's gradients in bf16; the MoE router
            # reads h in fp32; sequence parallelism would reduce-scatter its gradient in bf16)
            out_dtype = matmul_dtype(hidden_states) if isinstance(self.mixer, (Mamba2Mixer, MLP)) else None
            return hidden_states + self._mix(self.norm(x, out_dtype=out_dtype), info)
        h = self.norm(x, sp)
        # the mixer takes whole rows (autograd keeps this rank's part of them); the residual
        # stream keeps this rank's part
        full = sp.gather(h, info.length)
        with sp.keep_part(full, h):
            out = self._mix(full, info)
        return hidden_states + sp.shard(out)

    def _mix(self, h: torch.Tensor, info: SequenceInfo | None) -> torch.Tensor:
        if self.block_type in ("linear_attention", "full_attention") and info is not None:
            return self.mixer(h, seq_idx=info.seq_idx, cp=info.cp)
        if self.block_type == "moe" and info is not None and info.cp is not None:
            return self.mixer(h, cp=info.cp.cp)
        return self.mixer(h)

    # -- cached decoding (the loop is generation.py) ----------------------------------------------
    def prefill(self, hidden_states: torch.Tensor, seq_idx: torch.Tensor | None,
                valid: torch.Tensor | None, max_length: int) -> tuple[torch.Tensor, object | None]:
        """The block over a prompt [b, L, H] (``seq_idx``/``valid``: the left padding as its own
        document, see :func:`.generation.prefill`); returns the output and the layer's cache entry
        (a Mamba state or the key/value cache for ``max_length`` tokens; None for MLP and MoE)."""
        x = norm(self.norm, hidden_states, step=False)
        entry = None
        if self.block_type == "linear_attention":
            y, entry = self.mixer.prefill(x, seq_idx, valid)
        elif self.block_type == "full_attention":
            y, entry = self.mixer.prefill(x, seq_idx, max_length)
        else:
            y = self.mixer(x)
        return hidden_states + y, entry

    def step(self, hidden_states: torch.Tensor, entry: object | None, valid: torch.Tensor,
             position: torch.Tensor) -> torch.Tensor:
        """One decoding step [b, 1, H] on the layer's cache ``entry`` (``valid``/``position``: the
        cache's valid positions and the step's position, device tensors)."""
        x = norm(self.norm, hidden_states)
        if self.block_type == "linear_attention":
            y = self.mixer.step(x, entry)
        elif self.block_type == "full_attention":
            y = self.mixer.step(x, entry, valid, position)
        else:
            y = self.mixer.step(x)
        return hidden_states + y

    def verify(self, hidden_states: torch.Tensor, entry: object | None, valid: torch.Tensor,
               start: int) -> tuple[torch.Tensor, list]:
        """``T`` new tokens per row at once [b, T, H] at positions ``start``.. on the layer's cache
        ``entry`` (speculative verification: one forward instead of ``T`` steps); returns the
        output and, for a Mamba layer, its (conv, ssm) state after each token (else [])."""
        x = norm(self.norm, hidden_states)
        states = []
        if self.block_type == "linear_attention":
            y, states = self.mixer.verify(x, entry)
        elif self.block_type == "full_attention":
            y = self.mixer.verify(x, entry, valid, start)
        else:
            y = self.mixer.step(x)
        return hidden_states + y, states
