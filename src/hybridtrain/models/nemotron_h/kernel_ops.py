"""The Mamba2 kernels as ``torch.library`` custom ops (``hybridtrain::*``): a fake
implementation (shapes and dtypes) and a registered autograd each, so ``torch.compile`` never
traces into a kernel's Python wrapper (mamba_ssm's autotuned Triton launchers, a C++ extension)
and a compiled Mamba block stays one graph with the real kernels, also under activation
checkpointing. Each op calls the kernel :func:`.kernel_loader.kernel` finds when it runs.

* ``ssd_scan`` / ``ssd_scan_backward``: mamba_ssm's ``_mamba_chunk_scan_combined_fwd`` / ``_bwd``,
  the two calls its own ``MambaChunkScanCombinedFn`` makes (the same signature in 2.2.2 -
  2.3.2.post1), with ``dt_softplus`` and ``dt_limit``; the forward always returns the final state.
* ``ssd_state_update``: ``selective_state_update`` (one decoding token; the state in place).
* ``causal_conv1d`` / ``causal_conv1d_backward`` / ``causal_conv1d_update``: causal_conv1d's C++
  entry points, for releases before 1.5.1 (1.5.1 and later register ``DaoAILab::`` ops of their
  own and are called directly, see :func:`kernels.causal_conv1d`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .kernel_loader import kernel

_EMPTY = (0,)  # the gradient of an absent optional input (a custom op returns tensors only)


# -- the SSD scan ------------------------------------------------------------------------------
@torch.library.custom_op("hybridtrain::ssd_scan", mutates_args=())
def ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor,
             initial_states: Optional[Tensor], seq_idx: Optional[Tensor], chunk_size: int, dt_min: float,
             dt_max: float) -> tuple[Tensor, Tensor]:
    """(y [b, L, h, p] in x's dtype, final state [b, h, p, n] fp32) of mamba_ssm's SSD."""
    out, _, _, _, _, final, *_ = kernel("ssd_fwd")(
        x, dt, A, B, C, chunk_size, D=D, z=None, dt_bias=dt_bias, initial_states=initial_states,
        seq_idx=seq_idx, cu_seqlens=None, dt_softplus=True, dt_limit=(dt_min, dt_max))
    return out.to(x.dtype).contiguous(), final.float().contiguous()


@ssd_scan.register_fake
def _(x, dt, A, B, C, D, dt_bias, initial_states, seq_idx, chunk_size, dt_min, dt_max):
    b, _, h, p = x.shape
    return x.new_empty(x.shape), x.new_empty((b, h, p, B.shape[-1]), dtype=torch.float32)


@torch.library.custom_op("hybridtrain::ssd_scan_backward", mutates_args=())
def ssd_scan_backward(dout: Tensor, dfinal: Optional[Tensor], x: Tensor, dt: Tensor, A: Tensor, B: Tensor,
                      C: Tensor, D: Tensor, dt_bias: Tensor, initial_states: Optional[Tensor],
                      seq_idx: Optional[Tensor], out: Tensor, chunk_size: int, dt_min: float, dt_max: float
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`ssd_scan` for x, dt, A, B, C, D, dt_bias, initial_states (empty when
    there is none)."""
    dx, ddt, dA, dB, dC, dD, _, ddt_bias, dinit = kernel("ssd_bwd")(
        dout, x, dt, A, B, C, out, chunk_size, D=D, z=None, dt_bias=dt_bias, initial_states=initial_states,
        dfinal_states=dfinal, seq_idx=seq_idx, dt_softplus=True, dt_limit=(dt_min, dt_max))
    grads = [_like(g, t) for g, t in zip((dx, ddt, dA, dB, dC, dD, ddt_bias), (x, dt, A, B, C, D, dt_bias))]
    grads.append(x.new_empty(_EMPTY) if initial_states is None else _like(dinit, initial_states))
    return tuple(grads)


@ssd_scan_backward.register_fake
def _(dout, dfinal, x, dt, A, B, C, D, dt_bias, initial_states, seq_idx, out, chunk_size, dt_min, dt_max):
    grads = [t.new_empty(t.shape) for t in (x, dt, A, B, C, D, dt_bias)]
    grads.append(x.new_empty(_EMPTY) if initial_states is None else initial_states.new_empty(initial_states.shape))
    return tuple(grads)


def _like(g: Tensor, t: Tensor) -> Tensor:
    """A kernel's gradient ``g`` for ``t``: t's dtype and shape, contiguous (as the fake says)."""
    return g.to(t.dtype).reshape(t.shape).contiguous()


def _scan_setup(ctx, inputs, output):
    x, dt, A, B, C, D, dt_bias, initial_states, seq_idx, chunk_size, dt_min, dt_max = inputs
    ctx.save_for_backward(x, dt, A, B, C, D, dt_bias, initial_states, seq_idx, output[0])
    ctx.scalars = (chunk_size, dt_min, dt_max)
    ctx.has_initial = initial_states is not None


def _scan_backward(ctx, dout, dfinal):
    x, dt, A, B, C, D, dt_bias, initial_states, seq_idx, out = ctx.saved_tensors
    grads = ssd_scan_backward(dout, dfinal, x, dt, A, B, C, D, dt_bias, initial_states, seq_idx, out,
                              *ctx.scalars)
    dinit = grads[7] if ctx.has_initial else None
    return (*grads[:7], dinit, None, None, None, None)


torch.library.register_autograd("hybridtrain::ssd_scan", _scan_backward, setup_context=_scan_setup)


# -- one decoding token ------------------------------------------------------------------------
@torch.library.custom_op("hybridtrain::ssd_state_update", mutates_args=("state",))
def ssd_state_update(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor) -> Tensor:
    """mamba_ssm's ``selective_state_update`` of ``state`` [b, h, p, n] fp32 (in place) by x [b,
    h, p], dt [b, h] (after softplus and clamp), A [h], B/C [b, g, n], D [h] -> y [b, h, p] fp32.
    Per-head values broadcast over head_dim (stride 0: the kernel's tied-head_dim path); a zero
    ``dt_bias`` (every release reads its strides) and ``dt_softplus=False``."""
    h, p, n = state.shape[1:]
    per_head = lambda t: t[:, None].expand(h, p)  # noqa: E731
    y = kernel("selective_state_update")(
        state, x.float(), dt.float()[..., None].expand(-1, -1, p), A.float()[:, None, None].expand(h, p, n),
        B.float(), C.float(), D=per_head(D.float()), z=None,
        dt_bias=per_head(torch.zeros(h, dtype=torch.float32, device=state.device)), dt_softplus=False)
    return y.float().clone() if y is state or y is x else y.float()


@ssd_state_update.register_fake
def _(state, x, dt, A, B, C, D):
    return x.new_empty(x.shape, dtype=torch.float32)


# -- causal_conv1d before 1.5.1 ----------------------------------------------------------------
@torch.library.custom_op("hybridtrain::causal_conv1d", mutates_args=())
def causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor], seq_idx: Optional[Tensor]) -> Tensor:
    """SiLU(causal depthwise conv) of x [b, d, L] (its layout kept) by causal_conv1d's C++ forward."""
    return kernel("conv_fwd_cpp")(x, weight, bias, seq_idx, None, None, True)


