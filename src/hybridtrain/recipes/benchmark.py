"""``hybridtrain benchmark -c RECIPE.yaml``: tokens/s, TFLOPs and MFU of a recipe's training step.

Builds the recipe's model, optimizer and parallel layout as ``finetune`` does, then times full
training steps (forward, backward, clipping, optimizer step) with the trainer's own step. Options
live in the recipe's open ``benchmark:`` section (or ``--benchmark.KEY=VALUE``):

=================  ===========  ===========================================================
key                default      meaning
=================  ===========  ===========================================================
data               synthetic    ``synthetic``: random tokens in rows of ``seq_len``; ``recipe``:
                                the recipe's dataset (tokenizer, packing and batch sizes)
seq_len            (recipe)     synthetic row length; default ``packing.pack_size`` when packing
                                is on, else the dataset's ``seq_length``, else 2048
doc_length         null         synthetic: split each row into documents of this many tokens
                                (the packed-sequence path, ``cu_seqlens``); null: one per row
tokens_per_step    (recipe)     synthetic: rows per step = tokens_per_step / seq_len (per rank,
                                one micro-batch); default global_batch_size/dp * seq_len
warmup_steps       2            steps run before timing
steps              5            timed steps
seq_lengths        [512, 2048,  cost growth: the synthetic measurement repeated at each length
                   8192]        with the same tokens per step ([] to skip)
dtypes             null         compute dtypes to compare (e.g. [float32, bfloat16]); null:
                                ``training.dtype``. Single process only.
profile            false        true or a folder: torch profiler trace (Chrome/Perfetto JSON)
                                of ``profile_steps`` steps after the timed ones
profile_steps      2
measure_peak       false        also measure the device's matmul peak (an n x n matmul) and
                                report MFU against it
output             null         JSON file; null -> ``<checkpoint.dir>/benchmark.json``
=================  ===========  ===========================================================

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

import contextlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from hybridtrain.recipes.finetune import (
    _as_config,
    _build_tokenizer,
    _instantiate_with,
    _main_first,
    _parallelize,
    resolve_dtype,
)
from hybridtrain.training.flops import batch_flops, measure_matmul_peak, peak_tflops
from hybridtrain.training.optim import build_optimizer, param_groups
from hybridtrain.training.rng import seed_all
from hybridtrain.training.step_scheduler import StepScheduler
from hybridtrain.training.trainer import Trainer, TrainStep

logger = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {
    "data": "synthetic",
    "seq_len": None,
    "doc_length": None,
    "tokens_per_step": None,
    "warmup_steps": 2,
    "steps": 5,
    "seq_lengths": [512, 2048, 8192],
    "dtypes": None,
    "profile": False,
    "profile_steps": 2,
    "measure_peak": False,
    "output": None,
}


def _options(cfg, args) -> dict[str, Any]:
    given = cfg.benchmark.to_dict() if cfg.get("benchmark") is not None else {}
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise ValueError(
            f"benchmark: unknown key(s) {unknown} in the `benchmark:` section of {cfg.source_file}; "
            f"known: {sorted(DEFAULTS)}"
        )
    opts = {**DEFAULTS, **given}
    for flag, key in (("profile", "profile"), ("measure_peak", "measure_peak")):
        v = getattr(args, flag, None) if args is not None else None
        if v:
            opts[key] = v
    if opts["data"] not in ("synthetic", "recipe"):
        raise ValueError(f"benchmark.data must be 'synthetic' or 'recipe', got {opts['data']!r}")
    for key in ("warmup_steps", "steps", "profile_steps"):
        if not isinstance(opts[key], int) or opts[key] < (1 if key == "steps" else 0):
            raise ValueError(f"benchmark.{key} must be a {'positive' if key == 'steps' else 'non-negative'} "
                             f"int, got {opts[key]!r}")
    lengths = opts["seq_lengths"] or []
    if not isinstance(lengths, (list, tuple)) or any(not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"benchmark.seq_lengths must be a list of positive ints, got {lengths!r}")
    opts["seq_lengths"] = sorted(lengths)
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
@dataclass
class Setup:
    model: Any
    optimizer: Any
    device: torch.device
    ctx: Any
    plan: Any
    flops_fn: Any
    clip_fn: Any
    grad_clip: float | None
    seed: int
    base_mem: int  # CPU: resident bytes before the model was built


def _measure(setup: Setup, name: str, dataset, make_loader, global_batch_size: int,
             micro_batch_size: int, train_step, peak: float | None, opts: dict,
             profile_dir: str | None) -> dict[str, Any]:
    warmup, steps = opts["warmup_steps"], opts["steps"]
    n_prof = opts["profile_steps"] if profile_dir else 0
    sched = StepScheduler(global_batch_size, micro_batch_size, dp_size=setup.ctx.dp_size,
                          max_steps=warmup + steps + n_prof, num_train_samples=len(dataset),
                          seed=setup.seed, shuffle=False, drop_last=False)
    trainer = Trainer(setup.model, setup.optimizer, None, sched, dataset, make_loader,
                      device=setup.device, grad_clip=setup.grad_clip, dist_ctx=setup.ctx,
                      train_step=train_step, flops_fn=setup.flops_fn, peak_tflops=peak,
                      clip_grad_norm_fn=setup.clip_fn, save_hf_at_end=False, save_ckpt=False)
    batches = sched.train_batches(lambda s: make_loader(dataset, s), len(dataset), setup.ctx.dp_rank)
    for _ in range(warmup):
        trainer.train_one_step(next(batches))
    records = []
    with PeakMemory(setup.device) as mem:
        for _ in range(steps):
            records.append(trainer.train_one_step(next(batches)))
    if n_prof:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if setup.device.type == "cuda" else [])
        with profile(activities=acts, record_shapes=True) as prof:
            for _ in range(n_prof):
                trainer.train_one_step(next(batches))
        os.makedirs(profile_dir, exist_ok=True)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        trace = os.path.join(profile_dir, f"trace_{name}_rank{rank}.json")
        prof.export_chrome_trace(trace)
        logger.info("profiler trace: %s", trace)
    time_s = sum(r["step_time_s"] for r in records)
    tokens = sum(r["num_tokens"] for r in records)
    world = setup.ctx.world_size
    tflops = [r["tflops_per_device"] for r in records]
    tflops_dev = (sum(t * r["step_time_s"] for t, r in zip(tflops, records)) / time_s
                  if None not in tflops else None)
    base = setup.base_mem if setup.device.type != "cuda" else 0
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
    }


# -- the recipe -----------------------------------------------------------------------------
def run(cfg: Any, args: Any = None) -> dict[str, Any]:
    cfg = _as_config(cfg)
    opts = _options(cfg, args)
    from hybridtrain.distributed.init import destroy_distributed, init_distributed

    t = cfg.training
    backend = None if cfg.distributed.backend == "auto" else cfg.distributed.backend
    info = init_distributed(device=None if t.device == "auto" else t.device, backend=backend,
                            timeout_minutes=cfg.distributed.timeout_seconds / 60)
    try:
        return _run(cfg, opts, info.device, info.is_main, info.world_size)
    finally:
        if info.world_size > 1:
            destroy_distributed()


def _default_seq_len(cfg) -> int:
    if cfg.packing.enabled:
        return int(cfg.packing.pack_size)
    if cfg.dataset is not None and cfg.dataset.get("seq_length"):
        return int(cfg.dataset["seq_length"])
    return 2048


def _run(cfg, opts: dict, device: torch.device, is_main: bool, world_size: int) -> dict[str, Any]:
    t = cfg.training
    seed_all(t.seed)
    base_mem = _rss_bytes() if device.type != "cuda" else 0

    tokenizer = _build_tokenizer(cfg, is_main) if opts["data"] == "recipe" else None
    if cfg.model is None:
        raise ValueError(f"the recipe has no model section ({cfg.source_file})")
    torch.manual_seed(t.seed)
    from hybridtrain.config import instantiate

    model = instantiate(cfg.model)
    model_config = getattr(model, "config", None)
    # `auto` depends on the model's width on CPU (as in finetune), so resolve after building it
    hidden = getattr(model_config, "hidden_size", None)
    dtypes = [resolve_dtype(n, device, hidden_size=hidden) for n in (opts["dtypes"] or [t.dtype])]
    dtype_names = [str(dt).replace("torch.", "") for dt in dtypes]
    if tokenizer is not None and model_config is not None and len(tokenizer) > model_config.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but model.config.vocab_size is "
            f"{model_config.vocab_size} ({cfg.model.where()}); raise the model's vocab_size or "
            "use a smaller tokenizer")
    if cfg.peft is not None:
        from hybridtrain.peft.lora import apply_lora

        apply_lora(model, **cfg.peft.to_dict())
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())

    from hybridtrain.training.loss import cross_entropy_sum

    first_autocast = None if dtypes[0] == torch.float32 else dtypes[0]
    plan, ctx = _parallelize(cfg, model, world_size, device, cross_entropy_sum, first_autocast)
    if plan is not None and len(set(dtypes)) > 1:
        raise ValueError("benchmark.dtypes: comparing dtypes needs a single process without a "
                         "parallel plan; run the benchmark once per training.dtype instead")
    if plan is not None:
        model = plan.model
    o = cfg.optimizer
    if "_target_" in o:
        from hybridtrain.config import instantiate as _inst

        optimizer = _inst(o, param_groups(model, o.get("weight_decay", 0.0)))
    else:
        optimizer = build_optimizer(model, lr=o.lr, weight_decay=o.weight_decay, betas=o.betas,
                                    eps=o.eps, implementation=o.implementation, name=o.name)
    flops_fn = (lambda mb: float(batch_flops(model_config, mb))) if model_config is not None else None
    setup = Setup(model, optimizer, device, ctx, plan, flops_fn,
                  plan.clip_grad_norm if plan is not None else None, t.grad_clip, t.seed, base_mem)

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

    out_dir = os.path.abspath(cfg.checkpoint.dir)
    profile_dir = None
    if opts["profile"]:
        profile_dir = opts["profile"] if isinstance(opts["profile"], str) else os.path.join(out_dir, "profile")

    vocab = model_config.vocab_size if model_config is not None else None
    dp = ctx.dp_size
    seq_len = opts["seq_len"] or _default_seq_len(cfg)
    tokens_per_step = opts["tokens_per_step"] or max(1, t.global_batch_size // dp) * seq_len

    def synthetic(L):
        rows = max(1, tokens_per_step // L)
        if vocab is None:
            raise ValueError("benchmark.data=synthetic needs a model with config.vocab_size")
        ds = synthetic_rows(rows * dp * (opts["warmup_steps"] + opts["steps"] + opts["profile_steps"]),
                            L, vocab, opts["doc_length"], seed=t.seed)
        packed = opts["doc_length"] is not None
        loader = lambda d, s: ([_collate_synthetic([d[i] for i in idx], packed) for idx in s])  # noqa: E731
        return ds, loader, rows * dp, rows

    def recipe_data():
        from torch.utils.data import DataLoader

        from hybridtrain.data import build_collator, pack_dataset

        ds = _main_first(is_main, lambda: _instantiate_with(cfg.dataset, tokenizer=tokenizer))
        if cfg.packing.enabled:
            ds = pack_dataset(ds, cfg.packing.pack_size, pad_to_multiple_of=cfg.packing.pad_to_multiple_of)
        collate = build_collator(ds)

        def loader(d, s):
            return DataLoader(d, batch_sampler=s, collate_fn=collate, num_workers=cfg.dataloader.num_workers)

        return ds, loader, t.global_batch_size, t.micro_batch_size

    results = {"model_parameters": n_params, "device": str(device), "world_size": world_size,
               "torch_threads": torch.get_num_threads(), "options": opts,
               "matmul_peak_tflops_measured": peaks_measured or None, "runs": []}
    if device.type == "cuda":
        results["device_name"] = torch.cuda.get_device_name(device)
    for dt, dname in zip(dtypes, dtype_names):
        autocast = None if dt == torch.float32 else dt
        train_step = plan.train_step if plan is not None else TrainStep(autocast_dtype=autocast)
        peak = peak_for(dt)
        ds, loader, gbs, mbs = recipe_data() if opts["data"] == "recipe" else synthetic(seq_len)
        main = _measure(setup, f"{dname}_main", ds, loader, gbs, mbs, train_step, peak, opts, profile_dir)
        main.update(dtype=str(dt), data=opts["data"], peak_tflops=peak,
                    seq_len=seq_len if opts["data"] == "synthetic" else None)
        results["runs"].append(main)
        _print_run(main, is_main)
        for L in opts["seq_lengths"]:
            ds, loader, gbs, mbs = synthetic(L)
            r = _measure(setup, f"{dname}_L{L}", ds, loader, gbs, mbs, train_step, peak, opts, None)
            r.update(dtype=str(dt), data="synthetic", seq_len=L, peak_tflops=peak)
            results["runs"].append(r)
            _print_run(r, is_main)
    results["cost_growth"] = _growth(results["runs"])
    if is_main:
        for line in _growth_lines(results["cost_growth"]):
            print(line, flush=True)
        path = opts["output"] or os.path.join(out_dir, "benchmark.json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=2, default=str)
        print(f"benchmark results: {path}", flush=True)
        results["output"] = path
    return results


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
