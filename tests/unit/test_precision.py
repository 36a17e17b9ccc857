"""Mixed precision: bf16 against transformers' NemotronH in bf16, the fp32 islands
(router, SSD scan, norms, loss) checked on the dtypes of the ops that actually run, bf16 Hub
checkpoints in and out of fp32 runs, and the dtype resolution."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging

import pytest
import torch
from tests.helpers.hf import transformers
from tests.helpers.models import perturbed_model
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode

from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config
from hybridtrain.models.nemotron_h import kernels
from hybridtrain.models.nemotron_h.moe import TopkRouter
from hybridtrain.models.nemotron_h.norms import RMSNorm, RMSNormGated
from hybridtrain.models.nemotron_h.ssd import ssd_chunked
from hybridtrain.ops import backend
from hybridtrain.training import precision
from hybridtrain.ops.loss import cross_entropy_sum

BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2**-7
FP32_PARITY = 1e-4  # max |logits| difference to transformers in fp32 (test_model_parity)


@pytest.fixture(autouse=True)
def one_thread():
    """These tests are about numerics, on tiny shapes: one intra-op thread avoids OpenMP
    hand-offs that cost more than the ops themselves on a busy 2-core machine (~10x here)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


class OpDtypes(TorchDispatchMode):
    """Records (op name, output dtypes) of every aten op that runs; autocast sits above the
    Python dispatch key, so these are the dtypes the kernels really compute in. (An ``out=``
    op computes in its inputs' promoted dtype and rounds as it stores: that dtype is recorded.)"""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        dts = tuple(t.dtype for t in outs if isinstance(t, torch.Tensor) and t.is_floating_point())
        if kwargs and "out" in kwargs and dts:
            ins = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
            dts = (functools.reduce(torch.promote_types, ins),) if ins else dts
        self.ops.append((func.overloadpacket.__name__, dts))
        return out

    def float_ops(self, names=None):
        return [(n, d) for n, d in self.ops if d and (names is None or n in names)]


ARITH = {"mm", "bmm", "addmm", "matmul", "einsum", "linear", "cumsum", "exp", "sigmoid", "softplus",
         "mul", "add", "sub", "sum", "mean", "pow", "rsqrt", "logsumexp", "topk", "gather", "div"}


def assert_all_fp32(rec: OpDtypes, what: str):
    ops = rec.float_ops(ARITH)
    assert ops, f"{what}: no arithmetic recorded"
    bad = [(n, d) for n, d in ops if any(x != torch.float32 for x in d)]
    assert not bad, f"{what}: ops not in fp32: {bad[:8]}"


# ---------------------------------------------------------------------------------- fp32 islands
def test_router_is_fp32_under_autocast_and_bf16_params():
    cfg = tiny_config("moe", n_group=4, topk_group=2)
    torch.manual_seed(0)
    router = TopkRouter(cfg)
    router.reset_parameters()
    with torch.no_grad():
        router.e_score_correction_bias.normal_(0, 0.05)
    x = torch.randn(64, cfg.hidden_size).to(torch.bfloat16)
    ref = router(x.float())
    with autocast(), OpDtypes() as rec:
        out = router(x)
    assert_all_fp32(rec, "router under autocast")
    assert [t.dtype for t in out[:2]] == [torch.float32, torch.float32]
    # exactly the fp32 computation on the same inputs: same logits, experts and gates
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # bf16 parameters (a model cast with .to(bf16)): still fp32 math, fp32 correction bias
    router16 = TopkRouter(cfg)
    router16.load_state_dict(router.state_dict())
    router16.to(torch.bfloat16)
    assert router16.e_score_correction_bias.dtype == torch.float32
    with OpDtypes() as rec:
        logits, weights, _ = router16(x)
    assert_all_fp32(rec, "router with bf16 parameters")
    assert logits.dtype == weights.dtype == torch.float32


