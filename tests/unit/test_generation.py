"""Cached decoding (``NemotronHForCausalLM.generate``): greedy and seeded-sampling tokens equal to
``transformers.NemotronHForCausalLM.generate`` (same weights, fp32, its cache), cached logits
equal to the full forward of the same sequence at every step, left-padded batches equal to each
prompt alone, eos stopping, LoRA (applied and merged), bf16."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from tests.helpers.hf import hf_from_dir
from tests.helpers.models import perturbed_model

from hybridtrain.models.nemotron_h import tiny_config
from hybridtrain.models.nemotron_h.generation import decode_step, prefill
from hybridtrain.ops.sampling import filter_logits

KINDS = ["dense", "moe", "mixed"]
PROMPT_LENGTHS = [5, 21]  # tiny chunk_size is 8: shorter than a chunk, and several chunks


def _hf_generate(hf, ids, **kw):
    with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
        return hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for kind in KINDS:
        ours = perturbed_model(tiny_config(kind), seed=1)
        d = tmp_path_factory.mktemp(kind)
        ours.save_pretrained(d)
        out[kind] = (ours, hf_from_dir(d))
    return out


def _prompt(batch, length, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, length), generator=g)


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_match_transformers(models, kind, length):
    ours, hf = models[kind]
    ids = _prompt(2, length)
    a = ours.generate(ids, max_new_tokens=16)
    b = _hf_generate(hf, ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    print(f"\n[generate] {kind} prompt {length}: {a.shape[1] - length} tokens, identical={torch.equal(a, b)}")
    assert torch.equal(a, b)


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
@pytest.mark.parametrize("kind", KINDS)
def test_cached_logits_match_full_forward(models, kind, length):
    ours, _ = models[kind]
    ids = _prompt(2, length, seed=3)
    out = ours.generate(ids, max_new_tokens=16)
    with torch.no_grad():
        full = ours(out)
    logits, cache = prefill(ours, ids, max_length=out.shape[1])
    diffs = [(logits - full[:, length - 1]).abs().max().item()]
    for t in range(length, out.shape[1] - 1):
        diffs.append((decode_step(ours, cache, out[:, t]) - full[:, t]).abs().max().item())
    print(f"\n[generate] {kind} prompt {length}: max|cached - full logits| over {len(diffs)} steps = {max(diffs):.2e}")
    assert max(diffs) <= 1e-4, diffs


@pytest.mark.parametrize("kind", KINDS)
def test_left_padded_batch_equals_each_prompt_alone(models, kind):
    ours, _ = models[kind]
    lengths = [3, 9, 20]
    prompts = [_prompt(1, n, seed=10 + n)[0] for n in lengths]
    L = max(lengths)
    ids = torch.full((len(lengths), L), 7)  # pad id: any token, masked
    mask = torch.zeros(len(lengths), L, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = p
        mask[i, L - len(p):] = 1
    batched = ours.generate(ids, attention_mask=mask, max_new_tokens=12)
    logits_b, cache_b = prefill(ours, ids, mask, max_length=L + 12)
    steps_b: dict = {}
    worst = 0.0
    for i, p in enumerate(prompts):
        alone = ours.generate(p[None], max_new_tokens=12)
        assert torch.equal(batched[i, L:], alone[0, len(p):]), i
        logits_a, cache_a = prefill(ours, p[None], max_length=len(p) + 12)
        worst = max(worst, (logits_a[0] - logits_b[i]).abs().max().item())
        for t in range(11):  # the same token sequence, one step at a time
            la = decode_step(ours, cache_a, alone[:, len(p) + t])
            worst = max(worst, (la[0] - _step_row(ours, cache_b, batched, L + t, i, t, steps_b)).abs().max().item())
    print(f"\n[generate] {kind} left-padded batch of lengths {lengths}: max|logits - alone| = {worst:.2e}")
    assert worst <= 1e-4


def _step_row(model, cache, tokens, pos, row, t, memo: dict):
    """The batched cache's logits at step t, fed once per step for all rows and kept in ``memo``
    (one per cache: a key such as ``id(cache)`` can name a freed cache's steps)."""
    if t not in memo:
        memo[t] = decode_step(model, cache, tokens[:, pos])
    return memo[t][row]


def test_stops_at_eos_per_sequence(models):
    ours, hf = models["mixed"]
    ids = _prompt(2, 9, seed=4)
    free = ours.generate(ids, max_new_tokens=12)
    eos = int(free[0, 9 + 3])  # row 0 reaches it after 4 new tokens
    row1_first = [int(t) for t in free[1, 9:]].index(eos) if eos in free[1, 9:].tolist() else None
    a = ours.generate(ids, max_new_tokens=12, eos_token_id=eos)
    b = _hf_generate(hf, ids, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    assert torch.equal(a, b)
    assert torch.equal(a[0, : 9 + 4], free[0, : 9 + 4]) and bool((a[0, 9 + 4:] == eos).all())
    if row1_first is None:  # row 1 never emits eos: it runs the whole length
        assert torch.equal(a[1], free[1])
    # every row finished: the loop ends early
    both = ours.generate(ids, max_new_tokens=12, eos_token_id=[eos, int(free[1, 9])])
    assert both.shape[1] == 9 + 4


@pytest.mark.parametrize("settings", [
    dict(temperature=0.7, top_k=20, top_p=0.9),
    dict(temperature=1.3, top_k=0, top_p=1.0),
    dict(temperature=1.0, top_k=5, top_p=1.0),
])
def test_seeded_sampling_matches_transformers(models, settings):
    ours, hf = models["mixed"]
    ids = _prompt(3, 11, seed=5)
    a = ours.generate(ids, max_new_tokens=16, do_sample=True, seed=1234, **settings)
    torch.manual_seed(1234)
    b = _hf_generate(hf, ids, max_new_tokens=16, do_sample=True, eos_token_id=None, pad_token_id=0, **settings)
    assert torch.equal(a, b)
    assert torch.equal(a, ours.generate(ids, max_new_tokens=16, do_sample=True, seed=1234, **settings))
    assert not torch.equal(a, ours.generate(ids, max_new_tokens=16, do_sample=True, seed=99, **settings))


def test_filter_logits_matches_transformers_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    for temp, k, p in [(0.5, 10, 0.8), (1.0, 0, 0.3), (2.0, 3, 1.0), (1.0, 100, 0.99)]:
        ref = TemperatureLogitsWarper(temp)(None, logits.clone())
        if k:
            ref = TopKLogitsWarper(k)(None, ref)
        if p < 1.0:
            ref = TopPLogitsWarper(p)(None, ref)
        assert torch.equal(filter_logits(logits, temp, k, p), ref)


def test_lora_applied_and_merged(models):
    from hybridtrain.peft import apply_lora, merge_lora

    base, _ = models["mixed"]
    model = perturbed_model(base.config, seed=1)
    apply_lora(model, dim=4, alpha=8, target_modules=["*.in_proj", "*.out_proj", "*.q_proj", "*.v_proj",
                                                       "*.up_proj", "*.experts.*.up_proj"])
    torch.manual_seed(6)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.1)
    ids = _prompt(2, 13, seed=6)
    adapted = model.generate(ids, max_new_tokens=12)
    with torch.no_grad():
        full = model(adapted)
    logits, cache = prefill(model, ids, max_length=adapted.shape[1])
    worst = (logits - full[:, 12]).abs().max().item()
    for t in range(13, adapted.shape[1] - 1):
        worst = max(worst, (decode_step(model, cache, adapted[:, t]) - full[:, t]).abs().max().item())
    assert worst <= 1e-4
    assert not torch.equal(adapted, base.generate(ids, max_new_tokens=12))  # the adapters change the output
    merged = merge_lora(model)
    assert torch.equal(merged.generate(ids, max_new_tokens=12), adapted)


def test_bf16_generation_follows_the_bf16_forward(models):
    base, _ = models["mixed"]
    model = perturbed_model(base.config, seed=1).to(torch.bfloat16)
    ids = _prompt(2, 13, seed=7)
    out = model.generate(ids, max_new_tokens=8)
    assert out.shape == (2, 21)
    with torch.no_grad():
        full = model(out)
    logits, cache = prefill(model, ids, max_length=out.shape[1])
    worst = (logits - full[:, 12]).abs().max().item()
    for t in range(13, out.shape[1] - 1):
        worst = max(worst, (decode_step(model, cache, out[:, t]) - full[:, t]).abs().max().item())
    print(f"\n[generate] bf16 mixed: max|cached - full logits| = {worst:.2e}")
    assert worst <= 0.05
    assert cache.layers["0"].ssm.dtype == torch.float32


def test_mamba_state_memory_is_flat(models):
    ours, _ = models["mixed"]
    sizes = []
    for n in (4, 40):
        _, cache = prefill(ours, _prompt(1, n), max_length=n)
        sizes.append(sum(s.conv.numel() + s.ssm.numel() for s in cache.layers.values() if hasattr(s, "ssm")))
    assert sizes[0] == sizes[1]


def test_bad_arguments(models):
    ours, _ = models["dense"]
    ids = _prompt(2, 5)
    right_padded = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match="left"):
        ours.generate(ids, attention_mask=right_padded)
    with pytest.raises(ValueError, match="top_p"):
        ours.generate(ids, do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="temperature"):
        ours.generate(ids, do_sample=True, temperature=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        ours.generate(ids, max_new_tokens=-1)
    assert torch.equal(ours.generate(ids, max_new_tokens=0), ids)


def test_prefill_from_inputs_embeds(models):
    ours, _ = models["mixed"]
    ids = _prompt(2, 10, seed=8)
    a, _ = prefill(ours, ids)
    with torch.no_grad():
        b, _ = prefill(ours, None, inputs_embeds=ours.backbone.embeddings(ids))
    assert torch.equal(a, b)
