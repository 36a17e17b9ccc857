"""MoE layer: routing rules, the sort/unsort token flow, and equality with a per-token reference."""

from __future__ import annotations

import pytest
import torch

from hybridtrain.models.nemotron_h import tiny_config
from hybridtrain.models.nemotron_h.moe import MoE, permute, unpermute


def _moe(seed=0, **over):
    torch.manual_seed(seed)
    cfg = tiny_config("moe", **over)
    moe = MoE(cfg, layer_idx=1)
    moe.reset_parameters()
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.3)
        moe.gate.e_score_correction_bias.normal_(0, 0.05)
    return cfg, moe


def _reference_route(scores, bias, cfg):
    """Per-token loops over groups and experts."""
    T, E = scores.shape
    per = E // cfg.n_group
    out_idx, out_w = [], []
    for t in range(T):
        choice = scores[t] + bias
        gs = [sorted(choice[g * per:(g + 1) * per].tolist(), reverse=True) for g in range(cfg.n_group)]
        gscore = [s[0] + s[1] if len(s) > 1 else s[0] for s in gs]
        keep = sorted(range(cfg.n_group), key=lambda g: -gscore[g])[: cfg.topk_group]
        cand = [e for e in range(E) if e // per in keep]
        chosen = sorted(cand, key=lambda e: -choice[e].item())[: cfg.num_experts_per_tok]
        w = scores[t, chosen]
        if cfg.norm_topk_prob:
            w = w / w.sum()
        out_idx.append(chosen)
        out_w.append(w * cfg.routed_scaling_factor)
    return out_idx, out_w


@pytest.mark.parametrize("over", [{}, dict(n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=2.0)])
def test_router_matches_per_token_reference(over):
    cfg, moe = _moe(**over)
    x = torch.randn(40, cfg.hidden_size)
    logits, w, idx = moe.gate(x)
    assert logits.dtype == torch.float32 and w.dtype == torch.float32
    ref_idx, ref_w = _reference_route(torch.sigmoid(x @ moe.gate.weight.T), moe.gate.e_score_correction_bias, cfg)
    for t in range(40):
        got = dict(zip(idx[t].tolist(), w[t].tolist()))
        exp = dict(zip(ref_idx[t], ref_w[t].tolist()))
        assert got.keys() == exp.keys(), t
        assert all(abs(got[e] - exp[e]) < 1e-6 for e in got)


def test_correction_bias_selects_but_does_not_weight():
    cfg, moe = _moe(norm_topk_prob=False)
    x = torch.randn(16, cfg.hidden_size)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.zero_()
        moe.gate.e_score_correction_bias[5] = 10.0
    _, w, idx = moe.gate(x)
    assert (idx == 5).any(dim=1).all()
    scores = torch.sigmoid(x @ moe.gate.weight.T)
    assert torch.allclose(w, scores.gather(1, idx))  # gate weight = un-biased score


def test_permute_unpermute_round_trip():
    x = torch.randn(10, 6)
    idx = torch.randint(0, 4, (10, 3))
    w = torch.rand(10, 3)
    sx, order, counts, _ = permute(x, idx, 4)
    assert counts.tolist() == torch.bincount(idx.view(-1), minlength=4).tolist()
    # rows are grouped by expert
    assert torch.equal(idx.view(-1)[order], torch.sort(idx.view(-1), stable=True).values)
    y = unpermute(sx, order, w)
    assert torch.allclose(y, x * w.sum(1, keepdim=True), atol=1e-6)


@pytest.mark.parametrize("k", [2, 6])
def test_permutation_gradients_are_autograds_indexing(k):
    """permute / unpermute move rows by gathers with hand-written backwards; their gradients are
    those of autograd's indexing (a scatter-add), to the bit where the sums are the same: with k
    = 2 a token's two copies add in either order (a third reader of the tokens, as the router,
    included); with k = 6 they add in top-k order, not expert order (within rounding)."""
    torch.manual_seed(0)
    T, E, H = 40, 16, 12
    x0, readers = torch.randn(T, H), torch.randn(H, E)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    w0, g = torch.rand(T, k), torch.randn(T, H)

    def grads(ours: bool):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        sx, order, _, shared = permute(x, idx, E)
        if ours:
            y = unpermute(sx * 2.0, order, w)
        else:  # autograd's indexing both ways: a gather of the copies, a scatter back
            sx_ref = x[order // k]
            assert torch.equal(sx, sx_ref)
            rows = torch.zeros_like(sx_ref).index_put((order,), sx_ref * 2.0)
            y = (rows.view(T, k, H) * w[:, :, None]).sum(1)
        ((y * g).sum() + (x @ readers).sum() + (shared * g).sum()).backward()
        return y.detach(), x.grad, w.grad

    ours, ref = grads(True), grads(False)
    for a, b in zip(ours, ref):
        if k == 2:
            assert torch.equal(a, b)
        else:
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("over", [{}, dict(moe_latent_size=24, num_experts_per_tok=3)])
def test_moe_equals_per_token_reference_forward_and_backward(over):
    cfg, moe = _moe(seed=1, **over)
    x = torch.randn(2, 9, cfg.hidden_size, requires_grad=True)
    y = moe(x)
    _, w, idx = moe.gate(x.reshape(-1, cfg.hidden_size))  # with grad: the gate weights depend on x
    ref = []
    act = moe.experts.act_fn
    for t, xt in enumerate(x.reshape(-1, cfg.hidden_size)):
        h = moe.fc1_latent_proj(xt) if moe.fc1_latent_proj is not None else xt
        acc = sum(w[t, k] * (moe.experts.down_proj[e] @ act(moe.experts.up_proj[e] @ h)) for k, e in enumerate(idx[t].tolist()))
        if moe.fc2_latent_proj is not None:
            acc = moe.fc2_latent_proj(acc)
        ref.append(acc + moe.shared_experts(xt))
    ref = torch.stack(ref).view_as(y)
    assert (y - ref).abs().max() < 1e-5
    g = torch.randn_like(y)
    gx, gup = torch.autograd.grad((y * g).sum(), (x, moe.experts.up_proj))
    rx, rup = torch.autograd.grad((ref * g).sum(), (x, moe.experts.up_proj))
    assert (gx - rx).abs().max() < 1e-5 and (gup - rup).abs().max() < 1e-5


def test_unused_experts_get_zero_gradients_and_used_ones_not():
    """One token: its top-k experts get (non-zero) gradients, every other expert's rows of
    every expert weight are exactly zero (present, not None: optimizers and gradient reductions
    see the whole tensor)."""
    cfg, moe = _moe(seed=2)
    x = torch.randn(1, 1, cfg.hidden_size)  # one token: most experts get no rows
    y = moe(x)
    y.sum().backward()
    _, _, idx = moe.gate(x.reshape(-1, cfg.hidden_size))
    used = set(idx.flatten().tolist())
    assert len(used) == cfg.num_experts_per_tok < cfg.n_routed_experts
    for name in ("up_proj", "down_proj"):
        grad = getattr(moe.experts, name).grad
        assert grad is not None and grad.shape[0] == cfg.n_routed_experts
        for e in range(cfg.n_routed_experts):
            if e in used:
                assert grad[e].abs().sum() > 0, (name, e)
            else:
                assert torch.equal(grad[e], torch.zeros_like(grad[e])), (name, e)


def test_cpu_bf16_expert_gemms_have_aligned_rows(monkeypatch):
    """With the backend configured for CPU bf16 the per-expert GEMMs see row counts padded to a
    multiple of ``CPU_LOWP_ROW_MULTIPLE`` (bounded oneDNN kernel shapes); outputs and gradients
    equal the unpadded computation."""
    import hybridtrain.models.nemotron_h.moe as moe_mod
    from hybridtrain.ops import backend

    torch.manual_seed(0)
    cfg = tiny_config("moe")
    moe = MoE(cfg, 0)
    moe.reset_parameters()
    x0 = torch.randn(3, 37, cfg.hidden_size)
    seen = []
    real_linear = torch.nn.functional.linear

    def spy(x, w, b=None):
        if w.dim() == 2 and w.shape[0] == cfg.moe_intermediate_size and x.dtype == torch.bfloat16:
            seen.append(x.shape[0])
        return real_linear(x, w, b)

    results = []
    multiple = backend.CPU_LOWP_ROW_MULTIPLE
    monkeypatch.setattr(moe_mod.F, "linear", spy)
    for align in (multiple, 1):
        with backend.using(backend.BackendSettings(gemm_row_multiple=align)):
            x = x0.clone().requires_grad_()
            moe.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = moe(x)
            y.float().pow(2).sum().backward()
        results.append((y.detach().float(), x.grad, moe.experts.up_proj.grad))
        if align > 1:
            assert seen and all(n % align == 0 for n in seen), seen
            seen.clear()
    assert any(n % multiple for n in seen)  # unaligned counts occur without the padding
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_experts_go_through_the_token_dispatcher_it_was_given():
    """The layer calls ``token_dispatcher(experts, rows, counts)``; the default calls the experts."""
    from hybridtrain.distributed.expert_parallel import LocalDispatcher

    cfg, moe = _moe()
    x = torch.randn(2, 5, cfg.hidden_size)
    assert isinstance(moe.token_dispatcher, LocalDispatcher)
    ref = moe(x)
    seen = []

    def recording(experts, rows, counts):
        seen.append((experts, rows.shape[0], counts.tolist()))
        return LocalDispatcher()(experts, rows, counts)

    moe.token_dispatcher = recording
    assert torch.equal(moe(x), ref)
    (experts, n, counts), = seen
    assert experts is moe.experts and n == 10 * cfg.num_experts_per_tok == sum(counts)


def test_experts_without_rows_still_give_every_weight_a_gradient():
    """Under expert parallelism a rank's experts may receive no row; FSDP needs their grads."""
    cfg, moe = _moe()
    rows = torch.zeros(0, cfg.hidden_size)
    y = moe.experts(rows, torch.zeros(cfg.n_routed_experts, dtype=torch.long))
    assert y.shape == (0, cfg.hidden_size)
    assert y.requires_grad  # tied to the weights
    y.sum().backward()
    for n, p in moe.experts.named_parameters():
        assert p.grad is not None and not p.grad.any(), n


def test_expert_parallel_needs_experts_divisible_by_ep():
    from hybridtrain.distributed.expert_parallel import apply_expert_parallel

    class Mesh:
        def size(self):
            return 3

    cfg, moe = _moe()
    with pytest.raises(ValueError, match=f"{cfg.n_routed_experts} routed experts are not divisible by ep=3"):
        apply_expert_parallel(moe.experts, Mesh())


def test_fp32_cpu_experts_run_grouped_with_the_loops_values():
    """On a CPU in fp32 the experts run as torch's grouped_mm (no per-expert loop, no host count),
    with the per-expert loop's outputs and gradients bit for bit."""
    from dataclasses import replace

    from hybridtrain.ops import backend

    _, moe = _moe(seed=3)
    moe.experts.up_proj.requires_grad_(True)
    x = torch.randn(2, 13, moe.config.hidden_size)
    assert backend.grouped_experts(x.view(-1, x.shape[-1]), (moe.config.moe_intermediate_size,))
    runs = []
    for grouped in (True, False):
        with backend.using(replace(backend.settings(), grouped_mm=grouped)):
            xi = x.clone().requires_grad_()
            moe.zero_grad()
            y = moe(xi)
            y.square().sum().backward()
            runs.append((y, xi.grad, moe.experts.up_proj.grad, moe.experts.down_proj.grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
