"""``hybridtrain benchmark -c RECIPE.yaml``: tokens/s, TFLOPs and MFU of a recipe's training step.

Builds the recipe's model, optimizer and parallel layout as ``finetune`` does, then times full
training steps (forward, backward, clipping, optimizer step) with the trainer's own step. Options
live in the recipe's ``benchmark:`` section (or ``--benchmark.KEY=VALUE``); its keys, defaults
and meanings are in ``src/hybridtrain/config/recipe.py`` (``BenchmarkSection``;
docs/recipes/reference.md: the recipe reference).

With ``benchmark.profile`` the traced steps' top operators/kernels by device time (CPU time on
a CPU) are printed after the MFU line, as a table like ``torch.profiler``'s ``key_averages``.

``--profile`` / ``--measure-peak`` given to the command line (when the CLI passes them) mean
the same as the keys.

Memory: on CUDA, ``torch.cuda.max_memory_allocated`` over the timed steps (reset before them).
On CPU there is no allocator counter, so the figure is the peak resident set size of the process
sampled every 2 ms during the timed steps, less the resident size before the model was built:
weights, gradients, optimizer state and activations, plus whatever the C allocator keeps. It is
comparable between the measurements of one run (lengths are run shortest first), not exact.
FLOPs follow :mod:`hybridtrain.training.flops` (training = 3 x forward, causal attention per
document, the LM head on label tokens); MFU is against the data-sheet peak of the GPU for the dtype, or on CPU the measured
matmul peak of the dtype.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from typing import Any

import torch

from hybridtrain.config.sections import BenchmarkSection, recipe_config
from hybridtrain.distributed.init import process_group
from hybridtrain.fileio import atomic_write
from hybridtrain.ops.backend import configure_backend, kernel_paths, kernel_paths_line
from hybridtrain.runfolder import run_folder_path
from hybridtrain.distributed.parallel_plan import ParallelPlan, recipe_seq_len
from hybridtrain.training.builder import Built, build
from hybridtrain.training.flops import Throughput, measure_matmul_peak, peak_tflops
from hybridtrain.models.spec import Decoding
from hybridtrain.training.precision import autocast_context, autocast_dtype, resolve_dtype
from hybridtrain.training.preemption import deferred_signals
from hybridtrain.training.settings import trainer_settings
from hybridtrain.training.step_scheduler import StepScheduler
from hybridtrain.training.trainer import TrainData, Trainer

logger = logging.getLogger(__name__)

def _options(cfg, args) -> dict[str, Any]:
    """The ``benchmark:`` section (its defaults when absent), with the command-line flags."""
    opts = (cfg.benchmark or BenchmarkSection()).to_dict()
    for flag, key in (("profile", "profile"), ("measure_peak", "measure_peak")):
        v = getattr(args, flag, None) if args is not None else None
        if v:
            opts[key] = v
    opts["seq_lengths"] = sorted(opts["seq_lengths"] or [])  # (each checked when it loads)
    return opts


# -- memory ---------------------------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """Peak memory over a block: CUDA allocator peak, or on CPU the sampled peak RSS."""

    def __init__(self, device: torch.device, interval_s: float = 0.002):
        self.device, self.interval_s = device, interval_s
        self.peak = 0
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.peak = _rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _rss_bytes())


# -- data -----------------------------------------------------------------------------------
def synthetic_rows(num_rows: int, seq_len: int, vocab_size: int, doc_length: int | None = None,
                   seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Rows of random tokens with next-token labels (the last token of each document has none);
    with ``doc_length`` each row holds documents of that length (the last one shorter), as the
    packing collator lays them out (``cu_seqlens``, restarting ``position_ids``)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    doc = doc_length or seq_len
    for _ in range(num_rows):
        ids = torch.randint(0, vocab_size, (seq_len,), generator=g)
        starts = list(range(0, seq_len, doc))
        ends = starts[1:] + [seq_len]
        labels = torch.full((seq_len,), -100, dtype=torch.long)
        position_ids = torch.empty(seq_len, dtype=torch.long)
        for a, b in zip(starts, ends):
            labels[a:b - 1] = ids[a + 1:b]
            position_ids[a:b] = torch.arange(b - a)
        rows.append({
            "input_ids": ids, "labels": labels, "position_ids": position_ids,
            "attention_mask": torch.ones(seq_len, dtype=torch.long),
            "cu_seqlens": torch.tensor(starts + [seq_len], dtype=torch.int32),
            "num_tokens": torch.tensor(seq_len),
        })
    return rows


def _collate_synthetic(rows: list[dict], packed: bool) -> dict:
    batch = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels", "position_ids",
                                                           "attention_mask")}
    if packed:
        L = rows[0]["input_ids"].shape[0]
        cu = [r["cu_seqlens"][:-1].long() + i * L for i, r in enumerate(rows)]
        batch["cu_seqlens"] = torch.cat(cu + [torch.tensor([len(rows) * L])]).to(torch.int32)
    batch["num_tokens"] = batch["attention_mask"].sum()
    batch["num_label_tokens"] = (batch["labels"] != -100).sum()
    return batch


# -- one measurement ------------------------------------------------------------------------
def _measure(b: Built, plan: ParallelPlan, base_mem: int, name: str, dataset, make_loader,
             global_batch_size: int, micro_batch_size: int, peak: float | None, opts: dict,
             profile_dir: str | None) -> dict[str, Any]:
    """Times ``opts['steps']`` training steps (after the warm-up) of ``b``'s model and optimizer
    as ``plan`` (``b.plan``, at the measured autocast dtype) runs them. ``base_mem``: CPU
    resident bytes before the model was built."""
    warmup, steps = opts["warmup_steps"], opts["steps"]
    n_prof = opts["profile_steps"] if profile_dir else 0
    t = b.cfg.training
    sched = StepScheduler(global_batch_size, micro_batch_size, dp_size=b.plan.dims.dp,
                          max_steps=warmup + steps + n_prof, num_train_samples=len(dataset),
                          seed=t.seed, shuffle=False, drop_last=False)
    trainer = Trainer(plan, b.optimizer, None, sched, TrainData(dataset, make_loader),
                      trainer_settings(t, {"save_hf_at_end": False, "enabled": False}),
                      throughput=Throughput(b.flops_fn, peak), aux_loss=b.aux_loss,
                      expert_load=b.expert_load)
    batches = sched.train_batches(lambda s: make_loader(dataset, s), len(dataset), b.plan.dims.dp_rank)
    for _ in range(warmup):
        trainer.train_one_step(next(batches))
    records = []
    with PeakMemory(b.device) as mem:
        # the steps as a run queues them (the host runs ahead, no wait per step), timed as a
        # whole to the end of the device's work
        t0 = time.perf_counter()
        for _ in range(steps):
            records.append(trainer.step(next(batches)))
        trainer.settle()
        if b.device.type == "cuda":
            torch.cuda.synchronize(b.device)
        time_s = time.perf_counter() - t0
    if n_prof:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if b.device.type == "cuda" else [])
        with profile(activities=acts, record_shapes=True) as prof:
            for _ in range(n_prof):
                trainer.train_one_step(next(batches))
        os.makedirs(profile_dir, exist_ok=True)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        trace = os.path.join(profile_dir, f"trace_{name}_rank{rank}.json")
        prof.export_chrome_trace(trace)
        logger.info("profiler trace: %s", trace)
        top = top_operators(prof, b.device, n_prof)
    tokens = sum(r["num_tokens"] for r in records)
    world = b.plan.dims.world_size
    tflops = [r["tflops_per_device"] for r in records]  # x the step's own time: its TFLOP
    tflops_dev = (sum(t * r["step_time_s"] for t, r in zip(tflops, records)) / time_s
                  if None not in tflops else None)
    base = base_mem if b.device.type != "cuda" else 0
    return {
        "name": name,
        "steps": steps,
        "tokens_per_step": tokens / steps,
        "step_time_s": time_s / steps,
        "tokens_per_s": tokens / time_s,
        "tokens_per_s_per_device": tokens / time_s / world,
        "tflops_per_device": tflops_dev,
        "mfu": tflops_dev / peak if tflops_dev is not None and peak else None,
        # CPU: growth of the resident size over the pre-model baseline (never negative: freed
        # start-up memory can leave the process smaller than the baseline on a tiny model)
        "peak_memory_gb": max(mem.peak - base, 0) / 2**30,
        "loss": records[-1]["loss"],
        "profile": trace if n_prof else None,
        "profile_top": top if n_prof else None,
    }


PROFILE_ROWS = 30


def top_operators(prof, device: torch.device, steps: int) -> str:
    """The profiler's table of the operators and kernels taking the most time, by device time
    on CUDA (CPU time elsewhere), summed over the ``steps`` traced steps."""
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=PROFILE_ROWS, max_name_column_width=60)
    where = "device (CUDA) time" if device.type == "cuda" else "CPU time"
    return f"top {PROFILE_ROWS} operators/kernels by self {where}, {steps} traced step(s):\n{table}"


# -- the recipe -----------------------------------------------------------------------------
def run(cfg: Any, args: Any = None) -> dict[str, Any]:
    cfg = recipe_config(cfg)
    opts = _options(cfg, args)
    with process_group(cfg) as info:
        return _run(cfg, opts, info.device, info.is_main, info.world_size)


def _run(cfg, opts: dict, device: torch.device, is_main: bool, world_size: int) -> dict[str, Any]:
    t = cfg.training
    base_mem = _rss_bytes() if device.type != "cuda" else 0
    names = opts["dtypes"] or [t.dtype]
    b = build(cfg, device, is_main, world_size, data=opts["data"] == "recipe", dtype=names[0])
    # `auto` depends on the model's width on CPU (as in finetune): resolved after building it
    hidden = b.model_config.hidden_size
    dtypes = [b.dtype] + [resolve_dtype(n, device, hidden, t.cpu_bf16) for n in names[1:]]
    dtype_names = [str(dt).replace("torch.", "") for dt in dtypes]
    if world_size > 1 and len(set(dtypes)) > 1:
        raise ValueError("benchmark.dtypes: comparing dtypes needs a single process; run the "
                         "benchmark once per training.dtype instead")

    peaks_measured = {}
    if opts["measure_peak"]:
        for dt in set(dtypes):
            n = 8192 if device.type == "cuda" else 2048
            peaks_measured[str(dt)] = measure_matmul_peak(dt, n=n, iters=10, device=device)

    def peak_for(dt):
        if cfg.metrics.peak_tflops:
            return float(cfg.metrics.peak_tflops)
        if str(dt) in peaks_measured:
            return peaks_measured[str(dt)]
        return peak_tflops(device, dt)

    out_dir = run_folder_path(cfg.checkpoint.dir)
    profile_dir = None
    if opts["profile"]:
        profile_dir = opts["profile"] if isinstance(opts["profile"], str) else os.path.join(out_dir, "profile")

    vocab = b.model_config.vocab_size
    dp = b.plan.dims.dp
    seq_len = opts["seq_len"] or recipe_seq_len(cfg)
    tokens_per_step = opts["tokens_per_step"] or max(1, t.global_batch_size // dp) * seq_len

    def synthetic(L):
        rows = max(1, tokens_per_step // L)
        ds = synthetic_rows(rows * dp * (opts["warmup_steps"] + opts["steps"] + opts["profile_steps"]),
                            L, vocab, opts["doc_length"], seed=t.seed)
        packed = opts["doc_length"] is not None
        loader = lambda d, s: ([_collate_synthetic([d[i] for i in idx], packed) for idx in s])  # noqa: E731
        return ds, loader, rows * dp, rows

    results = {"model_parameters": b.num_params, "device": str(device), "world_size": world_size,
               "torch_threads": torch.get_num_threads(), "options": opts,
               "matmul_peak_tflops_measured": peaks_measured or None, "runs": []}
    if device.type == "cuda":
        results["device_name"] = torch.cuda.get_device_name(device)
    for dt, dname in zip(dtypes, dtype_names):
        configure_backend(device, dt, cpu_allocator=t.cpu_allocator, grouped_mm=t.grouped_mm,
                          fused_loss=t.fused_loss, mamba_kernels=t.mamba_kernels)
        if "kernel_paths" not in results:  # which implementation each part runs
            results["kernel_paths"] = kernel_paths(device)
            if is_main:
                print(kernel_paths_line(results["kernel_paths"]), flush=True)
        plan = dataclasses.replace(b.plan, autocast_dtype=autocast_dtype(dt))
        peak = peak_for(dt)
        if opts["data"] == "recipe":
            ds, loader = b.data.train, b.data.make_loader
            gbs, mbs = t.global_batch_size, t.micro_batch_size
        else:
            ds, loader, gbs, mbs = synthetic(seq_len)
        main = _measure(b, plan, base_mem, f"{dname}_main", ds, loader, gbs, mbs, peak, opts,
                        profile_dir)
        main.update(dtype=str(dt), data=opts["data"], peak_tflops=peak,
                    seq_len=seq_len if opts["data"] == "synthetic" else None)
        results["runs"].append(main)
        _print_run(main, is_main)
        for L in opts["seq_lengths"]:
            ds, loader, gbs, mbs = synthetic(L)
            r = _measure(b, plan, base_mem, f"{dname}_L{L}", ds, loader, gbs, mbs, peak, opts,
                         None)
            r.update(dtype=str(dt), data="synthetic", seq_len=L, peak_tflops=peak)
            results["runs"].append(r)
            _print_run(r, is_main)
    results["decode"] = _decode_table(b, opts, device, is_main)
    results["cost_growth"] = _growth(results["runs"])
    results["dtype_ratios"] = _dtype_ratios(results["runs"])
    if is_main:
        for line in _growth_lines(results["cost_growth"]) + _dtype_lines(results["dtype_ratios"]):
            print(line, flush=True)
        path = opts["output"] or os.path.join(out_dir, "benchmark.json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with deferred_signals():  # written whole, whatever signal comes meanwhile
            atomic_write(path, json.dumps(results, indent=2, default=str))
        print(f"benchmark results: {path}", flush=True)
        results["output"] = path
    return results


DECODE_PROMPT = 64  # tokens of the decoding table's synthetic prompt


def _decode_table(b: Built, opts: dict, device: torch.device, is_main: bool) -> dict | None:
    """``benchmark.decode_tokens``: greedy decoding of one synthetic prompt, plain and with the
    family's self-speculative decoding (the spec's ``Decoding.speculative``), each timed after a
    warm-up run; printed side by side."""
    n, k = opts["decode_tokens"], opts["draft_tokens"]
    if not n:
        return None
    if b.plan.dims.world_size > 1:
        raise ValueError("benchmark.decode_tokens: the decoding table runs in one process; set it "
                         "to 0 under a parallel layout")
    model = b.model
    prompt = torch.randint(0, b.model_config.vocab_size, (1, DECODE_PROMPT),
                           generator=torch.Generator().manual_seed(0)).to(device)
    decoding = b.spec.find(Decoding)
    speculative = decoding.speculative if decoding is not None else None

    def timed(fn):
        fn()  # warm-up
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0

    with autocast_context(b.plan.autocast_dtype, device):
        plain, dt_plain = timed(lambda: model.generate(prompt, max_new_tokens=n, do_sample=False))
        row = {"new_tokens": n, "prompt_tokens": DECODE_PROMPT, "draft_tokens": k,
               "plain_tokens_per_s": n / dt_plain, "speculative_tokens_per_s": None,
               "acceptance_rate": None, "speculative": None}
        try:
            if speculative is None:
                raise ValueError(f"the model family {b.spec.name!r} has no speculative decoding")
            (ids, stats), dt = timed(lambda: speculative(model, prompt, n, k, None))
            assert torch.equal(ids, plain), "speculative decoding changed the greedy tokens"
            row.update(speculative_tokens_per_s=n / dt, acceptance_rate=stats["acceptance_rate"],
                       speculative="mtp")
        except ValueError as e:
            row["speculative"] = f"n/a: {e}"
    if is_main:
        ratio = (row["speculative_tokens_per_s"] / row["plain_tokens_per_s"]
                 if row["speculative_tokens_per_s"] else None)
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
            f"{device.type}, {torch.get_num_threads()} thread(s)"
        print(f"decode on {where} (batch 1, {DECODE_PROMPT}-token prompt, {n} new tokens): "
              f"plain {row['plain_tokens_per_s']:.1f} tokens/s | speculative "
              + (f"mtp k={k} {row['speculative_tokens_per_s']:.1f} tokens/s (x{ratio:.2f}), "
                 f"acceptance {_fmt(row['acceptance_rate'], '.2f')}"
                 if ratio is not None else row["speculative"]), flush=True)
    return row


def _fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def _print_run(r: dict, is_main: bool) -> None:
    if not is_main:
        return
    print(f"{r['name']:>16s}: {_fmt(r['tokens_per_s'], '10.1f')} tokens/s "
          f"({_fmt(r['tokens_per_s_per_device'], '.1f')}/device), "
          f"{_fmt(r['tflops_per_device'], '.3g')} TFLOP/s/device, MFU {_fmt(r['mfu'], '.3f')} "
          f"(peak {_fmt(r.get('peak_tflops'), '.3g')}), peak memory {r['peak_memory_gb']:.2f} GB, "
          f"{r['tokens_per_step']:.0f} tokens/step, {r['step_time_s']:.2f} s/step", flush=True)
    if r.get("profile_top"):
        print(r["profile_top"], flush=True)


def _growth(runs: list[dict]) -> dict[str, list[dict]]:
    """Per dtype: tokens/s and memory at each sequence length, relative to the shortest."""
    by_dtype: dict[str, list[dict]] = {}
    for r in runs:
        if r["name"].endswith("_main"):
            continue
        by_dtype.setdefault(r["dtype"], []).append(r)
    out = {}
    for dt, rs in by_dtype.items():
        rs = sorted(rs, key=lambda r: r["seq_len"])
        ref = rs[0]
        out[dt] = [{
            "seq_len": r["seq_len"],
            "tokens_per_s": r["tokens_per_s"],
            "tokens_per_s_vs_shortest": r["tokens_per_s"] / ref["tokens_per_s"],
            "peak_memory_gb": r["peak_memory_gb"],
            "memory_per_token_vs_shortest": (r["peak_memory_gb"] / r["tokens_per_step"])
                                           / (ref["peak_memory_gb"] / ref["tokens_per_step"])
            if ref["peak_memory_gb"] > 0 else None,
        } for r in rs]
    return out


def _growth_lines(growth: dict) -> list[str]:
    lines = []
    for dt, rows in growth.items():
        lines.append(f"cost growth ({dt}, same tokens per step):")
        for g in rows:
            lines.append(f"  seq_len {g['seq_len']:>6d}: {g['tokens_per_s']:10.1f} tokens/s "
                         f"(x{g['tokens_per_s_vs_shortest']:.2f}), peak memory "
                         f"{g['peak_memory_gb']:.2f} GB")
    return lines


def _dtype_ratios(runs: list[dict]) -> list[dict]:
    """Each measurement of a later dtype against the same measurement of the first dtype:
    tokens/s ratio (e.g. bf16 vs fp32) and MFU of each against its own dtype's matmul peak."""
    first = runs[0]["dtype"] if runs else None
    base = {r["name"].split("_", 1)[1]: r for r in runs if r["dtype"] == first}
    out = []
    for r in runs:
        ref = base.get(r["name"].split("_", 1)[1])
        if r["dtype"] == first or ref is None:
            continue
        out.append({"measurement": r["name"], "dtype": r["dtype"], "vs_dtype": first,
                    "tokens_per_s_ratio": r["tokens_per_s"] / ref["tokens_per_s"],
                    "mfu": r["mfu"], "vs_mfu": ref["mfu"]})
    return out


def _dtype_lines(ratios: list[dict]) -> list[str]:
    return [f"{d['measurement']:>16s}: {d['tokens_per_s_ratio']:.2f}x the tokens/s of "
            f"{d['vs_dtype'].replace('torch.', '')} (MFU {_fmt(d['mfu'], '.3f')} vs "
            f"{_fmt(d['vs_mfu'], '.3f')}, each against its dtype's matmul peak)" for d in ratios]
