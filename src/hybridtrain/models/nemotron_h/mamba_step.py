"""One-token steps of the Mamba2 mixer in pure PyTorch (cached decoding, ``Mamba2Mixer.step``):
the causal conv over a window of the previous inputs and the recurrent form of the SSD scan
(``ssd.ssd_reference``'s update), O(1) work and memory per token, which the CUDA kernels behind
``kernels.conv_step`` / ``kernels.ssd_step`` compute too; and :func:`mixer_step_fp32`, the same
step fused for eager fp32 decoding on CPU (chosen by ``ops.backend.cpu_decode_forms``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def conv_step_torch(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """SiLU(depthwise conv) of one token x [b, d] over ``conv_state`` [b, d, k - 1] (the previous
    k - 1 inputs, oldest first; shifted in place). Accumulated in fp32 and rounded to x's dtype
    before the activation, as ``ssd.causal_conv1d_torch``."""
    window = torch.cat([conv_state, x.to(conv_state.dtype)[:, :, None]], dim=-1)  # [b, d, k]
    conv_state.copy_(window[:, :, 1:])
    cdt = torch.promote_types(x.dtype, torch.float32)
    out = (_as(window, cdt) * _as(weight, cdt)).sum(-1)
    if bias is not None:
        out += _as(bias, cdt)
    return F.silu(_as(out, x.dtype))


def ssd_step_torch(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                   B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None) -> torch.Tensor:
    """S = exp(dt A) S + dt x B^T; y = S C + D x for one token. state [b, h, p, n] fp32 (updated
    in place); x [b, h, p]; dt [b, h] (after softplus and clamp); A [h]; B, C [b, g, n], head
    ``i`` reading group ``i // (h / g)``. Returns y [b, h, p] in fp32.

    B and C broadcast over the heads of their group (no repeat per head); the update and the
    read-out are elementwise passes over the state (on CPU a fraction of the time of ``bmm`` /
    ``einsum``, whose products here have one column)."""
    b, h, p, n = state.shape
    g = B.shape[1]
    cdt = state.dtype
    x, dt = _as(x, cdt), _as(dt, cdt)
    decay = torch.exp(dt * _as(A, cdt))  # [b, h]
    state.mul_(decay[:, :, None, None])
    s = state.view(b, g, h // g, p, n)  # a group's heads
    s.addcmul_((dt[:, :, None] * x).view(b, g, h // g, p, 1), _as(B, cdt).view(b, g, 1, 1, n))
    y = (s * _as(C, cdt).view(b, g, 1, 1, n)).sum(-1).view(b, h, p)
    return y if D is None else y.addcmul_(_as(D, cdt)[:, None], x)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without a dispatch when it already is (one-token steps: many tiny ops)."""
    return t if t.dtype == dtype else t.to(dtype)


@dataclass
class StepConstants:
    """A Mamba2 mixer's parameters in the layout :func:`mixer_step_fp32` reads, made once at
    prefill (per step they would cost a few small operators each): ``groups`` B/C groups
    of ``heads`` heads of ``head_dim`` channels, state size ``n``."""

    A: torch.Tensor  # [G, heads] -exp(A_log)
    dt_bias: torch.Tensor  # [G, heads]
    dt_limit: tuple[float, float]
    D: torch.Tensor  # [G, heads, 1]
    conv_w: torch.Tensor  # [G, channels, k]
    conv_b: torch.Tensor | None  # [G, channels]
    norm_w: torch.Tensor  # [G, heads * head_dim]
    eps: float
    head_dim: int
    n: int

    @classmethod
    def make(cls, A_log, dt_bias, dt_limit, D, conv_w, conv_b, norm_w, eps, groups: int, head_dim: int,
             n: int) -> "StepConstants":
        """From the mixer's tensors (``conv_w`` [channels, k], group-major as the conv input)."""
        G = groups
        return cls(A=-torch.exp(A_log.float()).view(G, -1), dt_bias=dt_bias.float().view(G, -1),
                   dt_limit=dt_limit, D=D.float().view(G, -1, 1), conv_w=conv_w.float().view(G, -1, conv_w.shape[-1]),
                   conv_b=None if conv_b is None else conv_b.float().view(G, -1), norm_w=norm_w.view(G, -1),
                   eps=eps, head_dim=head_dim, n=n)


def mixer_step_fp32(zxbcdt: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor,
                    c: StepConstants) -> torch.Tensor:
    """One token of the Mamba2 mixer between its projections, fp32: ``zxbcdt`` [b, G * (z_g |
    x_g B_g C_g | dt_g)] (in_proj's output, group-major), ``conv_state`` [b, conv channels,
    k - 1] and ``state`` [b, h, p, n] updated in place; returns the gated, normalised y [b,
    inner] (out_proj's input). The same operations as :func:`conv_step_torch`,
    :func:`ssd_step_torch` and the gated RMSNorm (bit-identical), on views of [b, G, ...]: no
    copies of the split, no per-step parameter casts."""
    b = zxbcdt.shape[0]
    G, hg = c.A.shape
    gi, n, k = hg * c.head_dim, c.n, c.conv_w.shape[-1]
    zxbcdt = zxbcdt.view(b, G, -1)
    z, xBC, dt = zxbcdt[..., :gi], zxbcdt[..., gi:2 * gi + 2 * n], zxbcdt[..., 2 * gi + 2 * n:]
    # conv over the window of the k - 1 previous inputs and this one
    conv = conv_state.view(b, G, -1, k - 1)
    window = torch.cat([conv, xBC[..., None]], dim=-1)
    conv.copy_(window[..., 1:])
    xBC = (window * c.conv_w).sum(-1)
    if c.conv_b is not None:
        xBC += c.conv_b
    xBC = F.silu(xBC, inplace=True)
    x = xBC[..., :gi].view(b, G, hg, c.head_dim)
    B, C = xBC[..., None, None, gi:gi + n], xBC[..., None, None, gi + n:]  # [b, G, 1, 1, n]
    # the SSM update and read-out (a group's heads share B and C)
    dt = F.softplus(dt + c.dt_bias)
    lo, hi = c.dt_limit
    dt = dt.clamp_(min=lo) if hi == float("inf") else dt.clamp_(min=lo, max=hi)
    s = state.view(b, G, hg, c.head_dim, n)
    s.mul_(torch.exp(dt * c.A)[..., None, None])
    s.addcmul_((dt[..., None] * x)[..., None], B)
    y = (s * C).sum(-1).addcmul_(c.D, x).view(b, G, gi)
    # gated RMSNorm per group: weight * rmsnorm(y * silu(z))
    u = y.mul_(F.silu(z))
    u = u.mul_(u.pow(2).mean(-1, keepdim=True).add_(c.eps).rsqrt_())
    return (c.norm_w * u).view(b, G * gi)
