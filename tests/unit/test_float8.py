"""``training.float8``: which Linear layers torchao's float8 training takes on a Nano-shaped
tiny model, training that stays close to the high-precision run, and weights (state dicts,
checkpoints) that stay high-precision, so a run moves between float8 and bf16 freely."""

from __future__ import annotations

import pytest
import torch

from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config
from hybridtrain.models.nemotron_h.moe import Experts
from hybridtrain.models.spec import model_spec_for
from hybridtrain.training.float8 import block_names, convert_to_float8, plan_float8

pytest.importorskip("torchao.float8")

# Nemotron 3 Nano's layer mix (Mamba2, MoE, attention), at dims that are multiples of 16
NANO_PATTERN = "MEMEM*EMEM*EME"


def _nano(seed: int = 0) -> NemotronHForCausalLM:
    torch.manual_seed(seed)
    return NemotronHForCausalLM(tiny_config("moe", hybrid_override_pattern=NANO_PATTERN,
                                            mamba_num_heads=16, mamba_head_dim=8))


def _blocks(model):
    return block_names(model, model_spec_for(model).pipeline.layers(model))


def test_coverage_on_the_nano_shaped_model():
    model = _nano()
    blocks = _blocks(model)
    plan = plan_float8(model, blocks, expert_modules=(Experts,))
    inner = [n for n in plan.converted + list(plan.kept)
             if not n.startswith((blocks[0] + ".", blocks[-1] + ".")) and n != "lm_head"]
    assert sorted(plan.converted) == sorted(inner)  # every Linear of the inner blocks
    kinds = {n.rsplit(".", 1)[-1] for n in plan.converted}
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj",
            "up_proj", "down_proj"} <= kinds
    assert plan.kept["lm_head"] == "outside the blocks"
    assert all(plan.kept[n] == "in the first or last block" for n in plan.kept if n != "lm_head")
    assert len(plan.converted) == 28 and len(plan.kept) == 5
    # the routed experts: all but the last block's (the first block is Mamba)
    assert plan.experts == [f"backbone.layers.{i}.mixer.experts" for i in (1, 3, 6, 8, 11)]
    assert plan.experts_kept == {"backbone.layers.13.mixer.experts": "in the first or last block"}
    assert all(".experts." not in n for n in plan.other_weights)
    assert "28 of 33 converted" in plan.summary("rowwise") and "5 of 6 converted" in plan.summary("rowwise")
    off = plan_float8(model, blocks, expert_modules=(Experts,), experts_off="on this device")
    assert not off.experts and list(off.experts_kept.values()).count("on this device") == 5
    # the filter replaces the default: the end blocks convert, attention stays high-precision
    custom = plan_float8(model, blocks, keep=[r"\.(q|k|v|o)_proj$"])
    assert any(n.startswith(blocks[0] + ".") for n in custom.converted)
    assert not any(n.endswith("q_proj") for n in custom.converted)
    with pytest.raises(ValueError, match="training.float8_filter"):
        plan_float8(model, blocks, keep="q_proj")


def _train(model, steps: int = 4, seed: int = 0) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 256, (2, 32), generator=gen)
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(ids, labels=ids) / ids.numel()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_trains_close_to_bf16_and_keeps_high_precision_weights(recipe):
    ref = _train(_nano())
    model = _nano()
    plan = convert_to_float8(model, recipe, _blocks(model), emulate=True)
    assert type(model.get_submodule(plan.converted[0])).__name__ == "Float8Linear"
    losses = _train(model)
    assert all(abs(a - b) / b < 0.05 for a, b in zip(losses, ref)), (losses, ref)
    assert losses[-1] < losses[0]
    # the state dict is a bf16 run's: same names, high-precision tensors, loads both ways
    state = model.state_dict()
    plain = _nano(seed=1)
    assert set(state) == set(plain.state_dict())
    assert all(t.dtype == torch.float32 for t in state.values() if t.is_floating_point())
    plain.load_state_dict(state)  # float8 -> bf16
    again = _nano(seed=2)
    convert_to_float8(again, recipe, _blocks(again), emulate=True)
    again.load_state_dict(plain.state_dict())  # bf16 -> float8
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), state.values()))


def test_a_missing_recipe_is_refused():
    model = _nano()
    with pytest.raises(ValueError, match="training.float8"):
        convert_to_float8(model, "mxfp8", _blocks(model))


