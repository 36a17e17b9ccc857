"""RMSNorm and the gated, grouped RMSNorm of the Mamba2 mixer (fp32 math, as the reference).

Both run through one autograd function that saves only its inputs and the per-group inverse
RMS: the normalised and gated tensors are recomputed in backward (one elementwise pass) instead
of being kept alive for every layer until then.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridtrain.distributed.utils import local_tensor

from .numerics import mul_to, silu_grad


class _RMSNormFunction(torch.autograd.Function):
    """out = rmsnorm over groups of ``group_size`` channels of ``x`` (times ``silu(gate)`` first,
    if given), scaled by ``weight``. Statistics in fp32 (fp64 for fp64 inputs).

    The output dtype follows the reference modules: ``(weight * n).to(x.dtype)`` without a gate
    (NemotronHRMSNorm), ``weight * n.to(x.dtype)`` with one (MambaRMSNormGated); ``out_dtype``
    (e.g. the bf16 of the linear layer it feeds under autocast) replaces it: the product is
    rounded to it as it is written (the same values as a cast after, without the full-size copy)."""

    @staticmethod
    def _normalise(x, gate, group_size, eps=None, rstd=None):
        """(normalised u grouped [..., G, group_size], rstd [..., G, 1]); u = x * silu(gate)."""
        cdt = torch.promote_types(x.dtype, torch.float32)
        if gate is None:
            u = x if x.dtype == cdt else x.to(cdt)
        else:  # (a bf16 x promotes exactly in the product.) The gate's silu is fp32, as the
            # reference's: eager has no fp32 silu of a bf16 tensor without this copy
            u = x * F.silu(gate if gate.dtype == cdt else gate.to(cdt))
        ug = u.view(*u.shape[:-1], -1, group_size)
        if rstd is None:
            rstd = torch.rsqrt(ug.pow(2).mean(-1, keepdim=True) + eps)
        return ug * rstd, rstd

    @staticmethod
    def forward(ctx, x, gate, weight, group_size, eps, out_dtype=None):
        n, rstd = _RMSNormFunction._normalise(x, gate, group_size, eps=eps)
        ctx.save_for_backward(x, gate, weight, rstd)
        ctx.group_size = group_size
        return _RMSNormFunction._scale(n.view(x.shape), x, gate, weight, out_dtype)

    @staticmethod
    def _scale(n, x, gate, weight, out_dtype=None):
        if gate is None:
            a, b, dtype = (weight if weight.dtype == n.dtype else weight.to(n.dtype)), n, x.dtype
        else:
            a, b = weight, (n if n.dtype == x.dtype else n.to(x.dtype))
            dtype = torch.promote_types(a.dtype, b.dtype)
        dtype = out_dtype or dtype
        if dtype == torch.promote_types(a.dtype, b.dtype):
            return a * b
        # computed in the promoted dtype, rounded as it is stored: one kernel, no copy
        return torch.mul(a, b, out=torch.empty(n.shape, dtype=dtype, device=n.device))

    @staticmethod
    def apply_maybe_no_grad(x, gate, weight, group_size, eps, out_dtype=None):
        """``apply``, or the same computation without the autograd node when no gradient is
        wanted (cached decoding: one token per call, where the node costs more than the math)."""
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (gate is not None and gate.requires_grad)):
            return _RMSNormFunction.apply(x, gate, weight, group_size, eps, out_dtype)
        n, _ = _RMSNormFunction._normalise(x, gate, group_size, eps=eps)
        return _RMSNormFunction._scale(n.view(x.shape), x, gate, weight, out_dtype)

    @staticmethod
    def backward(ctx, gout):
        x, gate, weight, rstd = ctx.saved_tensors
        gs = ctx.group_size
        cdt = torch.promote_types(x.dtype, torch.float32)
        # the gate's one fp32 copy in backward, for the recomputed product and the gradients
        gate_c = None if gate is None else gate.to(cdt)
        ng, _ = _RMSNormFunction._normalise(x, gate_c, gs, rstd=rstd)
        n = ng.view(x.shape)
        if torch.promote_types(gout.dtype, cdt) != cdt:
            gout = gout.to(cdt)  # (a bf16 gout promotes exactly in the products below: no copy)
        # the weight's gradient sees what the forward multiplied it with
        gw = (gout * (n if gate is None else n.to(x.dtype).to(cdt))).sum(tuple(range(n.dim() - 1)))
        gn = (gout * weight.to(cdt)).view(ng.shape)
        gu = gn - ng * (gn * ng).mean(-1, keepdim=True)
        if gate is None:
            return mul_to(gu, rstd, x.dtype, inplace=True).view(x.shape), None, gw.to(weight.dtype), None, None, None
        gu = gu.mul_(rstd).view(x.shape)
        gx = mul_to(gu, F.silu(gate_c), x.dtype)
        ggate = mul_to(gu.mul_(x), silu_grad(gate_c), gate.dtype, inplace=True)
        return gx, ggate, gw.to(weight.dtype), None, None, None


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, sequence_parallel=None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``sequence_parallel`` (``distributed.tensor_parallel.SequenceParallel``): ``x`` is this
        rank's part of the sequence; the weight's gradient is summed over the ranks.
        ``out_dtype``: the output's dtype (default x's)."""
        if sequence_parallel is None:
            return self.normalize(x, out_dtype)
        w = sequence_parallel.sum_grad(self.weight)
        return _RMSNormFunction.apply_maybe_no_grad(x, None, w, x.shape[-1], self.eps, out_dtype)

    def normalize(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The forward's computation as a plain method (no module call, so no forward hooks:
        cached decoding calls it on the final norm of an FSDP2 unit it has gathered itself)."""
        return _RMSNormFunction.apply_maybe_no_grad(x, None, self.weight, x.shape[-1], self.eps, out_dtype)


class RMSNormGated(nn.Module):
    """y = weight * rmsnorm_per_group(x * silu(gate)); the gate is applied *before* the norm
    (``norm_before_gate=False`` in mamba_ssm terms), normalised over ``group_size`` channels."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-5):
        super().__init__()
        assert hidden_size % group_size == 0
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``out_dtype``: the output's dtype (default as the reference module's)."""
        # (tensor parallelism: the weight is sharded into whole groups, as x and gate)
        return _RMSNormFunction.apply_maybe_no_grad(x, gate, local_tensor(self.weight), self.group_size, self.eps,
                                                    out_dtype)
