"""The decoding step as a captured graph: on the static cache it compiles whole
(``torch.compile(fullgraph=True)``: no graph break, no host sync, every cache update an in-place
device op), its compiled steps give the eager step's logits and states, and :class:`StepGraph`
(the CUDA-graph wrapper) driven by a compiled stand-in for ``torch.cuda.graph`` — replays that
must not recompile, i.e. read nothing from the host — generates the eager greedy tokens."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from tests.helpers.models import perturbed_model

from hybridtrain.models.nemotron_h import generation as G
from hybridtrain.models.nemotron_h import tiny_config
from hybridtrain.ops import backend
from hybridtrain.ops.sampling import GenerationConfig, decode


def device_forms():
    return backend.using(dataclasses.replace(backend.settings(), cpu_decode_forms=False))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", ["mixed"])  # all four layer types
def test_the_step_compiles_whole_and_matches_eager(kind):
    model = perturbed_model(tiny_config(kind), seed=3).eval()
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded row
    with torch.no_grad():
        _, cache = G.prefill(model, ids, mask, max_length=12)
        twin = copy.deepcopy(cache)
        step = torch.compile(G._step, fullgraph=True, backend="aot_eager", dynamic=False)
        for t in range(3):
            tok = torch.tensor([5 + t, 9 * t])
            with device_forms():
                eager = G._step(model, cache, tok)
            assert torch.allclose(step(model, twin, tok), eager, atol=1e-5, rtol=1e-5)
        assert torch.equal(twin.position, cache.position) and torch.equal(twin.valid, cache.valid)
        for name, s in cache.layers.items():
            for a, b in zip(dataclasses.astuple(s), dataclasses.astuple(twin.layers[name])):
                if torch.is_tensor(a):
                    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), name


@pytest.mark.parametrize("kind", ["mixed"])  # all four layer types
def test_step_graph_replays_generate_the_eager_tokens(kind):
    model = perturbed_model(tiny_config(kind), seed=5).eval()
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(6))
    config = GenerationConfig(max_new_tokens=8)
    expected = model.generate(ids, max_new_tokens=8)
    with torch.no_grad():
        logits, cache = G.prefill(model, ids, max_length=ids.shape[1] + 8)
        before = [t.clone() for t in cache.mutable_tensors()]
        graph = G.StepGraph(model, cache, ids[:, -1], capture=G.compiled_capture)
        # the capture's warm-up left the cache as prefill made it
        assert all(torch.equal(a, b) for a, b in zip(before, cache.mutable_tensors()))
        out = decode(lambda: logits, lambda tok: G.decode_step(model, cache, tok, graph), ids, config)
    assert torch.equal(out, expected)
    assert cache.length == int(cache.position) == ids.shape[1] + 7
    # a cache with room for one step only: the capture's warm-up steps fit too
    short = model.generate(ids, max_new_tokens=2)
    with torch.no_grad():
        logits, cache = G.prefill(model, ids, max_length=ids.shape[1] + 2)
        graph = G.StepGraph(model, cache, ids[:, -1], capture=G.compiled_capture)
        out = decode(lambda: logits, lambda tok: G.decode_step(model, cache, tok, graph), ids,
                     GenerationConfig(max_new_tokens=2))
    assert torch.equal(out, short)