def test_float8_with_activation_checkpointing_is_exact(caplog):
    """The recipe's builder converts (on a CPU its log names why the routed experts stay
    high-precision); checkpointed blocks recompute the same float8 forward."""
    from tests.helpers import parity

    float8 = {"float8": "tensorwise", "float8_filter": []}
    with caplog.at_level("INFO", logger="hybridtrain.training.float8"):
        runs = [parity.train(*parity.build({}, 1, ac=ac, training=float8)) for ac in (False, True)]
    assert runs[0] == runs[1]
    assert "0 of 2 converted" in caplog.text and "needs CUDA" in caplog.text  # the MoE layers' experts


def _colmajor(t):
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


def _stand_in_cuda_kernels(monkeypatch) -> list:
    """torchao's float8 grouped GEMM with its CUDA-only parts stood in for on the CPU: the four
    Triton casts (torchao defines them only where ``torch.utils._triton.has_triton()``, i.e.
    with a GPU; else stubs raising NotImplementedError) by torch casts (torchao's own torch
    references where it has them), and ``torch._scaled_grouped_mm`` (no CPU kernel in torch
    2.13) by its emulation, which checks the operands' float8 dtype, layouts and 16-row groups.
    Returns the list of the grouped GEMMs' offsets, one per call."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
    from torchao.prototype.moe_training import fp8_grouped_mm
    from torchao.prototype.moe_training.utils import (
        _is_column_major, torch_to_3d_rowwise_float8_transpose_rhs, torch_to_float8_per_group_colwise,
    )

    def cast(x, dtype, dim, pow2):
        s = tensor_to_scale(x, dtype, scaling_granularity=ScalingGranularity.AXISWISE,
                            axiswise_dim=dim, round_scales_to_power_of_2=pow2)
        return to_fp8_saturated(x.float() * s, dtype), s

    def rowwise_2d(x, output_dtype, round_scales_to_power_of_2):
        data, s = cast(x, output_dtype, -1, round_scales_to_power_of_2)
        return data.contiguous(), s

    def colwise_3d(b_t, output_dtype, round_scales_to_power_of_2):
        data, s = cast(b_t, output_dtype, -2, round_scales_to_power_of_2)
        return _colmajor(data), s

    def per_group_colwise_dual(grad_out, a, offs, dtype, round_scales_to_power_of_2):
        out = []
        for t in (grad_out, a):
            data, s = torch_to_float8_per_group_colwise(_colmajor(t), offs, dtype, round_scales_to_power_of_2)
            out += [_colmajor(data), s]
        return tuple(out)

    calls = []

    def scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, out_dtype=None, use_fast_accum=False):
        assert a.dtype == b.dtype == torch.float8_e4m3fn and not _is_column_major(a) and _is_column_major(b)
        ends = offs.tolist()
        assert all(e % 16 == 0 for e in ends), ends  # the float8 weight gradient's row groups
        calls.append(ends)
        spans = list(zip([0] + ends[:-1], ends))
        if b.dim() == 3:  # (M, K) x (E, K, N): rows grouped by expert
            out = torch.zeros(a.shape[0], b.shape[2])
            for g, (s, e) in enumerate(spans):
                out[s:e] = (a[s:e].float() * scale_a[s:e, None]) @ (b[g].float() * scale_b[g])
        else:  # (N, M) x (M, K): the contraction grouped (the weights' gradient)
            n, k = a.shape[0], b.shape[1]
            out = torch.stack([(a[:, s:e].float() * scale_a[g * n:(g + 1) * n, None])
                               @ (b[s:e].float() * scale_b[g * k:(g + 1) * k]) for g, (s, e) in enumerate(spans)])
        return out.to(out_dtype)

    monkeypatch.setattr(fp8_grouped_mm, "triton_fp8_rowwise_2d_scale_and_cast", rowwise_2d)
    monkeypatch.setattr(fp8_grouped_mm, "triton_fp8_colwise_3d_scale_and_cast", colwise_3d)
    monkeypatch.setattr(fp8_grouped_mm, "triton_fp8_rowwise_3d_transpose_rhs",
                        lambda b_t, output_dtype, round_scales_to_power_of_2:
                        torch_to_3d_rowwise_float8_transpose_rhs(b_t, output_dtype, round_scales_to_power_of_2))
    monkeypatch.setattr(fp8_grouped_mm, "triton_fp8_per_group_colwise_scales_dual", per_group_colwise_dual)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm)
    return calls


def test_routed_experts_take_torchaos_float8_grouped_gemm(monkeypatch):
    """Converted experts hold torchao's float8 grouped-GEMM weights; their GEMMs are torchao's
    rowwise float8 grouped GEMM over 16-row groups, forward and backward (the CUDA-only parts
    stood in for), and train close to the bf16 experts; the state dict holds the
    high-precision tensors."""
    from torchao.prototype.moe_training.tensor import Float8TrainingWeightWrapperTensor

    ref = _train(_nano(), steps=3)
    model = _nano()
    plan = convert_to_float8(model, "rowwise", _blocks(model), ["(q|k|v|o|in|out|up|down)_proj$"],
                             emulate=True, expert_modules=(Experts,))
    assert len(plan.experts) == 6 and not plan.converted  # the experts alone
    experts = model.get_submodule(plan.experts[0])
    assert isinstance(experts.up_proj.data, Float8TrainingWeightWrapperTensor)
    with pytest.raises(NotImplementedError):  # what runs on a CPU without the stand-ins
        _train(model, steps=1)
    calls = _stand_in_cuda_kernels(monkeypatch)
    model = _nano()
    convert_to_float8(model, "rowwise", _blocks(model), ["(q|k|v|o|in|out|up|down)_proj$"],
                      emulate=True, expert_modules=(Experts,))
    losses = _train(model, steps=3)
    assert len(calls) == 3 * 6 * 6  # steps x expert modules x (2 forward + 4 backward GEMMs)
    assert all(abs(a - b) / b < 0.05 for a, b in zip(losses, ref)), (losses, ref)
    assert losses != ref
    state = model.state_dict()
    assert all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in state.values())
    assert set(state) == set(_nano().state_dict())


def test_a_converted_block_compiles_whole_and_matches_eager():
    """Compiled blocks compile the converted modules: an attention block's float8 q/k/v/o in one
    graph (``fullgraph``; ``aot_eager`` as in test_compiled_blocks), outputs and gradients equal
    to eager float8's. (Measured 2026-12-06: the MLP, MoE and Mamba blocks too, exact to 1e-7;
    left out here for time, the Mamba block takes 17 s.)"""
    from hybridtrain.models.nemotron_h.model import SequenceInfo

    torch._dynamo.reset()
    model = _nano()
    convert_to_float8(model, "tensorwise", _blocks(model), [], emulate=True)
    block = next(b for b in model.backbone.layers.values() if b.block_type == "full_attention")
    assert sum(type(m).__name__ == "Float8Linear" for m in block.modules()) == 4
    x = torch.randn(2, 24, model.config.hidden_size, generator=torch.Generator().manual_seed(2))

    def run(fn):
        block.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        y = fn(xg, SequenceInfo(seq_idx=None))
        y.pow(2).mean().backward()
        return [y, xg.grad] + [p.grad for p in block.parameters()]

    eager = run(block)
    got = run(torch.compile(block, fullgraph=True, backend="aot_eager", dynamic=False))
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


def test_tensor_parallel_styles_of_float8_layers():
    """Tensorwise float8 layers take torchao's float8 TP styles (the input cast before it is
    redistributed); rowwise ones the plain styles (torchao's float8 styles assume tensorwise)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from hybridtrain.distributed.tensor_parallel import _style

    for recipe, column, row in (("tensorwise", Float8ColwiseParallel, Float8RowwiseParallel),
                                ("rowwise", ColwiseParallel, RowwiseParallel)):
        model = _nano()
        plan = convert_to_float8(model, recipe, _blocks(model), emulate=True)
        layer = model.get_submodule(plan.converted[0])
        assert type(_style(layer, "column")) is column and type(_style(layer, "row")) is row
    assert type(_style(model.lm_head, "column")) is ColwiseParallel


def test_aligned_groups_keep_each_row_in_its_expert_group():
    """The float8 experts' 16-row groups: each row reaches its expert's group (an empty group
    included), and its output and gradient come back to it."""
    from hybridtrain.ops.grouped_rows import aligned_groups

    counts = torch.tensor([5, 0, 17, 15])
    x = torch.randn(int(counts.sum()), 4, requires_grad=True)

    def fn(rows, offs):
        assert offs.dtype == torch.int32 and all(o % 16 == 0 for o in offs.tolist())
        group = torch.searchsorted(offs, torch.arange(rows.shape[0], dtype=torch.int32), right=True)
        return rows * (group[:, None] + 1)

    factor = torch.repeat_interleave(torch.arange(4), counts)[:, None] + 1.0
    got = aligned_groups(x, counts, 16, fn)
    assert torch.equal(got, x * factor)
    got.sum().backward()
    assert torch.equal(x.grad, factor.expand_as(x))
