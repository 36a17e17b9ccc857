"""The hand-written autograd functions of the model (norms, causal conv, SSD intra-chunk block)
against plain autograd: gradcheck in fp64, and fp32 equality with the composed reference."""

import pytest
import torch
import torch.nn.functional as F

from hybridtrain.models.nemotron_h.norms import _RMSNormFunction


def _reference_rmsnorm(x, gate, weight, group_size, eps):
    dtype = x.dtype
    u = x.float() if x.dtype != torch.float64 else x
    if gate is not None:
        u = u * F.silu(gate.to(u.dtype))
    ug = u.view(*u.shape[:-1], -1, group_size)
    n = (ug * torch.rsqrt(ug.pow(2).mean(-1, keepdim=True) + eps)).view(x.shape)
    if gate is None:
        return (weight.to(n.dtype) * n).to(dtype)
    return weight * n.to(dtype)


@pytest.mark.parametrize("gated", [False, True])
def test_rmsnorm_function_gradcheck(gated):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    gate = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True) if gated else None
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    gs = 4 if gated else 8
    assert torch.autograd.gradcheck(lambda *a: _RMSNormFunction.apply(a[0], a[1] if gated else None, a[-1], gs, 1e-5),
                                    (x, gate, w) if gated else (x, w), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_function_matches_reference(gated, dtype):
    torch.manual_seed(0)
    x0 = torch.randn(3, 5, 16).to(dtype)
    g0 = torch.randn(3, 5, 16).to(dtype) if gated else None
    w0 = torch.randn(16)
    gs = 4 if gated else 16
    grads = []
    for fn in (_RMSNormFunction.apply, _reference_rmsnorm):
        x = x0.clone().requires_grad_()
        g = g0.clone().requires_grad_() if gated else None
        w = w0.clone().requires_grad_()
        out = fn(x, g, w, gs, 1e-5)
        out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape).to(out.dtype))
        grads.append((out.detach(), out.dtype, x.grad, g.grad if gated else None, w.grad))
    (o1, d1, *g1), (o2, d2, *g2) = grads
    assert d1 == d2
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(o1, o2, **tol)
    for a, b in zip(g1, g2):
        if a is not None:
            torch.testing.assert_close(a, b, **tol)


