"""No full-size fp32 copies beside bf16 twins: the forms that skip a cast give the same values as
the cast they replace (forward and backward, bit for bit), and a bf16 forward + backward of the
tiny model stays as close to its fp32 reference as it was with the casts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config
from hybridtrain.models.nemotron_h.model import Block
from hybridtrain.models.nemotron_h.moe import gate_weighted_sum, permute
from hybridtrain.models.nemotron_h.norms import _RMSNormFunction
from hybridtrain.models.nemotron_h.ssd import _ScanInputs, causal_conv1d_torch
from hybridtrain.ops.loss import chunk_softmax_grad

BF16 = torch.bfloat16


def _grads(fn, *inputs, gout):
    xs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*xs)
    out.backward(gout)
    return out.detach(), [t.grad for t in xs]


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_norm_written_in_the_consumer_dtype_equals_the_cast_after(gated, x_dtype):
    """``out_dtype=bf16`` (the norm feeding a bf16 GEMM) == the default output cast to bf16, and
    the gradients of x, gate and weight are bit-identical (the bf16 output gradient promotes
    exactly, as autocast's cast would pass it back)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 16, generator=g).to(x_dtype)
    gate = torch.randn(2, 5, 16, generator=g).to(torch.bfloat16) if gated else None
    w = 1 + 0.1 * torch.randn(16, generator=g)
    gout = torch.randn(2, 5, 16, generator=g).to(torch.bfloat16)
    group = 8 if gated else 16

    def today(x, w, *gate):
        return _RMSNormFunction.apply(x, gate[0] if gate else None, w, group, 1e-5).to(torch.bfloat16)

    def direct(x, w, *gate):
        return _RMSNormFunction.apply(x, gate[0] if gate else None, w, group, 1e-5, torch.bfloat16)

    extra = (gate,) if gated else ()
    ref, ref_grads = _grads(today, x, w, *extra, gout=gout)
    out, grads = _grads(direct, x, w, *extra, gout=gout)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    for a, b in zip(grads, ref_grads):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_gate_weighted_sum_of_bf16_outputs_equals_the_fp32_copy_form():
    """The MoE combine without an fp32 copy of the experts' outputs: bit-identical to
    ``(y.float() * w).sum(1)``, forward and both gradients."""
    g = torch.Generator().manual_seed(0)
    y = torch.randn(6, 3, 8, generator=g).to(torch.bfloat16)
    w = torch.rand(6, 3, generator=g)
    gout = torch.randn(6, 8, generator=g)
    ref, ref_grads = _grads(lambda y, w: (y.float() * w[:, :, None]).sum(1), y, w, gout=gout)
    out, grads = _grads(gate_weighted_sum, y, w, gout=gout)
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    for a, b in zip(grads, ref_grads):
        assert a.dtype == b.dtype and torch.equal(a, b)


# relative errors of the bf16 autocast forward + backward against the fp32 one (one thread),
# measured on the path with the casts (at b3b42a8: loss 6.3e-6, logits 4.8e-3, gradients 6.4e-3;
# the path without them gave the same tensors bit for bit), times 1.5
BF16_BOUNDS = {"loss": 9.5e-6, "logits": 7.2e-3, "grads": 9.6e-3}


def _relative_errors(model, ids):
    def run(autocast):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids)
            loss = model(input_ids=ids, labels=ids)
        loss.backward()
        return loss.detach(), logits.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    ref, bf16 = run(False), run(True)
    return {name: ((b.float() - r).norm() / r.norm()).item()
            for name, r, b in zip(("loss", "logits", "grads"), ref, bf16)}


