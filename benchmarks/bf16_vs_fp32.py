"""bf16 against fp32 training steps, and against transformers' NemotronH under bf16 autocast.

    python benchmarks/bf16_vs_fp32.py [--seq-len 512] [--batch-size 1] [--steps 6] [--rounds 3]
        [--threads N] [--clock wall|cpu] [--malloc-tune] [--strategies] [--json out.json]

One process, one ~48M-parameter MoE Nemotron-H (``small_moe_config()``, ``MEM*EM-E``),
initialised once and saved as a Hugging Face checkpoint that every run loads; identical random
token rows (``batch_size x seq_len``, one document per row) for every run. A step is a full
training step: forward, loss, backward, gradient clipping, AdamW (fp32 state).

Each run is a child process of its own (fresh heap, caches and oneDNN kernel cache, so that one
run's allocations cannot fragment the memory another run gets); the runs take turns over
``--rounds`` rounds, so that load on a shared machine hits all of them alike, and the best step
of each run over all rounds is kept (the median is printed too):

* ``hybridtrain fp32``      -- fp32 weights and compute; chunked linear cross-entropy.
* ``hybridtrain bf16``      -- what ``training.dtype: bf16`` runs: fp32 master weights and AdamW
  state, ``torch.autocast(bf16)``; router, SSD scan, norm statistics and the loss in fp32.
* ``transformers bf16``     -- ``transformers.NemotronHForCausalLM`` (fp32 weights, fused AdamW)
  under the same autocast, loss from fp32 logits (what a TRL user runs).
* ``--strategies`` adds ``hybridtrain bf16 copies`` -- the alternative strategy: bf16 model
  parameters with fp32 master copies in the optimizer (grads copied up, masters copied down).

``--kernel-caches`` times only ``hybridtrain bf16`` against ``hybridtrain bf16 torch caches``,
the same run with torch's default oneDNN kernel caches (1024 entries each) instead of the bound
hybridtrain sets (``hybridtrain.config.dist_env.GEMM_KERNEL_CACHE_ENTRIES``), and their ratio.

``--clock cpu`` times process CPU seconds instead of wall seconds (use with ``--threads 1`` on a
machine shared with other jobs: it is insensitive to time-slicing). ``--malloc-tune`` keeps freed
memory in the process (glibc ``mallopt``: no mmap for large blocks, no trimming) so that the
large per-step buffers are not page-faulted in again every step (hybridtrain.ops.backend allocator
"heap", what `training.cpu_allocator: auto` does on CPU); it applies to all runs.

Prints tokens/s, achieved TFLOP/s and MFU against the measured matmul peak of each run's dtype,
and the ratios: targets bf16 >= 3x fp32, and >= 1.2x transformers bf16.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

TARGETS = {"bf16 / fp32": 3.0, "bf16 / transformers bf16": 1.2}
TORCH_CACHES = "hybridtrain bf16 torch caches"  # torch's 1024 oneDNN kernels per cache


def matmul_peak_cpu_seconds(dtype: torch.dtype, n: int = 2048, iters: int = 5) -> float:
    """TFLOP/s of an n x n matmul per process CPU second (best of ``iters``), per thread."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(iters):
        t0 = time.process_time()
        a @ b
        best = min(best, time.process_time() - t0)
    return 2 * n**3 / best / 1e12 * torch.get_num_threads()


RUNS = ("hybridtrain fp32", "hybridtrain bf16", "transformers bf16")


