"""The kernels GPU users run, run here: mamba_ssm's Triton SSD and state update under Triton's
interpreter on CPU tensors (``TRITON_INTERPRET=1``, set before triton is imported: each check
all checks run in one such process, :func:`run_checks`), against the PyTorch path, and compiled.

* the Mamba2 mixer forward and backward, one document and packed (``seq_idx``) in fp32, packed
  in bf16 (autocast, as ``training.dtype: bfloat16`` runs it: bf16 x, B, C and dt);
* the scan with an initial state and the final state (what context parallelism passes), dt_bias,
  softplus and a ``dt_limit`` that clamps;
* the decoding step through ``selective_state_update``, fp32 and bf16;
* ``tl.dot`` of bf16 operands (the interpreter's, corrected by :mod:`hybridtrain.ops.triton_interpret`);
* ``torch.compile(fullgraph=True)`` of a Mamba block (plain, packed, under activation
  checkpointing), of the scan with states at a tensor-parallel head count, and of the tiny
  model's train step: one graph per block (``torch._dynamo`` counters), loss and gradients
  equal to eager.

Skipped where triton or mamba_ssm is not installed (``make test`` installs them; see the
Makefile). The interpreter is slow, its cost per program instance (batch x chunks x heads): the
shapes are tiny (two chunks of 4), and a compiled kernel path is compared with the eager
PyTorch path (the mixer check shows the eager kernel path equals it).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

FP32 = dict(rtol=1e-5, atol=1e-5)
BF16 = dict(rtol=2e-2, atol=2e-2)  # the suite's bf16 tolerance (test_mamba_kernel_contracts)


def _require_interpreter():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run in a process started with TRITON_INTERPRET=1"


def _settings(mode):
    from hybridtrain.ops import backend

    return backend.using(backend.BackendSettings(mamba_kernels=mode))


def _mixer(heads=4, groups=2, seed=0):
    from tests.helpers.models import tiny_mamba_mixer

    return tiny_mamba_mixer(heads, groups, seed)


def _ran(op: str, fn):
    """Runs ``fn``; asserts the custom op ``op`` ran in it (the kernel path, not a fallback)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    assert any(e.key == op for e in prof.key_averages()), f"{op} did not run"
    return out


def _mixer_run(m, x, seq_idx):
    m.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = m(x, seq_idx=seq_idx)
    (y.float().square() * torch.linspace(0.5, 1.5, y.numel()).view(y.shape)).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in m.parameters()]


def _assert_close_bf16(got, want, what):
    """Within the suite's bf16 tolerance, its atol taken relative to ``want``'s largest value (a
    gradient sums bf16 products over the tokens: its error grows with its size)."""
    torch.testing.assert_close(got, want, rtol=BF16["rtol"], atol=BF16["atol"] * want.abs().max().item(),
                               msg=lambda s: f"{what}: {s}")


