"""Mamba2 mixer of Nemotron-H (parameter names as on the Hub: in_proj, conv1d, dt_bias, A_log, D,
norm, out_proj)."""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from . import context_parallel as cpl
from . import kernels
from .config import NemotronHConfig
from .norms import RMSNormGated


class Mamba2Mixer(nn.Module):
    def __init__(self, config: NemotronHConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.mamba_num_heads
        self.head_dim = config.mamba_head_dim
        self.n_groups = config.n_groups
        self.ssm_state_size = config.ssm_state_size
        self.intermediate_size = config.mamba_intermediate_size
        self.conv_dim = config.mamba_conv_dim
        self.chunk_size = config.chunk_size
        self.dt_limit = config.dt_limit

        # in_proj -> [z (gate) | xBC (conv input) | dt]
        self.in_proj = nn.Linear(
            self.hidden_size, self.intermediate_size + self.conv_dim + self.num_heads, bias=config.use_bias
        )
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, kernel_size=config.conv_kernel, groups=self.conv_dim,
            padding=config.conv_kernel - 1, bias=config.use_conv_bias,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = RMSNormGated(
            self.intermediate_size, group_size=self.intermediate_size // self.n_groups, eps=config.layer_norm_epsilon
        )
        self.out_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=config.use_bias)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The reference initialisation (transformers' ``NemotronHPreTrainedModel._init_weights``)."""
        cfg = self.config
        std = cfg.initializer_range
        for lin in (self.in_proj, self.conv1d):
            nn.init.normal_(lin.weight, mean=0.0, std=std)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        self.A_log.copy_(torch.log(torch.arange(1, self.num_heads + 1, dtype=torch.float32)))
        nn.init.ones_(self.D)
        # dt ~ logUniform[time_step_min, time_step_max], floored; dt_bias = softplus^-1(dt)
        dt = torch.exp(
            torch.rand(self.num_heads, device=self.dt_bias.device)
            * (math.log(cfg.time_step_max) - math.log(cfg.time_step_min))
            + math.log(cfg.time_step_min)
        ).clamp(min=cfg.time_step_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.norm.reset_parameters()
        if self.out_proj.bias is not None:
            nn.init.zeros_(self.out_proj.bias)
        if cfg.rescale_prenorm_residual:
            # GPT-2 style: default Linear init scaled by 1/sqrt(num_layers)
            nn.init.kaiming_uniform_(self.out_proj.weight, a=math.sqrt(5))
            self.out_proj.weight.div_(math.sqrt(cfg.num_hidden_layers))
        else:
            nn.init.normal_(self.out_proj.weight, mean=0.0, std=std)

    def forward(self, hidden_states: torch.Tensor, seq_idx: torch.Tensor | None = None,
                cp: "cpl.CPSlice | None" = None) -> torch.Tensor:
        """``seq_idx`` [b, L]: document ids (state and conv restart at each document). ``cp``:
        this rank's slice of a context-parallel sequence (conv halo and state passing)."""
        b, L, _ = hidden_states.shape
        dtype = hidden_states.dtype
        zxbcdt = self.in_proj(hidden_states)
        z, xBC, dt = zxbcdt.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)

        if cp is None:
            xBC = kernels.causal_conv1d(
                xBC.transpose(1, 2), self.conv1d.weight.squeeze(1), self.conv1d.bias, seq_idx
            ).transpose(1, 2)
        else:
            xBC = cpl.conv_with_halo(xBC, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                     self.config.conv_kernel, cp)
        x, B, C = xBC.split(
            [self.intermediate_size, self.n_groups * self.ssm_state_size, self.n_groups * self.ssm_state_size], dim=-1
        )
        A = -torch.exp(self.A_log.float())
        scan = kernels.ssd_scan if cp is None else functools.partial(cpl.scan_with_state_passing, part=cp)
        y = scan(
            x.reshape(b, L, self.num_heads, self.head_dim),
            dt,
            A,
            B.reshape(b, L, self.n_groups, self.ssm_state_size),
            C.reshape(b, L, self.n_groups, self.ssm_state_size),
            chunk_size=self.chunk_size,
            D=self.D,
            dt_bias=self.dt_bias,
            dt_limit=self.dt_limit,
            seq_idx=seq_idx,
        )
        y = self.norm(y.reshape(b, L, self.intermediate_size), z)
        return self.out_proj(y.to(dtype))
