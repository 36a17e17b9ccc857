"""Packed sequences: the chunked SSD scan equals the token-by-token recurrence, the conv and the
SSM state restart at every document, attention never crosses one, and a packed row gives the
same logits (and gradients) as separate forward passes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.helpers.models import perturbed_model

from hybridtrain.models.nemotron_h import tiny_config
from hybridtrain.models.nemotron_h.model import seq_idx_from_cu_seqlens, seq_idx_from_position_ids
from hybridtrain.models.nemotron_h.ssd import causal_conv1d_torch, ssd_chunked, ssd_reference


def _ssm_inputs(b, L, h=4, p=3, g=2, n=5, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(b, L, h, p, dtype=torch.float64)
    dt = F.softplus(torch.randn(b, L, h, dtype=torch.float64) - 1)
    A = -torch.rand(h, dtype=torch.float64) * 2 - 0.1
    B = torch.randn(b, L, g, n, dtype=torch.float64)
    C = torch.randn(b, L, g, n, dtype=torch.float64)
    D = torch.randn(h, dtype=torch.float64)
    return x, dt, A, B, C, D


def _seq_idx(lengths_per_row):
    rows = []
    for lengths in lengths_per_row:
        rows.append(torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)]))
    return torch.stack(rows)


@pytest.mark.parametrize("chunk", [1, 4, 8, 64])
@pytest.mark.parametrize("L", [1, 7, 16, 29])
def test_chunked_scan_equals_recurrence(chunk, L):
    x, dt, A, B, C, D = _ssm_inputs(2, L)
    y = ssd_chunked(x, dt, A, B, C, chunk, D=D)
    ref = ssd_reference(x, dt, A, B, C, D)
    assert (y.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("chunk", [4, 8])
@pytest.mark.parametrize(
    "docs",
    [
        [[3, 9, 1, 11], [24]],  # boundaries mid-chunk, a 1-token document, one row unpacked
        [[8, 8, 8], [4, 4, 16]],  # boundaries exactly on chunk boundaries
        [[1] * 24, [2, 21, 1]],  # every token its own document; a document spanning > 2 chunks
    ],
)
def test_chunked_scan_restarts_state_at_documents(chunk, docs):
    L = sum(docs[0])
    seq_idx = _seq_idx(docs)
    x, dt, A, B, C, D = _ssm_inputs(2, L, seed=1)
    y, final = ssd_chunked(x, dt, A, B, C, chunk, D=D, seq_idx=seq_idx, return_final_state=True)
    ref = ssd_reference(x, dt, A, B, C, D, seq_idx=seq_idx)
    assert (y.double() - ref).abs().max() < 1e-5
    # the final state is that of the last document alone
    last = docs[0][-1]
    _, final_alone = ssd_chunked(x[:1, -last:], dt[:1, -last:], A, B[:1, -last:], C[:1, -last:], chunk,
                                 D=D, return_final_state=True)
    assert (final[:1] - final_alone).abs().max() < 1e-6


def test_chunked_scan_initial_and_final_state_equal_the_reference():
    x, dt, A, B, C, D = _ssm_inputs(2, 19, seed=3)
    init = torch.randn(2, 4, 3, 5, dtype=torch.float64)
    seq_idx = _seq_idx([[5, 14], [19]])
    y, final = ssd_chunked(x, dt, A, B, C, 8, D=D, seq_idx=seq_idx, initial_state=init, return_final_state=True)
    ref_y, ref_final = ssd_reference(x, dt, A, B, C, D, seq_idx=seq_idx, initial_state=init, return_final_state=True)
    assert (y - ref_y).abs().max() < 1e-10 and (final - ref_final).abs().max() < 1e-10


def test_chunked_scan_with_initial_state_continues_the_first_document():
    x, dt, A, B, C, D = _ssm_inputs(1, 20, seed=2)
    seq_idx = _seq_idx([[13, 7]])
    full = ssd_chunked(x, dt, A, B, C, 4, D=D, seq_idx=seq_idx)
    _, s = ssd_chunked(x[:, :6], dt[:, :6], A, B[:, :6], C[:, :6], 4, D=D, return_final_state=True)
    rest = ssd_chunked(x[:, 6:], dt[:, 6:], A, B[:, 6:], C[:, 6:], 4, D=D, seq_idx=seq_idx[:, 6:], initial_state=s)
    assert (full[:, 6:] - rest).abs().max() < 1e-6


def test_conv_restarts_at_documents(monkeypatch):
    """Each document is convolved alone (documents shorter than the window included), and the
    eager form (whole rows, the positions a document start cuts put back) gives bit for bit the
    values and gradients of the masked form compiled blocks trace."""
    torch.manual_seed(0)
    d, k = 6, 4
    rows = [[5, 1, 2, 9], [1, 3, 13]]
    w0, b0, x0, g = torch.randn(d, k), torch.randn(d), torch.randn(2, d, 17), torch.randn(2, d, 17)

    def run():
        w, bias, x = (t.clone().requires_grad_() for t in (w0, b0, x0))
        y = causal_conv1d_torch(x, w, bias, seq_idx=_seq_idx(rows))
        y.backward(g)
        return y.detach(), x.grad, w.grad, bias.grad

    eager = run()
    for r, docs in enumerate(rows):
        ref = torch.cat([causal_conv1d_torch(part, w0, b0) for part in x0[r:r + 1].split(docs, dim=-1)], dim=-1)
        torch.testing.assert_close(eager[0][r:r + 1], ref)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the traced form, eagerly
    for got, want in zip(eager, run()):
        assert torch.equal(got, want)
    plain = causal_conv1d_torch(x0, w0, b0, seq_idx=_seq_idx([[17], [17]]))
    assert (plain - causal_conv1d_torch(x0, w0, b0)).abs().max() < 1e-6


def test_seq_idx_derivation():
    assert seq_idx_from_cu_seqlens(torch.tensor([0, 3, 5, 8]), 1, 8).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    # flattened over the batch; a document crossing a row boundary is split there
    s = seq_idx_from_cu_seqlens(torch.tensor([0, 2, 6, 8]), 2, 4)
    assert s.tolist() == [[0, 0, 1, 1], [2, 2, 3, 3]]
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    assert seq_idx_from_position_ids(pos, 1, 8).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    for bad in ([1, 8], [0, 7], [0, 5, 3, 8]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            seq_idx_from_cu_seqlens(torch.tensor(bad), 1, 8)


DOCS = [11, 5, 16]  # boundaries mid-chunk (11) and exactly on a chunk boundary (16); chunk_size 8


def _separate_and_packed(model, ids, docs):
    sep = torch.cat([model(part) for part in ids.split(docs, dim=1)], dim=1)
    cu = torch.tensor([0] + list(torch.tensor(docs).cumsum(0)))
    pos = torch.cat([torch.arange(n) for n in docs])[None]
    return sep, model(ids, cu_seqlens=cu), model(ids, position_ids=pos)


@pytest.mark.parametrize("docs", [DOCS, [3, 13, 7]])
def test_packed_logits_equal_separate_forwards(docs):
    cfg = tiny_config("mixed")  # all four layer types
    assert set(cfg.layers_block_type) == {"linear_attention", "full_attention", "mlp", "moe"}
    model = perturbed_model(cfg, seed=5)
    torch.manual_seed(6)
    ids = torch.randint(0, cfg.vocab_size, (1, sum(docs)))
    with torch.no_grad():
        sep, packed_cu, packed_pos = _separate_and_packed(model, ids, docs)
        unpacked = model(ids)
    d_cu = (sep - packed_cu).abs().max().item()
    d_pos = (sep - packed_pos).abs().max().item()
    print(f"\n[packing] docs {docs}: max diff cu_seqlens {d_cu:.2e}, position_ids {d_pos:.2e}")
    assert d_cu <= 1e-5 and d_pos <= 1e-5
    # and the packing matters: without it later documents see earlier ones
    assert (unpacked[:, docs[0]:] - sep[:, docs[0]:]).abs().max() > 1e-3


def test_packed_batch_rows_with_flattened_cu_seqlens():
    cfg = tiny_config("mixed")
    model = perturbed_model(cfg, seed=7)
    torch.manual_seed(8)
    rows = [[9, 14, 1], [24]]
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    cu = torch.tensor([0, 9, 23, 24, 48])
    with torch.no_grad():
        packed = model(ids, cu_seqlens=cu)
        for r, docs in enumerate(rows):
            sep = torch.cat([model(p) for p in ids[r : r + 1].split(docs, dim=1)], dim=1)
            assert (packed[r : r + 1] - sep).abs().max() <= 1e-5


def test_packed_gradients_equal_separate_forwards():
    cfg = tiny_config("mixed")
    model = perturbed_model(cfg, seed=9)
    torch.manual_seed(10)
    ids = torch.randint(0, cfg.vocab_size, (1, sum(DOCS)))
    w = torch.randn(1, sum(DOCS), cfg.vocab_size)
    cu = torch.tensor([0] + list(torch.tensor(DOCS).cumsum(0)))
    (model(ids, cu_seqlens=cu) * w).sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    loss = sum((model(p) * wp).sum() for p, wp in zip(ids.split(DOCS, dim=1), w.split(DOCS, dim=1)))
    loss.backward()
    for n, p in model.named_parameters():
        assert torch.isfinite(packed[n]).all(), n
        rel = (packed[n] - p.grad).norm() / p.grad.norm().clamp(min=1e-12)
        assert rel < 1e-4, (n, rel.item())


def test_the_scans_cached_causal_masks_serve_training_after_inference_mode():
    """The scan's causal masks are built once per size and device; one first built under
    inference mode (decoding) is a plain tensor that a later training forward saves for backward."""
    from hybridtrain.models.nemotron_h.numerics import tril_mask

    with torch.inference_mode():
        first = tril_mask(7, 0, torch.device("cpu"))
    assert not first.is_inference() and tril_mask(7, 0, torch.device("cpu")) is first
    assert torch.equal(first, torch.tril(torch.ones(7, 7, dtype=torch.bool)))
    x = torch.randn(7, 7, requires_grad=True)
    x.masked_fill(~first, 0).sum().backward()
    assert torch.equal(x.grad, first.float())
