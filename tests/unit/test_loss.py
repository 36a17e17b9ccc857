"""Chunked linear cross-entropy and token log-probabilities equal the plain computation."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hybridtrain.ops import backend
from hybridtrain.ops.backend import auto_chunk_size
from hybridtrain.ops.loss import LinearCrossEntropy, cross_entropy_sum, token_logprobs


def _inputs(n=37, h=16, v=101, dtype=torch.float32, ignore_frac=0.3, seed=0, shape=None):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignore_frac] = -100
    if shape is not None:
        hidden, labels = hidden.reshape(*shape, h), labels.reshape(shape)
    return hidden.requires_grad_(), weight.requires_grad_(), labels


def _reference(hidden, weight, labels):
    """Independent reference: full fp32 logits through torch's own cross_entropy."""
    logits = hidden.reshape(-1, hidden.shape[-1]).double() @ weight.double().t()
    return F.cross_entropy(logits, labels.reshape(-1), ignore_index=-100, reduction="sum")


def _loss_and_grads(fn, hidden, weight, labels):
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    loss = fn(hidden, weight, labels)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("recompute", [False, True], ids=["eager_grads", "recompute"])
@pytest.mark.parametrize("chunk_size", [1, 5, 8, 36, 37, 64, 4096, "auto"])
@pytest.mark.parametrize("shape", [None, (1, 37)])
def test_fp32_loss_and_grads_match_plain(chunk_size, shape, recompute):
    hidden, weight, labels = _inputs(shape=shape)
    plain = _loss_and_grads(lambda h, w, y: cross_entropy_sum(h, w, y, chunk_size=None), hidden, weight, labels)
    chunked = _loss_and_grads(
        lambda h, w, y: cross_entropy_sum(h, w, y, chunk_size=chunk_size, recompute=recompute), hidden, weight, labels
    )
    ref = _loss_and_grads(_reference, hidden, weight, labels)
    assert chunked[0].dtype == torch.float32
    for got, want in zip(chunked, plain):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for got, want in zip(chunked, ref):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-5)


def test_batched_shape_equals_flat():
    hidden, weight, labels = _inputs(n=24, shape=(3, 8))
    flat = cross_entropy_sum(hidden.reshape(24, -1), weight, labels.reshape(24), chunk_size=7)
    batched = cross_entropy_sum(hidden, weight, labels, chunk_size=7)
    torch.testing.assert_close(flat, batched, rtol=0, atol=0)


@pytest.mark.parametrize("recompute", [False, True], ids=["eager_grads", "recompute"])
def test_ignore_index_and_all_ignored_chunk(recompute):
    hidden, weight, labels = _inputs(n=20, ignore_frac=0.0)
    labels[:8] = -100  # first chunk of 8 entirely ignored, second one partly
    labels[9] = -100
    plain = _loss_and_grads(lambda h, w, y: cross_entropy_sum(h, w, y, chunk_size=None), hidden, weight, labels)
    chunked = _loss_and_grads(lambda h, w, y: cross_entropy_sum(h, w, y, chunk_size=8, recompute=recompute), hidden, weight, labels)
    for got, want in zip(chunked, plain):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Ignored positions get exactly zero gradient and do not enter the loss.
    assert torch.all(chunked[1][:8] == 0) and torch.all(chunked[1][9] == 0)
    kept = labels != -100
    only_kept = cross_entropy_sum(hidden[kept], weight, labels[kept], chunk_size=8, recompute=recompute)
    torch.testing.assert_close(chunked[0], only_kept.detach(), rtol=1e-6, atol=1e-5)


def test_custom_ignore_index():
    hidden, weight, labels = _inputs(n=12, ignore_frac=0.0)
    labels[3] = 7
    masked = labels.clone()
    masked[labels == 7] = -100
    got = cross_entropy_sum(hidden, weight, labels, chunk_size=5, ignore_index=7)
    want = cross_entropy_sum(hidden, weight, masked, chunk_size=None)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("recompute", [False, True], ids=["eager_grads", "recompute"])
