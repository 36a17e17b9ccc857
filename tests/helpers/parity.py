"""Layout parity: the recipe's own builder and trainer under a parallel layout against the
single-process run of the same recipe.

A run: :func:`hybridtrain.training.builder.build` of :func:`recipe` (the tiny 'mixed'
Nemotron-H: Mamba, attention, MLP and MoE layers; fp32, AdamW, ``grad_clip: 1.0``; synthetic
prompt-masked SFT rows through the recipe's data path: unpacked rows of uneven length, or
packed rows of several documents), then the recipe's :func:`~hybridtrain.training.builder.
make_trainer`, fed ``STEPS`` fixed global batches of ``GBS`` rows: each rank passes its
micro-batches (the step scheduler's assignment, collated by the recipe's loader) to
``Trainer.train_one_step``. Returns per-step losses and gradient norms, the final weights and
the validation loss (``Trainer.validate``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from .recipes import tiny_recipe

STEPS = 3  # the second and third steps use AdamW's moments: optimizer state equality shows
SAVE_AT = 1  # checkpoints of the resume tests: two steps after the resume (the second one
# depends on the restored moments and step count)
GBS = 8
MBS = 2
SEQ = 16  # the longest unpacked row; the packed rows' length
LR = 2e-4

_LAYOUT_KEYS = {"dp_replicate": "dp_replicate", "dp_shard": "dp_shard", "pp": "pp", "ep": "ep",
                "tp": "tp", "cp": "cp", "schedule": "pp_schedule", "stages_per_rank": "pp_stages_per_rank",
                "sp": "sequence_parallel", "backward_prefetch": "fsdp_backward_prefetch",
                "reshard": "fsdp_reshard_after_forward", "split": "pp_split_points"}


def recipe(layout: dict, packed: bool, ac: Any = False, **sections) -> dict:
    """The parity recipe under ``layout`` (``pp``, ``ep``, ``dp_replicate``, ``dp_shard``,
    ``schedule``, ``stages_per_rank``, ``split``: the first layer of each stage after the
    first); ``ac``: ``training.activation_checkpointing``; ``sections`` update the recipe's (e.g. ``peft={...}``)."""
    data = ({"n": 160, "min_len": 4, "max_len": 8} if packed
            else {"n": STEPS * GBS, "min_len": 6, "max_len": SEQ})
    training = {"global_batch_size": GBS, "micro_batch_size": MBS, "max_steps": STEPS,
                "activation_checkpointing": ac, **sections.pop("training", {})}
    return tiny_recipe(
        distributed={_LAYOUT_KEYS[k]: v for k, v in layout.items()},
        dataset={"vocab_size": 256, **data, **sections.pop("dataset", {})},
        validation_dataset={"_target_": "tests.helpers.data.sft_dataset", "n": GBS,
                            "vocab_size": 256, "min_len": 6, "max_len": SEQ, "seed": 99},
        packing={"enabled": packed, "pack_size": SEQ, **sections.pop("packing", {})},
        training=training, optimizer={"lr": LR, "weight_decay": 0.1}, **sections)


def build(layout: dict, world: int, packed: bool = False, ac: Any = False,
          checkpoint_dir: str | None = None, **sections):
    """(``Built``, ``Trainer``) of the parity recipe: the recipe's builder and trainer (with a
    ``Checkpointer`` of ``checkpoint_dir`` when given)."""
    from hybridtrain.training.checkpoint import Checkpointer
    from hybridtrain.training.builder import build as build_recipe
    from hybridtrain.training.builder import make_trainer
    from hybridtrain.training.lr_schedule import LRScheduler
    from hybridtrain.training.step_scheduler import StepScheduler

    rank = dist.get_rank() if dist.is_initialized() else 0
    b = build_recipe(recipe(layout, packed, ac, **sections), "cpu", is_main=rank == 0,
                     world_size=world)
    assert len(b.data.train) >= STEPS * GBS, len(b.data.train)
    t = b.cfg.training
    sched = StepScheduler(t.global_batch_size, t.micro_batch_size, dp_size=b.plan.dims.dp,
                          max_steps=t.max_steps, num_train_samples=len(b.data.train), seed=t.seed)
    lr_scheduler = LRScheduler(b.optimizer, **b.cfg.lr_scheduler.to_dict(),
                               total_steps=sched.max_steps,
                               total_samples=sched.max_steps * sched.global_batch_size)
    checkpointer = Checkpointer(checkpoint_dir) if checkpoint_dir else None
    return b, make_trainer(b, sched, lr_scheduler, checkpointer)


