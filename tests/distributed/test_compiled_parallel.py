"""Compiled blocks under model parallelism (2 gloo ranks, ``aot_eager``): the graphs a compiled
block breaks into, and its outputs and gradients against eager (fp32, 1e-5).

Expert parallelism: the all-to-all exchange (host split sizes) is the one deliberate boundary,
two breaks per MoE block (dispatch, combine); everything else compiles without a break. Tensor
parallelism (DTensor weights) and context parallelism (K/V all-gather, the Mamba conv halo and
state passing as functional collectives when compiled): every block one graph, no break, on
packed rows."""

import importlib.util
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
    moe.token_dispatcher = apply_expert_parallel(moe.experts, dims.mesh("ep"))
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


def _all_workers(rank, world):
    """ep2, tp2 and cp2 in one set of processes (one launch for the file)."""
    return {"ep2": _ep_worker(rank, world), "tp2": _tp_worker(rank, world),
            "cp2": _cp_worker(rank, world)}


@pytest.fixture(scope="module")
def runs():
    """Per layout, each rank's result."""
    res = run_distributed(_all_workers, 2)
    return {name: [r[name] for r in res] for name in res[0]}


@pytest.mark.distributed
def test_ep2_compiled_moe_breaks_only_at_the_exchange_and_matches_eager(runs):
    for rank, (eager, compiled, graphs, reasons, seconds) in enumerate(runs["ep2"]):
        print(f"\n[compile] ep=2 moe rank {rank}: {graphs} graphs, breaks {reasons}, "
              f"first compiled step {seconds:.1f} s")
        assert reasons == ["ep_dispatch", "ep_combine"] and graphs == 3, reasons
        torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(compiled[1], eager[1], rtol=1e-5, atol=1e-5)
        for n, g in eager[2].items():
            torch.testing.assert_close(compiled[2][n], g, rtol=1e-5, atol=1e-5, msg=n)


def _fullgraph_against_eager(block, x, w, info):
    """(None, max |compiled - eager| over the output and all gradients, seconds of the first
    compiled step) of ``block`` compiled with ``fullgraph=True`` (one graph, or the compiler
    raises), or (the compiler's error, None, None) where it broke the graph."""
    fwd = lambda fn: (lambda h: fn(h, info))  # noqa: E731
    eager = _forward_backward(fwd(block), block, x, w)
    torch._dynamo.reset()
    t0 = time.perf_counter()
    try:
        compiled_block = torch.compile(block, backend="aot_eager", dynamic=False, fullgraph=True)
        compiled = _forward_backward(fwd(compiled_block), block, x, w)
    except Exception as e:  # a graph break under fullgraph: its reason goes back to the test
        torch._dynamo.reset()
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", None, None
    seconds = time.perf_counter() - t0
    pairs = [(compiled[0], eager[0]), (compiled[1], eager[1])] + [(compiled[2][n], g) for n, g in eager[2].items()]
    torch._dynamo.reset()
    return None, max(float((a - b).abs().max()) for a, b in pairs), seconds


def _compare_blocks(model, x, w, info, types):
    """{block type: (graph break, max |compiled - eager|, seconds)} of one block of each type
    (see :func:`_fullgraph_against_eager`)."""
    return {t: _fullgraph_against_eager(next(b for b in model.backbone.layers.values() if b.block_type == t), x, w, info)
            for t in types}