def assert_ssd_islands(rec: OpDtypes, what: str):
    """The scan's fp32 islands: every elementwise step and reduction (dt * A, cumsum, exp2 of
    the decays, state weights, the state passing's einsum, sums) in fp32; bf16 only as the
    output of the in-chunk products (bmm), which take bf16 operands like mamba_ssm's kernels;
    and the chunk-state product itself in fp32."""
    ops = [(n.rstrip("_"), d) for n, d in rec.float_ops()]  # in-place ops count as their op
    ops = [(n, d) for n, d in ops if n in ARITH | {"exp2", "where"}]  # (masking is exact in any dtype)
    bad = [(n, d) for n, d in ops if n != "bmm" and any(x != torch.float32 for x in d)]
    assert not bad, f"{what}: elementwise ops not in fp32: {bad[:8]}"
    assert {"cumsum", "exp2", "mul"} <= {n for n, _ in ops}, f"{what}: {sorted({n for n, _ in ops})}"
    bmm = [d for n, d in ops if n == "bmm"]
    assert (torch.bfloat16,) in bmm and (torch.float32,) in bmm, f"{what}: bmm dtypes {bmm}"


def test_ssd_scan_state_is_fp32_under_autocast():
    torch.manual_seed(0)
    b, L, h, p, g, n = 2, 21, 4, 8, 2, 8
    x, B, C = torch.randn(b, L, h, p), torch.randn(b, L, g, n), torch.randn(b, L, g, n)
    dt = torch.nn.functional.softplus(torch.randn(b, L, h) - 1)
    A, D = -torch.rand(h) - 0.5, torch.randn(h)
    bf = [t.to(torch.bfloat16) for t in (x, dt, B, C)]
    ref_y, ref_state = ssd_chunked(*[t.float() for t in bf[:2]], A, *[t.float() for t in bf[2:]], 8,
                                   D=D, return_final_state=True)
    with autocast(), OpDtypes() as rec:
        y, state = ssd_chunked(bf[0], bf[1], A, bf[2], bf[3], 8, D=D, return_final_state=True)
    assert_ssd_islands(rec, "ssd_chunked under autocast")
    assert y.dtype == state.dtype == torch.float32
    # the state is the fp32 scan's, bit for bit; the output went through bf16 operands of
    # fp32-accumulated products: within a few bf16 roundings of its scale
    torch.testing.assert_close(state, ref_state, rtol=0, atol=0)
    torch.testing.assert_close(y, ref_y, rtol=0, atol=4 * BF16_EPS * ref_y.abs().max().item())
    # the dispatch point (softplus(dt + dt_bias) and clamp too), with a bf16 dt projection
    with autocast(), OpDtypes() as rec:
        y2 = kernels.ssd_scan(bf[0], bf[1], A, bf[2], bf[3], chunk_size=8, D=D,
                              dt_bias=torch.zeros(h), dt_limit=(0.0, float("inf")), seq_idx=None)
    assert_ssd_islands(rec, "kernels.ssd_scan under autocast")
    assert y2.dtype == torch.float32
    # backward: the gradients of dt (through the decays) and of the state path stay in fp32
    # (D=None: with D, autograd sums x's two gradients in x's dtype, outside the scan)
    xs, dts, Bs, Cs = (t.clone().requires_grad_() for t in bf)
    with autocast():
        y3, state3 = ssd_chunked(xs, dts, A, Bs, Cs, 8, return_final_state=True)
    with OpDtypes() as rec:
        (y3.square().sum() + state3.square().sum()).backward()
    assert_ssd_islands(rec, "ssd_chunked backward")
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (xs, dts, Bs, Cs))


@pytest.mark.parametrize("mode", ["autocast", "bf16 params"])
def test_norm_statistics_are_fp32(mode):
    torch.manual_seed(0)
    norm, gated = RMSNorm(64), RMSNormGated(64, group_size=16)
    for m in (norm, gated):
        with torch.no_grad():
            m.weight.normal_(1, 0.1)
    x, z = torch.randn(2, 5, 64).to(torch.bfloat16), torch.randn(2, 5, 64).to(torch.bfloat16)
    ctx = autocast() if mode == "autocast" else contextlib.nullcontext()
    if mode == "bf16 params":
        norm.to(torch.bfloat16), gated.to(torch.bfloat16)
    for name, fn in (("RMSNorm", lambda: norm(x)), ("RMSNormGated", lambda: gated(x, z))):
        with ctx, OpDtypes() as rec:
            fn()
        stats = rec.float_ops({"pow", "mean", "rsqrt"})
        assert len(stats) >= 3, (name, rec.ops)
        assert all(d == (torch.float32,) for _, d in stats), f"{name}: {stats}"


