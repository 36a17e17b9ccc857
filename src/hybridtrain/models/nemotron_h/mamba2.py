"""Mamba2 mixer of Nemotron-H (parameter names as on the Hub: in_proj, conv1d, dt_bias, A_log, D,
norm, out_proj).

Row order: the Hub holds ``in_proj``'s output rows as ``[z | x | B | C | dt]`` and ``conv1d``'s
channels as ``[x | B | C]``. We hold both group by group (``[z_g | x_g | B_g | C_g | dt_g]`` and
``[x_g | B_g | C_g]`` for each B/C group ``g``; :func:`group_major_rows`), so that splitting them
into equal row blocks gives whole groups with their heads (tensor parallelism); ``hf_io`` maps
to and from the Hub's order. With ``n_groups = 1`` the two orders are the same. ``dt_bias``,
``A_log``, ``D``, the gated norm and ``out_proj``'s columns are group-major in both.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from hybridtrain.distributed.utils import local_tensor

from . import context_parallel as cpl
from . import kernels
from .config import NemotronHConfig
from .norms import RMSNormGated


def group_major_rows(config: NemotronHConfig, conv: bool = False) -> torch.Tensor:
    """For each of our rows of ``in_proj`` (``conv``: of ``conv1d``), its row in the Hub's order."""
    G, N = config.n_groups, config.ssm_state_size
    inner, heads = config.mamba_intermediate_size, config.mamba_num_heads
    # (first Hub row of the part, rows per group) for z, x, B, C, dt (conv1d: x, B, C)
    parts = [(0, inner // G), (inner, inner // G), (2 * inner, N), (2 * inner + G * N, N),
             (2 * inner + 2 * G * N, heads // G)]
    if conv:
        parts = [(start - inner, width) for start, width in parts[1:4]]
    return torch.cat([torch.arange(start + g * width, start + (g + 1) * width)
                      for g in range(G) for start, width in parts])


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
        # per B/C group: channels of z (and of x), heads (the local group count follows from the
        # local in_proj under tensor parallelism)
        self.group_inner = self.intermediate_size // self.n_groups
        self.group_heads = self.num_heads // self.n_groups

        # in_proj -> per group [z_g (gate) | x_g B_g C_g (conv input) | dt_g]
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
        for lin, conv in ((self.in_proj, False), (self.conv1d, True)):
            nn.init.normal_(lin.weight, mean=0.0, std=std)
            # drawn in the Hub's row order, then held in ours: a seed gives the same model
            lin.weight.copy_(lin.weight[group_major_rows(cfg, conv).to(lin.weight.device)])
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

    def project(self, hidden_states: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``in_proj`` of [..., hidden] -> (z [..., inner], conv input xBC [..., conv channels],
        dt [..., heads]) for the groups this rank holds, each in the order its consumer reads
        (z and dt head-major, xBC the conv1d's group-major channels)."""
        return self.project_output(self.in_proj(hidden_states))

    def project_output(self, zxbcdt: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The split of ``in_proj``'s output (:meth:`project`)."""
        gi, n = self.group_inner, self.ssm_state_size
        lead = zxbcdt.shape[:-1]
        # [..., groups, z_g | x_g B_g C_g | dt_g]
        zxbcdt = zxbcdt.view(*lead, -1, 2 * gi + 2 * n + self.group_heads)
        z, xBC, dt = zxbcdt.split([gi, gi + 2 * n, self.group_heads], dim=-1)
        return z.reshape(*lead, -1), xBC.reshape(*lead, -1), dt.reshape(*lead, -1)

    def split_conv_output(self, xBC: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """conv output [..., conv channels] -> x [..., heads, head_dim], B and C [..., groups,
        state]."""
        gi, n = self.group_inner, self.ssm_state_size
        x, B, C = xBC.view(*xBC.shape[:-1], -1, gi + 2 * n).split([gi, n, n], dim=-1)
        return x.reshape(*xBC.shape[:-1], -1, self.head_dim), B, C

    def forward(self, hidden_states: torch.Tensor, seq_idx: torch.Tensor | None = None,
                cp: "cpl.CPSlice | None" = None) -> torch.Tensor:
        """``seq_idx`` [b, L]: document ids (state and conv restart at each document). ``cp``:
        this rank's slice of a context-parallel sequence (conv halo and state passing)."""
        b, L, _ = hidden_states.shape
        dtype = hidden_states.dtype
        z, xBC, dt = self.project(hidden_states)
        conv_w, conv_b = local_tensor(self.conv1d.weight).squeeze(1), local_tensor(self.conv1d.bias)
        if cp is None:
            xBC = kernels.causal_conv1d(xBC.transpose(1, 2), conv_w, conv_b, seq_idx).transpose(1, 2)
        else:
            xBC = cpl.conv_with_halo(xBC, conv_w, conv_b, self.config.conv_kernel, cp)
        x, B, C = self.split_conv_output(xBC)
        scan = kernels.ssd_scan if cp is None else functools.partial(cpl.scan_with_state_passing, part=cp)
        y = scan(
            x, dt, -torch.exp(local_tensor(self.A_log).float()), B, C,
            chunk_size=self.chunk_size,
            D=local_tensor(self.D),
            dt_bias=local_tensor(self.dt_bias),
            dt_limit=self.dt_limit,
            seq_idx=seq_idx,
        )
        y = self.norm(y.reshape(b, L, -1), z)
        return self.out_proj(y.to(dtype))