def _tp_setup(rank, world):
    """The tiny model with tensor-parallel weights over ``world`` ranks, packed inputs."""
    from torch.distributed.device_mesh import init_device_mesh

    from hybridtrain.models.nemotron_h import tiny_config
    from hybridtrain.models.nemotron_h.model import SequenceInfo
    from hybridtrain.models.nemotron_h.parallelize import apply_tp
    from tests.helpers.models import perturbed_model

    model = perturbed_model(tiny_config("mixed"), seed=1)
    apply_tp(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    g = torch.Generator().manual_seed(2)
    x, w = (torch.randn(2, 24, model.config.hidden_size, generator=g) for _ in range(2))
    info = SequenceInfo(seq_idx=torch.tensor([[0] * 10 + [1] * 14, [2] * 24], dtype=torch.int32))
    return model, x, w, info


def _tp_worker(rank, world):
    return _compare_blocks(*_tp_setup(rank, world), ("linear_attention", "full_attention", "mlp", "moe"))


def _cp_setup(rank, world):
    """The tiny model under context parallelism: this rank's contiguous slice of packed rows."""
    import torch.distributed as dist

    from hybridtrain.distributed.context_parallel import ContextParallel
    from hybridtrain.models.nemotron_h import tiny_config
    from tests.helpers.models import perturbed_model

    model = perturbed_model(tiny_config("mixed"), seed=1)
    model.context_parallel = ContextParallel(dist.new_group(list(range(world))))
    g = torch.Generator().manual_seed(2)
    x, w = (torch.randn(2, 24, model.config.hidden_size, generator=g)[:, rank * 12:(rank + 1) * 12] for _ in range(2))
    # packed rows: documents of 10 and 14 tokens (the second crosses the ranks), and one of 24
    pos = torch.stack([torch.cat([torch.arange(10), torch.arange(14)]), torch.arange(24)])[:, rank * 12:(rank + 1) * 12]
    info = model.sequence_info(2, 12, x.device, position_ids=pos)
    return model, x, w, info


def _cp_worker(rank, world):
    return _compare_blocks(*_cp_setup(rank, world), ("linear_attention", "full_attention"))


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["tp2", "cp2"])
def test_blocks_compile_under_model_parallelism(runs, layout):
    for rank, res in enumerate(runs[layout]):
        for block_type, (broke, err, seconds) in res.items():
            assert broke is None, (layout, block_type, broke)
            print(f"\n[compile] {layout} rank {rank} {block_type}: one graph (fullgraph), "
                  f"max |compiled - eager| {err:.1e}, first compiled step {seconds:.1f} s")
            assert err <= 1e-5, (layout, block_type, err)


# -- the real kernels (mamba_ssm's Triton SSD under the interpreter) ---------------------------------
def _kernel_worker(rank, world):
    """The compiled Mamba block (``fullgraph=True``) with the real kernels under tp2 and cp2
    against the eager PyTorch path: {layout: (graph break or None, max |compiled - eager|,
    whether the kernel op ran)}."""
    from hybridtrain.ops import backend, triton_interpret

    assert triton_interpret.activate(), "the ranks need TRITON_INTERPRET=1"
    out = {}
    for layout, setup in (("tp2", _tp_setup), ("cp2", _cp_setup)):
        model, x, w, info = setup(rank, world)
        with backend.using(backend.BackendSettings(mamba_kernels=True)):
            # the kernels looked up before compiling, as configure_backend does once a run's model
            # is built (the family's kernel dispatch registers itself when its package loads)
            backend.kernel_paths("cpu")
        block = next(b for b in model.backbone.layers.values() if b.block_type == "linear_attention")
        fwd = lambda fn: (lambda h: fn(h, info))  # noqa: E731
        with backend.using(backend.BackendSettings(mamba_kernels=False)):
            eager = _forward_backward(fwd(block), block, x, w)
        broke, err, ran = None, None, False
        with backend.using(backend.BackendSettings(mamba_kernels=True)):
            torch._dynamo.reset()
            compiled_block = torch.compile(block, backend="aot_eager", dynamic=False, fullgraph=True)
            try:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    compiled = _forward_backward(fwd(compiled_block), block, x, w)
            except Exception as e:  # a graph break under fullgraph: its reason goes back to the test
                broke = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if broke is None:
            ran = any(e.key == "hybridtrain::ssd_scan" for e in prof.key_averages())
            pairs = [(compiled[0], eager[0]), (compiled[1], eager[1])] + [(compiled[2][n], g) for n, g in eager[2].items()]
            err = max(float((a - b).abs().max()) for a, b in pairs)
        out[layout] = (broke, err, ran)
        torch._dynamo.reset()
    return out


@pytest.mark.distributed
def test_mamba_block_compiles_with_the_real_kernels_under_tp_and_cp(monkeypatch):
    """fullgraph with mamba_ssm's SSD kernel (a torch custom op) under tensor parallelism (a
    rank's heads) and context parallelism (the state handed from slice to slice): one graph, no
    break, equal to the eager PyTorch path (fp32, 1e-5)."""
    for mod in ("triton", "mamba_ssm"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed (make test installs it: see the Makefile's kernel packages)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when triton is imported: the ranks are spawned
    for rank, res in enumerate(run_distributed(_kernel_worker, 2)):
        for layout, (broke, err, ran) in res.items():
            assert broke is None, (layout, rank, broke)
            print(f"\n[compile, kernels] {layout} rank {rank}: one graph (fullgraph), max |compiled - eager| {err:.1e}")
            assert ran, (layout, rank, "the kernel op did not run")
            assert err <= 1e-5, (layout, rank, err)
