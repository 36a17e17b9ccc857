"""``hybridtrain evaluate -c RECIPE [--checkpoint DIR]``: the recipe's ``evaluation:`` (defaults
when it has none) on a checkpoint: answers generated for its validation examples, SQuAD exact
match / F1, sample replies.

``--checkpoint``: a Hugging Face folder, a ``step_N`` checkpoint or a run folder (default: the
recipe's ``checkpoint.dir``, i.e. its latest checkpoint): its export, or, for a step without one,
its sharded checkpoint (read as ``hybridtrain convert`` reads it). The tokenizer is the export's
(the checkpoint's). The record (with the checkpoint's path and step) is printed and appended to
``<checkpoint.dir>/evaluation.jsonl``; replies go to the evaluation's ``samples_file`` there.

With several processes (``--nproc-per-node N`` or torchrun) the model is built under the recipe's
``distributed:`` layout (a model too large for one device), the ``step_N`` checkpoint (written
under any layout) is loaded into it, and the evaluator runs as at validation during training;
the tokenizer is then the recipe's.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from hybridtrain.config.sections import EvaluationSection, RecipeConfig, recipe_config
from hybridtrain.distributed.init import process_group
from hybridtrain.distributed.utils import main_process_first
from hybridtrain.fileio import read_json
from hybridtrain.recipes.generate import open_model
from hybridtrain.runfolder import run_folder_path
from hybridtrain.training.builder import (
    build, build_checkpointer, build_dataset, check_input_paths, make_evaluator,
    resolve_device,
)
from hybridtrain.training.checkpoint_reader import read_checkpoint
from hybridtrain.training.evaluation import evaluator_from_config
from hybridtrain.training.precision import autocast_dtype, resolve_dtype

logger = logging.getLogger(__name__)


def _step_of(step_dir: str) -> int | None:
    state = os.path.join(step_dir, "trainer_state.json")
    try:
        return int(read_json(state).get("step"))
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _write(out_dir: str, rec: dict[str, Any]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "evaluation.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(json.dumps(rec), flush=True)


def _check_step(path: str) -> str:
    """``path`` when it is a ``step_N`` checkpoint (what several processes can load)."""
    if not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise ValueError(f"hybridtrain evaluate with several processes: --checkpoint {path} is not a "
                         "step_N checkpoint or a run folder holding one (no trainer_state.json); "
                         "evaluate a Hugging Face folder in one process (drop --nproc-per-node)")
    return path


def _run_laid_out(cfg: RecipeConfig, checkpoint: str | None) -> dict[str, Any] | None:
    """The evaluation under the recipe's layout (several processes); the record on the main rank.
    The checkpoint is read as :func:`~hybridtrain.training.checkpoint_reader.read_checkpoint` reads it
    (rank 0 chooses the step, every rank pins it; nothing is written into its run folder)."""
    out_dir = run_folder_path(cfg.checkpoint.dir)
    section = cfg.evaluation if cfg.evaluation is not None else EvaluationSection()
    with process_group(cfg) as info:
        b = build(cfg, info.device, info.is_main, info.world_size, data=False, tokenizer=True,
                  evaluation=True)
        checkpointer = build_checkpointer(b, out_dir)
        path, state = read_checkpoint(checkpoint or out_dir, lambda step: (
            step, checkpointer.load(_check_step(step), b.model)))
        val_ds = main_process_first(lambda: build_dataset(
            cfg.validation_dataset, "validation_dataset", tokenizer=b.tokenizer,
            default_split="validation"), info.is_main)
        step = state.get("step")
        rec = {"checkpoint": path, "step": step, **make_evaluator(b, section, val_ds)(b.model, step)}
        if info.is_main:
            _write(out_dir, rec)
        return rec if info.is_main else None


def run(cfg: Any, checkpoint: str | None = None) -> dict[str, Any] | None:
    cfg = recipe_config(cfg)
    if cfg.validation_dataset is None:
        raise ValueError(f"hybridtrain evaluate: the recipe {cfg.source_file} has no validation_dataset")
    check_input_paths(cfg, ("validation_dataset",))  # before the model is loaded
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _run_laid_out(cfg, checkpoint)
    out_dir = run_folder_path(cfg.checkpoint.dir)
    ckpt = checkpoint or out_dir
    flag = "--checkpoint" if checkpoint else "checkpoint.dir"  # what errors name
    device = resolve_device(cfg.training.device)

    def read(path: str):  # the step's number read while the step is pinned
        loaded = open_model(path, device=device, flag=flag)
        return loaded, _step_of(loaded.source if loaded.hf_dir is None
                                else os.path.dirname(loaded.source))

    (model, tokenizer, _, source), step = read_checkpoint(ckpt, read)
    dtype = resolve_dtype(cfg.training.dtype, device, model.config.hidden_size, cfg.training.cpu_bf16)
    val_ds = build_dataset(cfg.validation_dataset, "validation_dataset", tokenizer=tokenizer)
    section = cfg.evaluation if cfg.evaluation is not None else EvaluationSection()
    evaluator = evaluator_from_config(section, val_ds, tokenizer, out_dir, autocast_dtype=autocast_dtype(dtype))
    rec = {"checkpoint": source, "step": step, **evaluator(model, step)}
    _write(out_dir, rec)
    return rec
