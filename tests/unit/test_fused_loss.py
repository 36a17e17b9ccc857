"""The fused implementations of the linear cross-entropy (``training.fused_loss``) give the
losses, per-token log-probs and gradients of the PyTorch chunk loop: its chunk functions under
``torch.compile`` (``compiled``; CPU inductor here) and Liger-Kernel's fused Triton kernel
(``liger``; Triton's interpreter on the CPU, skipped where triton / liger-kernel are absent)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridtrain.ops import backend
from hybridtrain.ops.loss import LinearCrossEntropy, cross_entropy_sum, token_logprobs


def _inputs(n=37, h=16, v=101, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.3] = -100
    return hidden, weight, labels


def _run(impl, fn, hidden, weight, labels):
    """(output, grad hidden, grad weight) of ``fn`` under ``training.fused_loss = impl``; the
    output is weighted per token before backward (a non-uniform incoming gradient)."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with backend.using(backend.BackendSettings(fused_loss=impl)):
        out = fn(h, w, labels)
    scale = torch.linspace(-1.0, 2.0, out.numel()).view(out.shape) if out.dim() else torch.tensor(1.7)
    (out * scale).sum().backward()
    return out.detach(), h.grad, w.grad


CASES = {
    "sum": lambda h, w, y: cross_entropy_sum(h, w, y, chunk_size=8),
    "sum_recompute": lambda h, w, y: cross_entropy_sum(h, w, y, chunk_size=8, recompute=True),
    "mean_one_chunk": lambda h, w, y: LinearCrossEntropy(chunk_size=64, reduction="mean")(h, _head(w), y),
    "logprobs": lambda h, w, y: token_logprobs(h, w, y, chunk_size=8),
}


def _head(weight):
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    del head.weight
    head.weight = weight  # a plain tensor attribute: the graph reaches the test's leaf
    return head


@pytest.mark.slow  # three inductor compiles
def test_compiled_chunks_match_the_torch_loop():
    """fullgraph=True (no graph break) and dynamic shapes: chunks of 8 and the ragged last one,
    label rows only; fp32 within 1e-5 of the eager loop (inductor reorders sums)."""
    hidden, weight, labels = _inputs()
    for name, fn in CASES.items():
        got, want = _run("compiled", fn, hidden, weight, labels), _run("torch", fn, hidden, weight, labels)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def check_liger_matches_the_torch_loop():
    """Per-token log-probs (Liger's reduction='none', gradients recomputed in backward with the
    per-token incoming gradient), sums and means over label tokens, ignored rows, fp32. Run in a
    process started with TRITON_INTERPRET=1 (Triton reads it when the kernels are defined)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    hidden, weight, labels = _inputs()
    none = torch.full_like(labels, -100)  # a batch without label tokens: the torch loop's zeros
    for name, y in [("sum", labels), ("mean_one_chunk", labels), ("logprobs", labels), ("logprobs", none)]:
        got = _run("liger", CASES[name], hidden, weight, y)
        want = _run("torch", CASES[name], hidden, weight, y)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_liger_matches_the_torch_loop():
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("liger_kernel") is None:
        pytest.skip("triton / liger-kernel not installed (extra hybridtrain[cuda])")
    root = Path(__file__).resolve().parents[2]
    code = "from tests.unit.test_fused_loss import check_liger_matches_the_torch_loop as c; c()"
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr[-3000:]


def _forward_0_8_2(ctx, _input, weight, target, bias=None, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
                   label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None,
                   use_token_scaling=False, return_token_accuracy=False, return_predicted_tokens=False): ...


def _forward_0_8_5(ctx, _input, weight, target, bias=None, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
                   label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None,
                   use_token_scaling=False, return_token_accuracy=False, return_predicted_tokens=False, ce_impl=None,
                   ce_mode=None, chunk_mem_const=4): ...


def test_liger_is_checked_against_the_call_it_gets(monkeypatch, caplog):
    """A Liger release whose LigerFusedLinearCrossEntropyFunction takes fewer positional arguments
    (0.8.2: no chunk_mem_const; the first loss would raise TypeError) is refused for
    fused_loss=liger and replaced by the compiled loss, with a warning, under auto on CUDA."""
    from hybridtrain.ops import liger_loader as liger

    assert liger.signature_problem(_forward_0_8_5) is None
    problem = liger.signature_problem(_forward_0_8_2)
    assert problem and "chunk_mem_const" in problem
    monkeypatch.setattr(liger, "problem", lambda: f"liger-kernel 0.8.2: {problem}; {liger.FIX}")
    with pytest.raises(ValueError, match="fused_loss: liger, but liger-kernel 0.8.2.*liger-kernel>=0.8.5"):
        backend.resolve_fused_loss("liger", "cuda")
    with caplog.at_level("WARNING", logger=backend.__name__):
        assert backend.resolve_fused_loss("auto", "cuda") == "compiled"
    if importlib.util.find_spec("liger_kernel"):
        assert "liger-kernel 0.8.2" in caplog.text and "compiled loss" in caplog.text
    assert backend.resolve_fused_loss("auto", "cpu") == "torch"
