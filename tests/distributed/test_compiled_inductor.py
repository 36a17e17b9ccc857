"""Inductor with the real kernels under model parallelism (2 gloo ranks, one launch): each block
type compiled by ``torch.compile(backend="inductor", fullgraph=True)`` with mamba_ssm's Triton
SSD as a torch custom op (under Triton's interpreter), plain and under activation checkpointing
(the trainer's wrapper), under tensor parallelism (DTensor weights, a kv head shared by the
ranks) and context parallelism (K/V gathered, the conv halo and the state passed between the
slices): one graph per block, output and gradients equal to the eager PyTorch path (fp32, 1e-5).

Inductor's C++ compiles cost minutes on a 2-core machine (all 16 cases: 341 CPU-s, 14 min on a
loaded machine, 2026-12-06): the suite runs :data:`DEFAULT_CASES`, the attention block
checkpointed under TP (it once failed: a ``DeviceMesh`` saved for backward beside an RNG state;
34 CPU-s); ``make test-compile`` runs every case (``HYBRIDTRAIN_COMPILE_MATRIX=all``), among them
the Mamba block checkpointed under CP (once a Python side effect inside the checkpoint, then the
ranks hanging on a reduce-scatter one rank ran in forward and the other in backward; 83 CPU-s).
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("compiled_inductor")]

BLOCK_TYPES = ("linear_attention", "full_attention", "mlp", "moe")
ALL_CASES = tuple((layout, block_type, checkpointed) for layout in ("tp2", "cp2") for block_type in BLOCK_TYPES
                  for checkpointed in (False, True))
DEFAULT_CASES = (("tp2", "full_attention", True),)
L = 16  # tokens per row: two documents in the first row, one in the second; 8 per cp rank


def _cases() -> tuple:
    return ALL_CASES if os.environ.get("HYBRIDTRAIN_COMPILE_MATRIX") == "all" else DEFAULT_CASES


def _model():
    """The smallest model with every block type that splits over 2 tp ranks (one kv head: the
    ranks share it) and runs the SSD kernel in two chunks per cp slice."""
    from hybridtrain.models.nemotron_h import tiny_config
    from tests.helpers.models import perturbed_model

    cfg = tiny_config("mixed", hidden_size=16, mamba_num_heads=4, mamba_head_dim=4, ssm_state_size=8, n_groups=2,
                      chunk_size=4, num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=32,
                      n_routed_experts=4, moe_intermediate_size=8, moe_shared_expert_intermediate_size=8,
                      vocab_size=64)
    return perturbed_model(cfg, seed=1)


def _inputs(rank: int, hidden: int, cp: bool):
    """(x, w, position ids): packed rows; under cp this rank's half of each."""
    g = torch.Generator().manual_seed(2)
    x, w = (torch.randn(2, L, hidden, generator=g) for _ in range(2))
    pos = torch.stack([torch.cat([torch.arange(6), torch.arange(L - 6)]), torch.arange(L)])
    if cp:
        part = slice(rank * L // 2, (rank + 1) * L // 2)
        x, w, pos = x[:, part], w[:, part], pos[:, part]
    return x, w, pos


def _tp_setup(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from hybridtrain.models.nemotron_h.parallelize import apply_tp

    model = _model()
    apply_tp(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    x, w, pos = _inputs(rank, model.config.hidden_size, cp=False)
    return model, x, w, model.sequence_info(2, L, x.device, position_ids=pos)


def _cp_setup(rank, world):
    import torch.distributed as dist

    from hybridtrain.distributed.context_parallel import ContextParallel

    model = _model()
    model.context_parallel = ContextParallel(dist.new_group(list(range(world))))
    x, w, pos = _inputs(rank, model.config.hidden_size, cp=True)
    return model, x, w, model.sequence_info(2, L // world, x.device, position_ids=pos)


def _forward_backward(fn, module, x, w, info):
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = fn(x, info)
    (y * w).sum().backward()
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in module.parameters()]
    return [y.detach(), x.grad, *grads]


def _against_eager(block, x, w, info, checkpointed: bool):
    """(max |compiled - eager| / (1e-5 + 1e-5 |eager|) over the output and all gradients (<= 1:
    within fp32's 1e-5), dynamo's graph count, whether the SSD op ran, compile-and-run seconds)
    of ``block`` compiled by inductor with the kernels (checkpointed as the trainer does), against
    the eager PyTorch path."""
    from torch import nn
    from torch._dynamo.utils import counters

    from hybridtrain.distributed.activation_checkpoint import apply_activation_checkpointing
    from hybridtrain.ops import backend

    with backend.using(backend.BackendSettings(mamba_kernels=False)):
        eager = _forward_backward(block, block, x, w, info)
    wrapped = nn.ModuleDict({"0": block})
    if checkpointed:
        apply_activation_checkpointing(wrapped, True, compiled=True)
    torch._dynamo.reset()
    counters.clear()
    t0 = time.perf_counter()
    with backend.using(backend.BackendSettings(mamba_kernels=True)):
        compiled = torch.compile(wrapped["0"], backend="inductor", dynamic=False, fullgraph=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            got = _forward_backward(compiled, block, x, w, info)
    seconds = time.perf_counter() - t0
    ran = any(e.key == "hybridtrain::ssd_scan" for e in prof.key_averages())
    err = max(float(((a - b).abs() / (1e-5 + 1e-5 * b.abs())).max()) for a, b in zip(got, eager))
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return err, graphs, ran, seconds


def _worker(rank, world, cases):
    """{case: see :func:`_against_eager`} for ``cases`` ((layout, block type, checkpointed))."""
    from hybridtrain.ops import backend, triton_interpret

    assert triton_interpret.activate(), "the ranks need TRITON_INTERPRET=1"
    out = {}
    for layout, setup in (("tp2", _tp_setup), ("cp2", _cp_setup)):
        mine = [c for c in cases if c[0] == layout]
        if not mine:
            continue
        model, x, w, info = setup(rank, world)
        with backend.using(backend.BackendSettings(mamba_kernels=True)):
            backend.kernel_paths("cpu")  # the kernels looked up before compiling, as a run does
        for case in mine:
            block = next(b for b in model.backbone.layers.values() if b.block_type == case[1])
            out[case] = _against_eager(block, x, w, info, case[2])
    return out


@pytest.mark.timeout(1500)  # inductor's C++ compiles and the interpreter on a loaded 2-core machine
def test_blocks_compile_by_inductor_with_the_real_kernels_under_tp_and_cp(monkeypatch):
    for mod in ("triton", "mamba_ssm"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed (make test installs it: see the Makefile's kernel packages)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when triton is imported: the ranks are spawned
    cases = _cases()
    for rank, res in enumerate(run_distributed(_worker, 2, cases, timeout=1400)):
        assert sorted(res) == sorted(cases)
        for (layout, block_type, checkpointed), (err, graphs, ran, seconds) in res.items():
            what = (layout, block_type, "checkpointed" if checkpointed else "plain", f"rank {rank}")
            print(f"\n[inductor, kernels] {' '.join(what)}: {graphs} graph, |compiled - eager| at most "
                  f"{err:.2f} of the 1e-5 tolerance, {seconds:.1f} s")
            assert graphs == 1, (*what, graphs)
            assert ran or block_type != "linear_attention", (*what, "the kernel op did not run")
            assert err <= 1, (*what, err)
