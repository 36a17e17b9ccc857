"""A trainer over a tiny model and the synthetic SFT data (the training-loop unit tests)."""

from __future__ import annotations

import torch

from hybridtrain.distributed.parallel_plan import ParallelPlan
from hybridtrain.models.spec import set_train_loss
from hybridtrain.ops.loss import LinearCrossEntropy
from hybridtrain.training.checkpoint import Checkpointer
from hybridtrain.training.lr_schedule import LRScheduler
from hybridtrain.training.metrics import MetricsLogger
from hybridtrain.training.optim import build_optimizer
from hybridtrain.training.settings import trainer_settings
from hybridtrain.training.step_scheduler import StepScheduler
from hybridtrain.training.trainer import TrainData, Trainer

from .data import make_loader, sft_dataset
from .models import tiny_model


def train_model(model_fn=tiny_model, seed: int = 0, loss_chunk_size: int | None = 16):
    """``model_fn(seed)`` with the trainer's summing loss installed (as the recipe does)."""
    model = model_fn(seed)
    set_train_loss(model, LinearCrossEntropy(chunk_size=loss_chunk_size, reduction="sum"))
    return model


def build_trainer(out_dir, max_steps=8, gbs=8, mbs=2, ckpt_every=4, lr=3e-3, seed=0,
                  model_fn=tiny_model, train_step=None, val=True, keep_last=None,
                  log_every=1, save_hf_at_end=False, n_train=64):
    torch.manual_seed(seed)
    model = train_model(model_fn, seed)
    opt = build_optimizer(model, lr=lr, weight_decay=0.1)
    sched = StepScheduler(gbs, mbs, max_steps=max_steps, num_train_samples=n_train,
                          ckpt_every_steps=ckpt_every, val_every_steps=4,
                          log_every_steps=log_every, seed=seed)
    lrs = LRScheduler(opt, lr_decay_style="cosine", lr_warmup_steps=2, total_steps=max_steps,
                      min_lr=lr / 10)
    ckpt = Checkpointer(out_dir, keep_last=keep_last) if out_dir else None
    metrics = MetricsLogger(out_dir, progress=False, plot=False) if out_dir else None
    trainer = Trainer(
        ParallelPlan.single(model), opt, lrs, sched,
        TrainData(sft_dataset(n_train), make_loader, val=sft_dataset(10, seed=1) if val else None),
        trainer_settings(checkpoint={"save_hf_at_end": save_hf_at_end}), checkpointer=ckpt,
        metrics=metrics)
    if train_step is not None:  # a step that injects a fault or runs under autocast
        trainer.train_step = train_step
    return trainer