def _reference_conv(x, weight, bias, seq_idx, silu=True):
    """Per-tap masked shifts, composed from plain autograd ops."""
    d, k = weight.shape
    L = x.shape[-1]
    out = x * weight[:, k - 1, None]
    for shift in range(1, k):
        xs = F.pad(x, (shift, 0))[..., :L]
        if seq_idx is not None:
            prev = F.pad(seq_idx, (shift, 0), value=-1)[:, :L]
            xs = xs * (prev == seq_idx).to(x.dtype)[:, None, :]
        else:
            xs = xs * (torch.arange(L) >= shift).to(x.dtype)
        out = out + xs * weight[:, k - 1 - shift, None]
    if bias is not None:
        out = out + bias[:, None]
    return F.silu(out) if silu else out


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("L", [3, 11])
def test_causal_conv_function(packed, L):
    from hybridtrain.models.nemotron_h.ssd import _CausalConv1d

    torch.manual_seed(0)
    seq_idx = torch.tensor([[0] * (L // 2) + [1] * (L - L // 2), [0] * (L - 2) + [3] * 2]) if packed else None
    args = [torch.randn(2, 5, L, dtype=torch.float64, requires_grad=True),
            torch.randn(5, 4, dtype=torch.float64, requires_grad=True),
            torch.randn(5, dtype=torch.float64, requires_grad=True)]
    assert torch.autograd.gradcheck(lambda x, w, b: _CausalConv1d.apply(x, w, b, seq_idx, True), args)
    # fp32 against composed autograd, channel-last strides as in the model
    x0 = torch.randn(2, L, 5).transpose(1, 2)
    outs = []
    for fn in (lambda *a: _CausalConv1d.apply(*a, True), _reference_conv):
        x, w, b = x0.clone().requires_grad_(), args[1].detach().float().requires_grad_(), args[2].detach().float().requires_grad_()
        y = fn(x.transpose(1, 2).contiguous().transpose(1, 2) if fn is _reference_conv else x, w, b, seq_idx)
        y.backward(torch.cos(torch.arange(y.numel(), dtype=torch.float32)).view(y.shape))
        outs.append((y.detach(), x.grad, w.grad, b.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_ssd_scan_gradcheck(packed, with_state):
    """The whole chunked scan (hand-written chunk backward + autograd state passing) in fp64:
    L = 11 with chunk 4 (padding), documents crossing chunk boundaries, initial/final state, two
    heads per B/C group. Head dim and state size are the smallest that are not 1 (the cost is
    one forward per input element and one backward per output element)."""
    from hybridtrain.models.nemotron_h.ssd import ssd_chunked

    torch.manual_seed(0)
    b, L, h, p, g, n = 2, 11, 4, 2, 2, 2
    x = torch.randn(b, L, h, p, dtype=torch.float64, requires_grad=True)
    dt = (torch.rand(b, L, h, dtype=torch.float64) * 0.5 + 0.05).requires_grad_()
    A = (-torch.rand(h, dtype=torch.float64) - 0.2).requires_grad_()
    B = torch.randn(b, L, g, n, dtype=torch.float64, requires_grad=True)
    C = torch.randn(b, L, g, n, dtype=torch.float64, requires_grad=True)
    D = torch.randn(h, dtype=torch.float64, requires_grad=True)
    seq_idx = torch.tensor([[0] * 3 + [1] * 6 + [2] * 2, [5] * 9 + [6] * 2]) if packed else None
    init = torch.randn(b, h, p, n, dtype=torch.float64, requires_grad=True) if with_state else None

    def fn(x, dt, A, B, C, D, *rest):
        y, final = ssd_chunked(x, dt, A, B, C, 4, D=D, seq_idx=seq_idx, initial_state=rest[0] if rest else None,
                               return_final_state=True)
        return y, final

    args = (x, dt, A, B, C, D) + ((init,) if with_state else ())
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-6)


def test_compiled_blocks_match_eager():
    """``training.compile`` compiles each block; the hand-written autograd functions trace
    (aot_eager: no C++ compiler needed) and give the eager results on packed rows."""
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config

    torch.manual_seed(0)
    cfg = tiny_config("mixed")
    model = NemotronHForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 40))
    cu = torch.tensor([0, 15, 40, 60, 80], dtype=torch.int32)
    results = []
    for compiled in (False, True):
        if compiled:
            for block in model.backbone.layers.values():
                block.compile(backend="aot_eager")
        model.zero_grad(set_to_none=True)
        out = model(ids, cu_seqlens=cu)
        out.float().pow(2).mean().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (o1, g1), (o2, g2) = results
    torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-6)
    assert g1.keys() == g2.keys()
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_base2_exponential_is_exp(dtype):
    """The loss's base-2 exponential (``2^(x log2 e)``, in place for fp32 logits) is
    ``exp(logits - shift)``: to the last bits in fp64; in fp32 within ``|logits - shift|`` ulp
    (the rounding of the exponent's argument, as for ``torch.exp`` of the rounded difference)."""
    from hybridtrain.ops.loss import _exp_shifted

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g, dtype=dtype) * 8
    shift = logits.amax(-1, keepdim=True).to(torch.float64 if dtype == torch.float64 else torch.float32)
    ref = (logits.double() - shift.double()).exp()
    got = _exp_shifted(logits.clone(), shift)
    assert got.dtype == dtype and got.shape == logits.shape
    spread = float((logits.double() - shift.double()).abs().max()) + 1
    tol = {torch.float64: 1e-13, torch.float32: spread * torch.finfo(torch.float32).eps}[dtype]
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=1e-30)