class StepSampler:
    """The batch sampler of global batch ``step`` (rows ``step*GBS ..``) for data-parallel rank
    ``dp_rank`` of ``dp``: micro-step i takes ``dp*MBS`` rows, the rank its slice."""

    def __init__(self, step: int, dp_rank: int, dp: int):
        self.step, self.dp_rank, self.dp = step, dp_rank, dp

    def for_rank(self, dp_rank: int) -> "StepSampler":
        return StepSampler(self.step, dp_rank, self.dp)

    def __len__(self) -> int:
        return GBS // (MBS * self.dp)

    def __iter__(self):
        first = self.step * GBS
        for i in range(len(self)):
            yield [first + i * self.dp * MBS + self.dp_rank * MBS + j for j in range(MBS)]


def micro_batches(b, step: int) -> list[dict]:
    """This rank's micro-batches of global batch ``step`` (:class:`StepSampler`), collated by
    the recipe's loader."""
    dims = b.plan.dims
    return list(b.data.make_loader(b.data.train, StepSampler(step, dims.dp_rank, dims.dp)))


def train(b, trainer, start: int = 0, steps: int = STEPS) -> tuple[list[float], list[float]]:
    """``Trainer.train_one_step`` over global batches ``start..start+steps-1``: (per-step
    losses, per-step gradient norms before clipping)."""
    losses, norms = [], []
    for step in range(start, start + steps):
        rec = trainer.train_one_step(micro_batches(b, step))
        assert rec["skipped_steps"] == 0
        losses.append(rec["loss"])
        norms.append(rec["grad_norm"])
    return losses, norms


def full_state(model) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters of this rank's part of the model."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[name] = t.clone()
    return out


def gather_state(model) -> dict[str, torch.Tensor]:
    """Every rank's parameters merged (pipeline stages hold different layers)."""
    local = full_state(model)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return local
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    merged = {}
    for p in parts:
        merged.update(p)
    return merged


def run_layout(layout: dict, world: int, packed: bool, ac: Any = False, **sections):
    """(per-step losses, final full weights (rank 0, else None), validation loss, per-step
    gradient norms) of one layout (``world`` 1: the single-process reference)."""
    b, trainer = build(layout, world, packed, ac, **sections)
    losses, norms = train(b, trainer)
    state = gather_state(b.model)
    val = trainer.validate()["val_loss"]
    rank = dist.get_rank() if dist.is_initialized() else 0
    return losses, state if rank == 0 else None, val, norms


_REFERENCES: dict[str, tuple] = {}


def reference(packed: bool, **sections):
    """The single-process run (the same builder and trainer, world size 1); computed once per
    test process for each ``packed`` and ``sections`` (the test files share it), a copy each
    call."""
    key = repr((packed, sorted(sections.items())))
    if key not in _REFERENCES:
        torch.set_num_threads(1)
        _REFERENCES[key] = run_layout({}, 1, packed, **sections)
    return copy.deepcopy(_REFERENCES[key])


def train_and_save(layout: dict, world: int, path: str, steps: int, packed: bool = False):
    """Train ``steps`` steps under ``layout`` and write the trainer's checkpoint (step_{steps}/)."""
    b, trainer = build(layout, world, packed, checkpoint_dir=path)
    losses, _ = train(b, trainer, steps=steps)
    trainer.save_checkpoint()
    return losses


def resume_and_train(layout: dict, world: int, path: str, packed: bool = False):
    """Resume the trainer from ``path`` (any layout's checkpoint) under ``layout`` and train the
    remaining steps."""
    b, trainer = build(layout, world, packed, checkpoint_dir=path)
    trainer.resume(trainer.checkpointer.latest())
    start = trainer.sched.step
    losses, _ = train(b, trainer, start=start, steps=STEPS - start)
    return losses
