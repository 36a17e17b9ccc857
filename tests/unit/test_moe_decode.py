"""The MoE layer of a captured decoding step (``MoE.step`` on the device forms) computes the chosen
experts over the stacked weights as they are: no copy of an expert's weights per token (each
operator's new tensors counted under a dispatch mode), the same output as the layer's forward,
the same greedy tokens as the eager CPU forms and ``transformers``, and one whole graph under
``torch.compile(fullgraph=True)`` (no host value: what a CUDA-graph capture needs); both forms,
the grouped GEMM (``grouped_mm``, offsets on the device) and its fallback (every local expert over
the step's tokens)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.helpers.hf import hf_from_dir
from tests.helpers.models import perturbed_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hybridtrain.models.nemotron_h import tiny_config
from hybridtrain.ops import backend

FORMS = {"grouped": True, "dense": False}  # form -> training.grouped_mm


def device_forms(form: str):
    """The forms of a captured step (no eager CPU forms), with ``form``'s experts."""
    return backend.using(dataclasses.replace(backend.settings(), cpu_decode_forms=False,
                                             grouped_mm=FORMS[form]))


class Allocations(TorchDispatchMode):
    """Records (operator, shape) of every new tensor an operator run inside it returns (not views
    of its inputs, not its in-place results)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.seen.append((str(func.overloadpacket.__name__), tuple(t.shape)))
        return out


def _moe(seed: int = 4, dtype=torch.float32):
    model = perturbed_model(tiny_config("moe"), seed=seed).to(dtype)
    return model, next(b.mixer for b in model.backbone.layers.values() if b.block_type == "moe")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("tokens", [1, 3, 12])
def test_decode_step_copies_no_expert_weights(form, tokens):
    model, moe = _moe()
    _, I, H = moe.experts.up_proj.shape
    x = torch.randn(tokens, 1, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), device_forms(form), Allocations() as rec:
        moe.step(x)
    ops = {name for name, _ in rec.seen}
    assert ("_grouped_mm" in ops) == (form == "grouped"), ops
    # the copies of the chosen experts' weights ([T k, I, H] and [T k, H, I] before) had an expert
    # weight's shape; nothing here has, and all new tensors together stay below those of the
    # up projection's copies alone
    weight_like = [(n, s) for n, s in rec.seen if len(s) == 3 and s[1:] in ((I, H), (H, I))]
    assert not weight_like, weight_like
    total = sum(torch.Size(s).numel() for _, s in rec.seen)
    k = moe.gate.top_k
    assert total < tokens * k * I * H, (total, tokens * k * I * H)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_matches_the_layer(form, tokens, dtype):
    model, moe = _moe(dtype=dtype)
    x = torch.randn(tokens, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(5)).to(dtype)
    with torch.no_grad(), device_forms(form):
        step, full = moe.step(x), moe(x)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert torch.allclose(step.float(), full.float(), **tol)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    ours = perturbed_model(tiny_config("moe"), seed=1)
    d = tmp_path_factory.mktemp("moe")
    ours.save_pretrained(d)
    return ours, hf_from_dir(d)


@pytest.mark.parametrize("form", FORMS)
def test_greedy_tokens_equal_the_cpu_forms_and_transformers(models, form):
    ours, hf = models
    ids = torch.randint(0, 256, (3, 9), generator=torch.Generator().manual_seed(2))
    expected = ours.generate(ids, max_new_tokens=12)  # the eager CPU forms (host-grouped experts)
    with device_forms(form):
        got = ours.generate(ids, max_new_tokens=12)
    assert torch.equal(got, expected)
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert torch.equal(got, theirs)


@pytest.mark.parametrize("form,dtype", [("grouped", torch.bfloat16), ("dense", torch.float32)])
def test_decode_step_compiles_whole(form, dtype):
    """No graph break and no host value in either form (what a CUDA-graph capture needs)."""
    torch._dynamo.reset()
    model, moe = _moe(dtype=dtype)
    x = torch.randn(3, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(5)).to(dtype)
    with torch.no_grad(), device_forms(form), Allocations() as rec:
        eager = moe.step(x)
    assert ("_grouped_mm" in {n for n, _ in rec.seen}) == (form == "grouped")
    with torch.no_grad(), device_forms(form):
        compiled = torch.compile(moe.step, fullgraph=True, backend="aot_eager", dynamic=False)(x)
    torch._dynamo.reset()
    assert torch.equal(compiled, eager)
