"""``hybridtrain evaluate -c RECIPE [--checkpoint DIR]``: the recipe's ``evaluation:`` (defaults
when it has none) on a checkpoint: answers generated for its validation examples, SQuAD exact
match / F1, sample replies.

``--checkpoint``: a Hugging Face folder, a ``step_N`` checkpoint or a run folder (default: the
recipe's ``checkpoint.dir``, i.e. its latest checkpoint). The tokenizer is the export's. The
record (with the checkpoint's path and step) is printed and appended to
``<checkpoint.dir>/evaluation.jsonl``; replies go to the evaluation's ``samples_file`` there.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from hybridtrain.config import ConfigNode
from hybridtrain.config.schema import section_defaults

logger = logging.getLogger(__name__)


def _step_of(hf_dir: str) -> int | None:
    state = os.path.join(os.path.dirname(hf_dir), "trainer_state.json")
    try:
        with open(state) as f:
            return int(json.load(f).get("step"))
    except (OSError, ValueError, TypeError):
        return None


def run(cfg: Any, checkpoint: str | None = None) -> dict[str, Any]:
    from hybridtrain.training.builder import instantiate_with, as_config, resolve_device
    from hybridtrain.recipes.generate import load_model, resolve_export
    from hybridtrain.training.evaluation import evaluator_from_config
    from hybridtrain.training.precision import autocast_dtype, resolve_dtype

    cfg: ConfigNode = as_config(cfg)
    if cfg.validation_dataset is None:
        raise ValueError(f"hybridtrain evaluate: the recipe {cfg.source_file} has no validation_dataset")
    out_dir = os.path.abspath(cfg.checkpoint.dir)
    ckpt = checkpoint or out_dir
    device = resolve_device(cfg.training.device)
    hf_dir, adapter = resolve_export(ckpt)
    model, tokenizer = load_model(ckpt, device=device)
    dtype = resolve_dtype(cfg.training.dtype, device, model.config.hidden_size, cfg.training.cpu_bf16)
    val_ds = instantiate_with(cfg.validation_dataset, tokenizer=tokenizer)
    section = cfg.evaluation if cfg.evaluation is not None else section_defaults("evaluation")
    step = _step_of(adapter or hf_dir)
    evaluator = evaluator_from_config(section, val_ds, tokenizer, out_dir, autocast_dtype=autocast_dtype(dtype))
    rec = {"checkpoint": adapter or hf_dir, "step": step, **evaluator(model, step)}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "evaluation.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(json.dumps(rec), flush=True)
    return rec
