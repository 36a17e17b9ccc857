"""The training step as a GPU user runs it, projected from the CPU trace of today's eager step
(``benchmarks/step_anatomy.py``), with the roofline of ``anatomy.Hardware`` calibrated against
the measured H100 profile (``benchmarks/results/h100-nano8-step-2026-11-26.json``).

What changes against the eager PyTorch step, and how each part is priced:

* **the loss**: Liger's fused linear cross-entropy in chunks of ``ops.backend.auto_chunk_size``
  tokens: its three GEMMs (logits, input and weight gradients), one Triton pass that reads and
  rewrites each bf16 logit chunk, the head weight cast to bf16 and its gradient back to fp32.
* **the Mamba scan and conv**: mamba_ssm's SSD kernels (5 launches forward, 10 backward; their
  FLOPs from the layer shapes, their tensor-core work at :data:`TRITON_GEMM_FRACTION` of the
  GEMM rate; their bytes: inputs, outputs, the fp32 chunk states written and read four times and
  the C.B blocks twice, the backward 2.5x the forward) and causal_conv1d (reads and writes its
  input once forward, three times backward).
* **elementwise work inside compiled blocks**: every run of consecutive kernels between two GEMMs
  (or a sort / top-k / cumsum / embedding, which stay as they are) becomes one kernel. It reads
  what the run's first kernel reads and writes what its last one writes (``fused``: the best
  case), or also every intermediate once (``fused, intermediates kept``: inductor keeps what
  backward needs); the two bound the prediction.
* GEMMs (grouped expert GEMMs: the same FLOPs) and the fused AdamW as traced.
* **what the trace leaves out**, priced apart: gradient clipping (the norm reads every fp32
  gradient, the scale reads and writes it: 12 bytes per parameter); the host gaps (each read of
  a device value the step still makes drains the GPU's queue: :data:`HOST_SYNC_MS` each,
  assumed); the SSD and attention at least at published kernel figures
  (:data:`SSD_PUBLISHED_MS`, :data:`FLASH_TFLOPS`), the lower figure in the ``fused`` bound and
  the higher in ``kept``.
* **float8** (``training.float8``): the GEMMs of the Linear layers it converts
  (``hybridtrain.training.float8.plan_float8`` on the model at its real sizes) at twice the
  bf16 rate, plus the casts to float8 (amax and cast of each operand, every step).

Calibration: the H100 ran the traced step's GEMMs at ``gemm`` x their modelled time, AdamW at
``optimizer`` x, and the non-GEMM work outside the loss, scan and optimizer at ``elementwise`` x
(achieved bandwidth below the model's); the projection applies the same factors.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from benchmarks import anatomy

MEASURED_FILE = Path(__file__).resolve().parent / "results" / "h100-nano8-step-2026-11-26.json"
TRITON_GEMM_FRACTION = 0.5  # mamba_ssm's tl.dot work against cuBLAS's rate (assumed, not measured)
GOAL_TFLOPS = 350.0
HOST_SYNC_MS = 0.5  # GPU idle per device read in a step: queue drained, relaunch lead (assumed)
# mamba_ssm's SSD, forward + backward, ms per Mamba layer per 8192 tokens at 64 heads x 64
# (a reading of published figures on 2026-12-05: 6-12 ms for nano8's 4 layers; not measured)
SSD_PUBLISHED_MS = (1.5, 3.0)
FLASH_TFLOPS = (350.0, 250.0)  # FA2-class causal attention on an H100, forward+backward (published)
FLOAT8_SPEEDUP = 2.0  # float8 GEMMs against bf16 on an H100 (the dense peak ratio)
ELEMENTWISE = ("casts", "norms/activations", "MoE routing/permutation", "other")
UNFUSED = {"aten::sort", "aten::argsort", "aten::topk", "aten::cumsum", "aten::embedding",
           "aten::embedding_dense_backward", "aten::nonzero", "aten::multinomial"}


def measured(path: Path = MEASURED_FILE) -> dict:
    """The measured H100 step (``benchmarks/results``): device ms per category and its context."""
    with open(path) as f:
        return json.load(f)


@dataclass(frozen=True)
class Calibration:
    gemm: float
    optimizer: float
    elementwise: float


def calibrate(kernels: list[anatomy.Kernel], hw: anatomy.Hardware, m: dict) -> Calibration:
    """Measured / modelled time of the traced eager step's GEMMs, AdamW and elementwise work."""
    ms = m["profile_ms"]

    def t(pred) -> float:
        return sum(k.seconds(hw) for k in kernels if pred(k)) * 1e3

    gemm_all = t(lambda k: k.name in anatomy.GEMMS)
    gemm_blocks = t(lambda k: k.name in anatomy.GEMMS and k.category == "GEMM + attention")
    gemm = ms["all GEMMs (aten::mm + aten::bmm, the loss's included)"] / gemm_all
    optimizer = ms["optimizer"] / t(lambda k: k.category == "optimizer")
    attention = t(lambda k: k.category == "GEMM + attention" and k.name not in anatomy.GEMMS)
    rest = (m["profile_step_device_ms"] - ms["loss"] - ms["Mamba scan + conv"] - ms["optimizer"]
            - gemm * gemm_blocks - attention)
    return Calibration(gemm, optimizer, rest / t(lambda k: k.category in ELEMENTWISE))


