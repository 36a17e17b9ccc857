"""Dense MLP of Nemotron-H: down_proj(act(up_proj(x))), squared ReLU by default (no gate)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .decode_ops import linear


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


ACTIVATIONS = {
    "relu2": relu2,
    "relu": F.relu,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class MLP(nn.Module):
    def __init__(self, config, intermediate_size: int | None = None, hidden_size: int | None = None):
        super().__init__()
        self.config = config
        hidden = hidden_size or config.hidden_size
        inter = intermediate_size or config.intermediate_size
        self.up_proj = nn.Linear(hidden, inter, bias=config.mlp_bias)
        self.down_proj = nn.Linear(inter, hidden, bias=config.mlp_bias)
        self.act_fn = ACTIVATIONS[config.mlp_hidden_act]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for lin in (self.up_proj, self.down_proj):
            nn.init.normal_(lin.weight, mean=0.0, std=self.config.initializer_range)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))

    def step(self, x: torch.Tensor) -> torch.Tensor:
        """The forward for the few rows of a decoding step (``decode_ops``' product forms)."""
        return linear(self.down_proj, self.act_fn(linear(self.up_proj, x)))