def build_run(name: str, model_dir: str, batch: dict):
    """The step function of run ``name`` (returns the loss) and the dtype of its matmuls."""
    import transformers

    from hybridtrain.models.nemotron_h import NemotronHForCausalLM
    from hybridtrain.distributed.utils import clip_grad_norm_
    from hybridtrain.training.optim import build_optimizer
    from hybridtrain.training.precision import autocast_context
    from hybridtrain.models.spec import set_train_loss
    from hybridtrain.ops.loss import LinearCrossEntropy
    from hybridtrain.training.trainer import TrainStep

    def loss_sum(model, b):  # the trainer's: the model's own forward with its summing loss
        set_train_loss(model, LinearCrossEntropy(reduction="sum"))
        return TrainStep.loss_sum(model, b)

    ids, labels = batch["input_ids"], batch["labels"]
    n_label = int((labels != -100).sum())

    if name in ("hybridtrain fp32", "hybridtrain bf16"):
        dtype = torch.float32 if name.endswith("fp32") else torch.bfloat16
        model = NemotronHForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
        opt = build_optimizer(model, lr=1e-5)
        params = [p for p in model.parameters() if p.requires_grad]

        def step():  # the trainer's step: clip, then the fused AdamW step
            with autocast_context(dtype, "cpu"):
                ce = loss_sum(model, batch)
            (ce / n_label).backward()
            clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(ce.detach()) / n_label
        return step, dtype

    if name == "hybridtrain bf16 copies":
        model16 = NemotronHForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).train()
        params16 = [p for p in model16.parameters() if p.requires_grad]
        masters = [p.detach().float().requires_grad_() for p in params16]
        opt16 = torch.optim.AdamW(masters, lr=1e-5, fused=True)

        def step_copies():
            ce = loss_sum(model16, batch)
            (ce / n_label).backward()
            for m, p in zip(masters, params16):
                m.grad, p.grad = p.grad.float(), None
            clip_grad_norm_(masters, 1.0)
            opt16.step()
            opt16.zero_grad(set_to_none=True)
            with torch.no_grad():
                torch._foreach_copy_(params16, masters)
            return float(ce.detach()) / n_label
        return step_copies, torch.bfloat16

    assert name == "transformers bf16", name
    with contextlib.redirect_stderr(io.StringIO()):
        hf = transformers.NemotronHForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, fused=True)
    hf_params = list(hf.parameters())

    def step_hf():
        with autocast_context(torch.bfloat16, "cpu"):
            logits = hf(input_ids=ids, use_cache=False).logits
            ce = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                reduction="sum")
        (ce / n_label).backward()
        torch.nn.utils.clip_grad_norm_(hf_params, 1.0)
        hf_opt.step()
        hf_opt.zero_grad(set_to_none=True)
        return float(ce.detach()) / n_label
    return step_hf, torch.bfloat16


def run_child(spec: dict) -> dict:
    """One run in this process: warm-up steps, then ``steps`` timed steps."""
    from hybridtrain.config.dist_env import gemm_kernel_cache_defaults
    from hybridtrain.ops.backend import configure_backend

    gemm_kernel_cache_defaults()  # as a run does (the torch caches' run sets its own)
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    # what the recipe does for a run of this dtype (GEMM row alignment for bf16), and the allocator
    configure_backend("cpu", torch.float32 if spec["name"].endswith("fp32") else torch.bfloat16,
                      cpu_allocator="heap" if spec["malloc_tune"] else "system")
    clock = time.process_time if spec["clock"] == "cpu" else time.perf_counter
    batch = torch.load(spec["batch"], weights_only=True)
    name = "hybridtrain bf16" if spec["name"] == TORCH_CACHES else spec["name"]
    step, _ = build_run(name, spec["model_dir"], batch)
    times, losses = [], []
    for i in range(spec["warmup"] + spec["steps"]):
        t0 = clock()
        losses.append(step())
        if i >= spec["warmup"]:
            times.append(clock() - t0)
    return {"times": times, "losses": losses}