def check_mixer_and_decode():
    """Mixer forward + backward (one document, packed; fp32, and packed in bf16), the scan with
    states, the decoding step (fp32 and bf16): the kernel path against the PyTorch path."""
    _require_interpreter()
    from hybridtrain.models.nemotron_h import kernels

    m = _mixer()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, 16, generator=g)
    packed = torch.tensor([[0] * 3 + [1] * 5, [3] * 8])
    for seq_idx in (None, packed):
        with _settings(True):
            got = _ran("hybridtrain::ssd_scan", lambda: _mixer_run(m, x, seq_idx))
        with _settings(False):
            want = _mixer_run(m, x, seq_idx)
        for i, (a, b) in enumerate(zip(got, want)):
            torch.testing.assert_close(a, b, **FP32, msg=lambda s: f"packed={seq_idx is not None} #{i}: {s}")
    # a packed row in bf16 as training.dtype bfloat16 runs it: under autocast in_proj and the
    # conv write bf16 x, B, C and dt, which reach mamba_ssm's SSD forward and backward as they are
    runs = []
    for mode in (True, False):
        with _settings(mode), torch.autocast("cpu", dtype=torch.bfloat16):
            run = lambda: _mixer_run(m, x[:1], packed[:1])  # noqa: E731
            runs.append(_ran("hybridtrain::ssd_scan", run) if mode else run())
    for i, (a, b) in enumerate(zip(*runs)):
        _assert_close_bf16(a, b, f"bf16 packed mixer #{i}")

    # the scan with an initial state and its final state (context parallelism), dt_limit clamping
    b, L, h, p, n, gr = 2, 8, 4, 4, 8, 2
    t = dict(x=torch.randn(b, L, h, p, generator=g), dt=torch.randn(b, L, h, generator=g) * 2,
             A=-torch.rand(h, generator=g) - 0.5, B=torch.randn(b, L, gr, n, generator=g),
             C=torch.randn(b, L, gr, n, generator=g), D=torch.randn(h, generator=g),
             dt_bias=torch.randn(h, generator=g), init=torch.randn(b, h, p, n, generator=g))
    seq_idx = torch.tensor([[0] * 3 + [1] * 5, [0] * 8])
    results = []
    for mode in (True, False):
        leaves = {k: v.clone().requires_grad_() for k, v in t.items()}
        with _settings(mode):
            y, final = kernels.ssd_scan(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk_size=4,
                                        D=leaves["D"], dt_bias=leaves["dt_bias"], dt_limit=(0.05, 1.5),
                                        seq_idx=seq_idx, initial_state=leaves["init"], return_final_state=True)
        (y.square().sum() + (final * final.detach().sign()).sum()).backward()
        results.append([y, final] + [leaves[k].grad for k in t])
    for i, (a, b_) in enumerate(zip(*results)):
        torch.testing.assert_close(a, b_, **FP32, msg=lambda s: f"scan with states #{i}: {s}")

    # the scan with every input but A in bf16 (parameters in bf16 too; y in x's dtype from the
    # kernel, fp32 from the PyTorch path)
    lowp = []
    for mode in (True, False):
        bf = {k: t[k].bfloat16() for k in ("x", "dt", "B", "C", "D", "dt_bias")}
        with _settings(mode):
            lowp.append(kernels.ssd_scan(bf["x"], bf["dt"], t["A"], bf["B"], bf["C"], chunk_size=4, D=bf["D"],
                                         dt_bias=bf["dt_bias"], dt_limit=(0.0, 8.0), seq_idx=seq_idx))
    _assert_close_bf16(lowp[0].float(), lowp[1], "bf16 scan")

    # one decoding token through selective_state_update: fp32, and bf16 x, dt, B, C (the fp32
    # state of decoding under autocast)
    state0, xs = torch.randn(b, h, p, n, generator=g), torch.randn(b, h, p, generator=g)
    dts, Bs, Cs = torch.randn(b, h, generator=g), torch.randn(b, gr, n, generator=g), torch.randn(b, gr, n, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        outs = []
        for mode in (True, False):
            state = state0.clone()
            step = lambda: kernels.ssd_step(state, xs.to(dtype), dts.to(dtype), t["A"], Bs.to(dtype),  # noqa: E731
                                            Cs.to(dtype), D=t["D"], dt_bias=t["dt_bias"], dt_limit=(0.0, 2.0))
            with _settings(mode):
                y = _ran("hybridtrain::ssd_state_update", step) if mode else step()
            outs.append((y, state))
        for what, a, b_ in zip(("y", "state"), *outs):
            if dtype == torch.float32:
                torch.testing.assert_close(a, b_, **FP32)
            else:
                _assert_close_bf16(a, b_, f"bf16 decoding step {what}")


def _one_graph(fn):
    """Runs ``fn`` (which compiles one thing and calls it) and returns its result; asserts dynamo
    made exactly one graph and broke none."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    out = fn()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    return out


def check_compiled():
    """fullgraph=True with the interpreted kernels: a Mamba block packed under activation
    checkpointing; the scan with states at half the heads (a tensor-parallel rank's);
    the tiny model's train step, one graph per block; all equal to the eager PyTorch path."""
    _require_interpreter()
    from torch.utils.checkpoint import checkpoint

    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, kernels, tiny_config
    from hybridtrain.models.nemotron_h.model import SequenceInfo

    cfg = tiny_config("mixed", hidden_size=16, mamba_num_heads=4, mamba_head_dim=4, ssm_state_size=8, n_groups=2,
                      chunk_size=4, num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=32,
                      n_routed_experts=4, moe_intermediate_size=8, moe_shared_expert_intermediate_size=8,
                      vocab_size=64)
    torch.manual_seed(0)
    model = NemotronHForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    block = next(b for b in model.backbone.layers.values() if b.block_type == "linear_attention")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 8, 16, generator=g)

    def run(fn, info):
        block.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y = fn(xi, info)
        y.square().mean().backward()
        return [y.detach(), xi.grad] + [p.grad for p in block.parameters()]

    # each compiled kernel path against the eager PyTorch path (eager kernels = PyTorch: above).
    # A Mamba block packed under activation checkpointing (without: in the train step below)
    ckpt = lambda xi, info: checkpoint(block, xi, info, use_reentrant=False)  # noqa: E731
    info = SequenceInfo(seq_idx=torch.tensor([[0] * 3 + [1] * 5, [2] * 8], dtype=torch.int32))
    with _settings(False):
        eager = run(ckpt, info)
    with _settings(True):
        compiled = torch.compile(ckpt, fullgraph=True, backend="aot_eager", dynamic=False)
        got = _one_graph(lambda: _ran("hybridtrain::ssd_scan", lambda: run(compiled, info)))
    for i, (a, b) in enumerate(zip(got, eager)):
        torch.testing.assert_close(a, b, **FP32, msg=lambda s: f"checkpointed packed block #{i}: {s}")

    # the scan as context parallelism calls it (initial and final state) at 2 of 4 heads
    b, L, h, p, n = 2, 8, 2, 4, 8
    t = [torch.randn(b, L, h, p, generator=g), torch.randn(b, L, h, generator=g), -torch.rand(h, generator=g),
         torch.randn(b, L, 1, n, generator=g), torch.randn(b, L, 1, n, generator=g), torch.randn(h, generator=g),
         torch.randn(h, generator=g), torch.randn(b, h, p, n, generator=g)]

    def scan(x_, dt, A, B, C, D, dt_bias, init):
        y, final = kernels.ssd_scan(x_, dt, A, B, C, chunk_size=4, D=D, dt_bias=dt_bias, dt_limit=(0.0, 4.0),
                                    seq_idx=None, initial_state=init, return_final_state=True)
        return y.square().sum() + final.sum()

    def grads(fn):
        leaves = [v.clone().requires_grad_() for v in t]
        loss = fn(*leaves)
        loss.backward()
        return [loss.detach()] + [v.grad for v in leaves]

    with _settings(False):
        eager = grads(scan)
    with _settings(True):
        got = _one_graph(lambda: _ran("hybridtrain::ssd_scan", lambda: grads(
            torch.compile(scan, fullgraph=True, backend="aot_eager", dynamic=False))))
    for a, b_ in zip(got, eager):
        torch.testing.assert_close(a, b_, **FP32)

    # the tiny model's train step, every block compiled as training.compile does (fullgraph):
    # each block type (the Mamba block without checkpointing) one graph
    ids = torch.randint(0, 64, (1, 8), generator=g)

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids)  # (the summed loss over label tokens)
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters()]

    with _settings(False):
        eager = step()
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    for blk in model.backbone.layers.values():
        blk.compile(fullgraph=True, backend="aot_eager", dynamic=False)
    with _settings(True):
        got = _ran("hybridtrain::ssd_scan", step)
    assert not counters["graph_break"], dict(counters["graph_break"])
    # one graph per block, shared by the blocks of a type (parameters are graph inputs)
    types = {blk.block_type for blk in model.backbone.layers.values()}
    assert counters["stats"]["unique_graphs"] == len(types) == 4, dict(counters["stats"])
    for i, (a, b_) in enumerate(zip(got, eager)):
        torch.testing.assert_close(a, b_, **FP32, msg=lambda s: f"train step #{i}: {s}")