def test_loss_is_fp32_under_autocast():
    torch.manual_seed(0)
    hidden = torch.randn(40, 32, requires_grad=True)
    weight = torch.randn(100, 32, requires_grad=True)
    labels = torch.randint(0, 100, (40,))
    labels[::7] = -100
    for chunk in (None, 16):
        with autocast(), OpDtypes() as rec:
            loss = cross_entropy_sum(hidden, weight, labels, chunk_size=chunk)
        assert loss.dtype == torch.float32
        soft = rec.float_ops({"logsumexp", "_log_softmax", "log_softmax", "nll_loss_forward", "exp", "sub"})
        assert soft and all(set(d) == {torch.float32} for _, d in soft), (chunk, soft)
        assert any(d == (torch.bfloat16,) for n, d in rec.float_ops({"mm"})), "the head matmul runs in bf16"
        with OpDtypes() as rec:
            loss.backward()
        assert hidden.grad.dtype == weight.grad.dtype == torch.float32
        hidden.grad = weight.grad = None


def test_full_model_under_autocast_computes_matmuls_in_bf16_and_islands_in_fp32(monkeypatch):
    cfg = tiny_config("mixed")
    model = perturbed_model(cfg, seed=0)
    records: dict[str, OpDtypes] = {}

    def recorded(name, fn):
        def wrapper(*a, **k):
            rec = records.setdefault(name, OpDtypes())
            with rec:
                return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(TopkRouter, "forward", recorded("router", TopkRouter.forward))
    monkeypatch.setattr(kernels, "ssd_scan", recorded("ssd", kernels.ssd_scan))
    ids = torch.randint(0, cfg.vocab_size, (2, 19))
    with autocast(), OpDtypes() as everything:
        logits = model(ids)
    assert logits.dtype == torch.float32
    assert_all_fp32(records["router"], "router inside the model")
    assert_ssd_islands(records["ssd"], "SSD scan inside the model")
    mms = everything.float_ops({"mm", "addmm", "bmm"})
    assert sum(d == (torch.bfloat16,) for _, d in mms) >= 10, "projections should run in bf16 under autocast"
    # parameters (the fp32 masters) are untouched by autocast
    assert all(p.dtype == torch.float32 for p in model.parameters())


# ---------------------------------------------------------------------------------- vs transformers
def _hf_bf16(path):
    with contextlib.redirect_stderr(io.StringIO()):
        return transformers.NemotronHForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, attn_implementation="eager").eval()


def _run_with_routes(model, ids, hf=False, ctx=None):
    """Logits (fp32) and the sorted top-k experts [moe_layers, tokens, k] of every MoE layer."""
    routes = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: routes.append(out[2].sort(-1).values))
             for n, m in model.named_modules() if n.endswith("mixer.gate")]
    try:
        with torch.no_grad(), (ctx or contextlib.nullcontext()):
            with contextlib.redirect_stderr(io.StringIO()):
                logits = model(ids, use_cache=False).logits if hf else model(ids)
    finally:
        for h in hooks:
            h.remove()
    return logits.float(), torch.stack(routes)