def launch(spec: dict, workdir: str) -> dict:
    path = Path(workdir) / "spec.json"
    path.write_text(json.dumps(spec))
    env = dict(os.environ)
    if spec["name"] == TORCH_CACHES:
        env.update(ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024", LRU_CACHE_CAPACITY="1024")
    out = subprocess.run([sys.executable, __file__, "--child", str(path)], capture_output=True, text=True,
                         check=False, env=env)
    if out.returncode != 0:
        raise SystemExit(f"run {spec['name']!r} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=6, help="timed steps per run and round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per run and round (kernel caches, heap)")
    p.add_argument("--rounds", type=int, default=3, help="child processes per run, taking turns")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--malloc-tune", action="store_true")
    p.add_argument("--strategies", action="store_true", help="also time bf16 params + fp32 masters")
    p.add_argument("--kernel-caches", action="store_true",
                   help="only bf16, against bf16 with torch's default oneDNN kernel caches")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(json.loads(Path(args.child).read_text()))))
        return {}

    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, small_moe_config
    from hybridtrain.models.nemotron_h.flops import model_flops
    from hybridtrain.training.flops import measure_matmul_peak
    from hybridtrain.ops.backend import cpu_has_native_bf16

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = small_moe_config()
    B, L = args.batch_size, args.seq_len
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, cfg.vocab_size, (B, L), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)  # shifted, as the data layer
    flops = model_flops(cfg, [[L]] * B, training=True)
    if args.clock == "wall":
        peaks = {dt: measure_matmul_peak(name) for dt, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))}
    else:
        peaks = {dt: matmul_peak_cpu_seconds(dt) for dt in (torch.float32, torch.bfloat16)}
    names = list(RUNS) + (["hybridtrain bf16 copies"] if args.strategies else [])
    if args.kernel_caches:
        names = ["hybridtrain bf16", TORCH_CACHES]
    dtypes = {n: torch.float32 if n.endswith("fp32") else torch.bfloat16 for n in names}

    times = {name: [] for name in names}
    losses = {}
    with tempfile.TemporaryDirectory(prefix="bf16_vs_fp32_") as tmp:
        torch.manual_seed(args.seed)
        model = NemotronHForCausalLM(cfg)
        n_params = model.num_parameters()
        model.save_pretrained(tmp)
        del model
        torch.save({"input_ids": ids, "labels": labels}, Path(tmp) / "batch.pt")
        spec = {"model_dir": tmp, "batch": str(Path(tmp) / "batch.pt"), "threads": args.threads,
                "clock": args.clock, "malloc_tune": args.malloc_tune, "warmup": args.warmup, "steps": args.steps}
        for _ in range(args.rounds):
            for name in names:
                out = launch({**spec, "name": name}, tmp)
                times[name] += out["times"]
                losses.setdefault(name, out["losses"])
    _, why = cpu_has_native_bf16()
    print(f"small_moe_config: {n_params / 1e6:.1f}M parameters; {B} x {L} tokens; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; clock {args.clock}; malloc tune {args.malloc_tune}; bf16: {why}; "
          f"matmul peak fp32 {peaks[torch.float32]:.3f} / bf16 {peaks[torch.bfloat16]:.3f} TFLOP/s; "
          f"{args.rounds} rounds x {args.steps} steps per run, each round a fresh process")

    res = {}
    for name in names:
        dtype = dtypes[name]
        best = min(times[name])
        median = sorted(times[name])[len(times[name]) // 2]
        tflops = flops / best / 1e12
        res[name] = {"tokens_per_s": B * L / best, "best_step_s": best, "median_step_s": median,
                     "median_tokens_per_s": B * L / median, "tflops": tflops, "mfu": tflops / peaks[dtype],
                     "losses": losses[name]}
        print(f"  {name:24s} {res[name]['tokens_per_s']:8.1f} tokens/s  best step {best:.3f} s  "
              f"(median {median:.3f})  {tflops:.3f} TFLOP/s  MFU {res[name]['mfu']:.1%} of the "
              f"{str(dtype).removeprefix('torch.')} matmul peak  loss {losses[name][0]:.4f} -> {losses[name][-1]:.4f}")
    ratios = {}
    for key in ("tokens_per_s", "median_tokens_per_s"):
        tps = {k: v[key] for k, v in res.items()}
        suffix = "" if key == "tokens_per_s" else " (medians)"
        if args.kernel_caches:
            ratios["bf16 / bf16 torch caches" + suffix] = tps["hybridtrain bf16"] / tps[TORCH_CACHES]
            continue
        ratios["bf16 / fp32" + suffix] = tps["hybridtrain bf16"] / tps["hybridtrain fp32"]
        ratios["bf16 / transformers bf16" + suffix] = tps["hybridtrain bf16"] / tps["transformers bf16"]
        if "hybridtrain bf16 copies" in tps:
            ratios["bf16 copies / fp32" + suffix] = tps["hybridtrain bf16 copies"] / tps["hybridtrain fp32"]
    for k, v in ratios.items():
        t = TARGETS.get(k)
        print(f"  {k:36s} {v:5.2f}x" + (f"   (target >= {t}x: {'met' if v >= t else 'MISSED'})" if t else ""))
    print(f"  load average {os.getloadavg()[0]:.1f}")
    out = {"args": vars(args), "params": n_params, "flops_per_step": flops, "peaks_tflops":
           {str(k): v for k, v in peaks.items()}, "runs": res, "ratios": ratios, "loadavg": os.getloadavg()[0]}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
