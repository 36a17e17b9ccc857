"""Context parallelism against one process.

Layers (fp64): a Mamba2 mixer (conv halo + state passing) and an attention layer (gathered K/V)
on 2 and 4 ranks give the outputs and the gradients (input and parameters, summed over the cp
ranks) of the whole sequence in one process, for unpacked rows and packed rows whose documents
cross rank boundaries, start exactly on one, or span a whole rank. The bytes a Mamba layer sends
do not grow with the sequence. The trainer (fp32, 3 AdamW steps, ``tests.helpers.parity``):
CP=2, CP=4, CP=2 x FSDP=2, CP=2 x PP=2 and CP=2 with activation checkpointing match the single-process per-step losses, gradient
norms, final weights and validation loss within 1e-5, packed and unpacked. (The CLI with
``--distributed.cp=2``: tests/distributed/test_launch.py.) One spawned group per world size
runs the layer cases and the trainer layouts.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tests.helpers import parity as pu
from tests.helpers.distributed import run_distributed

# one spawned group of 4 ranks runs every 4-rank case: above the suite's 300 s on a loaded box
pytestmark = pytest.mark.timeout(900)

# documents per row (lengths), for a sequence of 24 tokens
DOCS = [[5, 14, 5], [24], [12, 12], [2, 15, 7]]
SHORT = [[3, 5], [8], [1, 6, 1]]


def _seq_idx(rows):
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(r)]) for r in rows])


def _layer_case(kind: str, packed: bool, cp, docs=DOCS, seed: int = 0):
    """(single-process output, its grads, this rank's output, its grads) of one layer."""
    from hybridtrain.models.nemotron_h import tiny_config
    from hybridtrain.models.nemotron_h.attention import Attention
    from hybridtrain.models.nemotron_h.context_parallel import CPSlice
    from hybridtrain.models.nemotron_h.mamba2 import Mamba2Mixer

    torch.manual_seed(seed)
    cfg = tiny_config("mixed")
    layer = (Mamba2Mixer(cfg, 0) if kind == "mamba" else Attention(cfg, 1)).double()
    layer.reset_parameters()
    with torch.no_grad():  # a random (not the initial) state: D, dt, A all matter
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    B, L = len(docs), sum(docs[0])
    x = torch.randn(B, L, cfg.hidden_size, dtype=torch.float64)
    w = torch.randn(B, L, cfg.hidden_size, dtype=torch.float64)
    seq_idx = _seq_idx(docs) if packed else None

    def grads(inp, out, weight):
        layer.zero_grad()
        (out * weight).sum().backward()
        return [inp.grad] + [p.grad.clone() for p in layer.parameters()]

    xr = x.clone().requires_grad_()
    ref = layer(xr, seq_idx=seq_idx)
    ref_grads = grads(xr, ref, w)
    n = L // cp.size
    sl = slice(cp.rank * n, (cp.rank + 1) * n)
    xl = x[:, sl].clone().requires_grad_()
    part = CPSlice(cp, cp.rank * n, seq_idx)
    out = layer(xl, seq_idx=part.local_seq_idx(n), cp=part)
    got = grads(xl, out, w[:, sl])
    for g in got[1:]:
        dist.all_reduce(g, group=cp.group)
    return ref[:, sl].detach(), [ref_grads[0][:, sl]] + ref_grads[1:], out.detach(), got


def _named(kind):
    from hybridtrain.models.nemotron_h import tiny_config
    from hybridtrain.models.nemotron_h.attention import Attention
    from hybridtrain.models.nemotron_h.mamba2 import Mamba2Mixer

    cfg = tiny_config("mixed")
    return (Mamba2Mixer(cfg, 0) if kind == "mamba" else Attention(cfg, 1)).named_parameters()


def _layers(rank, world):
    from hybridtrain.distributed.context_parallel import ContextParallel

    cp = ContextParallel(dist.new_group(list(range(world))))
    errs = {}
    cases = [(kind, packed, DOCS) for kind in ("mamba", "attention") for packed in (False, True)]
    # rows of 8 tokens: on 4 ranks a slice (2 tokens) is shorter than the conv halo (3)
    cases += [("mamba_short", packed, SHORT) for packed in (False, True)]
    for kind, packed, docs in cases:
        layer = kind.split("_")[0]
        ref, ref_g, out, got = _layer_case(layer, packed, cp, docs)
        e_out = float((out - ref).abs().max() / ref.abs().max())
        rel = [float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
               for a, b in zip(got, ref_g)]
        names = ["input"] + [n for n, _ in _named(layer)]
        # A = -exp(A_log.float()): the model keeps A in fp32, so its gradient is fp32-exact
        e_a = max([r for n, r in zip(names, rel) if n == "A_log"], default=0.0)
        e_g = max(r for n, r in zip(names, rel) if n != "A_log")
        errs[(kind, packed)] = (e_out, e_g, e_a)
    # bytes one Mamba layer sends per forward+backward: independent of the sequence length
    sent = {}
    for L in (16, 64):
        cp.bytes_sent.clear()
        _mamba_bytes(cp, L)
        sent[L] = dict(cp.bytes_sent)
    return errs, sent


def _mamba_bytes(cp, L):
    from hybridtrain.models.nemotron_h import tiny_config
    from hybridtrain.models.nemotron_h.context_parallel import CPSlice
    from hybridtrain.models.nemotron_h.mamba2 import Mamba2Mixer

    cfg = tiny_config("mixed")
    layer = Mamba2Mixer(cfg, 0)
    layer.reset_parameters()
    x = torch.randn(2, L // cp.size, cfg.hidden_size, requires_grad=True)
    layer(x, cp=CPSlice(cp, cp.rank * (L // cp.size), None)).sum().backward()


# -- the trainer ------------------------------------------------------------------------------
# name: (layout, world size, activation checkpointing)
LAYOUTS = {"cp2": ({"cp": 2}, 2, False), "cp4": ({"cp": 4}, 4, False),
           "cp2_fsdp2": ({"cp": 2, "dp_shard": 2}, 4, False), "cp2_pp2": ({"cp": 2, "pp": 2}, 4, False),
           "cp2_ac": ({"cp": 2}, 2, True)}  # recomputed forwards exchange again, in order


def _group(rank, world):
    """The layers' errors and bytes, then every trainer layout of this world size, packed and
    unpacked: one spawned group per world size."""
    out = {"layers": _layers(rank, world)}
    for name, (layout, w, ac) in LAYOUTS.items():
        if w == world:
            out[name] = {packed: pu.run_layout(layout, world, packed, ac=ac) for packed in (False, True)}
    return out


@pytest.fixture(scope="module")
def groups():
    """{world size: per-rank results of :func:`_group`}, each group spawned on first use."""
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = run_distributed(_group, world)
        return cache[world]
    return get


def _by_world(names_and_worlds):
    """pytest params: the 4-rank group's on a worker of its own under xdist (tests/conftest.py)."""
    return [name if world == 2 else pytest.param(name, marks=pytest.mark.xdist_group(
        "context_parallel_4_ranks")) for name, world in names_and_worlds]


@pytest.mark.distributed
@pytest.mark.parametrize("world", _by_world([(2, 2), (4, 4)]))
def test_layers_match_one_process(groups, world):
    results = [r["layers"] for r in groups(world)]
    for rank, (errs, sent) in enumerate(results):
        for (kind, packed), (e_out, e_g, e_a) in errs.items():
            assert e_out < 1e-12 and e_g < 1e-12 and e_a < 1e-6, (rank, kind, packed, e_out, e_g, e_a)
        assert sent[16] == sent[64], sent
        if rank < world - 1:
            assert sent[16]["state"] > 0 and sent[16]["halo"] > 0
    # the last rank sends only gradients back: one state and one halo
    assert set(results[-1][1][16]) == {"halo_grad", "state_grad"}


@pytest.fixture(scope="module")
def ref():
    return {packed: pu.reference(packed) for packed in (False, True)}


@pytest.mark.distributed
@pytest.mark.parametrize("name", _by_world((name, w) for name, (_, w, _) in LAYOUTS.items()))
def test_trainer_matches_one_process(groups, ref, name):
    res = groups(LAYOUTS[name][1])[0][name]
    for packed, (losses, w, val, norms) in res.items():
        ref_losses, ref_w, ref_val, ref_norms = ref[packed]
        w = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in w.items()}
        assert all(math.isfinite(x) for x in losses)
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        rel_n = max(abs(a - b) / abs(b) for a, b in zip(norms, ref_norms))
        dw = max(float((w[k] - ref_w[k]).abs().max()) for k in ref_w)
        print(f"{name:10s} {'packed' if packed else 'unpacked':9s} loss rel {rel:.2e} "
              f"grad-norm rel {rel_n:.2e} weights abs {dw:.2e} "
              f"val rel {abs(val - ref_val) / ref_val:.2e}")
        assert rel <= 1e-5, (name, packed, losses, ref_losses)
        assert rel_n <= 1e-5, (name, packed, norms, ref_norms)
        assert set(w) == set(ref_w) and dw <= 1e-5
        assert abs(val - ref_val) <= 1e-5 * ref_val, (name, packed, val, ref_val)
