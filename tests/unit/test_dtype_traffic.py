"""No full-size fp32 copies beside bf16 twins: the forms that skip a cast give the same values as
the cast they replace (forward and backward, bit for bit), and a bf16 forward + backward of the
tiny model stays as close to its fp32 reference as it was with the casts."""

from __future__ import annotations

import pytest
import torch

from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config
from hybridtrain.models.nemotron_h.moe import gate_weighted_sum
from hybridtrain.models.nemotron_h.norms import _RMSNormFunction


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