@causal_conv1d.register_fake
def _(x, weight, bias, seq_idx):
    return torch.empty_like(x)


@torch.library.custom_op("hybridtrain::causal_conv1d_backward", mutates_args=())
def causal_conv1d_backward(dout: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                           seq_idx: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias (empty without a bias)) by causal_conv1d's C++ backward."""
    if dout.stride(2) != 1 and dout.stride(1) != 1:
        dout = dout.contiguous()
    dx, dw, db, _ = kernel("conv_bwd_cpp")(x, weight, bias, dout, seq_idx, None, None, None, False, True)
    return dx, dw.to(weight.dtype), x.new_empty(_EMPTY) if bias is None else db.to(bias.dtype)


@causal_conv1d_backward.register_fake
def _(dout, x, weight, bias, seq_idx):
    return (torch.empty_like(x), weight.new_empty(weight.shape),
            x.new_empty(_EMPTY) if bias is None else bias.new_empty(bias.shape))


def _conv_setup(ctx, inputs, output):
    x, weight, bias, seq_idx = inputs
    ctx.save_for_backward(x, weight, bias, seq_idx)
    ctx.has_bias = bias is not None


def _conv_backward(ctx, dout):
    x, weight, bias, seq_idx = ctx.saved_tensors
    dx, dw, db = causal_conv1d_backward(dout, x, weight, bias, seq_idx)
    return dx, dw, db if ctx.has_bias else None, None


torch.library.register_autograd("hybridtrain::causal_conv1d", _conv_backward, setup_context=_conv_setup)


@torch.library.custom_op("hybridtrain::causal_conv1d_update", mutates_args=("conv_state",))
def causal_conv1d_update(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """One token of SiLU(causal depthwise conv): x [b, d] in ``conv_state``'s dtype, the window
    [b, d, k - 1] shifted in place."""
    y = kernel("causal_conv1d_update")(x, conv_state, weight, bias, activation="silu")
    return y.clone() if y is x else y


@causal_conv1d_update.register_fake
def _(x, conv_state, weight, bias):
    return torch.empty_like(x)
