"""``hybridtrain finetune``: compose model, tokenizer, data, optimizer, schedules, checkpoints and
metrics from a recipe, and train.

    from hybridtrain.recipes.finetune import run
    summary = run("examples/squad_tiny.yaml")        # or a loaded ConfigNode, or a dict

The recipe is read once into typed sections (:func:`~hybridtrain.config.sections.recipe_config`).

Order of events: process group (when launched with several ranks) -> start-up checks (layout,
run-folder lock, earlier run or resume point) -> :func:`build` (seeds -> the input files and
folders the recipe names exist -> tokenizer -> model (random init from a config, or ``from_pretrained``) -> LoRA (``peft:``) ->
datasets (+ packing) -> parallel layout -> optimizer) -> step scheduler, LR
scheduler -> checkpointer and resume -> (only now writes: config.yaml, clearing an overwritten
run) train -> final checkpoint with the HF (or PEFT adapter) export and the ``final`` link ->
summary. The parts come from :mod:`hybridtrain.training.builder`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

import torch

from hybridtrain.config.sections import RecipeConfig, recipe_config
from hybridtrain.distributed.init import process_group
from hybridtrain.distributed.hetero import receiver_degrees
from hybridtrain.distributed.layout import parallel_dims_from_config
from hybridtrain.distributed.utils import is_main_process
from hybridtrain.fileio import atomic_write
from hybridtrain.runfolder import NothingToDo, RunLock, run_folder_path
from hybridtrain.training.builder import (
    build, build_checkpointer, build_lr_scheduler, make_trainer,
)
from hybridtrain.training.checkpoint import Checkpointer, check_resumable, nothing_left
from hybridtrain.training.metrics import metrics_logger
from hybridtrain.training.preemption import stopping_at_once
from hybridtrain.training.step_scheduler import StepScheduler
from hybridtrain.training.trainer import Trainer

logger = logging.getLogger(__name__)

# -- the recipe -------------------------------------------------------------------------------
def run(cfg: Any) -> dict[str, Any]:
    """Runs the fine-tuning recipe ``cfg``; returns the summary (also printed by rank 0)."""
    cfg = recipe_config(cfg)
    t_start = time.perf_counter()
    with process_group(cfg) as info:
        return _run(cfg, info.device, info.is_main, info.world_size, t_start)


def _run(cfg: RecipeConfig, device: torch.device, is_main: bool, world_size: int,
         t_start: float) -> dict[str, Any]:
    """Start-up checks, then training. Nothing in the run folder is written before every check
    has passed (only its lock, which goes with the run, and a folder created for it, removed
    again when a check fails)."""
    out_dir = run_folder_path(cfg.checkpoint.dir)
    if cfg.distributed.encoder_ranks:  # the degrees describe the ranks after the encoder's
        receiver_degrees(cfg.distributed, cfg.distributed.encoder_ranks, world_size)
    else:
        parallel_dims_from_config(cfg.distributed, world_size, device.type, build_mesh=False)
    created = is_main and not os.path.exists(out_dir)
    lock = RunLock(out_dir) if is_main else None
    if lock is not None:
        lock.acquire()
    started = False
    try:
        with stopping_at_once(cfg):  # a signal before or after the steps: stop, lock released
            try:
                trainer, sched, checkpointer, clear = _start(cfg, device, is_main, world_size,
                                                             out_dir, t_start)
            except NothingToDo as e:  # said in one line; the run folder is left as it is
                if is_main:
                    print(e, flush=True)
                return {"steps": 0, "nothing_to_do": str(e), "out_dir": out_dir}
            started = True
            return _train(cfg, trainer, sched, checkpointer, clear, is_main, out_dir, t_start)
    finally:
        if lock is not None:
            lock.release()
            if created and not started:
                try:
                    os.rmdir(out_dir)  # only if empty: this run wrote nothing there
                except OSError:
                    pass


def _check_run_folder(cfg: RecipeConfig, out_dir: str) -> tuple[str | None, bool]:
    """(checkpoint to resume or None, whether an earlier run there is to be cleared); refuses
    a folder holding a run that the recipe neither resumes nor overwrites."""
    ck = cfg.checkpoint
    folder = Checkpointer(out_dir)
    resume = folder.resolve_resume(ck.resume)
    if resume is None and ck.resume in ("auto", True) and is_main_process():
        logger.info("checkpoint.resume=auto: %s holds no checkpoint; starting a new run", out_dir)
    clear = resume is None and bool(folder.steps()) and ck.enabled
    if clear and not ck.overwrite:
        raise ValueError(
            f"checkpoint.dir {out_dir} already holds a run "
            f"({', '.join(f'step_{s}' for s in folder.steps())}); set "
            "checkpoint.resume=auto to continue it, choose another checkpoint.dir, or set "
            "checkpoint.overwrite=true to delete it and start over")
    return resume, clear


def _start(cfg: RecipeConfig, device: torch.device, is_main: bool, world_size: int, out_dir: str,
           t_start: float | None = None):
    """Builds everything and checks the run folder (earlier run, resume point); writes nothing
    there. Returns (trainer, step scheduler, checkpointer, whether to clear an earlier run)."""
    t = cfg.training
    resume, clear = _check_run_folder(cfg, out_dir)  # before build writes data or a tokenizer
    done = resume is not None and t.max_steps is not None and nothing_left(resume, t.max_steps)
    if done:
        raise NothingToDo(done)
    b = build(cfg, device, is_main, world_size, train_loop=True, check_model=None if resume is None
              else lambda model, peft: check_resumable(resume, model, peft))
    train_ds = b.data.train

    # step scheduler, LR scheduler
    sched = StepScheduler(
        t.global_batch_size, t.micro_batch_size, dp_size=b.plan.dims.dp, max_steps=t.max_steps,
        num_epochs=t.num_epochs, num_train_samples=len(train_ds),
        val_every_steps=t.val_every_steps, ckpt_every_steps=t.ckpt_every_steps,
        log_every_steps=t.log_every_steps, seed=t.seed, shuffle=cfg.dataloader.shuffle,
        drop_last=cfg.dataloader.drop_last)
    lr_scheduler = build_lr_scheduler(cfg, b.optimizer, sched.max_steps, sched.global_batch_size)

    # checkpoints, metrics, resume
    checkpointer = build_checkpointer(b, out_dir)
    metrics = metrics_logger(cfg, out_dir, is_main)
    trainer = make_trainer(b, sched, lr_scheduler, checkpointer, metrics, started=t_start)
    if resume is not None:
        done = t.max_steps is None and nothing_left(resume, sched.max_steps, t.num_epochs)
        if done:  # the run's length comes from its epochs: known once the data is
            raise NothingToDo(done)
        trainer.resume(resume)
    return trainer, sched, checkpointer, clear


def _train(cfg: RecipeConfig, trainer: Trainer, sched: StepScheduler, checkpointer: Checkpointer,
           clear: bool, is_main: bool, out_dir: str, t_start: float) -> dict[str, Any]:
    """Every check has passed: clear an earlier run (``overwrite``), record the recipe, train."""
    if clear:
        removed = checkpointer.clear()
        if is_main:
            logger.warning("%s held an earlier run: starting a new one there, removed its %s "
                           "(checkpoint.resume: auto continues a run instead)", out_dir,
                           ", ".join(removed))
    if is_main:
        atomic_write(os.path.join(out_dir, "config.yaml"), cfg.to_yaml())
    train_ds, val_ds = trainer.data.train, trainer.data.val
    logger.info("training: %d steps of %d samples (%d micro-batches of %d per rank, %d "
                "data-parallel ranks); %d training samples, %s validation samples",
                sched.max_steps, sched.global_batch_size, sched.grad_acc_steps,
                sched.micro_batch_size, sched.dp_size, len(train_ds),
                len(val_ds) if val_ds is not None else "no")
    summary = trainer.fit()
    summary["out_dir"] = out_dir
    summary["total_time_s"] = time.perf_counter() - t_start
    if is_main:
        print(format_summary(summary, out_dir), flush=True)
    return summary


def _fmt_time(s: float) -> str:
    return f"{int(s // 60)}m{s % 60:04.1f}s" if s >= 60 else f"{s:.1f}s"


def format_summary(summary: dict[str, Any], out_dir: str) -> str:
    def rel(p: str | None) -> str | None:
        return os.path.relpath(p, out_dir) if p else None

    def f(x):
        return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.4f}"

    lines = [
        f"hybridtrain finetune: {summary['steps']} steps in {_fmt_time(summary['total_time_s'])}"
        f" (training {_fmt_time(summary['wall_time_s'])}); loss {f(summary['first_loss'])} -> "
        f"{f(summary['last_loss'])}"
        + (f", validation loss {f(summary['last_val_loss'])}"
           if summary.get("last_val_loss") is not None else "")
        + "".join(f", {name} {summary['last_eval'][k]:.1f}" for k, name in
                  (("exact_match", "exact match"), ("f1", "F1")) if k in (summary.get("last_eval") or {}))
        + (f"; {summary['skipped_steps']} steps skipped" if summary["skipped_steps"] else ""),
        f"outputs in {out_dir}/",
    ]
    entries = []
    for name, what in (("training.jsonl", "per-step metrics"),
                       ("validation.jsonl", "validation metrics"),
                       ("samples.jsonl", "generated replies (evaluation)"), ("loss.png", "loss curve"),
                       ("config.yaml", "the resolved recipe")):
        if os.path.exists(os.path.join(out_dir, name)):
            entries.append((name, what))
    ck = summary.get("checkpoint")
    if ck:
        entries.append((rel(ck) + "/", "checkpoint (resume with --checkpoint.resume=auto)"))
    exp = summary.get("export_dir")
    if exp:
        for sub, what in (("hf", "Hugging Face model + tokenizer"),
                          ("adapter", "PEFT LoRA adapter"), ("merged_hf", "merged HF model")):
            if os.path.isdir(os.path.join(exp, sub)):
                entries.append(((rel(os.path.join(exp, sub)) or sub) + "/", what))
    if os.path.exists(os.path.join(out_dir, "latest")):
        entries.append(("latest", "name of the newest checkpoint"))
    if os.path.islink(os.path.join(out_dir, "final")):
        entries.append(("final/", f"-> {os.readlink(os.path.join(out_dir, 'final'))}: the "
                                  "finished run's export (a path that stays the same)"))
    width = max(len(n) for n, _ in entries) + 2 if entries else 0
    lines += [f"  {n:<{width}}{w}" for n, w in entries]
    return "\n".join(lines)