def check_bf16_dot():
    """``tl.dot`` of bf16 operands under the interpreter is the product of their values (the
    interpreter alone multiplies the bit patterns: ops.triton_interpret's stand-in), as fp16's."""
    import triton
    import triton.language as tl

    from hybridtrain.ops import triton_interpret

    @triton.jit
    def dot(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        at = i[:, None] * N + i[None, :]
        tl.store(out_ptr + at, tl.dot(tl.load(a_ptr + at), tl.load(b_ptr + at)))

    assert triton_interpret.activate() or torch.cuda.is_available()
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)
    for dtype in (torch.bfloat16, torch.float16):
        out = torch.empty(16, 16)
        dot[(1,)](a.to(dtype), b.to(dtype), out, 16)
        torch.testing.assert_close(out, a.to(dtype).float() @ b.to(dtype).float(), rtol=1e-6, atol=1e-5)


def check_loader():
    """The Triton kernels load where ``import mamba_ssm`` fails on its C++ extension (this
    install: MAMBA_SKIP_CUDA_BUILD), and ``import mamba_ssm`` afterwards fails as before."""
    import importlib

    from hybridtrain.models.nemotron_h import kernels

    fresh = subprocess.run([sys.executable, "-c", "import mamba_ssm"], capture_output=True, text=True)
    assert kernels.kernel("ssd_fwd") is not None and kernels.kernel("selective_state_update") is not None
    assert kernels.kernel("ssd_fwd").__module__ == "mamba_ssm.ops.triton.ssd_combined"
    if fresh.returncode == 0:  # a full install: imported normally, nothing skipped
        assert "mamba_ssm" not in kernels._init_skipped
        return
    assert "mamba_ssm" not in sys.modules  # no package shell left behind
    with pytest.raises(ImportError) as e:
        importlib.import_module("mamba_ssm")
    assert str(e.value) in fresh.stderr, (str(e.value), fresh.stderr[-500:])


