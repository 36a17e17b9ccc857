"""Compiled blocks under model parallelism (2 gloo ranks, ``aot_eager``): the graphs a compiled
block breaks into, and its outputs and gradients against eager (fp32, 1e-5).

Expert parallelism: the all-to-all exchange (host split sizes) is the one deliberate boundary,
two breaks per MoE block (dispatch, combine); everything else compiles without a break."""

import time

import pytest
import torch

from tests.helpers.distributed import run_distributed


def _forward_backward(fn, module, x, w):
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = fn(x)
    (y * w).sum().backward()
    grads = {n: p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for n, p in module.named_parameters()}
    return y.detach(), x.grad, grads


def _ep_worker(rank, world):
    from hybridtrain.distributed.expert_parallel import apply_expert_parallel
    from hybridtrain.distributed.parallel_dims import ParallelDims
    from hybridtrain.models.nemotron_h import tiny_config
    from hybridtrain.models.nemotron_h.moe import MoE

    dims = ParallelDims(world_size=world, ep=2).build_mesh("cpu")
    torch.manual_seed(0)
    moe = MoE(tiny_config("mixed"), layer_idx=3)
    moe.reset_parameters()
    apply_expert_parallel(moe, dims.mesh("ep"))
    g = torch.Generator().manual_seed(rank)
    x, w = torch.randn(2, 5, 64, generator=g), torch.randn(2, 5, 64, generator=g)
    eager = _forward_backward(moe, moe, x, w)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(moe)(x)
    # a break at a disabled exchange function -> its name; any other break -> its whole reason
    reasons = [next((fn for fn in ("ep_dispatch", "ep_combine") if fn in str(r.reason) and "disable" in str(r.reason)),
                    str(r.reason)) for r in explained.break_reasons]
    torch._dynamo.reset()
    t0 = time.perf_counter()
    compiled = _forward_backward(torch.compile(moe, backend="aot_eager", dynamic=False), moe, x, w)
    seconds = time.perf_counter() - t0
    return eager, compiled, explained.graph_count, reasons, seconds


@pytest.mark.distributed
def test_ep2_compiled_moe_breaks_only_at_the_exchange_and_matches_eager():
    for rank, (eager, compiled, graphs, reasons, seconds) in enumerate(run_distributed(_ep_worker, 2)):
        print(f"\n[compile] ep=2 moe rank {rank}: {graphs} graphs, breaks {reasons}, first compiled step {seconds:.1f} s")
        assert reasons == ["ep_dispatch", "ep_combine"] and graphs == 3, reasons
        torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(compiled[1], eager[1], rtol=1e-5, atol=1e-5)
        for n, g in eager[2].items():
            torch.testing.assert_close(compiled[2][n], g, rtol=1e-5, atol=1e-5, msg=n)