def test_bf16_step_of_the_tiny_model_stays_near_fp32():
    """A bf16 (autocast) forward + backward of the tiny MoE model (Mamba, attention, MLP, MoE
    layers) against its fp32 run: loss, logits and all gradients within 1.5x of the errors the
    path with the full-size casts had."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = NemotronHForCausalLM(tiny_config("moe", vocab_size=128, hidden_size=32, intermediate_size=64,
                                             moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
                                             mamba_num_heads=4, n_routed_experts=4))
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    try:
        errors = _relative_errors(model, ids)
    finally:
        torch.set_num_threads(threads)
    print("\n[bf16 vs fp32] relative errors " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    for name, bound in BF16_BOUNDS.items():
        assert errors[name] <= bound, (name, errors[name], bound)


def test_bf16_logit_gradient_written_by_the_product_equals_the_cast_after():
    """The loss's chunk gradient (softmax - onehot, per-row weights) in bf16: the product that
    rounds as it stores gives the fp32 gradient cast to bf16, bit for bit."""
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(6, 16, generator=g).to(BF16), torch.randn(40, 16, generator=g).to(BF16)
    labels, rows = torch.randint(0, 40, (6,), generator=g), torch.rand(6, generator=g)
    lse, target, grad = chunk_softmax_grad(h, w, labels, rows)
    logits = (h @ w.t()).float()
    ref = torch.softmax(logits, -1) * rows[:, None]
    ref[torch.arange(6), labels] -= rows
    assert grad.dtype == BF16
    torch.testing.assert_close(grad.float(), ref.to(BF16).float(), rtol=0, atol=2 ** -20)
    _, _, fp32_grad = chunk_softmax_grad(h.float(), w.float(), labels, rows)  # the fp32 path, in place
    assert fp32_grad.dtype == torch.float32


@pytest.mark.parametrize("seq", [False, True])
def test_conv_of_bf16_inputs_without_an_fp32_copy_equals_the_copy_form(seq):
    """The Mamba conv on a bf16 input promotes it inside the fp32 products: the output (rounded
    before the SiLU) and the gradients are those of the conv on the input's fp32 copy."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 12, generator=g).to(BF16).transpose(1, 2)  # [b, d, L], channels-last
    w, b = torch.randn(12, 4, generator=g), torch.randn(12, generator=g)
    seq_idx = torch.tensor([[0] * 4 + [1] * 5] * 2) if seq else None
    gout = torch.randn(2, 12, 9, generator=g).to(BF16)
    out, (gx, gw, gb) = _grads(lambda x, w, b: causal_conv1d_torch(x, w, b, seq_idx), x, w, b, gout=gout)
    pre = causal_conv1d_torch(x.float(), w, b, seq_idx, activation=None)
    assert torch.equal(out, F.silu(pre.to(BF16)))

    def on_the_copy(x, w, b):  # gradients of the old form: x's fp32 copy, rounded at the end
        return causal_conv1d_torch(x.float(), w, b, seq_idx)
    _, (rx, rw, rb) = _grads(on_the_copy, x, w, b, gout=gout.float())
    assert gx.dtype == BF16 and torch.equal(gx, rx) and torch.equal(gw, rw) and torch.equal(gb, rb)


def test_scan_inputs_gradient_of_x_is_one_fp32_sum_rounded_once():
    """(x * dt, x * D): fp32 gradients bit-identical to autograd's; for a bf16 x, x's gradient
    is the fp32 sum of both terms rounded once (autograd rounded each term, then summed in bf16)."""
    g = torch.Generator().manual_seed(0)
    x, dt, D = torch.randn(2, 5, 3, 4, generator=g), torch.rand(2, 5, 3, generator=g), torch.randn(3, generator=g)
    gxdt, gxD = torch.randn(2, 5, 3, 4, generator=g), torch.randn(2, 5, 3, 4, generator=g)

    def run(fn, x):
        xs = [t.clone().requires_grad_() for t in (x, dt, D)]
        a, b = fn(*xs)
        torch.autograd.backward([a, b], [gxdt, gxD])
        return [t.grad for t in xs]

    plain = lambda x, dt, D: (x * dt[..., None], x * D[None, None, :, None])  # noqa: E731
    for got, ref in zip(run(_ScanInputs.apply, x), run(plain, x)):
        assert torch.equal(got, ref)
    gx = run(_ScanInputs.apply, x.to(BF16))[0]
    assert gx.dtype == BF16
    assert torch.equal(gx, (gxD * D[None, None, :, None] + gxdt * dt[..., None]).to(BF16))


