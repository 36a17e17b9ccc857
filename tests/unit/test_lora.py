"""LoRA: target selection, frozen base, merging, per-expert adapters, state dicts."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config
from hybridtrain.peft import (
    LoRAExperts,
    LoRALinear,
    apply_lora,
    init_lora_weights,
    load_lora_state_dict,
    lora_state_dict,
    merge_lora,
    merged_state_dict,
)
from hybridtrain.peft.lora import select_targets


def make_model(kind: str = "mixed", seed: int = 0) -> NemotronHForCausalLM:
    torch.manual_seed(seed)
    m = NemotronHForCausalLM(tiny_config(kind))
    with torch.no_grad():  # norms, biases, router bias away from their trivial init
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        for b in m.buffers():
            b.add_(torch.randn_like(b) * 0.02)
    return m.eval()


def randomize_adapters(model, seed: int = 1, std: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:  # B starts at zero; make the adapters matter
                p.copy_(torch.randn(p.shape, generator=g) * std)


def ids(seed: int = 0, b: int = 2, L: int = 12) -> torch.Tensor:
    return torch.randint(0, 256, (b, L), generator=torch.Generator().manual_seed(seed))


def test_apply_all_linear_and_only_adapters_trainable():
    m = make_model()
    names = apply_lora(m, dim=4, alpha=8, match_all_linear=True)
    # every linear layer but lm_head, and both expert projections of each MoE layer
    assert "lm_head" not in names
    assert {"backbone.layers.0.mixer.in_proj", "backbone.layers.0.mixer.out_proj",
            "backbone.layers.1.mixer.q_proj", "backbone.layers.1.mixer.o_proj",
            "backbone.layers.2.mixer.up_proj", "backbone.layers.3.mixer.experts.up_proj",
            "backbone.layers.3.mixer.experts.down_proj",
            "backbone.layers.3.mixer.shared_experts.down_proj"} <= set(names)
    assert isinstance(m.backbone.layers["1"].mixer.q_proj, LoRALinear)
    assert isinstance(m.backbone.layers["3"].mixer.experts, LoRAExperts)
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert trainable == set(lora_state_dict(m)) and trainable
    assert all("lora_" in n for n in trainable)
    # base parameter names are unchanged (Hub names)
    assert "backbone.layers.1.mixer.q_proj.weight" in dict(m.named_parameters())
    assert "backbone.layers.3.mixer.experts.up_proj" in dict(m.named_parameters())
    # "checkpoints hold adapters only": torch's state dict without frozen params holds the
    # adapters and the (tiny) buffers, e.g. the router's e_score_correction_bias
    ckpt = get_model_state_dict(m, options=StateDictOptions(ignore_frozen_params=True))
    assert set(ckpt) == trainable | {n for n, _ in m.named_buffers()}


def test_optimizer_step_moves_adapters_only():
    m = make_model()
    apply_lora(m, dim=4, alpha=8)
    base = {n: p.detach().clone() for n, p in m.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    x = ids(L=8)
    m.train()
    m(x, labels=x).backward()
    opt.step()
    assert all(p.grad is None for p in m.parameters() if not p.requires_grad)
    for n, p in m.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), n
    assert any(p.abs().sum() > 0 for n, p in m.named_parameters() if "lora_B" in n)


def test_zero_b_is_identity_and_merge_matches_adapter_logits():
    m = make_model()
    x = ids()
    with torch.no_grad():
        ref = m(x)
    apply_lora(m, dim=4, alpha=8)
    with torch.no_grad():
        assert torch.equal(m(x), ref)  # B = 0 at init
    randomize_adapters(m)
    with torch.no_grad():
        lora_logits = m(x)
    assert (lora_logits - ref).abs().max() > 1e-2  # the adapters change the output

    # merged state dict into a plain model
    plain = NemotronHForCausalLM(m.config).eval()
    plain.load_state_dict(merged_state_dict(m))
    # in-place merge
    merged = merge_lora(copy.deepcopy(m))
    assert not any(isinstance(mod, (LoRALinear, LoRAExperts)) for mod in merged.modules())
    assert set(merged.state_dict()) == set(plain.state_dict())
    assert all(p.requires_grad for p in merged.parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(x), lora_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(plain(x), lora_logits, atol=1e-5, rtol=1e-5)


def test_expert_adapter_changes_only_its_expert():
    torch.manual_seed(0)
    m = make_model("moe")
    experts = m.backbone.layers["1"].mixer.experts
    E = experts.up_proj.shape[0]
    counts = torch.tensor([3, 0, 2, 4, 1, 2, 0, 3])
    assert counts.numel() == E
    x = torch.randn(int(counts.sum()), m.config.hidden_size)
    with torch.no_grad():
        base_out = experts(x, counts)
    apply_lora(m, dim=4, alpha=8, target_modules=["*.experts.*.up_proj", "*.experts.*.down_proj"])
    lexp = m.backbone.layers["1"].mixer.experts
    assert isinstance(lexp, LoRAExperts) and lexp.lora_projs == ("up_proj", "down_proj")
    rows = torch.repeat_interleave(torch.arange(E), counts)
    for j, proj in [(3, "up_proj"), (5, "down_proj")]:
        with torch.no_grad():
            for n, p in lexp.named_parameters():
                if "lora_B" in n:
                    p.zero_()
            getattr(lexp, f"{proj}_lora_B")[j].normal_(0, 0.1)
            out = lexp(x, counts)
        changed = (out - base_out).abs().amax(dim=1) > 1e-6
        assert torch.equal(changed, rows == j), (proj, j)
        assert torch.equal(out[rows != j], base_out[rows != j])


def test_grouped_mm_path_matches_loop():
    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("torch without F.grouped_mm")
    m = make_model("moe")
    apply_lora(m, dim=4, alpha=8, dropout=0.0, target_modules=["experts.up_proj", "experts.down_proj"])
    randomize_adapters(m)
    lexp = m.backbone.layers["1"].mixer.experts
    counts = torch.tensor([3, 0, 2, 4, 1, 2, 0, 3])
    x = torch.randn(int(counts.sum()), m.config.hidden_size, requires_grad=True)
    try:
        y_g = lexp._grouped(x, torch.cumsum(counts, 0, dtype=torch.int32), lexp.up_proj, lexp.down_proj,
                            lexp._ab("up_proj"), lexp._ab("down_proj"))
    except RuntimeError as e:
        pytest.skip(f"grouped_mm not available on CPU here: {e}")
    grads_g = torch.autograd.grad(y_g.square().sum(), [x, lexp.up_proj_lora_A, lexp.down_proj_lora_B])
    y_l = lexp(x, counts)  # CPU fp32: the per-expert loop
    grads_l = torch.autograd.grad(y_l.square().sum(), [x, lexp.up_proj_lora_A, lexp.down_proj_lora_B])
    torch.testing.assert_close(y_g, y_l, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads_g, grads_l):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_target_and_exclude_globs():
    m = make_model()
    sel = lambda **kw: select_targets(m, **kw)  # noqa: E731
    assert sel(target_modules=["*.mixer.in_proj"]) == ["backbone.layers.0.mixer.in_proj",
                                                       "backbone.layers.4.mixer.in_proj"]
    # a bare name is a dotted suffix: 'q_proj' == '*.q_proj'; '*q_proj' also works
    assert sel(target_modules=["q_proj"]) == sel(target_modules=["*q_proj"]) == [
        "backbone.layers.1.mixer.q_proj", "backbone.layers.5.mixer.q_proj"]
    # 'up_proj' reaches the dense MLP, the shared expert and the routed experts
    assert sel(target_modules=["up_proj"]) == [
        "backbone.layers.2.mixer.up_proj", "backbone.layers.3.mixer.experts.up_proj",
        "backbone.layers.3.mixer.shared_experts.up_proj", "backbone.layers.6.mixer.experts.up_proj",
        "backbone.layers.6.mixer.shared_experts.up_proj"]
    # experts by Hub name or by stacked name
    assert sel(target_modules=["*.experts.*.down_proj"]) == sel(target_modules=["experts.down_proj"]) == [
        "backbone.layers.3.mixer.experts.down_proj", "backbone.layers.6.mixer.experts.down_proj"]
    # exclusion
    got = sel(target_modules=["*_proj"], exclude_modules=["backbone.layers.[0-3].*", "out_proj"])
    assert got and all(int(n.split(".")[2]) >= 4 and not n.endswith("out_proj") for n in got)
    assert "backbone.layers.4.mixer.in_proj" in got
    # default (no targets) and match_all_linear: everything but lm_head
    assert sel() == sel(match_all_linear=True, target_modules=["q_proj"])
    assert "lm_head" not in sel()
    assert len(sel(match_all_linear=True, exclude_modules=["*.experts.*"])) == len(sel()) - 4


def test_pattern_errors():
    m = make_model()
    with pytest.raises(ValueError, match=r"'\*\.qproj' matches no adaptable module.*backbone\.layers\.0\.mixer\.in_proj"):
        apply_lora(m, target_modules=["*.qproj"])
    with pytest.raises(ValueError, match="exclude_modules: pattern 'nope'"):
        apply_lora(m, exclude_modules=["nope"])
    with pytest.raises(ValueError, match="matches no adaptable module.*lm_head is never adapted"):
        apply_lora(m, target_modules=["lm_head"])
    with pytest.raises(ValueError, match="only some experts"):
        apply_lora(m, target_modules=["*.experts.3.up_proj"])
    with pytest.raises(ValueError, match="removes every targeted module"):
        apply_lora(m, target_modules=["q_proj"], exclude_modules=["q_proj"])
    with pytest.raises(ValueError, match="peft.dim"):
        apply_lora(m, dim=0)
    with pytest.raises(ValueError, match="only 'lora'"):
        apply_lora(m, method="ia3")
    # nothing was changed by the failed calls
    assert all(p.requires_grad for p in m.parameters())
    apply_lora(m, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(m)


def test_peft_section_kwargs_and_dropout():
    m = make_model()
    peft_cfg = {"method": "lora", "dim": 4, "alpha": 16, "dropout": 0.5, "target_modules": ["q_proj", "up_proj"],
                "exclude_modules": [], "match_all_linear": False}
    apply_lora(m, **peft_cfg)
    q = m.backbone.layers["1"].mixer.q_proj
    assert q.scale == 4.0 and q.lora_A.shape == (4, 64) and q.lora_B.shape == (64, 4)
    randomize_adapters(m)
    x = ids()
    with torch.no_grad():
        m.eval()
        e1, e2 = m(x), m(x)
        m.train()
        torch.manual_seed(0)
        t1 = m(x)
        torch.manual_seed(1)
        t2 = m(x)
    assert torch.equal(e1, e2)
    assert not torch.equal(t1, t2)  # dropout on the adapter input path in training


def test_lora_state_dict_round_trip():
    m = make_model()
    apply_lora(m, dim=4, alpha=8)
    randomize_adapters(m)
    sd = lora_state_dict(m)
    assert all(n.endswith(("lora_A", "lora_B")) for n in sd)
    assert sd["backbone.layers.3.mixer.experts.up_proj_lora_A"].shape == (8, 4, 64)
    assert sd["backbone.layers.3.mixer.experts.up_proj_lora_B"].shape == (8, 32, 4)
    other = make_model()
    apply_lora(other, dim=4, alpha=8)
    load_lora_state_dict(other, {k: v.clone() for k, v in sd.items()})
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(other(x), m(x), atol=0, rtol=0)
    bad = dict(sd)
    bad.pop("backbone.layers.1.mixer.q_proj.lora_A")
    bad["backbone.layers.1.mixer.k_proj.lora_B"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="missing .*q_proj.lora_A[\\s\\S]*wrong shape: backbone.layers.1.mixer.k_proj"):
        load_lora_state_dict(other, bad)


def test_meta_device_then_init():
    with torch.device("meta"):
        m = NemotronHForCausalLM(tiny_config("moe"))
    apply_lora(m, dim=4, alpha=8)
    assert all(p.is_meta for p in lora_state_dict(m).values())
    m.to_empty(device="cpu")
    m.init_weights()
    init_lora_weights(m)
    sd = lora_state_dict(m)
    assert all(t.abs().sum() == 0 for n, t in sd.items() if n.endswith("lora_B"))
    assert all(t.abs().sum() > 0 for n, t in sd.items() if n.endswith("lora_A"))
    assert m(ids()).isfinite().all()


def test_adapter_dtype():
    m = make_model("moe").to(torch.bfloat16)
    apply_lora(m, dim=4, alpha=8, target_modules=["in_proj", "experts.up_proj"])
    lin = m.backbone.layers["0"].mixer.in_proj
    # a half-precision base gets fp32 adapters (as PEFT does)
    assert lin.weight.dtype == torch.bfloat16 and lin.lora_A.dtype == torch.float32
    assert m.backbone.layers["1"].mixer.experts.up_proj_lora_B.dtype == torch.float32
    randomize_adapters(m)
    y = lin(torch.randn(2, 3, 64, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16
    assert m(ids()).isfinite().all()
    m2 = make_model("dense").to(torch.bfloat16)
    apply_lora(m2, dim=4, alpha=8, dtype=torch.bfloat16, target_modules=["in_proj"])
    assert m2.backbone.layers["0"].mixer.in_proj.lora_A.dtype == torch.bfloat16


@pytest.mark.parametrize("alpha", [32, 12])
def test_adapter_scale_forms_are_bit_identical(alpha):
    """A power-of-two scale (alpha / r = 4) is applied to A instead of the adapter's output:
    the output and every gradient are bit for bit those of ``scale * B(A(x))``; another scale
    (1.5) keeps that form."""
    torch.manual_seed(0)
    base = nn.Linear(24, 40, bias=False)
    lin = LoRALinear(base, dim=8, alpha=alpha)
    with torch.no_grad():
        lin.lora_B.normal_()
    x0 = torch.randn(3, 5, 24)  # 15 rows x (24 + 40) == 24 x 40: the adapter is not folded
    g = torch.randn(3, 5, 40)
    x = x0.clone().requires_grad_()
    lin(x).backward(g)
    A, B = (t.detach().clone().requires_grad_() for t in (lin.lora_A, lin.lora_B))
    xr = x0.clone().requires_grad_()
    rows = xr.view(-1, 24)
    ref = F.linear(xr, base.weight) + (F.linear(F.linear(rows, A), B) * lin.scale).view(3, 5, 40)
    ref.backward(g)
    assert torch.equal(lin(x0), ref)
    for got, want in ((x.grad, xr.grad), (lin.lora_A.grad, A.grad), (lin.lora_B.grad, B.grad)):
        assert torch.equal(got, want)


def _adapted(in_f=24, out_f=40, bias=False, alpha=32, dropout=0.0, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    base = nn.Linear(in_f, out_f, bias=bias).to(dtype)
    base.requires_grad_(False)
    lin = LoRALinear(base, dim=8, alpha=alpha, dropout=dropout)
    with torch.no_grad():
        lin.lora_B.normal_()
    return lin


def _unfolded(lin, x):
    """The adapted layer's output in its unfolded form, from copies of the adapters."""
    A, B = (t.detach().clone().requires_grad_() for t in (lin.lora_A, lin.lora_B))
    rows = x.reshape(-1, x.shape[-1])
    delta = F.linear(F.linear(rows.to(A.dtype), A), B) * lin.scale
    return F.linear(x, lin.weight, lin.bias) + delta.view(*x.shape[:-1], -1).to(x.dtype), A, B