def _rel_rms(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("kind,over", [("mixed", {}), ("moe", dict(n_group=4, topk_group=2))])
def test_bf16_forward_matches_transformers_bf16(kind, over, tmp_path):
    """Same weights, bf16 on both sides (transformers loaded with dtype=bf16, ours with
    ``from_pretrained(dtype=bf16)``), 8 x 128 tokens.

    Routing: a near-tie between two experts' scores flips under any rounding difference, and
    neither side is "right"; both compute the router in fp32 from bf16 hidden states, so they
    must pick the same experts for >= 99 % of (token, MoE layer) pairs (measured 99.5-100 %).

    Logits, on the tokens routed identically in every layer by all three runs: the fp32 parity
    with transformers is 1e-4 (negligible here); a bf16 forward rounds every stored activation
    to 2^-8 relative (half of eps = 2^-7), and the logits go through ~16 such roundings in these
    6-layer models (norm, projections, mixer, residual), so two bf16 implementations that round
    in different places differ by at most ~16 * eps/2 = 8 eps relative to the logit scale:
    max|ours - transformers| <= 1e-4 + 8 * eps * max|fp32 logits| (measured <= 3 eps). And ours
    is as close to the fp32 logits as transformers' bf16 is: relative RMS error <= 4 eps
    (measured 1.2-2.3 eps for both)."""
    cfg = tiny_config(kind, **over)
    ref_model = perturbed_model(cfg, seed=1)
    ref_model.save_pretrained(tmp_path / "ckpt")
    ours = NemotronHForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16)
    assert ours.lm_head.weight.dtype == torch.bfloat16
    hf = _hf_bf16(tmp_path / "ckpt")
    torch.manual_seed(11)
    ids = torch.randint(0, cfg.vocab_size, (8, 128))

    ref, r_ref = _run_with_routes(ref_model, ids)
    a, r_a = _run_with_routes(ours, ids)
    b, r_b = _run_with_routes(hf, ids, hf=True)
    agree = (r_a == r_b).all(-1).float().mean().item()
    same = ((r_a == r_b).all(-1) & (r_a == r_ref).all(-1)).all(0).view(ids.shape)
    diff = (a - b)[same].abs().max().item()
    scale = ref.abs().max().item()
    tol = FP32_PARITY + 8 * BF16_EPS * scale
    err_ours, err_hf = _rel_rms(a[same], ref[same]), _rel_rms(b[same], ref[same])
    print(f"\n[bf16] {kind} {over}: router agreement ours/transformers {agree:.4f}; on {same.float().mean():.1%} "
          f"identically routed tokens max|ours-hf| = {diff:.4f} (tol {tol:.4f} = {tol / scale / BF16_EPS:.1f} eps "
          f"x max|logit|), rel RMS error vs fp32: ours {err_ours / BF16_EPS:.2f} eps, transformers "
          f"{err_hf / BF16_EPS:.2f} eps")
    assert agree >= 0.99
    assert diff <= tol
    assert err_ours <= 4 * BF16_EPS


def test_autocast_forward_follows_fp32(tmp_path):
    """The training mode (fp32 masters, bf16 autocast): same bounds against the fp32 forward,
    and the router keeps >= 98.5 % of fp32's choices (transformers in bf16 keeps 98.5-99.4 % on
    these models: the flips are near-ties)."""
    cfg = tiny_config("mixed")
    model = perturbed_model(cfg, seed=1)
    torch.manual_seed(11)
    ids = torch.randint(0, cfg.vocab_size, (8, 128))
    ref, r_ref = _run_with_routes(model, ids)
    a, r_a = _run_with_routes(model, ids, ctx=autocast())
    agree = (r_a == r_ref).all(-1).float().mean().item()
    same = (r_a == r_ref).all(-1).all(0).view(ids.shape)
    err = _rel_rms(a[same], ref[same])
    print(f"\n[autocast] router agreement with fp32 {agree:.4f}; rel RMS error {err / BF16_EPS:.2f} eps")
    assert agree >= 0.985
    assert err <= 4 * BF16_EPS


# ---------------------------------------------------------------------------------- checkpoints
def _st_dtypes(path):
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}


def test_bf16_hub_checkpoint_into_fp32_run_and_back(tmp_path):
    cfg = tiny_config("moe")
    src = perturbed_model(cfg, seed=2)
    src.save_pretrained(tmp_path / "hub", dtype=torch.bfloat16)  # a "Hub" checkpoint in bf16
    dts = _st_dtypes(tmp_path / "hub")
    assert {d for k, d in dts.items() if not k.endswith("e_score_correction_bias")} == {"BF16"}
    assert {d for k, d in dts.items() if k.endswith("e_score_correction_bias")} == {"F32"}
    assert json.loads((tmp_path / "hub" / "config.json").read_text())["dtype"] == "bfloat16"

    run = NemotronHForCausalLM.from_pretrained(tmp_path / "hub", dtype=torch.float32)  # fp32 run
    assert all(p.dtype == torch.float32 for p in run.parameters())
    assert run.checkpoint_dtype == torch.bfloat16
    hub = NemotronHForCausalLM.from_pretrained(tmp_path / "hub")  # as stored
    assert hub.lm_head.weight.dtype == torch.bfloat16
    for (n, p), q in zip(run.state_dict().items(), hub.state_dict().values()):
        assert torch.equal(p, q.float()), n  # bf16 -> fp32 is exact

    # `save_dtype: auto` writes the loaded dtype back: bit-identical tensors
    save_dtype = precision.resolve_save_dtype("auto", run)
    assert save_dtype == torch.bfloat16
    run.save_pretrained(tmp_path / "out", dtype=save_dtype)
    assert _st_dtypes(tmp_path / "out") == dts
    with safe_open(str(tmp_path / "hub" / "model.safetensors"), framework="pt") as f1, \
            safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f2:
        for k in f1.keys():
            assert torch.equal(f1.get_tensor(k), f2.get_tensor(k)), k
    # and transformers reads the export
    hf = _hf_bf16(tmp_path / "out")
    assert hf.lm_head.weight.dtype == torch.bfloat16
    ids = torch.randint(0, cfg.vocab_size, (1, 9))
    with torch.no_grad():
        assert torch.isfinite(hf(ids, use_cache=False).logits).all()

    # explicit save dtypes; fp32 keeps the master weights bit-exactly
    run.save_pretrained(tmp_path / "fp32", dtype="float32")
    assert set(_st_dtypes(tmp_path / "fp32").values()) == {"F32"}
    assert precision.resolve_save_dtype("bf16") == torch.bfloat16
    assert precision.resolve_save_dtype("auto", perturbed_model(cfg)) == torch.float32  # from scratch