def _fusable(k: anatomy.Kernel) -> bool:
    return k.category in ELEMENTWISE and k.name not in UNFUSED


def fused_runs(kernels: list[anatomy.Kernel], keep_intermediates: bool) -> tuple[float, int]:
    """(bytes moved, kernels) of the elementwise work once each run of consecutive fusable
    kernels is one kernel: the run's first reads and last writes (and every intermediate write
    with ``keep_intermediates``)."""
    runs: list[list[anatomy.Kernel]] = []
    current: list[anatomy.Kernel] = []
    for k in kernels:
        if _fusable(k):
            current.append(k)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    total = 0.0
    for run in runs:
        total += run[0].read_bytes + (sum(k.write_bytes for k in run) if keep_intermediates
                                      else run[-1].write_bytes)
    return total, len(runs)


@dataclass
class Part:
    name: str
    ms: float
    ideal_ms: float  # what the roofline allows this part at best (its GEMMs, unavoidable bytes)


def mamba_kernels_ms(kw: dict, tokens: int, batch: int, hw: anatomy.Hardware) -> tuple[float, float]:
    """(SSD ms, conv ms) of every Mamba layer, forward and backward, with mamba_ssm's SSD and
    causal_conv1d, from the layer shapes."""
    n_layers = kw["hybrid_override_pattern"].count("M")
    nh, hd, g, n, q = (kw["mamba_num_heads"], kw["mamba_head_dim"], kw["n_groups"], kw["ssm_state_size"],
                       kw["chunk_size"])
    chunks = batch * math.ceil(tokens / batch / q)
    flops_fwd = 2.0 * tokens * (q * g * n + q * nh * hd + 2 * nh * hd * n)
    states = chunks * nh * hd * n * 4
    bytes_fwd = (2 * tokens * nh * hd * 2 + 2 * tokens * g * n * 2 + 3 * tokens * nh * 4
                 + 4 * states + 2 * chunks * g * q * q * 4)
    rate = hw.gemm_flops * TRITON_GEMM_FRACTION
    ssd = (max(flops_fwd / rate, bytes_fwd / hw.bandwidth) + 5 * hw.launch_s
           + max(2 * flops_fwd / rate, 2.5 * bytes_fwd / hw.bandwidth) + 10 * hw.launch_s)
    conv_bytes = tokens * (nh * hd + 2 * g * n) * 2  # xBC in bf16
    conv = (2 * conv_bytes + 3 * conv_bytes) / hw.bandwidth + 2 * hw.launch_s
    return n_layers * ssd * 1e3, n_layers * conv * 1e3


def liger_loss_ms(kw: dict, tokens: int, hw: anatomy.Hardware, cal: Calibration) -> tuple[float, float]:
    """(ms, ideal ms: its GEMMs at the roofline) of Liger's fused linear cross-entropy."""
    from hybridtrain.ops.backend import auto_chunk_size

    h, v = kw["hidden_size"], kw["vocab_size"]
    chunks = math.ceil(tokens / auto_chunk_size(v, "cuda"))
    gemm = 3 * 2.0 * tokens * h * v / hw.gemm_flops
    logits = 2 * tokens * v * 2  # the Triton pass reads and rewrites each bf16 logit
    head = 2 * v * h * (4 + 2)  # weight to bf16, its gradient back to fp32
    ms = (gemm * cal.gemm + (logits + head) / hw.bandwidth * cal.elementwise + 4 * chunks * hw.launch_s) * 1e3
    return ms, gemm * 1e3


def meta_model(kw: dict):
    """The model of ``kw`` (``small_moe_config`` arguments) at its real sizes, on the meta device."""
    import torch

    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, small_moe_config

    with torch.device("meta"):
        return NemotronHForCausalLM(small_moe_config(**kw))


def clipping_ms(n_params: int, hw: anatomy.Hardware) -> float:
    """Gradient clipping over fp32 gradients: the norm reads each (4 B), the scale reads and
    writes it (8 B)."""
    return 12.0 * n_params / hw.bandwidth * 1e3


