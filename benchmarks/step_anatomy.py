"""Where a GPU training step's time goes, modelled on a CPU (see ``benchmarks/anatomy.py``).

    python benchmarks/step_anatomy.py [RECIPE.yaml] [--scale 16] [--precision both|autocast|bf16_params]
        [--gemm-tflops 700] [--bandwidth-tbs 3] [--launch-us 5] [--small]

Traces one training step of the recipe's model (default ``benchmarks/gpu/nano8.yaml``: Nemotron 3
Nano layer shapes, seq 4096 x batch 2) with ``torch.profiler`` on the CPU, as
the measured H100 profile ran it (bf16, fp32 master weights, every token labelled,
fused AdamW, no clipping), and estimates each operator's GPU time with a roofline. The real model
(30 GB of fp32 weights, gradients and AdamW state) does not fit a developer machine, so the step is
traced twice at reduced sizes, 1/scale and 2/scale of every size-dependent dimension (hidden,
head and state dims, chunk, vocabulary, FFN widths, sequence, the loss chunk; counts of heads,
groups, experts, top-k and rows kept), and each tensor's bytes and each GEMM's FLOPs are carried
to the real sizes by the power of the scale they grow with (``anatomy.extrapolate``). The
per-expert token counts come from random routing and grow only on average as the tokens do.

``--precision`` compares how the bf16 step makes its compute weights: ``autocast`` (today's
single-process path: ``torch.autocast`` over fp32 parameters) and ``bf16_params`` (the FSDP2
``MixedPrecisionPolicy`` path: bf16 copies of the parameters made once per micro-batch,
autocast on top); the casts of each are printed.

Then, for the recipe at its real sizes, the step as a GPU user runs it (``benchmarks/projection.py``:
mamba_ssm's SSD and causal_conv1d, elementwise work fused inside compiled blocks, Liger's loss):
its predicted model TFLOP/s on an H100, the roofline ceiling, and the three largest items between
the prediction and 350 TFLOP/s (and the same prediction with training.float8).

The measured reference: ``benchmarks/results/h100-nano8-step-2026-11-26.json`` (one H100, eager
PyTorch path, 2026-11-26).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks import anatomy  # noqa: E402
from benchmarks import projection  # noqa: E402

# the measured H100 step (benchmarks/results/h100-nano8-step-2026-11-26.json), device ms
_M = projection.measured()["profile_ms"]
MEASURED = {"loss": _M["loss"], "Mamba scan + conv": _M["Mamba scan + conv"], "optimizer": _M["optimizer"],
            "total": projection.measured()["profile_step_device_ms"]}
MEASURED_GEMM_MS = _M["all GEMMs (aten::mm + aten::bmm, the loss's included)"]
MEASURED_COPY_MS = _M["aten::copy_ (1067 calls)"]  # casts and same-dtype copies
MEASURED_NORM_MS = _M["RMSNorm forward + backward"]

SCALED = ("hidden_size", "head_dim", "mamba_head_dim", "ssm_state_size", "chunk_size",
          "intermediate_size", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
          "vocab_size")
SMALL = dict(hidden_size=64, vocab_size=512, n_routed_experts=4, num_experts_per_tok=2,
             mamba_num_heads=4, intermediate_size=64, moe_intermediate_size=32,
             moe_shared_expert_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, n_groups=2, ssm_state_size=16, chunk_size=16, mamba_head_dim=16)


def recipe_model(path: str) -> tuple[dict, int, int]:
    """(model config kwargs, seq_len, micro-batch) of a ``hybridtrain benchmark`` recipe."""
    r = yaml.safe_load(open(path))
    kw = {k: v for k, v in r["model"]["config"].items() if k != "_target_"}
    return kw, int(r["benchmark"]["seq_len"]), int(r["training"]["micro_batch_size"])


def scaled(kw: dict, seq: int, divisor: int) -> tuple[dict, int]:
    out = dict(kw)
    for k in SCALED:
        if k in out:
            if out[k] % divisor:
                raise ValueError(f"{k}={out[k]} is not a multiple of the scale {divisor}")
            out[k] //= divisor
    return out, seq // divisor


def build(kw: dict, loss_chunk: int, device="cpu"):
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, small_moe_config
    from hybridtrain.models.spec import set_train_loss
    from hybridtrain.ops.loss import LinearCrossEntropy

    torch.manual_seed(0)
    with torch.device(device):
        model = NemotronHForCausalLM(small_moe_config(**kw))
    set_train_loss(model, LinearCrossEntropy(chunk_size=loss_chunk, reduction="mean"))
    return model


def make_step(model, ids, precision: str):
    """One bf16 training step, fused AdamW over fp32 masters. ``autocast``: forward + loss under
    ``torch.autocast`` over the fp32 parameters (gradients arrive in fp32 through autocast's
    casts). ``bf16_params``: what FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)`` does on one rank: the fp32 masters cast once into bf16 compute
    parameters, forward and backward in bf16 (autocast on top), each gradient cast once to fp32."""
    if precision == "autocast":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids)
            (loss.loss if hasattr(loss, "loss") else loss).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    masters = [p.detach().clone().requires_grad_() for p in model.parameters()]
    model.to(torch.bfloat16)
    opt = torch.optim.AdamW(masters, lr=1e-4, fused=True)

    def step():
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)  # the bf16 "all-gather" of the fp32 shard
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids)
        (loss.loss if hasattr(loss, "loss") else loss).backward()
        for p, m in zip(model.parameters(), masters):
            m.grad, p.grad = p.grad.float(), None  # the fp32 "reduce-scatter"
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def trace(kw: dict, seq: int, batch: int, loss_chunk: int, precision: str):
    """The kernels of one profiled training step."""
    from torch.profiler import ProfilerActivity, profile

    model = build(kw, loss_chunk)
    ids = torch.randint(0, kw["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    step = make_step(model, ids, precision)
    step()  # warm-up: the optimizer state exists
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as p:
        step()
    return anatomy.kernels_of(p.events())


def anatomy_at_real_size(kw: dict, seq: int, batch: int, scale: int, precision: str):
    from hybridtrain.ops.backend import auto_chunk_size

    loss_chunk = auto_chunk_size(kw["vocab_size"])
    small_kw, small_seq = scaled(kw, seq, scale)
    large_kw, large_seq = scaled(kw, seq, scale // 2)
    k_small = trace(small_kw, small_seq, batch, loss_chunk // scale, precision)
    k_large = trace(large_kw, large_seq, batch, loss_chunk // (scale // 2), precision)
    return anatomy.extrapolate(k_small, k_large, scale / 2)


def report(kernels, hw: anatomy.Hardware, reference: bool) -> None:
    print(anatomy.table(kernels, hw, MEASURED if reference else None))
    gemm = sum(k.seconds(hw) for k in kernels if k.name in anatomy.GEMMS) * 1e3
    copies = [k for k in kernels if k.name == "aten::copy_"]
    norm = sum(k.seconds(hw) for k in kernels if k.category == "norms/activations") * 1e3
    n, b = anatomy.casts(kernels)
    where: dict = {}
    for k in kernels:
        if k.cast:
            w = where.setdefault(k.category, [0, 0])
            w[0], w[1] = w[0] + 1, w[1] + k.bytes
    print(f"casts (dtype-changing copies, every context): {n} kernels, {b / 1e9:.2f} GB, "
          f"{sum(k.seconds(hw) for k in kernels if k.cast) * 1e3:.1f} ms; by where they run: "
          + ", ".join(f"{c} {m} / {v / 1e9:.1f} GB" for c, (m, v) in where.items()))
    print("casts by call site (biggest first):\n" + anatomy.cast_sites(kernels))
    if reference:
        print(f"all GEMM ops (the loss's included): est. {gemm:.1f} ms vs measured "
              f"{MEASURED_GEMM_MS:.1f} ms (aten::mm + bmm) {anatomy._err(gemm, MEASURED_GEMM_MS)}")
        cms = sum(k.seconds(hw) for k in copies) * 1e3
        print(f"all copy_ kernels: {len(copies)}, est. {cms:.1f} ms vs measured {MEASURED_COPY_MS:.1f} ms"
              f" in 1067 calls {anatomy._err(cms, MEASURED_COPY_MS)}")
        print(f"norms/activations: est. {norm:.1f} ms; measured RMSNorm fwd+bwd alone "
              f"{MEASURED_NORM_MS:.1f} ms")


def print_projection(kernels, kw: dict, seq: int, batch: int, hw: anatomy.Hardware) -> dict:
    """The step as a GPU user runs it, projected from ``kernels`` (``benchmarks/projection.py``)."""
    from hybridtrain.models.nemotron_h import small_moe_config
    from hybridtrain.models.nemotron_h.flops import model_flops

    flop = model_flops(small_moe_config(**kw), [[seq]] * batch)
    p = projection.project(kernels, kw, seq, batch, hw, flop)
    print("\n" + projection.report(p, flop, hw))
    return p


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", nargs="?", default=str(HERE / "gpu" / "nano8.yaml"))
    ap.add_argument("--scale", type=int, default=16, help="trace at 1/scale and 2/scale of the sizes")
    ap.add_argument("--precision", default="autocast", choices=("autocast", "bf16_params", "both"))
    ap.add_argument("--gemm-tflops", type=float, default=700.0)
    ap.add_argument("--bandwidth-tbs", type=float, default=3.0)
    ap.add_argument("--launch-us", type=float, default=5.0)
    ap.add_argument("--small", action="store_true", help="tiny shapes, one trace, no extrapolation")
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    hw = anatomy.Hardware(a.gemm_tflops * 1e12, a.bandwidth_tbs * 1e12, a.launch_us * 1e-6,
                          f"{a.gemm_tflops:g} TFLOP/s, {a.bandwidth_tbs:g} TB/s, {a.launch_us:g} us/launch")
    kw, seq, batch = recipe_model(a.recipe)
    precisions = ("autocast", "bf16_params") if a.precision == "both" else (a.precision,)
    summary = []
    for precision in precisions:
        if a.small:
            kw_s = {**kw, **SMALL}
            kernels = trace(kw_s, 64, batch, 32, precision)
            where = f"tiny shapes ({a.recipe} with hidden 64, vocab 512, 4 experts; 2 x 64 tokens)"
        else:
            kernels = anatomy_at_real_size(kw, seq, batch, a.scale, precision)
            where = (f"{a.recipe} at its real sizes ({batch} x {seq} tokens), extrapolated from "
                     f"traces at 1/{a.scale} and 2/{a.scale}")
        print(f"\n== step anatomy, precision={precision}: {where}; GPU model: {hw.name}")
        report(kernels, hw, reference=not a.small and precision == "autocast")
        if precision == "autocast" and not a.small:
            print_projection(kernels, kw, seq, batch, hw)
        summary.append((precision, *anatomy.casts(kernels),
                        sum(k.seconds(hw) for k in kernels) * 1e3))
    if len(summary) > 1:
        print("\ncasts per step: " + "; ".join(f"{p}: {n} kernels, {b / 1e9:.2f} GB (step est. "
                                               f"{ms:.1f} ms)" for p, n, b, ms in summary))


if __name__ == "__main__":
    main()
