"""The tiny vision-language recipe for tests: a BPE tokenizer with ``<image>``, synthetic
shapes (images of several sizes, text-only samples mixed in), the tiny VLM; built and trained
by the recipe's own builder and trainer (the layout-parity helpers' batches and loop)."""

from __future__ import annotations

import torch.distributed as dist

from . import parity

IMAGE_TOKEN_ID = 4  # <image>: the first token after the tokenizer's four chat/special tokens


def vlm_recipe(tmp: str, layout: dict | None = None, packed: bool = False,
               freeze: list[str] = (), **sections) -> dict:
    n = 200 if packed else 64
    recipe = {
        "tokenizer": {"_target_": "hybridtrain.data.build_bpe_tokenizer",
                      "texts": {"_target_": "hybridtrain.data.shapes_texts"},
                      "out_dir": f"{tmp}/tokenizer", "vocab_size": 300,
                      "extra_special_tokens": ["<image>"]},
        "model": {"_target_": "hybridtrain.models.nemotron_vlm.build_vlm",
                  "config": {"_target_": "hybridtrain.models.nemotron_vlm.tiny_vlm_config",
                             "image_token_id": IMAGE_TOKEN_ID, "text": {"vocab_size": 320}},
                  "freeze": list(freeze)},
        "dataset": {"_target_": "hybridtrain.data.build_vision_chat_dataset",
                    "path": {"_target_": "hybridtrain.data.write_synthetic_shapes",
                             "out_dir": f"{tmp}/data", "n": n, "seed": 0, "text_only": 0.3},
                    "patch_size": 4, "min_patches": 16, "max_patches": 64},
        "validation_dataset": {"_target_": "hybridtrain.data.build_vision_chat_dataset",
                               "path": {"_target_": "hybridtrain.data.write_synthetic_shapes",
                                        "out_dir": f"{tmp}/val", "n": 16, "seed": 1},
                               "patch_size": 4, "min_patches": 16, "max_patches": 64},
        "packing": {"enabled": packed, "pack_size": 128},
        "distributed": dict(layout or {}),
        "training": {"device": "cpu", "dtype": "float32", "seed": 0, "grad_clip": 1.0,
                     "global_batch_size": parity.GBS, "micro_batch_size": parity.MBS,
                     "max_steps": parity.STEPS},
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "metrics": {"progress_bar": False, "plot": False, "peak_tflops": 1.0},
    }
    for name, values in sections.items():
        recipe.setdefault(name, {}).update(values)
    return recipe


def build(tmp: str, layout: dict | None = None, world: int = 1, packed: bool = False,
          freeze=(), checkpoint_dir: str | None = None):
    """(``Built``, ``Trainer``) of the tiny VLM recipe."""
    from hybridtrain.recipes.finetune import build as build_recipe
    from hybridtrain.recipes.finetune import make_trainer
    from hybridtrain.training.checkpoint import Checkpointer
    from hybridtrain.training.lr_schedule import LRScheduler
    from hybridtrain.training.step_scheduler import StepScheduler

    rank = dist.get_rank() if dist.is_initialized() else 0
    b = build_recipe(vlm_recipe(tmp, layout, packed, freeze), "cpu", is_main=rank == 0,
                     world_size=world)
    t = b.cfg.training
    sched = StepScheduler(t.global_batch_size, t.micro_batch_size, dp_size=b.plan.dims.dp,
                          max_steps=t.max_steps, num_train_samples=len(b.train_ds), seed=t.seed)
    lr = LRScheduler(b.optimizer, **b.cfg.lr_scheduler.to_dict(), total_steps=sched.max_steps,
                     total_samples=sched.max_steps * sched.global_batch_size)
    ck = Checkpointer(checkpoint_dir) if checkpoint_dir else None
    return b, make_trainer(b, sched, lr, ck)


def run(tmp: str, layout: dict | None = None, world: int = 1, packed: bool = False, freeze=()):
    """(per-step losses, full weights on rank 0, validation loss, per-step gradient norms) of
    the tiny VLM recipe."""
    b, trainer = build(tmp, layout, world, packed, freeze)
    losses, norms = parity.train(b, trainer)
    state = parity.gather_state(b.model)
    val = trainer.validate()["val_loss"]
    rank = dist.get_rank() if dist.is_initialized() else 0
    return losses, state if rank == 0 else None, val, norms