def test_all_ignored_gives_zero_loss_and_grads(recompute):
    hidden, weight, labels = _inputs(n=10)
    labels[:] = -100
    loss, gh, gw = _loss_and_grads(lambda h, w, y: cross_entropy_sum(h, w, y, chunk_size=4, recompute=recompute), hidden, weight, labels)
    assert loss.item() == 0.0 and torch.all(gh == 0) and torch.all(gw == 0)


@pytest.mark.parametrize("recompute", [False, True], ids=["eager_grads", "recompute"])
def test_grad_output_scaling_and_frozen_weight(recompute):
    hidden, weight, labels = _inputs()
    weight.requires_grad_(False)
    h1 = hidden.detach().clone().requires_grad_()
    (cross_entropy_sum(h1, weight, labels, chunk_size=6, recompute=recompute) * 0.25).backward()
    h2 = hidden.detach().clone().requires_grad_()
    (cross_entropy_sum(h2, weight, labels, chunk_size=None) * 0.25).backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-6)
    assert weight.grad is None


def _assert_bf16_close(got, want):
    """bf16 gradients against the fp32 truth: within 2**-7 of the largest entry. One bf16 rounding
    of the logits and of each chunk's partial weight gradient is 2**-9 relative each, so a few of
    them stay well inside 2**-7; a wrong softmax, label or mask is off by O(1)."""
    scale = want.abs().max()
    assert (got.double() - want.double()).abs().max() <= 2**-7 * scale


@pytest.mark.parametrize("recompute", [False, True], ids=["eager_grads", "recompute"])
def test_bf16_inputs_fp32_loss_grads_in_input_dtypes(recompute):
    hidden, weight, labels = _inputs(n=64, h=32, v=257, dtype=torch.bfloat16)
    loss, gh, gw = _loss_and_grads(lambda h, w, y: cross_entropy_sum(h, w, y, chunk_size=16, recompute=recompute), hidden, weight, labels)
    assert loss.dtype == torch.float32 and gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    # Same bf16 logits as the plain path and fp32 softmax in both: the losses agree to fp32 rounding.
    plain = _loss_and_grads(lambda h, w, y: cross_entropy_sum(h, w, y, chunk_size=None), hidden, weight, labels)
    torch.testing.assert_close(loss, plain[0], rtol=1e-5, atol=1e-4)
    ref = _loss_and_grads(_reference, hidden.float(), weight.float(), labels)
    torch.testing.assert_close(loss.double(), ref[0], rtol=2**-8, atol=0)
    _assert_bf16_close(gh, ref[1])
    _assert_bf16_close(gw, ref[2])


@pytest.mark.parametrize("recompute", [False, True], ids=["eager_grads", "recompute"])
def test_autocast_recomputes_the_same_logits(recompute):
    """Under autocast the chunk logits are bf16 matmuls in forward AND in backward (autocast is not
    active in backward), so the saved log-sum-exp matches the recomputed logits."""
    hidden, weight, labels = _inputs(n=40, h=32, v=129)
    hidden = (hidden.detach() * 8).requires_grad_()  # logits of O(30): a bf16/fp32 mix-up shows
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, gh, gw = _loss_and_grads(lambda h, w, y: cross_entropy_sum(h, w, y, chunk_size=16, recompute=recompute), hidden, weight, labels)
        plain = _loss_and_grads(lambda h, w, y: cross_entropy_sum(h, w, y, chunk_size=None), hidden, weight, labels)
    assert loss.dtype == torch.float32 and gh.dtype == torch.float32 and gw.dtype == torch.float32
    torch.testing.assert_close(loss, plain[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gh, plain[1], rtol=0, atol=2**-9 * plain[1].abs().max().item())
    # Each chunk's partial weight gradient is rounded to bf16 once before the fp32 sum: a few ulps.
    torch.testing.assert_close(gw, plain[2], rtol=0, atol=2**-7 * plain[2].abs().max().item())


def test_shape_errors_name_the_tensors():
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="LM head weight"):
        cross_entropy_sum(hidden, weight[:, :-1], labels)
    with pytest.raises(ValueError, match="labels"):
        cross_entropy_sum(hidden, weight, labels[:-1])
    with pytest.raises(ValueError, match="chunk_size"):
        cross_entropy_sum(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="chunk_size"):
        cross_entropy_sum(hidden, weight, labels, chunk_size="big")