def published_ssd_ms(kw: dict, tokens: int) -> tuple[float, float]:
    """(low, high) ms of every Mamba layer's SSD at :data:`SSD_PUBLISHED_MS`, scaled by tokens
    and heads x head dim."""
    scale = (kw["hybrid_override_pattern"].count("M") * tokens / 8192
             * kw["mamba_num_heads"] * kw["mamba_head_dim"] / (64 * 64))
    return SSD_PUBLISHED_MS[0] * scale, SSD_PUBLISHED_MS[1] * scale


def flash_attention_ms(kw: dict, seq: int, batch: int) -> tuple[float, float]:
    """(low, high) ms of causal attention forward and backward (3.5 x the forward's FLOPs) at
    :data:`FLASH_TFLOPS`."""
    layers = kw["hybrid_override_pattern"].count("*")
    fwd = 4.0 * batch * kw["num_attention_heads"] * seq * seq * kw["head_dim"] / 2 * layers
    return tuple(3.5 * fwd / (r * 1e12) * 1e3 for r in FLASH_TFLOPS)


def float8_gemms(kw: dict, tokens: int) -> tuple[float, float]:
    """(FLOPs, cast bytes) per step of the GEMMs ``training.float8`` converts by default."""
    from hybridtrain.models.spec import model_spec_for
    from hybridtrain.training.float8 import block_names, plan_float8

    model = meta_model(kw)
    plan = plan_float8(model, block_names(model, model_spec_for(model).pipeline.layers(model)))
    flops = cast = 0.0
    for name in plan.converted:
        lin = model.get_submodule(name)
        i, o = lin.in_features, lin.out_features
        flops += 3 * 2.0 * tokens * i * o  # forward, input and weight gradients
        # input and output gradient: amax read, cast read, float8 write (bf16 in); the fp32
        # weight: amax and cast reads, a float8 write, for forward and backward
        cast += tokens * (i + o) * (2 + 2 + 1) + i * o * (4 + 4 + 1) * 2
    return flops, cast


def project(kernels: list[anatomy.Kernel], kw: dict, seq: int, batch: int, hw: anatomy.Hardware,
            model_tflop: float, m: dict | None = None, syncs_per_step: int = 1) -> dict:
    """The projected step: its parts (ms; ``fused`` best case and ``kept``), the calibration,
    the predicted and roofline-ceiling model TFLOP/s and the three largest items between the
    prediction and :data:`GOAL_TFLOPS`."""
    m = measured() if m is None else m
    cal = calibrate(kernels, hw, m)
    tokens = seq * batch

    def t(pred) -> float:
        return sum(k.seconds(hw) for k in kernels if pred(k)) * 1e3

    gemm = t(lambda k: k.category == "GEMM + attention" and k.name in anatomy.GEMMS)
    attention = t(lambda k: k.category == "GEMM + attention" and k.name not in anatomy.GEMMS)
    loss, loss_ideal = liger_loss_ms(kw, tokens, hw, cal)
    ssd, conv = mamba_kernels_ms(kw, tokens, batch, hw)
    optimizer = t(lambda k: k.category == "optimizer")
    unfused = t(lambda k: k.category in ELEMENTWISE and k.name in UNFUSED)
    n_params = sum(p.numel() for p in meta_model(kw).parameters())
    clip = clipping_ms(n_params, hw)
    ssd_pub, attn_pub = published_ssd_ms(kw, tokens), flash_attention_ms(kw, seq, batch)
    f8_flops, f8_cast = float8_gemms(kw, tokens)
    f8_saved = f8_flops / hw.gemm_flops * cal.gemm * (1 - 1 / FLOAT8_SPEEDUP) * 1e3
    f8_casts = f8_cast / hw.bandwidth * cal.elementwise * 1e3
    out = {"calibration": cal, "parts": {}}
    for i, (label, keep) in enumerate((("fused", False), ("kept", True))):
        nbytes, runs = fused_runs(kernels, keep)
        elementwise = (nbytes / hw.bandwidth + runs * hw.launch_s) * 1e3 * cal.elementwise
        parts = [
            Part("GEMMs outside the loss (incl. grouped experts)", gemm * cal.gemm, gemm),
            Part("attention (at least FA2-class published rates)", max(attention, attn_pub[i]),
                 attention),
            Part("loss (Liger fused linear cross-entropy)", loss, loss_ideal),
            Part("elementwise in compiled blocks (fused runs)", elementwise, 0.0),
            Part("sorts / top-k / cumsum / embedding (not fused)", unfused * cal.elementwise, 0.0),
            Part("Mamba SSD (mamba_ssm; at least published figures)", max(ssd, ssd_pub[i]), 0.0),
            Part("Mamba conv (causal_conv1d)", conv, 0.0),
            Part("optimizer (fused AdamW, fp32 masters)", optimizer * cal.optimizer, optimizer),
            Part("gradient clipping (fp32 gradients read, scaled)", clip * cal.optimizer, clip),
            Part("host gaps (device reads left in the step)", syncs_per_step * HOST_SYNC_MS, 0.0),
        ]
        out["parts"][label] = parts
    step = {label: sum(p.ms for p in parts) for label, parts in out["parts"].items()}
    out["step_ms"] = step
    out["tflops"] = {label: model_tflop / (ms * 1e-3) / 1e12 for label, ms in step.items()}
    out["float8"] = {"saved_ms": f8_saved, "casts_ms": f8_casts,
                     "share": f8_flops / (gemm * 1e-3 * hw.gemm_flops) if gemm else 0.0,
                     "tflops": {label: model_tflop / ((ms - f8_saved + f8_casts) * 1e-3) / 1e12
                                for label, ms in step.items()}}
    ideal = sum(p.ideal_ms for p in out["parts"]["fused"])
    out["ceiling_tflops"] = model_tflop / (ideal * 1e-3) / 1e12
    out["goal_ms"] = model_tflop / (GOAL_TFLOPS * 1e12) * 1e3
    mid = {p.name: (a.ms + p.ms) / 2 for a, p in zip(out["parts"]["fused"], out["parts"]["kept"])}
    ideal_of = {p.name: p.ideal_ms for p in out["parts"]["fused"]}
    out["gap_items"] = sorted(((n, ms - ideal_of[n]) for n, ms in mid.items()), key=lambda x: -x[1])[:3]
    return out