@pytest.mark.parametrize("alpha, bias", [(32, False), (12, True)])
def test_folded_adapter_matches_the_unfolded_form(alpha, bias):
    """With rows x (in + out) > in x out the adapter runs folded into the base weight
    (``x (W + s B A)^T``, one product over the rows): output and gradients of x, A and B equal
    the unfolded form's up to fp32 rounding."""
    lin = _adapted(alpha=alpha, bias=bias)
    x0, g = torch.randn(4, 6, 24), torch.randn(4, 6, 40)  # 24 rows
    x = x0.clone().requires_grad_()
    y = lin(x)
    assert "_FoldedLinear" in type(y.grad_fn.next_functions[0][0]).__name__
    y.backward(g)
    xr = x0.clone().requires_grad_()
    ref, A, B = _unfolded(lin, xr)
    ref.backward(g)
    # each tensor within 1e-6 of its norm (the sums are the same up to their order; an entry
    # that nearly cancels may differ by more relative to itself)
    for got, want in ((y, ref), (x.grad, xr.grad), (lin.lora_A.grad, A.grad), (lin.lora_B.grad, B.grad)):
        assert float((got - want).detach().norm()) <= 1e-6 * float(want.detach().norm())


def test_folded_adapter_gradients_are_exact_in_fp64():
    lin = _adapted(dtype=torch.float64)
    lin.double()
    x = torch.randn(30, 24, dtype=torch.float64, requires_grad=True)
    A, B = (t.detach().clone().requires_grad_() for t in (lin.lora_A, lin.lora_B))
    from hybridtrain.peft.lora import _FoldedLinear

    assert torch.autograd.gradcheck(lambda x, A, B: _FoldedLinear.apply(x, lin.weight, None, A, B, 1.5),
                                    (x, A, B))


@pytest.mark.parametrize("case", ["few_rows", "dropout", "bf16_base", "trained_base"])
def test_adapter_stays_unfolded_where_folding_does_not_pay_or_changes_numerics(case):
    """Few rows (decoding), dropout on the adapter's input, a base in another dtype than the
    adapters (folding would round the adapter's update to the base's precision) and a base that
    trains keep the unfolded form, bit for bit."""
    lin = _adapted(dropout=0.1 if case == "dropout" else 0.0,
                   dtype=torch.bfloat16 if case == "bf16_base" else torch.float32)
    if case == "trained_base":
        lin.weight.requires_grad_(True)
    lin.eval()  # (dropout: the module is there, inactive)
    x = torch.randn(2, 3 if case == "few_rows" else 20, 24, dtype=lin.weight.dtype)
    ref, _, _ = _unfolded(lin, x)
    y = lin(x)
    assert "_FoldedLinear" not in type(y.grad_fn.next_functions[0][0]).__name__
    assert torch.equal(y, ref)