def test_auto_chunk_size_is_a_logit_budget():
    """auto: 2^25 logits per chunk in multiples of 64 tokens (1024 at the 48M MoE's 32000,
    256 at Nemotron's 131072), never below 64."""
    assert auto_chunk_size(32000) == 1024
    assert auto_chunk_size(131072) == 256
    assert auto_chunk_size(10**9) == 64
    assert auto_chunk_size(101) % 64 == 0 and auto_chunk_size(101) * 101 <= 1 << 25


def test_no_grad_forward_forms_no_gradients():
    hidden, weight, labels = _inputs()
    with torch.no_grad():
        got = cross_entropy_sum(hidden, weight, labels, chunk_size=8)
    assert not got.requires_grad
    torch.testing.assert_close(got, cross_entropy_sum(hidden, weight, labels, chunk_size=None).detach(),
                               rtol=1e-6, atol=1e-5)
    frozen = cross_entropy_sum(hidden.detach(), weight.detach(), labels, chunk_size=8)
    assert not frozen.requires_grad and frozen.item() == got.item()


def test_eager_grads_refuse_a_second_backward():
    hidden, weight, labels = _inputs()
    loss = cross_entropy_sum(hidden, weight, labels, chunk_size=8) * 2
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="recompute=True"):
        loss.backward()
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss = cross_entropy_sum(h2, w2, labels, chunk_size=8, recompute=True)
    loss.backward(retain_graph=True)
    loss.backward()
    torch.testing.assert_close(h2.grad, hidden.grad, rtol=1e-5, atol=1e-6)  # 2 x one backward each