def report(p: dict, model_tflop: float, hw: anatomy.Hardware, m: dict | None = None) -> str:
    m = measured() if m is None else m
    cal = p["calibration"]
    lines = [f"== the step as a GPU user runs it (mamba_ssm SSD + causal_conv1d, elementwise work fused in "
             f"compiled blocks, Liger loss), {hw.name}",
             f"calibrated on {m['device']}, {m['date']} at {m['commit']} ({MEASURED_FILE.parent.name}/"
             f"{MEASURED_FILE.name}): GEMMs x{cal.gemm:.2f}, AdamW x{cal.optimizer:.2f}, "
             f"non-GEMM work x{cal.elementwise:.2f} of the modelled time",
             f"{'part':<52}{'fused ms':>10}{'kept ms':>10}{'ideal ms':>10}"]
    for a, b in zip(p["parts"]["fused"], p["parts"]["kept"]):
        lines.append(f"{a.name:<52}{a.ms:>10.1f}{b.ms:>10.1f}{a.ideal_ms:>10.1f}")
    lines.append(f"{'step':<52}{p['step_ms']['fused']:>10.1f}{p['step_ms']['kept']:>10.1f}")
    lines.append(f"predicted nano8 model TFLOP/s on an H100: {p['tflops']['kept']:.0f}-{p['tflops']['fused']:.0f} "
                 f"({model_tflop / 1e12:.2f} TFLOP per step; measured 2026-11-26 on the eager path: "
                 f"{m['benchmark_model_tflops_per_s']['mamba_ssm kernels']:.1f})")
    f8 = p["float8"]
    lines.append(f"predicted with training.float8 (default filter; its GEMMs {f8['share']:.0%} of those "
                 f"outside the loss, at {FLOAT8_SPEEDUP:g}x): {p['float8']['tflops']['kept']:.0f}-"
                 f"{p['float8']['tflops']['fused']:.0f} model TFLOP/s ({f8['saved_ms']:.1f} ms of GEMMs "
                 f"saved, {f8['casts_ms']:.1f} ms of casts added)")
    lines.append(f"roofline ceiling (GEMMs at {hw.gemm_flops / 1e12:.0f} TFLOP/s, AdamW's bytes, nothing else): "
                 f"{p['ceiling_tflops']:.0f} model TFLOP/s")
    lo, hi = p["step_ms"]["fused"], p["step_ms"]["kept"]
    margin = (f"{p['goal_ms'] - hi:.1f}-{p['goal_ms'] - lo:.1f} ms to spare" if hi <= p["goal_ms"]
              else f"{hi - p['goal_ms']:.1f} ms over at worst" if lo <= p["goal_ms"]
              else f"{lo - p['goal_ms']:.1f}-{hi - p['goal_ms']:.1f} ms over")
    lines.append(f"{GOAL_TFLOPS:.0f} TFLOP/s needs a step of {p['goal_ms']:.1f} ms; predicted {lo:.1f}-{hi:.1f} ms "
                 f"({margin}); the three largest items above their ideal (mean of fused and kept):")
    lines += [f"  {ms:6.1f} ms  {name}" for name, ms in p["gap_items"]]
    return "\n".join(lines)
