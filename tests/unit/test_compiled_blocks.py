"""Blocks compile into one graph (``torch.compile(fullgraph=True)``: no graph break, no host sync —
MoE routing, token counts and the grouped-GEMM offsets stay on the device), with the eager
forward's outputs and gradients (fp32, 1e-5). ``aot_eager``: the traced graphs run as traced (no
C++ compiler needed).

Mamba2 also on packed rows (``seq_idx``: documents restart the conv and the state). Not yet
whole (as of 2026-11-26): attention over packed rows (``document_spans`` reads the document
boundaries on the host)."""

from __future__ import annotations

import time

import pytest
import torch
from tests.helpers.models import perturbed_model

from hybridtrain.distributed.compile import compile_enabled
from hybridtrain.models.nemotron_h import tiny_config
from hybridtrain.models.nemotron_h.model import SequenceInfo

CASES = [("linear_attention", True), ("full_attention", False), ("mlp", False), ("moe", False)]  # (type, packed)


@pytest.fixture(scope="module")
def model():
    return perturbed_model(tiny_config("mixed"), seed=1)  # all four block types


def _run(block, fn, x, info):
    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = fn(x, info)
    y.pow(2).mean().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in block.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("block_type,packed", CASES)
def test_block_compiles_whole_and_matches_eager(model, block_type, packed):
    torch._dynamo.reset()
    block = next(b for b in model.backbone.layers.values() if b.block_type == block_type)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 24, model.config.hidden_size, generator=g)
    info = SequenceInfo(seq_idx=torch.tensor([[0] * 10 + [1] * 14, [2] * 24], dtype=torch.int32) if packed else None)
    eager = _run(block, block, x, info)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager", dynamic=False)
    t0 = time.perf_counter()
    got = _run(block, compiled, x, info)
    print(f"\n[compile] {block_type}: first compiled forward+backward {time.perf_counter() - t0:.1f} s (aot_eager)")
    torch.testing.assert_close(got[0], eager[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], eager[1], rtol=1e-5, atol=1e-5)
    assert got[2].keys() == eager[2].keys()
    for n in eager[2]:
        torch.testing.assert_close(got[2][n], eager[2][n], rtol=1e-5, atol=1e-5, msg=n)
    torch._dynamo.reset()


def test_compile_auto_is_on_for_cuda_only():
    assert compile_enabled("auto", "cuda") and not compile_enabled("auto", "cpu")
    assert compile_enabled(True, "cpu") and not compile_enabled(False, "cuda")
    with pytest.raises(ValueError, match="training.compile"):
        compile_enabled("sometimes", "cpu")


def test_compiled_scan_with_initial_and_final_state_matches_eager():
    """The SSD scan's compiled backward (state passing differentiated by hand) against eager
    (autograd) with an initial state (context parallelism) and the final state, on documents
    crossing chunk boundaries, padding in the last chunk."""
    from hybridtrain.models.nemotron_h.ssd import ssd_chunked

    torch._dynamo.reset()
    g_ = torch.Generator().manual_seed(0)
    b, L, h, p, g, n = 2, 11, 4, 3, 2, 5
    args = [torch.randn(b, L, h, p, generator=g_), torch.rand(b, L, h, generator=g_) * 0.5 + 0.05,
            -torch.rand(h, generator=g_) - 0.2, torch.randn(b, L, g, n, generator=g_),
            torch.randn(b, L, g, n, generator=g_), torch.randn(h, generator=g_), torch.randn(b, h, p, n, generator=g_)]
    seq_idx = torch.tensor([[0] * 3 + [1] * 6 + [2] * 2, [5] * 9 + [6] * 2])

    def fn(x, dt, A, B, C, D, init):
        y, final = ssd_chunked(x, dt, A, B, C, 4, D=D, seq_idx=seq_idx, initial_state=init, return_final_state=True)
        return y.pow(2).sum() + final.sin().sum()

    results = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=False)):
        leaves = [t.clone().requires_grad_() for t in args]
        loss = f(*leaves)
        results.append([loss.detach()] + list(torch.autograd.grad(loss, leaves)))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