# -- GEMM row padding (ops.backend) ---------------------------------------------------------------
class _MatmulRows(TorchDispatchMode):
    """Row counts of the [rows, H] @ [H, V] head matmuls that run."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.rows = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "mm" and args[1].shape[-1] == self.vocab:
            self.rows.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recompute", [False, True], ids=["eager_grads", "recompute"])
def test_label_rows_padded_to_the_backend_multiple(recompute):
    """With a GEMM row multiple configured the label rows are padded with ignored rows (chunks of
    64 over 128 rows, not 64 + 37 over 101); loss and gradients are the unpadded ones."""
    hidden, weight, labels = _inputs(n=150, h=16, v=101, ignore_frac=0.3)
    results = []
    for multiple in (64, 1):
        with backend.using(backend.BackendSettings(gemm_row_multiple=multiple)), _MatmulRows(101) as seen:
            results.append(_loss_and_grads(
                lambda h, w, y: cross_entropy_sum(h, w, y, chunk_size=64, recompute=recompute), hidden, weight, labels))
        n_label = int((labels != -100).sum())
        assert set(seen.rows) == ({64} if multiple == 64 else {64, n_label % 64}), (n_label, seen.rows)
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# -- per-token log-probabilities -----------------------------------------------------------------
def _reference_logprobs(hidden, weight, labels, ignore_index=-100):
    """log_softmax of the full logits at the label, 0 at ignored positions."""
    logp = (hidden.reshape(-1, hidden.shape[-1]) @ weight.t()).log_softmax(-1)
    valid = labels.reshape(-1) != ignore_index
    picked = logp.gather(1, labels.reshape(-1).clamp(min=0)[:, None]).squeeze(1)
    return torch.where(valid, picked, torch.zeros_like(picked)).view(labels.shape)


@pytest.mark.parametrize("chunk_size", [None, 1, 7, 16, "auto"])
@pytest.mark.parametrize("shape", [None, (2, 20)])
def test_token_logprobs_match_log_softmax(chunk_size, shape):
    hidden, weight, labels = _inputs(n=40, shape=shape)
    g = torch.randn(labels.shape, generator=torch.Generator().manual_seed(5))
    got = token_logprobs(hidden, weight, labels, chunk_size=chunk_size)
    assert got.shape == labels.shape and got.dtype == torch.float32
    assert torch.all(got[labels == -100] == 0) and torch.all(got[labels != -100] < 0)
    gh, gw = torch.autograd.grad((got * g).sum(), (hidden, weight))
    h2, w2 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    want = _reference_logprobs(h2, w2, labels)
    rh, rw = torch.autograd.grad((want * g.double()).sum(), (h2, w2))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh.double(), rh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw.double(), rw, rtol=1e-5, atol=1e-5)
    assert torch.all(gh.reshape(-1, gh.shape[-1])[labels.reshape(-1) == -100] == 0)


def test_token_logprobs_sum_is_minus_the_loss():
    """Same chunked pass: the label-token sum of the log-probs is minus cross_entropy_sum."""
    hidden, weight, labels = _inputs(n=50)
    for chunk_size in (8, None):
        logp = token_logprobs(hidden, weight, labels, chunk_size=chunk_size).sum()
        torch.testing.assert_close(-logp, cross_entropy_sum(hidden, weight, labels, chunk_size=chunk_size),
                                   rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_token_logprobs_gradcheck(dtype):
    """Hand-written backward against finite differences; fp64 tightly, fp32 loosely."""
    hidden, weight, labels = _inputs(n=9, h=4, v=7, dtype=dtype, ignore_frac=0.3, seed=3)
    tol = dict(eps=1e-6, atol=1e-7, rtol=1e-5) if dtype == torch.float64 else dict(eps=1e-2, atol=1e-2, rtol=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gradcheck warns about fp32 inputs
        assert torch.autograd.gradcheck(lambda h, w: token_logprobs(h, w, labels, chunk_size=4), (hidden, weight),
                                        **tol)
        assert torch.autograd.gradcheck(lambda h, w: cross_entropy_sum(h, w, labels, chunk_size=4, recompute=True),
                                        (hidden, weight), **tol)


def test_token_logprobs_under_autocast_and_without_grad():
    hidden, weight, labels = _inputs(n=40, h=32, v=129)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = token_logprobs(hidden, weight, labels, chunk_size=16)
        plain = token_logprobs(hidden, weight, labels, chunk_size=None)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-4)
    with torch.no_grad():
        frozen = token_logprobs(hidden, weight, labels, chunk_size=16)
    assert not frozen.requires_grad
    torch.testing.assert_close(frozen, token_logprobs(hidden, weight, labels, chunk_size=None).detach(),
                               rtol=1e-6, atol=1e-5)


# -- the module ----------------------------------------------------------------------------------
def test_linear_cross_entropy_module_sum_and_mean():
    hidden, weight, labels = _inputs(n=30, shape=(3, 10))
    head = torch.nn.Linear(16, 101, bias=False)
    with torch.no_grad():
        head.weight.copy_(weight)
    total = cross_entropy_sum(hidden, weight, labels, chunk_size=8)
    assert torch.equal(LinearCrossEntropy(chunk_size=8)(hidden, head, labels), total)
    mean = LinearCrossEntropy(chunk_size=8, reduction="mean")(hidden, head, labels)
    assert torch.equal(mean, total / (labels != -100).sum())
    nothing = torch.full_like(labels, -100)
    assert LinearCrossEntropy(reduction="mean")(hidden, head, nothing).item() == 0.0  # count clamped to 1
    torch.testing.assert_close(LinearCrossEntropy(chunk_size=8).token_logprobs(hidden, head, labels),
                               token_logprobs(hidden, weight, labels, chunk_size=8), rtol=0, atol=0)
    with pytest.raises(ValueError, match="reduction"):
        LinearCrossEntropy(reduction="none")
    with pytest.raises(ValueError, match="chunk_size"):
        LinearCrossEntropy(chunk_size=0)
    with pytest.raises(ValueError, match="bias"):
        LinearCrossEntropy()(hidden, torch.nn.Linear(16, 101), labels)


def test_module_full_logits_mean_is_the_models_labels_loss():
    """``LinearCrossEntropy(chunk_size=None, reduction="mean")`` gives the model's
    ``forward(labels=...)`` loss bit for bit (what the model can hold for it)."""
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config

    torch.manual_seed(0)
    cfg = tiny_config("mixed")
    model = NemotronHForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    labels = torch.randint(0, cfg.vocab_size, (2, 24))
    labels[:, :9] = -100
    want = model(ids, labels=labels)
    got = LinearCrossEntropy(chunk_size=None, reduction="mean")(model.hidden_states(ids), model.lm_head, labels)
    assert torch.equal(got, want)