def test_token_copies_gathered_in_bf16_sum_their_gradients_in_fp32():
    """The MoE's k copies of each token, made in bf16 from the cast tokens: the same rows as the
    cast of the fp32 copies; each token's gradient the fp32 sum of its copies' gradients and of
    its cast's (the shared expert's input)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 8, generator=g)
    idx = torch.stack([torch.randperm(5, generator=g)[:3] for _ in range(7)])
    gout = torch.randn(21, 8, generator=g).to(BF16)
    gcast = torch.randn(7, 8, generator=g).to(BF16)
    order = permute(x, idx, 5)[1]
    xs = x.clone().requires_grad_()
    sorted_x, _, _, x_cast = permute(xs, idx, 5, BF16)
    torch.autograd.backward([sorted_x, x_cast], [gout, gcast])
    assert sorted_x.dtype == x_cast.dtype == BF16 and torch.equal(x_cast, x.to(BF16))
    assert torch.equal(sorted_x, x_cast[order // 3])
    ref = torch.zeros(7, 8).index_add_(0, order // 3, gout.float()) + gcast.float()  # in fp32
    assert xs.grad.dtype == torch.float32
    torch.testing.assert_close(xs.grad, ref, rtol=1e-6, atol=1e-6)


class Conversions(TorchDispatchMode):
    """Every fp32 <-> bf16 conversion the code asks for (``_to_copy``, ``copy_`` across the two
    dtypes; autocast's casts and autograd's included, both sit above the Python dispatch key),
    as (source dtype, shape). An op on mixed dtypes that converts as it loads is not one."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default:
            src, dst = args[0].dtype, out.dtype
        elif func is torch.ops.aten.copy_.default:
            src, dst = args[1].dtype, args[0].dtype
        else:
            return out
        if {src, dst} == {torch.float32, BF16}:
            self.seen.append((src, tuple(out.shape)))
        return out


def _block_step_conversions(cfg, kind: str, x: torch.Tensor):
    """The conversions of one bf16-autocast forward + backward of a ``kind`` block on ``x``
    (fp32, as the residual stream), and the block's parameter shapes."""
    torch.manual_seed(0)
    block = Block(cfg, cfg.layers_block_type.index(kind))
    with Conversions() as rec:
        with torch.autocast("cpu", dtype=BF16):
            y = block(x.clone().requires_grad_())
        y.square().sum().backward()
    return rec.seen, [tuple(p.shape) for p in block.parameters()]


def test_moe_block_converts_tokens_not_their_copies_and_each_weight_once_per_micro_batch():
    """One MoE block, bf16 autocast, forward + backward: each stacked expert weight is cast to
    bf16 once (not per expert, not per use) and its gradient once back; the activations are
    converted only at the size of the tokens (one cast for the routed and the shared experts,
    the shared expert's output gradient at the residual sum), never at the size of their k
    routed copies."""
    cfg = tiny_config("moe", hidden_size=32, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
                      n_routed_experts=4, num_experts_per_tok=2)
    x = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(0))
    seen, params = _block_step_conversions(cfg, "moe", x)
    for stacked in [(4, 16, 32), (4, 32, 16)]:
        assert seen.count((torch.float32, stacked)) == 1 and seen.count((BF16, stacked)) == 1, seen
    acts = [s for _, s in seen if s not in params]
    tokens = 2 * 24 * 32
    assert len(acts) <= 2 and max(torch.Size(s).numel() for s in acts) <= tokens, acts


def test_mamba_block_converts_only_at_its_fp32_islands():
    """One Mamba block, bf16 autocast, forward + backward, chunk 16 > head dim 8 (as in the real
    models): no conversion larger than the conv's input, and 12.75x the scan input's elements
    in all (before the changes of 2026-11-26: 30.75x, the largest twice the scan input: the
    in-chunk decay products). What is left, each needed: the bf16 operands of the scan's GEMMs
    (x dt, the start states, their gradients), B's fp32 copy for the fp32 chunk states, the
    gate's fp32 copy for the reference's fp32 SiLU (forward, backward), the rounding of
    fp32-accumulated gradients (conv input, B, C, the start states) and dt's small casts."""
    cfg = tiny_config("mixed", hidden_size=32, mamba_num_heads=4, mamba_head_dim=8, n_groups=1,
                      ssm_state_size=8, chunk_size=16)
    x = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(0))
    seen, params = _block_step_conversions(cfg, "linear_attention", x)
    sizes = [torch.Size(s).numel() for _, s in seen if s not in params]
    scan_input, conv_input = 2 * 64 * 4 * 8, 2 * 64 * (32 + 2 * 8)
    assert max(sizes) <= conv_input and sum(sizes) <= 12.75 * scan_input, sorted(sizes)
