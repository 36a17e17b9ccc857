"""Tensor parallelism: the vocab-parallel linear cross-entropy and log-probs (gradcheck, equality
with the full head), and the Nemotron-H modules sharded by heads and groups."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers.distributed import run_distributed


def _head_inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    n, h, v = 11, 6, 10  # an odd vocabulary: shards of 5 and 5 over 2 ranks... and 4/3/3 over 3
    hidden = torch.randn(n, h, generator=g, dtype=dtype)
    weight = torch.randn(v, h, generator=g, dtype=dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[[1, 4, 5]] = -100
    return hidden, weight, labels


def _vocab_parallel_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from hybridtrain.ops.loss import cross_entropy_sum, token_logprobs

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    hidden, weight, labels = _head_inputs()

    def sharded(w):  # full on every rank -> this rank's vocabulary rows; backward all-gathers
        return DTensor.from_local(w, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(0)])

    out = {}
    for name, fn in {
        "ce": lambda h, w: cross_entropy_sum(h, sharded(w), labels, chunk_size=4),
        "ce_recompute": lambda h, w: cross_entropy_sum(h, sharded(w), labels, chunk_size=4, recompute=True),
        "ce_one_chunk": lambda h, w: cross_entropy_sum(h, sharded(w), labels, chunk_size=None),
        "logprobs": lambda h, w: token_logprobs(h, sharded(w), labels, chunk_size=3),
    }.items():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        y = fn(h, w)
        gy = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view(y.shape) if y.dim() else torch.ones(())
        gh, gw = torch.autograd.grad(y, (h, w), gy)
        out[name] = (y.detach(), gh, gw)
        if name in ("ce_recompute", "logprobs"):  # (recompute=False: one backward only)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out[name + "_gradcheck"] = torch.autograd.gradcheck(
                    fn, (hidden.clone().requires_grad_(), weight.clone().requires_grad_()),
                    eps=1e-6, atol=1e-7, rtol=1e-5)
    with torch.no_grad():
        out["ce_no_grad"] = cross_entropy_sum(hidden, sharded(weight), labels, chunk_size=4)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_cross_entropy_and_logprobs(world):
    from hybridtrain.ops.loss import cross_entropy_sum, token_logprobs

    results = run_distributed(_vocab_parallel_worker, world)
    hidden, weight, labels = _head_inputs()
    for name, ref_fn in {
        "ce": lambda h, w: cross_entropy_sum(h, w, labels, chunk_size=None),
        "ce_recompute": lambda h, w: cross_entropy_sum(h, w, labels, chunk_size=None),
        "ce_one_chunk": lambda h, w: cross_entropy_sum(h, w, labels, chunk_size=None),
        "logprobs": lambda h, w: token_logprobs(h, w, labels, chunk_size=None),
    }.items():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        y = ref_fn(h, w)
        gy = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view(y.shape) if y.dim() else torch.ones(())
        gh, gw = torch.autograd.grad(y, (h, w), gy)
        for r, res in enumerate(results):
            got = res[name]
            torch.testing.assert_close(got[0], y.detach(), rtol=1e-12, atol=1e-12, msg=f"{name} rank {r}")
            torch.testing.assert_close(got[1], gh, rtol=1e-12, atol=1e-12, msg=f"{name} rank {r} d hidden")
            torch.testing.assert_close(got[2], gw, rtol=1e-12, atol=1e-12, msg=f"{name} rank {r} d weight")
            assert res.get(name + "_gradcheck", True) is True
        if name == "ce":
            for res in results:
                torch.testing.assert_close(res["ce_no_grad"], y.detach(), rtol=1e-12, atol=1e-12)