# -- the tests: the checks in one process started with TRITON_INTERPRET=1 ----------------------
CHECKS = ("check_loader", "check_bf16_dot", "check_mixer_and_decode", "check_compiled")
_RESULTS = "check results: "


def run_checks():
    """Runs every check in this process (one import of torch, triton and mamba_ssm for all);
    prints which failed, with their tracebacks, as one JSON line."""
    import json
    import traceback

    results = {}
    for name in CHECKS:
        try:
            globals()[name]()
            results[name] = None
        except BaseException:  # noqa: BLE001 (reported to the test of that check)
            results[name] = traceback.format_exc()
    print(_RESULTS + json.dumps(results), flush=True)


def _skip_without_kernels():
    for mod in ("triton", "mamba_ssm"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed (make test installs it: see the Makefile's kernel packages)")


@pytest.fixture(scope="module")
def check_results():
    _skip_without_kernels()
    import json

    root = Path(__file__).resolve().parents[2]
    code = "from tests.unit.test_real_kernels import run_checks; run_checks()"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(root / "src"), str(root), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600, env=env)
    line = next((x for x in out.stdout.splitlines() if x.startswith(_RESULTS)), None)
    assert out.returncode == 0 and line is not None, out.stderr[-4000:]
    return json.loads(line[len(_RESULTS):])


def _check(results, name):
    assert results[name] is None, results[name]


def test_triton_kernels_load_without_mamba_ssms_package_init(check_results):
    _check(check_results, "check_loader")


def test_the_interpreters_bf16_dot_multiplies_values(check_results):
    _check(check_results, "check_bf16_dot")


def test_mixer_scan_and_decode_step_match_the_pytorch_path(check_results):
    _check(check_results, "check_mixer_and_decode")


def test_blocks_and_train_step_compile_to_one_graph_each_with_the_kernels(check_results):
    _check(check_results, "check_compiled")


def _finetune_argv(work, *overrides):
    """``hybridtrain finetune``'s arguments for two optimizer steps of squad_tiny (one 128-token
    row each, 2 Mamba heads of 8) in ``work`` (its own tokenizer and data: runs can go
    concurrently)."""
    work.mkdir()
    return ["finetune", "-c", "examples/squad_tiny.yaml",
            "--training.max_steps=2", "--training.global_batch_size=1", "--training.micro_batch_size=1",
            "--packing.pack_size=128", "--model.config.mamba_num_heads=2", "--model.config.mamba_head_dim=8",
            "--validation_dataset=null", "--evaluation=null",
            "--training.ckpt_every_steps=0", "--checkpoint.save_hf_at_end=false", "--metrics.progress_bar=false",
            "--metrics.plot=false", f"--checkpoint.dir={work / 'run'}", f"--tokenizer.out_dir={work / 'tokenizer'}",
            f"--dataset.path.path={work / 'train.json'}", *overrides]


def _losses(work):
    import json

    return [json.loads(line)["loss"] for line in (work / "run" / "training.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_command_line_runs_the_real_kernels_on_the_cpu(tmp_path):
    """``TRITON_INTERPRET=1 hybridtrain finetune ... --training.mamba_kernels=true
    --training.fused_loss=liger``: the log names where each kernel comes from; the losses are
    the PyTorch path's (fp32, 1e-4 relative per step)."""
    _skip_without_kernels()
    if importlib.util.find_spec("liger_kernel") is None:
        pytest.skip("liger-kernel is not installed (make test installs it)")
    from tests.helpers.distributed import run_cli

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])}
    kernels = tmp_path / "kernels"
    cmd = [sys.executable, "-m", "hybridtrain",
           *_finetune_argv(kernels, "--training.mamba_kernels=true", "--training.fused_loss=liger")]
    with open(tmp_path / "stderr.log", "w") as log:  # (a file, not a pipe: nothing waits on a reader)
        proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=log, env=env)
    try:  # meanwhile the PyTorch path, in a process forked from the tests' preloaded server
        run_cli(_finetune_argv(tmp_path / "torch", "--training.mamba_kernels=false",
                               "--training.fused_loss=torch"), 1, root)
        proc.wait(timeout=600)
    finally:
        proc.kill()  # (a no-op for a run that ended)
    log = (tmp_path / "stderr.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    got, want = _losses(kernels), _losses(tmp_path / "torch")
    line = next(x for x in log.splitlines() if "kernel paths: " in x)
    assert "ssd=mamba-ssm" in line and "via hybridtrain::ssd_scan, Triton interpreter" in line, line
    assert "state_update=mamba-ssm" in line and "conv=PyTorch (causal-conv1d is CUDA C++ only)" in line, line
    assert "loss=liger-kernel" in line, line
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-4 * abs(w), (got, want)
