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
from hybridtrain.ops import backend

from . import context_parallel as cpl
from . import kernels, mamba_step
from .cache import MambaState
from .config import NemotronHConfig
from .norms import RMSNormGated
from .numerics import matmul_dtype
from .decode_ops import linear, plain_linear


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
        # the norm writes out_proj's input dtype (bf16 under autocast), not fp32 for a cast after
        return self.out_proj(self.norm(y.reshape(b, L, -1), z, matmul_dtype(hidden_states)))

    # ------------------------------------------------------------------ cached decoding
    def prefill(self, hidden_states: torch.Tensor, seq_idx: torch.Tensor | None,
                valid: torch.Tensor | None) -> tuple[torch.Tensor, MambaState]:
        """The forward over a prompt [b, L, H] (``seq_idx``: left padding and prompt as two
        documents; ``valid`` [b, L]: the prompt's positions, None: all), returning also the
        decoding state: the conv window (zeros where the padding was) and the final SSM state."""
        z, xBC, dt = self.project(hidden_states)
        k = self.conv1d.weight.shape[-1]
        window = xBC if valid is None else xBC.masked_fill(~valid[..., None], 0)
        window = window[:, -(k - 1):].transpose(1, 2) if k > 1 else window[:, :0].transpose(1, 2)
        if window.shape[-1] < k - 1:  # a prompt shorter than the window: zeros before it
            window = torch.nn.functional.pad(window, (k - 1 - window.shape[-1], 0))
        xBC = kernels.causal_conv1d(xBC.transpose(1, 2), local_tensor(self.conv1d.weight).squeeze(1),
                                    local_tensor(self.conv1d.bias), seq_idx).transpose(1, 2)
        x, B, C = self.split_conv_output(xBC)
        y, ssm = kernels.ssd_scan(
            x, dt, -torch.exp(local_tensor(self.A_log).float()), B, C, chunk_size=self.chunk_size,
            D=local_tensor(self.D), dt_bias=local_tensor(self.dt_bias), dt_limit=self.dt_limit,
            seq_idx=seq_idx, return_final_state=True,
        )
        state = MambaState(conv=window.contiguous(), ssm=ssm.float().contiguous(),
                           step=self._fused_step_constants(hidden_states))
        return self.out_proj(self.norm(y.reshape(z.shape), z, matmul_dtype(hidden_states))), state

    def step(self, hidden_states: torch.Tensor, state: MambaState) -> torch.Tensor:
        """One token per row, hidden_states [b, 1, H] -> [b, 1, H]; ``state`` is updated in
        place (no shape changes: a captured CUDA graph replays it)."""
        y = self._recur(linear(self.in_proj, hidden_states[:, 0]), state, hidden_states)
        return linear(self.out_proj, y)[:, None]

    def verify(self, hidden_states: torch.Tensor, state: MambaState
               ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """``T`` new tokens per row at once, hidden_states [b, T, H] -> [b, T, H] (speculative
        verification): the projections over all ``T``, the conv and SSM recurrence token after
        token from ``state`` (updated in place, as ``T`` steps would); returns also the (conv,
        ssm) state after each token, to roll back to."""
        zxbcdt = linear(self.in_proj, hidden_states)
        ys, states = [], []
        for i in range(hidden_states.shape[1]):
            ys.append(self._recur(zxbcdt[:, i], state, hidden_states))
            states.append((state.conv.clone(), state.ssm.clone()))
        return linear(self.out_proj, torch.stack(ys, dim=1)), states

    def _recur(self, zxbcdt: torch.Tensor, state: MambaState, hidden_states: torch.Tensor) -> torch.Tensor:
        """One token between the projections: in_proj's output [b, D] -> out_proj's input [b,
        inner] in ``hidden_states``' dtype, ``state`` updated in place."""
        if state.step is not None and backend.cpu_decode_forms(hidden_states):
            # the fused fp32 CPU form, its constants made at prefill (bit-identical to the below)
            return mamba_step.mixer_step_fp32(zxbcdt, state.conv, state.ssm, state.step)
        z, xBC, dt = self.project_output(zxbcdt)
        xBC = kernels.conv_step(xBC, state.conv, local_tensor(self.conv1d.weight).squeeze(1),
                                local_tensor(self.conv1d.bias))
        x, B, C = self.split_conv_output(xBC)
        y = kernels.ssd_step(
            state.ssm, x, dt, -torch.exp(local_tensor(self.A_log).float()), B, C,
            D=local_tensor(self.D), dt_bias=local_tensor(self.dt_bias), dt_limit=self.dt_limit,
        )
        y = self.norm(y.reshape(z.shape), z)
        return y.to(hidden_states.dtype)

    def _fused_step_constants(self, x: torch.Tensor) -> mamba_step.StepConstants | None:
        """The parameters for :func:`mamba_step.mixer_step_fp32` where ``ops.backend`` chooses the
        fp32 CPU decoding forms for ``x`` and the mixer is plain (not LoRA, not tensor-parallel)."""
        if not (backend.cpu_decode_forms(x) and plain_linear(self.in_proj) and plain_linear(self.out_proj)
                and type(self.norm) is RMSNormGated and self.conv1d.weight.shape[-1] > 1
                and all(local_tensor(p) is p and p.dtype == torch.float32
                        for p in (self.in_proj.weight, self.conv1d.weight, self.A_log, self.D, self.dt_bias,
                                  self.norm.weight))):
            return None
        return mamba_step.StepConstants.make(
            self.A_log, self.dt_bias, self.dt_limit, self.D, self.conv1d.weight.squeeze(1), self.conv1d.bias,
            self.norm.weight, self.norm.eps, groups=self.n_groups, head_dim=self.head_dim, n=self.ssm_state_size)
