"""flash-attn varlen as the compiled path for packed rows (``hybridtrain::flash_document_attention``,
a custom op around flash-attn's own ``torch.library`` ops): chosen where flash-attn imports on
CUDA in bf16/fp16, flex_attention (the named fallback) elsewhere; the op compiles into one graph
(``fullgraph=True``) and its outputs and gradients are the device-mask path's.

flash-attn is CUDA C++ and cannot run here: ``tests/helpers/fake_flash_attn.py`` stands in,
computing its varlen attention (forward, log-sum-exp, backward) in PyTorch."""

from __future__ import annotations

import sys

import pytest
import torch

from hybridtrain.ops import backend
from hybridtrain.ops.attention import document_causal_attention, flash_ok
from hybridtrain.ops.flash_varlen import flash_document_attention, forget_flash_varlen
from tests.helpers import fake_flash_attn


@pytest.fixture
def flash_calls(monkeypatch):
    """The stand-in ``flash_attn`` in ``sys.modules``; the calls its kernels get."""
    fake_flash_attn.install(monkeypatch)
    forget_flash_varlen()
    yield fake_flash_attn.CALLS
    forget_flash_varlen()


def test_flash_varlen_is_the_path_for_packed_rows_where_it_imports(flash_calls, monkeypatch):
    bf16 = torch.bfloat16
    assert flash_ok("cuda", bf16, 0, 24, 24) and flash_ok("cuda", torch.float16, 0, 24, 24)
    assert not flash_ok("cpu", bf16, 0, 24, 24)  # a CPU: the device-mask path
    assert not flash_ok("cuda", torch.float32, 0, 24, 24)  # flash-attn runs bf16/fp16 only
    assert not flash_ok("cuda", bf16, 9, 15, 24)  # queries offset into the keys (KV cache, CP)
    assert "hybridtrain::flash_document_attention" in backend.kernel_paths("cuda")["attention"]
    assert "flash_attn" not in backend.slow_paths("cuda", bf16)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed: flex, named, and a warning
    forget_flash_varlen()
    assert not flash_ok("cuda", bf16, 0, 24, 24)
    assert "flex_attention (compiled blocks; fallback: flash-attn is not installed)" in (
        backend.kernel_paths("cuda")["attention"])
    assert "flash-attn>=" in backend.slow_paths("cuda", bf16)["flash_attn"]


def test_the_flash_op_compiles_whole_and_matches_the_device_mask_path(flash_calls):
    """fullgraph (one graph, no break) around the op; output and q/k/v gradients equal to the
    eager per-document path (fp32, 1e-5), the output also to compiled flex_attention (no
    gradient: flex has no CPU backward). Grouped-query heads, three documents in two rows."""
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, 24, 8, generator=g) for h in (4, 2, 2))
    seq_idx = torch.tensor([[0] * 5 + [1] * 19, [4] * 24], dtype=torch.int32)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, seq_idx)
        return [out.detach()] + list(torch.autograd.grad(out.sin().sum(), leaves))

    want = run(document_causal_attention)
    torch._dynamo.reset()
    counters.clear()
    got = run(torch.compile(lambda *a: flash_document_attention(*a) * 1.0, fullgraph=True, backend="aot_eager",
                            dynamic=False))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert flash_calls == [("forward", [5, 19, 24]), ("backward", [5, 19, 24])]
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda s: f"#{i}: {s}")
    flex = torch.compile(document_causal_attention, fullgraph=True, backend="aot_eager", dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(got[0], flex(q, k, v, seq_idx), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