def test_save_dtype_shard_sizes_follow_the_written_dtype(tmp_path):
    model = perturbed_model(tiny_config("dense"))
    nbytes = sum(t.numel() for t in model.state_dict().values()) * 2
    model.save_pretrained(tmp_path / "a", dtype=torch.bfloat16, max_shard_size=nbytes // 2 + 1)
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == nbytes  # bytes as written, not as held (fp32)
    # a limit of the bf16 size fits in one file in bf16, not in fp32
    model.save_pretrained(tmp_path / "b", dtype=torch.bfloat16, max_shard_size=nbytes)
    assert (tmp_path / "b" / "model.safetensors").is_file()
    assert not (tmp_path / "b" / "model.safetensors.index.json").exists()
    model.save_pretrained(tmp_path / "c", max_shard_size=nbytes)
    assert (tmp_path / "c" / "model.safetensors.index.json").is_file()


# ---------------------------------------------------------------------------------- dtype resolution
def test_cpu_flag_parsing(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n\nprocessor\t: 1\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n")
    old = tmp_path / "old"
    old.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n")
    assert backend.cpu_bf16_flags(str(x86)) == {"avx512_bf16"}
    assert backend.cpu_bf16_flags(str(arm)) == {"bf16"}
    assert backend.cpu_bf16_flags(str(old)) == set()
    assert backend.cpu_bf16_flags(str(tmp_path / "missing")) is None


def test_resolve_dtype(monkeypatch, caplog):
    """training.dtype: auto follows ops.backend.auto_dtype; training.cpu_bf16 overrides the CPU
    detection (not the hidden-size rule); explicit dtypes are taken as asked."""
    backend._detect_cpu_bf16.cache_clear()
    with caplog.at_level(logging.INFO, logger="hybridtrain.training.precision"):
        assert precision.resolve_dtype("auto", "cpu", cpu_bf16=True) == torch.bfloat16
    assert "training.dtype=auto -> bfloat16 on cpu (training.cpu_bf16=true)" in caplog.text
    assert precision.resolve_dtype("auto", "cpu", hidden_size=2688, cpu_bf16=True) == torch.bfloat16
    assert precision.resolve_dtype("auto", "cpu", hidden_size=96, cpu_bf16=True) == torch.float32  # too narrow
    assert precision.resolve_dtype("bf16", "cpu", hidden_size=96, cpu_bf16=True) == torch.bfloat16  # as asked
    assert precision.resolve_dtype("auto", torch.device("cpu"), cpu_bf16=False) == torch.float32
    with pytest.raises(ValueError, match="training.cpu_bf16"):
        precision.resolve_dtype("auto", "cpu", cpu_bf16="yes")
    flags = backend.cpu_bf16_flags()
    expected = torch.bfloat16 if flags else torch.float32
    if flags is None:  # no /proc/cpuinfo: the probe decides
        expected = precision.resolve_dtype("auto", "cpu")
    assert precision.resolve_dtype("auto", "cpu") == expected
    backend._detect_cpu_bf16.cache_clear()
    monkeypatch.setattr(backend, "cpu_bf16_flags", lambda: None)
    monkeypatch.setattr(backend, "_probe_bf16_speedup", lambda: 0.5)
    assert precision.resolve_dtype("auto", "cpu") == torch.float32
    backend._detect_cpu_bf16.cache_clear()
    monkeypatch.setattr(backend, "_probe_bf16_speedup", lambda: 5.0)
    assert precision.resolve_dtype("auto", "cpu") == torch.bfloat16
    backend._detect_cpu_bf16.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert precision.resolve_dtype("auto", "cuda") == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert precision.resolve_dtype("auto", "cuda:0") == torch.float32
    assert precision.resolve_dtype("float32", "cpu") == torch.float32
    assert precision.resolve_dtype("bf16", "cuda") == torch.bfloat16
    with pytest.raises(ValueError, match="loss scaling"):
        precision.resolve_dtype("float16", "cuda")
    with pytest.raises(ValueError, match="training.dtype: unknown dtype 'fp8'"):
        precision.resolve_dtype("fp8", "cpu")


def test_cpu_bf16_rule_ignores_the_environment(monkeypatch):
    """The old HYBRIDTRAIN_CPU_BF16 switch is gone: training.cpu_bf16 is the one way to say it."""
    backend._detect_cpu_bf16.cache_clear()
    monkeypatch.setattr(backend, "cpu_bf16_flags", lambda: set())
    monkeypatch.setenv("HYBRIDTRAIN_CPU_BF16", "1")
    assert precision.resolve_dtype("auto", "cpu") == torch.float32
    backend._detect_cpu_bf16.cache_clear()


def test_autocast_context():
    assert isinstance(precision.autocast_context(torch.float32, "cpu"), contextlib.nullcontext)
    assert isinstance(precision.autocast_context(None, "cpu"), contextlib.nullcontext)
    with precision.autocast_context(torch.bfloat16, "cpu"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert precision.autocast_dtype(torch.float32) is None
    assert precision.autocast_dtype(torch.bfloat16) == torch.bfloat16


# ---------------------------------------------------------------------------------- training
def test_bf16_training_follows_fp32():
    """30 trainer steps of the tiny MoE Nemotron-H (Mamba, attention and MoE layers) from the
    same init and data, once in fp32 and once as ``training.dtype: bfloat16`` runs it (fp32
    masters and AdamW state, bf16 autocast): every step's loss within 2 %, no step skipped."""
    from tests.helpers.data import VOCAB
    from tests.helpers.training import build_trainer

    from hybridtrain.training.trainer import TrainStep

    def tiny_moe(seed):
        torch.manual_seed(seed)
        return NemotronHForCausalLM(tiny_config("moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
                                                mamba_num_heads=4, n_routed_experts=4))

    runs = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        step = TrainStep(autocast_dtype=precision.autocast_dtype(dtype))
        trainer = build_trainer(None, max_steps=30, gbs=8, mbs=4, model_fn=tiny_moe, train_step=step, val=False)
        trainer.fit()
        runs[name] = trainer.history
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    fp32 = torch.tensor([r["loss"] for r in runs["fp32"]])
    bf16 = torch.tensor([r["loss"] for r in runs["bf16"]])
    rel = ((bf16 - fp32).abs() / fp32).max().item()
    print(f"\n[bf16 training] loss fp32 {fp32[0]:.4f} -> {fp32[-1]:.4f}, bf16 {bf16[0]:.4f} -> {bf16[-1]:.4f}; "
          f"max per-step relative difference {rel:.2%}")
    assert len(fp32) == len(bf16) == 30
    assert runs["bf16"][-1]["skipped_steps"] == 0 and runs["fp32"][-1]["skipped_steps"] == 0
    assert fp32[-1] < 0.9 * fp32[0]  # it trains
    assert rel <= 0.02


def test_hf_export_in_save_dtype(tmp_path):
    """The trainer's export path (``default_export`` -> ``export_hf``) writes ``save_dtype``."""
    from hybridtrain.training.hf_export import default_export, export_hf

    model = perturbed_model(tiny_config("moe"))
    export_hf(model, str(tmp_path / "a"), dtype=torch.bfloat16)
    dts = _st_dtypes(tmp_path / "a")
    assert {d for k, d in dts.items() if not k.endswith("e_score_correction_bias")} == {"BF16"}
    out = default_export(model, str(tmp_path / "step_1"), dtype=None)  # None: as held (fp32)
    assert set(_st_dtypes(tmp_path / "step_1" / "hf").values()) == {"F32"}
    assert out.endswith("hf")
    assert all(p.dtype == torch.float32 for p in model.parameters())  # masters untouched
